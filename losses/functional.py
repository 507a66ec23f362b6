"""Acceptance-aligned losses for block drafters: pure functions with documented shapes.

Notation (docs/method.md §2). A batch holds N blocks of K predicted slots. For block n and slot k the
drafter's distribution is q_k = softmax(logits[n, k]), the hard label is y_k = labels[n, k] (the
target's token) and m_k = mask[n, k] says whether the slot has a label. ℓ_k = −log q_k(y_k).
Formulas count slots from 1, code from 0.

Masks are normally a prefix (valid slots, then padding at the end of a sequence). A masked slot in
the middle of a block is *skipped* everywhere: it is never an error, carries no loss, and in the
joint-prefix quantities (chain reward, D-PACE) it acts as a slot that is always accepted (factor 1,
log-factor 0) and is not counted in K_b. With prefix masks this is the same as ending the block at
its last valid slot. Labels at masked slots are ignored and may hold anything (e.g. -100).

Precision: every function computes in float32 (float64 inputs stay float64), whatever the logits'
dtype, and works in log space where probabilities could underflow. Autocast is disabled inside.

Memory: :func:`slot_statistics` walks the flattened (N·K, V) logits in chunks of rows, saves only
the logits (by reference) and per-slot scalars for backward, and recomputes softmax chunk by chunk
there; the only full-size tensor it allocates is the gradient of the logits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

SCHEDULES = ("exp", "linear", "uniform")
DRAFT_SAMPLING = ("greedy", "sample")
# Rows of logits per chunk are chosen so that a chunk holds about this many float32 values (2 MB):
# small enough to stay in cache on a CPU, large enough that the Python loop costs nothing.
CHUNK_ELEMENTS = 1 << 19


# --------------------------------------------------------------------------------------------------
# input checks


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


# --------------------------------------------------------------------------------------------------
# positional weights


def positional_weights(
    num_positions: int,
    gamma: float | None,
    schedule: str = "exp",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-slot weights w_k, k = 1..K: a (K,) tensor.

    * ``"exp"``: w_k = exp(−(k−1)/γ) (DFlash; γ = 7 at block 16). γ None or inf gives uniform weights.
    * ``"linear"``: w_k = 1 − (k−1)/K, from 1 at the first slot down to 1/K at the last; it has no
      rate, so γ is not used.
    * ``"uniform"``: w_k = 1.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if num_positions < 1:
        raise ValueError(f"num_positions must be >= 1, got {num_positions}")
    k = torch.arange(num_positions, device=device, dtype=dtype)  # k − 1 for k = 1..K
    if schedule == "linear":
        return 1.0 - k / num_positions
    if schedule == "uniform" or gamma is None or math.isinf(gamma):
        return torch.ones_like(k)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (or None/inf for uniform weights), got {gamma}")
    return torch.exp(-k / gamma)


# --------------------------------------------------------------------------------------------------
# per-slot statistics: CE, log-acceptance, argmax (one chunked pass over the logits)


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


def slot_cross_entropy(
    logits: torch.Tensor,  # (N, K, V)
    labels: torch.Tensor,  # (N, K) long
    mask: torch.Tensor | None = None,  # (N, K)
    target_probs: torch.Tensor | None = None,  # (N, K, V)
    chunk_size: int | None = None,
) -> torch.Tensor:  # (N, K)
    """Per-slot CE ℓ_k: −log q_k(y_k), or −Σ_v p_k(v) log q_k(v) with ``target_probs``; 0 where masked."""
    stats = slot_statistics(logits, labels, mask, target_probs, chunk_size=chunk_size)
    return stats.nll if target_probs is None else stats.soft_ce


# --------------------------------------------------------------------------------------------------
# first error and focal term


def first_error_from_correct(
    correct: torch.Tensor,  # (N, K) bool, argmax == label
    mask: torch.Tensor,  # (N, K) bool
) -> torch.Tensor:  # (N,) long
    """0-based index of the first unmasked slot that is not correct; K where there is none."""
    errors = mask.bool() & ~correct.bool()  # (N, K)
    K = errors.shape[-1]
    return torch.where(errors.any(-1), errors.to(torch.uint8).argmax(-1), K)


def first_error_from_argmax(
    argmax: torch.Tensor,  # (N, K) long
    labels: torch.Tensor,  # (N, K) long
    mask: torch.Tensor,  # (N, K) bool
) -> torch.Tensor:  # (N,) long
    """0-based index of the first unmasked slot with argmax ≠ label; K where there is none."""
    return first_error_from_correct(argmax == labels, mask)


def first_error_index(
    logits: torch.Tensor,  # (N, K, V)
    labels: torch.Tensor,  # (N, K) long
    mask: torch.Tensor | None = None,  # (N, K)
) -> torch.Tensor:  # (N,) long
    """j* per block: the first unmasked slot whose argmax (first index on ties) differs from its
    label, 0-based; K when every unmasked slot is right. No gradient."""
    labels, mask = check_inputs(logits, labels, mask)
    with torch.no_grad():
        return first_error_from_argmax(logits.argmax(-1), labels, mask)


def first_error_focal(
    ce: torch.Tensor,  # (N, K) per-slot CE ℓ_k
    log_accept: torch.Tensor | None,  # (N, K) log of the slot's acceptance probability; None if phi == 0
    first_error: torch.Tensor,  # (N,) long, K = no error
    phi: float,
) -> torch.Tensor:  # (N,)
    """Per-block first-error focal term (1 − a_{j*})^φ · ℓ_{j*}; 0 for blocks without an error.

    a = exp(log_accept) is q(y) for hard labels. The modulating factor is differentiable (as in the
    focal loss of Lin et al.); φ = 0 gives the plain CE at the first error.
    """
    if phi < 0:
        raise ValueError(f"focal exponent phi must be >= 0, got {phi}")
    K = ce.shape[-1]
    has_error = first_error < K  # (N,)
    j = first_error.clamp(max=K - 1).unsqueeze(-1)  # (N, 1)
    ce_j = ce.gather(-1, j).squeeze(-1)  # (N,)
    if phi == 0:
        return torch.where(has_error, ce_j, 0.0)
    if log_accept is None:
        raise ValueError("first_error_focal needs log_accept when phi > 0")
    log_a = log_accept.gather(-1, j).squeeze(-1)
    miss = (-torch.expm1(log_a)).clamp_min(_tiny(log_a.dtype))  # 1 − a_{j*}, kept off 0 for pow
    return torch.where(has_error, miss.pow(phi) * ce_j, 0.0)


# --------------------------------------------------------------------------------------------------
# chain reward


def chain_reward(
    log_accept: torch.Tensor,  # (N, K) log a_k (e.g. log q_k(y_k) = −nll)
    mask: torch.Tensor,  # (N, K) bool or 0/1
) -> torch.Tensor:  # (N,)
    """R = (1/K_b) Σ_{valid k} exp(Σ_{valid j ≤ k} log a_j), K_b = number of valid slots.

    R is the expected accepted prefix length divided by K_b when slot k is accepted independently
    with probability a_k. Computed as exp of a cumulative sum of log-probabilities (no underflowing
    products). Masked slots are skipped (factor 1, not counted); a block with no valid slot gives 0.
    """
    mask = mask.bool()
    log_a = torch.where(mask, log_accept.to(_compute_dtype(log_accept.dtype)), 0.0)  # (N, K)
    prefix = torch.exp(torch.cumsum(log_a, dim=-1))  # (N, K) P_k = Π_{j≤k} a_j
    valid = mask.sum(-1)  # (N,) K_b
    return torch.where(mask, prefix, 0.0).sum(-1) / valid.clamp_min(1)


def chain_surrogate(
    logits: torch.Tensor,  # (N, K, V)
    labels: torch.Tensor,  # (N, K) long
    mask: torch.Tensor | None = None,  # (N, K)
    chunk_size: int | None = None,
) -> torch.Tensor:  # (N,)
    """The chain reward with a_k = q_k(y_k): R = (1/K_b) Σ_{k≤K_b} exp(Σ_{j≤k} log q_j(y_j)).

    Differentiable; see :func:`chain_reward` for masks.
    """
    stats = slot_statistics(logits, labels, mask, chunk_size=chunk_size)
    _, mask = check_inputs(logits, labels, mask)
    return chain_reward(-stats.nll, mask)


# --------------------------------------------------------------------------------------------------
# D-PACE


def dpace_weights_from_accept(
    accept: torch.Tensor,  # (N, K) acceptance probabilities a_k (q_k(y_k) for hard labels)
    mask: torch.Tensor,  # (N, K)
    alpha: float = 0.5,
) -> torch.Tensor:  # (N, K), detached
    """D-PACE weights w_i = Σ_{k≥i} m_k P_k with P_k = Π_{l≤k} ((1 − α) a_l + α); 0 at masked slots.

    Masked slots are skipped in the product (factor 1). The weights carry no gradient.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace alpha must lie in [0, 1], got {alpha}")
    mask = mask.bool()
    with torch.no_grad():
        a = accept.detach().to(_compute_dtype(accept.dtype))
        factor = torch.where(mask, (1.0 - alpha) * a + alpha, 1.0)  # (N, K)
        reach = torch.where(mask, torch.cumprod(factor, dim=-1), 0.0)  # (N, K) m_k P_k
        tail = reach.flip(-1).cumsum(-1).flip(-1)  # (N, K) Σ_{k≥i} m_k P_k
        return torch.where(mask, tail, 0.0)


def dpace_weights(
    logits: torch.Tensor,  # (N, K, V)
    labels: torch.Tensor,  # (N, K) long
    mask: torch.Tensor | None = None,  # (N, K)
    alpha: float = 0.5,
    chunk_size: int | None = None,
) -> torch.Tensor:  # (N, K), detached
    """D-PACE weights with a_l = q_l(y_l); see :func:`dpace_weights_from_accept`."""
    labels, mask = check_inputs(logits, labels, mask)
    with torch.no_grad():
        nll = slot_statistics(logits, labels, mask, chunk_size=chunk_size).nll
    return dpace_weights_from_accept(torch.exp(-nll), mask, alpha)
