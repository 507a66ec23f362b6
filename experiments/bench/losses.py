"""Benchmark: forward+backward time of each conf/loss config relative to uniform cross-entropy.

    python -m experiments.bench.losses [--out runs/bench_losses.json] [--repeats 7]

For every vocabulary size (default 8192 and 4096, the embedded target's) it builds one batch of
N = 512 blocks of K = 15 slots and times, interleaved over configs and repeated, two steps:

* ``loss``: the loss on leaf logits (N, K, V), forward + backward to the logits;
* ``step``: a frozen LM head (hidden H -> V, as the drafter shares the target's head) plus the loss,
  forward + backward to the hidden states: the part of a training step that scales with V.

Each time is the median over repeats; ratios are against the ``uniform`` config (our chunked CE) and
against ``torch.nn.functional.cross_entropy`` (``torch_ce``) on the same tensors; ``torch_soft_ce`` is
PyTorch's CE against the soft labels p, the reference for ``soft_all``. Both wall-clock and
process CPU time are recorded: on a shared machine CPU time is the stable measure of cost (run with
``--threads 1`` so that it does not count threads spinning at barriers). A plain argparse script, not
a Hydra entry point: it sweeps every loss config itself and writes one JSON file.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import hydra.utils
import torch
import torch.nn.functional as F

from drafters.storage import write_json_atomic
from experiments.bench import loss_configs, loss_names


def make_batch(N: int, K: int, V: int, H: int, seed: int = 0):
    """Hidden states, a frozen head, labels the head often gets right, prefix masks, soft labels."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) / H**0.5 * 3)
        logits = head(hidden)  # (N, K, V)
        # labels: the argmax for ~70% of slots, a random token otherwise
        labels = torch.where(torch.rand(N, K, generator=g) < 0.7, logits.argmax(-1),
                             torch.randint(0, V, (N, K), generator=g))
        lengths = torch.where(torch.rand(N, generator=g) < 0.9, K, torch.randint(1, K + 1, (N,), generator=g))
        mask = torch.arange(K)[None, :] < lengths[:, None]  # (N, K), ~10% of blocks padded
        probs = torch.softmax(logits + torch.randn(N, K, V, generator=g), -1)  # (N, K, V)
    return hidden, head, logits, torch.where(mask, labels, -100), mask, probs


class TorchCE:
    """Reference: masked mean cross-entropy with PyTorch's kernels, on hard labels or (soft) on p."""

    def __init__(self, soft: bool = False) -> None:
        self.soft = soft

    def __call__(self, logits, labels, mask, target_probs=None):
        V = logits.shape[-1]
        if not self.soft:
            return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100), {}
        ce = F.cross_entropy(logits.reshape(-1, V), target_probs.reshape(-1, V), reduction="none")
        m = mask.reshape(-1)
        return (ce * m).sum() / m.sum(), {}


def time_once(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def bench_vocab(losses: dict, N: int, K: int, V: int, H: int, repeats: int) -> dict:
    hidden, head, logits, labels, mask, probs = make_batch(N, K, V, H)
    leaf = logits.clone().requires_grad_(True)
    hid = hidden.clone().requires_grad_(True)

    def loss_step(loss_fn, soft):
        leaf.grad = None
        loss, _ = loss_fn(leaf, labels, mask, probs if soft else None)
        loss.backward()

    def full_step(loss_fn, soft):
        hid.grad = None
        loss, _ = loss_fn(head(hid), labels, mask, probs if soft else None)
        loss.backward()

    kinds = [f"{step}_{clock}" for step in ("loss", "step") for clock in ("wall", "cpu")]
    times = {name: {kind: [] for kind in kinds} for name in losses}
    for rep in range(repeats + 1):  # the first round warms up and is dropped
        for name, loss_fn in losses.items():
            soft = bool(loss_fn.soft)
            for step, fn in (("loss", loss_step), ("step", full_step)):
                wall, cpu = time_once(lambda fn=fn, loss_fn=loss_fn, soft=soft: fn(loss_fn, soft))
                if rep > 0:
                    times[name][f"{step}_wall"].append(wall)
                    times[name][f"{step}_cpu"].append(cpu)
        print(f"  V={V} round {rep}/{repeats} done", flush=True)
    out = {}
    for name, per_kind in times.items():
        row = {}
        for kind, ts in per_kind.items():
            med = statistics.median(ts)
            row[f"{kind}_ms"] = round(med * 1000, 1)
            row[f"{kind}_vs_uniform"] = round(med / statistics.median(times["uniform"][kind]), 3)
            row[f"{kind}_vs_torch_ce"] = round(med / statistics.median(times["torch_ce"][kind]), 3)
            row[f"{kind}_iqr_ms"] = round((statistics.quantiles(ts, n=4)[2] - statistics.quantiles(ts, n=4)[0])
                                          * 1000, 1) if len(ts) > 1 else 0.0
        out[name] = row
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("BLOCKDRAFT_RUNS", "runs"), "bench_losses.json"))
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--slots", type=int, default=15)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 4096])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the frozen head in 'step'")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--configs", nargs="+", default=None, help="conf/loss names (default: all)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    losses = {"torch_ce": TorchCE(), "torch_soft_ce": TorchCE(soft=True)}
    names = [n for n in loss_names() if args.configs is None or n in args.configs or n == "uniform"]
    for name, cfg in loss_configs(names).items():
        losses[name] = hydra.utils.instantiate(cfg)
    result = {
        "setup": {"blocks": args.blocks, "slots": args.slots, "hidden": args.hidden, "repeats": args.repeats,
                  "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "machine": platform.processor() or platform.machine(), "load_avg": os.getloadavg()},
        "results": {},
    }
    for V in args.vocab:
        table = bench_vocab(losses, args.blocks, args.slots, V, args.hidden, args.repeats)
        result["results"][str(V)] = table
        for clock in ("cpu", "wall"):
            print(f"\nV={V}, {clock} time (median ms; ratio vs uniform config / vs torch F.cross_entropy)")
            print(f"{'config':<12} {'loss ms':>8} {'x unif':>7} {'x torch':>8}   {'step ms':>8} {'x unif':>7} "
                  f"{'x torch':>8}")
            for name, r in table.items():
                a, b = f"loss_{clock}", f"step_{clock}"
                print(f"{name:<12} {r[a + '_ms']:>8} {r[a + '_vs_uniform']:>7} {r[a + '_vs_torch_ce']:>8}   "
                      f"{r[b + '_ms']:>8} {r[b + '_vs_uniform']:>7} {r[b + '_vs_torch_ce']:>8}")
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
