"""Benchmark at a realistic shape with random weights: a Qwen3-sized target, a 5-layer drafter.

    python -m experiments.bench.scale [--shape qwen3-0.6b] [--seq-len 2048] [--device cpu]
    python -m experiments.bench.scale --shape qwen3-8b --device cuda --dtype bfloat16   # on a GPU

The target is ``transformers.Qwen3ForCausalLM`` built from a config of the real model's sizes
(:data:`SHAPES`, random init, nothing from the hub), so the numbers are those of the real
architecture at that size, not of its quality (random weights accept nothing; no τ is measured).
What it measures, in one process:

* ``regeneration``: greedy ``generate`` tokens/s (the in-process regeneration backend's call),
  ``--regen-batch`` prompts of ``--prompt-len`` random tokens, ``--new-tokens`` each;
* ``prefill``: one target forward over ``--seq-len`` tokens with hidden states (what the feature
  cache computes once per sequence, and what a speculative run does once per prompt);
* ``train_on_the_fly`` / ``train_cached``: one drafter training step as
  :class:`drafters.DrafterLightningModule` runs it (target forward or cached features, random
  anchors, the 5-layer drafter on every block, the loss, backward, AdamW), wall time and peak memory;
* ``verification``: at a context of ``--seq-len`` cached columns, a target step (1 token), a
  verification step (the block of K+1 = 16 tokens), and the drafter's draft of one block.

Peak memory is the process's peak RSS per phase (Linux ``clear_refs``), or the CUDA allocator's; the
training phases also give the memory at their start (the target, the drafter and what the allocator
kept) and the peak over it, the step's own working memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from drafters import factory
from drafters.storage import write_json_atomic
from drafters.training.blocks import select_blocks
from drafters.training.module import DrafterLightningModule
from drafters.training.optim import warmup_cosine
from experiments.bench import peak_rss_mb, reset_peak_rss
from experiments.pipeline import records
from losses import AcceptanceAlignedLoss
from verify.hf import cache_argument

# Real sizes (the models' config.json), random weights.
_QWEN3 = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
          "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
SHAPES = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
}
OUT = Path("experiments/results/bench/bench_scale.json")




def current_rss_mb() -> float:
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), 0.0)


def make_batch(seq_len: int, prompt_len: int, vocab: int, device: str) -> dict:
    """One sequence of random tokens: ``prompt_len`` prompt, the rest response."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    one = torch.ones(1, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompt_len": one * prompt_len,
            "length": one * seq_len}


def build_target(shape: str, device: str, dtype: torch.dtype):
    """A random ``Qwen3ForCausalLM`` of ``SHAPES[shape]`` on ``device`` in ``dtype``, frozen."""
    config = Qwen3Config(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


class Meter:
    """Wall time and peak memory of one phase (CUDA allocator on a GPU, else the process's RSS)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self):
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.rss_reset = reset_peak_rss()
        self.start_mb = round(torch.cuda.memory_allocated() / 2**20 if self.cuda else current_rss_mb(), 1)
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start  # this process's CPU time (shared machines)
        self.peak_mb = round(torch.cuda.max_memory_allocated() / 2**20 if self.cuda else peak_rss_mb(), 1)


@torch.no_grad()
def bench_regeneration(target, args) -> dict:
    """Greedy generate: every prompt gets exactly ``new_tokens`` (EOS ignored)."""
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (args.regen_batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "max_new_tokens": args.new_tokens,
              "min_new_tokens": args.new_tokens, "pad_token_id": 0}
    with Meter(args.device) as m:
        out = target.generate(ids, **kwargs)
    new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"prompts": args.regen_batch, "prompt_tokens": args.prompt_len, "new_tokens_per_prompt": args.new_tokens,
            "seconds": round(m.seconds, 3), "cpu_seconds": round(m.cpu_seconds, 3),
            "tokens_per_s": round(new / m.seconds, 3), "peak_mb": m.peak_mb}


@torch.no_grad()
def bench_prefill(target, drafter, batch, device: str):
    """One forward over the sequence with hidden states and a cache; returns (report, cache, features)."""
    with Meter(device) as m:
        out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                     use_cache=True, logits_to_keep=1)
    layers = [out.hidden_states[i] for i in drafter.target_layer_ids]
    features = torch.cat(layers, dim=-1).half().float()  # as drafters.training.features stores them (float16)
    tokens = batch["input_ids"].numel()
    report = {"tokens": tokens, "seconds": round(m.seconds, 3), "cpu_seconds": round(m.cpu_seconds, 3),
              "tokens_per_s": round(tokens / m.seconds, 2),
              "peak_mb": m.peak_mb}
    cache = next(v for k, v in out.items() if k in ("cache", "past_key_values"))  # the new name, else the old one
    return report, cache, layers, features


def _module(target, drafter, args):
    return DrafterLightningModule(
        drafter, target, AcceptanceAlignedLoss(), functools.partial(torch.optim.AdamW, lr=6e-4, weight_decay=0.0),
        functools.partial(warmup_cosine, warmup_steps=10, max_steps=1000), num_anchors=args.num_anchors,
    ).to(args.device)


def bench_train(target, drafter, batch, args, steps: int) -> dict:
    """``steps`` drafter training steps (the module's step: context, blocks, loss, backward, AdamW)."""
    module = _module(target, drafter, args)
    optimizer = module.configure_optimizers()["optimizer"]
    mixed = args.device.startswith("cuda") and args.dtype != "float32"
    autocast = torch.autocast("cuda", dtype=getattr(torch, args.dtype), enabled=mixed)
    times = []
    with Meter(args.device) as m:
        for step in range(steps):
            t0 = time.perf_counter()
            with autocast:  # trainer.precision=bf16-mixed on a GPU: float32 weights, bf16 autocast
                states, logits_t = module.context_states(batch, full_logits=False)
                logits, labels, mask, probs = select_blocks(drafter, batch, states, logits_t, args.num_anchors,
                                                            torch.Generator().manual_seed(step))
                loss, _ = module.loss(logits, labels, mask, probs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            m.sync()
            times.append(time.perf_counter() - t0)
    blocks = int(mask.any(-1).sum())
    return {"features": "cached" if "features" in batch else "on_the_fly", "steps": steps,
            "s_per_step": [round(t, 3) for t in times], "cpu_s_total": round(m.cpu_seconds, 3), "blocks_per_step": blocks,
            "supervised_tokens_per_step": int(mask.sum()), "memory_at_start_mb": m.start_mb, "peak_mb": m.peak_mb,
            "peak_over_start_mb": round(m.peak_mb - m.start_mb, 1)}


def _timed(fn, repeats: int, meter: Meter) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        meter.sync()
        t0 = time.perf_counter()
        fn()
        meter.sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def bench_verification(target, drafter, cache, layers, batch, args) -> dict:
    """At ``seq_len`` cached columns: a target step (1 token), a verification step (a block of
    block_size tokens) and the drafter's draft of one block (its context cache filled first)."""
    ids, length = batch["input_ids"], batch["input_ids"].shape[1]
    block = ids[:, -drafter.config.block_size:]
    meter = Meter(args.device)

    def step(tokens):
        pos = torch.arange(length, length + tokens.shape[1], device=ids.device).unsqueeze(0)
        target(input_ids=tokens, position_ids=pos, use_cache=True, logits_to_keep=tokens.shape[1],
               **{cache_argument(target): cache})
        cache.crop(-tokens.shape[1])  # back to `length` columns (transformers 5: a negative count)

    positions = torch.arange(length, device=ids.device).unsqueeze(0)
    drafter.reset(1)
    with meter:
        drafter.extend(ids, batch["attention_mask"], positions, layers)
    extend_s = meter.seconds
    anchor, anchor_pos = ids[:, -1], torch.tensor([length - 1], device=ids.device)
    one = _timed(lambda: step(ids[:, -1:]), args.repeats, meter)
    verify = _timed(lambda: step(block), args.repeats, meter)
    draft = _timed(lambda: drafter.draft(anchor, anchor_pos), args.repeats, meter)
    return {"context": length, "block_size": drafter.config.block_size, "repeats": args.repeats,
            "target_step_s": round(one, 4), "verify_step_s": round(verify, 4), "draft_s": round(draft, 4),
            "verify_over_target_step": round(verify / one, 3),
            "speculative_step_over_target_step": round((verify + draft) / one, 3),
            "drafter_context_extend_s": round(extend_s, 3)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seq-len", type=int, default=2048, help="training sequence and verification context")
    p.add_argument("--prompt-len", type=int, default=64, help="regeneration prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="regeneration tokens per prompt")
    p.add_argument("--regen-batch", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16, help="anchor + K drafted tokens (K = 15)")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--num-anchors", type=int, default=32, help="blocks per training sequence")
    p.add_argument("--train-steps", type=int, default=2, help="timed steps with cached features")
    p.add_argument("--repeats", type=int, default=3, help="verification timings: median of this many")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--note", action="append", default=[], help="a line for the JSON's notes (repeatable)")
    p.add_argument("--out", default=str(OUT))
    return p.parse_args(argv)


def machine(args) -> dict:
    info = {**records.machine(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run(args, argv=None) -> dict:
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    target = build_target(args.shape, args.device, dtype)
    words = sys.argv[1:] if argv is None else argv
    report = {"command": "python -m experiments.bench.scale " + " ".join(words), "machine": machine(args),
              "shape": args.shape, "target_config": SHAPES[args.shape], "dtype": args.dtype,
              "target_parameters": sum(p.numel() for p in target.parameters()),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note")},
              "random_weights": True, "notes": args.note, "build_s": round(time.perf_counter() - start, 1)}
    report["regeneration"] = bench_regeneration(target, args)
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=args.block_size, num_layers=args.drafter_layers)
    drafter.to(args.device)
    report["drafter_parameters"] = sum(p.numel() for p in drafter.parameters())
    batch = make_batch(args.seq_len, args.prompt_len, target.config.vocab_size, args.device)
    report["prefill"], cache, layers, features = bench_prefill(target, drafter, batch, args.device)
    report["verification"] = bench_verification(target, drafter, cache, layers, batch, args)
    del cache, layers
    # on the fly first: the cached step's memory is then measured over the same resident baseline
    report["train_on_the_fly"] = bench_train(target, drafter, batch, args, 1)
    report["train_cached"] = bench_train(target, drafter, {**batch, "features": features}, args, args.train_steps)
    report["total_s"] = round(time.perf_counter() - start, 1)
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args, argv)
    write_json_atomic(args.out, report)
    print(json.dumps({k: report[k] for k in ("regeneration", "prefill", "verification", "train_cached",
                                             "train_on_the_fly", "total_s")}, indent=1))
    print(f"[bench_scale] wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
