"""Store hints (needs ``hints``): slots whose prompt-lookup hint rests on fewer than :data:`STORE_BELOW_NGRAM`
tokens read instead what an n-gram store of the training answers continues (:class:`drafters.hints.HintStore`,
corpus_lookup's rule), saved beside the drafter. In training a row reads the store of the other
``num_folds - 1`` folds of answers (never its own; its fold is found from its prompt, ``prompt_len``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from drafters.hints import HintStore

#: Slots whose prompt-lookup hint rests on fewer tokens than this read the store's instead (a hint from the
#: anchor token alone is mostly wrong: docs/history.md, "Lookup hints").
STORE_BELOW_NGRAM = 2


@dataclass(frozen=True)
class StoreHintsOptions:
    num_folds: int = 4  # training rows read the store without their own fold of answers

    def check(self, config, variants) -> None:
        if self.num_folds < 2:
            raise ValueError(f"store_num_folds must be >= 2 (a row's own answer is left out), got {self.num_folds}")


class StoreHints:
    variant_name = "store_hints"
    Options = StoreHintsOptions
    requires: tuple[str, ...] = ("hints",)
    export_refusal = "store_hints (slots read an n-gram store of training answers): DFlash engines do not provide them"

    #: The training answers the weak slots' hints are retrieved from (set by training, saved and loaded beside
    #: the weights).
    hint_store: HintStore | None = None

    def slot_ids(self, ids, mask, anchors, prompt_len=None):
        """As the hints variant's; in training mode each row reads the store without its own answer, found from
        ``prompt_len`` (Bt,) (required then); in eval mode every row reads the whole store, as drafting does."""
        if self.training and prompt_len is None:
            raise ValueError("store_hints in training needs prompt_len (a row must not read its own answer "
                             "from the hint store)")
        return super().slot_ids(ids, mask, anchors, prompt_len)

    def _weak_hints(self, ids, anchors, hints, ngram, prompt_len):
        """Where the hint rests on fewer than STORE_BELOW_NGRAM tokens, the store's (without the row's own fold
        of answers in training mode when ``prompt_len`` is given)."""
        if self.hint_store is None:
            raise ValueError("store_hints: this drafter has no hint_store (training sets it from the data; "
                             "from_pretrained loads it from the drafter's folder)")
        folds = self.hint_store.folds(ids, prompt_len) if self.training and prompt_len is not None else None
        stored, n = self.hint_store.hints(ids, anchors, self.num_draft_tokens, ngram < STORE_BELOW_NGRAM, folds)
        from_store = n > 0
        hints = torch.where(from_store.unsqueeze(-1), stored, hints)
        return hints, torch.where(from_store, n, ngram), from_store

    def _save_extras(self, directory: Path) -> None:
        super()._save_extras(directory)
        if self.hint_store is not None:
            self.hint_store.save(directory)

    def _load_extras(self, directory: Path) -> None:
        super()._load_extras(directory)
        self.hint_store = HintStore.load(directory)
