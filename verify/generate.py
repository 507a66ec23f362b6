"""Batched speculative decoding with exact verification, and target-only decoding with the same code.

Both run one decoding loop (:func:`_decode`) over the column layout documented in
:mod:`verify.drafter` (the target's forward and the cache bookkeeping between steps:
:mod:`verify.target_pass`): a left-padded prompt x_1..x_t is prefilled without its last token x_t (the
anchor); each step the target runs ``[anchor, d_1..d_K]`` against its KV cache, :func:`verify_block`
keeps a prefix per row, the cache is cropped to the columns still needed (rows that kept fewer
drafts than the batch maximum keep masked holes) and the row's new anchor is the correction or
bonus token. Target-only decoding is the same loop with K = 0. Rows leave the batch once they hit
EOS or ``max_new_tokens``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from verify.drafter import Drafter
from verify.hf import output_vocab_size
from verify.inputs import check_inputs, eos_tensor, resolve_pad_id
from verify.metrics import summarize
from verify.rejection import verify_block, verify_greedy, warp_probs
from verify.target_pass import (
    Live,
    NoClock,
    Step,
    TargetPass,
    advance,
    drop_finished,
    head_logits,
    is_plain_head,
    keep_columns,
    prefill,
    reads_head_once,
    verify_greedy_lazy,
)
from verify.tree import DraftTree, TreeDrafter, ancestor_mask, check_tree, walk_tree

# The earlier private names of what moved to verify.inputs and verify.target_pass (tests and benchmarks use them).
_check_inputs, _eos_tensor, _is_plain_head = check_inputs, eos_tensor, is_plain_head


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
    """Result of :func:`speculative_generate`; metrics follow docs/method.md §4 (see verify.metrics)."""

    accepted_counts: list[list[int]] = field(default_factory=list)  # kept drafts, per row per step
    # What drafted each of those steps (the drafter's draft_sources(); empty lists when it has none).
    draft_sources: list[list[str]] = field(default_factory=list)
    target_forwards_per_row: list[int] = field(default_factory=list)  # verification steps per row
    num_batched_forwards: int = 0  # target forward calls after prefill (the batch's step count)
    num_verified_slots: int = 0  # drafts verified per row, summed over those calls (W of each step)
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
    num_verified_slots: int = 0
    draft_sources: list[list[str]] = field(default_factory=list)  # per row per step, when the drafter labels


def _draft(drafter, live: Live, num_drafts: int, temperature, top_k, top_p, generator):
    """``(drafts (B, W) long, q (B, W, V) or None)``: the drafter's proposal, cut to what a row can
    still keep; (B, 0) and None without a drafter."""
    rows = len(live.rows)
    if drafter is None:
        return live.anchor.new_zeros(rows, 0), None
    drafts, q = drafter.draft(
        live.anchor, live.anchor_pos, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )
    # A drafter may return fewer than K drafts (the same number for every row), e.g. when it
    # is unsure of the later ones: verifying a prefix of the drafts is still exact.
    if (drafts.ndim != 2 or drafts.shape[0] != rows or drafts.shape[1] > num_drafts
            or (q is not None and q.shape[:2] != drafts.shape)):
        raise ValueError(
            f"drafter returned tokens {tuple(drafts.shape)} / q {None if q is None else tuple(q.shape)}; "
            f"expected ({rows}, <= {num_drafts}) tokens and the same leading shape for q (B, K, V)"
        )
    # No row can keep more than `remaining` tokens: verifying more drafts is wasted work.
    width = min(drafts.shape[1], max(live.remaining_list))
    return drafts[:, :width].long(), (q[:, :width] if q is not None else None)


def _record_sources(drafter, rows: list[int], out: _Decoded) -> None:
    """Append the label of each live row's draft (``drafter.draft_sources()``, when it has one) to ``out``."""
    labels = drafter.draft_sources() if hasattr(drafter, "draft_sources") else None
    if labels is None:
        return
    if len(labels) != len(rows):
        raise ValueError(f"drafter.draft_sources() gave {len(labels)} labels for {len(rows)} rows")
    for row, label in zip(rows, labels):
        out.draft_sources[row].append(str(label))


def _verify(run: TargetPass, live: Live, drafts, q, slots, temperature, top_k, top_p, generator,
            clock) -> Step:
    """The target's forward over ``[anchor, d_1..d_W]`` and the kept prefix of every row."""
    width = drafts.shape[1]
    block = torch.cat([live.anchor.unsqueeze(1), drafts], dim=1)  # (B, W + 1) [anchor, d_1..d_W]
    block_mask = torch.cat([live.mask, torch.ones_like(block)], dim=1)  # (B, C + W + 1)
    positions = live.anchor_pos.unsqueeze(1) + slots  # (B, W + 1)
    if run.lazy:
        _, live.hidden, final = run(block, block_mask, positions, logits_to_keep=run.no_logits)
    else:
        logits, live.hidden, _ = run(block, block_mask, positions)
    clock.lap("target_forward")
    if run.lazy and temperature != 0:
        logits = head_logits(run.head, final)  # (B, W + 1, V)
    if run.lazy and temperature == 0:
        first = width + 1 if reads_head_once(run.head) else min(width + 1, 2 + math.ceil(live.accepted_mean))
        num_accepted, next_token = verify_greedy_lazy(drafts, final, run.head, first)  # (B,), (B,)
    elif temperature == 0:  # same result as verify_block on one-hot p, without sampling
        num_accepted, next_token = verify_greedy(drafts, logits)  # (B,), (B,)
    else:
        p = warp_probs(logits, temperature, top_k, top_p)  # (B, W + 1, V)
        num_accepted, next_token = verify_block(drafts, q, p, generator)  # (B,), (B,)
    clock.lap("verify")
    return Step(block, slots, num_accepted, next_token)


def _draft_tree(drafter, live: Live, temperature, top_k, top_p, generator) -> tuple[DraftTree, torch.Tensor]:
    """The drafter's trees (checked), without the nodes deeper than any row can still keep, and their depths
    (B, N + 1) (:func:`verify.tree.node_depths`, computed once per step)."""
    tree = drafter.draft_tree(live.anchor, live.anchor_pos, temperature=temperature, top_k=top_k, top_p=top_p,
                              generator=generator)
    if tree.tokens.shape[0] != len(live.rows):
        raise ValueError(f"drafter.draft_tree returned {tree.tokens.shape[0]} trees for {len(live.rows)} rows")
    depths = check_tree(tree, drafter.num_draft_tokens)  # (B, N + 1)
    valid = tree.valid & (depths[:, 1:] <= max(live.remaining_list))
    used = int(valid.any(dim=0).nonzero().max()) + 1 if bool(valid.any()) else 0  # trailing padding dropped
    return DraftTree(tree.tokens[:, :used], tree.parents[:, :used], valid[:, :used]), depths[:, : used + 1]


def _tree_mask(live: Live, tree: DraftTree, dtype: torch.dtype) -> torch.Tensor:  # (B, 1, N + 1, C + N + 1)
    """The additive attention mask of a tree step: each column sees the committed context and its ancestors."""
    tree_part = ancestor_mask(tree)  # (B, N + 1, N + 1)
    context = live.mask.bool().unsqueeze(1).expand(-1, tree_part.shape[1], -1)  # (B, N + 1, C)
    seen = torch.cat([context, tree_part], dim=2)
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)[:, None]


def _verify_tree(run: TargetPass, live: Live, tree: DraftTree, depths, temperature, top_k, top_p, generator,
                 clock) -> Step:
    """The target's forward over ``[anchor, node_1..node_N]`` with an ancestor-only mask, the exact walk
    (:func:`verify.tree.walk_tree`), and the cache, hidden states and block cut to each row's accepted path: the
    returned step reads as a chain step of width max(accepted)."""
    block = torch.cat([live.anchor.unsqueeze(1), tree.tokens], dim=1)  # (B, N + 1)
    positions = live.anchor_pos.unsqueeze(1) + depths  # (B, N + 1)
    dtype = run.target.get_input_embeddings().weight.dtype
    mask = _tree_mask(live, tree, dtype if dtype.is_floating_point else torch.float32)
    if run.lazy:
        _, hidden, final = run(block, mask, positions, logits_to_keep=run.no_logits)
        logits = head_logits(run.head, final)  # (B, N + 1, V)
    else:
        logits, hidden, _ = run(block, mask, positions)
    clock.lap("target_forward")
    num_accepted, next_token, path = walk_tree(tree, logits, temperature, top_k, top_p, generator, depths)
    path = path[:, : int(num_accepted.max()) + 1]  # (B, n + 1) columns: root, then the accepted nodes
    keep_columns(run.cache, live.mask.shape[1], path)
    if hidden is not None:
        live.hidden = tuple(h.gather(1, path.unsqueeze(-1).expand(-1, -1, h.shape[-1])) for h in hidden)
    clock.lap("verify")
    slots = torch.arange(path.shape[1], device=block.device)
    return Step(block.gather(1, path), slots, num_accepted, next_token)


def _emit(live: Live, step: Step, eos: torch.Tensor, out: _Decoded) -> tuple[list[int], list[int]]:
    """Append each row's emitted tokens d_1..d_n, next (truncated at the first EOS and at the row's
    budget) and kept-draft count to ``out``; returns per row (done, drafts accepted)."""
    live_rows, width = step.block.shape[0], step.block.shape[1] - 1
    emitted = torch.cat([step.block[:, 1:], step.block.new_zeros(live_rows, 1)], dim=1)  # (B, W + 1)
    emitted.scatter_(1, step.num_accepted.unsqueeze(1), step.next_token.unsqueeze(1))
    kept = torch.minimum(step.num_accepted + 1, live.remaining)  # (B,)
    if eos.numel() > 0:
        is_eos = torch.isin(emitted, eos) & (step.slots <= step.num_accepted.unsqueeze(1))  # (B, W + 1)
        first_eos = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1), width + 1)  # (B,)
        kept = torch.minimum(kept, first_eos + 1)
        done = (kept == live.remaining) | (first_eos < kept)  # (B,)
    else:
        done = kept == live.remaining
    live.remaining = live.remaining - kept
    # One transfer to the host per step: kept, kept drafts, done, accepted drafts per row.
    kept_list, counted_list, done_list, accepted_list = torch.stack(
        [kept, torch.minimum(step.num_accepted, kept), done.long(), step.num_accepted]
    ).tolist()
    emitted_list = emitted.tolist()
    for i, row in enumerate(live.rows):
        out.new_tokens[row].extend(emitted_list[i][: kept_list[i]])
        out.accepted_counts[row].append(counted_list[i])
    live.accepted_mean = 0.7 * live.accepted_mean + 0.3 * sum(accepted_list) / live_rows
    live.remaining_list = [r - k for r, k in zip(live.remaining_list, kept_list)]
    return done_list, accepted_list


@torch.inference_mode()
def _decode(
    target, drafter, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator,
    clock=None, lazy_head: bool | None = None,
) -> _Decoded:
    """The decoding loop: prefill, then draft, verify, emit, drop finished rows, advance (see the
    module docstring). ``lazy_head`` (default: on CPU) lets the verifier apply the LM head."""
    start = time.perf_counter()
    clock = clock if clock is not None else NoClock()
    clock.start()
    batch_size, prompt_len = input_ids.shape
    num_drafts = drafter.num_draft_tokens if drafter is not None else 0
    lazy = input_ids.device.type == "cpu" if lazy_head is None else bool(lazy_head)
    lazy = lazy and drafter is not None and prompt_len > 1
    run = TargetPass(target, drafter, max_new_tokens + num_drafts + 1, lazy, input_ids.device)
    live = prefill(run, drafter, input_ids, attention_mask, max_new_tokens)
    clock.lap("prefill")
    clock.next_step()
    out = _Decoded([[] for _ in range(batch_size)], [[] for _ in range(batch_size)], 0, 0.0,
                   draft_sources=[[] for _ in range(batch_size)])
    all_slots = torch.arange(num_drafts + 1, device=input_ids.device)  # (K + 1,)
    trees = isinstance(drafter, TreeDrafter)
    while live.rows:
        if trees:
            tree, depths = _draft_tree(drafter, live, temperature, top_k, top_p, generator)
            _record_sources(drafter, live.rows, out)
            clock.lap("draft")
            step = _verify_tree(run, live, tree, depths, temperature, top_k, top_p, generator, clock)
            width = tree.tokens.shape[1]
        else:
            drafts, q = _draft(drafter, live, num_drafts, temperature, top_k, top_p, generator)
            if drafter is not None:
                _record_sources(drafter, live.rows, out)
                clock.lap("draft")
            slots = all_slots[: drafts.shape[1] + 1]  # (W + 1,)
            step = _verify(run, live, drafts, q, slots, temperature, top_k, top_p, generator, clock)
            width = drafts.shape[1]
        out.num_batched_forwards += 1
        out.num_verified_slots += width
        done_list, accepted_list = _emit(live, step, eos, out)
        clock.lap("bookkeeping")
        if any(done_list):
            accepted_list = drop_finished(live, step, done_list, accepted_list, run.cache, drafter)
            if not live.rows:
                clock.next_step()
                break
            clock.lap("select_rows")
        advance(live, step, accepted_list, run.cache, drafter, clock)
        clock.next_step()
    out.wall_time = time.perf_counter() - start
    return out


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
    clock=None,
) -> SpeculativeOutput:
    """Speculative decoding of a Hugging Face causal LM ``target`` with any :class:`Drafter`.

    Output sequences are distributed exactly as the target's own under the same warping
    (temperature, top-k, top-p); at temperature 0 they equal its greedy decoding. A row stops after
    ``max_new_tokens`` new tokens or at the first token in ``eos_token_id`` (kept; None = never).
    ``sequences`` is the prompt followed by each row's new tokens, padded with ``pad_token_id``
    (default: the target's pad id, else the first EOS id, else 0) to the longest row. ``clock``: an
    optional step clock timing the parts of every step (``start()``, ``lap(name)``, ``next_step()``; e.g.
    :class:`experiments.bench.profiling.StepClock`).
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
    attention_mask = check_inputs(target, input_ids, attention_mask, max_new_tokens, target_vocab)
    eos = eos_tensor(eos_token_id, input_ids.device)
    decoded = _decode(
        target, drafter, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator, clock
    )
    steps = [len(c) for c in decoded.accepted_counts]
    metrics = summarize(decoded.accepted_counts, decoded.new_tokens, steps, num_drafts)
    return SpeculativeOutput(
        sequences=_sequences(input_ids, decoded.new_tokens, resolve_pad_id(target, pad_token_id, eos)),
        new_tokens=decoded.new_tokens,
        num_new_tokens=metrics["new_tokens"],
        num_target_forwards=metrics["target_forwards"],
        wall_time=decoded.wall_time,
        accepted_counts=decoded.accepted_counts,
        draft_sources=decoded.draft_sources,
        target_forwards_per_row=steps,
        num_batched_forwards=decoded.num_batched_forwards,
        num_verified_slots=decoded.num_verified_slots,
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
    attention_mask = check_inputs(target, input_ids, attention_mask, max_new_tokens, target_vocab)
    eos = eos_tensor(eos_token_id, input_ids.device)
    decoded = _decode(
        target, None, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, eos, generator
    )
    return TargetOutput(
        sequences=_sequences(input_ids, decoded.new_tokens, resolve_pad_id(target, pad_token_id, eos)),
        new_tokens=decoded.new_tokens,
        num_new_tokens=sum(len(t) for t in decoded.new_tokens),
        num_target_forwards=sum(len(c) for c in decoded.accepted_counts),
        wall_time=decoded.wall_time,
    )
