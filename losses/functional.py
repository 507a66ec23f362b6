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

Memory: :func:`slot_statistics` (:mod:`losses.slot_stats`) walks the flattened (N·K, V) logits in chunks of rows, saves only
the logits (by reference) and per-slot scalars for backward, and recomputes softmax chunk by chunk
there; the only full-size tensor it allocates is the gradient of the logits.
"""

from __future__ import annotations

import math

import torch

from losses.slot_stats import (  # noqa: F401 (re-exported: checks and slot statistics live in losses.slot_stats)
    CHUNK_ELEMENTS,
    DRAFT_SAMPLING,
    SlotStats,
    _compute_dtype,
    _tiny,
    check_inputs,
    default_chunk_rows,
    slot_statistics,
)

SCHEDULES = ("exp", "linear", "uniform")


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
# per-slot statistics: CE, log-acceptance, argmax (one chunked pass over the logits: losses.slot_stats)


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
