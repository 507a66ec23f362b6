"""PromptLookupDrafter: the lookup rule, its bookkeeping (holes, select_rows), and exact greedy decoding
through verify.speculative_generate, with τ > 1 on a repetitive prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, tiny_target
from test_generate import check_greedy

from verify import PromptLookupDrafter, speculative_generate, target_generate
from verify.lookup import copy_tokens, lookup_start

V = 64


def drafts_for(history, anchor, K=5, mask=None, **kwargs):
    """Drafts of a one-row PromptLookupDrafter whose committed columns are ``history`` (holes where mask=0)."""
    drafter = PromptLookupDrafter(V, K, **kwargs)
    drafter.reset(1)
    ids = torch.tensor([history], dtype=torch.long)
    drafter.extend(ids, torch.ones_like(ids) if mask is None else torch.tensor([mask]), None, None)
    tokens, q = drafter.draft(torch.tensor([anchor]), torch.tensor([len(history)]))
    assert q is None and tokens.dtype == torch.long and tokens.shape == (1, K)
    return tokens[0].tolist()


# ----------------------------------------------------------------------------- the rule


def test_latest_match_wins():
    # "1" occurs at 1 (followed by 5) and at 4 (followed by 6, 7): the latest one is copied, and past
    # the end of the sequence the copy continues with the same period (6 7 1 6 7 ...).
    assert drafts_for([9, 1, 5, 8, 1, 6, 7], anchor=1, max_ngram=1) == [6, 7, 1, 6, 7]


def test_longer_ngram_preferred():
    history = [2, 3, 1, 5, 9, 3, 1, 6, 8, 1, 7, 2, 3]  # then the anchor 1: the row ends in "2 3 1"
    assert drafts_for(history, 1, max_ngram=3) == [5, 9, 3, 1, 6]  # "2 3 1" at 0
    assert drafts_for(history, 1, max_ngram=2) == [6, 8, 1, 7, 2]  # "3 1" latest at 5
    assert drafts_for(history, 1, max_ngram=1) == [7, 2, 3, 1, 7]  # "1" latest at 9, then period 4
    # min_ngram=2 ignores 1-gram matches; min_ngram=3 with no recurring 3-gram falls back
    assert drafts_for([4, 1, 5, 6], 1, min_ngram=2) == [1] * 5
    assert drafts_for([4, 1, 5, 6], 1, min_ngram=1) == [5, 6, 1, 5, 6]


def test_no_match_repeats_the_anchor():
    assert drafts_for([3, 4, 5], anchor=6, K=4) == [6, 6, 6, 6]
    assert drafts_for([], anchor=6, K=3) == [6, 6, 6]  # a one-token prompt: the anchor alone


def test_overlapping_occurrences():
    # "7 7 7" ends the row; its latest earlier occurrence overlaps it (starts at 1, ends before the anchor)
    assert drafts_for([7, 7, 7, 7], anchor=7, K=3) == [7, 7, 7]
    assert lookup_start(torch.tensor([7, 7, 7, 7, 7]), 3) == 4


def test_holes_are_not_tokens():
    # Without the hole (9) the row is 3 4 6 4 8 3 | 4: "3 4" recurs at 0 -> copy 6 4 8 3 4.
    # Counting the hole would give 3 9 4 6 4 8 3 | 4: no "3 4"; "4" latest at 4 -> 8 3 4 8 3.
    assert drafts_for([3, 9, 4, 6, 4, 8, 3], 4, mask=[1, 0, 1, 1, 1, 1, 1]) == [6, 4, 8, 3, 4]
    assert drafts_for([3, 9, 4, 6, 4, 8, 3], 4) == [8, 3, 4, 8, 3]
    # A rejected draft becomes a hole in a later extend call: the anchor 7 only occurs there.
    drafter = PromptLookupDrafter(V, 2)
    drafter.reset(1)
    drafter.extend(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), None, None)
    drafter.extend(torch.tensor([[1, 7, 8]]), torch.tensor([[1, 0, 0]]), None, None)
    assert drafter.draft(torch.tensor([7]), torch.tensor([3]))[0].tolist() == [[7, 7]]


def test_rows_are_independent_and_select_rows():
    rows = [[9, 1, 5, 8, 1, 6, 7], [3, 4, 5], [2, 3, 1, 5]]
    drafter = PromptLookupDrafter(V, 3, max_ngram=1)
    drafter.reset(3)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left-padded: holes on the left
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    drafter.extend(ids, mask, None, None)
    anchors = torch.tensor([1, 6, 1])
    expected = [[6, 7, 1], [6, 6, 6], [5, 1, 5]]
    assert drafter.draft(anchors, mask.sum(1))[0].tolist() == expected
    drafter.select_rows(torch.tensor([2, 0]))
    assert drafter.draft(anchors[[2, 0]], None)[0].tolist() == [expected[2], expected[0]]
    drafter.extend(torch.tensor([[1, 9], [1, 9]]), torch.tensor([[1, 1], [1, 0]]), None, None)
    # row 2 is now 2 3 1 5 1 9 | 9 (its "9" is new); row 0 is 9 1 5 8 1 6 7 1 | 9 (its 9 was a hole)
    assert drafter.draft(torch.tensor([9, 9]), None)[0].tolist() == [[9, 9, 9], [1, 5, 8]]


def test_copy_tokens_and_errors():
    assert copy_tokens(torch.tensor([4, 5, 6]), 1, 5).tolist() == [5, 6, 5, 6, 5]
    assert copy_tokens(torch.tensor([4, 5, 6]), 0, 2).tolist() == [4, 5]
    with pytest.raises(ValueError, match="K"):
        PromptLookupDrafter(V, 0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(V, 3, max_ngram=1, min_ngram=2)


# ----------------------------------------------------------------------------- through the verifier


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("K", [1, 4, 15])
def test_greedy_matches_hf_generate(family, K):
    target = tiny_target(family, vocab_size=V, seed=1)
    out, _, _ = check_greedy(target, PromptLookupDrafter(V, K), [5, 2, 9], max_new_tokens=30, eos_token_id=2)
    assert len(out.accept_histogram) == K + 1


def next_token_target(successor: dict[int, int]) -> torch.nn.Module:
    """A Llama whose greedy next token depends only on the current one: ``successor[x]`` (else x).

    Attention and MLP outputs are zeroed, so the last hidden state is the token's one-hot embedding;
    the LM head maps it to its successor with a logit margin of 8.
    """
    target = tiny_target("llama", vocab_size=V, hidden_size=V, num_layers=1, num_heads=2)
    target.config.tie_word_embeddings = False
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.model.embed_tokens.weight.copy_(torch.eye(V))
        head = torch.zeros(V, V)
        for x in range(V):
            head[successor.get(x, x), x] = 1.0
        target.lm_head.weight = torch.nn.Parameter(head)
    return target


def test_repetitive_prompt_is_drafted_exactly():
    """A target that cycles 5 6 7 8 9: prompt lookup must copy the cycle (latest match, longest n,
    the copy continuing past the end of the sequence), giving τ far above 1, token-identical to greedy."""
    target = next_token_target({5: 6, 6: 7, 7: 8, 8: 9, 9: 5})
    prompts = [
        [7, 8, 9, 30, 31, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9],  # "7 8 9" also at 0, followed by junk: latest wins
        [7, 8, 9, 5, 6, 7, 8, 40, 9, 41, 42, 7, 8, 9],  # "9" latest at 8 (-> 41) but "7 8 9" at 0 (-> 5 6 7 8 40)
        [5],  # nothing to look up: the anchor repeated, rejected; then the cycle is learned from the output
    ]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    K, new = 8, 40
    out = speculative_generate(target, PromptLookupDrafter(V, K), input_ids, attention_mask=mask, max_new_tokens=new)
    base = target_generate(target, input_ids, attention_mask=mask, max_new_tokens=new)
    assert out.new_tokens == base.new_tokens
    assert base.new_tokens[0][:6] == [5, 6, 7, 8, 9, 5]
    # row 0: every draft is right (the copy runs 5 tokens then repeats its period): blocks of K + 1 = 9,
    # the last one cut to the 4 tokens left
    assert out.accepted_counts[0] == [8, 8, 8, 8, 4]
    # row 1: first block 5 6 7 8 accepted, 40 rejected; from then on the cycle is copied in full
    assert out.accepted_counts[1][:2] == [4, 8]
    # row 2: "5" drafted 5 5 5 ... is rejected until the output holds a full cycle to copy
    assert out.accepted_counts[2][0] == 0 and max(out.accepted_counts[2]) == K
    assert out.tau > 4.0
    wrong = speculative_generate(target, PromptLookupDrafter(V, K, max_ngram=1), input_ids, attention_mask=mask,
                                 max_new_tokens=new)
    assert wrong.accepted_counts[1][0] == 0  # with 1-grams only, row 1 copies 41 after the latest "9"


def test_random_prompts_batched_left_padded():
    """Batch > 1 with left padding on a random target, including rows that leave early at EOS."""
    target = tiny_target("llama", vocab_size=V, seed=2)
    input_ids, mask = left_padded_prompts([7, 3, 12, 1], V, seed=3)
    check_greedy(target, PromptLookupDrafter(V, 6, max_ngram=4, min_ngram=2), [7, 3, 12, 1], 40, seed=3)
    out = speculative_generate(target, PromptLookupDrafter(V, 6), input_ids, attention_mask=mask, max_new_tokens=40,
                               temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 40 for t in out.new_tokens) and out.tau >= 1.0


def test_replay_on_greedy_output_counts_the_online_steps():
    """experiments.pipeline.replay.lookup_replay (choose_k's prompt lookup) replays the rule against stored greedy answers: it must count exactly the
    speculative steps that online decoding with PromptLookupDrafter takes (T=0), row by row."""
    from experiments.pipeline.replay import lookup_replay as replay

    target = next_token_target({5: 6, 6: 7, 7: 8, 8: 9, 9: 5, 11: 12, 12: 13, 13: 11})
    prompts = [[7, 8, 9, 30, 31, 5, 6, 7, 8, 9], [11, 12, 40, 13, 11], [5]]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = speculative_generate(target, PromptLookupDrafter(V, 6), ids, attention_mask=torch.ones_like(ids),
                                   max_new_tokens=23)
        assert replay(prompt, out.new_tokens[0], 6, 3, 1) == len(out.accepted_counts[0]), prompt
    assert replay([1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2, 3, 1], 6, 3, 1) == 1  # 6 accepted + the target's 7th
    assert replay([1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2, 3, 1, 2], 6, 3, 1) == 2
