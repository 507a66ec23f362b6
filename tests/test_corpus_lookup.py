"""CorpusLookupDrafter and NgramStore: retrieval drafting from the target's own answers (the store's rule,
prompt lookup first, exact greedy decoding, and a corpus that holds the target's answer drafts it in full)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_generate import check_greedy
from test_prompt_lookup import next_token_target

from verify import CorpusLookupDrafter, NgramStore, PromptLookupDrafter, speculative_generate, target_generate

V = 64


def drafts_for(drafter, history, anchor):
    drafter.reset(1)
    ids = torch.tensor([history])
    drafter.extend(ids, torch.ones_like(ids), None, None)
    tokens, q = drafter.draft(torch.tensor([anchor]), torch.tensor([len(history)]))
    assert q is None and tokens.shape == (1, drafter.num_draft_tokens)
    return tokens[0].tolist()


def test_store_follows_the_most_frequent_continuation_of_the_longest_suffix():
    store = NgramStore([[1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 7, 8], [5, 3, 6]], max_ngram=3)
    assert store.num_tokens == 16
    assert store.continuation([1, 2, 3], 3) == [4]  # "1 2 3" -> 4 (twice); "3 4" and "4" are never followed
    assert store.continuation([9, 2, 3], 3) == [7, 8]  # the longest suffix "9 2 3" wins over "3" -> 4
    assert store.continuation([0, 5, 3], 2) == [6]  # "5 3" -> 6 where "3" alone would say 4
    assert store.continuation([0, 0, 3], 2) == [4]  # only "3" is known: its most frequent successor
    assert store.continuation([0, 0, 3], 2, min_ngram=2) == []  # ... which min_ngram = 2 refuses
    assert NgramStore([[1, 2], [1, 3]], 1).continuation([1], 1) == [2]  # a tie goes to the first seen
    with pytest.raises(ValueError, match="max_ngram must be >= 1"):
        NgramStore([[1]], 0)


def test_drafter_copies_the_row_first_then_the_store_then_repeats():
    store = NgramStore([[10, 11, 12, 13]], max_ngram=2)
    drafter = CorpusLookupDrafter(store, V, num_draft_tokens=5, prompt_min_ngram=2)
    # "20 21" recurs in the row: prompt lookup's copy, as PromptLookupDrafter(min_ngram=2) drafts it
    row = [20, 21, 22, 23, 20]
    assert drafts_for(drafter, row, 21) == drafts_for(PromptLookupDrafter(V, 5, 3, 2), row, 21) == [22, 23, 20, 21, 22]
    # no 2-gram recurs: the store's continuation 12 13, then its last token repeated
    assert drafts_for(drafter, [30, 31, 10], 11) == [12, 13, 13, 13, 13]
    # neither: the anchor repeated
    assert drafts_for(drafter, [30, 31], 40) == [40] * 5
    alone = CorpusLookupDrafter(store, V, num_draft_tokens=5, prompt_min_ngram=None)
    assert drafts_for(alone, [10, 11, 12, 40, 10], 11) == [12, 13, 13, 13, 13]  # the row's copy is not used
    with pytest.raises(ValueError, match="min_ngram must be in 1..2"):
        CorpusLookupDrafter(store, V, 5, min_ngram=3)


@pytest.mark.parametrize("prompt_min_ngram", [None, 2])
def test_greedy_matches_hf_generate(prompt_min_ngram):
    """Exact at T=0 on a random target with left padding and rows leaving early at EOS, with a store of the
    target's own greedy answers to other prompts."""
    target = tiny_target("llama", vocab_size=V, seed=2)
    other = target_generate(target, torch.randint(3, V, (4, 6), generator=torch.Generator().manual_seed(9)),
                            max_new_tokens=30)
    drafter = CorpusLookupDrafter(NgramStore(other.new_tokens, 3), V, 6, prompt_min_ngram=prompt_min_ngram)
    out, _, _ = check_greedy(target, drafter, [7, 3, 12, 1], 40, eos_token_id=2, seed=3)
    assert out.tau >= 1.0


def test_a_store_holding_the_answer_drafts_it_whole():
    """A target that cycles 5 6 7 8 9 and a store that saw the cycle once: from a prompt that never shows it,
    every block after the first is drafted right (τ near K + 1), where prompt lookup must first see a cycle."""
    target = next_token_target({5: 6, 6: 7, 7: 8, 8: 9, 9: 5})
    store = NgramStore([[5, 6, 7, 8, 9, 5]], max_ngram=2)
    input_ids = torch.tensor([[30, 31, 5]])
    K, new = 8, 36
    out = speculative_generate(target, CorpusLookupDrafter(store, V, K), input_ids, max_new_tokens=new)
    base = target_generate(target, input_ids, max_new_tokens=new)
    assert out.new_tokens == base.new_tokens
    assert out.accepted_counts[0] == [K, K, K, K]  # 4 blocks of K + 1 = 36 tokens
    # the first block is the store's; then the row's own tokens hold the cycle and prompt lookup drafts it
    assert out.draft_sources[0] == ["store", "prompt", "prompt", "prompt"]
    lookup = speculative_generate(target, PromptLookupDrafter(V, K), input_ids, max_new_tokens=new)
    assert lookup.accepted_counts[0][0] == 0 and out.tau > lookup.tau


def _fallback_drafter(target, block_size):
    from test_drafter_model import build_drafter

    torch.manual_seed(3)
    return build_drafter(target, "hinted", block_size=block_size).eval()


def test_fallback_drafts_the_rows_the_store_cannot_and_stays_exact():
    """With a block drafter as fallback and min_ngram = 2: rows whose last two tokens the store never saw get
    the block drafter's drafts (it saw every column), the others the store's; greedy identity holds."""
    target = tiny_target("llama", vocab_size=V, seed=2)
    block = _fallback_drafter(target, block_size=7)
    other = target_generate(target, torch.randint(3, V, (4, 6), generator=torch.Generator().manual_seed(9)),
                            max_new_tokens=30)
    store = NgramStore(other.new_tokens, 3)
    drafter = CorpusLookupDrafter(store, V, 6, min_ngram=2, prompt_min_ngram=None, fallback=block)
    assert drafter.target_layer_ids == block.target_layer_ids
    calls = []
    block_draft = block.draft
    block.draft = lambda *a, **k: calls.append(1) or block_draft(*a, **k)
    check_greedy(target, drafter, [7, 3, 12, 1], 40, eos_token_id=2, seed=3)
    assert calls  # some step needed the fallback
    with pytest.raises(ValueError, match="fallback drafter drafts K=6"):
        CorpusLookupDrafter(store, V, 5, fallback=block)


@pytest.mark.slow
def test_fallback_keeps_the_target_distribution():
    """Chi-square at T = 1: rows the store continues draft deterministically (one-hot q), the others sample
    from the block drafter's q, in the same batch."""
    from conftest import sampled_continuations_pvalue

    target = tiny_target("llama", vocab_size=8, seed=11, hidden_size=16, num_layers=2, init_range=0.6)
    store = NgramStore([[5, 3, 6, 1, 2], [6, 5, 3, 7]], max_ngram=2)  # knows "5 3" and "3 6", not most pairs
    drafter = CorpusLookupDrafter(store, 8, 3, min_ngram=2, prompt_min_ngram=None,
                                  fallback=_fallback_drafter(target, block_size=4))
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, [5, 3, 6, 5, 3], 3, 60, 40)
    assert accepted > 0
    assert pvalue > 1e-3


def test_fallback_q_is_one_hot_on_retrieved_rows_and_the_fallbacks_elsewhere():
    target = tiny_target("llama", vocab_size=8, seed=11, hidden_size=16, num_layers=2, init_range=0.6)
    block = _fallback_drafter(target, block_size=4)
    drafter = CorpusLookupDrafter(NgramStore([[5, 3, 6, 1, 2]], 2), 8, 3, min_ngram=2, prompt_min_ngram=None,
                                  fallback=block)
    ids = torch.tensor([[7, 5], [7, 2]])  # anchors 3 and 4: "5 3" is in the store, "2 4" is not
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        drafter.reset(2)
        drafter.extend(ids, torch.ones_like(ids), torch.arange(2).repeat(2, 1), [hidden[i] for i in block.target_layer_ids])
        anchors, positions = torch.tensor([3, 4]), torch.tensor([2, 2])
        tokens, q = drafter.draft(anchors, positions, temperature=1.0, generator=torch.Generator().manual_seed(0))
        _, q_block = block.draft(anchors, positions, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert tokens[0].tolist() == [6, 1, 2]
    assert torch.equal(q[0], torch.nn.functional.one_hot(tokens[0], 8).float())
    torch.testing.assert_close(q[1], q_block[1])
