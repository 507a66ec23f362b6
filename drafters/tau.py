"""Teacher-forced τ: greedy verification replayed on held-out sequences, without decoding (docs/method.md §4).

Every response column a is tried as an anchor (:func:`anchor_acceptance`): the drafter drafts K
tokens from the true context, and the draft is accepted up to its first slot that differs from the
target's greedy token (argmax of the target's logits at column a + k − 1, on the true context).
Then :func:`greedy_walk` replays verification: start at the prompt's last token, accept n drafts,
emit n + 1 tokens, next anchor = a + n + 1, truncated at the end of the sequence. τ = kept tokens /
steps, pooled over sequences. On sequences the target generated greedily this equals the online τ
of ``verify.speculative_generate`` at temperature 0 exactly (the data *is* the target's greedy
output, so the true context is the context the verifier would have); on sampled data it is an
estimate.

``tau_soft`` is the expected accepted length per step at temperature 1 for greedy drafts, where
slot k is accepted with probability a_k = p_target(d_k) (the verifier's min(1, p/q) for a one-hot
q): per anchor, E = 1 + Σ_k Π_{j≤k} a_j over the block's in-sequence slots, averaged over every
response anchor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drafters.training.blocks import run_target, slot_positions


@torch.no_grad()
def anchor_acceptance(
    drafter,
    hidden_states: Sequence[torch.Tensor] | torch.Tensor,  # full HF tuple, each (B, S, H), or cached (B, S, L*H)
    target_logits: torch.Tensor | None,  # (B, S, V); None (with ref): no soft acceptance
    input_ids: torch.Tensor,  # (B, S) long, right-padded
    attention_mask: torch.Tensor,  # (B, S)
    prompt_len: torch.Tensor,  # (B,) long
    length: torch.Tensor,  # (B,) long
    chunk: int = 64,
    ref: torch.Tensor | None = None,  # (B, S) long: the token after each column; None = the target's argmax
    vocab: torch.Tensor | None = None,  # (V',) long: the candidate ids drafts come from; None = the whole vocabulary
    width: int | None = None,  # blocks of width + 1 columns (DFlashDrafter.block_logits); None = the whole block
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy-draft acceptance of a block anchored at every response column.

    Returns, indexed by anchor column (B, S): ``lead`` (long, the number of leading drafts equal to
    the target's greedy tokens, counting only slots inside the sequence), ``soft`` (float,
    1 + Σ_k Π_{j≤k} p_target(d_j); None without ``target_logits``) and ``valid`` (bool, the anchor columns
    prompt_len-1..length-2). With ``vocab`` the drafter's head scores only those ids.
    """
    if target_logits is None and ref is None:
        raise ValueError("anchor_acceptance needs the target's logits or the reference tokens ref")
    bsz, seq = input_ids.shape
    k_slots = drafter.config.block_size - 1 if width is None else width
    ref = target_logits.argmax(-1) if ref is None else ref  # (B, S): the target's greedy token for column c + 1
    lse = None if target_logits is None else torch.stack([row.float().logsumexp(-1) for row in target_logits])
    # One spare column (index S) receives the padding anchors' values and is dropped at the end.
    lead = torch.zeros(bsz, seq + 1, dtype=torch.long, device=input_ids.device)
    soft = torch.zeros(bsz, seq + 1, dtype=torch.float32, device=input_ids.device)
    valid = torch.zeros(bsz, seq + 1, dtype=torch.bool, device=input_ids.device)
    rows = torch.arange(bsz, device=input_ids.device).view(bsz, 1, 1)
    for anchors, amask, logits in anchor_logits(drafter, hidden_states, input_ids, attention_mask, prompt_len,
                                                length, chunk, width, vocab):
        logits = logits[:, :, :k_slots]  # (B, A, K, V), or (B, A, K, V') over vocab
        drafts = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]  # (B, A, K)
        cols = slot_positions(anchors, k_slots, seq)  # (B, A, K)
        inside = (anchors.unsqueeze(-1) + torch.arange(1, k_slots + 1, device=anchors.device)
                  < length.view(bsz, 1, 1)) & amask.unsqueeze(-1)  # (B, A, K): column a+k is a token
        match = (drafts == ref.gather(1, cols.view(bsz, -1)).view_as(drafts)) & inside
        block_lead = match.long().cumprod(-1).sum(-1)  # (B, A)
        where = anchors.masked_fill(~amask, seq)  # (B, A)
        lead.scatter_(1, where, block_lead)
        valid.scatter_(1, where, amask)
        if lse is not None:
            p = (target_logits[rows, cols, drafts].float() - lse.gather(1, cols.view(bsz, -1)).view_as(cols)).exp()
            soft.scatter_(1, where, 1 + (p * inside).cumprod(-1).sum(-1))  # (B, A)
    return lead[:, :seq], None if lse is None else soft[:, :seq], valid[:, :seq]


def anchor_logits(drafter, hidden_states, input_ids, attention_mask, prompt_len, length, chunk: int = 64,
                  width: int | None = None, vocab: torch.Tensor | None = None):
    """Yield ``(anchors (B, A) long, amask (B, A) bool, logits (B, A, K', V))``: the drafter's slot logits of a
    block anchored at every response column (prompt_len - 1 .. length - 2), ``chunk`` anchors per forward; over
    the candidate ids ``vocab`` (V',) only if given ((B, A, K', V'), the head's product over their rows)."""
    lo, count = prompt_len - 1, length - prompt_len  # first anchor column, anchors per row
    for start in range(0, int(count.max()), chunk):
        j = torch.arange(start, min(start + chunk, int(count.max())), device=input_ids.device)  # (A,)
        amask = j.unsqueeze(0) < count.unsqueeze(1)  # (B, A)
        anchors = (lo.unsqueeze(1) + j).masked_fill(~amask, 0)  # (B, A)
        yield anchors, amask, drafter.forward_train(hidden_states, input_ids, None, anchors, amask, attention_mask,
                                                    vocab_ids=vocab, width=width)


@torch.no_grad()
def anchor_top(drafter, hidden_states, input_ids, attention_mask, prompt_len, length, k: int, slots: int,
               vocab: torch.Tensor | None = None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` log-probabilities and tokens of the first ``slots`` slots of a block anchored at every column:
    ``(values (B, S, slots, k) float, ids (B, S, slots, k) long)``, drafting from the candidate ids ``vocab`` (V',)
    if given (as :class:`drafters.policy.PolicyDrafter` drafts), each slot's distribution at ``temperature``
    (softmax of logits / temperature); columns that anchor no block hold zeros."""
    bsz, seq = input_ids.shape
    k = min(k, drafter.config.vocab_size if vocab is None else vocab.numel())
    values = torch.zeros(bsz, seq + 1, slots, k)
    ids = torch.zeros(bsz, seq + 1, slots, k, dtype=torch.long)
    for anchors, amask, logits in anchor_logits(drafter, hidden_states, input_ids, attention_mask, prompt_len,
                                                length, vocab=vocab):
        logits = logits[:, :, :slots].float()  # (B, A, W, V), or (B, A, W, V') over vocab
        top_v, top_i = (logits / temperature).log_softmax(-1).topk(k, dim=-1)
        where = anchors.masked_fill(~amask, seq).cpu()  # (B, A): padding anchors to the spare column
        values[torch.arange(bsz).unsqueeze(1), where] = top_v.cpu()
        ids[torch.arange(bsz).unsqueeze(1), where] = (top_i if vocab is None else vocab[top_i]).cpu()
    return values[:, :seq], ids[:, :seq]


def greedy_walk(lead: Sequence[int], prompt_len: int, length: int) -> tuple[list[int], list[int]]:
    """Replay greedy verification over one sequence of ``length`` tokens.

    ``lead[a]`` is the number of leading accepted drafts of the block anchored at column a. The
    first anchor is column ``prompt_len - 1``; a step that accepts n of the r tokens left keeps
    min(n + 1, r) tokens and moves the anchor by that much. Returns per-step
    ``(accepted_counts, kept_tokens)``, as ``speculative_generate`` counts them.
    """
    anchor, accepted, kept = prompt_len - 1, [], []
    while anchor < length - 1:
        left = length - 1 - anchor
        n = min(int(lead[anchor]), left)
        step = min(n + 1, left)
        accepted.append(n)
        kept.append(step)
        anchor += step
    return accepted, kept


@dataclass
class TauCounts:
    """Teacher-forced τ of one batch, as counts that add up over batches and processes."""

    accepted_counts: list[list[int]]  # per row, per verification step
    kept: int  # tokens kept over all rows and steps
    steps: int  # verification steps over all rows
    soft: torch.Tensor  # (n,) float32, the expected accepted length at each of the n response anchors


@torch.no_grad()
def batch_tau_counts(drafter, hidden_states, target_logits, batch: dict[str, torch.Tensor],
                     chunk: int = 64) -> TauCounts:
    """:func:`anchor_acceptance` then :func:`greedy_walk` on every row of a right-padded batch, given
    the target's output on it (full hidden-state tuple and logits (B, S, V))."""
    lead, soft, valid = anchor_acceptance(drafter, hidden_states, target_logits, batch["input_ids"],
                                          batch["attention_mask"], batch["prompt_len"], batch["length"], chunk)
    counts, kept = [], 0
    for b, row in enumerate(lead.tolist()):
        acc, step_kept = greedy_walk(row, int(batch["prompt_len"][b]), int(batch["length"][b]))
        counts.append(acc)
        kept += sum(step_kept)
    return TauCounts(counts, kept, sum(len(c) for c in counts), soft[valid])


@torch.no_grad()
def teacher_forced_tau(drafter, target, batch: dict[str, torch.Tensor], chunk: int = 64) -> dict:
    """Teacher-forced τ of a right-padded batch (see :func:`drafters.training.datamodule.collate`).

    Returns ``accepted_counts`` (per row, per step), ``tau_greedy`` (pooled kept tokens / steps) and
    ``tau_soft`` (mean over response anchors of the expected accepted length at temperature 1).
    """
    out = run_target(target, batch, full_logits=True)
    tau = batch_tau_counts(drafter, out.hidden_states, out.logits, batch, chunk)
    return {
        "accepted_counts": tau.accepted_counts,
        "tau_greedy": tau.kept / max(tau.steps, 1),
        "tau_soft": float(tau.soft.mean()) if tau.soft.numel() else float("nan"),
    }
