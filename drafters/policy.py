"""Decoding policy for block drafters: what a step verifies, decided outside the model.

:class:`DraftingPolicy` holds the settings (the way transformers keeps ``num_assistant_tokens`` and the
assistant's confidence threshold in ``GenerationConfig``), validated against a drafter in one place
(:meth:`DraftingPolicy.check`); :class:`PolicyDrafter` wraps a block drafter with them and is what the
verifier drives (:class:`verify.drafter.Drafter` protocol). Every setting is exact: what a step drafts and
how wide it is are fixed from the drafter's distributions and the lookup hints before anything is sampled
or the target runs, and a copied hint is proposed with one-hot q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from drafters.model import Block, propose
from verify.rejection import sample_tokens, warp_probs


@dataclass(frozen=True)
class DraftingPolicy:
    """Decoding settings of a block drafter (None: off)."""

    #: Verify at most this many drafted slots per step, the first W of the K, in every row (copied hints
    #: included); the cut comes before the confidence cut. A CPU pays per verified token.
    max_draft_tokens: int | None = None
    #: The drafter's layers compute only slots 1..W' (a block of W' + 1 columns). Where some row copies its hint
    #: the step still verifies that hint's whole block (every other row proposes its own hint tokens past W');
    #: where none does, the step verifies W' slots.
    own_draft_tokens: int | None = None
    #: Draft only the prefix of slots whose top-1 drafter probability is at least this, the same number of
    #: slots for every row (the longest row's).
    confidence_threshold: float | None = None
    #: Hinted drafters: draft the lookup hint's whole block in rows where an n-gram matched and the drafter's
    #: argmax agrees with the hint on the first m slots (m = 0: wherever one matched).
    follow_hint_after: int | None = None
    #: With follow_hint_after: copy only hints whose n-gram match is at least this long.
    follow_hint_min_ngram: int = 1
    #: With follow_hint_after = 0: run the drafter's layers only in steps where at least this many rows draft
    #: themselves; in the other steps every row copies its hint however short (a row with none proposes MASK).
    min_drafting_rows: int | None = None
    #: Read the context keys/values from the target's KV cache where they are the same numbers
    #: (:mod:`drafters.shared_cache`); False: the drafter always keeps its own.
    share_target_cache: bool = True

    def check(self, drafter) -> None:
        """Refuse settings ``drafter`` cannot take, naming the key (``drafter.<key>``, as evaluation configs spell it)."""
        k, m = drafter.num_draft_tokens, self.follow_hint_after
        hints = getattr(drafter, "variants", {}).get("hints")
        if self.confidence_threshold is not None and not 0.0 < self.confidence_threshold < 1.0:
            raise ValueError(f"drafter.confidence_threshold={self.confidence_threshold}: must be in (0, 1) or null")
        if m is not None and (m < 0 or hints is None):
            raise ValueError(f"drafter.follow_hint_after={m}: needs m >= 0 and a drafter trained with lookup hints "
                             f"(drafter=hinted; this one has variants {list(getattr(drafter, 'variant_names', ()))})")
        if self.follow_hint_min_ngram != 1 and m is None:
            raise ValueError(f"drafter.follow_hint_min_ngram={self.follow_hint_min_ngram} needs drafter.follow_hint_after "
                             "(it only narrows where the hint is copied)")
        top = hints.max_ngram if hints is not None else 1
        if not 1 <= self.follow_hint_min_ngram <= top:
            raise ValueError(f"drafter.follow_hint_min_ngram={self.follow_hint_min_ngram}: must be in 1..{top} "
                             "(the drafter's lookup_max_ngram)")
        if self.max_draft_tokens is not None and not max(1, m or 0) <= self.max_draft_tokens <= k:
            raise ValueError(f"drafter.max_draft_tokens={self.max_draft_tokens}: must be in {max(1, m or 0)}..{k} "
                             "(K of the drafter; at least drafter.follow_hint_after) or null")
        if self.own_draft_tokens is not None and not 1 <= self.own_draft_tokens <= k:
            raise ValueError(f"drafter.own_draft_tokens={self.own_draft_tokens}: must be in 1..{k} (K of the drafter) "
                             "or null")
        if self.min_drafting_rows is not None and (self.min_drafting_rows < 1 or m != 0):
            raise ValueError(f"drafter.min_drafting_rows={self.min_drafting_rows}: must be >= 1 and needs "
                             f"drafter.follow_hint_after=0 (got {m}), or null")


def confident_width(logits: torch.Tensor, threshold: float) -> int:
    """Slots (from slot 1) that every row's drafts need: the longest leading run over rows of slots whose top-1
    probability is at least ``threshold``. logits: (B, K, V)."""
    top1 = (logits.amax(-1) - logits.logsumexp(-1)).exp()  # (B, K)
    leading = (top1 >= threshold).long().cumprod(-1).sum(-1)  # (B,)
    return int(leading.max()) if leading.numel() else 0


class PolicyDrafter:
    """A block drafter drafting under a :class:`DraftingPolicy` (checked here); other attributes are the
    wrapped drafter's (``policy_drafter.config``, ``.parameters()``, ...)."""

    def __init__(self, drafter: nn.Module, policy: DraftingPolicy | None = None,
                 draft_vocab: torch.Tensor | None = None) -> None:
        self.drafter, self.policy = drafter, policy or DraftingPolicy()
        self.policy.check(drafter)
        #: (V',) long: the token ids drafted from (the LM head's matmul over these columns only), None: all.
        self.draft_vocab = draft_vocab
        #: Recent mean confident width: the confidence cut's first LM-head chunk covers it plus one slot.
        self.width_mean = 2.0
        self._sources: list[str] | None = None
        self._rows: tuple[tuple, torch.Tensor] | None = None  # the head's rows of draft_vocab, and what they came from

    def __getattr__(self, name: str) -> Any:
        if name in ("drafter", "policy", "draft_vocab", "_rows"):  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def reset(self, batch_size: int) -> None:
        self.drafter.reset(batch_size)

    def bind_target_cache(self, cache) -> None:
        if self.policy.share_target_cache:
            self.drafter.bind_target_cache(cache)

    def extend(self, input_ids, attention_mask, position_ids, hidden_states) -> None:
        self.drafter.extend(input_ids, attention_mask, position_ids, hidden_states)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.drafter.select_rows(rows)

    def draft_sources(self) -> list[str] | None:
        return self._sources

    def head(self, states: torch.Tensor) -> torch.Tensor:
        """The drafter's logits (..., V) of ``states`` (..., H). With :attr:`draft_vocab` (FR-Spec's lever), the LM
        head's matmul covers those V' columns only and the others hold the dtype's lowest finite value (the
        verifier refuses infinite logits): q is exactly 0 there, so drafts come from the candidates, still exact."""
        part, vocab = self.candidate_logits(states)  # (..., V')
        if vocab is None:
            return part
        logits = part.new_full((*part.shape[:-1], self.drafter.vocab_size), torch.finfo(part.dtype).min)
        logits[..., vocab] = part
        return logits

    def candidate_logits(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's logits over its candidates only (..., V') and their token ids (V',) long: with
        :attr:`draft_vocab`, those V' columns of :meth:`head`; without, the whole vocabulary and None."""
        if self.draft_vocab is None:
            return self.drafter.head(states), None
        return self.drafter.head(states, self.draft_vocab, self._candidate_rows()), self.draft_vocab

    @torch.no_grad()
    def _candidate_rows(self) -> torch.Tensor:
        """The LM head's weight rows of :attr:`draft_vocab` (V', H), gathered once and again only when the weight is
        another tensor (moved, cast, re-laid) or was written in place."""
        weight = self.drafter.target.get_output_embeddings().weight
        key = (weight.data_ptr(), weight.dtype, weight.device, weight._version)
        if self._rows is None or self._rows[0] != key:
            self._rows = (key, weight[self.draft_vocab.to(weight.device)].contiguous())
        return self._rows[1]

    @torch.no_grad()
    def draft(self, anchor_ids, anchor_position_ids, *, temperature: float = 0.0, top_k=None, top_p=None,
              generator=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, W) and, when sampling, q (B, W, V): W = K or ``max_draft_tokens``; with ``own_draft_tokens``
        W' < W, the drafter's W' slots unless some row copies its hint (then every other row proposes its hint
        tokens past its W' slots); with ``confidence_threshold``, the confident width within those (all W when
        some row copies its hint)."""
        d, p = self.drafter, self.policy
        width = d.num_draft_tokens if p.max_draft_tokens is None else p.max_draft_tokens
        own_width = width if p.own_draft_tokens is None else min(width, p.own_draft_tokens)
        block = d.block_inputs(anchor_ids, anchor_position_ids, None if p.own_draft_tokens is None else own_width)
        follow = self._copied_rows(block) if p.follow_hint_after == 0 else None  # (B,) bool: rows that copy
        if follow is not None and bool(follow.any()):
            # Known before any pass: the drafter runs on the other rows only; the copied rows' logits are
            # placeholders, replaced by their hints in _propose.
            own = (~follow).nonzero().squeeze(1)  # (b,)
            logits = torch.zeros(follow.shape[0], own_width, d.config.vocab_size, device=follow.device)
            if own.numel():
                logits[own] = self.head(d.block_states(block, own)[:, :own_width])
        else:
            logits, follow = self._own_logits(block, own_width)
        copies = follow is not None and bool(follow.any())
        self._sources = d.source_labels(block, follow)
        return self._propose(block, logits, follow, copies, width, temperature, top_k, top_p, generator)

    def _own_logits(self, block: Block, own_width: int):
        """``(logits (B, W'', V), follow (B,) bool or None)`` where no row copies its hint before a pass."""
        d, p = self.drafter, self.policy
        states = d.block_states(block)[:, :own_width]  # (B, W', H)
        logits = self.head(states) if p.confidence_threshold is None else None  # (B, W', V)
        follow = None
        if p.follow_hint_after is not None:  # the head on the first m slots only, unless it ran on all
            follow = self._follows_hint(block, logits if logits is not None else self.head(states[:, : p.follow_hint_after]))
        if logits is None:  # a copied hint is drafted whole (its W slots); otherwise the confident prefix
            logits = self.head(states) if follow is not None and bool(follow.any()) else self.confident_logits(states)
        return logits, follow

    def _hint_rows(self, block: Block) -> torch.Tensor:
        """(B,) bool: rows whose hint rests on an n-gram of at least ``follow_hint_min_ngram`` tokens."""
        return block.hints[1] >= max(1, self.policy.follow_hint_min_ngram)

    def _copied_rows(self, block: Block) -> torch.Tensor:
        """(B,) bool under ``follow_hint_after = 0``: the hint rows, or every row where fewer than
        ``min_drafting_rows`` would draft."""
        follow = self._hint_rows(block)
        least = self.policy.min_drafting_rows
        if least is not None and int((~follow).sum()) < least:
            return torch.ones_like(follow)
        return follow

    def _follows_hint(self, block: Block, logits: torch.Tensor) -> torch.Tensor:
        """(B,) bool: rows whose block is the lookup hint under ``follow_hint_after`` (logits (B, >= m, V))."""
        hints, m = block.hints[0], self.policy.follow_hint_after
        return self._hint_rows(block) & (logits[:, :m].argmax(-1) == hints[:, :m]).all(-1)

    def confident_logits(self, states: torch.Tensor) -> torch.Tensor:
        """``logits[:, :w]`` for ``logits = head(states)`` (B, K', H), w the longest leading run over rows of
        slots with top-1 probability >= the threshold; the LM head runs slot chunk by slot chunk until every row
        has met a slot below it (the first chunk: the recent mean width plus one slot; each next twice as long)."""
        rows, num_slots, _ = states.shape
        threshold = self.policy.confidence_threshold
        leading = torch.zeros(rows, dtype=torch.long, device=states.device)  # confident slots so far
        parts, start = [], 0
        size = max(1, math.ceil(self.width_mean) + 1)
        while start < num_slots:
            end = min(num_slots, start + size)
            logits = self.head(states[:, start:end])  # (B, n, V)
            top1 = (logits.amax(-1) - logits.logsumexp(-1)).exp()  # (B, n)
            run = (top1 >= threshold).long().cumprod(-1).sum(-1)  # (B,)
            leading = torch.where(leading == start, start + run, leading)
            parts.append(logits)
            if not bool((leading == end).any()):
                break
            start, size = end, 2 * size
        width = int(leading.max()) if rows else 0
        self.width_mean = 0.7 * self.width_mean + 0.3 * width
        return torch.cat(parts, dim=1)[:, :width]

    @staticmethod
    def _propose(block: Block, logits, follow, copies: bool, width: int, temperature, top_k, top_p, generator):
        """Tokens (B, W) and q (B, W, V) or None from the drafter's logits (B, W', V) and the rows that copy
        their hint (``follow``). Where a row copies, the step drafts W slots: copied rows their hint (one-hot
        q), the others their W' slots and then their hint tokens (one-hot q); else the drafter's W' slots."""
        if follow is None:
            return propose(logits, temperature, top_k, top_p, generator)
        out_width = width if copies else logits.shape[1]
        hints = block.hints[0][:, :out_width]  # (B, W)
        past = hints[:, logits.shape[1]:] if copies else None  # (B, W - W') the other rows' hints past their slots
        if temperature == 0:
            tokens = logits.argmax(-1)
            if past is not None:
                tokens = torch.cat([tokens, past], dim=1)
            return torch.where(follow[:, None], hints, tokens), None
        q = warp_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # (B, W', V) float32
        if past is not None:  # proposed as they are: one-hot q, so the hint token is the draw
            q = torch.cat([q, nn.functional.one_hot(past, q.shape[-1]).to(q.dtype)], dim=1)
        q = torch.where(follow[:, None, None], nn.functional.one_hot(hints, q.shape[-1]).to(q.dtype), q)
        return sample_tokens(q, generator), q  # (B, W): slot k drawn from q[:, k]
