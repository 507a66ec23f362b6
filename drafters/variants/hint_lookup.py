"""Lookup hints: what prompt lookup would draft, given to a block drafter as its slots' input tokens.

A drafter with the ``hints`` variant (:mod:`drafters.variants.hints`) fills block slots 1..K with the continuation that
prompt lookup (:class:`verify.PromptLookupDrafter`, the rule of transformers'
``prompt_lookup_num_tokens``) proposes from the row's own tokens up to the anchor, instead of MASK
tokens; where no n-gram of the anchor's suffix occurs earlier, the slots stay MASK. The drafter still
predicts every slot in one pass from the target's hidden states: the hint is an input it learns when
to trust (a loop in the target's output is copied; elsewhere the hint is noise it learns to ignore).

The same function serves training (every anchor of a batch at once) and inference (one anchor per row
after the committed tokens), so both see the same hints.

With the ``store_hints`` variant the slots whose prompt-lookup hint rests on fewer than two tokens read
a :class:`HintStore`'s continuation instead: what ``corpus_lookup`` (:class:`verify.CorpusLookupDrafter`)
would draft there from the target's own answers.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from verify.lookup import NgramStore


def lookup_hints(
    ids: torch.Tensor,  # (Bt, S) long
    mask: torch.Tensor,  # (Bt, S) bool: real tokens; each row's real tokens up to its anchors are contiguous
    anchors: torch.Tensor,  # (Bt, A) long column of each block's anchor (the last token it may read)
    num_slots: int,  # K
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup continuations of ``ids[b, :anchors[b, a] + 1]``: ``(hints (Bt, A, K) long, ngram (Bt, A) long)``.

    For the largest n in ``max_ngram..min_ngram`` (n <= anchor) whose last-n-token window also ends
    at an earlier column j (j < anchor, every token of both windows real), the latest such j; the hint
    is the tokens after j, continuing periodically past the anchor (period anchor - j), exactly what
    ``verify.lookup.copy_tokens(seq, lookup_start(seq), K)`` drafts. ``ngram`` is that n, the length of
    the match (how much context the hint rests on), and 0 where no n-gram matches (the hint row is then
    0, to be replaced by MASK).
    """
    bt, seq = ids.shape
    if anchors.dim() != 2 or anchors.shape[0] != bt:
        raise ValueError(f"anchors must be (Bt={bt}, A), got {tuple(anchors.shape)}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    t = anchors.clamp(0, seq - 1)  # (Bt, A)
    cols = torch.arange(seq, device=ids.device)  # (S,)
    before = cols.view(1, 1, seq) < t.unsqueeze(-1)  # (Bt, A, S): window ends strictly before the anchor
    best = torch.full_like(t, -1)  # window end j of the longest, latest match
    ngram = torch.zeros_like(t)  # its n
    match = before.clone()
    for i in range(max_ngram):  # extend every window one token to the left: n = i + 1
        shifted_ids = torch.full_like(ids, -1)
        shifted_ids[:, i:] = ids[:, : seq - i]  # ids[j - i] at column j; -1 (never a token) before column i
        shifted_ids = shifted_ids.masked_fill(~_shift(mask, i), -2)  # holes never match either
        anchor_tok = ids.gather(1, (t - i).clamp(min=0))  # (Bt, A)
        anchor_ok = (t - i >= 0) & mask.gather(1, (t - i).clamp(min=0))
        match = match & (shifted_ids.unsqueeze(1) == anchor_tok.unsqueeze(-1)) & anchor_ok.unsqueeze(-1)
        n = i + 1
        if n >= min_ngram:
            latest = torch.where(match, cols, -1).amax(-1)  # (Bt, A)
            usable = (n <= t) & (latest >= 0)
            best = torch.where(usable, latest, best)  # a longer n found later overrides
            ngram = torch.where(usable, n, ngram)
    found = best >= 0
    start = best + 1  # (Bt, A)
    period = (t - best).clamp(min=1)  # tokens start .. t repeat
    k = torch.arange(num_slots, device=ids.device)
    src = start.unsqueeze(-1) + k % period.unsqueeze(-1)  # (Bt, A, K)
    hints = ids.gather(1, src.clamp(0, seq - 1).view(bt, -1)).view(bt, -1, num_slots)
    return hints.masked_fill(~found.unsqueeze(-1), 0), ngram


def _shift(mask: torch.Tensor, i: int) -> torch.Tensor:
    """``mask[:, j - i]`` at column j (False before column i)."""
    out = torch.zeros_like(mask)
    out[:, i:] = mask[:, : mask.shape[1] - i]
    return out


def compact_rows(ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's real tokens (holes dropped) followed by ``last`` (Bt,), right-padded:
    ``(ids (Bt, L) long, mask (Bt, L) bool, anchors (Bt, 1) long)`` for :func:`lookup_hints`."""
    rows = [torch.cat([ids[r][mask[r]], last[r].view(1)]) for r in range(ids.shape[0])]
    width = max(len(r) for r in rows)
    out = ids.new_zeros(len(rows), width)
    real = torch.zeros(len(rows), width, dtype=torch.bool, device=ids.device)
    for r, row in enumerate(rows):
        out[r, : len(row)], real[r, : len(row)] = row, True
    anchors = torch.tensor([[len(r) - 1] for r in rows], device=ids.device)
    return out, real, anchors


class HintStore:
    """Retrieval hints: :class:`verify.NgramStore` continuations of the training answers, for block slots.

    A training row must not read its own answer from the store (its hints would be its labels): the rows
    fall into ``num_folds`` folds by a hash of their prompt (:func:`prompt_fold`), and in training a row
    reads the store of the other folds' answers. Inference reads the store of every answer, built here at
    once (built on first use, it would be charged to the first timed decode); the folds' stores are built on
    first use. Saved beside the drafter (:meth:`save`, :meth:`load`) as the answers themselves.
    """

    FILE = "hint_store.safetensors"

    def __init__(self, rows: Sequence[tuple[Sequence[int], int]], num_folds: int = 4, max_ngram: int = 4):
        if num_folds < 2:
            raise ValueError(f"num_folds must be >= 2 (a row's own answer is left out of its store), got {num_folds}")
        if not rows:
            raise ValueError("a hint store needs at least one regenerated row")
        self.rows = [(list(map(int, ids)), int(prompt_len)) for ids, prompt_len in rows]  # (input_ids, prompt_len)
        self.num_folds, self.max_ngram = int(num_folds), int(max_ngram)
        self._folds = [prompt_fold(ids[:n], self.num_folds) for ids, n in self.rows]
        self._stores: dict[int | None, NgramStore] = {None: NgramStore.from_answers(self.rows, self.max_ngram)}

    @classmethod
    def from_data(cls, data, num_folds: int = 4, indices: Sequence[int] | None = None) -> HintStore:
        """The store of a regenerated dataset's rows (``drafters.training.datamodule.load_regenerated``), or of ``indices`` only."""
        ids, prompt_lens = (data.data.column(c).to_pylist() for c in ("input_ids", "prompt_len"))
        return cls([(ids[i], prompt_lens[i]) for i in (range(len(ids)) if indices is None else indices)], num_folds)

    def store(self, fold: int | None = None) -> NgramStore:
        """The store of every answer (``fold`` None) or of the answers outside ``fold``."""
        if fold not in self._stores:
            rows = [r for r, f in zip(self.rows, self._folds) if f != fold]
            self._stores[fold] = NgramStore.from_answers(rows, self.max_ngram)
        return self._stores[fold]

    def hints(
        self,
        ids: torch.Tensor,  # (Bt, S) long; each row's real tokens up to its anchors are contiguous
        anchors: torch.Tensor,  # (Bt, A) long
        num_slots: int,  # K
        need: torch.Tensor,  # (Bt, A) bool: the anchors to look up
        folds: Sequence[int] | None = None,  # (Bt,) each row's fold (training), None = the store of every answer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hints (Bt, A, K) long, ngram (Bt, A) long)``: where ``need``, the store's continuation of the row's
        tokens up to the anchor (:meth:`verify.NgramStore.continuation`), its last token repeated where the
        store runs out; ``ngram`` is the suffix length its first token rests on (0: nothing held, hint 0)."""
        hints = torch.zeros(*anchors.shape, num_slots, dtype=torch.long)
        ngram = torch.zeros(anchors.shape, dtype=torch.long)
        rows, cols = ids.tolist(), anchors.tolist()
        for b, a in need.nonzero().tolist():
            store = self.store(None if folds is None else int(folds[b]))
            t = cols[b][a]
            context = rows[b][max(0, t - self.max_ngram + 1) : t + 1]
            tokens = store.continuation(context, num_slots)
            if tokens:
                hints[b, a] = torch.tensor(tokens + tokens[-1:] * (num_slots - len(tokens)))
                ngram[b, a] = store.suffix_length(context)
        return hints.to(ids.device), ngram.to(ids.device)

    def folds(self, ids: torch.Tensor, prompt_len: torch.Tensor) -> list[int]:
        """(Bt,) the fold of each row ``ids (Bt, S)`` with ``prompt_len (Bt,)`` prompt tokens."""
        return [prompt_fold(row[:n], self.num_folds) for row, n in zip(ids.tolist(), prompt_len.tolist())]

    def save(self, directory: str | Path) -> None:
        """``hint_store.safetensors`` in ``directory``: the rows' tokens, lengths and prompt lengths."""
        flat = torch.tensor([t for ids, _ in self.rows for t in ids], dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids, _ in self.rows], dtype=torch.long)
        prompt_lens = torch.tensor([n for _, n in self.rows], dtype=torch.long)
        save_file({"tokens": flat, "lengths": lengths, "prompt_lens": prompt_lens}, str(Path(directory) / self.FILE),
                  metadata={"num_folds": str(self.num_folds), "max_ngram": str(self.max_ngram)})

    @classmethod
    def load(cls, directory: str | Path) -> HintStore:
        path = Path(directory) / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the drafter was trained with store_hints and reads its hints "
                                    "from the answers saved there")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        t = load_file(str(path))
        rows = zip(t["tokens"].split(t["lengths"].tolist()), t["prompt_lens"].tolist())
        return cls([(ids.tolist(), n) for ids, n in rows], int(meta["num_folds"]), int(meta["max_ngram"]))


def prompt_fold(prompt: Sequence[int], num_folds: int) -> int:
    """The fold (0..num_folds-1) of a row with these prompt tokens: rows of one prompt share it."""
    return zlib.crc32(",".join(map(str, prompt)).encode()) % num_folds
