"""The block attention mask against a brute-force loop over (query, key) pairs."""

import pytest
import torch

from drafters.layers import block_mask_subset, build_block_attention_mask, own_block_mask


def brute_force_mask(anchors, block_size, context_len, context_valid, anchor_valid, causal_anchor=False):
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
                    if causal_anchor and qi % block_size == 0:  # the anchor sees itself only in its block
                        ok = kj - context_len == qi
                mask[b, 0, qi, kj] = bool(ok)
    return mask


@pytest.mark.parametrize("causal_anchor", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_on_random_anchors(seed, causal_anchor):
    g = torch.Generator().manual_seed(seed)
    bt, num_blocks, block_size, seq = 3, 4, 3, 11
    anchors = torch.randint(0, seq, (bt, num_blocks), generator=g)
    context_valid = torch.rand(bt, seq, generator=g) > 0.3
    anchor_valid = torch.rand(bt, num_blocks, generator=g) > 0.25
    got = build_block_attention_mask(anchors, block_size, seq, context_valid, anchor_valid, causal_anchor)
    want = brute_force_mask(anchors, block_size, seq, context_valid, anchor_valid, causal_anchor)
    assert got.shape == (bt, 1, num_blocks * block_size, seq + num_blocks * block_size)
    assert got.dtype == torch.bool
    assert torch.equal(got, want)



@pytest.mark.parametrize("blocks", [[1, 3], [0], [2, 3, 4]])
def test_block_subset_is_the_mask_of_those_anchors(blocks):
    """block_mask_subset(mask, blocks) is the mask built for anchors[:, blocks] alone."""
    g = torch.Generator().manual_seed(4)
    anchors = torch.randint(0, 9, (2, 5), generator=g)
    context_valid, anchor_valid = torch.rand(2, 9, generator=g) > 0.3, torch.rand(2, 5, generator=g) > 0.25
    full = build_block_attention_mask(anchors, 3, 9, context_valid, anchor_valid)
    idx = torch.tensor(blocks)
    want = build_block_attention_mask(anchors[:, idx], 3, 9, context_valid, anchor_valid[:, idx])
    assert torch.equal(block_mask_subset(full, idx, 3), want)

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


@pytest.mark.parametrize("causal_anchor", [False, True])
def test_block_attention_is_sdpa_under_the_block_mask(causal_anchor):
    """drafters.layers.block_attention (the CPU training path) = scaled_dot_product_attention over
    [context, every block's slots] under build_block_attention_mask, outputs and gradients, with padding
    anchors (context hidden) and padding columns."""
    import torch.nn.functional as F

    from drafters.layers import block_attention

    g = torch.Generator().manual_seed(0)
    bt, h, blocks, bs, seq, d = 2, 3, 4, 5, 13, 8
    anchors = torch.randint(0, seq, (bt, blocks), generator=g)
    context_valid, anchor_valid = torch.rand(bt, seq, generator=g) > 0.2, torch.rand(bt, blocks, generator=g) > 0.3
    mask = build_block_attention_mask(anchors, bs, seq, context_valid, anchor_valid, causal_anchor)
    q, k, v = (torch.randn(bt, h, blocks * bs, d, generator=g, requires_grad=True) for _ in range(3))
    ctx_k, ctx_v = (torch.randn(bt, h, seq, d, generator=g, requires_grad=True) for _ in range(2))
    inputs = (q, k, v, ctx_k, ctx_v)
    want = F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), attn_mask=mask)
    got = block_attention(q, k, v, ctx_k, ctx_v, mask[..., :seq], bs, own_block_mask(bs) if causal_anchor else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    for got_grad, want_grad in zip(torch.autograd.grad(got, inputs, grad_out), want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_slot_mask", [False, True])
def test_cached_attention_is_sdpa_over_a_slice_of_the_cache_buffers(per_slot_mask):
    """drafters.layers.cached_attention (written out on a CPU) gives scaled_dot_product_attention's output for a
    block's few queries over the first columns of larger cache buffers, under a shared or a per-slot mask."""
    import torch.nn.functional as F

    from drafters.layers import cached_attention

    g = torch.Generator().manual_seed(0)
    rows, heads, slots, dim, columns = 3, 2, 4, 8, 11
    q = torch.randn(rows, heads, slots, dim, generator=g)
    k_buffer, v_buffer = (torch.randn(rows, heads, columns + 7, dim, generator=g) for _ in range(2))
    keys, values = k_buffer[:, :, :columns], v_buffer[:, :, :columns]
    mask = torch.rand(rows, 1, slots if per_slot_mask else 1, columns, generator=g) > 0.4
    mask[..., -1] = True  # every slot sees one key at least
    out = cached_attention(q, keys, values, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
    moved = mask.clone()
    moved[0, 0, 0, 0] = ~moved[0, 0, 0, 0]  # the last column stays visible
    assert not torch.allclose(cached_attention(q, keys, values, moved), out)  # the mask is read
