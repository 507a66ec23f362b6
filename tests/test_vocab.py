"""drafters.training.vocab: a candidate vocabulary for the training loss (frequent tokens, label remapping, logits)."""

from __future__ import annotations

import torch
from conftest import tiny_target

from drafters import factory
from drafters.training.blocks import select_blocks
from drafters.training.vocab import TrainVocab, coverage, frequent_tokens, lookup_table, remap_labels


def test_frequent_tokens_keeps_the_most_frequent_and_the_forced_ids():
    responses = [[5, 5, 5, 7, 7, 9], [5, 7, 3]]
    ids = frequent_tokens(responses, size=2, vocab_size=16, always=[2])
    assert ids.tolist() == [2, 5, 7]
    assert coverage(responses, ids, 16) == 7 / 9


def test_remap_labels_cuts_each_block_at_its_first_label_outside():
    table = lookup_table(torch.tensor([3, 5, 7]), 10)
    labels = torch.tensor([[5, 7, 3, 5], [5, 9, 7, 3], [4, 5, 5, 5]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True], [True, True, True, True]])
    index, kept = remap_labels(labels, mask, table)
    assert kept.tolist() == [[True, True, True, False], [True, False, False, False], [False] * 4]
    assert index[0, :3].tolist() == [1, 2, 0] and index[1, 0].item() == 1


def test_candidate_logits_are_the_full_logits_columns():
    torch.manual_seed(0)
    target = tiny_target("llama", vocab_size=64, hidden_size=32)
    drafter = factory.from_target(target, block_size=4)
    ids = torch.randint(3, 64, (2, 20))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompt_len": torch.tensor([6, 8]),
             "length": torch.tensor([20, 20])}
    states = target(input_ids=ids, output_hidden_states=True).hidden_states
    vocab_ids = torch.tensor(sorted(set(ids[:, 6:].flatten().tolist()) - {ids[0, 12].item()}))
    gen = torch.Generator().manual_seed(0)
    full, labels, mask, _ = select_blocks(drafter, batch, states, None, 16, gen)
    gen = torch.Generator().manual_seed(0)
    part, sub_labels, sub_mask, _ = select_blocks(drafter, batch, states, None, 16, gen,
                                                  vocab=TrainVocab.build(vocab_ids, 64))
    kept = remap_labels(labels, mask, lookup_table(vocab_ids, 64))[1].any(-1)  # blocks left with a label
    assert not kept.all() and part.shape == (int(kept.sum()), 3, len(vocab_ids))
    torch.testing.assert_close(part, full[kept][..., vocab_ids])
    assert torch.equal(vocab_ids[sub_labels][sub_mask], labels[kept][sub_mask])
    assert sub_mask.sum() < mask[kept].sum()  # the label left out cuts its blocks


def test_sampled_negatives_come_from_outside_the_candidates_after_them():
    vocab = TrainVocab.build(torch.tensor([1, 4, 9]), 12, negatives=5)
    cols = vocab.columns(torch.Generator().manual_seed(0))
    assert cols[:3].tolist() == [1, 4, 9] and len(cols) == 8 and len(set(cols.tolist())) == 8
    assert not set(cols[3:].tolist()) & {1, 4, 9}
    assert TrainVocab.build(torch.tensor([1, 4, 9]), 12).columns(torch.Generator()).tolist() == [1, 4, 9]
