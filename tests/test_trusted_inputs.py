"""Issue 73: nothing cached, shipped or exported is trusted unchecked, and no non-finite number gets through.

Non-finite losses stop training (naming the step and the rows), non-finite weights are neither saved nor loaded,
non-finite decoding settings are refused naming the setting.
"""

from __future__ import annotations

import functools
import json
import math
import re

import lightning as L
import pytest
import torch
from conftest import left_padded_prompts, tiny_target
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from drafters import factory
from drafters.integrity import RECORD_NAME, NonFiniteWeightsError
from drafters.training.datamodule import RegenDataModule, write_meta, write_shard
from drafters.training.module import DrafterLightningModule, NonFiniteLossError
from experiments.pipeline.export import export_for_serving
from experiments.pipeline.paths import run_name_problem
from experiments.pipeline.settings import DecodingSettings
from losses import AcceptanceAlignedLoss
from verify.rejection import warp_probs

VOCAB = 64


def _target():
    return tiny_target("llama", vocab_size=VOCAB, hidden_size=32)


class NanAtStep(torch.nn.Module):
    """AcceptanceAlignedLoss whose loss turns NaN from the ``step``-th call on (a diverging run)."""

    soft = False

    def __init__(self, step: int):
        super().__init__()
        self.inner, self.step, self.calls = AcceptanceAlignedLoss(), step, 0

    def forward(self, *args):
        loss, components = self.inner(*args)
        self.calls += 1
        return (loss * float("nan") if self.calls > self.step else loss), components


def test_training_stops_on_a_non_finite_loss_naming_the_step_and_rows(tmp_path):
    target = _target()
    ids, _ = left_padded_prompts([4] * 12, VOCAB, seed=1)
    rows = [{"id": f"row/{b}", "domain": "code", "input_ids": ids[b].tolist() + [5, 6, 7, 8, 9], "prompt_len": 4}
            for b in range(12)]
    write_shard(rows, tmp_path)
    write_meta(tmp_path, {"complete": True})
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=4)
    module = DrafterLightningModule(drafter, target, NanAtStep(2),
                                    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), num_anchors=4)
    datamodule = RegenDataModule(str(tmp_path), batch_size=4, val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    with pytest.raises(NonFiniteLossError, match=r"training loss is nan at step 2 ") as err:
        trainer.fit(module, datamodule=datamodule)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message
    shown = [int(i) for i in message.split("source rows [")[1].split("]")[0].split(",")]
    assert len(shown) == 4 and len(set(shown)) == 4 and all(0 <= i < 12 for i in shown)
    assert all(f"'row/{i}'" in message for i in shown)  # the rows' ids, in the same order
    assert trainer.global_step == 2  # the NaN step never reached the optimizer
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_non_finite_weights_are_neither_saved_nor_loaded(tmp_path):
    target = _target()
    drafter = factory.from_target(target, block_size=4)
    good = tmp_path / "good"
    drafter.save_pretrained(good)
    assert factory.load(good, target=target) is not None and (good / RECORD_NAME).is_file()

    name = next(n for n, p in drafter.named_parameters() if p.ndim == 2)
    with torch.no_grad():
        dict(drafter.named_parameters())[name][0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match=rf"{good}/model.safetensors: tensor {name} .*holds 1 NaN"):
        drafter.save_pretrained(good)  # saving over a good drafter
    assert not (good / RECORD_NAME).exists()  # the folder no longer claims a checked drafter

    # a NaN written into the weights file of a saved drafter (no record: only the warning would stop nothing)
    with torch.no_grad():
        dict(drafter.named_parameters())[name][0, 0] = 0.0
    saved = tmp_path / "saved"
    drafter.save_pretrained(saved)
    weights = load_file(str(saved / "model.safetensors"))
    weights[name][1, 1] = float("nan")
    save_file(weights, str(saved / "model.safetensors"))
    (saved / RECORD_NAME).unlink()
    with pytest.raises(NonFiniteWeightsError, match=rf"{saved}/model.safetensors: tensor {name} "):
        factory.load(saved, target=target)


@pytest.mark.parametrize(("settings", "key"), [
    ({"temperatures": (0.0, math.nan)}, "temperatures[1]"),
    ({"temperatures": (math.inf,)}, "temperatures[0]"),
    ({"top_p": math.nan}, "top_p"),
])
def test_non_finite_decoding_settings_are_refused_naming_the_setting(settings, key):
    with pytest.raises(ValueError, match=rf"^decoding setting {re.escape(key)} is "):
        DecodingSettings(**settings)


def test_warp_probs_refuses_a_non_finite_temperature():
    logits = torch.randn(2, 8)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            warp_probs(logits, bad)
    assert torch.allclose(warp_probs(logits, 1.0).sum(-1), torch.ones(2))


# ----------------------------------------------------------------------------- 2. run names, export folders, cards


@pytest.mark.parametrize("value", ["../../x", "a/b", "..", ".", "", "a\\b"])
def test_a_run_name_that_is_a_path_is_refused_naming_the_key(value):
    problem = run_name_problem(value)
    assert problem.startswith(f"name={value} is not a run name: it must be one folder name") and "\n" not in problem
    assert run_name_problem("tiny-dflash-uniform-s0") is None and run_name_problem("l2r_all.g1") is None


def test_train_refuses_name_with_dots_before_any_folder_exists(tmp_path, monkeypatch):
    from test_train import offline_env, run_main

    from experiments import train

    offline_env(monkeypatch, tmp_path)
    with pytest.raises(SystemExit) as info:
        run_main(train, ["loss=uniform", "name=../../x"])
    assert info.value.code.startswith("error: name=../../x is not a run name")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def _export_cfg(drafter_dir, out):
    return OmegaConf.create({"drafter": {"path": str(drafter_dir)}, "out": str(out), "target_path": "Org/Model",
                             "dtype": None, "max_position_embeddings": None})


def test_export_refuses_the_drafters_own_folder_and_a_foreign_one(tmp_path):
    from test_export import fake_run

    run_dir, _ = fake_run(tmp_path / "runs", tmp_path / "target", with_results=False)
    drafter_dir = run_dir / "drafter"
    before = {p.name: p.read_bytes() for p in drafter_dir.iterdir()}
    with pytest.raises(ValueError, match=rf"^out={drafter_dir} is the folder of the drafter it exports"):
        export_for_serving(_export_cfg(drafter_dir, drafter_dir))
    assert {p.name: p.read_bytes() for p in drafter_dir.iterdir()} == before
    with pytest.raises(ValueError, match=rf"^out={run_dir} is a non-empty folder that is not a DFlash export"):
        export_for_serving(_export_cfg(drafter_dir, run_dir))  # the training run's folder
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    with pytest.raises(ValueError, match=rf"^out={foreign} is a non-empty folder that is not a DFlash export "
                                         r"\(it holds thesis.tex\)"):
        export_for_serving(_export_cfg(drafter_dir, foreign))
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"]
    out = export_for_serving(_export_cfg(drafter_dir, tmp_path / "served"))
    assert export_for_serving(_export_cfg(drafter_dir, out)) == out  # an earlier export is replaced
    export_for_serving(_export_cfg(drafter_dir, drafter_dir / "dflash"))  # beside the drafter, as shipped ones are
    assert factory.load(drafter_dir) is not None


def test_the_card_publishes_no_interpolation_of_the_run_settings(tmp_path, monkeypatch):
    from test_export import fake_run

    run_dir, _ = fake_run(tmp_path / "runs", tmp_path / "target", with_results=False)
    monkeypatch.setenv("BLOCKDRAFT_SECRET_HOME", "/home/someone/private")
    (run_dir / "run_settings.json").write_text(json.dumps({"choices": {"loss": "l2r_all"}, "settings": {
        "data.generation.prompts.sources": ["${oc.env:BLOCKDRAFT_SECRET_HOME}/prompts"],  # an escaped interpolation
        "data.generation.temperature": 1.0, "loss.gamma": 7.0, "loss.focal_weight": 0.3}}))
    out = export_for_serving(_export_cfg(run_dir / "drafter", tmp_path / "served"))
    card = (out / "README.md").read_text()
    assert "${" not in card and "/home/someone" not in card
    assert "`l2r_all` (blockdraft AcceptanceAlignedLoss: gamma=7.0, focal_weight=0.3)" in card


# ----------------------------------------------------------------------------- 3. the T=0 replay's cache is sealed


def test_cached_greedy_answers_are_sealed_and_an_edited_or_truncated_file_is_named_and_decoded_again(
        tmp_path, monkeypatch):
    import warnings

    from test_evaluate import _suites, _target, _tokenizer

    from drafters.storage import sha256_file
    from experiments.pipeline import replay

    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok = _tokenizer()
    target, prompts = _target(tok).eval(), _suites()["chat"]
    settings = DecodingSettings(temperatures=(0.0,), max_new_tokens=12, batch_size=2, max_prompt_tokens=40,
                                num_bootstrap=50, progress=False, measure_target_only=False)

    def answers():
        return replay.greedy_answers(target, tok, prompts, suite="chat", settings=settings)

    first = answers()
    (path,) = (tmp_path / "greedy").glob("chat-*.json")
    seal = path.with_name(path.name + ".sha256")
    sealed = sha256_file(path)
    assert seal.read_text() == f"{sealed}  {path.name}\n"  # sha256sum's format
    decode = replay.target_generate
    monkeypatch.setattr(replay, "target_generate", None)  # a sealed, unchanged file is read, not decoded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert answers() == first
    monkeypatch.setattr(replay, "target_generate", decode)

    doc = json.loads(path.read_text())
    doc["answers"][0][0][0][-1] += 1  # one answer token edited: still valid JSON of the right shape
    path.write_text(json.dumps(doc, indent=1) + "\n")
    edited = sha256_file(path)
    with pytest.warns(UserWarning, match=rf"cached greedy answers {re.escape(str(path))} has sha256 {edited} but its "
                                         rf"seal {re.escape(seal.name)} records {sealed}: .*; decoding them again"):
        assert answers() == first
    assert sha256_file(path) == sealed and seal.read_text().split()[0] == sealed  # decoded again and sealed

    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with pytest.warns(UserWarning, match=rf"{re.escape(str(path))} has sha256 {sha256_file(path)} but .* records "
                                         rf"{sealed}: the file was edited or truncated"):
        assert answers() == first
    seal.unlink()
    with pytest.warns(UserWarning, match=rf"{re.escape(str(path))} has no readable seal"):
        assert answers() == first
    assert seal.is_file()


# ----------------------------------------------------------------------------- 4. clear refusals


def test_a_truncated_regeneration_shard_is_named(tmp_path):
    from drafters.storage import DamagedFileError
    from drafters.training.datamodule import finished_ids, load_regenerated

    rows = [{"id": f"r{i}", "domain": "code", "input_ids": list(range(1, 40)), "prompt_len": 3} for i in range(50)]
    write_shard(rows[:25], tmp_path)
    shard = write_shard(rows[25:], tmp_path)
    write_meta(tmp_path, {"complete": True})
    (arrow,) = shard.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    (shard / "seals.json").unlink()  # a shard written before seals: pyarrow's failure, named in one line
    for read in (load_regenerated, finished_ids):
        with pytest.raises(DamagedFileError, match=rf"^regenerated shard {re.escape(str(shard))} cannot be read "
                                                   r"\(OSError: .*\): it is damaged .*delete the folder") as err:
            read(tmp_path)
        assert "\n" not in str(err.value)


def test_an_edited_regeneration_shard_is_named_before_it_is_read(tmp_path):
    """A byte of a sealed shard changed at the same size (still a readable table) is named with both hashes."""
    from drafters.storage import BrokenSealError
    from drafters.training.datamodule import load_regenerated

    rows = [{"id": f"r{i}", "domain": "code", "input_ids": list(range(1, 40)), "prompt_len": 3} for i in range(20)]
    shard = write_shard(rows, tmp_path)
    write_meta(tmp_path, {"complete": True})
    assert len(load_regenerated(tmp_path)) == 20
    (arrow,) = shard.glob("*.arrow")
    data = bytearray(arrow.read_bytes())
    at = data.rfind(bytes([7, 0, 0, 0]))  # one token id of the input_ids column: 7 -> 8
    data[at] = 8
    arrow.write_bytes(bytes(data))
    with pytest.raises(BrokenSealError, match=rf"regenerated shard file {re.escape(str(arrow))} has sha256 \w+ but "
                                              r"was sealed with \w+: .*delete the folder"):
        load_regenerated(tmp_path)


def test_evaluation_without_drafter_path_names_the_key():
    from experiments.pipeline.eval_drafters import CHOICES_DIR
    from experiments.pipeline.evaluation import build_drafter, check_drafter_settings

    block = OmegaConf.load(CHOICES_DIR / "block.yaml")
    with pytest.raises(ValueError, match=r"^drafter.path is not set: experiments.pipeline.eval_drafters.block_drafter "
                                         r"needs it; give drafter.path=\.\.\."):
        build_drafter(block, None)
    without = {k: v for k, v in OmegaConf.to_container(block).items() if k != "path"}  # a section with no path key
    with pytest.raises(ValueError, match=r"^drafter.path is not set"):
        check_drafter_settings(without)
    check_drafter_settings(OmegaConf.load(CHOICES_DIR / "prompt_lookup.yaml"))  # nothing required: no refusal


def test_a_pickled_bin_holding_more_than_tensors_is_named_not_loaded(tmp_path):
    from drafters.storage import DamagedFileError
    from experiments.data.target import load_target_model
    from experiments.pipeline.eval_drafters import ar_assistant

    model = tiny_target("llama", vocab_size=VOCAB, hidden_size=32)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # tensors only: loads
    assert load_target_model(str(folder))[0].config.vocab_size == VOCAB
    torch.save({"weights": model.state_dict(), "hook": print}, folder / "pytorch_model.bin")  # names a callable
    bad = rf"^weights file {re.escape(str(folder / 'pytorch_model.bin'))} is a pickle that holds more than tensors"
    with pytest.raises(DamagedFileError, match=bad) as err:
        load_target_model(str(folder))
    assert "weights_only=False" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DamagedFileError, match=bad):
        ar_assistant(model, str(folder))
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(DamagedFileError, match=r"pytorch_model.bin cannot be read \(.*\): it is damaged"):
        load_target_model(str(folder))


# ----------------------------------------------------------------------------- 5. the assistant of the chosen target


def test_ar_assistant_is_the_one_shipped_for_the_chosen_target():
    from pathlib import Path

    from test_configs import _compose

    from experiments.pipeline.eval_drafters import drafter_config

    assets = Path(__file__).resolve().parents[1] / "experiments" / "assets"
    for target, folder in (("tiny", "ar_assistant"), ("smollm2", "ar_assistant_smollm2")):
        cfg = _compose("evaluate", ["drafter=ar_assistant", f"target={target}"])
        assert Path(cfg.drafter.path) == assets / folder and (assets / folder / "model.safetensors").is_file()
    cfg = _compose("evaluate", ["drafter=ar_assistant", "target=hf", "target.path=/models/mine"])
    with pytest.raises(Exception, match=r"no assistant is shipped for target=hf; give drafter.path=.*"
                                        r"experiments/assets/ar_assistant_smollm2 for target=smollm2"):
        _ = cfg.drafter.path
    cfg = _compose("evaluate", ["drafter=ar_assistant", "target=hf", "target.path=/models/mine", "drafter.path=/a"])
    assert cfg.drafter.path == "/a"
    # the multirun report's baselines compose the choice into the jobs' config: its target decides
    joined = OmegaConf.create({"target": {"name": "smollm2"}, "drafter": drafter_config("ar_assistant")})
    assert Path(joined.drafter.path) == assets / "ar_assistant_smollm2"


# ----------------------------------------------------------------------------- 6. shipped assets and their records


def test_a_shipped_drafter_without_its_record_is_refused_not_warned_about(tmp_path, monkeypatch):
    from drafters import integrity

    monkeypatch.setattr(integrity, "SHIPPED_DIR", tmp_path / "assets")
    target = _target()
    drafter = factory.from_target(target, block_size=4)
    for folder in (tmp_path / "assets" / "mine", tmp_path / "runs" / "mine"):
        drafter.save_pretrained(folder)
        (folder / RECORD_NAME).unlink()
    with pytest.raises(integrity.ChangedDrafterError, match=rf"^shipped drafter {tmp_path / 'assets' / 'mine'} has no "
                                                           rf"{RECORD_NAME}: .*restore it"):
        factory.load(tmp_path / "assets" / "mine", target=target)
    with pytest.warns(UserWarning, match="has no blockdraft_record.json"):  # a drafter of one's own: a warning
        factory.load(tmp_path / "runs" / "mine", target=target)


def test_the_shipped_assistants_carry_a_record_that_is_checked(tmp_path):
    import shutil
    from pathlib import Path

    from drafters.integrity import ChangedDrafterError, check_assistant_record

    assets = Path(__file__).resolve().parents[1] / "experiments" / "assets"
    for name in ("ar_assistant", "ar_assistant_smollm2"):
        check_assistant_record(assets / name)  # committed with a record that matches its files
    copy = tmp_path / "ar_assistant"
    shutil.copytree(assets / "ar_assistant", copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ChangedDrafterError, match=r"config.json differs from the settings .* num_hidden_layers is 1, "
                                                  r"recorded 2"):
        check_assistant_record(copy)
    (copy / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9"}))  # not a setting
    check_assistant_record(copy)
    weights = load_file(str(copy / "model.safetensors"))
    save_file({k: v.clone() + (i == 0) for i, (k, v) in enumerate(weights.items())}, str(copy / "model.safetensors"))
    with pytest.raises(ChangedDrafterError, match=r"model.safetensors have sha256 .* but .* records"):
        check_assistant_record(copy)


def test_a_drafters_record_covers_every_byte_of_its_config_and_card(tmp_path):
    from drafters.integrity import OVERRIDE, ChangedDrafterError, read_record, record_files

    target = _target()
    folder = tmp_path / "drafter"
    factory.from_target(target, block_size=4).save_pretrained(folder)
    assert set(read_record(folder)["files_sha256"]) == {"config.json"}
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(json.dumps(json.loads(config)))  # the same settings, other bytes
    with pytest.raises(ChangedDrafterError, match=rf"^{re.escape(str(folder / 'config.json'))} has sha256 \w+ but .* "
                                                  r"records \w+: the file changed .*every byte.*" + re.escape(OVERRIDE)):
        factory.load(folder, target)
    with pytest.warns(UserWarning, match="config.json has sha256"):
        factory.load(folder, target, allow_edited_settings=True)
    (folder / "config.json").write_text(config)
    (folder / "card.json").write_text(json.dumps({"tau": {"T=0": {"humaneval": 1.5}}}))
    record_files(folder, ["card.json"])  # a shipped drafter's card (pipeline.ship)
    factory.load(folder, target)
    (folder / "card.json").write_text(json.dumps({"tau": {"T=0": {"humaneval": 2.5}}}))  # a better τ, typed in
    with pytest.raises(ChangedDrafterError, match=rf"^{re.escape(str(folder / 'card.json'))} has sha256 .*restore "
                                                  r"the recorded file$"):
        factory.load(folder, target, allow_edited_settings=True)  # no setting lets an edited card through


def test_feature_parts_are_sealed_and_an_edited_part_is_named_and_computed_again(tmp_path, capsys):
    import numpy as np

    from drafters.training.features import FeatureStore, compute_features

    target = _target()
    rows = [list(range(3, 3 + n)) for n in (5, 9, 7, 6, 8)]
    root = compute_features(target, rows, tmp_path / "f", target_layer_ids=[1, 2], dtype="float32",
                            rows_per_part=2, progress=False)
    meta = json.loads((root / "meta.json").read_text())
    parts = sorted(p.name for p in root.glob("part-*.npy"))
    assert sorted(meta["part_seals"]) == parts and len(parts) == 6  # 3 parts and their offsets
    want = [FeatureStore(root)[i] for i in range(5)]
    part = root / "part-00001.npy"
    sealed = meta["part_seals"][part.name]["sha256"]
    array = np.load(part)
    array[0, 0] += 1.0  # one value edited, the file as long as before
    np.save(part, array)
    with pytest.raises(ValueError, match=rf"^feature part {re.escape(str(part))} has sha256 \w+ but was sealed with "
                                         rf"{sealed}: the file was edited or truncated"):
        FeatureStore(root)
    others = {p: p.stat().st_mtime_ns for p in (root / "part-00000.npy", root / "part-00002.npy")}
    compute_features(target, rows, root, target_layer_ids=[1, 2], dtype="float32", rows_per_part=2, progress=False)
    assert f"[features] feature part {part} has sha256" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in others} == others  # only the edited part was computed again
    store = FeatureStore(root)
    assert all(torch.equal(store[i], want[i]) for i in range(5))
    # a cache from before seals: sealed as it is, nothing computed again
    (root / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "part_seals"}))
    compute_features(target, rows, root, target_layer_ids=[1, 2], dtype="float32", rows_per_part=2, progress=False)
    assert sorted(json.loads((root / "meta.json").read_text())["part_seals"]) == parts
    assert {p: p.stat().st_mtime_ns for p in others} == others
