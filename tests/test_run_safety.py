"""Issue #14, "nothing lost, nothing mixed up": folder locks, guarded resumes, damaged files.

Concurrent jobs are simulated by a small child process that owns a folder's lock (as a second
``experiments.train`` would) while this process runs the entry points in-process (see test_train).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
from test_train import offline_env, run_main, save_target

from drafters import locks, storage
from drafters.training.datamodule import load_regenerated
from experiments import regenerate, train

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# A child owning <folder>'s lock: prints "held", runs an optional copy, sleeps, exits (releasing it).
HOLDER = textwrap.dedent("""
    import json, shutil, sys, time
    from pathlib import Path
    from drafters import locks
    folder, seconds, src = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    with locks.hold(folder, "test folder"):
        if src:  # another job's regeneration under way: an incomplete regen.json first
            meta = json.loads((Path(src) / "regen.json").read_text())
            (Path(folder) / "regen.json").write_text(json.dumps({**meta, "complete": False}))
        print("held", flush=True)
        time.sleep(seconds)
        if src:  # another job's regeneration: its shards and a complete regen.json
            for i, shard in enumerate(sorted((Path(src) / "shards").iterdir())):
                shutil.copytree(shard, Path(folder) / "shards" / f"shard-{1000 + i:05d}")
            shutil.copy(Path(src) / "regen.json", Path(folder) / "regen.json")
""")


def start_holder(folder, seconds: float, src: str = "") -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(seconds), src],
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert child.stdout.readline().strip() == "held"
    return child


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, root)
        target = save_target(root / "target")
        base = ["target=hf", f"target.path={target}", "experiment=smoke"]
        run_main(regenerate, [*base, "suite=[humaneval,gsm_symbolic]"])
        data_dir = next((root / "cache" / "regen" / "hf").iterdir())
        base += ["train.max_steps=2", "train.val_every=2", "train.checkpoint_every=2", "train.validate_first=false"]
        yield {"root": root, "target": target, "base": base, "data_dir": data_dir, "runs": root / "runs" / "train"}


# ----------------------------------------------------------------------------- locks


def test_lock_refuses_waits_nests_and_takes_over_stale(tmp_path, capsys):
    folder = tmp_path / "f"
    child = start_holder(folder, 2.0)
    with pytest.raises(locks.FolderBusyError, match=f"pid {child.pid} on host {socket.gethostname()} since "):
        locks.acquire(folder, "test folder")
    with locks.hold(folder, wait=True, poll_s=0.1, timeout_s=60):  # waits for the child, then owns it
        child.wait(timeout=30)
        assert locks.owner(folder)["pid"] == os.getpid()
        with locks.hold(folder):  # the same process again: nested
            pass
        assert locks.owner(folder)["pid"] == os.getpid()
    assert locks.owner(folder) == {} and "waiting" in capsys.readouterr().err
    # a killed owner: its record is still there, its pid is dead
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "then"}))
    with locks.hold(folder):
        pass
    assert f"taking over the lock of pid {dead.pid}" in capsys.readouterr().err
    # a record whose pid is live again, reused by a later process (another start time): not its owner
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = locks._start_ticks(alive.pid)
        record = {"pid": alive.pid, "host": socket.gethostname(), "since": "then"}
        assert start is not None and locks._live_elsewhere({**record, "pid_start": start})
        assert locks._live_elsewhere(record)  # a record from before pid_start: the pid is trusted
        (folder / ".lock").write_text(json.dumps({**record, "pid_start": start - 1}))
        with locks.hold(folder):
            assert locks.owner(folder)["pid_start"] == locks._start_ticks(os.getpid())
    finally:
        alive.kill()


# ----------------------------------------------------------------------------- 1. data folders


def test_second_job_waits_for_the_data_folder_then_reads_it(env):
    """Two jobs with the same regeneration settings on a cold cache: one regenerates, the other waits."""
    fresh = env["root"] / "cold"
    child = start_holder(fresh, 3.0, str(env["data_dir"]))  # "job A" regenerating
    run_main(train, [*env["base"], f"data.data_dir={fresh}", "name=cold", "suite=[humaneval,gsm_symbolic]"])
    child.wait()
    ids = load_regenerated(fresh)["id"]
    assert len(ids) == len(set(ids)) == len(load_regenerated(env["data_dir"]))  # nothing duplicated


# ----------------------------------------------------------------------------- 3. run folders


def test_a_second_training_of_the_same_name_refuses(env):
    child = start_holder(env["runs"] / "busy", 30.0)
    try:
        with pytest.raises(locks.FolderBusyError, match=f"run folder .*busy is in use by pid {child.pid} on host "):
            run_main(train, [*env["base"], "name=busy"])
    finally:
        child.kill()
        child.wait()
    assert not (env["runs"] / "busy" / "logs").exists()  # nothing written


def test_a_second_evaluation_into_a_busy_run_folder_refuses(env):
    from experiments import evaluate

    folder = env["root"] / "runs" / "evaluate" / "busy"
    child = start_holder(folder, 30.0)
    try:
        with pytest.raises(locks.FolderBusyError, match=f"run folder .*busy is in use by pid {child.pid} on host "):
            run_main(evaluate, ["target=hf", f"target.path={env['target']}", "drafter=prompt_lookup",
                                "suite=humaneval", f"hydra.run.dir={folder}"])
    finally:
        child.kill()
        child.wait()
    assert not (folder / "results.json").exists() and not (folder / "logs").exists()


# ----------------------------------------------------------------------------- 4. guarded resumes


def test_resume_refuses_another_objective_and_allows_another_budget(env):
    run_main(train, [*env["base"], "name=objective"])
    with pytest.raises(ValueError, match=r"other settings.*\(loss: uniform -> l2r_all\).*loss\.chain_weight: 0\.0 -> 40\.0"):
        run_main(train, [*env["base"], "name=objective", "loss=l2r_all", "train.max_steps=3"])
    with pytest.raises(ValueError, match=r"optimizer\.lr: 0\.0006 -> 0\.1"):
        run_main(train, [*env["base"], "name=objective", "optimizer.lr=0.1", "train.max_steps=3"])
    run_main(train, [*env["base"], "name=objective", "train.max_steps=3"])  # a longer budget: resumed
    summary = json.loads((env["runs"] / "objective" / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["resumed_from_step"] == 2


def test_resume_ignores_where_the_recorded_answers_lie_but_not_the_data(tmp_path):
    """A run resumed from another checkout (the recorded answers' asset elsewhere) keeps its fingerprint, also
    against a run_settings.json saved with that path in it; other data settings are refused."""
    from omegaconf import OmegaConf

    from experiments.pipeline.run_settings import FINGERPRINT, check
    from experiments.pipeline.run_settings import run_fingerprint as fingerprint
    from experiments.pipeline.training import RESUME_KEYS

    def run_fingerprint(cfg):
        return fingerprint(cfg, RESUME_KEYS)

    def check_resume_settings(run_dir, cfg):
        check(run_dir, cfg, RESUME_KEYS)

    def config(path: str, seed: int):
        return OmegaConf.create({"data": {"backend": {"path": path, "check_batches": 1}, "generation": {"seed": seed}},
                                 "loss": {"gamma": 2.0}})

    here = run_fingerprint(config("/one/checkout/assets/answers", 0))
    assert run_fingerprint(config("/another/clone/assets/answers", 0)) == here
    assert run_fingerprint(config("/one/checkout/assets/answers", 1)) != here
    assert here["data.backend.check_batches"] == 1 and "data.backend.path" not in here
    saved = {**here, "data.backend.path": "/one/checkout/assets/answers"}  # as written before the path was freed
    (tmp_path / FINGERPRINT).write_text(json.dumps({"choices": {}, "settings": saved}))
    check_resume_settings(tmp_path, config("/another/clone/assets/answers", 0))
    with pytest.raises(ValueError, match=r"data\.generation\.seed: 0 -> 1"):
        check_resume_settings(tmp_path, config("/another/clone/assets/answers", 1))


# ----------------------------------------------------------------------------- 5. damaged files


def test_damaged_checkpoint_is_named_and_nothing_is_touched(env):
    run_main(train, [*env["base"], "name=damaged"])
    run_dir = env["runs"] / "damaged"
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(b"garbage, not a checkpoint")
    before = sorted(p.name for p in (run_dir / "logs").iterdir())
    for _ in range(2):
        with pytest.raises(storage.DamagedFileError, match=f"checkpoint {last} cannot be read") as info:
            run_main(train, [*env["base"], "name=damaged", "train.max_steps=3"])
        assert "weights_only" not in str(info.value)
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == before and "metrics.csv" in before


def test_bad_numbers_name_their_key(env):
    with pytest.raises(ValueError, match="train.max_steps must be an integer >= 1, got 'abc'"):
        run_main(train, [*env["base"], "name=abc", "train.max_steps=abc"])


def test_damaged_drafter_and_target_files_are_named(env, tmp_path):
    from experiments.data.target import load_target
    from experiments.pipeline.eval_drafters import block_drafter

    run_main(train, [*env["base"], "name=files"])
    target, _ = load_target(str(env["target"]))
    drafter = tmp_path / "drafter"
    shutil.copytree(env["runs"] / "files" / "drafter", drafter)
    text = (drafter / "config.json").read_text()
    (drafter / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(storage.DamagedFileError, match=f"drafter config {drafter / 'config.json'} is damaged"):
        block_drafter(target, str(drafter))
    (drafter / "config.json").write_text(text)
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(storage.DamagedFileError, match=f"weights file {weights} is damaged"):
        block_drafter(target, str(drafter))
    broken = tmp_path / "target"
    shutil.copytree(env["target"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(storage.DamagedFileError, match=f"weights file {weights} is damaged"):
        load_target(str(broken))


# ----------------------------------------------------------------------------- 2. evaluation resumes


def test_evaluation_is_redone_when_the_drafter_changed(env):
    from drafters.storage import file_digest

    args = [*env["base"], "name=evr", "evaluate.enabled=true", "suite=humaneval", "suite.humaneval.limit=2",
            "evaluate.temperatures=[0.0]", "evaluate.max_new_tokens=8", "evaluate.num_bootstrap=10",
            "evaluate.measure_target_only=false", "evaluate.progress=false"]
    run_dir = env["runs"] / "evr"
    run_main(train, args)
    first = json.loads((run_dir / "results.json").read_text())
    run_main(train, [*args, "train.max_steps=4", "train.checkpoint_every=4"])  # trained further: a new drafter
    results = json.loads((run_dir / "results.json").read_text())
    assert results["drafter"]["weights_sha256"] == file_digest([run_dir / "drafter" / "model.safetensors"])
    assert results["drafter"]["weights_sha256"] != first["drafter"]["weights_sha256"]
    assert [json.loads(p.read_text()) for p in run_dir.glob("results.replaced-*.json")] == [first]  # kept
    # the standalone evaluation refuses to resume results of other weights
    from experiments.pipeline.records import check_resumable

    with pytest.raises(ValueError, match="drafter.weights_sha256"):
        check_resumable(first, results, run_dir / "results.json")


def test_speeds_resume_only_on_the_kind_of_machine_that_measured_them(tmp_path):
    """records.check_resumable: results holding speeds are refused on another CPU, ISA, torch or thread count
    (naming it); results of τ alone resume there."""
    from experiments.pipeline.records import check_resumable

    here = {"cpu": "AMD EPYC", "isa": "AVX512", "torch": "2.13.0+cpu", "threads": 2, "platform": "Linux-a"}
    timed = {"results": {"humaneval": {"t0": {"tau": 1.5, "speedup": 1.4}}}, "machine": here}
    check_resumable(timed, {"machine": {**here, "platform": "Linux-b"}}, tmp_path / "results.json")
    with pytest.raises(ValueError, match=r"machine\.cpu: 'AMD EPYC' -> 'Intel Xeon'"):
        check_resumable(timed, {"machine": {**here, "cpu": "Intel Xeon"}}, tmp_path / "results.json")
    with pytest.raises(ValueError, match=r"machine\.threads: 2 -> 4"):
        check_resumable(timed, {"machine": {**here, "threads": 4}}, tmp_path / "results.json")
    tau_only = {"results": {"humaneval": {"t0": {"tau": 1.5, "speedup": None}}}, "machine": here}
    check_resumable(tau_only, {"machine": {**here, "cpu": "Intel Xeon"}}, tmp_path / "results.json")
