"""The Hydra callback that writes one report when a multirun ends (``hydra.callbacks`` of the
``conf/experiment/l2r_*`` multiruns)."""

from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from experiments.reporting.runs import find_results, load_runs, order_runs
from experiments.reporting.write import write_report


class MultirunReport(Callback):
    """Hydra callback: when a multirun (e.g. ``experiment=l2r_ablation``) ends, write one report of
    every job's ``results.json`` to ``<sweep dir>/report`` (configure under ``hydra.callbacks``)."""

    def __init__(self, baseline: str | None = "uniform", num_bootstrap: int = 1000, out: str | None = None,
                 name_by_dir: bool = False):
        self.baseline, self.num_bootstrap, self.out, self.name_by_dir = baseline, num_bootstrap, out, name_by_dir

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            found = find_results([sweep_dir])
        except FileNotFoundError as err:
            print(f"[report] nothing to report: {err}", flush=True)
            return
        out = Path(self.out) if self.out else sweep_dir / "report"
        names = [p.parent.name for p in found] if self.name_by_dir else None
        swept = OmegaConf.select(config, "hydra.sweeper.params.loss", default=None)
        order = [x.strip() for x in str(swept).split(",")] if swept else []
        runs = order_runs(load_runs([sweep_dir], names=names), order, self.baseline)
        report = write_report(runs, out, baseline=self.baseline, num_bootstrap=self.num_bootstrap)
        print(f"[report] {len(report['configurations'])} configurations -> {out / 'report.md'}", flush=True)
