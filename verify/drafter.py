"""The drafter protocol: what a drafter receives at each speculative step and what it returns.

Layout shared by the verifier and every drafter (one batch of B rows):

* The verifier keeps a *column* buffer of length C for all rows. Column c of row b holds a token
  that is either committed (``attention_mask[b, c] == 1``) or a hole (``0``: left padding, or a
  draft that this row rejected while another row accepted it). Holes are never removed; they are
  masked. ``position_ids`` count committed tokens only (``cumsum(mask) - 1``), so a row's
  positions are exactly those it would have without batching.
* The *anchor* of a row is its last committed token, which the target has not processed yet.
  It is never in the column buffer: it is handed to :meth:`Drafter.draft`.

One speculative step:

1. ``draft(anchor_ids, anchor_position_ids, ...)`` returns K draft tokens per row and, for sampled
   drafts, the proposal distributions q they were drawn from (``None`` means deterministic drafts,
   i.e. q is one-hot at the returned token).
2. The target runs ``[anchor, d_1..d_K]`` in one forward pass and the verifier accepts a prefix.
3. ``extend(input_ids, attention_mask, position_ids, hidden_states)`` appends the new columns
   ``[anchor, d_1..d_n]`` (n = the largest accepted count over rows; rows that accepted fewer have
   holes there) together with the target's hidden states at those columns, for the layers listed
   in ``target_layer_ids`` (indices into Hugging Face's ``output_hidden_states`` tuple, 0 being the
   embeddings). The first call after :meth:`reset` carries the prompt without its anchor.

A drafter may be stateful (caches), so the verifier calls ``reset`` before a new batch and
``select_rows`` when it drops finished rows from the batch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Drafter(Protocol):
    """A drafter that the verifier in :mod:`verify.generate` can drive."""

    #: K, the number of tokens drafted per step (the block size minus one for block drafters).
    num_draft_tokens: int
    #: Indices into the target's ``hidden_states`` tuple that ``extend`` must receive; empty if none.
    target_layer_ids: tuple[int, ...]
    #: Vocabulary size of the drafter's output distribution; must equal the target's.
    vocab_size: int

    def reset(self, batch_size: int) -> None:
        """Forget every cached column; a new batch of ``batch_size`` rows starts."""

    def extend(
        self,
        input_ids: torch.Tensor,  # (B, n) long
        attention_mask: torch.Tensor,  # (B, n) long, 1 = committed, 0 = hole
        position_ids: torch.Tensor,  # (B, n) long
        hidden_states: tuple[torch.Tensor, ...] | None,  # len(target_layer_ids) x (B, n, H)
    ) -> None:
        """Append n committed-or-hole columns to the drafter's context."""

    def draft(
        self,
        anchor_ids: torch.Tensor,  # (B,) long
        anchor_position_ids: torch.Tensor,  # (B,) long
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Propose K tokens per row: ``(tokens (B, K) long, q (B, K, V) float32 or None)``.

        When q is returned, ``tokens[:, k]`` must have been drawn from ``q[:, k]`` (given the
        drafts before it); the verifier's exactness relies on it.
        """

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows listed in ``rows`` (B',) long, in that order."""
