"""The main job (``python -m experiments.main``, the README's first command): every stage in turn.

On the embedded default (tiny target, local suites) it runs the whole pipeline end to end:

1. ``experiments.regenerate`` — the target answers the training prompts (cached across runs);
2. ``experiments.train`` — one drafter per loss in ``losses`` (default: the uniform baseline and
   the all-three composite ``l2r_all``), same data, budget and seed;
3. ``experiments.evaluate`` — each drafter on every suite at T=0 and T=1 through the exact verifier,
   then the untrained baselines in ``baselines`` (default ``prompt_lookup`` and the shipped
   ``ar_assistant``, ``drafter=<name>``) with the same settings;
4. ``experiments.report`` — the Markdown table and the plots (the baselines are the last rows).

Each stage runs as its own entry point (a subprocess, its own Hydra run dir under this job's run
dir), so every stage can also be rerun by hand with the command printed here. Stages that already
finished are skipped by the stages themselves (regeneration shards, ``last.ckpt``, results.json),
so a killed main job resumes when started again with ``hydra.run.dir=<its run dir>``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.data.suites import cache_dir
from experiments.pipeline.paths import REPO


def stage(name: str, module: str, overrides: list[str], log: dict) -> None:
    """Run ``python -m <module> <overrides>``; print and record its wall time."""
    cmd = [sys.executable, "-m", module, *overrides]
    print(f"\n=== [{name}] {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
    t = time.time()
    proc = subprocess.run(cmd, check=False)
    seconds = time.time() - t
    log["stages"].append({"stage": name, "command": " ".join(cmd[1:]), "seconds": round(seconds, 1)})
    print(f"=== [{name}] done in {seconds / 60:.1f} min", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"stage {name!r} failed with exit code {proc.returncode}: {' '.join(cmd[1:])}")


def portable_summary(log: dict, run_dir: Path) -> str:
    """main_summary.json's text with paths relative to the repository or to the job's run dir (``.``), and
    regenerated data as ``$BLOCKDRAFT_CACHE/...``."""
    text = json.dumps(log, indent=1)
    for folder in (run_dir, REPO):  # the run dir first: it may lie inside the repository
        quoted = json.dumps(str(folder))[1:-1]
        text = text.replace(quoted + "/", "").replace(f'"{quoted}"', '"."')
    return text.replace(json.dumps(str(cache_dir().expanduser().resolve()))[1:-1] + "/", "$BLOCKDRAFT_CACHE/")


def trained_data_dir(run_dir: Path, losses) -> str | None:
    """The regenerated data folder the main job's drafters trained on (their train_summary.json), if any."""
    for loss in losses:
        summary = run_dir / "train" / loss / "train_summary.json"
        if summary.is_file():
            return json.loads(summary.read_text())["data_dir"]
    return None


def baseline_overrides(overrides, baseline: str, data_dir: str | None) -> list[str]:
    """``baseline_overrides.<baseline>`` with ``{data_dir}`` filled in; a clear error where it is unknown."""
    if data_dir is None and any("{data_dir}" in o for o in overrides):
        raise ValueError(f"baseline_overrides.{baseline} needs the drafters' data folder ({{data_dir}}), known from a "
                         f"trained loss's train_summary.json: train at least one loss, or drop {baseline} from baselines")
    return [o.replace("{data_dir}", str(data_dir)) for o in overrides]


def run_main_job(cfg: DictConfig) -> dict:
    """Regenerate, train and evaluate each loss, evaluate the baselines, report (``conf/main.yaml``);
    returns the stage log written to ``<run dir>/main_summary.json``."""
    run_dir = Path(cfg.paths.run_dir).resolve()
    common = [f"target={cfg.target_choice}", *cfg.common_overrides]
    if cfg.target_choice != "tiny":
        common.append(f"target.path={cfg.target.path}")
    log = {"run_dir": str(run_dir), "stages": [], "config": OmegaConf.to_container(cfg, resolve=True)}
    t0 = time.time()

    data = list(cfg.data_overrides)  # the regenerated data, shared by regenerate and train
    stage("regenerate", "experiments.regenerate", [*common, *data, *cfg.regenerate_overrides,
                                                    f"hydra.run.dir={run_dir}/regenerate"], log)
    eval_dirs = []
    for loss in cfg.losses:
        train_dir = run_dir / "train" / loss
        stage(f"train {loss}", "experiments.train", [*common, *data, f"loss={loss}", f"seed={cfg.seed}",
                                                     *cfg.train_overrides, f"hydra.run.dir={train_dir}"], log)
        eval_dir = run_dir / "eval" / loss
        stage(f"evaluate {loss}", "experiments.evaluate", [*common, f"drafter.path={train_dir}/drafter",
                                                           *cfg.evaluate_overrides, *cfg.trained_evaluate_overrides,
                                                           f"hydra.run.dir={eval_dir}"], log)
        eval_dirs.append(eval_dir)
    data_dir = trained_data_dir(run_dir, cfg.losses)
    for baseline in cfg.baselines:
        eval_dir = run_dir / "eval" / baseline
        extra = baseline_overrides(cfg.baseline_overrides.get(baseline, []), baseline, data_dir)
        stage(f"evaluate {baseline}", "experiments.evaluate", [*common, f"drafter={baseline}", *extra,
                                                               *cfg.evaluate_overrides, f"hydra.run.dir={eval_dir}"], log)
        eval_dirs.append(eval_dir)
    report_dir = run_dir / "report"
    stage("report", "experiments.report", [*map(str, eval_dirs), "--out", str(report_dir)], log)

    log["total_seconds"] = round(time.time() - t0, 1)
    (run_dir / "main_summary.json").write_text(portable_summary(log, run_dir))
    print("\n" + (report_dir / "report.md").read_text(), flush=True)
    print("stage times:")
    for s in log["stages"]:
        print(f"  {s['stage']:<24s} {s['seconds'] / 60:6.1f} min")
    print(f"  {'total':<24s} {log['total_seconds'] / 60:6.1f} min   (plots and tables in {report_dir})")
    return log

