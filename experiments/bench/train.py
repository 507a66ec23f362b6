"""Benchmark: drafter training throughput and peak memory for each loss configuration.

    python -m experiments.bench.train [--target PATH] [--losses uniform chain ...] [--out runs/bench_train.json]

One training step is what :class:`drafters.DrafterLightningModule` does: a target forward (no grad,
hidden states; full logits only for soft losses), random anchors, the drafter on every block, the
loss, backward, AdamW step. Batches are synthetic (random tokens, a ``--prompt-len`` prompt, the
rest response; throughput does not depend on content). For each ``conf/loss/<name>.yaml`` it
reports, over ``--steps`` timed steps after ``--warmup``:

* ``blocks_per_s`` (blocks with a label) and ``tokens_per_s`` (supervised slots), wall clock;
* ``cpu_s_per_step`` (process CPU time; the stable measure on a shared machine) and the share of
  the step spent in the target forward;
* ``peak_rss_mb``: the process's peak resident memory during that config's steps (Linux: the peak
  is reset through ``/proc/self/clear_refs`` before each config; elsewhere ``getrusage``'s
  lifetime peak), ``peak_cuda_mb`` on a GPU.

Every loss runs twice in one process (``--features both``): with a target forward per step, as
without a feature cache, and with cached features (:mod:`drafters.training.features`; soft losses still need
the target's logits and always run it), so the speedup of the cache is a ratio measured in one run.

Plus, once, the cost of one validation batch (teacher-forced τ over every response anchor), and the
machine's own yardstick measured in the same process (``reference``): the GFLOP/s of a plain float32 matmul
at the target's widths, the target's feature pass (the cache's forward: hidden states, no LM head) in
tokens/s and GFLOP/s, and each as a share of that matmul rate (2 FLOPs per weight per token, attention
excluded). The default target is the embedded tiny target if it has been trained, else a random Llama of its
size.
"""

from __future__ import annotations

import argparse
import functools
import time

import hydra.utils
import torch

from drafters import factory
from drafters.storage import write_json_atomic
from drafters.tau import anchor_acceptance
from drafters.training.blocks import select_blocks
from drafters.training.module import DrafterLightningModule
from drafters.training.optim import warmup_cosine
from drafters.training.vocab import TrainVocab
from experiments.bench import (
    loss_configs,
    make_batch,
    peak_rss_mb,
    random_target,
    reset_peak_rss,
    with_cached_features,
)
from experiments.data.target import TINY_TARGET_DIR, load_target
from experiments.pipeline.paths import portable_value
from experiments.pipeline.records import machine, matmul_gflops, median_seconds

LOSSES = ("uniform", "decay", "focal", "chain", "decay_focal", "l2r_all", "dpace", "soft_all")




def bench_loss(name: str, target, args, batch, cached: bool, num_anchors: int) -> dict:
    loss = hydra.utils.instantiate(loss_configs([name])[name])
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=args.block_size, num_layers=args.layers)
    drafter.to(args.device)
    module = DrafterLightningModule(
        drafter, target, loss, functools.partial(torch.optim.AdamW, lr=6e-4, weight_decay=0.01),
        functools.partial(warmup_cosine, warmup_steps=10, max_steps=1000), num_anchors=num_anchors,
    ).to(args.device)
    optimizer = module.configure_optimizers()["optimizer"]
    if cached:
        batch = with_cached_features(batch, target, drafter.target_layer_ids)
    vocab = None
    if args.train_vocab_size:  # the most frequent ids stand in for a candidate vocabulary (timing only)
        vocab_ids = torch.arange(min(args.train_vocab_size, drafter.vocab_size), device=args.device)
        vocab = TrainVocab.build(vocab_ids, drafter.vocab_size, args.train_vocab_negatives)
        batch = {**batch, "input_ids": batch["input_ids"] % len(vocab_ids)}
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    blocks = tokens = 0
    target_s = wall = cpu = 0.0
    reset_ok = reset_peak_rss()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        states, target_logits = module.context_states(batch, full_logits=loss.soft)
        sync()
        t1 = time.perf_counter()
        with autocast:
            logits, labels, mask, probs = select_blocks(drafter, batch, states, target_logits, num_anchors,
                                                        torch.Generator().manual_seed(step), soft=loss.soft,
                                                        vocab=vocab)
        value, _ = loss(logits.float(), labels, mask, probs)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        sync()
        if step >= args.warmup:
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            target_s += t1 - t0
            blocks += int(mask.any(-1).sum())
            tokens += int(mask.sum())
    result = {
        "loss": name, "soft": bool(loss.soft), "features": "cached" if cached and not loss.soft else "on_the_fly",
        "train_vocab_size": args.train_vocab_size, "bf16": args.bf16, "num_anchors": num_anchors,
        "blocks_per_s": blocks / wall, "tokens_per_s": tokens / wall,
        "s_per_step": wall / args.steps, "cpu_s_per_step": cpu / args.steps,
        "target_forward_share": target_s / wall, "blocks_per_step": blocks / args.steps,
        "peak_rss_mb": round(peak_rss_mb(), 1), "peak_rss_is_per_config": reset_ok,
        "final_loss": float(value.detach()),
    }
    if args.device.startswith("cuda"):
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


@torch.no_grad()
def bench_reference(target, args, batch) -> dict:
    """The float32 matmul rate at the target's widths, and the feature pass's rate against it (module doc)."""
    hidden, inner = target.config.hidden_size, target.config.intermediate_size
    rows = args.batch_size * args.seq_len
    matmul = matmul_gflops(rows, hidden, inner, args.device)
    body = sum(p.numel() for n, p in target.named_parameters() if "embed" not in n and "lm_head" not in n)
    seconds = median_seconds(lambda: target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                             output_hidden_states=True, use_cache=False, logits_to_keep=1), reps=3)
    feature_gflops = 2 * body * rows / seconds / 1e9
    return {"matmul_shape": [rows, hidden, inner], "matmul_gflops": round(matmul, 1),
            "feature_pass_tokens_per_s": round(rows / seconds, 1), "feature_pass_gflops": round(feature_gflops, 1),
            "feature_pass_share_of_matmul": round(feature_gflops / matmul, 3)}


def _drafter_shares(results: list[dict], target, args, matmul_rate: float) -> None:
    """Each training record's drafted slots/s as GFLOP/s (forward + backward ~ 3x the forward's 2 FLOPs per
    drafter weight per slot, the LM head over the vocabulary scored) and its share of the matmul rate."""
    drafter = factory.from_target(target, block_size=args.block_size, num_layers=args.layers)
    weights = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    head = target.config.hidden_size * (args.train_vocab_size or target.config.vocab_size)
    for r in results:
        gflops = 6 * (weights + head) * r["tokens_per_s"] / 1e9
        r["train_gflops"], r["train_share_of_matmul"] = round(gflops, 1), round(gflops / matmul_rate, 3)


def interleaved(run, configs: list[tuple], rounds: int) -> list[dict]:
    """``run(*config)`` for every config, round after round; per config the record of its median round by
    ``s_per_step``, with every round's ``s_per_step`` in ``s_per_step_rounds``."""
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _ in range(rounds):
        for config in configs:
            r = run(*config)
            runs[config].append(r)
            print(f"[bench_train] {r['loss']:12s} {r['features']:10s} {r['num_anchors']:4d} anchors "
                  f"{r['blocks_per_s']:8.1f} blocks/s {r['tokens_per_s']:9.1f} tok/s {r['s_per_step']:.3f} s/step "
                  f"(cpu {r['cpu_s_per_step']:.3f}) target {r['target_forward_share']:.0%} "
                  f"peak {r['peak_rss_mb']:.0f} MB", flush=True)
    return [{**sorted(rs, key=lambda r: r["s_per_step"])[(len(rs) - 1) // 2],
             "s_per_step_rounds": [round(r["s_per_step"], 4) for r in rs]} for rs in runs.values()]


@torch.no_grad()
def bench_validation(target, args, batch) -> dict:
    drafter = factory.from_target(target, block_size=args.block_size, num_layers=args.layers)
    drafter.to(args.device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    anchor_acceptance(drafter, out.hidden_states, out.logits, batch["input_ids"], batch["attention_mask"],
                      batch["prompt_len"], batch["length"], chunk=64)
    anchors = int((batch["length"] - batch["prompt_len"]).sum())
    wall = time.perf_counter() - t0
    return {"s_per_batch": wall, "cpu_s_per_batch": time.process_time() - c0, "anchors_per_s": anchors / wall}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded tiny target, if trained)")
    p.add_argument("--losses", nargs="+", default=list(LOSSES))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-anchors", type=int, nargs="+", default=[32],
                   help="anchors per sequence: each value is a config")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--features", choices=["both", "cached", "on_the_fly"], default="both",
                   help="context from cached target features, a target forward per step, or both (one run)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every config this many times, round after round (interleaved); each keeps its median")
    p.add_argument("--train-vocab-size", type=int, default=None,
                   help="training logits over this many ids only (module.train_vocab_size; "
                        "drafters/training/vocab.py)")
    p.add_argument("--train-vocab-negatives", type=int, default=0, help="other ids scored per step (sampled softmax)")
    p.add_argument("--bf16", action="store_true", help="the drafter's forward under bfloat16 autocast")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="runs/bench_train.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.target or (str(TINY_TARGET_DIR) if (TINY_TARGET_DIR / "config.json").is_file() else None)
    target = load_target(path, device=args.device)[0] if path else random_target(args.device)
    vocab = target.get_output_embeddings().weight.shape[0]
    batch = make_batch(args.batch_size, args.seq_len, args.prompt_len, vocab, args.device)
    modes = {"both": [False, True], "cached": [True], "on_the_fly": [False]}[args.features]
    results = interleaved(lambda name, cached, anchors: bench_loss(name, target, args, batch, cached, anchors),
                          [(n, c, a) for n in args.losses for c in modes for a in args.num_anchors], args.rounds)
    reference = bench_reference(target, args, batch)
    _drafter_shares(results, target, args, reference["matmul_gflops"])
    print(f"[bench_train] matmul {reference['matmul_gflops']} GFLOP/s; feature pass "
          f"{reference['feature_pass_tokens_per_s']} tok/s = {reference['feature_pass_share_of_matmul']:.0%} of it",
          flush=True)
    report = {
        "target": portable_value(path) if path else "random Llama (tiny-target shape)",
        "target_parameters": sum(q.numel() for q in target.parameters()),
        "settings": {k: portable_value(v) if k == "target" and v else v for k, v in vars(args).items()
                     if k not in {"out", "losses"}},
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": machine(),
        "losses": results,
        "validation_batch": bench_validation(target, args, batch),
        "reference": reference,
    }
    write_json_atomic(args.out, report)
    print(f"[bench_train] wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
