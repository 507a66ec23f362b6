"""Issue 49: what blockdraft ships or converts is checked where it is used (the recorded answers here; the
SmolLM2 conversion in test_smollm2.py), and a job's temporary folder is named when unusable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments.data.target import asset_path
from experiments.pipeline import recorded_answers as ra
from experiments.pipeline import run_folder
from experiments.pipeline.paths import REPO


@pytest.fixture
def answers(tmp_path):
    """A copy of the shipped SmolLM2 answers asset."""
    folder = tmp_path / "answers"
    shutil.copytree(asset_path("smollm2_answers"), folder)
    return folder


def test_the_shipped_answers_load_and_match_their_record(answers):
    record, loaded = ra.load_answers(answers)
    assert len(loaded) == record["rows"] == 738
    assert sum(len(v) for v in loaded.values()) == record["response_tokens"] == 72613


def test_changed_answers_are_refused_naming_both_hashes(answers):
    with np.load(answers / ra.ANSWERS) as f:
        arrays = dict(f)
    arrays["tokens"][arrays["offsets"][300]] += 1  # one token id of row 300 changed
    np.savez_compressed(answers / ra.ANSWERS, **arrays)
    recorded = json.loads((answers / ra.RECORD).read_text())["answers_sha256"]
    with pytest.raises(ra.RecordMismatch) as err:
        ra.load_answers(answers)
    found = ra.sha256_file(answers / ra.ANSWERS)
    assert f"{answers / ra.ANSWERS} has sha256 {found}, {answers / ra.RECORD} records {recorded}" in str(err.value)


@pytest.mark.parametrize("field,value", [("rows", 999), ("response_tokens", 1), ("commit", "0" * 40)])
def test_an_edited_record_is_refused(answers, field, value):
    record = json.loads((answers / ra.RECORD).read_text())
    record[field] = value
    (answers / ra.RECORD).write_text(json.dumps(record))
    with pytest.raises(ra.RecordMismatch, match=f"{ra.RECORD} was edited: its fields hash to [0-9a-f]{{64}}, it records "
                                                f"record_sha256 {record['record_sha256']}"):
        ra.load_answers(answers)


def test_counts_that_disagree_with_the_archive_are_refused_even_when_resealed(answers):
    record = json.loads((answers / ra.RECORD).read_text())
    (answers / ra.RECORD).write_text(json.dumps(ra.seal({**record, "rows": 999})))
    with pytest.raises(ra.RecordMismatch, match="records 999 rows and 72613 response tokens, .* holds 738 and 72613"):
        ra.load_answers(answers)


def test_a_record_without_hashes_is_refused(answers):
    record = json.loads((answers / ra.RECORD).read_text())
    del record["answers_sha256"], record["record_sha256"]
    (answers / ra.RECORD).write_text(json.dumps(record))
    with pytest.raises(ra.RecordMismatch, match="records no sha256"):
        ra.load_answers(answers)


def test_an_unusable_tmpdir_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "absent"))
    assert run_folder.temp_problem() == f"TMPDIR={tmp_path / 'absent'} is not a folder: create it or point TMPDIR " \
                                        "at a writable folder"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "file"))
    assert "is not a folder" in run_folder.temp_problem()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert run_folder.temp_problem() is None


def test_the_staging_folder_is_created_in_a_new_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder.tempfile, "tempdir", str(tmp_path / "new"))
    (tmp_path / "new").mkdir()
    staged = run_folder.staging_dir()
    assert run_folder.Path(staged).parent.is_dir() and run_folder.Path(staged).parent.parent == tmp_path / "new"


def _job(args: list[str], root, tmpdir) -> subprocess.CompletedProcess:
    """An entry point run as a user would, in a new process, with its own runs, cache and TMPDIR."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "BLOCKDRAFT_RUNS": str(root / "runs"),
           "BLOCKDRAFT_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, cwd=REPO,
                          check=False)


@pytest.mark.slow
def test_a_new_machine_trains_and_evaluates_with_an_empty_tmpdir(tmp_path):
    """A short training and an evaluation with TMPDIR a new, empty folder (as on a machine that never ran a job);
    their logs hold their messages; a refused evaluation leaves no trace and says why in one line."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    trained = _job(["experiments.train", "experiment=smoke", "name=fresh"], tmp_path, tmpdir)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = tmp_path / "runs" / "train" / "fresh"
    assert "[train] 6 steps" in (run / "train.log").read_text()
    assert "Seed set to 0" in (run / "train.log").read_text()  # Lightning's messages too
    evaluated = _job(["experiments.evaluate", f"drafter.path={run / 'drafter'}", "suite=humaneval",
                      "suite.humaneval.limit=2", "temperatures=[0.0]", "max_new_tokens=8",
                      f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path, tmpdir)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "[evaluate] results in" in (tmp_path / "eval" / "evaluate.log").read_text()
    refused = _job(["experiments.evaluate", f"drafter.path={run / 'drafter'}", "max_new_tokens=0",
                    f"hydra.run.dir={tmp_path / 'refused'}"], tmp_path, tmpdir)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == ("error: max_new_tokens must be >= 1, got 0 "
                                                       "(HYDRA_FULL_ERROR=1 shows the traceback)")
    assert not (tmp_path / "refused").exists()
    again = _job(["experiments.evaluate", f"drafter.path={run / 'drafter'}", "max_new_tokens=0",
                  f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path, tmpdir)  # an existing run folder stays as it was
    assert again.returncode == 1 and "max_new_tokens: 8" in (tmp_path / "eval" / ".hydra" / "config.yaml").read_text()
    bad_tmp = _job(["experiments.train", "experiment=smoke", "name=other"], tmp_path, tmp_path / "absent")
    assert bad_tmp.returncode == 1 and bad_tmp.stderr.strip().splitlines()[-1] == (
        f"error: TMPDIR={tmp_path / 'absent'} is not a folder: create it or point TMPDIR at a writable folder")
    assert not (tmp_path / "runs" / "train" / "other").exists()


def test_a_busy_folder_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    busy = run_folder.FolderBusyError("run folder runs/x is in use by pid 12 on host h (lock runs/x/.lock)")
    with pytest.raises(SystemExit) as exit_, run_folder.job():
        raise busy
    assert exit_.value.code == f"error: {busy} (HYDRA_FULL_ERROR=1 shows the traceback)"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(run_folder.FolderBusyError), run_folder.job():
        raise busy


def test_the_job_log_takes_prints_but_not_progress_redraws(tmp_path, monkeypatch):
    import io
    import logging

    handler = logging.FileHandler(tmp_path / "job.log")
    monkeypatch.setattr(run_folder, "_staged_logs", lambda: [handler])
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    try:
        with run_folder.job():
            print("[train] 6 steps")
            sys.stdout.write("\rtraining:  50%|#####     | 3/6")
    finally:
        handler.close()
    assert (tmp_path / "job.log").read_text() == "[train] 6 steps\n"


def test_the_shipped_sharegpt_answers_are_at_the_fields_scale_and_say_how_they_were_made():
    """Issue 50's training data: >= 10,000 answers and >= 1.5M response tokens, ShareGPT among the sources (its
    file's sha256), the engine that made them and their measured agreement with the in-process target."""
    from experiments.data import sharegpt

    record, answers = ra.load_answers(asset_path("sharegpt_answers"))
    assert record["rows"] == len(answers) >= 10_000 and record["response_tokens"] >= 1_500_000
    assert record["sources"]["sharegpt"]["sha256"] == sharegpt.SHA256
    assert sum(i.startswith("sharegpt/") for i in answers) > len(answers) / 2  # the largest share
    assert record["engine"]["kind"] == "vllm" and record["generation"]["engine"] == "vllm"
    agreement = record["agreement_with_in_process_target"]
    assert agreement["sample"] >= 64 and 0 <= agreement["identical"] <= agreement["sample"]
    assert 0 < record["cut_at_max_new_tokens"] < 1
