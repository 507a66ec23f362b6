"""The drafter's layers: RMSNorm, RoPE, attention over [context, block] keys/values, SwiGLU, and
the decoder layer (:class:`DrafterLayer`), run by training over many blocks per row (:class:`BlockContext`)
and by drafting over one block per row after the cached columns (:class:`CachedContext`); and
:func:`copy_target_layers` (the warm start from the target's layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from drafters.config import DrafterConfig


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
    :func:`drafters.attention.build_block_attention_mask`; own: (B, B) bool, which slots of its own block
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
    :func:`drafters.attention.build_block_attention_mask` (whose other-block part is all False), scoring
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
        q = self.attn.rotated_query(self.q_projection(h, block_size), cos, sin)  # (Bt, h, N', d)
        out = context.attend(q, k, v, keep).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # (Bt, N', h*d)
        x = x + self.o_projection(out, block_size)
        return x + self.feed_forward(x, block_size)

    # Hooks over the block's slots (x block-major, blocks of ``block_size``); a variant may treat each block's
    # first slot (its anchor) apart (drafters.variants.anchor).

    def q_projection(self, h: torch.Tensor, block_size: int) -> torch.Tensor:  # (Bt, N, H) -> (Bt, N, h*d)
        return self.attn.q_proj(h)

    def o_projection(self, out: torch.Tensor, block_size: int) -> torch.Tensor:  # (Bt, N, h*d) -> (Bt, N, H)
        return self.attn.o_proj(out)

    def feed_forward(self, x: torch.Tensor, block_size: int) -> torch.Tensor:  # (Bt, N, H) -> (Bt, N, H)
        return self.mlp(self.post_attn_norm(x))


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
