"""Cost of one speculative step, part by part, against one target-only step (CPU or GPU).

Profiles the real decoding loop (:mod:`experiments.bench.profiling`) on the embedded tiny target with
a freshly initialised 1-layer :class:`drafters.model.DFlashDrafter` (untrained weights cost
what trained ones do; ``--drafter-config layerwise --num-layers 2`` profiles the main job's design) at block size 16 (K = 15) and 8 (K = 7), at batch 1 and 8, on HumanEval
prompts of 185-215 tokens (chat-templated) while each row generates ``--max-new-tokens``: the
first ``--skip`` steps, the prefill and the last step are left out. Greedy, and sampling at the
``--sampled`` temperatures (variants ``*_T1``). Parts: ``draft`` (of which ``draft_states@draft``:
the drafter's layers; its LM head is ``lm_head@draft``), ``target_forward``, ``verify``, ``bookkeeping`` (emitted tokens, EOS and
budget, the Python lists), ``select_rows``, ``crop`` (KV cache crop and the new columns' mask),
``drafter_extend``; ``lm_head@<part>`` is the time in the target's LM head (which the drafter
shares) within that part. Medians of wall (``*_ms``) and of CPU time (``*_cpu_ms``, the table's
unit: robust to other processes on a shared machine at one thread). The break-even τ is the
speculative step's cost over the target-only step's.

Then end to end: tokens/s of greedy speculative decoding (the same drafters; ``--drafter DIR``
adds a trained one, and ``--confidence`` thresholds its confidence-truncated drafts) and of
target-only decoding on the same prompts, interleaved, with τ and the break-even τ = τ / speedup
(prefill included, which dilutes it). A random drafter has τ ≈ 1.

``--label`` names the run inside ``--out``; runs under other labels already in the file are kept. To compare
two versions of the code, run each checkout under its own label into the same file.

    python -m experiments.bench.step --drafter <run>/drafter --confidence 0.4 0.6 0.8 --label main \
        --out runs/bench_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from pathlib import Path

import torch

from drafters import factory
from drafters.policy import DraftingPolicy, PolicyDrafter
from experiments.bench import drafter_factory
from experiments.bench.profiling import (
    TARGET_ONLY,
    Variant,
    break_even,
    end_to_end,
    profile_steps,
)
from experiments.data.prompts import encode_prompt, left_pad
from experiments.data.suites import load_humaneval
from experiments.data.target import TINY_TARGET_DIR, load_target
from experiments.pipeline.paths import portable_path, runs_path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="Hugging Face model folder (default: the embedded tiny target)")
    parser.add_argument("--drafter", default=None,
                        help="a saved drafter, also run end to end (trained_K*); --confidence then applies to it")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--num-layers", type=int, default=1, help="layers of the random drafter")
    parser.add_argument("--drafter-config", default="dflash",
                        help="conf/drafter/ choice of the random drafter (dflash, layerwise: its layers copied from the "
                             "target, which costs what random ones do)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[185, 215], metavar=("MIN", "MAX"),
                        help="HumanEval prompts whose encoded length lies in this range")
    parser.add_argument("--single-prompts", type=int, default=2, help="prompts profiled one by one at batch 1")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens per row of a profiled decode")
    parser.add_argument("--skip", type=int, default=4, help="first steps of a decode left out of the profile")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the step profile")
    parser.add_argument("--sampled", type=float, nargs="*", default=[1.0],
                        help="also profile steps sampling at these temperatures (variants *_T1)")
    parser.add_argument("--e2e-prompts", type=int, default=16, help="prompts of the end-to-end part (0: skip it)")
    parser.add_argument("--e2e-batch-sizes", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--e2e-single-prompts", type=int, default=4, help="prompts of the batch-1 end-to-end runs")
    parser.add_argument("--e2e-new-tokens", type=int, default=64)
    parser.add_argument("--e2e-rounds", type=int, default=3)
    parser.add_argument("--confidence", type=float, nargs="*", default=[],
                        help="also run end to end with drafts truncated at these top-1 probability thresholds")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="run", help="name of this run inside --out")
    parser.add_argument("--out", default="runs/bench_step.json")
    return parser.parse_args(argv)


def humaneval_prompts(tokenizer, low: int, high: int) -> list[list[int]]:
    """Chat-templated HumanEval prompts of ``low..high`` tokens, shortest first (ties by id)."""
    encoded = [(encode_prompt(tokenizer, p.turns[:1], []), p.id) for p in load_humaneval()]
    chosen = sorted((len(ids), pid, ids) for ids, pid in encoded if low <= len(ids) <= high)
    if not chosen:
        raise ValueError(f"no HumanEval prompt has {low}..{high} tokens")
    return [ids for _, _, ids in chosen]


def make_batches(prompts, batch_size: int, count: int, pad_id: int, device) -> list:
    """``count`` prompts (cycled if fewer) in batches of ``batch_size``."""
    chosen = [prompts[i % len(prompts)] for i in range(count)]
    return [left_pad(chosen[i: i + batch_size], pad_id, device) for i in range(0, count, batch_size)]


def random_drafters(args, target, device) -> tuple[dict, dict]:
    """``(drafters, variants)``: a random drafter per block size (seeded alike), each a variant; plus the
    target-only variant."""
    drafters, variants = {}, {TARGET_ONLY: Variant()}
    for block_size in args.block_sizes:
        torch.manual_seed(args.seed)
        name = f"spec_K{block_size - 1}"
        build = drafter_factory(args.drafter_config, [f"drafter.block_size={block_size}",
                                                      f"drafter.num_layers={args.num_layers}"])
        drafters[name] = drafter = build(target).to(device).eval()
        variants[name] = Variant(drafter)
    return drafters, variants


def step_costs(args, target, variants: dict, prompts, pad_id: int, device) -> tuple[dict, dict]:
    """``(steps, batches)``: one step part by part per variant (greedy and at each ``--sampled``
    temperature) and batch size, with the break-even τ."""
    step_variants = dict(variants)
    for temperature in args.sampled:  # the same steps, sampling (q from the drafter, verify_block)
        for name, variant in variants.items():
            step_variants[f"{name}_T{temperature:g}"] = Variant(variant.drafter, variant.generate,
                                                                 temperature=temperature)
    batches = {}
    for batch_size in args.batch_sizes:
        count = args.single_prompts if batch_size == 1 else batch_size
        batches[f"batch_{batch_size}"] = make_batches(prompts, batch_size, count, pad_id, device)
    steps = profile_steps(target, step_variants, batches, args.max_new_tokens, args.rounds, args.skip)
    for summary in steps.values():
        wall, cpu = break_even(summary), break_even(summary, key="total_cpu_ms")
        summary["break_even_tau"], summary["break_even_tau_cpu"] = wall, cpu
    return steps, batches


def end_to_end_runs(args, target, variants: dict, prompts, pad_id: int, device) -> dict:
    """Tokens/s of whole generations per batch size: the variants and a trained ``--drafter`` (and its
    ``--confidence`` thresholds)."""
    if args.e2e_prompts <= 0:
        return {}
    e2e_variants = dict(variants)
    if args.drafter is not None:
        trained = factory.load(args.drafter, target=target).to(device)
        e2e_variants[f"trained_K{trained.num_draft_tokens}"] = Variant(trained)
    for threshold in args.confidence:
        for name, variant in list(e2e_variants.items()):
            if variant.drafter is not None and "/" not in name and "@" not in name and (
                    args.drafter is None or name.startswith("trained")):
                e2e_variants[f"{name}@{threshold:g}"] = Variant(_with_threshold(variant.drafter, threshold))
    e2e = {}
    for batch_size in args.e2e_batch_sizes:
        count = args.e2e_single_prompts if batch_size == 1 else args.e2e_prompts
        e2e[f"batch_{batch_size}"] = end_to_end(
            target, e2e_variants, make_batches(prompts, batch_size, count, pad_id, device),
            args.e2e_new_tokens, args.e2e_rounds)
    return e2e


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    target, tokenizer = load_target(args.target or str(TINY_TARGET_DIR), device=args.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    drafters, variants = random_drafters(args, target, device)
    prompts = humaneval_prompts(tokenizer, *args.prompt_tokens)
    steps, batches = step_costs(args, target, variants, prompts, pad_id, device)
    e2e = end_to_end_runs(args, target, variants, prompts, pad_id, device)
    run = {
        "config": {**vars(args), "drafter": runs_path(args.drafter) if args.drafter else None,  # no machine paths
                   "target": portable_path(args.target) if args.target else None, "out": portable_path(args.out)},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "device": str(device)},
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_params": {n: sum(p.numel() for p in d.parameters()) for n, d in drafters.items()},
        "prompt_tokens": {b: [int(m.sum(1).max()) for _, m in bs] for b, bs in batches.items()},
        "trained_drafter": _drafter_card(args.drafter),
        "step": steps,
        "end_to_end": e2e,
    }
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {}
    results.setdefault("runs", {})[args.label] = run
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(run))
    print(f"wrote {out_path} (run {args.label!r})")
    return run


def _drafter_card(path: str | None) -> dict | None:
    """What a trained drafter is: its training run's summary (steps, data, last validation), if any."""
    if path is None:
        return None
    card = {"path": Path(path).name}  # no machine paths in committed results; the name and overrides retrain it
    summary = Path(path).parent / "train_summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        card.update({k: data[k] for k in ("name", "steps", "train_rows", "overrides") if k in data})
        last = data.get("val") or {}
        if isinstance(last, dict):
            card.update({k: v for k, v in last.items() if k in ("val/tau_greedy", "val/acc_slot1", "val/ce")})
    return card


def _with_threshold(drafter, threshold: float):
    """``drafter`` (its weights, target and other policy settings) truncating drafts at ``threshold``
    (:attr:`drafters.policy.DraftingPolicy.confidence_threshold`)."""
    policy = getattr(drafter, "policy", DraftingPolicy())
    return PolicyDrafter(getattr(drafter, "drafter", drafter), replace(policy, confidence_threshold=threshold))


def format_table(run: dict, suffix: str = "cpu_ms") -> str:
    """The per-part table (ms of CPU time by default) and the end-to-end lines."""
    lines = []
    for batch, summary in run["step"].items():
        names = [n for n in summary if not n.startswith("break_even")]
        parts = sorted({k[: -len(suffix) - 1] for n in names for k in summary[n] if k.endswith("_" + suffix)
                        and not k.endswith("_cpu_" + suffix)})
        lines.append(f"\n{batch}: {suffix} per step (median)")
        lines.append("part".ljust(26) + "".join(n.rjust(20) for n in names))
        for part in parts:
            lines.append(part.ljust(26) + "".join(f"{summary[n].get(f'{part}_{suffix}', 0.0):20.2f}" for n in names))
        key = "break_even_tau_cpu" if suffix == "cpu_ms" else "break_even_tau"
        lines.append("break-even tau".ljust(26) + "".join(
            f"{summary[key][n]:20.2f}" if n in summary[key] else "".rjust(20) for n in names))
    for batch, result in run["end_to_end"].items():
        lines.append(f"\nend to end, {batch}")
        for name, r in result.items():
            line = f"  {name}: {r['tokens_per_s']:.1f} tok/s ({r['tokens_per_cpu_s']:.1f} per CPU s)"
            if "tau" in r:
                line += (f", tau {r['tau']:.2f}, speedup {r['speedup']:.3f} (CPU {r['speedup_cpu']:.3f}), "
                         f"break-even tau {r['break_even_tau']:.2f} (CPU {r['break_even_tau_cpu']:.2f}), "
                         f"identical {r['identical_to_target']}")
            lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
