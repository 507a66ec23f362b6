"""The Hydra callback that writes one report when a multirun ends (``hydra.callbacks`` of the
``conf/experiment/l2r_*`` multiruns)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from drafters import locks
from experiments.pipeline.eval_drafters import drafter_config
from experiments.pipeline.evaluation import evaluate_like_training
from experiments.reporting.runs import find_results, load_runs, order_runs
from experiments.reporting.write import write_report


class MultirunReport(Callback):
    """Hydra callback: when a multirun (e.g. ``experiment=l2r_ablation``) ends, write one report of
    every job's ``results.json`` to ``<sweep dir>/report`` (configure under ``hydra.callbacks``).

    ``baseline``: the configuration the gains are measured against (e.g. ``uniform``).
    ``baselines``: untrained drafters (``conf/eval/drafter/`` choices, e.g. ``prompt_lookup``,
    ``ar_assistant``) evaluated first with the jobs' target, suites and ``evaluate`` settings into
    ``<sweep dir>/baselines/<name>``, and reported as the last rows (``corpus_lookup`` reads the jobs' data
    folder, ``data.data_dir``). They are evaluated once per sweep
    dir (a later multirun into it reuses them) with ``baseline_seed`` (T > 0 sampling), whatever the jobs'
    seeds, so the rows of a multi-seed ablation run in several multiruns are one evaluation; multiruns
    ending together into one sweep dir evaluate them one after the other.
    """

    def __init__(self, baseline: str | None = "uniform", num_bootstrap: int = 1000, out: str | None = None,
                 name_by_dir: bool = False, baselines: Sequence[str] = (), baseline_seed: int = 0):
        self.baseline, self.num_bootstrap, self.out, self.name_by_dir = baseline, num_bootstrap, out, name_by_dir
        self.baselines, self.baseline_seed = list(baselines), baseline_seed
        for name in self.baselines:  # a misspelt name fails when the multirun starts, not after its jobs
            drafter_config(name)

    def evaluate_baselines(self, config, sweep_dir: Path) -> None:
        """Evaluate each of ``baselines`` into ``<sweep dir>/baselines/<name>`` (finished ones are skipped)."""
        if not self.baselines:
            return
        if not OmegaConf.select(config, "evaluate.enabled", default=False):
            print("[report] evaluate.enabled is false: the jobs were not evaluated, nor are the baselines", flush=True)
            return
        folder = sweep_dir / "baselines"
        folder.mkdir(parents=True, exist_ok=True)
        with locks.hold(folder, "baseline evaluations", wait=True):  # multiruns ending together: one at a time
            for name in self.baselines:
                print(f"[report] baseline {name}: evaluating into {folder / name}", flush=True)
                drafter = drafter_config(name)
                if "data_dir" in drafter:  # retrieval (corpus_lookup): the answers the jobs trained on
                    drafter["data_dir"] = OmegaConf.select(config, "data.data_dir")
                evaluate_like_training(config, drafter, folder / name, seed=self.baseline_seed)

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        self.evaluate_baselines(config, sweep_dir)
        try:
            found = find_results([sweep_dir])
        except FileNotFoundError as err:
            print(f"[report] nothing to report: {err}", flush=True)
            return
        out = Path(self.out) if self.out else sweep_dir / "report"
        names = [p.parent.name for p in found] if self.name_by_dir else None
        swept = OmegaConf.select(config, "hydra.sweeper.params.loss", default=None)
        order = [x.strip() for x in str(swept).split(",")] if swept else []
        runs = order_runs(load_runs([sweep_dir], names=names), [*order, *self.baselines], self.baseline)
        report = write_report(runs, out, baseline=self.baseline, num_bootstrap=self.num_bootstrap)
        print(f"[report] {len(report['configurations'])} configurations -> {out / 'report.md'}", flush=True)
