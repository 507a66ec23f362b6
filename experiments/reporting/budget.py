"""The training-budget curve: τ (the suites' mean) against training steps, one line per loss configuration.

    python -m experiments.reporting.budget <run dirs, multirun dirs or results.json ...> --out DIR [--temperature 0]
        [--seeds 0]

Every evaluated trained drafter found under the paths is one point: its loss (as :mod:`experiments.report` names
it), the steps its training ran (``train_summary.json`` of its training run) and its τ averaged over the suites it
was evaluated on (all points must share them). Seeds of the same (loss, steps) are averaged; ``--seeds`` keeps
only those training seeds (a curve whose budgets were trained at other seeds than its 1x point compares like
with like only so). Writes
``budget.md`` (τ per loss and budget, with the gain over ``uniform`` at the same budget), ``budget.json`` and
``budget.png``; it answers whether the losses' gains grow, shrink or vanish with training.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from experiments.reporting.budget_curve import budget_points, write_budget


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.reporting.budget", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="run dirs (searched recursively) or results.json files")
    parser.add_argument("--out", required=True, help="directory for budget.md, budget.json and budget.png")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--baseline", default="uniform")
    parser.add_argument("--seeds", type=int, nargs="+", help="only drafters trained with these seeds (default: all)")
    args = parser.parse_args(argv)
    points = budget_points(args.paths, args.temperature, args.seeds)
    if not points:
        raise SystemExit(f"no evaluated trained drafter under {args.paths}")
    return write_budget(points, args.out, args.temperature, args.baseline, args.seeds)


if __name__ == "__main__":
    main()
