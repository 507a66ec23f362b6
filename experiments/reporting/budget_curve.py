"""The training-budget curve's numbers and files (the CLI is :mod:`experiments.reporting.budget`): τ (the suites'
mean) against training steps, one line per loss configuration, from every evaluated trained drafter found."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.pipeline.records import temperature_key
from experiments.reporting.plots import plot_training_curves
from experiments.reporting.runs import auto_name, find_results


def _steps(doc: dict, path: Path) -> int | None:
    """The optimizer steps of the training run behind an evaluation (None for untrained drafters)."""
    candidates = [path.parent, Path(((doc.get("drafter") or {}).get("training_run") or {}).get("run_dir") or path.parent)]
    drafter = (doc.get("drafter") or {}).get("path")
    if drafter:
        candidates.append(Path(drafter).parent)
    for folder in candidates:
        summary = folder / "train_summary.json"
        if summary.is_file():
            return int(json.loads(summary.read_text())["steps"])
    return None


def budget_points(paths: Sequence[str | Path], temperature: float = 0.0,
                  seeds: Sequence[int] | None = None) -> dict[str, dict[int, list[float]]]:
    """``{loss: {steps: [mean τ per seed]}}`` of every trained drafter's results.json under ``paths`` (trained with
    one of ``seeds``, when given)."""
    key, points, suites_seen = temperature_key(temperature), {}, set()
    for path in find_results(paths):
        doc = json.loads(path.read_text())
        steps = _steps(doc, path)
        entries = {s: e[key] for s, e in doc["results"].items() if key in e}
        if steps is None or not entries:
            continue
        suites_seen.add(tuple(sorted(entries)))
        if len(suites_seen) > 1:
            raise ValueError(f"{path}: evaluated on suites {sorted(entries)}, other points on {min(suites_seen)}; "
                             "a budget curve compares the same suites")
        loss, seed = auto_name(path, doc)
        if seeds is not None and seed not in seeds:
            continue
        points.setdefault(loss, {}).setdefault(steps, []).append(float(np.mean([e["tau"] for e in entries.values()])))
    return points


def budget_lines(points: dict[str, dict[int, list[float]]], baseline: str = "uniform") -> list[str]:
    """Markdown: τ per loss (rows) and budget (columns), with the gain over ``baseline`` at the same budget."""
    budgets = sorted({s for by_steps in points.values() for s in by_steps})
    lines = ["| loss | " + " | ".join(f"{s} steps" for s in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for loss, by_steps in points.items():
        cells = []
        for s in budgets:
            if s not in by_steps:
                cells.append("—")
                continue
            tau = float(np.mean(by_steps[s]))
            base = points.get(baseline, {}).get(s)
            gain = f" ({100 * (tau / float(np.mean(base)) - 1):+.1f}%)" if base and loss != baseline else ""
            seeds = f", {len(by_steps[s])} seeds" if len(by_steps[s]) > 1 else ""
            cells.append(f"{tau:.3f}{gain}{seeds}")
        lines.append(f"| {loss} | " + " | ".join(cells) + " |")
    return lines


def write_budget(points: dict[str, dict[int, list[float]]], out: str | Path, temperature: float = 0.0,
                 baseline: str = "uniform", seeds: Sequence[int] | None = None) -> dict:
    """Write budget.md, budget.json and budget.png into ``out``; returns budget.json's content."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {loss: (sorted(by_steps), [float(np.mean(by_steps[s])) for s in sorted(by_steps)])
              for loss, by_steps in points.items()}
    plot_training_curves(curves, out / "budget.png", title=f"τ at T={temperature:g} (suites' mean) "
                         "against the training budget", ylabel="accepted length τ", legend="loss")
    which = f", seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}" if seeds else ""
    lines = [f"# τ against the training budget (T={temperature:g}, mean over suites{which})", "",
             *budget_lines(points, baseline), "", "![budget](budget.png)", ""]
    (out / "budget.md").write_text("\n".join(lines))
    doc = {"temperature": temperature, "seeds": list(seeds) if seeds else None,
           "points": {loss: {str(s): v for s, v in by.items()} for loss, by in points.items()}}
    (out / "budget.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(lines), flush=True)
    return doc
