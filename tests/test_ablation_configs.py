"""experiment=l2r_ablation and experiment=l2r_budget: the main job's training (experiment=smollm2) with the
ablation's losses and seeds, and with its schedule scaled; experiments/ablation_queue.sh runs their jobs."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf
from test_configs import CONF, ROOT, _compose, _sweep_jobs

from experiments import times

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# What the SmolLM2 ablation and budget curve keep from experiment=smollm2 (unresolved: same settings, same sources).
SMOLLM2_KEYS = ["target", "drafter", "data", "module", "optimizer", "loss", "seed", "num_threads", "suite",
                "evaluate.enabled", "train.checkpoint_every", "train.gradient_clip_val", "scheduler.min_lr_ratio"]


def _same_as_smollm2(cfg, loss: str, seed: str) -> None:
    main = _compose("train", ["experiment=smollm2", f"loss={loss}", f"seed={seed}"])
    for key in SMOLLM2_KEYS:
        ours, theirs = OmegaConf.select(cfg, key), OmegaConf.select(main, key)
        if OmegaConf.is_config(ours):
            ours, theirs = OmegaConf.to_container(ours), OmegaConf.to_container(theirs)
        assert ours == theirs, key


def test_the_smollm2_ablation_is_the_main_jobs_training_with_every_loss_and_three_seeds():
    jobs = _sweep_jobs("l2r_ablation", [])
    losses = sorted(p.stem for p in (CONF / "loss").glob("*.yaml"))
    assert sorted((j["loss"], j["seed"]) for j in jobs) == sorted((loss, s) for loss in losses for s in "012")
    cfg = _compose("train", ["experiment=l2r_ablation", "loss=decay", "seed=1"])
    _same_as_smollm2(cfg, "decay", "1")
    main = _compose("train", ["experiment=smollm2"])
    for key in ("train.max_steps", "train.val_every", "scheduler.warmup_steps", "scheduler.max_steps"):
        assert OmegaConf.select(cfg, key) == OmegaConf.select(main, key), key
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN" and not cfg.evaluate.enabled  # training only
    sweep = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert sweep["sweep"]["dir"].endswith("/multirun/l2r_ablation") and sweep["run"]["dir"] == \
        "${hydra.sweep.dir}/${hydra.sweep.subdir}"  # launch=run resumes the multirun's run dir
    assert sweep["sweep"]["subdir"] == "${hydra:runtime.choices.loss}-s${seed}"
    tiny = _compose("train", ["experiment=l2r_ablation_tiny"]).hydra.sweep.dir
    assert tiny != sweep["sweep"]["dir"] and tiny.endswith("/multirun/l2r_ablation_tiny")


@pytest.mark.parametrize("budget", [1, 2, 4])
def test_the_budget_curve_scales_the_main_jobs_schedule(budget):
    """experiment=l2r_budget at budget b: the main job's training with max_steps, val_every and warmup times b
    (budget=1 is experiment=smollm2's schedule exactly); the sweep is uniform, decay, l2r_all at 2x and 4x."""
    jobs = _sweep_jobs("l2r_budget", [])
    assert sorted((j["loss"], j["budget"], j["seed"]) for j in jobs) == sorted(
        (loss, b, "0") for loss in ("uniform", "decay", "l2r_all") for b in ("2", "4"))
    cfg = _compose("train", ["experiment=l2r_budget", "loss=l2r_all", f"budget={budget}"])
    _same_as_smollm2(cfg, "l2r_all", "0")
    main = _compose("train", ["experiment=smollm2"])
    for key in ("train.max_steps", "train.val_every", "scheduler.warmup_steps"):
        assert OmegaConf.select(cfg, key) == budget * OmegaConf.select(main, key), key
    assert cfg.scheduler.max_steps == cfg.trainer.max_steps == cfg.train.max_steps
    assert OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"] == \
        "${hydra:runtime.choices.loss}-x${budget}-s${seed}"


def test_times_resolver_scales_step_counts_and_refuses_fractions():
    assert times(700, 4) == 2800 and times(40, 1.5) == 60
    with pytest.raises(ValueError, match="whole number"):
        times(35, 0.5)
    with pytest.raises(ValueError, match="needs two numbers"):
        times(700, "abc")


def test_the_ablation_queue_trains_the_sweeps_losses():
    """experiments/ablation_queue.sh's loss list is experiment=l2r_ablation's, and its budget runs are l2r_budget's."""
    script = (ROOT / "experiments" / "ablation_queue.sh").read_text()
    (losses,) = re.findall(r"^LOSSES=\((.*)\)$", script, flags=re.MULTILINE)
    assert losses.split() == [j["loss"] for j in _sweep_jobs("l2r_ablation", ["seed=0"])]
    budget = {tuple(m) for m in re.findall(r"budget (\w+) (\d)", script)}
    assert budget == {(j["loss"], j["budget"]) for j in _sweep_jobs("l2r_budget", [])}


def test_the_ablation_queue_evaluates_like_the_main_job():
    """The queue's evaluation of each trained drafter uses conf/main.yaml's evaluate_overrides (suites, batch, replay)."""
    from omegaconf import OmegaConf

    script = (ROOT / "experiments" / "ablation_queue.sh").read_text()
    call = script[script.index("-m experiments.evaluate"): script.index('"hydra.run.dir=$out"')]
    main = OmegaConf.load(ROOT / "conf" / "main.yaml")
    for override in main.evaluate_overrides:  # the thread count is the queue's THREADS (default 2, main's)
        assert (override if not override.startswith("num_threads=") else '"num_threads=$threads"') in call, override
    assert 'threads="${THREADS:-2}"' in script and "num_threads=2" in main.evaluate_overrides


def test_the_depth_runs_are_the_main_jobs_training_with_two_layers():
    """experiment=l2r_layers: the main job's training (1 layer) with the drafter's depth set by `layers`; the
    queue trains its sweep's jobs."""
    jobs = _sweep_jobs("l2r_layers", [])
    assert sorted((j["loss"], j["layers"], j["seed"]) for j in jobs) == [("l2r_all", "2", "0"), ("uniform", "2", "0")]
    cfg = _compose("train", ["experiment=l2r_layers", "loss=l2r_all", "layers=2"])
    main = _compose("train", ["experiment=smollm2", "loss=l2r_all"])
    assert cfg.drafter.num_layers == 2 and main.drafter.num_layers == 1
    cfg.drafter.num_layers = main.drafter.num_layers
    _same_as_smollm2(cfg, "l2r_all", "0")
    assert OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"] == \
        "${hydra:runtime.choices.loss}-L${layers}-s${seed}"
    script = (ROOT / "experiments" / "ablation_queue.sh").read_text()
    assert {tuple(m) for m in re.findall(r"^.*layers (\w+) (\d)", script, flags=re.MULTILINE)} >= \
        {(j["loss"], j["layers"]) for j in jobs}


FAKE_PYTHON = r'''#!/usr/bin/env python3
"""Stands in for the queue's python: records each call, writes what a finished training or evaluation leaves."""
import json, os, pathlib, sys, time
if sys.argv[1] == "-c":  # the long queue's precision probe
    sys.exit(print(os.environ.get("FAKE_PRECISION", "32")))
module, kv = sys.argv[2], dict(a.lstrip("+").split("=", 1) for a in sys.argv[3:])
runs = pathlib.Path(os.environ["BLOCKDRAFT_RUNS"])
if module == "experiments.train":
    swept = [k for k in kv if k.startswith("loss.")]  # a loss sweep: <key><value>-s<seed>
    sub = kv.get("hydra.sweep.subdir") or (
        {"l2r_ablation": "{loss}-s{seed}", "l2r_budget": "{loss}-x{budget}-s{seed}", "ablation_long": "{loss}-s{seed}",
         "l2r_layers": "{loss}-L{layers}-s{seed}"}[kv["experiment"]].format(**kv) if not swept else
        f"{swept[0][5:]}{kv[swept[0]]}-s{kv['seed']}")
    run = runs / "multirun" / kv["experiment"] / sub
    run.mkdir(parents=True, exist_ok=True)
    try:
        (run / "busy").mkdir()  # two jobs in one run at once would fail here
    except FileExistsError:
        sys.exit(3)
    time.sleep(0.05)
    (run / "busy").rmdir()
    (run / "drafter").mkdir(exist_ok=True)
    (run / "train_summary.json").write_text("{}")
else:  # a trained run's <run>/eval (eval_tree, ...), or a baseline's own folder
    out = pathlib.Path(kv["hydra.run.dir"])
    run = out.parent if out.name.startswith("eval") else out
    keys = {f"t{float(t):g}": {} for t in json.loads(kv["temperatures"])}
    config = ({"max_draft_tokens": int(kv["drafter.max_draft_tokens"])} if "drafter.max_draft_tokens" in kv else
              {"tree_policy": {"budget": int(kv["drafter.budget"])}} if "drafter.budget" in kv else
              {"num_draft_tokens": int(kv["drafter.num_draft_tokens"])} if "drafter.num_draft_tokens" in kv else {})
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"drafter": {"config": config},
                                                  "results": {s: keys for s in ("a", "b", "c")}}))
with open(runs / "calls.jsonl", "a") as f:
    f.write(json.dumps({"module": module, "run": str(run.relative_to(runs)), "threads": kv["num_threads"],
                        "name": kv.get("drafter.name"), "temperatures": kv.get("temperatures"),
                        "drafter": kv.get("drafter"), "path": kv.get("drafter.path"),
                        "out": kv.get("hydra.run.dir"), "redo": kv.get("redo_if_changed")}) + "\n")
'''


def _run_queue(tmp_path, **env):
    import json
    import os
    import subprocess

    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    runs = tmp_path / "runs"
    env = {**os.environ, "BLOCKDRAFT_RUNS": str(runs), "PYTHON": str(fake), "NICE": "0", **env}
    done = subprocess.run(["bash", str(ROOT / "experiments" / "ablation_queue.sh")], check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = runs / "calls.jsonl"
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    record.unlink(missing_ok=True)
    return calls


def test_the_queues_workers_share_the_runs_and_a_relaunch_only_adds_what_is_missing(tmp_path):
    """Two workers train every run of the order exactly once and evaluate each (a run held by one worker is not
    started by the other); a relaunch trains nothing again, and evaluates again only for a new temperature."""
    from collections import Counter

    calls = _run_queue(tmp_path, WORKERS="2", THREADS="1", ASSISTANT="main/assistant/export")
    baselines = {c["run"]: c for c in calls if c["run"].startswith("baselines/")}
    assert {run: (c["drafter"], c["path"], c["temperatures"]) for run, c in baselines.items()} == {
        "baselines/prompt_lookup": ("prompt_lookup", None, "[0.0,1.0]"),
        "baselines/ar_assistant": ("ar_assistant", "main/assistant/export", "[0.0,1.0]")}
    calls = [c for c in calls if c["run"] not in baselines]
    trained = Counter(c["run"] for c in calls if c["module"] == "experiments.train")
    evaluated = Counter(c["run"] for c in calls if c["module"] == "experiments.evaluate")
    expected = {f"multirun/l2r_ablation/{loss}-s{seed}" for loss in
                ["uniform", "decay", "focal", "chain", "decay_focal", "l2r_all", "dpace", "soft_all"] for seed in range(3)}
    expected |= {f"multirun/l2r_budget/{loss}-x{b}-s0" for loss, b in
                 [("l2r_all", 2), ("uniform", 2), ("decay", 2), ("uniform", 4), ("decay", 4), ("l2r_all", 4)]}
    expected |= {f"multirun/l2r_layers/{loss}-L2-s0" for loss in ("l2r_all", "uniform")}
    sweeps = {}  # the loss sweeps' runs, by their run dir as the experiments name them, and their rows' names
    for experiment in ("l2r_sweep_gamma", "l2r_sweep_focal", "l2r_sweep_chain"):
        for job in _sweep_jobs(experiment, []):
            (key,) = [k for k in job if k.startswith("loss.")]
            sweeps[f"multirun/{experiment}/{key[5:]}{job[key]}-s{job['seed']}"] = f"{key[5:]}{job[key]}"
    expected |= set(sweeps)
    assert set(trained) == expected and set(trained.values()) == {1}
    names = {c["run"]: c["name"] for c in calls if c["module"] == "experiments.evaluate"}
    assert {run: name for run, name in names.items() if name} == sweeps
    ablation = {run for run in expected if "/l2r_ablation/" in run}  # evaluated again at T=1 too, after the 4x runs
    assert evaluated == {run: 1 + (run in ablation) for run in trained} and {c["threads"] for c in calls} == {"1"}
    last_eval = {c["run"]: c["temperatures"] for c in calls if c["module"] == "experiments.evaluate"}
    assert {last_eval[run] for run in ablation} == {"[0.0,1.0]"} and {last_eval[run] for run in sweeps} == {"[0.0]"}
    assert _run_queue(tmp_path) == []
    assert (tmp_path / "runs" / ".ablation_queue.pid").read_text().strip().isdigit()  # what `kill` is given
    again = _run_queue(tmp_path, TEMPERATURES="[0.0,1.0]")
    assert {c["module"] for c in again} == {"experiments.evaluate"} and {c["run"] for c in again} == expected - ablation
    again = _run_queue(tmp_path, BASELINE_K="3", ASSISTANT="main/assistant/export")  # the baselines' K changed: evaluated again (redo_if_changed)
    assert {c["run"] for c in again} == set(baselines) and {c["redo"] for c in again} == {"true"}


def test_the_long_queue_trains_each_run_once_and_evaluates_again_only_what_another_width_changes(tmp_path):
    """QUEUE=long: the six losses and dpace/soft_all at 2 seeds (and bfloat16's quality check where the CPU has it),
    each evaluated as a chain of CHAIN_W and a tree of TREE_N; a relaunch with another CHAIN_W evaluates the chains
    again (the old results moved aside by the evaluation: redo_if_changed) and leaves the trees alone."""
    from collections import Counter

    calls = _run_queue(tmp_path, QUEUE="long", WORKERS="2", THREADS="1", FAKE_PRECISION="bf16-mixed")
    trained = Counter(c["run"].rsplit("/", 1)[-1] for c in calls if c["module"] == "experiments.train")
    losses = ["uniform", "l2r_all", "decay", "focal", "chain", "decay_focal", "dpace", "soft_all"]
    precision = {f"precision-{p}-s{seed}" for p in ("32", "bf16-mixed") for seed in (0, 1)}
    assert trained == Counter({f"{loss}-s{seed}" for loss in losses for seed in (0, 1)} | precision)
    order = [c["run"].rsplit("/", 1)[-1] for c in calls if c["module"] == "experiments.train"]
    assert order.index("decay_focal-s0") > order.index("chain-s1")  # 5 configurations x 2 seeds first
    evals = [c for c in calls if c["module"] == "experiments.evaluate"]
    assert {c["redo"] for c in evals} == {"true"} and len(evals) == 2 * 16 + 4  # a chain and a tree per run
    assert _run_queue(tmp_path, QUEUE="long", FAKE_PRECISION="bf16-mixed") == []
    again = _run_queue(tmp_path, QUEUE="long", FAKE_PRECISION="bf16-mixed", CHAIN_W="5")
    chains = {c["out"].rsplit("/", 2)[-2] for c in again}
    assert {c["module"] for c in again} == {"experiments.evaluate"} and {c["drafter"] for c in again} == {None}
    assert chains == {f"{loss}-s{seed}" for loss in losses for seed in (0, 1)} | precision
    assert {c["out"].rsplit("/", 1)[-1] for c in again} == {"eval"}
