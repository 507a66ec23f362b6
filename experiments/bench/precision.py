"""Benchmark: float32 against bfloat16 autocast on this machine, interleaved in one process (issue 75).

    python -m experiments.bench.precision [--target PATH] [--rounds 5] [--out runs/bench_precision_bf16.json]

What ``trainer.precision=auto`` (:func:`experiments.pipeline.trainer.resolve_precision`) chooses between, measured
round after round, float32 then bfloat16 in each round, so both see the same load on a shared machine; every figure
is the median over the rounds, every round's value kept beside it:

* ``matmul_gflops``: a plain ``(rows, hidden) @ (hidden, inner)`` matmul at the target's widths (the operands stored
  in the dtype);
* ``step``: the drafter's training step as :class:`drafters.training.module.DrafterLightningModule` runs it under
  Lightning (``precision=32-true`` or ``bf16-mixed``: the step's forward and loss under autocast, backward outside
  it, gradient clipping at 1.0, AdamW; the module's per-slot statistics included) on synthetic batches, in
  blocks/s and s/step (wall) and CPU s/step. The default shape is the long runs' (``conf/experiment/smollm2.yaml``):
  4 answers of 512 tokens (a 128-token prompt), block 8, one drafter layer, 16 anchors per answer, cached features,
  the ``l2r_all`` loss over a training vocabulary of 8,192 ids and 4,096 sampled negatives;
* ``feature_pass``: the target's forward of the feature cache (hidden states, the LM head of the last column only)
  over the same batch, tokens/s.

The default target is the embedded tiny target; the long runs' shape wants SmolLM2 (``--target
$BLOCKDRAFT_CACHE/targets/SmolLM2-135M-Instruct``, converted there by any ``target=smollm2`` job).

Then a short :mod:`torch.profiler` profile of the bfloat16 step (``profile``: the operators with the most self CPU
time, per step) and, with ``--optimizers``, the bfloat16 step again with other AdamW implementations (``foreach``,
``fused``; Lightning refuses a fused optimizer with gradient clipping under ``bf16-mixed``, so ``fused`` is
measured here, not trained with). The record names the CPU and its bfloat16 flags (``machine``); on a CPU without them the
bfloat16 figures are torch's emulation.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import hydra.utils
import torch

from drafters import factory
from drafters.storage import write_json_atomic
from drafters.training.blocks import slot_stats
from drafters.training.module import DrafterLightningModule
from drafters.training.optim import warmup_cosine
from drafters.training.vocab import TrainVocab
from experiments.bench import loss_configs, make_batch, random_target, with_cached_features
from experiments.data.target import TINY_TARGET_DIR, load_target
from experiments.pipeline.paths import portable_value
from experiments.pipeline.records import cpu_model, machine
from experiments.pipeline.trainer import BF16_FLAGS, cpuinfo_flags

PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)


@torch.no_grad()
def matmul_gflops(rows: int, inner: int, outer: int, dtype, reps: int = 5) -> float:
    a = torch.randn(rows, inner).to(dtype or torch.float32)
    b = torch.randn(inner, outer).to(dtype or torch.float32)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * rows * inner * outer / statistics.median(times) / 1e9


class Step:
    """One precision's training step, its drafter, optimizer and batch built once (every round continues them)."""

    def __init__(self, target, args, batch: dict, dtype, optimizer: str = "default"):
        self.dtype, self.args = dtype, args
        self.loss = hydra.utils.instantiate(loss_configs([args.loss])[args.loss])
        torch.manual_seed(0)
        drafter = factory.from_target(target, block_size=args.block_size, num_layers=args.layers)
        kwargs = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[optimizer]
        self.module = DrafterLightningModule(
            drafter, target, self.loss, functools.partial(torch.optim.AdamW, lr=6e-4, weight_decay=0.01, **kwargs),
            functools.partial(warmup_cosine, warmup_steps=10, max_steps=1000), num_anchors=args.num_anchors)
        self.optimizer = self.module.configure_optimizers()["optimizer"]
        self.vocab = None
        self.batch = batch
        if args.train_vocab_size:  # the first ids stand in for a candidate vocabulary (timing only)
            vocab_ids = torch.arange(min(args.train_vocab_size, drafter.vocab_size))
            self.vocab = TrainVocab.build(vocab_ids, drafter.vocab_size, args.train_vocab_negatives)
            self.batch = {**batch, "input_ids": batch["input_ids"] % len(vocab_ids)}
        self.calls = 0

    def __call__(self) -> int:
        """One step (what Lightning runs for training_step under this precision); returns its blocks."""
        module, soft = self.module, bool(getattr(self.loss, "soft", False))
        with autocast(self.dtype):
            states, target_logits = module.context_states(self.batch, full_logits=soft)
            logits, labels, mask, probs = module._blocks(self.batch, states, target_logits,
                                                         torch.Generator().manual_seed(self.calls), self.vocab)
            loss, _ = module.loss(logits, labels, mask, probs)
            with torch.no_grad():
                slot_stats(logits, labels, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.drafter.parameters(), 1.0)
        self.optimizer.step()
        self.calls += 1
        return int(mask.any(-1).sum())

    def timed(self, steps: int) -> dict:
        blocks, wall, cpu = 0, 0.0, 0.0
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            blocks += self()
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
        return {"blocks_per_s": blocks / wall, "s_per_step": wall / steps, "cpu_s_per_step": cpu / steps,
                "blocks_per_step": blocks / steps}


@torch.no_grad()
def feature_pass(target, batch: dict, dtype, reps: int) -> float:
    """Tokens/s of the feature cache's target forward (drafters.training.features) in ``dtype``."""
    def run():
        with autocast(dtype):
            target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                   use_cache=False, logits_to_keep=1)
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return batch["input_ids"].numel() / statistics.median(times)


def profile_step(step: Step, steps: int, rows: int) -> list[dict]:
    """The operators of ``steps`` steps with the most self CPU time: ms per step, calls per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2),
             "share": round(e.self_cpu_time_total / total, 3), "calls_per_step": e.count / steps}
            for e in events[:rows]]


def interleaved(steps: dict[str, Step], target, batch: dict, args) -> dict:
    """Every step's figures, round after round (in each round, every precision in turn): each figure's median over
    the rounds, and every round's value in ``rounds``."""
    hidden, inner = target.config.hidden_size, target.config.intermediate_size
    rows = args.batch_size * args.seq_len
    rounds: dict[str, dict[str, list]] = {name: {} for name in steps}
    for r in range(args.rounds):
        for name, step in steps.items():
            dtype = step.dtype
            got = {"matmul_gflops": matmul_gflops(rows, hidden, inner, dtype), **step.timed(args.steps)}
            if name in PRECISIONS:
                got["feature_pass_tokens_per_s"] = feature_pass(target, batch, dtype, args.feature_reps)
            for key, value in got.items():
                rounds[name].setdefault(key, []).append(value)
            print(f"[bench_precision] round {r} {name:17s} matmul {got['matmul_gflops']:6.1f} GFLOP/s  step "
                  f"{got['blocks_per_s']:6.1f} blocks/s {got['s_per_step']:.3f} s (cpu {got['cpu_s_per_step']:.3f})"
                  + (f"  features {got['feature_pass_tokens_per_s']:7.1f} tok/s" if name in PRECISIONS else ""),
                  flush=True)
    return {name: {**{k: round(statistics.median(v), 4) for k, v in got.items()},
                   "rounds": {k: [round(x, 4) for x in v] for k, v in got.items()}}
            for name, got in rounds.items()}


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded tiny target, if trained)")
    p.add_argument("--loss", default="l2r_all")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--train-vocab-size", type=int, default=8192)
    p.add_argument("--train-vocab-negatives", type=int, default=4096)
    p.add_argument("--features", choices=["cached", "on_the_fly"], default="cached",
                   help="the step's context from cached features (the long runs') or a target forward per step")
    p.add_argument("--rounds", type=int, default=5, help="float32 then bfloat16, this many times")
    p.add_argument("--steps", type=int, default=3, help="timed steps per precision per round")
    p.add_argument("--feature-reps", type=int, default=2, help="timed feature passes per precision per round")
    p.add_argument("--profile-steps", type=int, default=3, help="bfloat16 steps profiled (0: none)")
    p.add_argument("--optimizers", nargs="*", default=[], choices=["foreach", "fused"],
                   help="time the bfloat16 step again with these AdamW implementations, interleaved")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/bench_precision_bf16.json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.target or (str(TINY_TARGET_DIR) if (TINY_TARGET_DIR / "config.json").is_file() else None)
    target = load_target(path, device="cpu")[0] if path else random_target("cpu")
    vocab = target.get_output_embeddings().weight.shape[0]
    batch = make_batch(args.batch_size, args.seq_len, args.prompt_len, vocab, "cpu")
    layer_ids = factory.from_target(target, block_size=args.block_size, num_layers=args.layers).target_layer_ids
    step_batch = with_cached_features(batch, target, layer_ids) if args.features == "cached" else batch
    steps = {name: Step(target, args, step_batch, dtype) for name, dtype in PRECISIONS.items()}
    steps |= {f"bfloat16+{o}": Step(target, args, step_batch, torch.bfloat16, o) for o in args.optimizers}
    for step in steps.values():
        step()  # warm-up: first-call allocations and oneDNN kernel selection
    results = interleaved(steps, target, batch, args)
    base, fast = results["float32"], results["bfloat16"]
    speedup = {k: round(fast[k] / base[k], 3) for k in ("matmul_gflops", "blocks_per_s", "feature_pass_tokens_per_s")}
    print(f"[bench_precision] bfloat16 / float32 (medians): {json.dumps(speedup)}", flush=True)
    profile = profile_step(steps["bfloat16"], args.profile_steps, 20) if args.profile_steps else []
    for row in profile[:12]:
        print(f"[bench_precision] profile {row['op']:45s} {row['self_ms_per_step']:8.1f} ms/step "
              f"{row['share']:6.1%}", flush=True)
    flags = cpuinfo_flags()
    report = {
        "target": portable_value(path) if path else "random Llama (tiny-target shape)",
        "settings": {k: v for k, v in vars(args).items() if k not in {"out", "target"}},
        "machine": {**machine(), "cpu": cpu_model(), "bf16_flags": [f for f in BF16_FLAGS if f in flags],
                    "avx512_flags": sorted(f for f in flags if f.startswith("avx512")),
                    "amx_flags": sorted(f for f in flags if f.startswith("amx"))},
        "matmul_shape": [args.batch_size * args.seq_len, target.config.hidden_size, target.config.intermediate_size],
        "results": results,
        "bf16_over_fp32": speedup,
        "profile_bf16_step": profile,
    }
    write_json_atomic(args.out, report)
    print(f"[bench_precision] wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
