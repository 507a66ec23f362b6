"""Every report of the SmolLM2 ablation from whatever runs exist: ``python -m experiments.ablation_report``.

Reads the run folders that ``experiments/ablation_queue.sh`` fills (``<runs>/multirun/...``, ``--runs`` or
``$BLOCKDRAFT_RUNS``) and rewrites, under ``--out`` (default ``experiments/results``):

* ``ablation_smollm2/``: the 8 loss configurations over their seeds, at every temperature evaluated, beside the
  paper's figures (as ``python -m experiments.report --paper``), with the baselines as rows (``--baselines``;
  default: the queue's ``<runs>/baselines/*``);
* ``budget_smollm2/``: τ against the training budget, seed 0 (the budget runs' seed) at 1x, 2x and 4x
  (as ``python -m experiments.reporting.budget --seeds 0``);
* ``sweep_<name>_smollm2/`` for each loss sweep that has runs: its values beside the ablation's own run of that loss
  (the sweep's default) and ``uniform``, seed by seed, and the curve of τ against the swept setting
  (``curve.md``/``.png``, :mod:`experiments.reporting.sweep_curve`).

With ``--long``, the long-budget ablation instead (``QUEUE=long``: ``<runs>/multirun/ablation_long``):

* ``ablation_long/`` and ``ablation_long_tree/``: the losses at 10K steps as a chain and as a best-first tree, gains
  over ``uniform`` (``uniform_tree``), beside the paper's figures; ``ablation_long_5k/``, ``ablation_long_tree_5k/``:
  the same runs' 5K-step snapshots (T=0);
* ``ablation_long_precision/``: l2r_all trained 5K steps in float32 and in bfloat16 from the same initialisation and
  data order, the bfloat16 one's gain over the float32 one, and ``quality.md``/``.json``: whether its intervals hold 0,
  and the held-out τ of both (issue 75's quality check, :mod:`experiments.reporting.precision`).

A part without runs (or without its baseline) is skipped and named, and so is an evaluation under way; in the long
parts a run whose seed has no uniform run evaluated waits, named (a gain pairs runs of one seed). Run it again as runs
finish.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from experiments.reporting.budget_curve import budget_points, write_budget
from experiments.reporting.paper import beside_composition_lines, beside_lines, suffixed_composites
from experiments.reporting.plots import plot_beside
from experiments.reporting.precision import write_quality
from experiments.reporting.runs import Run, find_results, load_runs, order_runs
from experiments.reporting.sweep_curve import sweep_points, write_sweep_curve
from experiments.reporting.write import write_report

ORDER = ["decay", "focal", "chain", "decay_focal", "l2r_all", "dpace", "soft_all"]
# experiment=l2r_sweep_<name>: (its loss, the loss setting it sweeps)
SWEEPS = {"gamma": ("decay", "gamma"), "focal": ("focal", "focal_gamma"), "chain": ("chain", "chain_weight")}


def complete(path: Path) -> bool:
    """Whether an evaluation's results.json holds every suite it lists (one under way at T=0 does not, and would
    narrow every row's mean over suites; a temperature under way is dropped by the report itself)."""
    doc = json.loads(path.read_text())
    return set(doc["results"]) >= set(doc.get("suites") or ())


def _evaluated(paths: Sequence[Path]) -> list[Path]:
    """The complete results.json files under ``paths``; those under way (or still training) are named and left out."""
    kept, found = [], []
    for p in (p for p in paths if p.exists()):
        try:
            found += find_results([p])
        except FileNotFoundError:
            print(f"[ablation_report] {p}: no evaluation yet, left out", flush=True)
    for f in found:
        if complete(f):
            kept.append(f)
        else:
            print(f"[ablation_report] {f}: evaluation under way, left out", flush=True)
    return kept


def sweep_paths(runs: Path, name: str) -> list[Path]:
    """The sweep's evaluations and the ablation's uniform and <loss> ones of the seeds the sweep trained."""
    folder = runs / "multirun" / f"l2r_sweep_{name}"
    seeds = sorted({d.name.rsplit("-s", 1)[1] for d in folder.glob("*-s*") if _evaluated([d])})
    ablation = runs / "multirun" / "l2r_ablation"
    return _evaluated([folder] + [ablation / f"{loss}-s{s}" for s in seeds for loss in ("uniform", SWEEPS[name][0])])


def _report(paths: Sequence[Path], out: Path, order: Sequence[str], paper: bool = False,
            baseline: str = "uniform", untimed: str | None = None,
            composites: dict[str, Sequence[str]] | None = None) -> tuple[list[Run], dict | None]:
    """Write the report of ``paths`` into ``out`` (``composites``: see :func:`write_report`); returns its runs and
    report.json's content (None, the part skipped and named, while no run of ``baseline`` is evaluated)."""
    runs = order_runs(load_runs(paths), order, baseline)
    if baseline not in {r.config for r in runs} | {r.name for r in runs}:
        print(f"[ablation_report] {out.name}: no evaluated {baseline} run yet, skipped", flush=True)
        return runs, None
    report = write_report(runs, out, baseline=baseline, paper=paper, untimed=untimed, composites=composites)
    print(f"[ablation_report] {len(paths)} evaluations -> {out / 'report.md'}", flush=True)
    return runs, report


# report folder -> (the evaluation folder of each ablation_long run, the baseline row)
LONG_PARTS = {"ablation_long": ("eval", "uniform"), "ablation_long_tree": ("eval_tree", "uniform_tree"),
              "ablation_long_5k": ("eval_5k", "uniform"), "ablation_long_tree_5k": ("eval_tree_5k", "uniform_tree")}
# why the long reports leave out their evaluations' tokens/s
QUEUE_TIMES = ("the queue evaluates each drafter niced beside another training, and pauses with it, so its tokens/s "
               "measure the machine's load (the main job's speed stage times drafters alone)")
# the queue's precision-<trainer.precision>-s<seed> runs: the precision's name in the quality check
PRECISION_NAMES = {"32": "float32", "bf16-mixed": "bfloat16"}


def precision_runs(folder: Path) -> dict[tuple[str, int], Path]:
    """``{(precision, seed): run folder}`` of the ``precision-<trainer.precision>-s<seed>`` runs under ``folder``
    trained and evaluated, of the seeds done in both precisions (a seed in one only would be paired with another)."""
    runs = {}
    for d in folder.glob("precision-*-s*"):
        setting, seed = d.name.removeprefix("precision-").rsplit("-s", 1)
        if setting not in PRECISION_NAMES:
            raise ValueError(f"{d}: trainer.precision={setting} is not one of the quality check's "
                             f"{sorted(PRECISION_NAMES)} (experiments/ablation_queue.sh's precision_job)")
        if (d / "train_summary.json").is_file() and _evaluated([d / "eval"]):
            runs[PRECISION_NAMES[setting], int(seed)] = d
    both = {seed for _, seed in runs if all((name, seed) in runs for name in PRECISION_NAMES.values())}
    return {key: d for key, d in sorted(runs.items()) if key[1] in both}


def precision_report(folder: Path, out: Path) -> bool:
    """The bfloat16 quality check's report and verdict (:func:`experiments.reporting.precision.write_quality`) from
    the seeds both precisions finished and evaluated; False (named) while there is none."""
    runs = precision_runs(folder)
    if not runs:
        print(f"[ablation_report] {out.name}: no seed trained and evaluated in both precisions yet, skipped", flush=True)
        return False
    _, report = _report([d / "eval" for d in runs.values()], out, ["l2r_all_bf16-mixed"], baseline="l2r_all_32")
    if report is not None:
        write_quality(report, runs, out, "l2r_all_bf16-mixed")
    return report is not None


def _paired_seeds(trained: Sequence[Path], sub: str) -> list[Path]:
    """The run folders among ``trained`` (``<loss>-s<seed>``) of the seeds whose ``uniform`` run has ``sub``
    evaluated: a gain pairs a run with uniform's of its own seed, never another seed's. The rest are named."""
    seed = {d: d.name.rsplit("-s", 1)[1] for d in trained}
    done = {seed[d] for d in trained if d.name.startswith("uniform-s") and (d / sub / "results.json").is_file()
            and complete(d / sub / "results.json")}
    waiting = [d.name for d in trained if seed[d] not in done and (d / sub).is_dir()]
    if waiting:
        print(f"[ablation_report] {', '.join(waiting)} ({sub}): left out until their seed's uniform run is evaluated",
              flush=True)
    return [d for d in trained if seed[d] in done]


# the columns of beside.md: report folder -> (heading, the suffix of its rows' names)
BESIDE = {"ablation_long_5k": ("5K steps, chain", ""), "ablation_long": ("10K steps, chain", ""),
          "ablation_long_tree_5k": ("5K steps, tree", "_tree"), "ablation_long_tree": ("10K steps, tree", "_tree")}


def write_beside(out: Path, written: Sequence[str], short: Path | None) -> None:
    """``<out>/ablation_long/beside.md``: each loss's gain in the long-budget reports just ``written`` (chain, tree,
    the 5K snapshots) beside the 700-step ablation's (``short``: its report.json, where given and present) and the
    paper's, at T=0 and T=1."""
    columns = {"700 steps": (json.loads(short.read_text()), "")} if short is not None and short.is_file() else {}
    columns |= {heading: (json.loads((out / name / "report.json").read_text()), suffix)
                for name, (heading, suffix) in BESIDE.items() if name in written}
    text = ["# The long-budget ablation beside the 700-step one and the paper", "",
            ("Each cell: the gain over uniform on the suites' mean, with its 95% interval (over several seeds: the mean "
            "of each seed's gain). 10K: the queue's ablation_long runs at their full budget; 5K: their 5K-step "
            "snapshots."), ""]
    for key in ("t0", "t1"):
        text += beside_lines(columns, ORDER, key) + beside_composition_lines(columns, key)
    plot_beside(columns, ORDER, out / "ablation_long" / "beside.png")
    (out / "ablation_long" / "beside.md").write_text("\n".join([*text, "![beside](beside.png)", ""]))


def long_reports(runs: Path, out: Path, short: Path | None = None) -> list[str]:
    """The long-budget ablation's reports (the module doc, ``--long``), and ``beside.md`` (:func:`write_beside`, the
    700-step ablation's report.json from ``short``); returns the folders written."""
    folder, written = runs / "multirun" / "ablation_long", []
    trained = [d for d in sorted(folder.glob("*-s*")) if not d.name.startswith("precision-")]
    for name, (sub, baseline) in LONG_PARTS.items():
        paths = _evaluated([d / sub for d in _paired_seeds(trained, sub)])
        if len(paths) < 2:
            print(f"[ablation_report] {name}: fewer than two evaluated runs yet, skipped", flush=True)
            continue
        suffix = baseline.removeprefix("uniform")  # the rows' suffix: "_tree" in a tree report
        if _report(paths, out / name, [loss + suffix for loss in ORDER], paper=sub == "eval", baseline=baseline,
                   untimed=QUEUE_TIMES, composites=suffixed_composites(suffix))[1] is not None:
            written.append(name)
    if "ablation_long" in written:
        write_beside(out, written, short)
    if precision_report(folder, out / "ablation_long_precision"):
        written.append("ablation_long_precision")
    print(f"[ablation_report] wrote {', '.join(written) or 'nothing'} under {out}", flush=True)
    return written


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m experiments.ablation_report", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=os.environ.get("BLOCKDRAFT_RUNS", "runs"), help="the queue's runs folder")
    parser.add_argument("--out", default="experiments/results", help="folder the report folders are written into")
    parser.add_argument("--baselines", nargs="+", default=None, help="evaluations of untrained drafters on the "
                        "same suites, rows of the ablation report (default: the queue's <runs>/baselines/*; e.g. "
                        "the main job's <run>/eval/prompt_lookup, evaluated at T=0 only)")
    parser.add_argument("--long", action="store_true", help="the long-budget ablation's reports (QUEUE=long)")
    parser.add_argument("--short", default="experiments/results/ablation_smollm2/report.json", help="with --long: "
                        "the 700-step ablation's report.json, its gains beside the long budget's (beside.md)")
    args = parser.parse_args(argv)
    runs, out, written = Path(args.runs).expanduser(), Path(args.out), []
    if args.long:
        return long_reports(runs, out, Path(args.short) if args.short else None)
    ablation = _evaluated([runs / "multirun" / "l2r_ablation"])
    if not ablation:
        raise SystemExit(f"no evaluated run under {runs / 'multirun' / 'l2r_ablation'}: run "
                         "experiments/ablation_queue.sh first")
    given = args.baselines if args.baselines is not None else sorted((runs / "baselines").glob("*/results.json"))
    baselines = _evaluated([Path(b).expanduser() for b in given])
    if _report(ablation + baselines, out / "ablation_smollm2", ORDER, paper=True)[1] is not None:
        written.append("ablation_smollm2")
    budget_runs = _evaluated([runs / "multirun" / "l2r_budget"])
    if budget_runs:
        trained_longer = budget_points(budget_runs, seeds=[0])  # the losses of the curve
        points = {loss: p for loss, p in budget_points(ablation + budget_runs, seeds=[0]).items() if loss in trained_longer}
        write_budget(points, out / "budget_smollm2", seeds=[0])
        written.append("budget_smollm2")
    for name, (loss, key) in SWEEPS.items():
        paths = sweep_paths(runs, name)
        if len(paths) < 2:
            print(f"[ablation_report] no evaluated run of experiment=l2r_sweep_{name} yet: skipped", flush=True)
            continue
        swept, report = _report(paths, out / f"sweep_{name}_smollm2", [loss])
        if report is None:
            continue
        write_sweep_curve(*sweep_points(swept, report, key), out / f"sweep_{name}_smollm2", key, loss=loss)
        written.append(f"sweep_{name}_smollm2")
    print(f"[ablation_report] wrote {', '.join(written)} under {out}", flush=True)
    return written


if __name__ == "__main__":
    main()
