"""Plot learning curves side by side (teacher-forced τ and slot-1 accuracy vs training step):

    python -m experiments.bench.learning_plot runs/bench_learning.json [more.json ...] \\
        [--runs g2_600 ar_target ...] [--out runs/learning_plots]

Reads a collection (``{"runs": {name: {"what": ..., "curve": [...]}}}``, as in the diagnosis record
``experiments/results/diagnosis/learning_curves.json`` at commit 9f469f9, docs/history.md) or single
``python -m experiments.bench.learning`` outputs (``{"settings": ..., "curve": [...]}``, named by file stem); every curve point needs ``step``
and ``tau``, and ``acc1`` or ``acc_slot`` for the accuracy panel. Writes ``learning_tau.png`` and
``learning_acc1.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.reporting.plots import plot_training_curves


def load_curves(paths: list[Path]) -> dict[str, list[dict]]:
    curves = {}
    for path in paths:
        data = json.loads(path.read_text())
        if "runs" in data:
            curves.update({name: run["curve"] for name, run in data["runs"].items()})
        elif "curve" in data:
            curves[path.stem] = data["curve"]
        else:
            raise ValueError(f"{path}: neither a collection ('runs') nor a bench.learning output ('curve')")
    return curves


def series(curve: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(p["step"], p[key] if key in p else p["acc_slot"][0]) for p in curve
              if key in p or "acc_slot" in p]
    return [s for s, _ in points], [v for _, v in points]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--runs", nargs="+", default=None, help="runs to plot, in this order (default: all)")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    curves = load_curves(args.files)
    names = args.runs or list(curves)
    missing = [n for n in names if n not in curves]
    if missing:
        raise SystemExit(f"--runs {missing} not found; the files hold {sorted(curves)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for key, label, stem in (("tau", "teacher-forced τ (greedy), validation", "learning_tau"),
                             ("acc1", "slot-1 (next-token) accuracy, validation", "learning_acc1")):
        chosen = {n: series(curves[n], key) for n in names}
        path = plot_training_curves(chosen, args.out / f"{stem}.png", title=f"Learning: {key}", ylabel=label,
                                    legend="run")
        print(f"[learning_plot] wrote {path}")


if __name__ == "__main__":
    main()
