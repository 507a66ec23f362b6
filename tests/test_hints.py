"""Lookup hints (drafters/variants/hint_lookup.py): prompt lookup's proposal as the block slots' input tokens."""

import pytest
import torch
from conftest import left_padded_prompts, sampled_continuations_pvalue, tiny_target
from test_drafter_model import _run_target, build_drafter, build_target

from drafters import DraftingPolicy, PolicyDrafter, factory
from drafters.dflash import DFlashFormatError, export_dflash
from drafters.variants.hint_lookup import compact_rows, lookup_hints
from verify import speculative_generate
from verify.lookup import copy_tokens, lookup_start
from verify.metrics import accepted_by_source


def _longest_match(seq: list[int], max_ngram: int, min_ngram: int) -> int:
    """The longest n in min_ngram..max_ngram whose n-gram ending at the last token also ends earlier; 0 if none
    (brute force)."""
    t = len(seq) - 1
    for n in range(min(max_ngram, t), min_ngram - 1, -1):
        if any(seq[j - n + 1: j + 1] == seq[t - n + 1: t + 1] for j in range(n - 1, t)):
            return n
    return 0


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (2, 2), (4, 1)])
def test_hints_are_what_prompt_lookup_drafts(max_ngram, min_ngram):
    """Every anchor of right-padded rows: the hint is verify.PromptLookupDrafter's copy of the row's tokens
    up to the anchor, and ``ngram`` is the length of the n-gram it matched (0: none)."""
    g = torch.Generator().manual_seed(0)
    lengths = [30, 17, 1, 24]
    ids = torch.randint(0, 5, (4, 30), generator=g)
    mask = torch.arange(30).expand(4, 30) < torch.tensor(lengths).unsqueeze(1)
    ids = ids.masked_fill(~mask, 3)  # padding holds a real token id: it must never match
    anchors = torch.arange(30).expand(4, 30)
    hints, ngram = lookup_hints(ids, mask, anchors, num_slots=7, max_ngram=max_ngram, min_ngram=min_ngram)
    assert hints.shape == (4, 30, 7) and ngram.shape == (4, 30)
    checked, lengths_seen = 0, set()
    for b, length in enumerate(lengths):
        for t in range(length):
            seq = ids[b, : t + 1]
            assert int(ngram[b, t]) == _longest_match(seq.tolist(), max_ngram, min_ngram), (b, t)
            lengths_seen.add(int(ngram[b, t]))
            if ngram[b, t] > 0:
                want = copy_tokens(seq, lookup_start(seq, max_ngram, min_ngram), 7)
                assert hints[b, t].tolist() == want.tolist(), (b, t)
                checked += 1
            else:
                assert hints[b, t].tolist() == [0] * 7
    assert checked > 20  # many anchors of a 5-token alphabet match
    assert lengths_seen == {0, *range(min_ngram, max_ngram + 1)}  # every match length occurs


def test_compact_rows_drops_holes_and_appends_the_anchor():
    ids = torch.tensor([[9, 1, 2, 9, 3], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[False, True, True, False, True], [True] * 5])
    out, real, anchors = compact_rows(ids, mask, torch.tensor([1, 2]))
    assert out[0, :4].tolist() == [1, 2, 3, 1] and out[1].tolist() == [4, 5, 6, 7, 8, 2]
    assert real.sum(1).tolist() == [4, 6] and anchors.tolist() == [[3], [5]]


def test_hinted_drafter_reads_the_loop_and_differs_from_mask():
    """In a periodic context the slots read the loop's continuation; the logits differ from MASK slots."""
    target = build_target("llama")
    torch.manual_seed(1)
    drafter = build_drafter(target, "hinted", block_size=5)
    ids = torch.tensor([[10, 11, 12, 13] * 3 + [10]])  # anchor 10 at column 12: the loop goes on 11, 12, 13, 10
    slots = drafter.slot_ids(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[12]]))
    assert slots.tolist() == [[[11, 12, 13, 10]]]
    no_loop = drafter.slot_ids(torch.tensor([[20, 21, 22]]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([[2]]))
    assert no_loop.tolist() == [[[drafter.config.mask_token_id] * 4]]
    states = _run_target(target, ids)
    pos = torch.arange(13).view(1, 13)
    with torch.no_grad():
        hinted = drafter.forward_train(states, ids, pos, torch.tensor([[12]]))
        masked = factory.without_variant(drafter, "hints").forward_train(states, ids, pos, torch.tensor([[12]]))
    assert not torch.allclose(hinted, masked, atol=1e-3)


def test_export_refuses_hinted_drafters(tmp_path):
    target = build_target("qwen2")
    drafter = build_drafter(target, "hints", block_size=4)
    with pytest.raises(DFlashFormatError, match="lookup_hints"):
        export_dflash(drafter, tmp_path / "out")


# ---- store hints: the weak slots read an n-gram store of the training answers -------------------------


def _rows_in_two_folds():
    """Two regenerated rows (input_ids, prompt_len) whose prompts fall in different folds of 2."""
    from drafters.variants.hint_lookup import prompt_fold

    prompts = [[2, 3, p] for p in range(4, 40)]
    first = prompts[0]
    second = next(p for p in prompts if prompt_fold(p, 2) != prompt_fold(first, 2))
    return [(first + [50, 51, 52, 53, 54], 3), (second + [60, 61, 62, 63, 64], 3)]


def test_hint_store_leaves_each_rows_own_answer_out_in_training():
    """A row of fold f reads the store of the other folds' answers (never its own); inference (folds None)
    reads every answer. The hint is the store's continuation, its last token repeated, and ngram the
    length of the suffix it rests on."""
    from drafters.variants.hint_lookup import HintStore

    rows = _rows_in_two_folds()
    store = HintStore(rows, num_folds=2)
    ids = torch.tensor([rows[0][0][:4], rows[1][0][:4]])  # each row up to its first answer token
    anchors, need = torch.tensor([[3], [3]]), torch.ones(2, 1, dtype=torch.bool)
    folds = store.folds(ids, torch.tensor([3, 3]))
    assert folds[0] != folds[1]
    hints, ngram = store.hints(ids, anchors, 6, need)
    assert hints[:, 0].tolist() == [[51, 52, 53, 54, 54, 54], [61, 62, 63, 64, 64, 64]]
    assert ngram[:, 0].tolist() == [4, 4]  # "2 3 p 50" is held: the longest suffix (max_ngram 4)
    _, own = store.hints(ids, anchors, 6, need, folds)
    assert own[:, 0].tolist() == [0, 0]  # "50" / "60" only occur in the row's own answer
    # rows of another prompt reaching "50" and "60", in the other row's fold: each reads the answer it reaches
    crossed = torch.tensor([[2, 3, 9, 9, 50], [2, 3, 9, 9, 60]])
    hints, ngram = store.hints(crossed, torch.tensor([[4], [4]]), 3, need, [folds[1], folds[0]])
    assert hints[:, 0].tolist() == [[51, 52, 53], [61, 62, 63]] and ngram[:, 0].tolist() == [1, 1]
    assert store.hints(ids, anchors, 6, torch.zeros(2, 1, dtype=torch.bool))[1].tolist() == [[0], [0]]  # need


def test_inference_hints_build_no_store(monkeypatch):
    """The store of every answer is built with the HintStore (load time), not by the first inference lookup:
    built there, its cost would be charged to the first timed decode (0.4 s of 3.9 s on the main job's
    HumanEval subset). The folds' stores (training) are still built on first use."""
    from drafters.variants import hint_lookup as hints_module

    rows = _rows_in_two_folds()
    store = hints_module.HintStore(rows, num_folds=2)
    ids, anchors, need = torch.tensor([rows[0][0][:4]]), torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool)
    built, build = [], hints_module.NgramStore.from_answers

    def counted(cls, *args, **kwargs):
        built.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(hints_module.NgramStore, "from_answers", classmethod(counted))
    assert store.hints(ids, anchors, 4, need)[1].tolist() == [[4]] and built == []
    store.hints(ids, anchors, 4, need, store.folds(ids, torch.tensor([3])))
    assert len(built) == 1  # the row's fold store, on first use


def test_store_hints_fill_the_weak_slots_and_are_saved_with_the_drafter(tmp_path):
    """store_hints: a slot whose prompt-lookup hint rests on >= 2 tokens keeps it; one on 1 token or none reads
    the store's continuation; the store is saved and loaded with the drafter; training needs prompt_len."""
    from drafters.variants.hint_lookup import HintStore

    target = build_target("llama")
    torch.manual_seed(1)
    drafter = build_drafter(target, "hinted", block_size=5, variants={"store_hints": {}}).eval()
    drafter.hint_store = HintStore([([7, 8, 9, 20, 21, 22, 23, 24], 3), ([7, 8, 6, 30, 31, 32, 33, 34], 3)])
    ones = lambda ids: torch.ones_like(ids, dtype=torch.bool)
    two = torch.tensor([[10, 11, 12, 13, 20, 10, 11]])  # "10 11" recurs: prompt lookup's 12 13 20 10 stays
    one = torch.tensor([[10, 11, 12, 13, 20, 21, 11, 20]])  # "20" recurs alone: the store's 21 22 23 24
    none = torch.tensor([[40, 41, 30]])  # nothing recurs: the store's 31 32 33 34
    unknown = torch.tensor([[40, 41, 42]])  # nothing anywhere: MASK
    mask_id = drafter.config.mask_token_id
    expected = [[12, 13, 20, 10], [21, 22, 23, 24], [31, 32, 33, 34], [mask_id] * 4]
    for ids, want in zip([two, one, none, unknown], expected):
        assert drafter.slot_ids(ids, ones(ids), torch.tensor([[ids.shape[1] - 1]])).tolist() == [[want]]
    drafter.save_pretrained(tmp_path / "d")
    loaded = factory.load(tmp_path / "d", target=target)
    assert loaded.hint_store.rows == drafter.hint_store.rows and "store_hints" in loaded.variant_names
    assert loaded.slot_ids(one, ones(one), torch.tensor([[7]])).tolist() == [[expected[1]]]
    states = _run_target(target, one)
    drafter.train()
    with pytest.raises(ValueError, match="prompt_len"):
        drafter.forward_train(states, one, None, torch.tensor([[7]]))
    (tmp_path / "d" / "hint_store.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="hint_store.safetensors"):
        factory.load(tmp_path / "d")


def test_store_hints_copy_the_stores_answer_and_keep_greedy_identity():
    """A store holding the target's greedy answer to a prompt: with follow_hint_after = 0 the drafter copies
    the store's continuation and accepts whole blocks; the output is still exactly the target's greedy."""
    from drafters.variants.hint_lookup import HintStore

    target = tiny_target("llama", vocab_size=64)
    torch.manual_seed(7)
    prompts, mask = left_padded_prompts([6, 9], 64, seed=5)
    ref = target.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    answer = ref[1, prompts.shape[1]:].tolist()  # row 1's greedy answer (its prompt is unpadded)
    drafter = build_drafter(target, "hinted", block_size=5, variants={"store_hints": {}})
    drafter.hint_store = HintStore([(prompts[1].tolist() + answer, prompts.shape[1]), ([3, 4, 5, 6], 2)])
    copying = PolicyDrafter(drafter.eval(), DraftingPolicy(follow_hint_after=0, follow_hint_min_ngram=2))
    out = speculative_generate(target, copying, prompts, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(out.sequences, ref)
    assert max(out.accept_histogram[4:]) > 0  # a whole block of the stored answer was accepted
    # every step is labelled; row 1 (the stored prompt) copies the store's hint and keeps more drafts per such
    # step than the untrained drafter's own tokens keep
    assert [len(s) for s in out.draft_sources] == [len(c) for c in out.accepted_counts]
    assert set(out.draft_sources[1]) <= {"hint:store", "hint:prompt", "drafter"} and "hint:store" in out.draft_sources[1]
    by = accepted_by_source(out.accepted_counts, out.draft_sources)
    assert by["hint:store"]["mean_accepted"] > by.get("drafter", {"mean_accepted": 0.0})["mean_accepted"]


@pytest.mark.slow
def test_store_hints_keep_the_target_distribution():
    """Chi-square at T = 1: a drafter copying store hints (one-hot q) where they rest on >= 2 tokens."""
    from drafters.variants.hint_lookup import HintStore

    target = tiny_target("llama", vocab_size=8, seed=11, hidden_size=16, num_layers=2, init_range=0.6)
    torch.manual_seed(3)
    drafter = build_drafter(target, "hinted", block_size=4, variants={"store_hints": {}})
    drafter.hint_store = HintStore([([1, 2, 5, 3, 6, 2, 4, 7, 1, 6], 2), ([4, 4, 3, 6, 5, 0, 2], 2)])
    copying = PolicyDrafter(drafter.eval(), DraftingPolicy(follow_hint_after=0, follow_hint_min_ngram=2))
    pvalue, accepted = sampled_continuations_pvalue(target, copying, [7, 5, 3, 6], 3, 60, 40)
    assert accepted > 0
    assert pvalue > 1e-3
