"""Anchor policies. ``causal``: each block's anchor (position 0) attends to the context and itself only, not
to the block's other slots (they still see it); shifted, with every target layer copied, the anchor's output is
then the target's own next-token prediction before any training. ``frozen`` (needs a shifted layerwise
drafter): the anchor runs through frozen copies of each layer's query/output projections, post-attention norm
and MLP, taken when the drafter is built; the parts every slot reads (input norms, key/value projections, q/k
norms, the output norm) are frozen too, so training never moves slot 1 and the losses train slots 2..K only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from drafters.layers import DrafterLayer, RMSNorm, SwiGLU, own_block_mask
from drafters.model import Variant


@dataclass(frozen=True)
class CausalAnchor(Variant):
    name: ClassVar[str] = "anchor"
    export_refusal: ClassVar[str] = ("anchor (causal or frozen anchor): DFlash blocks attend bidirectionally and run "
                                     "every slot through the same weights")
    frozen: bool = False  # the anchor runs through frozen copies of the layers

    def check(self, config, variants) -> None:
        layerwise = variants.get("layerwise")
        if self.frozen and not (layerwise is not None and layerwise.shifted):
            raise ValueError("frozen_anchor needs causal_anchor and shifted (slot 1 read from an anchor that sees no "
                             "other slot): compose it with the layerwise variant, shifted=True")

    def own_mask(self, drafter, block_size: int, device):
        return own_block_mask(block_size, device)

    def new_layer(self, drafter):
        return FrozenAnchorLayer(drafter.config) if self.frozen else DrafterLayer(drafter.config)

    def after_init(self, drafter) -> None:
        """frozen: the output norm (read by the anchor too) is frozen, and the anchor's copies := each layer's
        current weights (at construction, after any warm start; a saved drafter loads its own)."""
        if self.frozen:
            drafter.norm.requires_grad_(False)
            for layer in drafter.layers:
                layer.sync_anchor_path()


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

    def part(self, name: str, x, block_size: int):
        """Each block's anchor through the frozen copy of part ``name``, its other slots through the live one."""
        frozen = {"q": self.attn.anchor_q_proj, "o": self.attn.anchor_o_proj,
                  "ffn": lambda a: self.anchor_mlp(self.anchor_post_attn_norm(a))}[name]
        return by_slot(x, block_size, frozen, self.live(name))

    @torch.no_grad()
    def sync_anchor_path(self) -> None:
        """The anchor's frozen copies := the layer's current weights."""
        pairs = [(self.attn.anchor_q_proj, self.attn.q_proj), (self.attn.anchor_o_proj, self.attn.o_proj),
                 (self.anchor_post_attn_norm, self.post_attn_norm), (self.anchor_mlp, self.mlp)]
        for frozen, live in pairs:
            frozen.load_state_dict(live.state_dict())

