"""verify.layout: column-major linear weights keep a model's values, shapes, ties and outputs."""

from __future__ import annotations

import torch
from conftest import tiny_target
from torch import nn

from verify.generate import target_generate
from verify.layout import column_major, column_major_linears, is_column_major


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
