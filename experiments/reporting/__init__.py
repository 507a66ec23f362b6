"""Reports over evaluated runs (``python -m experiments.report``, the multirun callback):

* :mod:`.runs`: find every results.json, name the configurations, read training curves;
* :mod:`.stats`: τ tables, paired gains over the baseline, the mean over suites, seed aggregates;
* :mod:`.tables`: report.md; :mod:`.plots`: the PNGs; :mod:`.write`: one folder of both (paths made
  relative to the repository or the runs' folder);
* :mod:`.callback`: :class:`MultirunReport`, the Hydra callback that reports a finished multirun.
"""

from experiments.reporting.runs import CURVE_METRIC, Run, find_results, load_runs, order_runs, training_curve
from experiments.reporting.stats import MEAN, aggregate_seeds, build_report, mean_curves, seed_view
from experiments.reporting.tables import OVERLAP_MARK, render_markdown
from experiments.reporting.write import log_to_wandb, write_report

__all__ = ["CURVE_METRIC", "MEAN", "OVERLAP_MARK", "Run", "aggregate_seeds", "build_report", "find_results",
           "load_runs", "log_to_wandb", "mean_curves", "order_runs", "render_markdown", "seed_view",
           "training_curve", "write_report"]
