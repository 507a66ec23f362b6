"""Drafters saved by older blockdraft load with today's code: folders saved at commit ce28914 (before the drafter
core moved into drafters/model.py + drafters/factory.py; tests/fixtures/drafters_ce28914, with the logits that code
computed), and the flat config.json of an older blockdraft, read by drafters.factory.upgrade_saved_config."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_target

from drafters import factory
from drafters.factory import upgrade_saved_config

FIXTURES = Path(__file__).parent / "fixtures" / "drafters_ce28914"


@pytest.mark.parametrize("name", ["core", "variants"])
def test_drafters_saved_at_ce28914_load_with_the_same_config_and_logits(name, tmp_path):
    target = tiny_target("llama", vocab_size=64, seed=0, num_layers=2)
    drafter = factory.load(FIXTURES / name, target=target)
    saved = json.loads((FIXTURES / name / "config.json").read_text())
    assert drafter.saved_config() == saved  # today's format: nothing to convert
    ids = torch.arange(12).remainder(7).unsqueeze(0) + 1
    with torch.no_grad():
        logits = drafter.forward_train(target(ids, output_hidden_states=True).hidden_states, ids, None,
                                       torch.tensor([[3, 7]]))
    want = json.loads((FIXTURES / "expected.json").read_text())[name]
    assert list(logits.shape) == want["shape"] and logits.argmax(-1).tolist() == want["argmax"]
    assert float(logits.double().sum()) == pytest.approx(want["sum"], rel=1e-6)
    drafter.save_pretrained(tmp_path)  # saved again: the same config.json
    assert json.loads((tmp_path / "config.json").read_text()) == saved


# The config.json of a drafter saved before variants and q/k norm existed (every research switch a flat field).
FLAT = {"block_size": 4, "num_layers": 2, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 64, "mask_token_id": 63,
        "target_layer_ids": [0, 1], "target_fingerprint": {"model_type": "llama", "vocab_size": 64,
                                                           "hidden_size": 32, "num_hidden_layers": 2},
        "layerwise_context": True, "shifted": True, "causal_anchor": False, "frozen_anchor": False,
        "lookup_hints": True, "lookup_max_ngram": 2, "store_hints": False, "store_num_folds": 4,
        "refine_passes": 1}


def test_the_flat_config_of_an_older_blockdraft_converts_once_into_variants():
    upgraded = upgrade_saved_config(FLAT)
    assert upgraded["variants"] == {"layerwise": {"shifted": True}, "hints": {"max_ngram": 2}, "refine": {"passes": 1}}
    assert upgraded["qk_norm"] is False and upgraded["attention_bias"] is False  # what it was trained with
    assert not set(upgraded) & set(factory.FLAT_KEYS)
    assert upgrade_saved_config(upgraded) == upgraded  # today's format is left as it is
    config, variants = factory.read_saved_config(FLAT)
    assert list(variants) == ["refine", "hints", "layerwise"] and config.num_layers == 2
    with pytest.raises(ValueError, match="shifted=true needs the layerwise variant"):
        upgrade_saved_config(FLAT | {"layerwise_context": False})
