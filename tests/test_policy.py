"""Decoding policy (drafters.policy): the hint switch, narrow drafting, the drafting gate, the confidence cut
and the verified width, as settings of a PolicyDrafter around a block drafter; all exact."""

import pytest
import torch
from conftest import left_padded_prompts, sampled_continuations_pvalue, tiny_target
from test_drafter_model import _run_target, build_drafter, build_target

from drafters import DraftingPolicy, PolicyDrafter
from verify import speculative_generate
from verify.rejection import warp_probs


def _policy(drafter, **settings) -> PolicyDrafter:
    return PolicyDrafter(drafter, DraftingPolicy(**settings))


def test_settings_are_checked_against_the_drafter():
    """One place refuses what a drafter cannot take, naming the key as evaluation configs spell it."""
    target = build_target("llama")
    plain, hinted = build_drafter(target, "dflash", block_size=5), build_drafter(target, "hinted", block_size=5)
    cases = [(plain, {"follow_hint_after": 0}, "drafter.follow_hint_after=0: needs m >= 0 and a drafter trained with"),
             (hinted, {"follow_hint_after": -1}, "needs m >= 0"),
             (hinted, {"follow_hint_min_ngram": 2}, "follow_hint_min_ngram=2 needs drafter.follow_hint_after"),
             (hinted, {"follow_hint_after": 0, "follow_hint_min_ngram": 4}, r"must be in 1..3"),
             (hinted, {"confidence_threshold": 1.5}, r"confidence_threshold=1.5: must be in \(0, 1\)"),
             (plain, {"max_draft_tokens": 5}, r"max_draft_tokens=5: must be in 1..4"),
             (hinted, {"follow_hint_after": 3, "max_draft_tokens": 2}, r"max_draft_tokens=2: must be in 3..4"),
             (plain, {"own_draft_tokens": 0}, r"own_draft_tokens=0: must be in 1..4"),
             (hinted, {"min_drafting_rows": 2, "follow_hint_after": 1}, "min_drafting_rows=2: .*follow_hint_after=0")]
    for drafter, settings, message in cases:
        with pytest.raises(ValueError, match=message):
            _policy(drafter, **settings)
    wrapped = _policy(hinted, follow_hint_after=0, follow_hint_min_ngram=3, min_drafting_rows=2, max_draft_tokens=4)
    assert wrapped.num_draft_tokens == 4 and wrapped.target_layer_ids == hinted.target_layer_ids
    assert wrapped.config is hinted.config  # the wrapped drafter's other attributes


@pytest.mark.parametrize("m", [0, 1])
def test_follow_hint_after_keeps_greedy_identity_and_copies_loops(m):
    """follow_hint_after: the output is still the target's greedy output, and on prompts that repeat
    themselves the copied hints change what is drafted (and accepted)."""
    target = tiny_target("llama", vocab_size=64)
    torch.manual_seed(7)
    drafter = build_drafter(target, "hinted", block_size=5)
    loops, _ = left_padded_prompts([4], 64, seed=3)
    ids = torch.cat([loops.repeat(1, 3), loops[:, :2]], 1).repeat(2, 1)  # (2, 14): two rows that loop
    ref = target.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0)
    plain = speculative_generate(target, drafter, ids, max_new_tokens=20)
    followed = speculative_generate(target, _policy(drafter, follow_hint_after=m), ids, max_new_tokens=20)
    assert torch.equal(followed.sequences, ref) and torch.equal(plain.sequences, ref)
    assert followed.accepted_counts != plain.accepted_counts


@pytest.mark.slow
@pytest.mark.parametrize("threshold, width, own", [(None, None, None), (0.2, None, None), (None, 2, None), (None, None, 1)])
def test_follow_hint_after_keeps_the_target_distribution(threshold, width, own):
    """Chi-square of 3-token continuations at T = 1 against the target's exact distribution, a hinted
    drafter copying the hint wherever an n-gram matches (one-hot q) and sampling elsewhere (with a
    confidence threshold: only the confident prefix in steps where no row copies; with max_draft_tokens:
    the first 2 slots of every block, copied hints included; with own_draft_tokens = 1: the drafter samples
    slot 1 only and proposes its hint past it where another row copies)."""
    length, batches, rows = 3, 60, 40
    target = tiny_target("llama", vocab_size=8, seed=11, hidden_size=16, num_layers=2, init_range=0.6)
    torch.manual_seed(3)
    drafter = _policy(build_drafter(target, "hinted", block_size=4), follow_hint_after=0,
                      confidence_threshold=threshold, max_draft_tokens=width, own_draft_tokens=own)
    prompt = [5, 3, 6, 5, 3]  # "5 3" recurs: the first block is the hint 6 5 3
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, prompt, length, batches, rows)
    assert accepted > 0
    assert pvalue > 1e-3


def _first_draft(drafter, target, ids):  # (1, T) -> (1, K): the greedy draft with ids[:, -1] as the anchor
    states = _run_target(target, ids[:, :-1])
    t = ids.shape[1] - 1
    drafter.reset(1)
    drafter.extend(ids[:, :-1], torch.ones(1, t, dtype=torch.long), torch.arange(t).view(1, t),
                   [states[i] for i in drafter.target_layer_ids])
    return drafter.draft(ids[:, -1], torch.tensor([t]))[0]


def test_follow_hint_min_ngram_copies_only_hints_from_long_enough_matches():
    """follow_hint_min_ngram = 2: a hint found from the anchor token alone is not copied (the drafter's own
    block is drafted), one found from two tokens is; min_ngram = 1 copies both."""
    target = build_target("llama")
    torch.manual_seed(4)
    drafter = build_drafter(target, "hinted", block_size=5).eval()
    one_token = torch.tensor([[10, 11, 12, 13, 20, 21, 11]])  # "11" recurs, "21 11" does not: hint 12 13 20 21
    two_tokens = torch.tensor([[10, 11, 12, 13, 20, 10, 11]])  # "10 11" recurs: hint 12 13 20 10
    with torch.no_grad():
        own = _first_draft(_policy(drafter, follow_hint_after=0), target, one_token)  # min n-gram 1: copied
        assert own.tolist() == [[12, 13, 20, 21]]
        mine = _first_draft(_policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2), target, one_token)
        assert torch.equal(mine, _first_draft(drafter, target, one_token))  # the drafter's own argmax block
        assert mine.tolist() != [[12, 13, 20, 21]]
        two = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2)
        assert _first_draft(two, target, two_tokens).tolist() == [[12, 13, 20, 10]]
        cut = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2, max_draft_tokens=2)
        assert _first_draft(cut, target, two_tokens).tolist() == [[12, 13]]  # the copied hint is cut too


def test_follow_hint_with_confidence_threshold_drafts_whole_hints_and_confident_prefixes():
    """With confidence_threshold too: a step where a row copies its hint drafts K slots (the hint whole);
    a step where none does drafts the confident prefix only (here none: an untrained drafter is unsure)."""
    target = build_target("llama")
    torch.manual_seed(4)
    drafter = _policy(build_drafter(target, "hinted", block_size=5).eval(), follow_hint_after=0,
                      follow_hint_min_ngram=2, confidence_threshold=0.99)
    with torch.no_grad():
        assert _first_draft(drafter, target, torch.tensor([[10, 11, 12, 13, 20, 10, 11]])).tolist() == [[12, 13, 20, 10]]
        assert _first_draft(drafter, target, torch.tensor([[10, 11, 12, 13, 20, 21, 11]])).shape == (1, 0)


def _two_rows_one_copying(design: str = "hinted"):
    """``(drafter, anchors, positions)``: a drafter (block 5) over two rows after their context: under
    follow_hint_after 0 and min n-gram 2, row 0's hint "12 13 20 10" rests on "10 11" and is copied, row 1's on
    "11" alone. The drafter's block passes are counted (``drafter.passes``: (rows, columns) per pass)."""
    target = build_target("llama")
    torch.manual_seed(4)
    drafter = build_drafter(target, design, block_size=5).eval()
    ids = torch.tensor([[10, 11, 12, 13, 20, 10, 11], [10, 11, 12, 13, 20, 21, 11]])
    states = _run_target(target, ids[:, :-1])
    drafter.reset(2)
    drafter.extend(ids[:, :-1], torch.ones(2, 6, dtype=torch.long), torch.arange(6).repeat(2, 1),
                   [states[i] for i in drafter.target_layer_ids])
    passes, block_pass = [], drafter.block_pass
    drafter.block_pass = lambda ids, *rest: passes.append(tuple(ids.shape)) or block_pass(ids, *rest)
    drafter.passes = passes
    return drafter, ids[:, -1], torch.tensor([6, 6])


@pytest.mark.parametrize("design", ["hinted", "refined"])
def test_rows_that_copy_their_hint_skip_the_drafters_passes(design):
    """follow_hint_after = 0: which rows copy their hint is known before the drafter runs, so its passes
    and head run on the other rows only, with the drafts and q of a pass over the whole batch."""
    drafter, anchors, positions = _two_rows_one_copying(design)
    refine = drafter.variants.get("refine")
    copying = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2)
    with torch.no_grad():
        greedy, _ = copying.draft(anchors, positions)
        assert [rows for rows, _ in drafter.passes] == [1] * (1 + (refine.passes if refine else 0))  # row 1 only
        sampled, q = copying.draft(anchors, positions, temperature=1.0, generator=torch.Generator().manual_seed(0))
        full = drafter.draft_logits(anchors, positions)  # (2, K, V): every row through the drafter
        assert greedy[0].tolist() == [12, 13, 20, 10] and sampled[0].tolist() == [12, 13, 20, 10]
        assert torch.equal(greedy[1], full[1].argmax(-1)) and not torch.equal(greedy[1], greedy[0])
        assert torch.equal(q[0], torch.nn.functional.one_hot(greedy[0], q.shape[-1]).float())
        torch.testing.assert_close(q[1], warp_probs(full[1:], temperature=1.0)[0])
        drafter.passes.clear()
        both = _policy(drafter, follow_hint_after=0)  # min n-gram 1: both rows copy, no pass at all
        assert both.draft(anchors, positions)[0].tolist() == [[12, 13, 20, 10], [12, 13, 20, 21]]
        assert drafter.passes == []


def test_min_drafting_rows_skips_the_drafter_where_too_few_rows_draft():
    """min_drafting_rows = 2 with one drafting row: no pass at all, row 0 copies its 2-gram hint and row 1 its
    1-gram hint (labelled hint:prompt); min_drafting_rows = 1 is the plain rule."""
    drafter, anchors, positions = _two_rows_one_copying()
    with torch.no_grad():
        plain = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2, min_drafting_rows=1)
        first, _ = plain.draft(anchors, positions)
        assert len(drafter.passes) == 1 and plain.draft_sources() == ["hint:prompt", "drafter"]
        drafter.passes.clear()
        gate = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2, min_drafting_rows=2)
        gated, q = gate.draft(anchors, positions, temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert drafter.passes == [] and gate.draft_sources() == ["hint:prompt", "hint:prompt"]
        assert gated.tolist() == [[12, 13, 20, 10], [12, 13, 20, 21]] and gated[0].tolist() == first[0].tolist()
        assert torch.equal(q, torch.nn.functional.one_hot(gated, q.shape[-1]).float())


def test_a_gated_row_without_a_hint_proposes_mask_tokens_labelled_hint_none():
    """Under the gate a row whose context has no n-gram match copies its MASK slots (rejected at once) and is
    labelled ``hint:none``."""
    target = build_target("llama")
    torch.manual_seed(4)
    drafter = build_drafter(target, "hinted", block_size=5).eval()
    ids = torch.tensor([[10, 11, 12, 13, 20, 10, 11], [30, 31, 32, 33, 34, 35, 36]])  # row 1: nothing recurs
    states = _run_target(target, ids[:, :-1])
    gate = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2, min_drafting_rows=2)
    gate.reset(2)
    gate.extend(ids[:, :-1], torch.ones(2, 6, dtype=torch.long), torch.arange(6).repeat(2, 1),
                [states[i] for i in drafter.target_layer_ids])
    with torch.no_grad():
        tokens, _ = gate.draft(ids[:, -1], torch.tensor([6, 6]))
    assert tokens[1].tolist() == [drafter.config.mask_token_id] * 4 and tokens[0].tolist() == [12, 13, 20, 10]
    assert gate.draft_sources() == ["hint:prompt", "hint:none"]


@pytest.mark.parametrize("rows", [2, 4])
def test_min_drafting_rows_keeps_greedy_identity(rows):
    target = tiny_target("llama", vocab_size=64)
    torch.manual_seed(7)
    drafter = build_drafter(target, "hinted", block_size=5)
    prompts, mask = left_padded_prompts([6, 12, 9], 64, seed=5)
    ids = torch.cat([prompts, prompts[:, -4:]], 1)
    mask = torch.cat([mask, torch.ones_like(mask[:, -4:])], 1)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    plain = speculative_generate(target, _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2), ids,
                                 attention_mask=mask, max_new_tokens=20)
    gated = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2, min_drafting_rows=rows)
    out = speculative_generate(target, gated, ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(out.sequences, ref) and torch.equal(plain.sequences, ref)
    assert out.accepted_counts != plain.accepted_counts  # some step skipped the drafter
    if rows > 3:  # more than the batch: the drafter never drafts
        assert all(s != "drafter" for step in out.draft_sources for s in step)


def test_own_draft_tokens_runs_a_narrow_block_and_proposes_hints_past_it():
    """own_draft_tokens = 2 (K = 4): the drafter's layers run on [anchor, slot 1, slot 2] only; slot 1 is the
    whole block's (causal anchor) and slot 2 the narrow block's own argmax; where another row copies its hint
    the step keeps K slots and the drafter's row proposes its own hint at slots 3..4 (one-hot q), where no
    row copies it drafts 2 slots."""
    drafter, anchors, positions = _two_rows_one_copying("deep")
    with torch.no_grad():
        full = drafter.draft_logits(anchors, positions).argmax(-1)  # (2, K): the whole block, every row
        narrow = drafter.head(drafter.block_states(drafter.block_inputs(anchors, positions, 2))).argmax(-1)
        drafter.passes.clear()
        own = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=2, own_draft_tokens=2)
        greedy, _ = own.draft(anchors, positions)
        assert drafter.passes == [(1, 3)]  # row 1 only, 3 columns
        assert greedy[0].tolist() == [12, 13, 20, 10]
        assert greedy[1, 0] == full[1, 0] and greedy[1, :2].tolist() == narrow[1].tolist()
        assert greedy[1, 2:].tolist() == [20, 21]  # row 1's prompt-lookup hint "12 13 20 21", slots 3..4
        sampled, q = own.draft(anchors, positions, temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert sampled[1, 2:].tolist() == [20, 21]
        assert torch.equal(q[1, 2:], torch.nn.functional.one_hot(torch.tensor([20, 21]), q.shape[-1]).float())
        none = _policy(drafter, follow_hint_after=0, follow_hint_min_ngram=3, own_draft_tokens=2)  # no row copies
        mine, _ = none.draft(anchors, positions)
        assert mine.tolist() == narrow.tolist() and drafter.passes[-1] == (2, 3)


@pytest.mark.parametrize("threshold, own", [(None, None), (0.05, None), (None, 2)])
def test_follow_hint_min_ngram_keeps_greedy_identity(threshold, own):
    target = tiny_target("llama", vocab_size=64)
    torch.manual_seed(7)
    drafter = build_drafter(target, "hinted", block_size=5)
    prompts, mask = left_padded_prompts([6, 12, 9], 64, seed=5)
    ids = torch.cat([prompts, prompts[:, -4:]], 1)  # the last tokens recur: long and short matches
    mask = torch.cat([mask, torch.ones_like(mask[:, -4:])], 1)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    plain = speculative_generate(target, _policy(drafter, confidence_threshold=threshold, own_draft_tokens=own), ids,
                                 attention_mask=mask, max_new_tokens=20)
    copying = _policy(drafter, confidence_threshold=threshold, own_draft_tokens=own, follow_hint_after=0,
                      follow_hint_min_ngram=2)
    out = speculative_generate(target, copying, ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(out.sequences, ref) and torch.equal(plain.sequences, ref)
    assert out.accepted_counts != plain.accepted_counts  # some hint was copied


def test_a_candidate_vocabulary_drafts_from_it_and_stays_exact():
    """draft_vocab: drafts come from the candidates only (q = 0 elsewhere) and the output is the target's
    greedy output; the logits over the candidates are the full head's."""
    target = tiny_target("llama", vocab_size=64)
    torch.manual_seed(5)
    drafter = build_drafter(target, "dflash", block_size=5)
    vocab = torch.arange(0, 64, 3)  # every third id
    wrapped = PolicyDrafter(drafter, draft_vocab=vocab)
    states = torch.randn(2, 4, drafter.config.hidden_size)
    logits, full = wrapped.head(states), drafter.head(states)
    assert torch.allclose(logits[..., vocab], full[..., vocab]) and (logits[..., 1] == torch.finfo().min).all()
    with torch.no_grad():  # the candidates' rows are kept between drafts, never stale: a weight written in place
        target.get_output_embeddings().weight.mul_(2.0)
    assert torch.allclose(wrapped.head(states)[..., vocab], drafter.head(states)[..., vocab])
    assert not torch.allclose(wrapped.head(states)[..., vocab], full[..., vocab])
    ids, _ = left_padded_prompts([6, 6], 64, seed=2)
    ref = speculative_generate(target, drafter, ids, max_new_tokens=16)  # exact: the target's greedy output
    out = speculative_generate(target, wrapped, ids, max_new_tokens=16)
    assert torch.equal(out.sequences, ref.sequences)
    tokens = _first_draft(wrapped, target, ids[:1])
    assert set(tokens.flatten().tolist()) <= set(vocab.tolist())
    q = warp_probs(wrapped.head(states), temperature=1.0)
    assert float(q[..., 1].sum()) == 0.0 and torch.allclose(q.sum(-1), torch.ones(2, 4))


@pytest.mark.slow
def test_a_candidate_vocabulary_keeps_the_target_distribution():
    """Chi-square of 3-token continuations at T = 1: drafts from half the vocabulary, the target's distribution."""
    target = tiny_target("llama", vocab_size=8, seed=11, hidden_size=16, num_layers=2, init_range=0.6)
    torch.manual_seed(3)
    drafter = PolicyDrafter(build_drafter(target, "dflash", block_size=4), draft_vocab=torch.tensor([0, 2, 3, 5]))
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, [5, 3, 6, 5, 3], 3, 60, 40)
    assert accepted > 0 and pvalue > 1e-3
