"""The long job (``python -m experiments.long``, ``conf/long.yaml``): issue 50's data, curves and long-trained
drafters as one resumable command for the background.

Stages, each its own entry point (its command printed and timed in ``long_summary.json``), in the order that
gives the results that matter most first:

1. ``data``: ``experiments.regenerate experiment=<train_experiment>`` (vLLM's CPU engine, resumable shards);
   ``agreement``: :mod:`experiments.pipeline.engine_agreement` on ``agreement_sample`` answers; ``export``: the
   answers recorded as an asset (``export_answers``, :mod:`experiments.pipeline.recorded_answers`); ``bench``: the
   pipeline benchmark (:mod:`experiments.bench.train`) while the job has the machine to itself;
2. ``gamma``: ``l2r_all`` at each ``gamma`` on all the answers for ``curve.steps`` steps; the value with the best
   held-out τ (``val/tau_greedy`` on the held-out split of the training answers, never the suites) goes to
   ``gamma.json`` and into every later ``l2r_all`` run;
3. ``long``: each of ``long.losses`` for the experiment's budget, the drafter saved at ``train.snapshot_steps``,
   its final drafter evaluated at ``long.temperatures`` and shipped (``ship``: :mod:`experiments.pipeline.ship`,
   ``<ship.dir>/<loss>_long`` with its model card; those in ``ship.dflash`` also exported to the DFlash format in
   ``<loss>_long/dflash``); after the long ``l2r_all``, the ar_assistant on the same answers for as long
   (``long_assistant``); after the last, ``long_report`` (``experiments.report``: the paired gains at the long
   budget);
4. ``curve``: each of ``curve.losses`` on each ``curve.train_rows`` answers (nested subsets), equal steps.

After each training its drafters (the final one and the snapshots) are evaluated on the main job's suites (T=0,
replayed; a long run's final drafter also at the other ``long.temperatures``) and ``<run dir>/data_scale`` is rewritten (:mod:`experiments.reporting.data_scale`: JSON, PNG, Markdown).
A stage whose output exists is skipped (a finished training's ``train_summary.json`` at its budget, an
evaluation's ``results.json`` with every suite); an unfinished one resumes itself (shards, ``last.ckpt``).

Run dir layout: ``data/``, ``sharegpt_answers/``, ``curve/<loss>-rows<N|all>[-gamma<g>]/``, ``long/<loss>/``
(with ``snapshots/step-<N>/``), ``assistant/``, ``eval/<run>/``, ``data_scale/``, ``long_report/``, ``assets/``
(``ship.dir``).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.jobs.main_job import portable_summary, stage
from experiments.pipeline.records import git_commit
from experiments.pipeline.ship import ship_assistant, ship_drafter
from experiments.reporting import data_scale
from experiments.reporting.runs import suites_tau

SUMMARY = "long_summary.json"


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def trained(run: Path, steps: int | None = None) -> bool:
    """Whether the training in ``run`` finished (at ``steps`` optimizer steps, when given)."""
    summary = _read(run / "train_summary.json")
    return summary is not None and (steps is None or summary["steps"] >= steps)


def evaluated(out: Path, suites: list[str], temperatures=(0.0,)) -> bool:
    """Whether ``out/results.json`` holds every one of ``temperatures`` for every one of ``suites``."""
    return all(suites_tau(out / "results.json", suites, t) is not None for t in temperatures)


class LongJob:
    """The stages of the module doc over one run dir; ``log`` is what ``long_summary.json`` records."""

    def __init__(self, cfg: DictConfig):
        self.cfg, self.run_dir = cfg, Path(cfg.paths.run_dir).resolve()
        self.science = [f"experiment={cfg.train_experiment}", "launch=run", f"seed={cfg.seed}", *cfg.common_overrides]
        self.log = {"run_dir": str(self.run_dir), "stages": [], "config": OmegaConf.to_container(cfg, resolve=True)}
        self.gamma: float | None = None  # l2r_all's, once chosen

    def stage(self, name: str, module: str, args: list[str]) -> None:
        stage(name, module, args, self.log)

    def run(self) -> dict:
        """The stages, the long drafters first (the results that matter most come first); the data_scale report
        is rewritten after each training."""
        t0 = time.time()
        self.data_dir = self.data()
        if self.cfg.get("bench") and not (self.run_dir / "bench_train.json").is_file():
            self.stage("bench", "experiments.bench.train", [*self.cfg.bench, "--out", str(self.run_dir / "bench_train.json")])
        self.gamma = self.choose_gamma()
        for run in itertools.chain(self.long(), self.curve()):
            self.evaluate([run])
            if run.parent.name == "long":
                self.ship(run)
            self.report()
            if run.parent.name == "long" and run.name == "l2r_all":
                self.assistant()
            if run.parent.name == "long" and run.name == self.cfg.long.losses[-1]:
                self.long_report()
        self.log["seconds_this_launch"] = round(time.time() - t0, 1)
        (self.run_dir / SUMMARY).write_text(portable_summary(self.log, self.run_dir))
        return self.log

    def report(self) -> None:
        data_scale.write(data_scale.collect(self.run_dir, self.suites()), self.run_dir / "data_scale",
                         gamma=_read(self.run_dir / "gamma.json"), data_dir=self.data_dir)

    # ---- data ----------------------------------------------------------------------------------------

    def data(self) -> Path:
        """Regenerate (resumes), measure the engine's agreement, export the asset; returns the data folder."""
        self.stage("data", "experiments.regenerate", [*self.science, *self.cfg.data_overrides,
                                                     f"hydra.run.dir={self.run_dir}/data"])
        data_dir = Path(_read(self.run_dir / "data" / "regenerate.json")["data_dir"])
        agreement = _read(data_dir / "agreement.json")
        if self.cfg.agreement_sample and (agreement is None or agreement["sample"] < self.cfg.agreement_sample):
            self.stage("agreement", "experiments.pipeline.engine_agreement",
                       [str(data_dir), "--sample", str(self.cfg.agreement_sample)])
        out = self.cfg.export_answers
        if out and not (Path(out) / "record.json").is_file():
            self.stage("export", "experiments.regenerate", [*self.science, *self.cfg.data_overrides,
                                                           f"export_answers={out}",
                                                           f"hydra.run.dir={self.run_dir}/data"])
        return data_dir

    # ---- training ------------------------------------------------------------------------------------

    def train(self, run: Path, loss: str, overrides: list[str], steps: int | None = None) -> Path:
        if not trained(run, steps):
            self.stage(f"train {run.relative_to(self.run_dir)}", "experiments.train",
                       [*self.science, f"loss={loss}", *overrides, f"hydra.run.dir={run}"])
        return run

    def _curve_run(self, loss: str, rows: int | None, gamma: float | None) -> Path:
        name = f"{loss}-rows{rows if rows is not None else 'all'}" + (f"-gamma{gamma:g}" if gamma is not None else "")
        steps = self.cfg.curve.steps
        overrides = [f"data.datamodule.max_train_rows={'null' if rows is None else rows}",
                     f"train.max_steps={steps}", *self.cfg.curve.overrides]
        if gamma is not None:
            overrides.append(f"loss.gamma={gamma}")
        return self.train(self.run_dir / "curve" / name, loss, overrides, steps)

    def choose_gamma(self) -> float | None:
        """l2r_all at each candidate γ on all the answers; the best held-out τ (``gamma.json``). One value: that one,
        without runs; none: l2r_all's configured γ (None)."""
        if len(self.cfg.gamma) < 2:
            return float(self.cfg.gamma[0]) if len(self.cfg.gamma) else None
        held_out = {}
        for g in self.cfg.gamma:
            summary = _read(self._curve_run("l2r_all", None, float(g)) / "train_summary.json")
            held_out[f"{float(g):g}"] = summary["val"]["val/tau_greedy"]
        chosen = float(max(held_out, key=held_out.get))
        (self.run_dir / "gamma.json").write_text(json.dumps(
            {"chosen": chosen, "held_out_tau": held_out, "steps": self.cfg.curve.steps,
             "measured_on": "val/tau_greedy: the held-out split of the training answers"}, indent=1) + "\n")
        print(f"[long] l2r_all's gamma: {chosen:g} (held-out τ {held_out})", flush=True)
        return chosen

    def _gamma(self, loss: str) -> float | None:
        """The γ chosen for ``loss`` (only ``l2r_all`` has one; None: its configured γ)."""
        return self.gamma if loss == "l2r_all" else None

    def curve(self) -> Iterator[Path]:
        """Each curve run, trained as it is reached."""
        for loss in self.cfg.curve.losses:
            for rows in self.cfg.curve.train_rows:
                yield self._curve_run(loss, rows, self._gamma(loss))

    def _continued(self, name: str) -> Path | None:
        """``<continue_from>/<name>``: the shipped model a long run continues (None without ``continue_from``)."""
        return Path(str(self.cfg.continue_from)) / name if self.cfg.get("continue_from") else None

    def _long_args(self, loss: str) -> list[str]:
        g, earlier = self._gamma(loss), self._continued(f"{loss}_long")
        return [*([f"loss.gamma={g}"] if g is not None else []), *self.cfg.long.overrides,
                *([f"drafter.init_from={earlier}"] if earlier is not None else [])]

    def long(self) -> Iterator[Path]:
        """Each long run, trained as it is reached."""
        for loss in self.cfg.long.losses:
            yield self.train(self.run_dir / "long" / loss, loss, self._long_args(loss))

    def assistant(self) -> None:
        """The ar_assistant for as long as the long l2r_all trained (null ``long_assistant``: none): its steps from
        a short timed run, so that its learning-rate schedule ends when the time does; the time is also its cap."""
        spec, run = self.cfg.get("long_assistant"), self.run_dir / "assistant"
        budget = (_read(self.run_dir / "long" / "l2r_all" / "train_summary.json") or {}).get("train_seconds")
        if not spec or budget is None:
            return
        if not trained(run):
            steps, earlier = self._assistant_steps(spec, budget), self._continued(spec.ship_as)
            self._train_assistant("train ar_assistant", run, spec, [
                f"train.max_steps={steps}", f"callbacks.train_clock.duration={{seconds:{int(budget * 1.1)}}}",
                *([f"init_from={earlier}"] if earlier is not None else [])])
        out = Path(self.cfg.ship.dir) / spec.ship_as
        if (out / "training.json").is_file():
            return
        ship_assistant(run / "export", out, self.data_record(), git_commit())
        print(f"[long] the ar_assistant shipped to {out}", flush=True)

    def _assistant_steps(self, spec, budget: float) -> int:
        """The ar_assistant's steps in ``budget`` seconds, timed over ``spec.probe_steps`` steps (no validation)."""
        probe = self.run_dir / "assistant_probe"
        if not trained(probe):
            self._train_assistant("time ar_assistant", probe, spec, [f"train.max_steps={spec.probe_steps}",
                                                                     f"train.val_every={10 ** 9}"])
        summary = _read(probe / "train_summary.json")
        seconds_per_step = summary["wall_time_s"] / summary["steps"]
        steps = max(1, int(budget / seconds_per_step))
        print(f"[long] ar_assistant: {seconds_per_step:.3f} s/step, {steps} steps in {budget:.0f} s", flush=True)
        return steps

    def _train_assistant(self, name: str, run: Path, spec, overrides: list[str]) -> None:
        self.stage(name, "experiments.train_assistant",
                   ["--config-name", spec.config_name, f"seed={self.cfg.seed}", *self.cfg.common_overrides,
                    *spec.overrides, *overrides, f"hydra.run.dir={run}"])

    # ---- shipping ------------------------------------------------------------------------------------

    def ship(self, run: Path) -> Path:
        """The long run's final drafter as ``<ship.dir>/<loss>_long`` with its card (and its DFlash export)."""
        name, out = f"{run.name}_long", Path(self.cfg.ship.dir) / f"{run.name}_long"
        dflash = run.name in self.cfg.ship.dflash
        if (out / "card.json").is_file() and (not dflash or (out / "dflash" / "config.json").is_file()):
            return out
        results = self.run_dir / "eval" / run.relative_to(self.run_dir) / "drafter" / "results.json"
        command = " ".join(["python -m experiments.train", *self.science, f"loss={run.name}", *self._long_args(run.name)])
        ship_drafter(run / "drafter", results, out, self.data_record(), name=name, command=command, extra=("dflash",),
                     continued_from=self._continued(name))
        if dflash:
            self.stage(f"export {name}", "experiments.export",
                       [f"drafter.path={run / 'drafter'}", f"out={out / 'dflash'}", f"results={results}",
                        f"dtype={self.cfg.ship.dflash_dtype or 'null'}"])
        print(f"[long] {name} shipped to {out}", flush=True)
        return out

    def data_record(self) -> dict:
        """The exported answers' record (their sha256, rows, tokens, engine); without an export, the data folder."""
        exported = _read(Path(self.cfg.export_answers) / "record.json") if self.cfg.export_answers else None
        return exported or {"data_dir": str(self.data_dir)}

    def long_report(self) -> None:
        """The paired gains of the long drafters over the long ``uniform`` (``long_report/``)."""
        evals = [self.run_dir / "eval" / "long" / loss / "drafter" for loss in self.cfg.long.losses]
        if (self.run_dir / "long_report" / "report.json").is_file():
            return
        self.stage("report long", "experiments.report", [*map(str, evals), "--out", str(self.run_dir / "long_report")])

    # ---- evaluation ----------------------------------------------------------------------------------

    def suites(self) -> list[str]:
        limits = [o.split("=")[0] for o in self.cfg.evaluate_overrides if o.startswith("suite.")]
        return sorted({o.split(".")[1] for o in limits})

    def evaluate(self, runs: list[Path]) -> None:
        """T=0 (replayed) of every trained drafter and snapshot in ``runs`` into ``eval/<its path>``."""
        drafters = []
        for run in runs:
            drafters += sorted(p for p in (run / "snapshots").glob("step-*") if p.is_dir())
            drafters.append(run / "drafter")
        for drafter in drafters:
            out = self.run_dir / "eval" / drafter.relative_to(self.run_dir)
            final_long = drafter.name == "drafter" and drafter.parent.parent.name == "long"
            temperatures = list(self.cfg.long.temperatures) if final_long else [0.0]
            if drafter.is_dir() and not evaluated(out, self.suites(), temperatures):
                self.stage(f"eval {drafter.relative_to(self.run_dir)}", "experiments.evaluate",
                           [f"target={self.cfg.eval_target}", *self.cfg.common_overrides, f"drafter.path={drafter}",
                            *self.cfg.evaluate_overrides, f"temperatures={temperatures}", f"hydra.run.dir={out}"])


def run_long_job(cfg: DictConfig) -> dict:
    """Every stage of the module doc; returns what ``<run dir>/long_summary.json`` records."""
    return LongJob(cfg).run()

