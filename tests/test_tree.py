"""Tree verification (verify.tree, the tree step of verify.generate): exact at T = 0 (token-identical to greedy
decoding) and at T > 0 (the target's distribution), for random ragged trees, EOS inside a tree, the
max_new_tokens cap; a one-child tree decodes as the chain."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, sampled_continuations_pvalue, tiny_target
from test_generate import hf_greedy

from verify import PromptLookupDrafter, speculative_generate
from verify.tree import DraftTree, ancestor_mask, check_tree, node_depths, pad_trees, walk_tree


class RandomTreeDrafter:
    """Random ragged trees (0..max_nodes nodes, depth <= K) over tokens of ``vocab``; when ``reference`` (a greedy
    continuation per original row) is given, most trees also hold a prefix of the row's true continuation, with a
    wrong token now and then, so walks go deep, stop early and branch."""

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size, num_draft_tokens, max_nodes, reference=None, seed=0, vocab=None):
        self.vocab_size, self.num_draft_tokens, self.max_nodes = vocab_size, num_draft_tokens, max_nodes
        self.reference, self.vocab = reference, vocab if vocab is not None else list(range(vocab_size))
        self.generator = torch.Generator().manual_seed(seed)

    def _int(self, high):
        return int(torch.randint(high, (1,), generator=self.generator))

    def reset(self, batch_size):
        self.rows, self.kept = list(range(batch_size)), [0] * batch_size

    def extend(self, input_ids, attention_mask, position_ids=None, hidden_states=None):
        self.kept = [k + int(m.sum()) for k, m in zip(self.kept, attention_mask)]

    def select_rows(self, rows):
        self.rows = [self.rows[i] for i in rows.tolist()]
        self.kept = [self.kept[i] for i in rows.tolist()]

    def _row_tree(self, row, kept):
        tokens, parents, depth = [], [], []
        for _ in range(self._int(self.max_nodes + 1)):
            parent = self._int(len(tokens) + 1) - 1
            d = 1 if parent < 0 else depth[parent] + 1
            if d > self.num_draft_tokens:
                parent, d = -1, 1
            tokens.append(self.vocab[self._int(len(self.vocab))])
            parents.append(parent)
            depth.append(d)
        if self.reference is not None and self._int(4) > 0:
            truth = self.reference[row][kept:]  # the anchor is reference[kept - 1]; its successor is next
            parent = -1
            for token in truth[: 1 + self._int(self.num_draft_tokens)]:
                if self._int(6) == 0:
                    token = self.vocab[self._int(len(self.vocab))]
                tokens.append(int(token))
                parents.append(parent)
                parent = len(tokens) - 1
        return tokens, parents

    def draft_tree(self, anchor_ids, anchor_position_ids, **sampling):
        return pad_trees([self._row_tree(row, kept + 1) for row, kept in zip(self.rows, self.kept)],
                         anchor_ids.device)


class ChainAsTree:
    """A chain drafter's drafts verified as one-child trees."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.num_draft_tokens, self.vocab_size = drafter.num_draft_tokens, drafter.vocab_size
        self.target_layer_ids = drafter.target_layer_ids

    def reset(self, batch_size):
        self.drafter.reset(batch_size)

    def extend(self, *args):
        self.drafter.extend(*args)

    def select_rows(self, rows):
        self.drafter.select_rows(rows)

    def draft_tree(self, anchor_ids, anchor_position_ids, **sampling):
        drafts, _ = self.drafter.draft(anchor_ids, anchor_position_ids, **sampling)
        return DraftTree.chain(drafts)


def test_tree_structure_helpers():
    tree = pad_trees([([5, 6, 7, 8], [-1, 0, -1, 1]), ([9], [-1])])
    assert node_depths(tree).tolist() == [[0, 1, 2, 1, 3], [0, 1, 1, 1, 1]]
    mask = ancestor_mask(tree)
    assert mask[0, 4].tolist() == [True, True, True, False, True]  # node 3 sees root, node 0, node 1, itself
    assert mask[0, 3].tolist() == [True, False, False, True, False]
    merged = DraftTree.from_paths([[[1, 2, 3], [1, 2, 4], [5]]])
    assert merged.tokens.tolist() == [[1, 2, 3, 4, 5]] and merged.parents.tolist() == [[-1, 0, 1, 1, -1]]


def test_walk_follows_the_target_draws():
    tree = pad_trees([([5, 6, 7, 8], [-1, 0, -1, 1])])
    logits = torch.full((1, 5, 10), -5.0)
    for column, token in enumerate([5, 7, 8, 1, 3]):  # root -> 5 (node 0) -> 7? no child holds it: stop
        logits[0, column, token] = 5.0
    accepted, nxt, path = walk_tree(tree, logits)
    assert accepted.tolist() == [1] and nxt.tolist() == [7] and path[0, :2].tolist() == [0, 1]
    logits[0, 1] = -5.0
    logits[0, 1, 6] = 5.0  # at node 0 the target says 6 (node 1), at node 1 it says 8 (node 3), then 3
    accepted, nxt, path = walk_tree(tree, logits)
    assert accepted.tolist() == [3] and nxt.tolist() == [3] and path[0].tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("parents, message", [([-1, 1], "not the root"), ([-1, -2], "not the root")])
def test_bad_trees_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        check_tree(DraftTree(torch.tensor([[3, 4]]), torch.tensor([parents]), torch.ones(1, 2, dtype=torch.bool)))


def test_too_deep_and_orphaned_trees_are_refused():
    chain = DraftTree.chain(torch.tensor([[3, 4, 5]]))
    with pytest.raises(ValueError, match="deeper than the drafter's 2"):
        check_tree(chain, max_depth=2)
    orphan = DraftTree(chain.tokens, chain.parents, torch.tensor([[True, False, True]]))
    with pytest.raises(ValueError, match="padding node"):
        check_tree(orphan)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("K, max_nodes, lengths, eos", [(4, 6, [7, 3, 9], None), (3, 10, [5, 8], 2),
                                                        (6, 3, [4, 6, 2, 9], None)])
def test_random_trees_are_greedy_exact(family, K, max_nodes, lengths, eos):
    target = tiny_target(family, vocab_size=64, seed=1)
    input_ids, attention_mask = left_padded_prompts(lengths, 64, seed=3)
    ref_seq, ref_new, margin = hf_greedy(target, input_ids, attention_mask, 24, eos)
    assert margin > 1e-4
    reference = [input_ids[b][attention_mask[b].bool()].tolist() + ref_new[b] for b in range(len(lengths))]
    drafter = RandomTreeDrafter(64, K, max_nodes, reference, seed=len(lengths))
    out = speculative_generate(target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=24,
                               eos_token_id=eos)
    assert out.new_tokens == ref_new
    assert torch.equal(out.sequences, ref_seq)
    assert max(max(c) for c in out.accepted_counts) >= 2  # walks went deep
    assert out.tau == pytest.approx(out.num_new_tokens / out.num_target_forwards)


def test_eos_inside_a_tree_and_the_cap():
    target = tiny_target("llama", vocab_size=64, seed=1)
    input_ids, attention_mask = left_padded_prompts([6, 4], 64, seed=5)
    _, free, _ = hf_greedy(target, input_ids, attention_mask, 30)
    eos = free[0][5]  # a token the first row writes at its 6th step: an EOS inside some tree
    _, ref_new, _ = hf_greedy(target, input_ids, attention_mask, 30, eos)
    reference = [input_ids[b][attention_mask[b].bool()].tolist() + free[b] for b in range(2)]
    drafter = RandomTreeDrafter(64, 5, 4, reference, seed=1)
    out = speculative_generate(target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=30,
                               eos_token_id=eos)
    assert out.new_tokens == ref_new and out.new_tokens[0][-1] == eos
    capped = speculative_generate(target, RandomTreeDrafter(64, 5, 4, reference, seed=2), input_ids,
                                  attention_mask=attention_mask, max_new_tokens=7)
    assert capped.new_tokens == [row[:7] for row in free]


def test_a_one_child_tree_decodes_as_the_chain():
    target = tiny_target("llama", vocab_size=64, seed=1)
    input_ids, attention_mask = left_padded_prompts([9, 5, 12], 64, seed=2)
    chain = speculative_generate(target, PromptLookupDrafter(64, 4), input_ids, attention_mask=attention_mask,
                                 max_new_tokens=20)
    tree = speculative_generate(target, ChainAsTree(PromptLookupDrafter(64, 4)), input_ids,
                                attention_mask=attention_mask, max_new_tokens=20)
    assert tree.new_tokens == chain.new_tokens
    assert tree.accepted_counts == chain.accepted_counts


@pytest.mark.slow
def test_random_trees_sample_the_target_distribution():
    target = tiny_target("llama", vocab_size=5, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    drafter = RandomTreeDrafter(5, 3, 6, seed=4, vocab=[1, 2, 3, 4])
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, [3, 1, 4], length=3, batches=6, rows=1000)
    assert accepted > 500  # the walk went past the root often
    assert pvalue > 1e-3
