"""The drafter's layers: RMSNorm, RoPE, the block attention masks, attention over [context, block] keys/values,
SwiGLU, and the decoder layer (:class:`DrafterLayer`), run by training over many blocks per row
(:class:`BlockContext`) and by drafting over one block per row after the cached columns (:class:`CachedContext`);
and :func:`copy_target_layers` (the warm start from the target's layers).

The block attention mask. Keys are laid out as ``[context columns 0..S-1, block 0 slots, block 1 slots, ...]``
and queries as ``[block 0 slots, block 1 slots, ...]``; every block has ``block_size`` slots. A query slot of
block ``a`` may attend to

* context column ``j`` iff ``j < anchors[a]`` (strictly before the block's anchor), the column is
  valid (``context_valid``) and the anchor itself is valid (``anchor_valid``);
* every slot of its own block (bidirectional inside the block), never a slot of another block.

A padding anchor (``anchor_valid`` False) sees only its own block, so no query row is empty (an empty
row would make ``scaled_dot_product_attention`` return NaN); its outputs are meant to be masked out.
At inference there is one block per row whose anchor lies after every cached column
(:func:`draft_block_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from drafters.config import DrafterConfig

# ---- masks ------------------------------------------------------------------------------------------

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


# ---- layers -----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., H)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape (Bt, N, head_dim) for absolute positions (Bt, N) (half-split layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # (Bt, N, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (Bt, N, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (Bt, h, N, d) by cos/sin (Bt, N, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DrafterAttention(nn.Module):
    """The projections of a drafter layer's attention (Qwen3's: per-head q/k RMSNorm before RoPE)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:  # (Bt, N, n*d) -> (Bt, n, N, d)
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def rotated_query(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projected queries (Bt, N, h*d) -> normalised, rotated heads (Bt, h, N, d)."""
        q = self._heads(q, self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated keys and values (Bt, h_kv, N, d) of x (Bt, N, H) at the positions of cos/sin."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rope(k, cos, sin), v


def _repeat_kv(groups: int, *tensors: torch.Tensor):
    """Grouped-query attention: each key/value head (Bt, h_kv, S, d) repeated for its query heads."""
    return tensors if groups == 1 else tuple(t.repeat_interleave(groups, dim=1) for t in tensors)


@dataclass
class BlockContext:
    """Training: A blocks per row over S context columns (:meth:`DrafterLayer.forward`'s ``context``).

    keys/values: (Bt, h_kv, S, d) of the context columns; mask: (Bt, 1, A*B, S + A*B) bool from
    :func:`build_block_attention_mask`; own: (B, B) bool, which slots of its own block
    each slot sees (None: all)."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    block_size: int
    own: torch.Tensor | None = None

    def attend(self, q, k, v, keep=None) -> torch.Tensor:
        """q (Bt, h, N, d) of the blocks' slots, k/v (Bt, h_kv, N, d) of the same slots -> (Bt, h, N, d)."""
        groups = q.shape[1] // k.shape[1]
        k, v, ctx_k, ctx_v = _repeat_kv(groups, k, v, self.keys, self.values)
        if q.device.type == "cpu":  # the fused kernel would score every block's slots; see block_attention
            return block_attention(q, k, v, ctx_k, ctx_v, self.mask[..., : ctx_k.shape[2]], self.block_size,
                                   self.own)
        # the fused kernel never holds the (N, S) scores: the memory a GPU-sized step needs
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # (Bt, h, S + N, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


@dataclass
class CachedContext:
    """Drafting: one block per row after ``start`` cached columns (:meth:`DrafterLayer.forward`'s ``context``).

    keys/values: the cache buffers (B, h_kv, capacity, d); the block's own keys/values are written at
    columns ``start .. start + N`` (just past the cached ones) and attention reads ``buffer[..., :start + N]``:
    the keys of ``cat([context, block])`` without copying the context. mask: (B, 1, 1, start + N) shared by
    every slot, or (B, 1, N, start + N) per slot."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int
    mask: torch.Tensor

    def attend(self, q, k, v, keep=None) -> torch.Tensor:
        """q (B, h, N', d) of the kept slots, k/v (B, h_kv, N, d) of every block slot -> (B, h, N', d)."""
        end = self.start + k.shape[2]
        self.keys[:, :, self.start : end] = k
        self.values[:, :, self.start : end] = v
        keys, values = _repeat_kv(q.shape[1] // k.shape[1], self.keys[:, :, :end], self.values[:, :, :end])
        mask = self.mask[:, :, keep] if keep is not None and self.mask.shape[2] > 1 else self.mask
        return cached_attention(q, keys, values, mask)


def block_attention(q, k, v, ctx_k, ctx_v, context_mask, block_size: int, own_mask=None) -> torch.Tensor:
    """Attention of A blocks' slots over the context keys ``context_mask`` allows and their own block's keys.

    q, k, v: (Bt, h, N, d), N = A * block_size, block-major; ctx_k, ctx_v: (Bt, h, S, d); context_mask:
    (Bt, 1, N, S) bool. Returns (Bt, h, N, d): scaled_dot_product_attention under
    :func:`build_block_attention_mask` (whose other-block part is all False), scoring
    S + block_size keys per slot instead of S + N (a third of the work at S = 300, A = 32, block 16).
    own_mask: (B, B) bool, which slots of its own block each slot sees (None: all; ``causal_anchor``).
    """
    bt, h, n, d = q.shape
    blocks = n // block_size
    scale = d ** -0.5
    context = (q @ ctx_k.transpose(-1, -2) * scale).masked_fill(~context_mask, float("-inf"))  # (Bt, h, N, S)
    qb = q.reshape(bt, h, blocks, block_size, d)
    own = qb @ k.reshape(bt, h, blocks, block_size, d).transpose(-1, -2) * scale  # (Bt, h, A, B, B)
    if own_mask is not None:
        own = own.masked_fill(~own_mask, float("-inf"))
    p = torch.cat([context, own.reshape(bt, h, n, block_size)], dim=-1).softmax(-1)  # (Bt, h, N, S + B)
    s = ctx_k.shape[2]
    own_out = p[..., s:].reshape(bt, h, blocks, block_size, block_size) @ v.reshape(bt, h, blocks, block_size, d)
    return p[..., :s] @ ctx_v + own_out.reshape(bt, h, n, d)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm Llama layer whose attention also reads the context keys/values; the one layer that both
    training (:class:`BlockContext`) and drafting (:class:`CachedContext`) run."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DrafterAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    #: Recompute the layer's activations in the backward pass (torch.utils.checkpoint) instead of keeping
    #: them: the activation memory of a training step drops to the layers' inputs, for one more forward
    #: of the layers. Training only; set by ``set_gradient_checkpointing`` (config:
    #: ``drafter.gradient_checkpointing``); not saved with the drafter. Gradients are unchanged.
    gradient_checkpointing: bool = False

    def forward(self, x, cos, sin, context, block_size: int, keep: slice | None = None) -> torch.Tensor:
        """x (Bt, N, H) block states (N = A blocks x ``block_size``), cos/sin (Bt, N, d) -> (Bt, N', H).

        ``context``: a :class:`BlockContext` or :class:`CachedContext`. ``keep`` (drafting's last layer: the
        drafted slots of one block per row): the queries, the MLP and the returned states are those N' slots
        only, as no head reads the other slot's output; the keys/values are every slot's."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, context, block_size, keep, use_reentrant=False)
        return self._forward(x, cos, sin, context, block_size, keep)

    def _forward(self, x, cos, sin, context, block_size: int, keep: slice | None) -> torch.Tensor:
        h = self.input_norm(x)
        k, v = self.attn.key_value(h, cos, sin)  # (Bt, h_kv, N, d): every slot's
        if keep is not None:
            h, x, cos, sin = h[:, keep].contiguous(), x[:, keep], cos[:, keep], sin[:, keep]
            block_size = h.shape[1]  # one block per row, its kept slots
        q = self.attn.rotated_query(self.part("q", h, block_size), cos, sin)  # (Bt, h, N', d)
        out = context.attend(q, k, v, keep).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # (Bt, N', h*d)
        x = x + self.part("o", out, block_size)
        return x + self.part("ffn", x, block_size)

    def live(self, name: str):
        """The layer's part ``name``: ``q`` (Bt, N, H) -> (Bt, N, h*d), ``o`` (Bt, N, h*d) -> (Bt, N, H),
        ``ffn`` (Bt, N, H) -> (Bt, N, H)."""
        if name == "ffn":
            return lambda x: self.mlp(self.post_attn_norm(x))
        return self.attn.q_proj if name == "q" else self.attn.o_proj

    def part(self, name: str, x: torch.Tensor, block_size: int) -> torch.Tensor:
        """Part ``name`` (:meth:`live`) over the blocks' slots (x block-major, blocks of ``block_size``). The one
        hook of the layer: the frozen anchor (drafters.variants.anchor) runs each block's anchor apart."""
        return self.live(name)(x)


# Drafter layer parameter -> the same parameter of a Llama/Qwen-style target decoder layer.
_TARGET_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{n}_proj.{w}": f"self_attn.{n}_proj.{w}" for n in "qkvo" for w in ("weight", "bias")},
    **{f"attn.{n}_norm.weight": f"self_attn.{n}_norm.weight" for n in "qk"},
    **{f"mlp.{n}_proj.weight": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
}


def copy_target_layers(drafter: nn.Module, target: nn.Module, first: int = 0, sources=None) -> int:
    """Warm start: drafter layer i <- the target's decoder layer ``sources[i]`` (default: ``first + i``,
    its first layers), where names and shapes match (a Llama target has no q/k norm: those keep their
    init). Block slots enter as token embeddings, the input the target's first layers were trained on.
    Returns the tensors copied."""
    base = getattr(target, "model", None)
    layers = getattr(base, "layers", None)
    sources = list(range(first, first + len(drafter.layers)) if sources is None else sources)
    if layers is None or min(sources) < 0 or len(layers) <= max(sources):
        raise ValueError(f"init_layers_from_target needs a Llama/Qwen-style target with >= {max(sources) + 1} "
                         f"decoder layers at target.model.layers; {type(target).__name__} has none or fewer")
    copied = 0
    with torch.no_grad():
        for i, (layer, source_layer) in enumerate(zip(drafter.layers, sources)):
            theirs = dict(layers[source_layer].named_parameters())
            for name, param in layer.named_parameters():
                source = theirs.get(_TARGET_LAYER_NAMES.get(name, ""))
                if source is None:
                    continue
                if source.shape != param.shape:
                    raise ValueError(f"init_layers_from_target: drafter layers.{i}.{name} {tuple(param.shape)} "
                                     f"!= target layer {source_layer} {tuple(source.shape)}")
                param.copy_(source.float())
                copied += 1
    return copied


def cached_attention(q, keys, values, mask) -> torch.Tensor:
    """Attention of a block's few queries q (B, h, N, d) over cached keys/values (B, h, S, d) under a bool
    ``mask`` (B, 1, N or 1, S): ``scaled_dot_product_attention``. On a CPU it is written out (scores,
    masked softmax, weighted sum): for a handful of queries the fused CPU kernel costs ~3.5x more
    (~0.9 ms vs ~0.25 ms per layer at 8 rows x 4 heads x 5 queries x 204 keys, one thread)."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, h, N, S)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
