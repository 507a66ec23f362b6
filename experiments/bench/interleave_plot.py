"""Plot an interleave record's variants as τ against speedup, one panel per suite:

    python -m experiments.bench.interleave_plot experiments/results/bench/interleave_gate.json \\
        [--names main k3 ...] [--tau-bar mtbench=2.54 ...] [--speed-bar 1.3] [--out tau_speed.png]

Reads ``python -m experiments.bench.interleave``'s JSON (its ``summary``). ``--names`` relabels the variants in
their order (default: the variants' overrides); ``--tau-bar suite=value`` and ``--speed-bar`` draw the bars of a
goal as dashed lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.reporting.plots import plot_tau_speed


def points(summary: dict, names: list[str] | None = None) -> dict[str, dict[str, tuple[float, list[float]]]]:
    """``{name: {suite: (tau, speedups)}}`` from an interleave summary, named by ``names`` (in order) if given."""
    variants = list(summary)
    if names is not None and len(names) != len(variants):
        raise ValueError(f"--names has {len(names)} names for {len(variants)} variants: {variants}")
    labels = names or variants
    return {label: {suite: (v["tau"][0], list(v["speedup"])) for suite, v in summary[variant].items()}
            for label, variant in zip(labels, variants)}


def tau_bars(items: list[str]) -> dict[str, float]:
    """``{suite: τ}`` from ``suite=value`` items."""
    bars = {}
    for item in items:
        suite, _, value = item.partition("=")
        try:
            bars[suite] = float(value)
        except ValueError:
            raise SystemExit(f"--tau-bar {item!r}: expected suite=number") from None
    return bars


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path)
    p.add_argument("--names", nargs="+", default=None, help="labels of the variants, in their order")
    p.add_argument("--tau-bar", nargs="+", default=[], help="suite=τ lines to draw")
    p.add_argument("--speed-bar", type=float, default=None)
    p.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the file, <stem>.png)")
    args = p.parse_args(argv)
    doc = json.loads(args.file.read_text())
    if "summary" not in doc:
        raise SystemExit(f"{args.file}: no 'summary': not a python -m experiments.bench.interleave record")
    out = args.out or args.file.with_suffix(".png")
    path = plot_tau_speed(points(doc["summary"], args.names), out, tau_bars(args.tau_bar), args.speed_bar)
    print(f"[interleave_plot] wrote {path}")
    return path


if __name__ == "__main__":
    main()
