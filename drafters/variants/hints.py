"""Lookup hints: block slots 1..K read the continuation that prompt lookup proposes from the row's own tokens up
to the anchor (:func:`drafters.variants.hint_lookup.lookup_hints`, n-grams ``max_ngram``..1) instead of MASK, where an n-gram
matches. The drafter learns when to trust the copy. Training (every anchor of a batch) and drafting (one anchor
per row after the committed tokens) read the same hints. Whether a step copies a hint outright is decoding
policy (:class:`drafters.policy.DraftingPolicy`). Not servable as DFlash (engines feed MASK tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from drafters.model import Variant
from drafters.variants.hint_lookup import compact_rows, lookup_hints


@dataclass(frozen=True)
class LookupHints(Variant):
    name: ClassVar[str] = "hints"
    export_refusal: ClassVar[str] = ("hints (lookup_hints: block slots read prompt-lookup tokens instead of MASK): "
                                     "DFlash engines do not provide them")
    max_ngram: int = 3  # longest n-gram prompt lookup matches

    def check(self, config, variants) -> None:
        if self.max_ngram < 1:
            raise ValueError(f"lookup_max_ngram must be >= 1, got {self.max_ngram}")

    def slot_ids(self, drafter, ids, mask, anchors, prompt_len=None) -> torch.Tensor:
        """Slots' input tokens (Bt, A, K): the prompt-lookup continuation of ``ids[:, :anchor + 1]``, MASK where
        no n-gram matched (see :meth:`hinted_slots`)."""
        return self.hinted_slots(drafter, ids, mask, anchors, prompt_len)[0]

    def hinted_slots(self, drafter, ids, mask, anchors, prompt_len=None):
        """``(slot ids (Bt, A, K), ngram (Bt, A), from_store (Bt, A) bool)``: the hints, MASK where no n-gram
        matched (ngram 0), the length of the n-gram each rests on, and whether it came from a hint store (the
        store_hints variant replaces weak hints). ids: (Bt, S) long; mask: (Bt, S) bool real tokens; anchors:
        (Bt, A) long columns."""
        hints, ngram = lookup_hints(ids, mask, anchors, drafter.num_draft_tokens, self.max_ngram)
        store = drafter.variants.get("store_hints")
        if store is not None:
            hints, ngram, from_store = store.weak_hints(drafter, ids, anchors, hints, ngram, prompt_len)
        else:
            from_store = torch.zeros_like(ngram, dtype=torch.bool)
        return hints.masked_fill(ngram.unsqueeze(-1) == 0, drafter.config.mask_token_id), ngram, from_store

    def slot_inputs(self, drafter, ids: torch.Tensor, columns: int):
        """The hints of the committed tokens (holes dropped) and the anchor, as training reads them, into
        ids[:, 1:]; all K of them are returned as the block's ``hints``."""
        cache = drafter.draft_cache
        rows = compact_rows(cache.ids_buffer[:, :columns], cache.mask_buffer[:, :columns], ids[:, 0])
        slots, ngram, store = self.hinted_slots(drafter, *rows)
        ids[:, 1:] = slots[:, 0, : ids.shape[1] - 1]
        return slots[:, 0], ngram[:, 0], store[:, 0]  # (B, K), (B,), (B,)

    def source_labels(self, drafter, block, copied):
        """``hint:prompt`` / ``hint:store`` (a copied hint of the row's own tokens or of the hint store),
        ``hint:none`` (a copied row with no hint) or ``drafter`` (the drafter's tokens), per row."""
        _, ngram, store = (h.tolist() for h in block.hints)
        kinds = ["hint:store" if s else "hint:prompt" if n else "hint:none" for n, s in zip(ngram, store)]
        copied = copied.tolist() if copied is not None else [False] * len(kinds)
        return [kind if c else "drafter" for c, kind in zip(copied, kinds)]
