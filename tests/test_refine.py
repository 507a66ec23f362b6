"""Refinement passes (the ``refine`` variant): the block re-run on its own argmax drafts."""

import pytest
import torch
from conftest import sampled_continuations_pvalue, tiny_target
from test_drafter_model import _run_target, build_drafter, build_target

from drafters import factory
from drafters.dflash import DFlashFormatError, export_dflash
from drafters.layers import build_block_attention_mask


def _forward(drafter, states, ids, anchors):
    return drafter.forward_train(states, ids, torch.arange(ids.shape[1]).expand_as(ids), anchors)


def test_training_self_conditions_odd_blocks_on_a_first_pass():
    """Train mode: even blocks are the plain pass on the hints, odd blocks one pass on the plain pass's argmax
    (what eval mode does with one refinement), and the gradient reaches the drafter through both."""
    target = build_target("llama")
    torch.manual_seed(5)
    drafter = build_drafter(target, "hinted", block_size=5, variants={"refine": {"passes": 1}}).train()
    ids = torch.randint(0, 6, (2, 16))
    states = _run_target(target, ids)
    anchors = torch.tensor([[2, 5, 9, 11], [1, 6, 8, 12]])
    with torch.no_grad():
        plain = _forward(factory.without_variant(drafter, "refine"), states, ids, anchors)
        refined = _forward(drafter.eval(), states, ids, anchors)
    assert not torch.allclose(plain, refined, atol=1e-3)  # the refinement pass changes the logits
    trained = _forward(drafter.train(), states, ids, anchors)
    torch.testing.assert_close(trained[:, 0::2].detach(), plain[:, 0::2], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(trained[:, 1::2].detach(), refined[:, 1::2], atol=2e-5, rtol=1e-4)
    trained[:, 1::2].logsumexp(-1).sum().backward()  # odd blocks alone
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.layers.parameters() if p.requires_grad)


def test_more_passes_draft_from_the_previous_pass():
    """Two refinement passes = one pass on the argmax of the one-refinement logits (eval mode)."""
    target = build_target("qwen2")
    torch.manual_seed(6)
    drafter = build_drafter(target, "dflash", block_size=4).eval()
    ids = torch.randint(0, 96, (1, 12))
    states = _run_target(target, ids)
    anchors = torch.tensor([[3, 7]])
    with torch.no_grad():
        once = _forward(factory.with_variant(drafter, "refine", passes=1), states, ids, anchors)
        twice = _forward(factory.with_variant(drafter, "refine", passes=2), states, ids, anchors)
        pos = torch.arange(12).view(1, 12)
        kv = drafter.context_kv([states[i] for i in drafter.target_layer_ids], pos)
        mask = build_block_attention_mask(anchors, 4, 12, None, None)
        again = drafter.block_logits(ids.gather(1, anchors), pos.gather(1, anchors), kv, mask, once.argmax(-1))
    torch.testing.assert_close(twice, again, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_refined_drafter_keeps_the_target_distribution():
    """Chi-square of 3-token continuations at T = 1 against the target's exact distribution, drafts sampled
    from the last of two refinement passes."""
    target = tiny_target("llama", vocab_size=8, seed=11, hidden_size=16, num_layers=2, init_range=0.6)
    torch.manual_seed(3)
    drafter = build_drafter(target, "refined", block_size=4)
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, [5, 3, 6, 5, 3], 3, 60, 40)
    assert accepted > 0
    assert pvalue > 1e-3


def test_refine_passes_validated_and_export_refuses_them(tmp_path):
    target = build_target("qwen2")
    drafter = build_drafter(target, "dflash", block_size=4, variants={"refine": {"passes": 1}})
    assert drafter.variant_names == ("refine",) and drafter.variants["refine"].passes == 1
    with pytest.raises(ValueError, match="refine_passes must be >= 1 with the refine variant.*got -1"):
        build_drafter(target, "dflash", block_size=4, variants={"refine": {"passes": -1}})
    with pytest.raises(ValueError, match="refine_passes must be >= 1 with the refine variant"):
        factory.with_variant(drafter, "refine", passes=0)
    with pytest.raises(DFlashFormatError, match="DFlash engines run the block once.*without_variant"):
        export_dflash(drafter, tmp_path / "out")
    export_dflash(factory.without_variant(drafter, "refine"), tmp_path / "out")  # its first pass, the same weights
    assert (tmp_path / "out" / "model.safetensors").is_file()
