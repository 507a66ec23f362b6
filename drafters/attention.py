"""The block attention mask shared by drafter training and inference.

Keys are laid out as ``[context columns 0..S-1, block 0 slots, block 1 slots, ...]`` and queries as
``[block 0 slots, block 1 slots, ...]``; every block has ``block_size`` slots. A query slot of block
``a`` may attend to

* context column ``j`` iff ``j < anchors[a]`` (strictly before the block's anchor), the column is
  valid (``context_valid``) and the anchor itself is valid (``anchor_valid``);
* every slot of its own block (bidirectional inside the block), never a slot of another block.

A padding anchor (``anchor_valid`` False) sees only its own block, so no query row is empty (an empty
row would make ``scaled_dot_product_attention`` return NaN); its outputs are meant to be masked out.
At inference there is one block per row whose anchor lies after every cached column, so the same
function with ``anchors = context_len`` gives the inference mask.
"""

from __future__ import annotations

import torch


def build_block_attention_mask(
    anchors: torch.Tensor,  # (Bt, A) long, column index of each block's anchor
    block_size: int,
    context_len: int,
    context_valid: torch.Tensor | None = None,  # (Bt, S) bool, False = padding / hole column
    anchor_valid: torch.Tensor | None = None,  # (Bt, A) bool, False = padding anchor
    causal_anchor: bool = False,
) -> torch.Tensor:
    """Boolean attention mask ``(Bt, 1, A*block_size, S + A*block_size)``, True = may attend.

    ``S = context_len``. The result broadcasts over heads in ``F.scaled_dot_product_attention``. With
    ``causal_anchor`` each block's anchor (its slot 0) sees no other slot of its block (:func:`own_block_mask`).
    """
    if anchors.dim() != 2:
        raise ValueError(f"anchors must be (Bt, A), got shape {tuple(anchors.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    bt, num_blocks = anchors.shape
    device = anchors.device
    if context_valid is None:
        context_valid = torch.ones(bt, context_len, dtype=torch.bool, device=device)
    if anchor_valid is None:
        anchor_valid = torch.ones(bt, num_blocks, dtype=torch.bool, device=device)
    if tuple(context_valid.shape) != (bt, context_len):
        raise ValueError(
            f"context_valid must be (Bt, S) = {(bt, context_len)}, got {tuple(context_valid.shape)}"
        )
    if tuple(anchor_valid.shape) != (bt, num_blocks):
        raise ValueError(
            f"anchor_valid must be (Bt, A) = {(bt, num_blocks)}, got {tuple(anchor_valid.shape)}"
        )

    # Context part: block a sees column j iff j < anchor_a, column valid, anchor valid.
    cols = torch.arange(context_len, device=device)  # (S,)
    ctx = cols.view(1, 1, -1) < anchors.unsqueeze(-1)  # (Bt, A, S)
    ctx = ctx & context_valid.bool().unsqueeze(1) & anchor_valid.bool().unsqueeze(-1)  # (Bt, A, S)
    ctx = ctx.repeat_interleave(block_size, dim=1)  # (Bt, A*B, S)

    # Block part: block-diagonal, every slot sees all slots of its own block.
    block_of = torch.arange(num_blocks * block_size, device=device) // block_size  # (A*B,)
    blk = block_of.view(-1, 1) == block_of.view(1, -1)  # (A*B, A*B)
    if causal_anchor:
        blk = blk & own_block_mask(block_size, device).repeat(num_blocks, num_blocks)
    blk = blk.unsqueeze(0).expand(bt, -1, -1)  # (Bt, A*B, A*B)

    return torch.cat([ctx, blk], dim=-1).unsqueeze(1)  # (Bt, 1, A*B, S + A*B)


def own_block_mask(block_size: int, device=None) -> torch.Tensor:
    """(B, B) bool, query slot x key slot inside one block under ``causal_anchor``: all True except the
    anchor's row, which keeps only itself."""
    own = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    own[0, 1:] = False
    return own


def block_mask_subset(mask: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The mask of :func:`build_block_attention_mask` for the blocks ``blocks`` (n,) long only: their
    query rows and, past the S context columns, their own slots' key columns, (Bt, 1, n*B, S + n*B)."""
    slots = (blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=mask.device)).flatten()  # (n*B,)
    context = mask.shape[-1] - mask.shape[-2]  # S: the keys are [context, every block's slots]
    keys = torch.cat([torch.arange(context, device=mask.device), context + slots])
    return mask[:, :, slots][..., keys]


def draft_block_mask(columns: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
    """The mask of one block per row at inference: ``columns`` (B, C + N) bool, the cached columns a row sees
    followed by the block's N slots (True). (B, 1, 1, C + N), the same for every slot; with ``own`` (N, N) bool
    (:func:`own_block_mask`), (B, 1, N, C + N): slot i sees block slot j iff ``own[i, j]``."""
    mask = columns[:, None, None]
    if own is None:
        return mask
    n = own.shape[0]
    cached = mask[..., : mask.shape[-1] - n].expand(-1, -1, n, -1)
    return torch.cat([cached, mask[..., -n:] & own], dim=-1)
