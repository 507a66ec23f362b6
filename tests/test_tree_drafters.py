"""Tree and hybrid drafting (drafters.tree): the best-first tree is the top-N paths by product score, lookup's
paths are the matched n-gram's distinct continuations, and every policy (tree, chain, hybrid, merged, lookup
tree) decodes exactly: token-identical to greedy at T = 0, the target's distribution at T = 1."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import left_padded_prompts, sampled_continuations_pvalue, tiny_target
from test_drafter_model import build_drafter

from drafters import PolicyDrafter
from drafters.tree import TreeDrafter, TreePolicy, best_first_tree, merge_paths
from verify import PromptLookupDrafter, speculative_generate
from verify.lookup import lookup_paths


def test_best_first_tree_is_the_top_paths_by_product_score():
    torch.manual_seed(0)
    log_probs = torch.randn(3, 5).log_softmax(-1)  # K = 3 slots over 5 tokens
    for budget in (1, 4, 9, 20):
        tokens, parents = best_first_tree(log_probs, budget)
        assert len(tokens) == budget
        paths, scores = [], []
        for i in range(len(tokens)):  # each node's root path and its score
            path, node = [], i
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            path = path[::-1]
            assert all(p < i for p in [parents[i]])  # parents come first
            paths.append(tuple(path))
            scores.append(sum(float(log_probs[k, t]) for k, t in enumerate(path)))
        assert len(set(paths)) == budget
        every = [(sum(float(log_probs[k, t]) for k, t in enumerate(p)), p)
                 for d in (1, 2, 3) for p in itertools.product(range(5), repeat=d)]
        best = sorted(every, reverse=True)[:budget]
        assert sorted(scores, reverse=True) == pytest.approx([s for s, _ in best])


def test_lookup_paths_and_merging():
    seq = torch.tensor([5, 6, 7, 9, 5, 6, 8, 3, 5, 6])  # "5 6" recurs twice: followed by 7 9 / 8 3
    n, paths = lookup_paths(seq, 3, 1, depth=3, max_paths=4)
    assert n == 2 and paths == [[8, 3, 5], [7, 9, 5]]
    assert lookup_paths(seq, 3, 1, depth=3, max_paths=1) == (2, [[8, 3, 5]])
    assert lookup_paths(torch.tensor([1, 2, 3]), 3, 1, depth=2) == (0, [[3, 3]])
    tokens, parents = merge_paths([8, 4], [-1, 0], [[8, 3], [7]])
    assert tokens == [8, 4, 3, 7] and parents == [-1, 0, 0, -1]


def _looping_prompts(vocab: int):
    """Rows that repeat themselves (lookup serves them) beside random rows (the drafter does), left-padded."""
    ids, mask = left_padded_prompts([5, 14, 4, 11], vocab, seed=3)
    ids[1, -14:] = ids[1, -5:].repeat(3)[:14]
    ids[3, -11:] = ids[3, -4:].repeat(3)[:11]
    return ids, mask


POLICIES = {
    "tree": (False, {"budget": 6}),
    "tree_flat": (False, {"budget": 6, "score_temperature": 4.0}),
    "chain": (False, {"chain_width": 3}),
    "hybrid": (True, {"budget": 4, "lookup_min_match": 2, "lookup_depth": 4}),
    "hybrid_paths": (True, {"budget": 3, "lookup_min_match": 1, "lookup_depth": 3, "lookup_paths": 3}),
    "merged": (True, {"budget": 4, "merge": True, "lookup_depth": 4}),
    "lookup_tree": (True, {"lookup_paths": 3, "lookup_depth": 4}),
}


def _tree_drafter(target, name, block_size=5):
    lookup, settings = POLICIES[name]
    torch.manual_seed(7)
    block = None if name == "lookup_tree" else PolicyDrafter(build_drafter(target, "dflash", block_size=block_size))
    lookup = PromptLookupDrafter(target.config.vocab_size, 4) if lookup else None
    return TreeDrafter(block, lookup, TreePolicy(**settings))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_is_greedy_exact(name):
    target = tiny_target("llama", vocab_size=64, seed=1)
    ids, mask = _looping_prompts(64)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    drafter = _tree_drafter(target, name)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out.sequences, ref)
    sources = {s for row in out.draft_sources for s in row}
    expected = {"tree": {"drafter"}, "tree_flat": {"drafter"}, "chain": {"drafter"}, "lookup_tree": {"lookup"}, "merged": {"merged", "drafter"},
                "hybrid": {"lookup", "drafter"}, "hybrid_paths": {"lookup", "drafter"}}[name]
    assert sources == expected


def test_a_higher_score_temperature_spends_the_nodes_wider(monkeypatch):
    """score_temperature flattens each slot before the best-first ranking: near 0 the argmax chain is taken first
    (one node below the root), high it spends all N nodes on slot 1's runners-up; output is the target's either way."""
    target = tiny_target("llama", vocab_size=64, seed=1)
    ids, mask = _looping_prompts(64)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    original, trees = TreePolicy.row_tree, []
    monkeypatch.setattr(TreePolicy, "row_tree", lambda self, lookup, top: trees.append(original(self, lookup, top))
                        or trees[-1])
    below_root = {}
    for temperature in (0.02, 50.0):
        trees.clear()
        torch.manual_seed(7)
        block = PolicyDrafter(build_drafter(target, "dflash", block_size=5))
        drafter = TreeDrafter(block, None, TreePolicy(budget=6, score_temperature=temperature))
        out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=12)
        assert torch.equal(out.sequences, ref)
        below_root[temperature] = [parents.count(-1) for _, parents, _ in trees]
        assert [len(tokens) for tokens, _, _ in trees] == [6] * len(trees)
    assert set(below_root[50.0]) == {6}  # all six nodes are slot 1's top six
    assert max(below_root[0.02]) < 6 and sum(below_root[0.02]) < sum(below_root[50.0])


def test_the_drafter_pass_is_skipped_where_lookup_serves_every_row(monkeypatch):
    target = tiny_target("llama", vocab_size=64, seed=1)
    ids, mask = _looping_prompts(64)
    drafter = _tree_drafter(target, "hybrid")
    calls = []
    inner = drafter.block.drafter
    original = inner.block_states
    monkeypatch.setattr(inner, "block_states", lambda block, rows=None: calls.append(rows) or original(block, rows))
    rows = torch.tensor([1, 3])  # the looping rows only
    out = speculative_generate(target, drafter, ids[rows], attention_mask=mask[rows], max_new_tokens=12)
    lookup_steps = sum(row.count("lookup") for row in out.draft_sources)
    drafter_steps = sum(row.count("drafter") for row in out.draft_sources)
    assert lookup_steps > 0
    assert len(calls) <= drafter_steps  # no pass in a step that no row drafted itself


def test_bad_policies_are_refused():
    target = tiny_target("llama", vocab_size=64, seed=1)
    block = PolicyDrafter(build_drafter(target, "dflash", block_size=5))
    lookup = PromptLookupDrafter(64, 4)
    with pytest.raises(ValueError, match="needs a drafter"):
        TreeDrafter(None, None)
    with pytest.raises(ValueError, match=r"drafter.budget=0"):
        TreeDrafter(block, None, TreePolicy(budget=0))
    with pytest.raises(ValueError, match=r"drafter.score_temperature=0.0: must be > 0"):
        TreeDrafter(block, None, TreePolicy(score_temperature=0.0))
    with pytest.raises(ValueError, match=r"drafter.chain_width=9: must be in 1..4"):
        TreeDrafter(block, None, TreePolicy(chain_width=9))
    with pytest.raises(ValueError, match="merge=true .* needs both"):
        TreeDrafter(None, lookup, TreePolicy(merge=True))
    with pytest.raises(ValueError, match=r"lookup_min_match=4 exceeds prompt lookup's max_ngram=3"):
        TreeDrafter(block, PromptLookupDrafter(64, 4, max_ngram=3), TreePolicy(lookup_min_match=4))
    TreeDrafter(block, PromptLookupDrafter(64, 4, max_ngram=3), TreePolicy(lookup_min_match=3))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "merged"])
def test_hybrid_and_merged_sample_the_target_distribution(name):
    target = tiny_target("llama", vocab_size=5, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    torch.manual_seed(7)
    block = PolicyDrafter(build_drafter(target, "dflash", block_size=4))
    policy = TreePolicy(budget=4, lookup_min_match=1, lookup_depth=3, lookup_paths=2, merge=name == "merged")
    drafter = TreeDrafter(block, PromptLookupDrafter(5, 3), policy)
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, [3, 1, 3, 1], length=3, batches=5, rows=800)
    assert accepted > 300
    assert pvalue > 1e-3
