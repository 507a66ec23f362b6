"""verify.reference: the plain loop gives what the tuned loop (verify.generate) gives: the same tokens at T = 0 for
chain and tree drafters, and the target's distribution at T = 1 (chi-square), with q used by a sampled chain."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import left_padded_prompts, sampled_continuations_pvalue, tiny_target
from test_drafter_model import build_drafter

import verify
from drafters import PolicyDrafter
from drafters.tree import TreeDrafter, TreePolicy
from verify import AssistantDrafter, PromptLookupDrafter, speculative_generate, truncated_copy
from verify.reference import reference_generate


def _drafters(target):
    torch.manual_seed(7)
    block = PolicyDrafter(build_drafter(target, "dflash", block_size=5))
    vocab = target.config.vocab_size
    return {"assistant": AssistantDrafter(truncated_copy(target, 1), 3),
            "lookup": PromptLookupDrafter(vocab, 4),
            "block": block,
            "tree": TreeDrafter(block, None, TreePolicy(budget=5)),
            "hybrid": TreeDrafter(block, PromptLookupDrafter(vocab, 4), TreePolicy(budget=3, lookup_min_match=1))}


@pytest.mark.parametrize("name", ["assistant", "lookup", "block", "tree", "hybrid"])
def test_the_reference_loop_gives_the_tuned_loops_tokens(name):
    target = tiny_target("llama", vocab_size=64, seed=1)
    ids, mask = left_padded_prompts([6, 3, 9], 64, seed=4)
    ids[2, -9:] = ids[2, -3:].repeat(3)  # a row that repeats itself: lookup has something to copy
    tuned = speculative_generate(target, _drafters(target)[name], ids, attention_mask=mask, max_new_tokens=16,
                                 eos_token_id=5)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    plain = reference_generate(target, _drafters(target)[name], prompts, max_new_tokens=16, eos_token_id=5)
    assert plain == tuned.new_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["assistant", "hybrid"])
def test_the_reference_loop_samples_the_target_distribution(name, monkeypatch):
    target = tiny_target("llama", vocab_size=5, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    drafter = _drafters(target)[name]

    def plain(target, drafter, ids, max_new_tokens, temperature, generator):  # speculative_generate's shape
        new = reference_generate(target, drafter, ids.tolist(), max_new_tokens=max_new_tokens, temperature=temperature,
                                 generator=generator)
        return SimpleNamespace(new_tokens=new, accept_histogram=[0])

    monkeypatch.setattr(verify, "speculative_generate", plain)
    pvalue, _ = sampled_continuations_pvalue(target, drafter, [3, 1, 3, 1], length=3, batches=1, rows=3000)
    assert pvalue > 1e-3
