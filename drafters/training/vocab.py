"""A candidate vocabulary for the training loss (EAGLE-3 / FR-Spec style): the frequent tokens only.

A small drafter's step is dominated by the target's LM head (49,152 rows for SmolLM2). Training computes
the drafter's logits over the ``size`` most frequent response tokens of the training answers only; a slot
whose label falls outside them ends its block's labels there (the drafter cannot be trained to draft it,
and nothing after it is a prefix the drafter could reach). Drafting and evaluation keep the full head, so
the drafter stays an ordinary DFlash drafter; ``docs/method.md`` gives the losses this feeds.

The tokens left out still have logits at inference, and nothing in a candidate-only softmax pushes them
down: on SmolLM2 a drafter trained 60 steps that way reached training slot-1 accuracy 0.19 and validation
(full vocabulary) accuracy 0. Each step therefore also scores ``negatives`` ids drawn uniformly from the
rest of the vocabulary (a sampled softmax: :meth:`TrainVocab.columns`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def frequent_tokens(responses: Iterable[Sequence[int]], size: int, vocab_size: int,
                    always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent ids of ``responses`` (ties: the smaller id), plus ``always``; (V',) sorted."""
    if size < 1:
        raise ValueError(f"a candidate vocabulary needs size >= 1, got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in responses:
        counts += torch.bincount(torch.as_tensor(list(ids), dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(counts, descending=True, stable=True)[: min(size, vocab_size)]
    keep = set(order[counts[order] > 0].tolist()) | {int(i) for i in always}
    return torch.tensor(sorted(keep), dtype=torch.long)


def lookup_table(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) long: the index of each full-vocabulary id in ``vocab_ids``, -1 outside it."""
    table = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab_ids.device)
    table[vocab_ids] = torch.arange(len(vocab_ids), device=vocab_ids.device)
    return table


def remap_labels(labels: torch.Tensor, mask: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (N, K) in candidate indices and their mask (N, K), cut at each block's first label outside the
    candidate vocabulary (labels past the cut become 0, masked)."""
    index = table[labels.clamp(min=0)]  # (N, K)
    inside = (index >= 0) | ~mask
    mask = mask & inside.long().cumprod(-1).bool()
    return index.clamp(min=0), mask


def coverage(responses: Iterable[Sequence[int]], vocab_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of response tokens inside the candidate vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab_ids] = True
    hit = total = 0
    for ids in responses:
        t = torch.as_tensor(list(ids), dtype=torch.long)
        hit, total = hit + int(inside[t].sum()), total + len(t)
    return hit / max(total, 1)


@dataclass
class TrainVocab:
    """The training loss's columns: ``ids`` (V',) candidates, ``table`` (V,) their lookup, ``others`` the rest of
    the vocabulary, ``negatives`` of which are scored each step."""

    ids: torch.Tensor
    table: torch.Tensor
    others: torch.Tensor
    negatives: int = 0

    @classmethod
    def build(cls, ids: torch.Tensor, vocab_size: int, negatives: int = 0) -> TrainVocab:
        table = lookup_table(ids, vocab_size)
        return cls(ids, table, torch.nonzero(table < 0).flatten(), negatives)

    def to(self, device) -> TrainVocab:
        return TrainVocab(self.ids.to(device), self.table.to(device), self.others.to(device), self.negatives)

    def columns(self, generator: torch.Generator) -> torch.Tensor:
        """(V' + R,) ids whose logits a step computes: the candidates first (label indices stay), then R negatives."""
        count = min(self.negatives, len(self.others))
        if count == 0:
            return self.ids
        pick = torch.randperm(len(self.others), generator=generator)[:count].to(self.others.device)
        return torch.cat([self.ids, self.others[pick]])
