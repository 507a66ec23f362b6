"""Anchor policies. ``causal``: each block's anchor (position 0) attends to the context and itself only, not
to the block's other slots (they still see it); shifted, with every target layer copied, the anchor's output is
then the target's own next-token prediction before any training. ``frozen`` (needs a shifted layerwise
drafter): the anchor runs through frozen copies of each layer's query/output projections, post-attention norm
and MLP, taken when the drafter is built; the parts every slot reads (input norms, key/value projections, q/k
norms, the output norm) are frozen too, so training never moves slot 1 and the losses train slots 2..K only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from drafters.attention import own_block_mask
from drafters.layers import DrafterLayer, RMSNorm, SwiGLU


@dataclass(frozen=True)
class AnchorOptions:
    frozen: bool = False  # the anchor runs through frozen copies of the layers

    def check(self, config, variants) -> None:
        layerwise = variants.get("layerwise")
        if self.frozen and not (layerwise is not None and layerwise.shifted):
            raise ValueError("frozen_anchor needs causal_anchor and shifted (slot 1 read from an anchor that sees no "
                             "other slot): compose it with the layerwise variant, shifted=True")


def by_slot(x: torch.Tensor, block_size: int, anchor_fn, slot_fn) -> torch.Tensor:
    """``anchor_fn`` on each block's anchor (position 0), ``slot_fn`` on its other positions.

    x: (Bt, N, *), block-major, N = A * block_size (at drafting one block per row: block_size = N).
    Returns (Bt, N, *'), the two results put back in place."""
    bt, n = x.shape[:2]
    blocks = x.reshape(bt, n // block_size, block_size, *x.shape[2:])  # (Bt, A, B, *)
    # contiguous parts: a linear layer then runs as one plain matmul (a strided view makes it a batched one
    # over a broadcast weight, several times slower on a CPU)
    out = torch.cat([anchor_fn(blocks[:, :, :1].contiguous()), slot_fn(blocks[:, :, 1:].contiguous())], dim=2)
    return out.reshape(bt, n, *out.shape[3:])


class FrozenAnchorLayer(DrafterLayer):
    """A drafter layer whose blocks' anchors run through frozen copies of its query/output projections,
    post-attention norm and MLP (state dict names ``attn.anchor_{q,o}_proj``, ``anchor_post_attn_norm``,
    ``anchor_mlp``)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        a = self.attn
        a.anchor_q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        a.anchor_o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.anchor_post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.anchor_mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        for module in (self.anchor_post_attn_norm, self.anchor_mlp, a.anchor_q_proj, a.anchor_o_proj,
                       self.input_norm, a.k_proj, a.v_proj, a.q_norm, a.k_norm):
            if module is not None:
                module.requires_grad_(False)

    def q_projection(self, h, block_size: int):
        return by_slot(h, block_size, self.attn.anchor_q_proj, self.attn.q_proj)

    def o_projection(self, out, block_size: int):
        return by_slot(out, block_size, self.attn.anchor_o_proj, self.attn.o_proj)

    def feed_forward(self, x, block_size: int):
        return by_slot(x, block_size, lambda a: self.anchor_mlp(self.anchor_post_attn_norm(a)),
                       lambda s: self.mlp(self.post_attn_norm(s)))

    @torch.no_grad()
    def sync_anchor_path(self) -> None:
        """The anchor's frozen copies := the layer's current weights."""
        pairs = [(self.attn.anchor_q_proj, self.attn.q_proj), (self.attn.anchor_o_proj, self.attn.o_proj),
                 (self.anchor_post_attn_norm, self.post_attn_norm), (self.anchor_mlp, self.mlp)]
        for frozen, live in pairs:
            frozen.load_state_dict(live.state_dict())


class CausalAnchor:
    variant_name = "anchor"
    Options = AnchorOptions
    requires: tuple[str, ...] = ()
    export_refusal = ("anchor (causal or frozen anchor): DFlash blocks attend bidirectionally and run every slot "
                      "through the same weights")

    def _own_mask(self, block_size: int, device):
        return own_block_mask(block_size, device)

    def _new_layer(self):
        return FrozenAnchorLayer(self.config) if self.variants["anchor"].frozen else super()._new_layer()

    def _after_init(self) -> None:
        """frozen: the output norm (read by the anchor too) is frozen, and the anchor's copies := each layer's
        current weights (at construction, after any warm start; a saved drafter loads its own)."""
        super()._after_init()
        if self.variants["anchor"].frozen:
            self.norm.requires_grad_(False)
            for layer in self.layers:
                layer.sync_anchor_path()
