"""Batches of regenerated rows: block anchors, right-padded batches, and the training loader that resumes mid-epoch.

Anchors (:func:`sample_anchors`): blocks start at random columns of the response region; column ``a`` is an anchor
when ``prompt_len - 1 <= a <= length - 2``, so slot 1 of its block predicts column ``a + 1``, a response token.

Resuming: the training loader (:class:`ResumableLoader` over :class:`EpochShuffle`) is saved in Lightning's
checkpoints (epoch, batches of it done), so a run killed mid-epoch and resumed sees the same batches in the same
order as an uninterrupted one. Used through :mod:`drafters.training.datamodule`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader, Sampler


def sample_anchors(
    prompt_len: torch.Tensor,  # (B,) long, prompt tokens per row (>= 1)
    length: torch.Tensor,  # (B,) long, real tokens per row (prompt + response)
    num_anchors: int,
    generator: torch.Generator | None = None,
    weights: torch.Tensor | None = None,  # (B, S) float in (0, 1], per column; None: all 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block anchors in each row's response region, without replacement.

    Candidates of row b are the columns ``prompt_len[b] - 1 .. length[b] - 2``. Each row gets
    ``min(num_anchors, #candidates)`` distinct anchors drawn uniformly, sorted ascending and
    followed by padding; the width is ``A = min(num_anchors, max_b #candidates)``. With ``weights``, a column is
    drawn in proportion to its weight (without replacement: the ``A`` largest keys ``log(u) / w``, u uniform), so a
    column of weight w adds w times as much to the loss in expectation.
    Returns ``anchors (B, A) long`` (0 at padding) and ``anchor_mask (B, A) bool`` (False = padding).
    Deterministic given ``generator`` (drawn on the CPU, moved to ``length``'s device).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if (prompt_len < 1).any():
        raise ValueError("every row needs a prompt of at least one token (prompt_len >= 1)")
    device = length.device
    lo, hi = (prompt_len - 1).cpu(), (length - 2).cpu()  # (B,)
    width = max(int(length.max()), 1)
    cols = torch.arange(width)  # (S,)
    cand = (cols >= lo.unsqueeze(1)) & (cols <= hi.unsqueeze(1))  # (B, S)
    count = cand.sum(1)  # (B,)
    num = min(num_anchors, int(count.max()))
    scores = torch.rand(cand.shape, generator=generator)  # (B, S) in [0, 1)
    if weights is not None:
        weights = weights.cpu().float()[:, :width]  # (B, S)
        if weights.shape != cand.shape or not bool(((weights > 0) & (weights <= 1)).all()):
            raise ValueError(f"anchor weights must be (B, S) = {tuple(cand.shape)} in (0, 1], got "
                             f"{tuple(weights.shape)} in [{float(weights.min())}, {float(weights.max())}]")
        scores = scores.clamp(min=1e-12).log() / weights  # (B, S) <= 0; weighted sampling without replacement
    scores = scores.masked_fill(~cand, -float("inf") if weights is not None else -1.0)  # candidates rank first
    picked = scores.topk(num, dim=1).indices  # (B, A), candidates first
    anchor_mask = torch.arange(num).unsqueeze(0) < count.unsqueeze(1)  # (B, A)
    anchors = picked.masked_fill(~anchor_mask, width).sort(dim=1).values.masked_fill(~anchor_mask, 0)
    return anchors.to(device), anchor_mask.to(device)


FEATURE_KEYS = ("features", "head_states")  # cached per-column target tensors a batch may carry
SOURCE_ROWS = "source_rows"  # (B,) long: each batch row's index in its data dir (named when a step fails)


def collate(rows: Sequence[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad rows ``{"input_ids": list[int], "prompt_len": int}`` into a batch.

    Returns ``input_ids (B, S) long`` (padding = ``pad_token_id``), ``attention_mask (B, S) long``,
    ``prompt_len (B,) long`` and ``length (B,) long``; rows with cached target ``features`` ((len, F)
    tensors, see :mod:`drafters.training.features`) add ``features (B, S, F)``, zero at padding; likewise
    ``head_states`` (the target's final states, for soft labels). Rows with a ``row`` (their index in the data
    dir) add ``source_rows (B,) long``, so that a failing step can name the rows it read.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    lengths = [len(r["input_ids"]) for r in rows]
    width = max(lengths)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (r, n) in enumerate(zip(rows, lengths)):
        input_ids[b, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompt_len": torch.tensor([int(r["prompt_len"]) for r in rows], dtype=torch.long),
        "length": torch.tensor(lengths, dtype=torch.long),
    }
    if all("row" in r for r in rows):
        batch[SOURCE_ROWS] = torch.tensor([int(r["row"]) for r in rows], dtype=torch.long)
    for key in FEATURE_KEYS:
        if key in rows[0]:
            feats = torch.zeros(len(rows), width, rows[0][key].shape[-1])
            for b, (r, n) in enumerate(zip(rows, lengths)):
                feats[b, :n] = r[key]
            batch[key] = feats
    return batch


class EpochShuffle(Sampler):
    """A permutation of ``range(n)`` drawn from ``(seed, epoch)``; Lightning calls ``set_epoch``.

    Unlike a DataLoader-level generator, the order of epoch e does not depend on how many epochs
    this process ran before, so a run resumed at an epoch boundary sees the data in the same order
    as an uninterrupted one. Under DDP, Lightning wraps it (``DistributedSamplerWrapper``, which
    forwards ``set_epoch``) and gives each rank its slice of the same permutation.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())


class _SkipFirst:
    """The batches of indices of ``inner``, less the first ones its loader asks to skip (a resumed epoch):
    indices only, so skipping reads no data. Lazy, so the sampler's epoch is read when iterating."""

    def __init__(self, inner, loader: ResumableLoader):
        self.inner, self.loader = inner, loader

    def __len__(self) -> int:
        return len(self.inner)  # the whole epoch: Lightning counts the batches already done itself

    def __iter__(self):
        skip = self.loader._start_epoch(int(getattr(self.loader.sampler, "epoch", 0)))
        batches = iter(self.inner)
        for _ in range(skip):
            next(batches, None)
        yield from batches


class ResumableLoader(DataLoader):
    """A DataLoader whose position Lightning keeps in its checkpoints (``state_dict``/``load_state_dict``:
    the epoch and how many of its batches were handed out), so that a run resumed mid-epoch goes on
    with the rest of the same permutation instead of starting the epoch over.

    Skipping works on the batches of indices (the data of skipped batches is never read), under the
    sampler of the DataLoader, whatever wraps it (Lightning's ``DistributedSamplerWrapper`` under DDP).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._position = (0, 0)  # (epoch, batches of it handed out)
        self._resume_at: tuple[int, int] | None = None  # from a checkpoint, for the next iteration

    @property
    def _index_sampler(self):  # what DataLoader iterators draw their batches of indices from
        return _SkipFirst(DataLoader._index_sampler.fget(self), self)

    def _start_epoch(self, epoch: int) -> int:
        """Batches of ``epoch`` to skip now (those done before a resumed checkpoint)."""
        resume, self._resume_at = self._resume_at, None
        skip = resume[1] if resume is not None and resume[0] == epoch else 0
        self._position = (epoch, skip)
        return skip

    def __iter__(self):
        for batch in super().__iter__():
            epoch, served = self._position
            self._position = (epoch, served + 1)
            yield batch

    def state_dict(self) -> dict:
        epoch, served = self._position
        return {"epoch": epoch, "batches": served}

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, served = int(state["epoch"]), int(state["batches"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"the checkpoint's data loader state {state!r} is not one of a ResumableLoader "
                             "(epoch, batches)") from None
        if served >= len(self):  # saved after the epoch's last batch: the next epoch, from its start
            epoch, served = epoch + 1, 0
        self._resume_at = (epoch, served)
        _set_sampler_epoch(self, epoch)  # also for workers that prefetch before Lightning sets it
