"""experiments.bench.step_parts: scripted acceptance and the old verify package beside today's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target

from drafters import BlockDiffusionDrafter
from experiments.bench.step_parts import OneProductHead, ScriptedDrafts, load_verify_at
from verify import speculative_generate, target_generate

pytestmark = pytest.mark.slow


def test_scripted_drafts_keep_the_asked_number_and_the_old_verifier_agrees():
    target = tiny_target("llama", vocab_size=64, seed=1, init_range=0.6)
    torch.manual_seed(0)
    drafter = BlockDiffusionDrafter.from_target(target, block_size=5)
    ids = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    greedy = target_generate(target, ids, max_new_tokens=30).new_tokens[0]
    old = load_verify_at("HEAD")
    for accept in (0, 2, 3):
        scripted = ScriptedDrafts(drafter, greedy, ids.shape[1], accept)
        out = speculative_generate(target, scripted, ids, max_new_tokens=20)
        assert out.new_tokens[0] == greedy[:20]
        assert set(out.accepted_counts[0][:-1]) == {accept}  # the last step may stop at the budget
        before = old.speculative_generate(target, ScriptedDrafts(OneProductHead(drafter), greedy, ids.shape[1], accept),
                                          ids, max_new_tokens=20)
        assert before.new_tokens == out.new_tokens and before.accepted_counts == out.accepted_counts
