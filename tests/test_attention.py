"""The block attention mask against a brute-force loop over (query, key) pairs."""

import pytest
import torch

from drafters.attention import build_block_attention_mask


def brute_force_mask(anchors, block_size, context_len, context_valid, anchor_valid):
    bt, num_blocks = anchors.shape
    n = num_blocks * block_size
    mask = torch.zeros(bt, 1, n, context_len + n, dtype=torch.bool)
    for b in range(bt):
        for qi in range(n):
            a = qi // block_size
            for kj in range(context_len + n):
                if kj < context_len:
                    ok = kj < anchors[b, a] and context_valid[b, kj] and anchor_valid[b, a]
                else:
                    ok = (kj - context_len) // block_size == a
                mask[b, 0, qi, kj] = bool(ok)
    return mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_on_random_anchors(seed):
    g = torch.Generator().manual_seed(seed)
    bt, num_blocks, block_size, seq = 3, 4, 3, 11
    anchors = torch.randint(0, seq, (bt, num_blocks), generator=g)
    context_valid = torch.rand(bt, seq, generator=g) > 0.3
    anchor_valid = torch.rand(bt, num_blocks, generator=g) > 0.25
    got = build_block_attention_mask(anchors, block_size, seq, context_valid, anchor_valid)
    want = brute_force_mask(anchors, block_size, seq, context_valid, anchor_valid)
    assert got.shape == (bt, 1, num_blocks * block_size, seq + num_blocks * block_size)
    assert got.dtype == torch.bool
    assert torch.equal(got, want)


def test_defaults_mean_all_valid():
    anchors = torch.tensor([[0, 3, 5]])
    got = build_block_attention_mask(anchors, 2, 6)
    want = brute_force_mask(anchors, 2, 6, torch.ones(1, 6, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(got, want)
    # Anchor 0 sees no context; every query row sees at least its own block.
    assert not got[0, 0, :2, :6].any()
    assert got.any(-1).all()


def test_inference_layout_is_one_block_after_all_columns():
    valid = torch.tensor([[False, True, True, False, True]])
    got = build_block_attention_mask(torch.tensor([[5]]), 4, 5, valid)
    assert torch.equal(got[0, 0, :, :5], valid.expand(4, 5))
    assert got[0, 0, :, 5:].all()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="context_valid"):
        build_block_attention_mask(torch.zeros(2, 3, dtype=torch.long), 4, 5, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="anchor_valid"):
        build_block_attention_mask(torch.zeros(2, 3, dtype=torch.long), 4, 5, None, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="anchors"):
        build_block_attention_mask(torch.zeros(3, dtype=torch.long), 4, 5)
