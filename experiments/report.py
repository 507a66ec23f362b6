"""Compare evaluated drafters: ``python -m experiments.report <run dirs or results.json> --out DIR``.

The work lives in :mod:`experiments.reporting` (runs, stats, tables, plots, write).

Gathers every ``results.json`` written by :mod:`experiments.evaluate` under the given paths (a run
dir, a multirun dir searched recursively, or the files themselves) and writes to ``--out``:

* ``report.md``: per temperature, a table of τ per suite (and their mean) per configuration with
  95% bootstrap intervals, the gain over the baseline configuration (``--baseline``, default
  ``uniform``) as relative % with a 95% interval of the ratio τ/τ_baseline from *paired* resampling of
  the prompts both evaluated (when per-prompt records are present), and the measured speeds;
* ``report.json``: the same numbers;
* PNG plots: ``tau.png`` (grouped bars with CI error bars, one panel per temperature), ``gain.png``
  (gain over the baseline per suite with paired intervals),
  ``position_acceptance.png`` (a_k vs k per suite), ``accept_hist.png`` (share of steps keeping
  0..K drafts) and, when the training logs are found (a CSV logger's ``metrics.csv`` with a
  ``val/tau_greedy`` column), ``training_curves.png``.

Seeds: when a configuration was trained with several seeds (e.g. ``seed=0,1,2`` on a multirun),
each run is labelled ``<loss>-s<seed>`` and compared with the baseline run of the *same* seed, and
report.md opens with across-seeds tables (τ mean ± SD over seeds; the mean of per-seed gains, each
seed's gain, and how many seeds gained); the plots then show one bar/line per configuration (seed
means; error bars = the range over seeds).

A configuration is named by the drafter's ``name`` in results.json when it has one (the baselines
``prompt_lookup`` and ``ar_assistant``, which have no training curves), else by the ``loss`` group
choice of the training run it came from, read from ``.hydra/hydra.yaml`` (or the ``loss=`` override in
``train_summary.json``) beside the results or beside the evaluated drafter; otherwise by its directory
name. ``--names`` overrides, in the order
the files are found. ``--wandb`` also logs the plots and the table to Weights & Biases (offline
unless ``--wandb-mode online``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from experiments.reporting.runs import load_runs, order_runs
from experiments.reporting.write import log_to_wandb, write_report


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="run dirs (searched recursively) or results.json files")
    parser.add_argument("--out", required=True, help="output directory for report.md, report.json and PNGs")
    parser.add_argument("--names", nargs="+", help="configuration names, in the order the results are found")
    parser.add_argument("--baseline", default="uniform", help="configuration the gains are relative to "
                        "('none': no gains; default uniform, skipped with a note when absent)")
    parser.add_argument("--order", nargs="+", default=[], help="configurations to list first, in this order "
                        "(the baseline always comes first)")
    parser.add_argument("--speed", nargs="+", default=[], help="evaluations at batch 1 (measure_target_only) whose "
                        "speedups make the speed section (experiments/reporting/speed.py)")
    parser.add_argument("--paper", action="store_true", help="add the paper's figures beside this report's "
                        "(experiments/reporting/paper.py)")
    parser.add_argument("--num-bootstrap", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wandb", action="store_true", help="also log the plots and table to W&B")
    parser.add_argument("--wandb-project", default="blockdraft")
    parser.add_argument("--wandb-mode", default="offline", choices=["offline", "online"])
    args = parser.parse_args(argv)
    if args.num_bootstrap < 1:
        parser.error(f"--num-bootstrap must be >= 1, got {args.num_bootstrap}")
    runs = load_runs(args.paths, args.names)
    baseline = None if args.baseline.lower() == "none" else args.baseline
    if baseline == "uniform" and baseline not in [r.name for r in runs] + [r.config for r in runs]:
        print(f"[report] no configuration named 'uniform' among {[r.name for r in runs]}: no gains "
              "(pass --baseline <name>)", flush=True)
        baseline = None
    runs = order_runs(runs, args.order, baseline)
    speed_runs = load_runs(args.speed) if args.speed else []
    report = write_report(runs, args.out, baseline=baseline, num_bootstrap=args.num_bootstrap, seed=args.seed,
                          speed_runs=speed_runs, paper=args.paper)
    if args.wandb:
        report["wandb_dir"] = log_to_wandb(report, args.out, project=args.wandb_project, mode=args.wandb_mode)
    print(f"[report] {len(runs)} configurations -> {Path(args.out) / 'report.md'}", flush=True)
    return report


if __name__ == "__main__":
    main()
