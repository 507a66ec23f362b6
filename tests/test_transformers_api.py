"""The verifier uses the KV-cache API that the installed transformers asks for, and its own LM head product
(``verify.hf.linear_logits``) gives the head's logits."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import FAMILIES, left_padded_prompts, tiny_target

from drafters import DraftingPolicy, PolicyDrafter, factory
from verify import AssistantDrafter, PromptLookupDrafter, speculative_generate, target_generate
from verify.hf import HEAD_CHUNK, cache_argument, linear_logits, new_kv_cache


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _deprecations(run) -> list[str]:
    """Deprecation warnings (Python warnings, and transformers' logger, whose once-only cache is cleared first)
    raised while ``run()`` decodes."""
    handler, logger = _Records(), logging.getLogger("transformers")
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        logger.removeHandler(handler)
    python = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    return python + [m for m in handler.messages if "deprecated" in m.lower()]


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_raises_no_deprecation_warning(family):
    target = tiny_target(family, vocab_size=64, seed=1)
    torch.manual_seed(0)
    block = factory.from_target(target, block_size=4)
    assistant = AssistantDrafter(tiny_target(family, vocab_size=64, seed=2), 3)
    ids, mask = left_padded_prompts([5, 3], 64, seed=3)

    def run():
        for drafter in (block, assistant):
            for temperature in (0.0, 1.0):
                out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=6,
                                           temperature=temperature, generator=torch.Generator().manual_seed(0))
                assert out.num_new_tokens == 12
        assert target_generate(target, ids, attention_mask=mask, max_new_tokens=4).num_new_tokens == 8

    assert _deprecations(run) == []


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoding_with_variants_and_a_policy_raises_no_deprecation_warning(family):
    """The variants' own target calls (layers copied from the target, a frozen anchor reading the target's cache)
    and the drafting policy pass the cache as transformers asks; the check sees the deprecated keyword."""
    target = tiny_target(family, vocab_size=64, seed=1, num_layers=3)
    torch.manual_seed(0)
    build = {"block_size": 4, "num_layers": 3, "init_layers_from_target": True, "qk_norm": False}
    hinted = factory.from_target(target, variants={"layerwise": {"shifted": True}, "hints": {},
                                                                 "refine": {}}, **build)
    frozen = factory.from_target(target, variants={"layerwise": {"shifted": True},
                                                                 "anchor": {"frozen": True}}, **build)
    drafters = [PolicyDrafter(hinted, DraftingPolicy(follow_hint_after=0)), frozen, PromptLookupDrafter(64, 3)]
    ids, mask = left_padded_prompts([5, 3], 64, seed=3)

    def run():
        for drafter in drafters:
            for temperature in (0.0, 1.0):
                out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=6,
                                           temperature=temperature, generator=torch.Generator().manual_seed(0))
                assert out.num_new_tokens == 12

    assert _deprecations(run) == []
    if cache_argument(target) == "cache":  # this transformers renamed the keyword: the old one is reported
        old = lambda: target(input_ids=ids, past_key_values=new_kv_cache(target), use_cache=True)
        assert any("past_key_values" in m for m in _deprecations(old))


def test_cache_argument_follows_the_forward_signature():
    class Named(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class Wrapper(Old):  # names neither: passes the cache on to its base class's forward
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class Neither(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    assert cache_argument(Named()) == "cache"
    assert cache_argument(Old()) == "past_key_values" == cache_argument(Wrapper()) == cache_argument(Neither())
    import inspect

    expected = "cache" if "cache" in inspect.signature(type(tiny_target("llama")).forward).parameters else (
        "past_key_values")
    assert cache_argument(tiny_target("llama")) == expected


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 15, 16, 33])
def test_linear_logits_equals_the_head(rows):
    generator = torch.Generator().manual_seed(rows)
    vocab = 3 * HEAD_CHUNK + 17  # several chunks and a partial one
    weight = torch.randn(vocab, 24, generator=generator)
    states = torch.randn(rows, 24, generator=generator)
    expected = torch.nn.functional.linear(states, weight)
    got = linear_logits(weight, states)
    assert got.shape == (rows, vocab)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_linear_logits_keeps_gradients_and_checks_shapes():
    weight = torch.randn(2 * HEAD_CHUNK, 8, requires_grad=True)
    states = torch.randn(5, 8)
    linear_logits(weight, states).sum().backward()  # out= has no autograd: the one-product path records it
    torch.testing.assert_close(weight.grad, states.sum(0).expand_as(weight))
    with pytest.raises(ValueError, match="head weight"):
        linear_logits(weight, torch.randn(5, 9))
