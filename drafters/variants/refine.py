"""Refinement (self-conditioning): after the first pass the block runs ``passes`` more times with the previous
pass's argmax drafts in slots 1..K instead of MASK / hints, and the last pass drafts. In training, every other
block is conditioned on a first pass's argmax (no gradient through it), so the drafter learns both passes.
Adds no weights: ``factory.with_variant(drafter, "refine", passes=n)`` / ``without_variant`` change it at
decoding time. DFlash engines run the block once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from drafters.layers import block_mask_subset
from drafters.model import Variant


@dataclass(frozen=True)
class Refine(Variant):
    name: ClassVar[str] = "refine"
    export_refusal: ClassVar[str] = ("refine (more passes over the block): DFlash engines run the block once; export "
                                     "the first pass with without_variant(drafter, 'refine')")
    passes: int = 1  # passes after the first

    def check(self, config, variants) -> None:
        if self.passes < 1:
            raise ValueError(f"refine_passes must be >= 1 with the refine variant (0: drop the variant), got {self.passes}")

    def train_logits(self, drafter, anchor_ids, anchor_positions, kv, mask, slot_ids, vocab_ids=None,
                     width=None) -> torch.Tensor:
        """Eval mode: what drafting does, ``passes`` more passes, each with the previous pass's argmax in the slots.
        Training mode: odd blocks (a = 1, 3, ...) run on the argmax of a first pass made without gradient, even
        blocks on ``slot_ids``, so one step trains both the first pass and a refining one.
        Whole blocks only (``width`` None)."""
        if width is not None:
            raise ValueError(f"width={width}: blocks narrower than the drafter's are replayed for one-pass "
                             f"drafters only (this one has variants {list(drafter.variant_names)})")
        args = (anchor_ids, anchor_positions, kv, mask)
        ids = (lambda logits: logits.argmax(-1)) if vocab_ids is None else (lambda logits: vocab_ids[logits.argmax(-1)])
        if drafter.training:  # the first pass only where its argmax is used: the odd blocks (blocks are independent)
            odd = torch.arange(1, anchor_ids.shape[1], 2, device=anchor_ids.device)  # (A // 2,)
            slots = slot_ids.clone()
            if odd.numel():
                with torch.no_grad():
                    first = drafter.block_logits(anchor_ids[:, odd], anchor_positions[:, odd], kv,
                                              block_mask_subset(mask, odd, drafter.config.block_size), slot_ids[:, odd],
                                              vocab_ids)
                    slots[:, odd] = ids(first)  # (Bt, A // 2, K)
            return drafter.block_logits(*args, slots, vocab_ids)
        logits = drafter.block_logits(*args, slot_ids, vocab_ids)
        for _ in range(self.passes):
            logits = drafter.block_logits(*args, ids(logits), vocab_ids)
        return logits

    def block_passes(self, drafter, ids, cos, sin, columns: int, mask, kv) -> torch.Tensor:
        """The first pass, then ``passes`` more with the previous pass's argmax in the slots."""
        states = drafter.block_pass(ids, cos, sin, columns, mask, kv)
        for _ in range(self.passes):
            ids = ids.clone()
            ids[:, 1:] = drafter.head(states).argmax(-1)
            states = drafter.block_pass(ids, cos, sin, columns, mask, kv)
        return states
