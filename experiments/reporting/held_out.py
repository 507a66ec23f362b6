"""Held-out curves of training runs side by side: every ``val/*`` metric a run's CSV logger wrote at each validation
(held-out τ ``val/tau_greedy``, per-slot accuracy, the loss terms), for runs that differ in one setting (a learning
rate, a schedule, a loss), into ``held_out.json`` (per run: its folder as committed records name it, and
``{step, metrics}`` points), ``held_out.md`` (the τ table, with each point's change from the run's first validation)
and ``held_out.png`` (τ against the step).

    python -m experiments.reporting.held_out lr3e-4=<run dir> lr1e-4=<run dir> --out DIR [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from experiments.pipeline.paths import record_path
from experiments.reporting.plots import plot_training_curves
from experiments.reporting.runs import CURVE_METRIC, logged_rows


def parse_runs(specs: Sequence[str]) -> dict[str, Path]:
    """``NAME=RUN_DIR`` arguments as ``{name: folder}``; a malformed one, a repeated name or a folder without a
    logged ``val/tau_greedy`` is refused by name."""
    runs: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"{spec!r}: expected NAME=RUN_DIR")
        if name in runs:
            raise ValueError(f"{spec!r}: the name {name!r} is given twice")
        if not logged_rows(Path(folder)):
            raise FileNotFoundError(f"{spec!r}: no metrics.csv under {folder} logs {CURVE_METRIC}")
        runs[name] = Path(folder)
    return runs


def collect(runs: dict[str, Path]) -> dict:
    """Each run's validations: ``{name: {"run_dir", "points": [{"step", "val/...": value}, ...]}}`` by step."""
    doc = {}
    for name, folder in runs.items():
        points = [{"step": int(float(r["step"])), **{k: round(float(v), 4) for k, v in r.items()
                                                     if k.startswith("val/") and v}}
                  for r in logged_rows(folder) if r.get(CURVE_METRIC) and r.get("step")]
        doc[name] = {"run_dir": record_path(folder), "points": sorted(points, key=lambda p: p["step"])}
    return doc


def table(doc: dict) -> str:
    """The held-out τ of every run at every validated step (and its change from the run's first validation)."""
    steps = sorted({p["step"] for run in doc.values() for p in run["points"]})
    lines = ["| run | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for name, run in doc.items():
        by_step = {p["step"]: p[CURVE_METRIC] for p in run["points"]}
        first = run["points"][0][CURVE_METRIC]
        cells = [f"{by_step[s]:.3f}" + (f" ({by_step[s] - first:+.3f})" if s != run["points"][0]["step"] else "")
                 if s in by_step else "" for s in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(doc: dict, out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "held_out.json").write_text(json.dumps({"title": title, "metric": CURVE_METRIC, "runs": doc}, indent=1))
    (out / "held_out.md").write_text(f"# {title}\n\nHeld-out τ ({CURVE_METRIC}) at each validation:\n\n{table(doc)}\n")
    curves = {name: ([p["step"] for p in run["points"]], [p[CURVE_METRIC] for p in run["points"]])
              for name, run in doc.items()}
    plot_training_curves(curves, out / "held_out.png", title=title)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR: a training run folder (its CSV logger's metrics.csv)")
    parser.add_argument("--out", type=Path, required=True, help="folder for held_out.json, .md and .png")
    parser.add_argument("--title", default="Held-out τ along training")
    args = parser.parse_args(argv)
    write(collect(parse_runs(args.runs)), args.out, args.title)
    print(f"[held_out] {args.out}/held_out.md")


if __name__ == "__main__":
    main()
