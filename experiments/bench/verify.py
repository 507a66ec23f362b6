"""Benchmark of the verifier: this speculative decoder vs transformers' assisted generation.

Same target, same autoregressive assistant (a truncated copy of the target: its first layers), same
prompts, K fixed on both sides, greedy decoding. Reports whether the outputs are identical, tokens/s
at batch 1 against ``target.generate(assistant_model=...)`` (which only supports batch 1), this
verifier's throughput at several batch sizes, and its speedup over target-only decoding with the
same KV-cache code (:func:`verify.target_generate`).

The default target is a random Llama built from config. To make a truncated copy a meaningful
assistant, the residual branches of the layers it lacks are scaled by ``--deep-scale`` (their
output projections), so the deep layers perturb rather than rewrite the early layers' prediction.
``--target PATH`` loads a real model instead (no scaling).

    python -m experiments.bench.verify --out runs/bench_verify.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from drafters.storage import write_json_atomic
from experiments.data.prompts import left_pad
from experiments.pipeline.records import machine
from verify import AssistantDrafter, speculative_generate, target_generate, truncated_copy


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="local Hugging Face model folder (default: random Llama)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--init-range", type=float, default=0.05)
    parser.add_argument("--deep-scale", type=float, default=0.1,
                        help="scale of the output projections of the layers the assistant lacks")
    parser.add_argument("--assistant-layers", type=int, default=1)
    parser.add_argument("--K", type=int, default=4, help="draft tokens per step, on both sides")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt; lengths vary down to half")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench_verify.json")
    return parser.parse_args(argv)


def build_models(args):
    """(target, assistant): the target in eval mode, the assistant its first ``assistant_layers`` layers."""
    if args.target is not None:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    else:
        config = LlamaConfig(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=int(2.6875 * args.hidden_size),
            num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_heads, max_position_embeddings=args.prompt_len + args.max_new_tokens + 64,
            initializer_range=args.init_range, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        torch.manual_seed(args.seed)
        target = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for layer in target.model.layers[args.assistant_layers :]:
                layer.self_attn.o_proj.weight.mul_(args.deep_scale)
                layer.mlp.down_proj.weight.mul_(args.deep_scale)
    target.requires_grad_(False)
    target.generation_config.eos_token_id = None  # fixed-length outputs on both sides
    assistant = truncated_copy(target, args.assistant_layers).requires_grad_(False)
    assistant.generation_config.num_assistant_tokens = args.K
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return target, assistant


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.num_prompts,), generator=generator)
    return [torch.randint(3, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


def timed_interleaved(contenders: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Run every contender once to warm up, then ``repeats`` rounds in turn (so that load from other
    processes hits all of them alike). Returns ({name: last result}, {name: fastest wall seconds},
    {name: fastest CPU seconds of this process}); CPU time is robust to a busy machine when
    ``--threads 1``."""
    results = {name: fn() for name, fn in contenders.items()}
    wall = dict.fromkeys(contenders, float("inf"))
    cpu = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, fn in contenders.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            wall[name] = min(wall[name], time.perf_counter() - start_wall)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    return results, wall, cpu


def contenders(args, target, assistant, prompts: list[list[int]], pad_id: int = 0) -> dict:
    """Name -> a function decoding every prompt: transformers' assisted and greedy generation (one
    row at a time), and per batch size the speculative verifier and target-only decoding."""
    new, drafter = args.max_new_tokens, AssistantDrafter(assistant, args.K)

    def hf(**extra):
        return lambda: [target.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=pad_id,
                                        **extra)[0, len(p):].tolist() for p in prompts]

    def batched(decode, batch_size):
        def run():
            outs = []
            for start in range(0, len(prompts), batch_size):
                ids, mask = left_pad(prompts[start: start + batch_size], pad_id)
                outs.append(decode(ids, mask))
            return outs
        return run

    out = {"hf_assisted": hf(assistant_model=assistant), "hf_greedy": hf()}
    for batch_size in args.batch_sizes:
        out[f"spec_{batch_size}"] = batched(lambda ids, mask: speculative_generate(
            target, drafter, ids, attention_mask=mask, max_new_tokens=new), batch_size)
        out[f"target_{batch_size}"] = batched(lambda ids, mask: target_generate(
            target, ids, attention_mask=mask, max_new_tokens=new), batch_size)
    return out


def batch_results(args, outputs: dict, seconds: dict, cpu_seconds: dict, total_new: int) -> tuple[dict, list]:
    """Per batch size: speeds, τ, accepted-count histogram and token identity with the references;
    and the batch-1 (first batch size) tokens every other output is compared with."""
    results, reference = {}, None
    for batch_size in args.batch_sizes:
        spec_outs, spec_time = outputs[f"spec_{batch_size}"], seconds[f"spec_{batch_size}"]
        target_outs, target_time = outputs[f"target_{batch_size}"], seconds[f"target_{batch_size}"]
        spec_tokens = [t for out in spec_outs for t in out.new_tokens]
        target_tokens = [t for out in target_outs for t in out.new_tokens]
        counts = [c for out in spec_outs for c in out.accepted_counts]
        steps = sum(out.num_target_forwards for out in spec_outs)
        if reference is None:
            reference = spec_tokens
        results[str(batch_size)] = {
            "spec_tokens_per_s": total_new / spec_time,
            "target_tokens_per_s": total_new / target_time,
            "speedup_vs_target_generate": target_time / spec_time,
            "spec_seconds": spec_time,
            "target_seconds": target_time,
            "spec_tokens_per_cpu_s": total_new / cpu_seconds[f"spec_{batch_size}"],
            "target_tokens_per_cpu_s": total_new / cpu_seconds[f"target_{batch_size}"],
            "speedup_vs_target_generate_cpu": cpu_seconds[f"target_{batch_size}"] / cpu_seconds[f"spec_{batch_size}"],
            "tau": total_new / steps,
            "accept_hist": [sum(1 for row in counts for c in row if c == k) for k in range(args.K + 1)],
            "identical_to_target_generate": sum(a == b for a, b in zip(spec_tokens, target_tokens)),
            "identical_to_hf_greedy": sum(a == b for a, b in zip(spec_tokens, outputs["hf_greedy"])),
            "identical_to_batch_1": sum(a == b for a, b in zip(spec_tokens, reference)),
        }
    return results, reference


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, assistant = build_models(args)
    prompts = make_prompts(args, target.get_output_embeddings().weight.shape[0])
    total_new = len(prompts) * args.max_new_tokens
    outputs, seconds, cpu_seconds = timed_interleaved(contenders(args, target, assistant, prompts), args.repeats)
    hf_assisted_tokens, hf_greedy_tokens = outputs["hf_assisted"], outputs["hf_greedy"]
    batches, reference = batch_results(args, outputs, seconds, cpu_seconds, total_new)
    hf_assisted_time, hf_greedy_time = seconds["hf_assisted"], seconds["hf_greedy"]
    first = batches[str(args.batch_sizes[0])]
    results = {
        "batch": batches,
        "config": vars(args),
        "machine": machine(),
        "target_params": sum(p.numel() for p in target.parameters()),
        "assistant_params": sum(p.numel() for p in assistant.parameters()),
        "num_prompts": len(prompts),
        "new_tokens": total_new,
        "hf_assisted_tokens_per_s": total_new / hf_assisted_time,
        "hf_greedy_tokens_per_s": total_new / hf_greedy_time,
        "identical_to_hf_assisted": sum(a == b for a, b in zip(reference, hf_assisted_tokens)),
        "hf_assisted_identical_to_hf_greedy": sum(a == b for a, b in zip(hf_assisted_tokens, hf_greedy_tokens)),
        "hf_assisted_tokens_per_cpu_s": total_new / cpu_seconds["hf_assisted"],
        "hf_greedy_tokens_per_cpu_s": total_new / cpu_seconds["hf_greedy"],
        f"ratio_vs_hf_assisted_at_batch_{args.batch_sizes[0]}": first["spec_tokens_per_s"]
        / (total_new / hf_assisted_time),
        f"ratio_vs_hf_assisted_at_batch_{args.batch_sizes[0]}_cpu": first["spec_tokens_per_cpu_s"]
        / (total_new / cpu_seconds["hf_assisted"]),
    }
    write_json_atomic(args.out, results)
    print(json.dumps({k: v for k, v in results.items() if k != "config"}, indent=2))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
