"""experiments.long: the stage list, γ chosen on held-out answers, the assistant's time budget, the skipping of
finished stages (fake stages), and the data_scale report; one real run on the tiny target (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from experiments.jobs import long_job
from experiments.reporting import data_scale

HELD_OUT = {"1": 1.50, "2": 1.62, "4": 1.55}  # val/tau_greedy of l2r_all per gamma (fake)
SUITES = ["gsm_symbolic", "humaneval", "mtbench"]


def _summary(run: Path, steps: int, tau: float, rows: int = 100, seconds: float | None = None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "drafter").mkdir(exist_ok=True)
    (run / "train_summary.json").write_text(json.dumps(
        {"steps": steps, "train_rows": rows, "val": {"val/tau_greedy": tau}, "train_seconds": seconds}))


def _results(out: Path, tau: float, temperatures: list[float] = (0.0,)) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"results": {s: {f"t{t:g}": {"tau": tau} for t in temperatures} for s in SUITES}}))


def _fake_stages(tmp_path, monkeypatch) -> list[tuple[str, str, list[str]]]:
    """Stages that write what the real ones would, and record their commands."""
    calls = []

    def fake(name, module, args, log):
        calls.append((name, module, args))
        log["stages"].append({"stage": name, "seconds": 0.0})
        run = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1]) \
            if any(a.startswith("hydra.run.dir=") for a in args) else None
        if module == "experiments.regenerate" and not any(a.startswith("export_answers=") for a in args):
            run.mkdir(parents=True, exist_ok=True)
            (run / "regenerate.json").write_text(json.dumps({"data_dir": str(tmp_path / "data_dir")}))
        elif module == "experiments.regenerate":
            out = Path(next(a for a in args if a.startswith("export_answers=")).split("=", 1)[1])
            out.mkdir(parents=True)
            (out / "record.json").write_text("{}")
        elif module == "experiments.pipeline.engine_agreement":
            (tmp_path / "data_dir").mkdir(exist_ok=True)
            (tmp_path / "data_dir" / "agreement.json").write_text(json.dumps({"sample": int(args[2])}))
        elif module == "experiments.train":
            gamma = next((a.split("=")[1] for a in args if a.startswith("loss.gamma=")), None)
            tau = HELD_OUT[f"{float(gamma):g}"] if gamma else 1.4
            long = run.parent.name == "long"
            _summary(run, 20000 if long else 2000, tau, seconds=3600.0 if long else 300.0)
            if long:
                (run / "snapshots" / "step-1000").mkdir(parents=True)
                (run / "logs").mkdir()
                (run / "logs" / "metrics.csv").write_text("step,val/tau_greedy\n999,1.3\n19999,1.6\n")  # as Lightning logs
        elif module == "experiments.train_assistant":
            steps = int(next(a for a in args if a.startswith("train.max_steps=")).split("=")[1])
            _summary(run, steps, 1.2)
            summary = json.loads((run / "train_summary.json").read_text())
            (run / "train_summary.json").write_text(json.dumps({**summary, "wall_time_s": 0.9 * steps}))
        elif module == "experiments.evaluate":
            temperatures = next(a for a in args if a.startswith("temperatures=")).split("=")[1]
            _results(run, 1.5, json.loads(temperatures))
        elif module == "experiments.export":
            out = Path(next(a for a in args if a.startswith("out=")).split("=", 1)[1])
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        elif module == "experiments.report":
            Path(args[-1]).mkdir(parents=True)
            (Path(args[-1]) / "report.json").write_text("{}")
        elif module == "experiments.bench.train":
            Path(args[-1]).write_text("{}")

    def ship(drafter_dir, results, out, record, *, name, command, extra, continued_from):
        calls.append((f"ship {name}", "ship", [str(drafter_dir), str(results), command, str(continued_from)]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "card.json").write_text("{}")

    def ship_assistant(export_dir, out, record, commit):
        calls.append(("ship ar_assistant", "ship", [str(export_dir), str(out)]))
        out.mkdir(parents=True)
        (out / "training.json").write_text("{}")

    monkeypatch.setattr(long_job, "stage", fake)
    monkeypatch.setattr(long_job, "ship_drafter", ship)
    monkeypatch.setattr(long_job, "ship_assistant", ship_assistant)
    return calls


def _compose(config: str, *overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config, overrides=list(overrides))


def _cfg(tmp_path, *overrides):
    return _compose("long", f"paths.run_dir={tmp_path / 'run'}", f"export_answers={tmp_path / 'run' / 'answers'}",
                    *overrides)


def test_the_long_job_chooses_gamma_held_out_and_gives_the_assistant_the_drafters_time(tmp_path, monkeypatch):
    calls = _fake_stages(tmp_path, monkeypatch)
    cfg = _cfg(tmp_path)
    log = long_job.run_long_job(cfg)
    names = [c[0] for c in calls]
    assert names[:4] == ["data", "agreement", "export", "bench"]
    gammas = [f"train curve/l2r_all-rowsall-gamma{g}" for g in (1, 2, 4)]
    assert names[4:7] == gammas  # γ first: every later l2r_all run uses the chosen one
    chosen = json.loads((tmp_path / "run" / "gamma.json").read_text())
    assert chosen["chosen"] == 2.0 and chosen["held_out_tau"] == HELD_OUT  # the best held-out τ, not the suites'
    by_name = {c[0]: c[2] for c in calls}
    assert "loss.gamma=2.0" in by_name["train curve/l2r_all-rows738-gamma2"]
    assert "loss.gamma=2.0" in by_name["train long/l2r_all"] and not any(
        a.startswith("loss.gamma") for a in by_name["train long/uniform"])
    assert "data.datamodule.max_train_rows=738" in by_name["train curve/uniform-rows738"]
    assert "data.datamodule.max_train_rows=null" in by_name["train curve/uniform-rowsall"]
    assert "train.max_steps=2000" in by_name["train curve/uniform-rows2500"]
    assert "train.max_steps=50" in by_name["time ar_assistant"]
    assistant = by_name["train ar_assistant"]
    assert "train.max_steps=4000" in assistant  # 3600 s at the timed 0.9 s/step: the schedule ends with the time
    assert "callbacks.train_clock.duration={seconds:3960}" in assistant  # the long l2r_all's time (+10%) caps it
    evaluated = [n for n in names if n.startswith("eval ")]
    assert "eval long/l2r_all/snapshots/step-1000" in evaluated and "eval long/l2r_all/drafter" in evaluated
    assert "eval curve/l2r_all-rowsall-gamma4/drafter" not in evaluated  # a γ candidate not chosen
    assert "temperatures=[0.0, 1.0]" in by_name["eval long/l2r_all/drafter"]  # the final long drafters: T=0 and T=1
    assert "temperatures=[0.0]" in by_name["eval long/l2r_all/snapshots/step-1000"]
    shipped = [c for c in calls if c[1] == "ship" and c[0] != "ship ar_assistant"]
    assert [c[0] for c in shipped] == ["ship l2r_all_long", "ship uniform_long"]
    assert shipped[0][2][1].endswith("eval/long/l2r_all/drafter/results.json")  # the card's τ: these weights'
    assert "loss.gamma=2.0" in shipped[0][2][2] and "loss=l2r_all" in shipped[0][2][2]  # the command that trained it
    assert names.index("eval long/l2r_all/drafter") < names.index("ship l2r_all_long") < names.index(
        "export l2r_all_long") < names.index("train ar_assistant")
    assert "export uniform_long" not in names  # ship.dflash: l2r_all only
    assert names.index("train ar_assistant") + 1 == names.index("ship ar_assistant")
    assert by_name["ship ar_assistant"] == [str(tmp_path / "run" / "assistant" / "export"),
                                            str(tmp_path / "run" / "assets" / "ar_assistant_smollm2")]
    assert names.index("ship uniform_long") < names.index("report long") < names.index("train curve/uniform-rows738")
    assert by_name["report long"][:2] == [str(tmp_path / "run" / "eval" / "long" / loss / "drafter")
                                          for loss in ("l2r_all", "uniform")]
    assert [s["stage"] for s in log["stages"]] == [n for n in names if not n.startswith("ship ")]

    doc = json.loads((tmp_path / "run" / "data_scale" / "data_scale.json").read_text())
    assert [p["train_rows"] for p in doc["answers"]["uniform"]] == [100, 100, 100]
    assert [p["run"] for p in doc["answers"]["l2r_all"]] == [
        "curve/l2r_all-rows2500-gamma2", "curve/l2r_all-rows738-gamma2", "curve/l2r_all-rowsall-gamma2"]
    steps = doc["steps"]["l2r_all"]
    assert [(p["steps"], p["held_out_tau"], p["suites_tau"]["mean"]) for p in steps] == [(1000, 1.3, 1.5),
                                                                                       (20000, 1.62, 1.5)]  # final: its summary's (γ = 2)
    assert (tmp_path / "run" / "data_scale" / "data_scale.png").stat().st_size > 0

    calls.clear()  # run again: everything is there, only the data stage (it resumes itself) runs
    long_job.run_long_job(cfg)
    assert [c[0] for c in calls] == ["data"]


def test_a_continued_long_job_starts_each_long_run_and_the_assistant_from_the_shipped_ones(tmp_path, monkeypatch):
    calls = _fake_stages(tmp_path, monkeypatch)
    shipped = tmp_path / "assets"
    long_job.run_long_job(_cfg(tmp_path, f"continue_from={shipped}", "gamma=[1.0]", "curve.train_rows=[]", "bench=null"))
    by_name = {c[0]: c[2] for c in calls}
    assert "loss.gamma=1.0" in by_name["train long/l2r_all"]  # one γ: that one, without runs
    for loss in ("l2r_all", "uniform"):
        assert by_name[f"train long/{loss}"][-2] == f"drafter.init_from={shipped / f'{loss}_long'}"
        assert by_name[f"ship {loss}_long"][3] == str(shipped / f"{loss}_long")  # the card names what it continued
    assert f"init_from={shipped / 'ar_assistant_smollm2'}" in by_name["train ar_assistant"]
    assert not any(a.startswith("init_from=") for a in by_name["time ar_assistant"])  # the probe only times steps
    assert not any(n.startswith("train curve/") for n in by_name)


def test_long_continue_trains_the_shipped_drafters_further_without_an_engine(tmp_path, monkeypatch):
    """`--config-name long_continue` on a new machine: the answers installed from the asset (no vLLM, no agreement
    run), the chosen γ without its runs, no curves or benchmark; each run starts from experiments/assets."""
    from experiments.data.target import asset_path

    calls = _fake_stages(tmp_path, monkeypatch)
    cfg = _compose("long_continue", f"paths.run_dir={tmp_path / 'run'}", f"export_answers={tmp_path / 'answers'}")
    long_job.run_long_job(cfg)
    by_name = {c[0]: c[2] for c in calls}
    assert list(by_name)[:3] == ["data", "export", "train long/l2r_all"]
    assert "data=sharegpt_answers" in by_name["data"] and "data=sharegpt_answers" in by_name["export"]
    chosen = json.loads(Path("experiments/results/long/gamma.json").read_text())["chosen"]
    assert f"loss.gamma={chosen}" in by_name["train long/l2r_all"]  # the γ the long job chose on held-out answers
    for loss in ("l2r_all", "uniform"):
        assert f"drafter.init_from={asset_path(f'{loss}_long')}" in by_name[f"train long/{loss}"]
    assert f"init_from={asset_path('ar_assistant_smollm2')}" in by_name["train ar_assistant"]
    assert not any(n.startswith("train curve/") for n in by_name)


def test_the_recorded_answers_fill_the_data_folder_the_regeneration_would():
    """data=sharegpt_answers and data=sharegpt_mix name the same data folder (what made the answers, not how they
    arrive), so a training with the long experiment finds the installed answers instead of regenerating them."""
    made, recorded = (_compose("regenerate", "experiment=smollm2_long", *extra).data
                      for extra in ((), ("data=sharegpt_answers",)))
    assert recorded.backend._target_ != made.backend._target_
    assert recorded.generation == made.generation


def test_without_a_long_l2r_all_the_assistant_has_no_time_budget(tmp_path, monkeypatch):
    calls = _fake_stages(tmp_path, monkeypatch)
    cfg = _cfg(tmp_path, "gamma=[2.0]", "long.losses=[uniform]", "agreement_sample=0")
    long_job.run_long_job(cfg)
    names = [c[0] for c in calls]
    assert "agreement" not in names and "train ar_assistant" not in names
    # one candidate: nothing to choose, the curves' l2r_all runs use it
    assert [n for n in names if "gamma" in n and n.startswith("train")] == [
        f"train curve/l2r_all-rows{r}-gamma2" for r in (738, 2500, "all")]
    assert not (tmp_path / "run" / "gamma.json").exists()


def test_data_scale_waits_for_every_suite_before_it_counts_an_evaluation(tmp_path):
    run = tmp_path / "run"
    _summary(run / "curve" / "uniform-rows738", 2000, 1.3, rows=738)
    (run / "eval" / "curve" / "uniform-rows738" / "drafter").mkdir(parents=True)
    (run / "eval" / "curve" / "uniform-rows738" / "drafter" / "results.json").write_text(
        json.dumps({"results": {"humaneval": {"t0": {"tau": 1.4}}}}))
    doc = data_scale.collect(run, SUITES)
    assert doc["answers"]["uniform"][0]["suites_tau"] is None  # two suites missing: no mean yet
    _results(run / "eval" / "curve" / "uniform-rows738" / "drafter", 1.25)
    doc = data_scale.collect(run, SUITES)
    assert doc["answers"]["uniform"][0]["suites_tau"]["mean"] == 1.25
    assert doc["answers"]["uniform"][0]["held_out_tau"] == 1.3


@pytest.mark.slow
def test_the_long_job_runs_on_the_tiny_target(tmp_path):
    """Every stage for real on the tiny target: data, γ, curve, a long run with a snapshot, evaluations, report."""
    env = {**os.environ, "BLOCKDRAFT_RUNS": str(tmp_path / "runs"), "HF_HUB_OFFLINE": "1"}
    run = tmp_path / "long"
    cmd = [sys.executable, "-m", "experiments.long", "train_experiment=smoke", "eval_target=tiny", "agreement_sample=0",
           "export_answers=null", "gamma=[1.0,2.0]", "curve.losses=[uniform,l2r_all]", "curve.train_rows=[3,null]",
           "curve.steps=2", "long.losses=[l2r_all]", "long_assistant=null", "bench=null",
           "long.overrides=['train.max_steps=4','train.snapshot_steps=[2]']",
           ("evaluate_overrides=['progress=false','replay_greedy=true','suite.humaneval.limit=2',"
           "'suite.gsm_symbolic.limit=2','suite.mtbench.limit=1']"), f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run / "long" / "l2r_all" / "snapshots" / "step-2" / "config.json").is_file()
    assert json.loads((run / "long" / "l2r_all" / "train_summary.json").read_text())["train_seconds"] > 0
    doc = json.loads((run / "data_scale" / "data_scale.json").read_text())
    assert [p["train_rows"] for p in doc["answers"]["uniform"]] == [3, doc["answers"]["uniform"][1]["train_rows"]]
    assert doc["answers"]["uniform"][1]["train_rows"] > 3
    assert [p["steps"] for p in doc["steps"]["l2r_all"]] == [2, 4]
    final = json.loads((run / "long" / "l2r_all" / "train_summary.json").read_text())["val"]["val/tau_greedy"]
    assert doc["steps"]["l2r_all"][-1]["held_out_tau"] == round(final, 4)
    assert all(p["suites_tau"]["mean"] >= 1.0 for pts in doc["answers"].values() for p in pts)
    assert doc["gamma"]["chosen"] in (1.0, 2.0)
    card = json.loads((run / "assets" / "l2r_all_long" / "card.json").read_text())  # shipped with its card
    assert set(card["tau"]) == {"T=0", "T=1"} and card["training"]["steps"] == 4
    assert (run / "assets" / "l2r_all_long" / "dflash" / "config.json").is_file()  # and in the DFlash format
    assert (run / "long_report" / "report.md").is_file()


def test_the_long_jobs_run_dir_is_fixed_so_the_same_command_resumes(monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setenv("BLOCKDRAFT_RUNS", "/runs")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("long", return_hydra_config=True)
    assert OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"] == "/runs/long/smollm2_long-s0"
