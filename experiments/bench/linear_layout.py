"""What a linear layer costs on this CPU at the few rows a speculative step feeds it, in the two weight layouts:
PyTorch's own ``(out, in)`` row-major weight (``F.linear(x, W)``, BLAS multiplies by a transposed operand) and the
same weight stored column-major (``W.t().contiguous().t()``: identical values and shape, BLAS multiplies by a
plain operand). The rows are a step's verified columns at batch 1 (1: target-only decoding).

    python -m experiments.bench.linear_layout [--shapes 576x576 576x1536 1536x576 576x49152] \\
        [--rows 1 2 3 4 6 8 16] [--rounds 30] [--threads 2] [--out runs/linear_layout.json]

Each (shape, rows) times both layouts interleaved round by round; medians over rounds, the first 3 left out; wall ms.
Shapes are ``in x out`` (SmolLM2-135M: attention 576x576 and 576x192, MLP 576x1536 and 1536x576, head 576x49152).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from experiments.bench import write_record
from verify.layout import column_major

SKIP = 3


def measure(in_features: int, out_features: int, rows: int, rounds: int) -> dict[str, float]:
    """Median wall ms of ``F.linear`` with a row-major and a column-major weight, (rows, in) -> (rows, out)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    layouts = {"row_major": weight, "column_major": column_major(weight)}
    x = torch.randn(1, rows, in_features, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, w in layouts.items():
                start = time.perf_counter()
                F.linear(x, w)
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t[SKIP:]) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["576x576", "576x192", "576x1536", "1536x576", "576x49152"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8, 16])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/linear_layout.json")
    args = parser.parse_args(argv)
    if args.rounds <= SKIP:
        parser.error(f"--rounds must exceed {SKIP} (the warm-up rounds left out)")
    torch.set_num_threads(args.threads)
    results = {}
    for shape in args.shapes:
        try:
            in_features, out_features = map(int, shape.split("x"))
        except ValueError:
            parser.error(f"--shapes: {shape!r} is not IN x OUT, e.g. 576x1536")
        for rows in args.rows:
            ms = measure(in_features, out_features, rows, args.rounds)
            results[f"{shape} rows={rows}"] = {**ms, "column_major / row_major": ms["column_major"] / ms["row_major"]}
            print(f"{shape:>10s} rows={rows:<3d} row-major {ms['row_major']:7.3f} ms   "
                  f"column-major {ms['column_major']:7.3f} ms", flush=True)
    record = {"command": "python -m experiments.bench.linear_layout " + " ".join(argv or []),
              "rounds": args.rounds, "median_ms": results}
    return write_record(record, args.out)


if __name__ == "__main__":
    main()
