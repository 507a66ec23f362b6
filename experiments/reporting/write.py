"""Writing a report: report.md, report.json and the plots to one folder (and optionally to W&B)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from drafters.training.datamodule import META
from experiments.pipeline.paths import REPO, cache_path, inside, portable_path
from experiments.reporting.paper import COMPOSITES, PAPER_TAU, composition_lines, paper_lines
from experiments.reporting.plots import (
    plot_accept_hist,
    plot_gain,
    plot_position_acceptance,
    plot_tau,
    plot_training_curves,
)
from experiments.reporting.runs import CURVE_METRIC, Run, training_curve
from experiments.reporting.speed import plot_speed, speed_lines, speed_table
from experiments.reporting.stats import build_report, mean_curves, seed_view
from experiments.reporting.tables import reach_lines, render_markdown


def is_data_folder(path: str | Path) -> bool:
    """A regenerated data folder (it holds ``regen.json``), e.g. the store of a ``corpus_lookup`` row."""
    return (Path(os.path.expanduser(str(path))) / META).is_file()


def runs_folder(configurations: Sequence[dict]) -> Path | None:
    """The folder holding every reported run outside the repository (a multirun's sweep dir, the main
    job's run dir): the deepest common parent of their run folders; None when all are in the repository."""
    folders = []
    for c in configurations:
        training_run = c.get("training_run") or {}
        for path, is_file in ((c.get("results_path"), True), (c.get("drafter_path"), True),
                              (training_run.get("run_dir"), False)):
            if path and not is_data_folder(path):  # corpus_lookup's drafter_path is its data folder, not a run
                full = Path(os.path.expanduser(str(path))).resolve()
                if not inside(full, REPO):
                    folders.append(full.parent if is_file else full)
    return Path(os.path.commonpath(folders)) if folders else None


def make_paths_portable(report: dict) -> Path | None:
    """Rewrite the paths of ``report["configurations"]`` (in place; the training-run records are copied
    first, not changed in the runs' documents): run paths with :func:`portable_path`, a training run's
    data folder with :func:`cache_path`. Returns the runs' folder."""
    base = runs_folder(report["configurations"])
    for c in report["configurations"]:
        for key in ("results_path", "drafter_path"):
            if c.get(key):
                c[key] = cache_path(c[key]) if is_data_folder(c[key]) else portable_path(c[key], base)
        training_run = dict(c.get("training_run") or {})
        if training_run.get("run_dir"):
            training_run["run_dir"] = portable_path(training_run["run_dir"], base)
        for key in ("data_dir", "target_path"):  # the cache's as $BLOCKDRAFT_CACHE/..., else relative if it can be
            if training_run.get(key):
                cached = cache_path(training_run[key])
                training_run[key] = cached if cached != str(training_run[key]) else portable_path(cached, base)
        if training_run:
            c["training_run"] = training_run
    return base

def write_report(runs: Sequence[Run], out: str | Path, baseline: str | None = "uniform",
                 num_bootstrap: int = 1000, seed: int = 0, speed_runs: Sequence[Run] = (), paper: bool = False,
                 untimed: str | None = None, composites: dict[str, Sequence[str]] | None = None) -> dict:
    """Write report.md, report.json and the PNGs to ``out``; returns report.json's content (with ``files``).
    ``speed_runs``: evaluations at batch 1 whose speeds make the report's speed section (:mod:`.speed`);
    ``paper``: a section with the paper's figures beside this report's (:mod:`.paper`), and the composition of
    :data:`.paper.COMPOSITES` unless ``composites`` (composite -> its terms' rows) names others; ``untimed``: why the
    evaluations' own speeds are left out (:func:`.tables.render_markdown`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(runs, baseline=baseline, num_bootstrap=num_bootstrap, seed=seed,
                          composites=COMPOSITES if composites is None and paper else composites)
    base = make_paths_portable(report)
    report["runs_folder"] = base.name if base is not None else None
    if report["across_seeds"]:  # plots show configurations (seed means), not every run
        view = seed_view(report)
        plots = [plot_tau(view, out / "tau.png", "Accepted length τ per suite: mean over seeds "
                          "(error bars: seed range, dots: seeds)")]
    else:
        view = report
        plots = [plot_tau(report, out / "tau.png")]
    if baseline is not None and report["baseline"] is not None and len(view["configurations"]) > 1:
        plots.append(plot_gain(view, out / "gain.png", seeds=bool(report["across_seeds"])))
    plots += [plot_position_acceptance(view, out / "position_acceptance.png"),
              plot_accept_hist(view, out / "accept_hist.png")]
    curves = {r.name: c for r in runs if (c := training_curve(r)) is not None}
    report["training_curves"] = {n: {"steps": s, CURVE_METRIC: v} for n, (s, v) in curves.items()}
    if curves and report["across_seeds"]:
        plots.append(plot_training_curves(mean_curves(curves, {r.name: r.config for r in runs}),
                                          out / "training_curves.png", f"Training: {CURVE_METRIC}, mean over seeds"))
    elif curves:
        plots.append(plot_training_curves(curves, out / "training_curves.png"))
    markdown = render_markdown(report, plots, untimed)
    if reach := reach_lines(view):
        markdown += "\n".join(["", "## Where drafts are kept" + (" (seeds summed)" if view is not report else ""),
                               *reach, ""]) + "\n"
    if paper:
        report["paper_tau"] = PAPER_TAU
    beside = [line for key in report["table"] for line in
              [*(paper_lines(report, key) if paper else []), *composition_lines(report, key)]]
    markdown += "\n".join(beside) + "\n" if beside else ""
    if speed_runs:
        report["speed"] = speed_table(speed_runs)
        plots.append(plot_speed(report["speed"], out / "speed.png"))
        markdown += "\n".join([*speed_lines(report["speed"]), "", "![speed](speed.png)"]) + "\n"
    (out / "report.md").write_text(markdown)
    report["files"] = [portable_path(f, base, out.parent) for f in (out / "report.md", out / "report.json", *plots)]
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def log_to_wandb(report: dict, out: str | Path, project: str = "blockdraft", mode: str = "offline",
                 name: str | None = None) -> str:
    """Log the PNGs and the τ table to a W&B run (offline by default); returns the run's directory."""
    import wandb

    run = wandb.init(project=project, mode=mode, dir=str(out), name=name, job_type="report",
                     config={"baseline": report["baseline"], "configurations": report["configurations"]})
    images = {f"report/{Path(f).stem}": wandb.Image(str(Path(out) / Path(f).name))
              for f in report["files"] if f.endswith(".png")}
    columns = ["configuration", "temperature", "suite", "tau", "ci_low", "ci_high", "gain", "gain_ci_low",
               "gain_ci_high"]
    rows = [[n, report["temperatures"][k], s, c["tau"], c.get("ci_low"), c.get("ci_high"), c.get("gain"),
             c.get("gain_ci_low"), c.get("gain_ci_high")]
            for k, suites in report["table"].items() for s, cells in suites.items() for n, c in cells.items()]
    run.log({**images, "report/tau_table": wandb.Table(columns=columns, data=rows)})
    run_dir = run.dir
    run.finish()
    return run_dir
