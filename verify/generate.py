"""Batched speculative decoding with exact verification, and target-only decoding with the same code.

Both run one decoding loop (:func:`_decode`) over the column layout documented in
:mod:`verify.drafter`: a left-padded prompt x_1..x_t is prefilled without its last token x_t (the
anchor); each step the target runs ``[anchor, d_1..d_K]`` against its KV cache, :func:`verify_block`
keeps a prefix per row, the cache is cropped to the columns still needed (rows that kept fewer
drafts than the batch maximum keep masked holes) and the row's new anchor is the correction or
bonus token. Target-only decoding is the same loop with K = 0. Rows leave the batch once they hit
EOS or ``max_new_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verify.drafter import Drafter, max_positions, new_kv_cache, output_vocab_size
from verify.metrics import summarize
from verify.rejection import verify_block, verify_greedy, warp_probs


@dataclass
class TargetOutput:
    """Result of :func:`target_generate`."""

    sequences: torch.Tensor  # (B, T + max_b len(new_tokens[b])) prompt, new tokens, then pad
    new_tokens: list[list[int]]  # kept new tokens per row (EOS included when hit)
    num_new_tokens: int
    num_target_forwards: int  # summed over rows, after prefill
    wall_time: float  # seconds, prefill included

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / max(self.wall_time, 1e-9)


@dataclass
class SpeculativeOutput(TargetOutput):
    """Result of :func:`speculative_generate`; metrics follow DESIGN.md §4 (see verify.metrics)."""

    accepted_counts: list[list[int]] = field(default_factory=list)  # kept drafts, per row per step
    target_forwards_per_row: list[int] = field(default_factory=list)  # verification steps per row
    num_batched_forwards: int = 0  # target forward calls after prefill (the batch's step count)
    tau: float = 0.0  # micro: all kept new tokens / all verification steps
    tau_macro: float = 0.0
    accept_histogram: list[int] = field(default_factory=list)  # steps that kept 0..K drafts
    position_acceptance: list[float | None] = field(default_factory=list)  # a_1..a_K
    metrics: dict = field(default_factory=dict)  # verify.metrics.summarize(...)


@dataclass
class _Decoded:
    new_tokens: list[list[int]]
    accepted_counts: list[list[int]]
    num_batched_forwards: int
    wall_time: float


def _eos_tensor(eos_token_id, device) -> torch.Tensor:
    if eos_token_id is None:
        ids = []
    elif isinstance(eos_token_id, int):
        ids = [eos_token_id]
    else:
        ids = [int(i) for i in eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _check_inputs(target, input_ids, attention_mask, max_new_tokens, vocab_size) -> torch.Tensor:
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (B, T) tensor, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
        )
    attention_mask = attention_mask.long()
    lengths = attention_mask.sum(dim=1)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt: rows {torch.nonzero(lengths == 0).flatten().tolist()} have no tokens")
    if (attention_mask[:, -1] == 0).any() or (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError("attention_mask must be left-padded (zeros, then ones) and end in a token on every row")
    tokens = input_ids[attention_mask.bool()]
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the target's vocabulary)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions(target)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the target's "
            f"max_position_embeddings ({limit})"
        )
    return attention_mask


def _pad_id(target, pad_token_id, eos: torch.Tensor) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    for config in (getattr(target, "generation_config", None), target.config):
        value = getattr(config, "pad_token_id", None) if config is not None else None
        if value is not None:
            return int(value)
    return int(eos[0]) if eos.numel() else 0


class _NoClock:
    """The default step clock: records nothing."""

    def lap(self, name: str) -> None:
        pass

    def next_step(self) -> None:
        pass


@torch.inference_mode()
def _decode(
    target, drafter, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator,
    clock=None,
) -> _Decoded:
    start = time.perf_counter()
    clock = clock if clock is not None else _NoClock()
    batch_size, prompt_len = input_ids.shape
    device = input_ids.device
    num_drafts = drafter.num_draft_tokens if drafter is not None else 0
    layer_ids = tuple(drafter.target_layer_ids) if drafter is not None else ()
    want_hidden = len(layer_ids) > 0
    position_limit = max_positions(target)

    def run_target(ids, mask, positions, **kwargs):  # (B, n), (B, C + n), (B, n)
        if position_limit is not None:
            positions = positions.clamp(max=position_limit - 1)  # only slots beyond a row's cap
        out = target(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=want_hidden,
            **kwargs,
        )
        hidden = tuple(out.hidden_states[i] for i in layer_ids) if want_hidden else None
        return out.logits, hidden

    # Prefill x_1..x_{t-1}; x_t is every row's anchor (the prompt is left-padded).
    cache = new_kv_cache(target)
    mask = attention_mask[:, :-1]  # (B, C) the target cache's columns: 1 committed, 0 hole
    prefix_pos = (mask.cumsum(dim=1) - 1).clamp_min(0)  # (B, C)
    hidden = None
    if prompt_len > 1:
        _, hidden = run_target(input_ids[:, :-1], mask, prefix_pos, logits_to_keep=1)
    elif want_hidden:
        width = target.config.get_text_config().hidden_size
        hidden = tuple(torch.zeros(batch_size, 0, width, device=device) for _ in layer_ids)
    if drafter is not None:
        drafter.reset(batch_size)
        drafter.extend(input_ids[:, :-1], mask, prefix_pos, hidden)
    clock.lap("prefill")
    clock.next_step()

    anchor = input_ids[:, -1]  # (B,)
    anchor_pos = attention_mask.sum(dim=1) - 1  # (B,)
    rows = list(range(batch_size))  # original index of each live row
    remaining = torch.full((batch_size,), max_new_tokens, dtype=torch.long, device=device)  # (B,)
    new_tokens: list[list[int]] = [[] for _ in range(batch_size)]
    accepted_counts: list[list[int]] = [[] for _ in range(batch_size)]
    num_forwards = 0
    while rows:
        live = len(rows)
        if drafter is not None:
            drafts, q = drafter.draft(
                anchor, anchor_pos, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            if drafts.shape != (live, num_drafts) or (q is not None and q.shape[:2] != (live, num_drafts)):
                raise ValueError(
                    f"drafter returned tokens {tuple(drafts.shape)} / q {None if q is None else tuple(q.shape)}; "
                    f"expected ({live}, {num_drafts}) tokens and ({live}, {num_drafts}, V) q"
                )
            # No row can keep more than `remaining` tokens: verifying more drafts is wasted work.
            width = min(num_drafts, int(remaining.max()))
            drafts = drafts[:, :width].long()
            q = q[:, :width] if q is not None else None
            clock.lap("draft")
        else:
            width = 0
            drafts, q = anchor.new_zeros(live, 0), None
        slots = torch.arange(width + 1, device=device)  # (W + 1,)
        block = torch.cat([anchor.unsqueeze(1), drafts], dim=1)  # (B, W + 1) [anchor, d_1..d_W]
        block_mask = torch.cat([mask, torch.ones_like(block)], dim=1)  # (B, C + W + 1)
        logits, hidden = run_target(block, block_mask, anchor_pos.unsqueeze(1) + slots)
        num_forwards += 1
        clock.lap("target_forward")
        if temperature == 0:  # same result as verify_block on one-hot p, without sampling
            num_accepted, next_token = verify_greedy(drafts, logits)  # (B,), (B,)
        else:
            p = warp_probs(logits, temperature, top_k, top_p)  # (B, W + 1, V)
            num_accepted, next_token = verify_block(drafts, q, p, generator)  # (B,), (B,)
        clock.lap("verify")

        # Emitted tokens d_1..d_n, next; truncated at the first EOS and at the row's budget.
        emitted = torch.cat([drafts, drafts.new_zeros(live, 1)], dim=1)  # (B, W + 1)
        emitted.scatter_(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
        kept = torch.minimum(num_accepted + 1, remaining)  # (B,)
        is_eos = torch.isin(emitted, eos) & (slots <= num_accepted.unsqueeze(1))  # (B, W + 1)
        first_eos = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1), width + 1)  # (B,)
        kept = torch.minimum(kept, first_eos + 1)
        done = (kept == remaining) | (first_eos < kept)  # (B,)
        remaining = remaining - kept

        emitted_list, kept_list = emitted.tolist(), kept.tolist()
        accepted_list = torch.minimum(num_accepted, kept).tolist()
        for i, row in enumerate(rows):
            new_tokens[row].extend(emitted_list[i][: kept_list[i]])
            accepted_counts[row].append(accepted_list[i])
        clock.lap("bookkeeping")

        if bool(done.any()):
            keep_idx = torch.nonzero(~done).flatten()  # (B',)
            rows = [rows[i] for i in keep_idx.tolist()]
            if not rows:
                break
            cache.batch_select_indices(keep_idx)
            if drafter is not None:
                drafter.select_rows(keep_idx)
            mask, anchor_pos, remaining = mask[keep_idx], anchor_pos[keep_idx], remaining[keep_idx]
            block, num_accepted, next_token = block[keep_idx], num_accepted[keep_idx], next_token[keep_idx]
            hidden = tuple(h[keep_idx] for h in hidden) if hidden is not None else None
            clock.lap("select_rows")

        # Keep columns [anchor, d_1..d_n], n = the largest accepted count among live rows.
        n = int(num_accepted.max())
        cache.crop(n - width)
        new_mask = (slots[: n + 1] <= num_accepted.unsqueeze(1)).long()  # (B, n + 1)
        new_pos = anchor_pos.unsqueeze(1) + slots[: n + 1]  # (B, n + 1)
        clock.lap("crop")
        if drafter is not None:
            hidden = tuple(h[:, : n + 1] for h in hidden) if hidden is not None else None
            drafter.extend(block[:, : n + 1], new_mask, new_pos, hidden)
            clock.lap("drafter_extend")
        mask = torch.cat([mask, new_mask], dim=1)
        anchor = next_token
        anchor_pos = anchor_pos + num_accepted + 1
        clock.lap("bookkeeping")
        clock.next_step()
    return _Decoded(new_tokens, accepted_counts, num_forwards, time.perf_counter() - start)


def _sequences(input_ids, new_tokens, pad_id) -> torch.Tensor:  # (B, T + max new)
    width = max(len(t) for t in new_tokens)
    padded = [tokens + [pad_id] * (width - len(tokens)) for tokens in new_tokens]
    return torch.cat([input_ids, torch.tensor(padded, dtype=torch.long, device=input_ids.device)], dim=1)


def speculative_generate(
    target,
    drafter: Drafter,
    input_ids: torch.Tensor,  # (B, T) long, left-padded
    *,
    attention_mask: torch.Tensor | None = None,  # (B, T), 1 = token, 0 = left padding
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
) -> SpeculativeOutput:
    """Speculative decoding of a Hugging Face causal LM ``target`` with any :class:`Drafter`.

    Output sequences are distributed exactly as the target's own under the same warping
    (temperature, top-k, top-p); at temperature 0 they equal its greedy decoding. A row stops after
    ``max_new_tokens`` new tokens or at the first token in ``eos_token_id`` (kept; None = never).
    ``sequences`` is the prompt followed by each row's new tokens, padded with ``pad_token_id``
    (default: the target's pad id, else the first EOS id, else 0) to the longest row.
    """
    num_drafts = getattr(drafter, "num_draft_tokens", 0)
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"drafter.num_draft_tokens (K) must be an int >= 1, got {num_drafts!r}")
    target_vocab = output_vocab_size(target)
    if drafter.vocab_size != target_vocab:
        raise ValueError(
            f"vocabulary mismatch: drafter.vocab_size is {drafter.vocab_size} but the target outputs "
            f"{target_vocab} tokens"
        )
    attention_mask = _check_inputs(target, input_ids, attention_mask, max_new_tokens, target_vocab)
    eos = _eos_tensor(eos_token_id, input_ids.device)
    decoded = _decode(
        target, drafter, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator
    )
    steps = [len(c) for c in decoded.accepted_counts]
    metrics = summarize(decoded.accepted_counts, decoded.new_tokens, steps, num_drafts)
    return SpeculativeOutput(
        sequences=_sequences(input_ids, decoded.new_tokens, _pad_id(target, pad_token_id, eos)),
        new_tokens=decoded.new_tokens,
        num_new_tokens=metrics["new_tokens"],
        num_target_forwards=metrics["target_forwards"],
        wall_time=decoded.wall_time,
        accepted_counts=decoded.accepted_counts,
        target_forwards_per_row=steps,
        num_batched_forwards=decoded.num_batched_forwards,
        tau=metrics["tau"],
        tau_macro=metrics["tau_macro"],
        accept_histogram=metrics["accept_hist"],
        position_acceptance=metrics["position_acceptance"],
        metrics=metrics,
    )


def target_generate(
    target,
    input_ids: torch.Tensor,  # (B, T) long, left-padded
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
) -> TargetOutput:
    """Target-only decoding (one token per forward) with the same KV-cache code: the speed baseline."""
    target_vocab = output_vocab_size(target)
    attention_mask = _check_inputs(target, input_ids, attention_mask, max_new_tokens, target_vocab)
    eos = _eos_tensor(eos_token_id, input_ids.device)
    decoded = _decode(
        target, None, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator
    )
    return TargetOutput(
        sequences=_sequences(input_ids, decoded.new_tokens, _pad_id(target, pad_token_id, eos)),
        new_tokens=decoded.new_tokens,
        num_new_tokens=sum(len(t) for t in decoded.new_tokens),
        num_target_forwards=sum(len(c) for c in decoded.accepted_counts),
        wall_time=decoded.wall_time,
    )
