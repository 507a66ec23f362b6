"""Input checks and per-slot statistics of the losses (:mod:`losses.functional`, whose notation and
conventions these follow; re-exported there).

:func:`slot_statistics` computes, in one chunked pass over the (N·K, V) logits, each slot's cross-entropy
(hard label, and against the target's distribution when given), the log of the verifier's acceptance
probability and the argmax. Its custom autograd function saves only the logits (by reference) and per-slot
scalars for backward and recomputes the softmax chunk by chunk there; the only full-size tensor it allocates
is the gradient of the logits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

DRAFT_SAMPLING = ("greedy", "sample")
# Rows of logits per chunk are chosen so that a chunk holds about this many float32 values (2 MB):
# small enough to stay in cache on a CPU, large enough that the Python loop costs nothing.
CHUNK_ELEMENTS = 1 << 19


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _tiny(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny


def check_inputs(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None, target_probs=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes; return ``(labels (N, K) long with 0 at masked slots, mask (N, K) bool)``."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be (N, K, V), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    N, K, V = logits.shape
    if tuple(labels.shape) != (N, K):
        raise ValueError(f"labels must be (N, K) = {(N, K)} like logits, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if mask is None:
        mask = torch.ones(N, K, dtype=torch.bool, device=logits.device)
    else:
        if tuple(mask.shape) != (N, K):
            raise ValueError(f"mask must be (N, K) = {(N, K)} like logits, got {tuple(mask.shape)}")
        mask = mask.to(device=logits.device, dtype=torch.bool) if mask.dtype != torch.bool else mask
    if target_probs is not None and tuple(target_probs.shape) != (N, K, V):
        raise ValueError(
            f"target_probs must be (N, K, V) = {(N, K, V)} like logits, got {tuple(target_probs.shape)}"
        )
    labels = torch.where(mask, labels.long(), 0)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= V):
        raise ValueError(f"labels at unmasked slots must lie in [0, {V}), got [{labels.min()}, {labels.max()}]")
    return labels, mask


class SlotStats(NamedTuple):
    """Per-slot statistics, each (N, K); masked slots hold 0 (argmax, correct excepted)."""

    nll: torch.Tensor  # −log q_k(y_k): hard-label cross-entropy; log q_k(y_k) = −nll
    soft_ce: torch.Tensor | None  # −Σ_v p_k(v) log q_k(v): CE against target_probs (None without them)
    log_accept: torch.Tensor | None  # log of the verifier's acceptance probability (see slot_statistics)
    argmax: torch.Tensor | None  # long, argmax_v q_k(v), first index on ties; no gradient
    correct: torch.Tensor | None  # bool, argmax_v q_k(v) == y_k; no gradient


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _soft_chunk(rows: slice, p, x, e, S, accept, tiny, lse, argmax, soft_ce, log_accept, aux_s, aux_q) -> None:
    """The soft-label statistics of one chunk of rows in :class:`_SlotStatsFunction`'s forward, written
    in place: soft CE and, with ``accept``, the log acceptance and the backward's auxiliaries.
    ``p`` (c, V) the target's probabilities, ``x`` the logits, ``e`` = exp(x - max) (overwritten by
    ``accept="sample"``), ``S`` its row sums."""
    soft_ce[rows] = lse[rows] - torch.linalg.vecdot(p, x)
    if accept == "greedy":
        chosen = p.gather(-1, argmax[rows].unsqueeze(-1)).squeeze(-1)  # p(argmax q)
        log_accept[rows] = chosen.clamp_min(tiny).log()
        aux_s[rows] = torch.linalg.vecdot(e, p) / S  # Σ q p
    elif accept == "sample":
        q = e.div_(S.unsqueeze(-1))
        A = torch.minimum(q, p).sum(-1)
        log_accept[rows] = A.clamp_min(tiny).log()
        aux_s[rows] = A
        aux_q[rows] = torch.where(q < p, q, 0.0).sum(-1)


class _SlotStatsFunction(torch.autograd.Function):
    """Chunked softmax statistics over rows of logits (R, V). See :func:`slot_statistics`.

    Outputs (each (R,)): nll = lse − x_y; soft_ce = lse − Σ p x (empty without probs);
    log_accept (empty unless ``accept``); argmax (empty unless asked); correct (empty unless asked).
    Backward recomputes q = exp(x − lse) per chunk:

    * d nll / dx = q − onehot(y)
    * d soft_ce / dx = q − p
    * greedy: d log s / dx = q ⊙ p / s − q, with s = Σ_v q(v) p(v)
    * sample: d log A / dx = (q ⊙ 1[q < p] − q · Q) / A, with A = Σ_v min(p, q), Q = Σ_{q<p} q

    Argmax without a slow index-tracking max: d = x − max(x) is exactly +0 at the maxima and < 0
    elsewhere (an IEEE difference is 0 only for equal operands), so the bit patterns of d, read as
    integers, are largest exactly at the maxima and an integer argmax gives the first maximal index,
    like ``torch.argmax``. ``correct`` (argmax == y) needs no argmax: it holds iff x_y is a maximum
    and, when another maximum exists (one cheap max of d with d_y set to −inf), none comes before y;
    only rows with such an exact tie fall back to ``torch.argmax``.
    """

    @staticmethod
    def forward(ctx, logits, labels, probs, accept, chunk, with_argmax, with_correct):
        # logits (R, V), labels (R,) long in [0, V), probs (R, V) or None
        ctx.set_materialize_grads(False)
        R = logits.shape[0]
        device = logits.device
        cdtype = _compute_dtype(logits.dtype)
        tiny = _tiny(cdtype)
        with_argmax = with_argmax or accept == "greedy"

        def new(n, dtype=cdtype):
            return torch.empty(n, dtype=dtype, device=device)

        lse = new(R)
        argmax = new(R if with_argmax else 0, torch.long)
        correct = new(R if with_correct else 0, torch.bool)
        tied = new(R if with_correct and not with_argmax else 0, torch.bool)  # x_y ties another max
        soft_ce = new(R if probs is not None else 0)
        log_accept = new(R if accept else 0)
        aux_s = new(R if accept else 0)  # s (greedy) or A (sample)
        aux_q = new(R if accept == "sample" else 0)  # Q (sample)
        with torch.autocast(device.type, enabled=False):
            for a in range(0, R, chunk):
                b = min(a + chunk, R)
                x = logits[a:b].to(cdtype)  # (c, V)
                m = x.amax(-1)  # (c,)
                d = torch.sub(x, m.unsqueeze(-1))  # (c, V) ≤ 0, exactly +0 at the maxima
                if with_argmax:
                    argmax[a:b] = _int_view(d).argmax(-1)
                elif with_correct:
                    y = labels[a:b].unsqueeze(-1)  # (c, 1)
                    d_y = d.gather(-1, y)  # (c, 1), 0 iff x_y is a maximum
                    other_max = d.scatter_(-1, y, -math.inf).amax(-1) == 0  # another maximum exists
                    d.scatter_(-1, y, d_y)  # restore d_y
                    correct[a:b] = ok = d_y.squeeze(-1) == 0
                    tied[a:b] = ok & other_max
                e = d.exp_()  # (c, V) = q · S
                S = e.sum(-1)  # (c,)
                lse[a:b] = S.log() + m
                if probs is not None:
                    _soft_chunk(slice(a, b), probs[a:b].to(cdtype), x, e, S, accept, tiny,
                                lse, argmax, soft_ce, log_accept, aux_s, aux_q)
            x_y = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(cdtype)  # (R,)
            nll = lse - x_y
            if with_correct and with_argmax:
                correct = argmax == labels
            elif with_correct:  # exact ties (one host sync per call): argmax is the first maximal index
                rows = tied.nonzero().squeeze(-1)
                if rows.numel():
                    correct[rows] = logits[rows].argmax(-1) == labels[rows]
        ctx.save_for_backward(logits, labels, probs, lse, aux_s, aux_q)
        ctx.accept, ctx.chunk = accept, chunk
        ctx.mark_non_differentiable(argmax, correct)
        return nll, soft_ce, log_accept, argmax, correct

    @staticmethod
    def backward(ctx, g_nll, g_soft, g_acc, _g_argmax, _g_correct):
        logits, labels, probs, lse, aux_s, aux_q = ctx.saved_tensors
        accept, chunk = ctx.accept, ctx.chunk
        if g_soft is not None and g_soft.numel() == 0:
            g_soft = None
        if g_acc is not None and g_acc.numel() == 0:
            g_acc = None
        none = (None,) * 6
        if g_nll is None and g_soft is None and g_acc is None:
            return (None, *none)
        R = logits.shape[0]
        cdtype = lse.dtype
        tiny = _tiny(cdtype)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        # Per-row coefficient of q in the gradient; see the class docstring.
        coef = torch.zeros(R, dtype=cdtype, device=logits.device)
        if g_nll is not None:
            coef += g_nll
        if g_soft is not None:
            coef += g_soft
        if g_acc is not None:
            coef -= g_acc if accept == "greedy" else g_acc * aux_q / aux_s.clamp_min(tiny)
            acc_scale = g_acc / aux_s.clamp_min(tiny)  # g / s (greedy) or g / A (sample)
        in_place = grad.dtype == cdtype
        with torch.autocast(logits.device.type, enabled=False):
            for a in range(0, R, chunk):
                b = min(a + chunk, R)
                x = logits[a:b].to(cdtype)
                # q, written straight into the gradient buffer when dtypes allow, else into x's copy
                gq = torch.sub(x, lse[a:b].unsqueeze(-1), out=grad[a:b]) if in_place else x.sub_(lse[a:b, None])
                q = gq.exp_()  # (c, V); becomes the gradient in place
                c = coef[a:b].unsqueeze(-1)  # (c, 1)
                p = probs[a:b].to(cdtype) if probs is not None else None
                if g_acc is None:
                    q.mul_(c)
                else:  # q ⊙ (coef + p r) for greedy, q ⊙ (coef + r 1[q < p]) for sample
                    r = acc_scale[a:b].unsqueeze(-1)
                    q.mul_(torch.addcmul(c, p, r) if accept == "greedy" else torch.where(q < p, c + r, c))
                if g_soft is not None:
                    gq.addcmul_(p, g_soft[a:b].unsqueeze(-1), value=-1.0)
                if g_nll is not None:
                    gq.scatter_add_(-1, labels[a:b].unsqueeze(-1), -g_nll[a:b].unsqueeze(-1))
                if not in_place:
                    grad[a:b] = gq
        return (grad, *none)


def default_chunk_rows(vocab_size: int) -> int:
    """Rows of logits per chunk so that one chunk holds about ``CHUNK_ELEMENTS`` values."""
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def slot_statistics(
    logits: torch.Tensor,  # (N, K, V)
    labels: torch.Tensor,  # (N, K) long
    mask: torch.Tensor | None = None,  # (N, K) bool or 0/1; None = all valid
    target_probs: torch.Tensor | None = None,  # (N, K, V) target's distribution p_k, no gradient
    *,
    accept: str | None = None,  # None | "greedy" | "sample"; needs target_probs
    with_argmax: bool = False,  # also return argmax (always computed for accept="greedy")
    with_correct: bool = False,  # also return argmax == label
    chunk_size: int | None = None,  # rows of V logits per chunk; None = about 2**19 values
) -> SlotStats:
    """Per-slot cross-entropy, log-acceptance and argmax/correctness in one chunked pass over the logits.

    * ``nll`` = −log q_k(y_k) = logsumexp(x) − x_y, the hard-label CE (so log q_k(y_k) = −nll).
    * ``soft_ce`` = −Σ_v p_k(v) log q_k(v) (cross-entropy against p, without p's entropy).
    * ``log_accept``: the verifier's acceptance probability of the slot's draft under soft labels.

      - ``"greedy"`` (deterministic draft d = argmax q): the value is log p_k(d), exactly what is
        reported. It has zero gradient almost everywhere, so its gradient is taken from the smooth
        surrogate log E_{v~q_k} p_k(v) = log Σ_v q_k(v) p_k(v) (straight-through in log space). That
        surrogate is maximised by q one-hot at argmax p, which is also where p_k(argmax q_k) peaks.
      - ``"sample"`` (draft drawn from q): log Σ_v min(p_k(v), q_k(v)), value and gradient exact
        (subgradient where p = q).

    * ``argmax`` (with_argmax) and ``correct`` = argmax == y (with_correct), exact ``torch.argmax``
      semantics (first index on ties); None when not asked for.

    Everything is computed in float32 (float64 stays float64); gradients flow to ``logits`` only.
    Masked slots hold 0 in nll, soft_ce and log_accept (probability 1: "always accepted").
    """
    labels, mask = check_inputs(logits, labels, mask, target_probs)
    if accept is not None and accept not in DRAFT_SAMPLING:
        raise ValueError(f"accept must be None or one of {DRAFT_SAMPLING}, got {accept!r}")
    if accept is not None and target_probs is None:
        raise ValueError("accept=... needs target_probs (the soft labels p)")
    N, K, V = logits.shape
    chunk = default_chunk_rows(V) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(N * K, V)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    probs = None if target_probs is None else target_probs.detach().reshape(N * K, V)
    nll, soft_ce, log_accept, argmax, correct = _SlotStatsFunction.apply(
        flat, labels.reshape(-1), probs, accept, chunk, with_argmax, with_correct
    )
    zero = lambda t: torch.where(mask, t.view(N, K), 0.0)
    return SlotStats(
        nll=zero(nll),
        soft_ce=zero(soft_ce) if target_probs is not None else None,
        log_accept=zero(log_accept) if accept is not None else None,
        argmax=argmax.view(N, K) if (with_argmax or accept == "greedy") else None,
        correct=correct.view(N, K) if with_correct else None,
    )
