"""Store hints (needs ``hints``): slots whose prompt-lookup hint rests on fewer than :data:`STORE_BELOW_NGRAM`
tokens read instead what an n-gram store of the training answers continues (:class:`drafters.variants.hint_lookup.HintStore`,
corpus_lookup's rule), saved beside the drafter. In training a row reads the store of the other
``num_folds - 1`` folds of answers (never its own; its fold is found from its prompt, ``prompt_len``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from drafters.model import Variant
from drafters.variants.hint_lookup import HintStore

#: Slots whose prompt-lookup hint rests on fewer tokens than this read the store's instead (a hint from the
#: anchor token alone is mostly wrong: docs/history.md, "Lookup hints").
STORE_BELOW_NGRAM = 2


@dataclass(frozen=True)
class StoreHints(Variant):
    """Read by the hints variant (:meth:`weak_hints`); the store itself is the drafter's ``hint_store``."""

    name: ClassVar[str] = "store_hints"
    requires: ClassVar[tuple[str, ...]] = ("hints",)
    export_refusal: ClassVar[str] = ("store_hints (slots read an n-gram store of training answers): DFlash engines do "
                                     "not provide them")
    num_folds: int = 4  # training rows read the store without their own fold of answers

    def check(self, config, variants) -> None:
        if self.num_folds < 2:
            raise ValueError(f"store_num_folds must be >= 2 (a row's own answer is left out), got {self.num_folds}")

    def slot_ids(self, drafter, ids, mask, anchors, prompt_len=None):
        """As the hints variant's; in training mode each row reads the store without its own answer, found from
        ``prompt_len`` (Bt,) (required then); in eval mode every row reads the whole store, as drafting does."""
        if drafter.training and prompt_len is None:
            raise ValueError("store_hints in training needs prompt_len (a row must not read its own answer "
                             "from the hint store)")
        return drafter.variants["hints"].slot_ids(drafter, ids, mask, anchors, prompt_len)

    def weak_hints(self, drafter, ids, anchors, hints, ngram, prompt_len):
        """Where the hint rests on fewer than STORE_BELOW_NGRAM tokens, the store's (without the row's own fold
        of answers in training mode when ``prompt_len`` is given); ``(hints, ngram, from_store)``."""
        store = drafter.hint_store
        if store is None:
            raise ValueError("store_hints: this drafter has no hint_store (training sets it from the data; "
                             "from_pretrained loads it from the drafter's folder)")
        folds = store.folds(ids, prompt_len) if drafter.training and prompt_len is not None else None
        stored, n = store.hints(ids, anchors, drafter.num_draft_tokens, ngram < STORE_BELOW_NGRAM, folds)
        from_store = n > 0
        hints = torch.where(from_store.unsqueeze(-1), stored, hints)
        return hints, torch.where(from_store, n, ngram), from_store

    def save_extras(self, drafter, directory: Path) -> None:
        if drafter.hint_store is not None:
            drafter.hint_store.save(directory)

    def load_extras(self, drafter, directory: Path) -> None:
        drafter.hint_store = HintStore.load(directory)
