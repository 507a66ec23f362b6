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

Optionally, ``bind_target_cache(cache)`` is offered the target's KV cache after ``reset`` and before the first
``extend``: a drafter whose context keys/values are the target's may read them there instead of keeping its
own (:mod:`drafters.shared_cache`). The verifier crops that cache to the committed columns and selects its rows
before it calls ``extend`` and ``select_rows``; a drafter may write scratch columns past its end.

Optionally, ``draft_sources()`` returns, per row of the last ``draft``, a label of what drafted it (e.g.
``hint`` for a copied lookup hint, ``drafter`` for the model's own tokens; None: unlabelled). The verifier
records them beside the accepted counts (:func:`verify.metrics.accepted_by_source`).
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch

from verify.hf import cache_argument, max_positions, new_kv_cache, output_vocab_size
from verify.rejection import sample_tokens, warp_probs


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

        A drafter may return fewer drafts, (B, W) and (B, W, V) with W <= K, the same W for every
        row: only those are verified. Exactness then needs only that the decision to include slot k
        does not look at the token drawn for slot k or later (e.g. a width chosen from the proposal
        distributions of a block drafter, whose slots are drawn independently).
        """

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows listed in ``rows`` (B',) long, in that order."""


class AssistantDrafter:
    """Any Hugging Face causal LM used as an autoregressive drafter (K forwards per step).

    It keeps its own KV cache in the verifier's column layout (see the module docstring). ``draft``
    runs the pending columns plus the anchor in one forward, then feeds d_1..d_{K-1} one at a time,
    caching them as if committed. ``extend`` keeps the cached columns the verifier committed (with
    the verifier's mask, which turns a row's rejected drafts into holes), crops the others and
    queues the columns not computed yet (d_K when all K were accepted, or the prompt after
    ``reset``); they run together with the next anchor. At temperature 0, or with
    ``deterministic=True``, drafts are greedy and q is None; otherwise d_k is sampled from the warped
    distribution q_k, which is returned.
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, num_draft_tokens: int, deterministic: bool = False):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.num_draft_tokens = int(num_draft_tokens)
        self.deterministic = deterministic
        self.vocab_size = output_vocab_size(model)
        self._max_position = max_positions(model)
        self._cache_key = cache_argument(model)  # the keyword under which model.forward takes the cache
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        device = next(self.model.parameters()).device
        self._cache = new_kv_cache(self.model)
        self._mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, C) cached columns
        self._pending_ids = self._mask.clone()  # (B, P) committed-or-hole columns not run yet
        self._pending_mask = self._mask.clone()  # (B, P)
        self._pending_pos = self._mask.clone()  # (B, P)
        self._num_fed = 0  # trailing cached columns [anchor, d_1, ...] written by draft(), unconfirmed

    def extend(self, input_ids, attention_mask, position_ids, hidden_states=None) -> None:
        keep = min(self._num_fed, input_ids.shape[1])
        if self._num_fed > keep:
            self._cache.crop(keep - self._num_fed)
        confirmed = self._mask[:, : self._mask.shape[1] - self._num_fed]
        self._mask = torch.cat([confirmed, attention_mask[:, :keep]], dim=1)
        self._pending_ids = torch.cat([self._pending_ids, input_ids[:, keep:]], dim=1)
        self._pending_mask = torch.cat([self._pending_mask, attention_mask[:, keep:]], dim=1)
        self._pending_pos = torch.cat([self._pending_pos, position_ids[:, keep:]], dim=1)
        self._num_fed = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self._cache.batch_select_indices(rows)
        self._mask = self._mask[rows]
        self._pending_ids = self._pending_ids[rows]
        self._pending_mask = self._pending_mask[rows]
        self._pending_pos = self._pending_pos[rows]

    def _forward(self, input_ids, positions, new_mask) -> torch.Tensor:  # (B, n) x3 -> (B, V)
        """Run n new columns through the assistant, appending them to its cache and mask."""
        if self._max_position is not None:
            positions = positions.clamp(max=self._max_position - 1)  # only slots past the cap get here
        self._mask = torch.cat([self._mask, new_mask], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=self._mask,
            position_ids=positions.clamp_min(0),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_key: self._cache},
        )
        return out.logits[:, -1]

    def draft(self, anchor_ids, anchor_position_ids, *, temperature=0.0, top_k=None, top_p=None, generator=None):
        greedy = temperature == 0 or self.deterministic
        ones = torch.ones_like(anchor_ids).unsqueeze(1)  # (B, 1)
        logits = self._forward(
            torch.cat([self._pending_ids, anchor_ids.unsqueeze(1)], dim=1),
            torch.cat([self._pending_pos, anchor_position_ids.unsqueeze(1)], dim=1),
            torch.cat([self._pending_mask, ones], dim=1),
        )
        self._pending_ids = self._pending_mask = self._pending_pos = self._pending_ids[:, :0]
        self._num_fed = 1
        tokens, probs = [], []
        for k in range(1, self.num_draft_tokens + 1):
            if greedy:
                token = logits.argmax(dim=-1)  # (B,)
            else:
                q_k = warp_probs(logits, temperature, top_k, top_p)  # (B, V)
                token = sample_tokens(q_k, generator)
                probs.append(q_k)
            tokens.append(token)
            if k < self.num_draft_tokens:
                logits = self._forward(token.unsqueeze(1), (anchor_position_ids + k).unsqueeze(1), ones)
                self._num_fed += 1
        return torch.stack(tokens, dim=1), (None if greedy else torch.stack(probs, dim=1))


def truncated_copy(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A copy of a Hugging Face causal LM keeping only its first ``num_layers`` decoder layers.

    Embeddings, final norm and LM head are copied too, so the copy is a cheap early-exit assistant
    that agrees with the full model more often than an unrelated model would.
    """
    config = copy.deepcopy(model.config)
    total = config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total} (the model's layer count), got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    weight = next(model.parameters())
    small = type(model)(config).to(device=weight.device, dtype=weight.dtype)
    missing, _ = small.load_state_dict(model.state_dict(), strict=False)
    if missing:
        raise ValueError(f"truncated copy could not be filled from the model; missing weights: {missing[:5]}")
    return small.eval()
