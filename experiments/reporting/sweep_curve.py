"""A loss sweep's curve: τ (the suites' mean, mean over seeds) against the swept setting ``loss.<key>``, with the
position-uniform runs of the same seeds as a flat line. Written beside the sweep's report by
:mod:`experiments.ablation_report` (``curve.md``, ``curve.json``, ``curve.png``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from experiments.pipeline.records import temperature_key
from experiments.reporting.plots import plot_training_curves
from experiments.reporting.runs import Run
from experiments.reporting.stats import MEAN


def swept_value(run: Run, key: str) -> float | None:
    """``loss.<key>`` of the training run behind ``run``, from its ``.hydra/config.yaml`` (None when not found)."""
    for folder in run.training_dirs():
        config = folder / ".hydra" / "config.yaml"
        if config.is_file():
            loss = (yaml.safe_load(config.read_text()) or {}).get("loss") or {}
            if loss.get(key) is not None:
                return float(loss[key])
    return None


def sweep_points(runs: Sequence[Run], report: dict, key: str, baseline: str = "uniform",
                 temperature: float = 0.0) -> tuple[dict[float, list[float]], list[float]]:
    """``({value: [suites' mean τ per seed]}, [baseline's τ per seed])`` from the runs' report
    (:func:`experiments.reporting.write.write_report`'s, its mean over suites); a run with no ``loss.<key>`` is
    skipped."""
    means = report["table"].get(temperature_key(temperature), {}).get(MEAN, {})
    points: dict[float, list[float]] = {}
    base: list[float] = []
    for run in (r for r in runs if r.name in means):
        tau = float(means[run.name]["tau"])
        if run.config == baseline:
            base.append(tau)
        elif (value := swept_value(run, key)) is not None:
            points.setdefault(value, []).append(tau)
    return dict(sorted(points.items())), base


def write_sweep_curve(points: dict[float, list[float]], base: list[float], out: str | Path, key: str,
                      temperature: float = 0.0, baseline: str = "uniform", loss: str = "") -> dict:
    """Write curve.md, curve.json and curve.png into ``out`` (``loss``: the swept loss, the curve's label); returns
    curve.json's content."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    values = list(points)
    means = [float(np.mean(points[v])) for v in values]
    curves = {f"{loss or 'loss'} (loss.{key} swept)": (values, means)}
    if base:
        curves[baseline] = (values, [float(np.mean(base))] * len(values))
    plot_training_curves(curves, out / "curve.png", title=f"τ at T={temperature:g} (suites' mean, seeds' mean) "
                         f"against loss.{key}", ylabel="accepted length τ", legend="", xlabel=f"loss.{key}")
    lines = [f"# τ against loss.{key} (T={temperature:g}, mean over suites, then over seeds)", "",
             f"| loss.{key} | τ | per seed | gain over {baseline} |", "|---|---|---|---|"]
    for value, mean in zip(values, means):
        gain = f"{100 * (mean / np.mean(base) - 1):+.1f}%" if base else "—"
        lines.append(f"| {value:g} | {mean:.3f} | {', '.join(f'{t:.3f}' for t in points[value])} | {gain} |")
    if base:
        lines.append(f"| {baseline} | {np.mean(base):.3f} | {', '.join(f'{t:.3f}' for t in base)} | |")
    lines += ["", "![curve](curve.png)", ""]
    (out / "curve.md").write_text("\n".join(lines))
    doc = {"key": f"loss.{key}", "temperature": temperature, "points": {f"{v:g}": points[v] for v in values},
           baseline: base}
    (out / "curve.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc
