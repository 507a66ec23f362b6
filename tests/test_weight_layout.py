"""verify.layout: column-major linear weights keep a model's values, shapes, ties and outputs."""

from __future__ import annotations

import torch
from conftest import tiny_target
from torch import nn

from verify.generate import target_generate
from verify.layout import (
    OneDNNPackedLinear,
    column_major,
    column_major_linears,
    is_column_major,
    onednn_packed_linears,
    set_weight_layout,
)
from verify.target_pass import head_logits


def test_column_major_weight_has_the_same_values_and_shape():
    weight = torch.randn(5, 3)
    moved = column_major(weight)
    assert moved.shape == weight.shape and torch.equal(moved, weight)
    assert is_column_major(moved) and not is_column_major(weight) and moved.stride() == (1, 5)


def test_a_model_keeps_its_ties_and_outputs_and_relaying_twice_changes_nothing():
    model = tiny_target("llama", vocab_size=64, hidden_size=32, num_layers=2)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert column_major_linears(model) == len({id(m.weight) for m in linears})
    assert all(is_column_major(m.weight) for m in linears)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one tensor
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert column_major_linears(model) == 0


def test_greedy_decoding_is_token_identical_after_relaying():
    model = tiny_target("llama", vocab_size=64, hidden_size=32, num_layers=2, init_range=0.5)
    prompts = torch.randint(3, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    before = target_generate(model, prompts, max_new_tokens=12).sequences
    column_major_linears(model)
    after = target_generate(model, prompts, max_new_tokens=12).sequences
    assert torch.equal(before, after)


def test_a_wrapped_drafter_and_its_target_are_relaid_and_speculative_decoding_stays_greedy_identical():
    from conftest import left_padded_prompts

    from drafters import DraftingPolicy, PolicyDrafter, factory
    from drafters.checks import target_weights_sha1
    from verify.generate import speculative_generate

    target = tiny_target("llama", vocab_size=64, seed=1)
    torch.manual_seed(7)
    drafter = PolicyDrafter(factory.from_target(target, block_size=6), DraftingPolicy())
    ids, mask = left_padded_prompts([6, 3, 8], 64, seed=1)
    signature = target_weights_sha1(target)
    before = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    assert set_weight_layout("row_major", target, drafter) == 0
    assert set_weight_layout("column_major", target, drafter) > 0
    inner = [m for m in drafter.drafter.modules() if isinstance(m, nn.Linear)]
    assert inner and all(is_column_major(m.weight) for m in inner)
    assert target_weights_sha1(target) == signature  # the drafter still knows its target
    after = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    greedy = target_generate(target, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    assert torch.equal(after.sequences, before.sequences) and torch.equal(after.sequences, greedy.sequences)


def test_an_unknown_layout_is_named():
    import pytest

    from experiments.pipeline.settings import DecodingSettings

    with pytest.raises(ValueError, match="weight_layout: 'diagonal' is not one of"):
        DecodingSettings(weight_layout="diagonal")
    with pytest.raises(ValueError, match="weight_layout: 'diagonal'"):
        set_weight_layout("diagonal", tiny_target("llama"))



def test_onednn_packed_linears_keep_parameters_ties_and_outputs_at_every_row_count():
    model = tiny_target("llama", vocab_size=64, hidden_size=32, num_layers=2)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    params = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = [model(ids[:, :n]).logits for n in (1, 3, 9)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert onednn_packed_linears(model) == len(linears)
    assert all(type(m) is OneDNNPackedLinear for m in linears)
    assert {n: p for n, p in model.named_parameters()} == params  # the same tensors: ties and fingerprints hold
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        after = [model(ids[:, :n]).logits for n in (1, 3, 9)]
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert onednn_packed_linears(model) == 0  # idempotent


def test_onednn_packed_linear_takes_the_packed_path_at_every_row_count_but_never_with_a_gradient(monkeypatch):
    layer = nn.Linear(8, 5)
    onednn_packed_linears(layer)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(layer(x[:, :1]), nn.functional.linear(x[:, :1], layer.weight, layer.bias))
        assert layer(x[:, :0]).shape == (1, 0, 5)  # no rows: F.linear
    assert calls == [torch.Size([3, 8]), torch.Size([1, 8])]
    y = layer(x.requires_grad_())  # training: F.linear, with a gradient
    y.sum().backward()
    assert len(calls) == 2 and x.grad is not None


def test_the_verifiers_own_head_product_uses_the_packed_head(monkeypatch):
    head = nn.Linear(16, 300, bias=False)
    states = torch.randn(2, 3, 16)
    with torch.no_grad():
        plain = head_logits(head, states)
        onednn_packed_linears(head)
        calls = []
        real = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a))
        packed = head_logits(head, states)
    assert calls == [torch.Size([6, 16])]  # (b * L, H): one packed product, not verify.hf.linear_logits
    assert packed.shape == (2, 3, 300)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def _target_drafter_prompts():
    from conftest import left_padded_prompts

    from drafters import DraftingPolicy, PolicyDrafter, factory

    target = tiny_target("llama", vocab_size=64, seed=1)
    torch.manual_seed(7)
    drafter = PolicyDrafter(factory.from_target(target, block_size=6), DraftingPolicy())
    return target, drafter, *left_padded_prompts([6, 3, 8], 64, seed=1)


def test_the_lazy_verifier_applies_a_packed_head_to_every_position_at_once(monkeypatch):
    """At T=0 the verifier applies the LM head lazily (first positions, then growing chunks); a packed head costs
    about as much over every position as over a few, so it gets them all in one product."""
    import verify.generate as gen

    target, drafter, ids, mask = _target_drafter_prompts()
    seen, real = [], gen.verify_greedy_lazy
    monkeypatch.setattr(gen, "verify_greedy_lazy",
                        lambda drafts, final, head, first: seen.append((drafts.shape[1], first)) or real(drafts, final, head, first))
    plain = gen.speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    assert any(first < width + 1 for width, first in seen)  # lazy: the first positions only
    seen.clear()
    set_weight_layout("onednn_packed", target, drafter)
    packed = gen.speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    assert seen and all(first == width + 1 for width, first in seen)
    assert torch.equal(packed.sequences, plain.sequences)


def test_greedy_and_speculative_decoding_are_token_identical_with_onednn_packed_weights():
    from drafters.checks import target_weights_sha1
    from verify.generate import speculative_generate

    target, drafter, ids, mask = _target_drafter_prompts()
    signature = target_weights_sha1(target)
    greedy = target_generate(target, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    assert set_weight_layout("onednn_packed", target, drafter) > 0
    assert target_weights_sha1(target) == signature
    packed_greedy = target_generate(target, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    spec = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=2)
    assert torch.equal(packed_greedy.sequences, greedy.sequences)
    assert torch.equal(spec.sequences, greedy.sequences)
