"""drafters.training.datamodule: anchor sampling, collate, label masks, storage, the id split and the DataModule."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from scipy.stats import chisquare

from drafters import factory
from drafters.training.blocks import lookup_anchor_weights
from drafters.training.datamodule import (
    EpochShuffle,
    RegenDataModule,
    RegenDataset,
    ResumableLoader,
    collate,
    finished_ids,
    load_regenerated,
    read_meta,
    sample_anchors,
    split_by_id,
    write_meta,
    write_shard,
)
from verify.lookup import lookup_paths

# ----------------------------------------------------------------------------- anchors


def test_anchors_lie_in_the_response_region_distinct_sorted_and_padded():
    prompt_len = torch.tensor([3, 1, 5, 2])
    length = torch.tensor([10, 4, 6, 30])  # candidates: 7, 3, 1, 28
    anchors, mask = sample_anchors(prompt_len, length, num_anchors=6, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == mask.shape == (4, 6)
    assert mask.sum(1).tolist() == [6, 3, 1, 6]
    for b in range(4):
        a = anchors[b][mask[b]].tolist()
        assert a == sorted(set(a))  # distinct, ascending
        assert all(prompt_len[b] - 1 <= x <= length[b] - 2 for x in a)
        assert (anchors[b][~mask[b]] == 0).all()
    # row 1 (3 candidates) and row 2 (1 candidate) get every candidate
    assert anchors[1][mask[1]].tolist() == [0, 1, 2]
    assert anchors[2][mask[2]].tolist() == [4]


def test_anchor_width_shrinks_to_the_longest_response():
    anchors, mask = sample_anchors(torch.tensor([4, 4]), torch.tensor([6, 7]), num_anchors=32)
    assert anchors.shape == (2, 3) and mask.sum().item() == 5


def test_anchors_are_seeded_and_uniform():
    prompt_len, length = torch.tensor([2]), torch.tensor([12])  # 10 candidates: columns 1..10
    a1, _ = sample_anchors(prompt_len, length, 3, torch.Generator().manual_seed(7))
    a2, _ = sample_anchors(prompt_len, length, 3, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(12)
    for _ in range(3000):
        a, _ = sample_anchors(prompt_len, length, 3, generator)
        counts.index_add_(0, a[0], torch.ones(3))
    assert counts[0] == 0 and counts[11] == 0
    assert chisquare(counts[1:11].numpy()).pvalue > 1e-3  # each candidate equally likely


def test_weighted_anchors_are_drawn_in_proportion_to_their_weights():
    prompt_len, length = torch.tensor([2]), torch.tensor([8])  # 6 candidates: columns 1..6
    weights = torch.tensor([[1.0, 1.0, 0.1, 1.0, 0.1, 0.5, 1.0, 1.0]])
    generator, counts = torch.Generator().manual_seed(0), torch.zeros(8)
    for _ in range(4000):
        a, _ = sample_anchors(prompt_len, length, 1, generator, weights)
        counts[a[0, 0]] += 1
    expected = weights[0, 1:7] / weights[0, 1:7].sum() * 4000
    assert counts[0] == counts[7] == 0
    assert chisquare(counts[1:7].numpy(), expected.numpy()).pvalue > 1e-3
    # every candidate is still drawn when the row asks for all of them
    a, m = sample_anchors(prompt_len, length, 6, generator, weights)
    assert a[m].tolist() == [1, 2, 3, 4, 5, 6]


def test_lookup_anchor_weights_mark_where_the_hybrid_drafts_by_lookup():
    ids = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6, 0], [1, 2, 3, 4, 1, 2, 1, 2, 3]])
    batch = {"input_ids": ids, "length": torch.tensor([8, 9])}
    w = lookup_anchor_weights(batch, 0.25, 2)
    # (5, 6) recurs at columns 4 and 7 of row 0; (1, 2) at 5 and 7, (2, 3) at 8 of row 1; padding is never served
    assert (w[0] == 0.25).nonzero().flatten().tolist() == [4, 7]
    assert (w[1] == 0.25).nonzero().flatten().tolist() == [5, 7, 8]
    for row, n in ((0, 8), (1, 9)):  # the hybrid's own rule: lookup_paths finds an n-gram of >= 2 tokens
        served = [lookup_paths(ids[row, :a + 1], 3, 1, 4)[0] >= 2 for a in range(n)]
        assert served == (w[row, :n] < 1).tolist()


def test_anchor_errors():
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.tensor([2]), torch.tensor([5]), 0)
    with pytest.raises(ValueError, match="prompt_len"):
        sample_anchors(torch.tensor([0]), torch.tensor([5]), 2)
    with pytest.raises(ValueError, match=r"anchor weights must be \(B, S\) = \(1, 5\) in \(0, 1\]"):
        sample_anchors(torch.tensor([2]), torch.tensor([5]), 2, weights=torch.zeros(1, 5))


# ----------------------------------------------------------------------------- batches and labels


def test_collate_right_pads():
    rows = [{"input_ids": [5, 6, 7], "prompt_len": 2}, {"input_ids": [8, 9, 10, 11, 12], "prompt_len": 1}]
    batch = collate(rows, pad_token_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["prompt_len"].tolist() == [2, 1] and batch["length"].tolist() == [3, 5]
    with pytest.raises(ValueError, match="empty batch"):
        collate([])


def test_label_mask_of_sampled_blocks():
    target = tiny_target("llama", vocab_size=64)
    drafter = factory.from_target(target, block_size=4)
    rows = [{"input_ids": list(range(10, 19)), "prompt_len": 4}, {"input_ids": [20, 21, 22, 23], "prompt_len": 2}]
    batch = collate(rows)
    anchors, amask = sample_anchors(batch["prompt_len"], batch["length"], 8, torch.Generator().manual_seed(1))
    labels, mask = drafter.block_labels(batch["input_ids"], anchors, amask, batch["attention_mask"])
    assert labels.shape == mask.shape == (2, anchors.shape[1], 3)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        for a in range(anchors.shape[1]):
            for k in range(1, 4):
                col = int(anchors[b, a]) + k
                expected = bool(amask[b, a]) and col <= n - 1
                assert bool(mask[b, a, k - 1]) == expected
                if expected:
                    assert int(labels[b, a, k - 1]) == row["input_ids"][col]
    assert mask[:, :, 0][amask].all()  # slot 1 always predicts a response token


# ----------------------------------------------------------------------------- storage and split


def _rows(n, start=0, prompt_len=3, length=8):
    return [{"id": f"src/{i}", "domain": "dialogue", "input_ids": list(range(1, length + 1)),
             "prompt_len": prompt_len} for i in range(start, start + n)]


def test_shards_round_trip_and_resume_ids(tmp_path):
    with pytest.raises(FileNotFoundError, match="empty"):
        load_regenerated(tmp_path)
    write_shard(_rows(3), tmp_path)
    write_shard(_rows(2, start=3), tmp_path)
    (tmp_path / "shards" / ".tmp-shard-00002-1").mkdir()  # a killed job's leftover is ignored
    assert finished_ids(tmp_path) == {f"src/{i}" for i in range(5)}
    write_meta(tmp_path, {"complete": True})
    data = load_regenerated(tmp_path)
    assert len(data) == 5 and data[4]["id"] == "src/4" and data[0]["input_ids"] == list(range(1, 9))
    assert read_meta(tmp_path) == {"complete": True}
    with pytest.raises(ValueError, match="columns"):
        write_shard([{"id": "x", "input_ids": [1]}], tmp_path)


def test_split_by_id_is_stable_disjoint_and_nonempty():
    ids = [f"doc/{i}" for i in range(2000)]
    train, val = split_by_id(ids, 0.1)
    assert sorted(train + val) == list(range(2000)) and not set(train) & set(val)
    assert 150 < len(val) < 250
    assert split_by_id(list(reversed(ids)), 0.1)[1] == [1999 - i for i in reversed(val)]  # by id, not order
    assert len(split_by_id(ids[:3], 0.01)[1]) == 1  # tiny sets still get a validation row
    assert split_by_id(ids[:3], 0.0)[1] == []
    with pytest.raises(ValueError, match="val_fraction"):
        split_by_id(ids, 1.0)


def test_epoch_shuffle_depends_on_epoch_only():
    s = EpochShuffle(10, seed=3)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    assert sorted(first) == list(range(10)) and first != second
    s.set_epoch(0)
    assert list(s) == first


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resumable_loader_goes_on_where_its_state_stopped(num_workers):
    def loader():  # as RegenDataModule's training loader: EpochShuffle, a last partial batch
        return ResumableLoader(list(range(11)), batch_size=3, sampler=EpochShuffle(11, seed=5),
                               num_workers=num_workers, generator=torch.Generator().manual_seed(0))

    straight = loader()
    epochs = []
    for epoch in range(2):
        straight.sampler.set_epoch(epoch)
        epochs.append([b.tolist() for b in straight])
    for epoch, batches in ((0, 2), (1, 1), (0, 4)):  # mid-epoch; the last batch of epoch 0: epoch 1 next
        first = loader()
        first.sampler.set_epoch(epoch)
        it = iter(first)
        assert [next(it).tolist() for _ in range(batches)] == epochs[epoch][:batches]
        state = first.state_dict()
        assert state == {"epoch": epoch, "batches": batches}
        resumed = loader()
        resumed.load_state_dict(state)
        if batches == len(resumed):
            assert resumed.sampler.epoch == epoch + 1
            assert [b.tolist() for b in resumed] == epochs[epoch + 1]
        else:
            assert len(resumed) == 4 and [b.tolist() for b in resumed] == epochs[epoch][batches:]
        assert [b.tolist() for b in resumed] == epochs[resumed.sampler.epoch]  # later iterations: whole epochs


def test_datamodule_truncates_drops_and_splits(tmp_path):
    rows = _rows(40) + [{"id": "long/0", "domain": "code", "input_ids": list(range(1, 30)), "prompt_len": 20}]
    write_shard(rows, tmp_path)
    write_meta(tmp_path, {"complete": True})
    dm = RegenDataModule(str(tmp_path), batch_size=4, max_length=12, val_fraction=0.2, max_val_samples=3)
    dm.setup("fit")
    assert len(dm.val_set) == 3 and len(dm.train_set) + len(dm.val_set) <= 41
    kept = RegenDataset(load_regenerated(tmp_path), max_length=12)
    assert kept.num_dropped == 1  # the long row keeps only prompt tokens under max_length=12
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 8) and batch["prompt_len"].tolist() == [3] * 4
    with pytest.raises(ValueError, match="max_length"):
        RegenDataModule(str(tmp_path), max_length=1)
    subsets = []
    for cap in (5, 12, None):  # nested training subsets over the same validation rows
        sub = RegenDataModule(str(tmp_path), max_length=12, val_fraction=0.2, max_val_samples=3, max_train_rows=cap)
        sub.setup("fit")
        subsets.append(set(sub.train_set.indices))
        assert sub.val_set.indices == dm.val_set.indices
    assert len(subsets[0]) == 5 and len(subsets[1]) == 12 and subsets[0] < subsets[1] < subsets[2]
    assert subsets[2] == set(dm.train_set.indices)
    with pytest.raises(ValueError, match="max_train_rows must be >= 1"):
        RegenDataModule(str(tmp_path), max_train_rows=0)
    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match="is empty"):
        RegenDataModule(str(empty)).setup("fit")
