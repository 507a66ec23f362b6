"""Issue #14, fault injection: a training, a regeneration and an evaluation killed at seeded random points
several times, each time started again with the same command, end with the artefacts of an
uninterrupted run (bit-identical on CPU).

The kills happen in this process (an exception from inside the job, as a crash would), at points where a
killed job leaves what a hard kill leaves: the files written so far (each written atomically).
"""

from __future__ import annotations

import csv
import json
import random
import shutil

import lightning as L
import pytest
from test_train import offline_env, run_main, save_target

import experiments.pipeline.evaluation as ev
import experiments.pipeline.training as tr
from drafters.storage import file_digest
from drafters.training import datamodule as regen
from experiments import regenerate, train
from experiments.pipeline.records import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

RNG = random.Random(14)  # the kill points
BUILD_TRAINER = tr.build_trainer
REGEN = ["batch_size=2", "shard_size=2"]  # experiments.regenerate: a shard per batch of 2 prompts


class Killed(RuntimeError):
    """The injected fault."""


class KillAtStep(L.Callback):
    """Dies when training step ``step`` (1-based) is about to run: steps before it are done and logged."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            raise Killed(f"killed before step {self.step}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, root)
        target = save_target(root / "target")
        base = ["target=hf", f"target.path={target}", "experiment=smoke", "suite=[humaneval,gsm_symbolic]"]
        run_main(regenerate, [*base, *REGEN])
        data_dir = next((root / "cache" / "regen" / "hf").iterdir())
        yield {"root": root, "target": target, "base": base, "data_dir": data_dir, "runs": root / "runs" / "train"}


def _with_kill(monkeypatch, step: int | None) -> None:
    """The trainers experiments.train builds get a :class:`KillAtStep` (``step`` None: none)."""
    monkeypatch.setattr(tr, "build_trainer", BUILD_TRAINER)
    if step is not None:
        monkeypatch.setattr(tr, "build_trainer", lambda cfg, logger: _add(BUILD_TRAINER(cfg, logger), KillAtStep(step)))


def _add(trainer: L.Trainer, callback: L.Callback) -> L.Trainer:
    trainer.callbacks.insert(0, callback)
    return trainer


def _metrics(run_dir) -> list[dict]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_killed_training_resumes_bit_identical(env, monkeypatch, recwarn):
    """16 steps over several epochs (4 batches each); last.ckpt every 2 steps, validation every 5."""
    args = [*env["base"], "train.max_steps=16", "train.checkpoint_every=2", "train.val_every=5",
            "train.validate_first=false"]
    _with_kill(monkeypatch, None)
    run_main(train, [*args, "name=straight"])
    kills = sorted(RNG.sample(range(2, 16), 4))  # several kills, mid-epoch and at epoch ends alike
    for step in kills:
        _with_kill(monkeypatch, step)
        with pytest.raises(Killed):
            run_main(train, [*args, "name=killed"])
    _with_kill(monkeypatch, None)
    run_main(train, [*args, "name=killed"])
    straight, killed = env["runs"] / "straight", env["runs"] / "killed"
    summary = json.loads((killed / "train_summary.json").read_text())
    assert summary["steps"] == 16 and summary["resumed_from_step"] is not None
    assert summary["val"] == json.loads((straight / "train_summary.json").read_text())["val"]
    assert _metrics(killed) == _metrics(straight), f"kills before steps {kills}"
    assert file_digest([killed / "drafter" / "model.safetensors"]) == \
        file_digest([straight / "drafter" / "model.safetensors"])
    assert not [w for w in recwarn if "not resumable" in str(w.message)]  # Lightning: the loader is resumable


def _rows(data_dir) -> list[list[dict]]:
    from datasets import load_from_disk

    return [load_from_disk(str(s)).to_list() for s in regen.shard_dirs(data_dir)]


def test_killed_regeneration_resumes_to_the_same_shards(env, monkeypatch):
    """Killed while generating a shard (after some whole ones), several times: the same shards, row by row."""
    data_dir = env["root"] / "regen-killed"
    args = [*env["base"], *REGEN, f"data.data_dir={data_dir}"]
    shards = len(regen.shard_dirs(env["data_dir"]))
    real, written = regen.write_shard, []

    def dying(rows, folder):
        if len(written) == budget:
            raise Killed(f"killed while writing shard {budget}")
        written.append(1)
        return real(rows, folder)

    monkeypatch.setattr(regen, "write_shard", dying)
    for _ in range(3):
        budget, written = RNG.randrange(shards - len(regen.shard_dirs(data_dir))), []
        with pytest.raises(Killed):
            run_main(regenerate, args)
        assert not regen.read_meta(data_dir).get("complete")
    budget = float("inf")
    run_main(regenerate, args)
    assert regen.read_meta(data_dir)["complete"]
    assert regen.read_meta(data_dir)["rows"] == regen.read_meta(env["data_dir"])["rows"]
    assert _rows(data_dir) == _rows(env["data_dir"])  # the same shards, rows and tokens


def _untimed(results: dict) -> dict:
    return {s: {k: {f: v for f, v in e.items() if f not in TIMING_KEYS} for k, e in entries.items()}
            for s, entries in results.items()}


def test_killed_evaluation_resumes_to_the_same_results(env, monkeypatch):
    """4 (suite, temperature) entries; killed during one of them (after 0 to 3), several times."""
    from experiments import evaluate

    drafter = env["runs"] / "straight" / "drafter"
    if not drafter.is_dir():  # this test alone: a drafter of 2 steps
        run_main(train, [*env["base"], "name=straight", "train.max_steps=2", "train.validate_first=false"])
    args = ["target=hf", f"target.path={env['target']}", f"drafter.path={drafter}", "suite=[humaneval,gsm_symbolic]",
            "suite.humaneval.limit=2", "suite.gsm_symbolic.limit=2", "temperatures=[0.0,1.0]", "max_new_tokens=8",
            "num_bootstrap=20", "measure_target_only=false", "progress=false", "batch_size=1"]
    straight, killed = env["root"] / "eval-straight", env["root"] / "eval-killed"
    run_main(evaluate, [*args, f"hydra.run.dir={straight}"])
    real, calls = ev.evaluate_suite, []

    def dying(*a, **kw):
        if len(calls) == budget:
            raise Killed(f"killed during entry {budget}")
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ev, "evaluate_suite", dying)
    done = 0
    for _ in range(3):
        budget, calls = RNG.randrange(4 - done), []  # entries this run finishes before it dies
        with pytest.raises(Killed):
            run_main(evaluate, [*args, f"hydra.run.dir={killed}"])
        done += budget
        results = json.loads((killed / "results.json").read_text())["results"] if done else {}
        assert sum(len(v) for v in results.values()) == done  # what a killed evaluation leaves
    budget = float("inf")
    run_main(evaluate, [*args, f"hydra.run.dir={killed}"])
    ours, theirs = (json.loads((d / "results.json").read_text()) for d in (killed, straight))
    assert _untimed(ours["results"]) == _untimed(theirs["results"])
    assert ours["drafter"] == theirs["drafter"] and ours["suites"] == theirs["suites"]
    shutil.rmtree(killed)
