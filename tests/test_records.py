"""Issue #43, "records that cannot lie": a drafter knows its target's weights, a refused job leaves the run
folder's records alone, a wrongly typed config field is named, and an unwritable run folder fails first.

The entry points run in this process as in test_train (``main()`` with a patched ``sys.argv``); the refused-job
cases compare every file of the run folder byte for byte before and after the refused job.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_export import fake_run
from test_export import run_main as run_export
from test_run_safety import start_holder
from test_train import offline_env, run_main, save_target

from drafters import factory, locks
from drafters.checks import ConfigTypeError, TargetMismatchError, target_weights_sha1
from drafters.factory import check_same_config
from experiments import evaluate, regenerate, train
from experiments.data.target import load_target
from experiments.pipeline.eval_drafters import block_drafter
from experiments.pipeline.export import export_for_serving

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore:target_layer_ids .* the target's last hidden state"),
]


def perturbed_copy(src: Path, dst: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """The target at ``src`` with every tensor moved by ``scale`` of its std (same shapes, same tokenizer)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))
    model.save_pretrained(dst)
    return dst


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the lock (whose holder names itself there while it holds the folder,
    drafters/locks.py): relative path -> bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != locks.LOCK_NAME}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, root)
        target = save_target(root / "target")
        other = perturbed_copy(target, root / "sibling")
        base = ["target=hf", f"target.path={target}", "experiment=smoke"]
        run_main(regenerate, [*base, "suite=[humaneval,gsm_symbolic]"])
        base += ["train.max_steps=2", "train.val_every=2", "train.checkpoint_every=2", "train.validate_first=false"]
        run_main(train, [*base, "name=owner"])
        yield {"root": root, "target": target, "other": other, "base": base, "runs": root / "runs" / "train",
               "drafter": root / "runs" / "train" / "owner" / "drafter"}


# ----------------------------------------------------------------------------- 1. a drafter knows its target


def test_evaluation_refuses_a_sibling_target_naming_both_signatures(env):
    target, _ = load_target(str(env["target"]))
    sibling, _ = load_target(str(env["other"]))
    ours, theirs = target_weights_sha1(target), target_weights_sha1(sibling)
    assert ours != theirs and json.loads((env["drafter"] / "config.json").read_text())["target_fingerprint"][
        "weights_sha1"] == ours
    folder = env["root"] / "runs" / "evaluate" / "sibling"
    args = [f"drafter.path={env['drafter']}", "target=hf", f"target.path={env['other']}", "suite=humaneval",
            "suite.humaneval.limit=1", "temperatures=[0.0]", "max_new_tokens=4", f"hydra.run.dir={folder}"]
    with pytest.raises(TargetMismatchError) as info:
        run_main(evaluate, args)
    message = str(info.value)
    for text in (f"drafter {env['drafter']} was trained for another target", f"weights_sha1 {ours}",
                 f"target {env['other']} has {theirs}", "drafter.allow_other_target=true"):
        assert text in message, text
    assert not (folder / "results.json").exists() and not (folder / ".hydra").exists()
    with pytest.warns(UserWarning, match="used anyway"):  # the explicit override
        built = block_drafter(sibling, str(env["drafter"]), allow_other_target=True)
    assert built.info["config"]["allow_other_target"] is True
    assert block_drafter(target, str(env["drafter"])).info["config"].get("allow_other_target") is None


def test_init_from_refuses_a_sibling_target_unless_allowed(env):
    sibling, _ = load_target(str(env["other"]))
    with pytest.raises(TargetMismatchError, match="was trained for another target"):
        factory.from_target(sibling, block_size=None, init_from=env["drafter"])
    with pytest.warns(UserWarning, match="drafter.allow_other_target=true"):
        drafter = factory.from_target(sibling, block_size=None, init_from=env["drafter"],
                                                    allow_other_target=True)
    # trained from here on for the sibling: its record says so, not the first target
    assert drafter.config.target_fingerprint["weights_sha1"] == target_weights_sha1(sibling)


def test_resume_refuses_other_weights_and_accepts_a_legacy_checkpoint(env):
    target, _ = load_target(str(env["target"]))
    sibling, _ = load_target(str(env["other"]))
    saved = factory.from_target(target, block_size=4).saved_config()
    current = factory.from_target(sibling, block_size=4).saved_config()
    with pytest.raises(ValueError, match="checkpoint was trained for another target.*weights_sha1"):
        check_same_config(saved, current)
    legacy = {**saved, "target_fingerprint": {k: v for k, v in saved["target_fingerprint"].items()
                                              if k != "weights_sha1"}}
    with pytest.warns(UserWarning, match="records no signature of its target's weights"):
        check_same_config(legacy, current)


def test_a_drafter_saved_before_signatures_loads_with_a_warning(env, tmp_path):
    target, _ = load_target(str(env["target"]))
    old = tmp_path / "old"
    shutil.copytree(env["drafter"], old)
    raw = json.loads((old / "config.json").read_text())
    del raw["target_fingerprint"]["weights_sha1"]
    (old / "config.json").write_text(json.dumps(raw))
    (old / "blockdraft_record.json").unlink()  # nor the record of its files (drafters/integrity.py)
    with pytest.warns(UserWarning, match=f"drafter {old} records no signature of its target's weights"):
        factory.load(old, target)


def test_export_refuses_a_card_naming_another_target(tmp_path):
    run_dir, _ = fake_run(tmp_path / "runs", tmp_path / "target")
    sibling = perturbed_copy(tmp_path / "target", tmp_path / "sibling")
    cfg = {"drafter": {"path": str(run_dir / "drafter")}, "out": str(tmp_path / "served"), "target_path": str(sibling),
           "dtype": None, "max_position_embeddings": None}
    with pytest.raises(TargetMismatchError, match=f"target {sibling} has [0-9a-f]{{40}}"):
        export_for_serving(OmegaConf.create(cfg))
    assert not (tmp_path / "served").exists()
    with pytest.warns(UserWarning, match="used anyway"):
        export_for_serving(OmegaConf.create({**cfg, "drafter": {**cfg["drafter"], "allow_other_target": True}}))
    assert str(sibling) in (tmp_path / "served" / "README.md").read_text()


# ----------------------------------------------------------------------------- 2. refused jobs change nothing


def test_a_resume_refused_for_its_settings_changes_nothing_and_the_card_says_what_trained(env, tmp_path):
    run_dir = env["runs"] / "owner"
    before = snapshot(run_dir)
    assert "loss=decay" not in before[".hydra/overrides.yaml"].decode()
    with pytest.raises(ValueError, match=r"other settings.*\(loss: uniform -> decay\)"):
        run_main(train, [*env["base"], "name=owner", "loss=decay", "train.max_steps=3"])
    assert snapshot(run_dir) == before
    run_export([f"drafter.path={run_dir / 'drafter'}", f"out={tmp_path / 'served'}"], env["root"] / "runs")
    card = (tmp_path / "served" / "README.md").read_text()
    assert "`uniform`" in card and "decay" not in card


def test_a_training_refused_for_the_lock_changes_nothing(env):
    run_dir = env["runs"] / "owner"
    child = start_holder(run_dir, 30.0)  # the owner, still running
    try:
        before = snapshot(run_dir)
        with pytest.raises(locks.FolderBusyError, match=f"run folder .*owner is in use by pid {child.pid}"):
            run_main(train, [*env["base"], "name=owner", "loss=decay"])
        assert snapshot(run_dir) == before
    finally:
        child.kill()
        child.wait()


def test_an_injected_fault_before_the_job_owns_its_records_changes_nothing(env, monkeypatch):
    """A resumed job that passes its checks but dies while building (here: an injected fault) leaves the
    records of the run it was to continue, and a later job with the run's own settings still resumes it."""
    import experiments.pipeline.training as tr

    run_dir = env["runs"] / "owner"
    before = snapshot(run_dir)

    def fail(cfg):
        raise RuntimeError("injected fault while building")

    with monkeypatch.context() as mp:
        mp.setattr(tr, "build", fail)
        with pytest.raises(RuntimeError, match="injected fault"):
            run_main(train, [*env["base"], "name=owner", "train.max_steps=3", "train.checkpoint_every=3"])
    assert snapshot(run_dir) == before
    run_main(train, [*env["base"], "name=owner", "train.max_steps=3", "train.checkpoint_every=3"])
    assert "train.max_steps=3" in (run_dir / ".hydra" / "overrides.yaml").read_text()  # the owner's, now
    log = (run_dir / "train.log").read_bytes()  # its log appended to the run's
    assert log.startswith(before["train.log"]) and log.count(b"Seed set") == before["train.log"].count(b"Seed set") + 1


def test_an_evaluation_refused_for_the_lock_or_its_settings_changes_nothing(env):
    folder = env["root"] / "runs" / "evaluate" / "first"
    args = ["target=hf", f"target.path={env['target']}", "drafter=prompt_lookup", "suite=humaneval",
            "suite.humaneval.limit=2", "temperatures=[0.0]", "max_new_tokens=4", "num_bootstrap=10",
            "measure_target_only=false", "progress=false", f"hydra.run.dir={folder}"]
    run_main(evaluate, args)
    before = snapshot(folder)
    assert "max_new_tokens=4" in before[".hydra/overrides.yaml"].decode()
    with pytest.raises(ValueError, match=r"other settings \(settings.max_new_tokens: 4 -> 6"):
        run_main(evaluate, [*args, "max_new_tokens=6"])
    assert snapshot(folder) == before
    child = start_holder(folder, 30.0)
    try:
        before = snapshot(folder)
        with pytest.raises(locks.FolderBusyError, match="run folder .*first is in use"):
            run_main(evaluate, [*args, "max_new_tokens=6"])
        assert snapshot(folder) == before
    finally:
        child.kill()
        child.wait()


# ----------------------------------------------------------------------------- 3. wrongly typed fields


def test_a_wrongly_typed_drafter_field_is_named(env, tmp_path):
    target, _ = load_target(str(env["target"]))
    bad = tmp_path / "bad"
    shutil.copytree(env["drafter"], bad)
    raw = json.loads((bad / "config.json").read_text())
    for field, value, expected in (("block_size", "sixteen", "an integer"), ("qk_norm", "yes", "a boolean"),
                                   ("target_layer_ids", [1, "two"], "a list of an integer"),
                                   ("rms_norm_eps", None, "a number")):
        (bad / "config.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ConfigTypeError) as info:
            block_drafter(target, str(bad))
        assert str(info.value).startswith(f"{bad / 'config.json'}: field '{field}' is {value!r} "
                                          f"({type(value).__name__}), expected {expected}"), str(info.value)
    fingerprint = {**raw["target_fingerprint"], "vocab_size": "300"}
    (bad / "config.json").write_text(json.dumps({**raw, "target_fingerprint": fingerprint}))
    with pytest.raises(ConfigTypeError, match=r"field 'target_fingerprint.vocab_size' is '300' \(str\), expected an integer"):
        factory.load(bad, target)


def test_a_wrongly_typed_target_or_dflash_field_is_named(env, tmp_path):
    broken = tmp_path / "target"
    shutil.copytree(env["target"], broken)
    raw = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**raw, "hidden_size": "thirty-two"}))
    with pytest.raises(ConfigTypeError, match=f"{broken / 'config.json'}: field 'hidden_size' is 'thirty-two' "
                                              r"\(str\), expected an integer"):
        load_target(str(broken))
    (broken / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": "small"}))
    with pytest.raises(ConfigTypeError, match=r"field 'rms_norm_eps' is 'small' \(str\), expected a number"):
        load_target(str(broken))
    target, _ = load_target(str(env["target"]))
    served = tmp_path / "served"
    from drafters.dflash import export_dflash

    export_dflash(factory.load(env["drafter"], target), served)
    raw = json.loads((served / "config.json").read_text())
    raw["dflash_config"]["block_size"] = "16"
    (served / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigTypeError, match=r"field 'dflash_config.block_size' is '16' \(str\), expected an integer"):
        factory.load(served, target)


# ----------------------------------------------------------------------------- 4. an unwritable run folder


def _deny_writes_under(monkeypatch, folder: Path) -> None:
    """As root every folder is writable: answer permission checks for ``folder`` and below as the kernel
    answers a user without write permission (for other users the chmod above does it)."""
    import experiments.pipeline.run_folder as rf

    access = os.access

    def denied(path, mode, *args, **kwargs):
        inside = Path(path).absolute() == folder or folder in Path(path).absolute().parents
        return False if inside and mode & os.W_OK else access(path, mode, *args, **kwargs)

    monkeypatch.setattr(rf.os, "access", denied)


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
@pytest.mark.parametrize("entry", [evaluate, train])
def test_an_unwritable_run_folder_fails_first_with_one_line(tmp_path, monkeypatch, entry):
    offline_env(monkeypatch, tmp_path)
    folder, runs = tmp_path / "run", tmp_path / "runs"
    for path in (folder, runs):
        path.mkdir()
        path.chmod(0o555)
        if os.geteuid() == 0:
            _deny_writes_under(monkeypatch, path)
    try:
        with pytest.raises(SystemExit) as info:  # an existing run folder
            run_main(entry, ["drafter=prompt_lookup" if entry is evaluate else "loss=uniform", f"hydra.run.dir={folder}"])
        assert info.value.code == (
            f"error: run folder {folder} is not writable (mode dr-xr-xr-x, owner uid {os.geteuid()}; this job runs "
            f"as uid {os.getuid()}): permission denied. Make it writable or choose another folder (hydra.run.dir=..., "
            "$BLOCKDRAFT_RUNS)")
        with pytest.raises(SystemExit) as info:  # a run folder to be created in a runs folder that cannot be written
            run_main(entry, [f"hydra.run.dir={runs / 'x' / 'y'}"])
        assert info.value.code.startswith(f"error: run folder {runs / 'x' / 'y'} cannot be created: {runs} is not "
                                          "writable (mode dr-xr-xr-x") and "\n" not in info.value.code
        assert list(folder.iterdir()) == [] and list(runs.iterdir()) == []  # nothing written before the check
    finally:
        folder.chmod(0o755)
        runs.chmod(0o755)


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_the_check_runs_where_the_run_name_reads_hydras_choices(tmp_path, monkeypatch):
    """An experiment whose run name reads ${hydra:runtime.choices.loss} (the ablations': their run folder is named
    after the loss) is checked too: the callback once raised resolving the name before Hydra's config was set, Hydra
    only warned, and the check was skipped."""
    offline_env(monkeypatch, tmp_path)
    runs = tmp_path / "unwritable_runs"
    runs.mkdir()
    runs.chmod(0o555)
    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(runs))
    if os.geteuid() == 0:
        _deny_writes_under(monkeypatch, runs)
    try:
        with pytest.raises(SystemExit) as info:
            run_main(train, ["experiment=l2r_ablation", "launch=run", "loss=decay", "seed=1"])
        assert info.value.code.startswith(f"error: run folder {runs}/multirun/l2r_ablation/decay-s1 cannot be "
                                          f"created: {runs} is not writable"), info.value.code
        assert list(runs.iterdir()) == []
    finally:
        runs.chmod(0o755)


def test_a_drafter_and_its_snapshots_name_the_run_they_came_from(tmp_path):
    """records.drafter_training_run: ``<run>/drafter`` and ``<run>/snapshots/step-<N>`` name ``<run>`` (its loss and
    seed); a folder outside a training run names none."""
    from experiments.pipeline.records import drafter_training_run

    run = tmp_path / "decay-s1"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 1\nname: ablation_long-decay-s1\n")
    (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      loss: decay\n")
    for drafter in (run / "drafter", run / "snapshots" / "step-5000"):
        info = drafter_training_run(drafter)
        assert (info["loss"], info["seed"], info["name"]) == ("decay", 1, "ablation_long-decay-s1")
    assert drafter_training_run(tmp_path / "elsewhere" / "drafter") is None
    assert drafter_training_run(tmp_path / "other" / "snapshots" / "step-5000") is None
