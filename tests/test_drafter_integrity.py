"""Issue 49 (drafter side): a saved or exported drafter records its weights' sha256 and its settings
(blockdraft_record.json, drafters/integrity.py), and loading it refuses other weights or an edited config.json
unless drafter.allow_edited_settings=true, which the evaluation's results then record."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from conftest import tiny_target
from omegaconf import OmegaConf

from drafters import factory
from drafters.dflash import export_dflash
from drafters.integrity import RECORD_NAME, ChangedDrafterError
from drafters.storage import sha256_file
from experiments.pipeline.eval_drafters import block_drafter, drafter_config
from experiments.pipeline.export import export_for_serving

FORMATS = ("blockdraft", "dflash")


def target():
    return tiny_target("qwen2", vocab_size=48, num_layers=3, seed=0)


def saved(folder, fmt: str, seed: int = 1, **kwargs):
    """A fresh drafter (random weights from ``seed``) of ``target()`` saved in ``folder`` in format ``fmt``."""
    model = target()
    torch.manual_seed(seed)
    drafter = factory.from_target(model, block_size=4, num_layers=1, target_layer_ids=(1, 2), **kwargs)
    if fmt == "dflash":
        export_dflash(drafter, folder)
    else:
        drafter.save_pretrained(folder)
    return drafter


def edit(folder, change) -> None:
    raw = json.loads((folder / "config.json").read_text())
    change(raw)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))


def load_quietly(folder, **kwargs):
    """``factory.load`` with every warning an error: an untouched folder loads without a word."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return factory.load(folder, target(), **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_untouched_save_or_export_loads_silently_with_its_weights(tmp_path, fmt):
    drafter = saved(tmp_path, fmt)
    record = json.loads((tmp_path / RECORD_NAME).read_text())
    assert record["weights_sha256"] == {"model.safetensors": sha256_file(tmp_path / "model.safetensors")}
    assert record["settings"]["block_size"] == 4
    loaded = load_quietly(tmp_path)
    assert loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_edited_setting_is_refused_naming_the_file_the_key_and_both_values(tmp_path, fmt):
    saved(tmp_path, fmt)
    edit(tmp_path, lambda raw: raw.update(block_size=8))
    with pytest.raises(ChangedDrafterError) as info:
        factory.load(tmp_path, target())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"drafter config {tmp_path / 'config.json'} differs from the settings "
                              f"{tmp_path / RECORD_NAME} records: block_size is 8, recorded 4. "), message
    assert message.endswith("set drafter.allow_edited_settings=true to use the edited ones")


def test_an_edited_variant_option_is_named_by_its_dotted_key(tmp_path):
    saved(tmp_path, "blockdraft", variants={"refine": {"passes": 1}})
    edit(tmp_path, lambda raw: raw["variants"]["refine"].update(passes=3))
    with pytest.raises(ChangedDrafterError, match="variants.refine.passes is 3, recorded 1"):
        factory.load(tmp_path, target())
    edit(tmp_path, lambda raw: raw.update(variants={}))  # the variant dropped
    with pytest.raises(ChangedDrafterError, match="variants.refine is absent, recorded {.passes.: 1}"):
        factory.load(tmp_path, target())


def test_a_serving_choice_of_an_export_is_not_a_trained_setting(tmp_path):
    saved(tmp_path, "dflash")
    edit(tmp_path, lambda raw: raw.update(max_position_embeddings=4096, dtype="bfloat16"))
    assert load_quietly(tmp_path).config.block_size == 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_swapped_for_another_drafters_are_refused_naming_both_hashes(tmp_path, fmt):
    ours, other = tmp_path / "ours", tmp_path / "other"
    saved(ours, fmt, seed=1)
    saved(other, fmt, seed=2)  # the same shapes, other weights
    recorded = sha256_file(ours / "model.safetensors")
    shutil.copy(other / "model.safetensors", ours / "model.safetensors")
    found = sha256_file(ours / "model.safetensors")
    assert found != recorded
    with pytest.raises(ChangedDrafterError) as info:
        factory.load(ours, target())
    assert str(info.value) == (
        f"drafter weights {ours / 'model.safetensors'} have sha256 {found} but {ours / RECORD_NAME} records "
        f"{recorded}: the file was replaced or changed after the drafter was saved; restore the saved file, or "
        "save or export the drafter again to record these weights")
    with pytest.raises(ChangedDrafterError, match=found):  # no setting lets other weights through
        factory.load(ours, target(), allow_edited_settings=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_override_is_accepted_and_recorded_in_the_evaluation_info(tmp_path, fmt):
    saved(tmp_path, fmt)
    edit(tmp_path, lambda raw: raw.update(block_size=8))
    assert drafter_config("block")["allow_edited_settings"] is False  # the key drafter.allow_edited_settings sets
    with pytest.raises(ChangedDrafterError, match="block_size is 8, recorded 4"):
        block_drafter(target(), str(tmp_path))
    with pytest.warns(UserWarning, match=r"block_size is 8, recorded 4; used anyway "
                                         r"\(drafter.allow_edited_settings=true\)"):
        built = block_drafter(target(), str(tmp_path), allow_edited_settings=True)
    assert built.drafter.num_draft_tokens == 7
    assert built.info["edited_settings"] == {"block_size": {"recorded": 4, "found": 8}}
    assert built.info["config"]["allow_edited_settings"] is True and built.info["config"]["block_size"] == 8


def test_an_unedited_drafter_records_no_override_in_the_evaluation_info(tmp_path):
    saved(tmp_path, "blockdraft", variants={"refine": {"passes": 1}})
    built = block_drafter(target(), str(tmp_path), refine_passes=2)  # a decoding setting, not an edit
    assert built.info["edited_settings"] is None and "allow_edited_settings" not in built.info["config"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_old_save_without_the_record_loads_with_a_one_line_warning(tmp_path, fmt):
    drafter = saved(tmp_path, fmt)
    (tmp_path / RECORD_NAME).unlink()
    edit(tmp_path, lambda raw: None)  # re-written: nothing to compare it with
    with pytest.warns(UserWarning) as caught:
        loaded = factory.load(tmp_path, target())
    messages = [str(w.message) for w in caught if RECORD_NAME in str(w.message)]
    assert messages == [(f"drafter {tmp_path} has no {RECORD_NAME} (saved by an older blockdraft or another tool): "
                         "its weights and config.json are loaded without checking that they are those it was saved "
                         "with; save or export it again to record them")]
    assert loaded.config == drafter.config
    loaded.save_pretrained(tmp_path / "again")  # saved again: recorded, and then checked
    assert (tmp_path / "again" / RECORD_NAME).is_file() and load_quietly(tmp_path / "again").config == drafter.config


def test_export_refuses_an_edited_drafter_unless_allowed(tmp_path):
    saved(tmp_path / "drafter", "blockdraft")
    edit(tmp_path / "drafter", lambda raw: raw.update(block_size=8))
    cfg = {"drafter": {"path": str(tmp_path / "drafter")}, "out": str(tmp_path / "served"), "target_path": None,
           "dtype": None, "max_position_embeddings": None}
    with pytest.raises(ChangedDrafterError, match="block_size is 8, recorded 4"):
        export_for_serving(OmegaConf.create(cfg))
    assert not (tmp_path / "served").exists()
    allowed = {**cfg, "drafter": {**cfg["drafter"], "allow_edited_settings": True}}
    with pytest.warns(UserWarning, match="used anyway"):
        export_for_serving(OmegaConf.create(allowed))
    assert "block size 8" in (tmp_path / "served" / "README.md").read_text()
    assert load_quietly(tmp_path / "served").config.block_size == 8


@pytest.mark.parametrize("fmt", FORMATS)
def test_init_from_an_edited_drafter_needs_the_override_of_the_drafter_config(tmp_path, fmt):
    from hydra.utils import instantiate

    saved(tmp_path, fmt)
    edit(tmp_path, lambda raw: raw.update(block_size=8))
    cfg = OmegaConf.load("conf/drafter/dflash.yaml")
    cfg.init_from, cfg.block_size, cfg.num_layers = str(tmp_path), None, None
    assert cfg.allow_edited_settings is False
    with pytest.raises(ChangedDrafterError, match="block_size is 8, recorded 4"):
        instantiate(cfg)(target())
    cfg.allow_edited_settings = True
    with pytest.warns(UserWarning, match="used anyway"):
        assert instantiate(cfg)(target()).config.block_size == 8
