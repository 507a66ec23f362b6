"""The target's side of the decoding loop (:mod:`verify.generate`): its forward over new columns against the KV
cache (:class:`TargetPass`, with the LM head applied by the verifier where the logits are a plain head's), the state
of the rows still decoding (:class:`Live`, :class:`Step`), and the bookkeeping around each verification step:
:func:`prefill`, :func:`drop_finished` (finished rows leave the cache and the drafter) and :func:`advance` (the
cache cropped to the kept columns, holes masked, anchors moved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import verify.hf
from verify.hf import cache_argument, max_positions, new_growing_kv_cache
from verify.layout import OneDNNPackedLinear
from verify.rejection import verify_greedy


class NoClock:
    """The default step clock: records nothing (:mod:`experiments.bench.profiling` passes one that does)."""

    def start(self) -> None:
        pass

    def lap(self, name: str) -> None:
        pass

    def next_step(self) -> None:
        pass


def is_plain_head(head, logits: torch.Tensor, final: torch.Tensor) -> bool:
    """Whether ``logits`` (B, V) are ``final @ head.weight.T`` for final hidden states (B, H): a head without
    bias, and no logit scaling or soft-capping after it, so the verifier may apply the head's weight itself
    (:func:`verify.hf.linear_logits`)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or getattr(head, "bias", None) is not None or weight.ndim != 2:
        return False
    if weight.shape[1] != final.shape[-1]:
        return False
    mine = verify.hf.linear_logits(weight, final.to(weight.dtype)).float()
    ref = logits.float()
    if mine.shape != ref.shape:
        return False
    return bool(torch.allclose(mine, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(ref.abs().max()))))


def reads_head_once(head) -> bool:
    """Whether ``head`` multiplies several rows at about the cost of one (its weight packed,
    ``weight_layout=onednn_packed``): the lazy verifier then applies it to every position of a block at once."""
    return isinstance(head, OneDNNPackedLinear)


def head_logits(head, states: torch.Tensor) -> torch.Tensor:  # (b, L, H) -> (b, L, V)
    """The logits of a plain head (see :func:`is_plain_head`) over final hidden states, as one 2-D product: the
    head module's own where its weight is laid out for several rows (``weight_layout=onednn_packed``), else
    :func:`verify.hf.linear_logits` on its weight."""
    b, length, size = states.shape
    flat = states.reshape(b * length, size).to(head.weight.dtype)
    logits = head(flat) if reads_head_once(head) else verify.hf.linear_logits(head.weight, flat)
    return logits.view(b, length, -1)


def verify_greedy_lazy(drafts, final, head, first: int):  # (B, W), (B, W + 1, H) -> (B,), (B,)
    """:func:`verify_greedy` with the LM head (its weight, :func:`verify.hf.linear_logits`) applied only where
    the result can depend on it.

    A row that kept n drafts needs the target's argmax at block positions 0..n only. The head runs
    on positions [0, first) of every row, then, for the rows that accepted every draft so far, on
    chunks twice as long (each chunk starting at the last position of the previous one), until no
    row is still accepting. Each chunk is verified by :func:`verify_greedy`, so the result is the
    one :func:`verify_greedy` gives on the full logits.
    """
    batch, width = drafts.shape

    def logits(states):  # (b, L, H) -> (b, L, V)
        return head_logits(head, states)

    num_accepted = drafts.new_zeros(batch)
    next_token = drafts.new_zeros(batch)
    rows = None  # None = every row
    start, size = 0, max(1, first)
    while True:
        end = min(start + size, width + 1)
        if rows is None:
            n, token = verify_greedy(drafts[:, start : end - 1], logits(final[:, start:end]))
            num_accepted, next_token = n + start, token
        else:
            n, token = verify_greedy(drafts[rows, start : end - 1], logits(final[rows, start:end]))
            num_accepted[rows], next_token[rows] = n + start, token
        if end == width + 1:
            break
        still = n == end - 1 - start  # accepted every draft of the chunk: the next ones matter
        if not bool(still.any()):
            break
        rows = (torch.arange(batch, device=drafts.device) if rows is None else rows)[still]
        start, size = end - 1, 2 * size
    return num_accepted, next_token


class TargetPass:
    """The target's forward over new columns against its KV cache, returning what the loop needs.

    ``lazy``: the verifier applies the LM head's weight itself where the target's logits are plain
    head(final hidden state) (checked on the prefill's logits, see :func:`prefill`): lazily at temperature 0,
    over every column when sampling; the forward then computes no logits and returns the final hidden
    states instead. The cache is passed under the keyword the target's forward names
    (:func:`verify.hf.cache_argument`).
    """

    def __init__(self, target, drafter, reserve: int, lazy: bool, device: torch.device):
        self.target = target
        self.layer_ids = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.position_limit = max_positions(target)
        self.head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        self.lazy = lazy and self.head is not None
        self.no_logits = torch.zeros(0, dtype=torch.long, device=device)  # logits_to_keep: none
        self.cache = new_growing_kv_cache(target, reserve)
        self.cache_key = cache_argument(target)

    def __call__(self, ids, mask, positions, **kwargs):  # (B, n), (B, C + n), (B, n)
        """``(logits, hidden (the drafter's layers) or None, final hidden states or None)``."""
        if self.position_limit is not None:
            positions = positions.clamp(max=self.position_limit - 1)  # only slots beyond a row's cap
        out = self.target(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=bool(self.layer_ids) or self.lazy,
            **{self.cache_key: self.cache},
            **kwargs,
        )
        hidden = tuple(out.hidden_states[i] for i in self.layer_ids) if self.layer_ids else None
        final = out.hidden_states[-1] if self.lazy else None
        return out.logits, hidden, final


@dataclass
class Live:
    """Decoding state of the rows still in the batch, in batch order (finished rows leave it)."""

    rows: list[int]  # original index of each live row
    mask: torch.Tensor  # (B, C) the target cache's columns: 1 committed, 0 hole
    anchor: torch.Tensor  # (B,) each row's last committed token, not in the cache yet
    anchor_pos: torch.Tensor  # (B,) its position
    remaining: torch.Tensor  # (B,) new tokens each row may still emit
    remaining_list: list[int]  # the same, on the host
    hidden: tuple[torch.Tensor, ...] | None = None  # the drafter's target layers at the last block
    accepted_mean: float = 1.0  # running mean of the drafts kept per row: the lazy head's first chunk


@dataclass
class Step:
    """One verification step of the live rows."""

    block: torch.Tensor  # (B, W + 1) [anchor, d_1..d_W]
    slots: torch.Tensor  # (W + 1,) 0..W
    num_accepted: torch.Tensor  # (B,) drafts kept
    next_token: torch.Tensor  # (B,) the correction or bonus token: the row's next anchor


def prefill(run: TargetPass, drafter, input_ids, attention_mask, max_new_tokens: int) -> Live:
    """Run x_1..x_{t-1} through the target and the drafter; x_t is every row's anchor (the prompt is
    left-padded)."""
    batch_size, prompt_len = input_ids.shape
    mask = attention_mask[:, :-1]  # (B, C) the target cache's columns: 1 committed, 0 hole
    prefix_pos = (mask.cumsum(dim=1) - 1).clamp_min(0)  # (B, C)
    hidden = None
    if prompt_len > 1:
        logits, hidden, final = run(input_ids[:, :-1], mask, prefix_pos, logits_to_keep=1)
        if run.lazy:
            run.lazy = final is not None and is_plain_head(run.head, logits[:, -1], final[:, -1])
    elif run.layer_ids:
        width = run.target.config.get_text_config().hidden_size
        hidden = tuple(torch.zeros(batch_size, 0, width, device=input_ids.device) for _ in run.layer_ids)
    if drafter is not None:
        drafter.reset(batch_size)
        if hasattr(drafter, "bind_target_cache"):  # optional: a drafter that can read the target's keys/values
            drafter.bind_target_cache(run.cache)
        drafter.extend(input_ids[:, :-1], mask, prefix_pos, hidden)
    remaining = torch.full((batch_size,), max_new_tokens, dtype=torch.long, device=input_ids.device)
    return Live(list(range(batch_size)), mask, input_ids[:, -1], attention_mask.sum(dim=1) - 1, remaining,
                 [max_new_tokens] * batch_size)


def drop_finished(live: Live, step: Step, done_list, accepted_list, cache, drafter) -> list[int]:
    """Remove the finished rows from the state, the step, the cache and the drafter; returns the
    accepted counts of the rows left."""
    keep = [i for i, d in enumerate(done_list) if not d]
    live.rows = [live.rows[i] for i in keep]
    if not live.rows:
        return []
    live.remaining_list = [live.remaining_list[i] for i in keep]
    keep_idx = torch.tensor(keep, dtype=torch.long, device=step.block.device)  # (B',)
    cache.batch_select_indices(keep_idx)
    if drafter is not None:
        drafter.select_rows(keep_idx)
    live.mask, live.anchor_pos = live.mask[keep_idx], live.anchor_pos[keep_idx]
    live.remaining = live.remaining[keep_idx]
    step.block, step.num_accepted = step.block[keep_idx], step.num_accepted[keep_idx]
    step.next_token = step.next_token[keep_idx]
    live.hidden = tuple(h[keep_idx] for h in live.hidden) if live.hidden is not None else None
    return [accepted_list[i] for i in keep]


def keep_columns(cache, start: int, index: torch.Tensor) -> None:
    """Keep, after the cache's first ``start`` columns, the columns ``start + index[b]`` of each row, in that order
    (index (B, n) long, relative to ``start``), and drop the rest: a tree step keeps its accepted path. Where every
    row's path is columns 0..n - 1 in order (a chain's, lookup's), nothing moves: the cache is only cut."""
    in_place = bool((index == torch.arange(index.shape[1], device=index.device)).all())
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True):
            continue
        for name in () if in_place else ("keys", "values"):
            states = getattr(layer, name)  # (B, h, start + N + 1, d)
            where = (start + index)[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
            states[:, :, start : start + index.shape[1]] = states.gather(2, where)
        layer.crop(start + index.shape[1] - layer.keys.shape[-2])


def advance(live: Live, step: Step, accepted_list: list[int], cache, drafter, clock) -> None:
    """Keep the columns [anchor, d_1..d_n], n = the largest accepted count among live rows (rows that
    kept fewer get holes), hand them to the drafter, and move every anchor to its next token."""
    n = max(accepted_list)
    cache.crop(n - (step.block.shape[1] - 1))
    new_mask = (step.slots[: n + 1] <= step.num_accepted.unsqueeze(1)).long()  # (B, n + 1)
    new_pos = live.anchor_pos.unsqueeze(1) + step.slots[: n + 1]  # (B, n + 1)
    clock.lap("crop")
    if drafter is not None:
        hidden = tuple(h[:, : n + 1] for h in live.hidden) if live.hidden is not None else None
        drafter.extend(step.block[:, : n + 1], new_mask, new_pos, hidden)
        clock.lap("drafter_extend")
    live.mask = torch.cat([live.mask, new_mask], dim=1)
    live.anchor = step.next_token
    live.anchor_pos = live.anchor_pos + step.num_accepted + 1
    clock.lap("bookkeeping")
