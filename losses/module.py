"""AcceptanceAlignedLoss: the composite training loss for block drafters (docs/method.md §2).

    L = L_pos + α_f · L_fe − α_c · R

* L_pos = Σ w_k m_k ℓ_k / Σ w_k m_k, with positional weights w_k (uniform when γ is None) or, with
  ``dpace=True``, the detached D-PACE weights instead. With every option off it is the
  position-uniform CE baseline Σ m ℓ / Σ m.
* L_fe = Σ_blocks (1 − a_{j*})^φ ℓ_{j*} / (number of blocks, or of blocks with an error): the
  first-error focal term; blocks without an error add nothing.
* R = Σ_blocks R_b / number of blocks: the chain reward, the mean over blocks of the expected
  accepted-prefix fraction.

"Blocks" are those with at least one valid slot. Here ℓ is the hard-label CE and a_k = q_k(y_k);
with ``soft=True`` ℓ is the CE against the target's distribution p_k and a_k the verifier's
acceptance probability (see :func:`losses.functional.slot_statistics`).

Distributed training: every denominator is summed over all ranks (one all-reduce of detached
scalars per call), and each rank returns world_size · (its numerator) / (global denominator). DDP
averages gradients over ranks, so the gradients equal those of the whole batch on one process, for
any split of the batch over ranks; and the mean over ranks of the loss and of every component equals
the single-process value (average them when logging, e.g. ``sync_dist=True`` in Lightning). With
gradient accumulation the denominators are per micro-batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from losses import functional as LF

FOCAL_NORMS = ("blocks", "errors")


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _global_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a detached tensor of scalars over all ranks (identity without torch.distributed)."""
    values = values.detach().clone()
    if _world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class AcceptanceAlignedLoss(nn.Module):
    """Composite acceptance-aligned loss; ``forward`` returns ``(loss, components)``.

    Args:
        gamma: decay rate of the positional weights; None (or inf) = uniform.
        schedule: ``"exp"`` (exp(−(k−1)/γ)), ``"linear"`` (1 − (k−1)/K, no rate) or ``"uniform"``.
        focal_weight: α_f, weight of the first-error focal term (0 = off).
        focal_gamma: φ, exponent of the focal factor (1 − a_{j*})^φ; 0 = plain CE at the first error.
        focal_norm: ``"blocks"``: divide by the number of blocks, so the term shrinks as errors get
            rarer (an expectation over blocks); ``"errors"``: divide by the number of blocks with an
            error (the mean CE at the breaker, a constant scale).
        chain_weight: α_c, weight of the chain reward (0 = off); the loss adds −α_c · R.
        dpace: replace the positional weights by the detached D-PACE weights (needs uniform
            positional weights, i.e. gamma None).
        dpace_alpha: the a of D-PACE, P_k = Π_{l≤k} ((1 − a) q_l(y_l) + a).
        soft: use ``target_probs`` (the target's p_k): CE against p, and the verifier's acceptance
            probability instead of q(y) in the chain, D-PACE and focal factor.
        draft_sampling: in soft mode, how drafts are made at inference: ``"greedy"`` (argmax q,
            acceptance p(argmax q), gradient from the surrogate log Σ q p) or ``"sample"``
            (acceptance Σ_v min(p, q)).
        chunk_size: rows of V logits per chunk (None: about 2**19 values per chunk).

    Components (detached): ``ce`` (L_pos with positional weights) or ``dpace`` (L_pos with D-PACE
    weights), ``focal`` (L_fe, before α_f), ``chain`` (R, the mean reward), and always ``ce_uniform``
    (hard-label Σ m ℓ / Σ m, for monitoring). loss = (ce | dpace) + α_f · focal − α_c · chain.
    """

    def __init__(
        self,
        gamma: float | None = None,
        schedule: str = "exp",
        focal_weight: float = 0.0,
        focal_gamma: float = 0.0,
        focal_norm: str = "blocks",
        chain_weight: float = 0.0,
        dpace: bool = False,
        dpace_alpha: float = 0.5,
        soft: bool = False,
        draft_sampling: str = "greedy",
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if schedule not in LF.SCHEDULES:
            raise ValueError(f"schedule must be one of {LF.SCHEDULES}, got {schedule!r}")
        if gamma is not None and not gamma > 0:
            raise ValueError(f"gamma must be > 0, or None for uniform weights, got {gamma}")
        for name, value in (("focal_weight", focal_weight), ("focal_gamma", focal_gamma),
                            ("chain_weight", chain_weight)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if focal_norm not in FOCAL_NORMS:
            raise ValueError(f"focal_norm must be one of {FOCAL_NORMS}, got {focal_norm!r}")
        if draft_sampling not in LF.DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {LF.DRAFT_SAMPLING}, got {draft_sampling!r}")
        if not 0.0 <= dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must lie in [0, 1], got {dpace_alpha}")
        decays = schedule == "linear" or (schedule == "exp" and gamma is not None and not math.isinf(gamma))
        if dpace and decays:
            raise ValueError(
                f"dpace=True replaces the positional weights; set gamma=None (got gamma={gamma}, "
                f"schedule={schedule!r})"
            )
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        self.gamma, self.schedule = gamma, schedule
        self.focal_weight, self.focal_gamma, self.focal_norm = float(focal_weight), float(focal_gamma), focal_norm
        self.chain_weight = float(chain_weight)
        self.dpace, self.dpace_alpha = bool(dpace), float(dpace_alpha)
        self.soft, self.draft_sampling = bool(soft), draft_sampling
        self.chunk_size = chunk_size

    def extra_repr(self) -> str:
        keys = ("gamma", "schedule", "focal_weight", "focal_gamma", "focal_norm", "chain_weight", "dpace",
                "dpace_alpha", "soft", "draft_sampling")
        return ", ".join(f"{k}={getattr(self, k)!r}" for k in keys)

    def forward(
        self,
        logits: torch.Tensor,  # (N, K, V) drafter logits, any float dtype
        labels: torch.Tensor,  # (N, K) long, the target's tokens
        mask: torch.Tensor,  # (N, K) bool or 0/1
        target_probs: torch.Tensor | None = None,  # (N, K, V) target's p_k; soft mode only
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.soft and target_probs is None:
            raise ValueError("soft=True needs target_probs (N, K, V), the target's distributions")
        if not self.soft and target_probs is not None:
            raise ValueError("target_probs given but soft=False; set soft=True to train on soft labels")
        labels, mask = LF.check_inputs(logits, labels, mask, target_probs)
        N, K, _V = logits.shape
        use_focal, use_chain = self.focal_weight > 0, self.chain_weight > 0
        # The acceptance probability a_k is needed by the chain, D-PACE and a focal factor with φ > 0.
        need_accept = use_chain or self.dpace or (use_focal and self.focal_gamma > 0)
        with torch.autocast(logits.device.type, enabled=False):
            stats = LF.slot_statistics(
                logits, labels, mask, target_probs,
                accept=self.draft_sampling if (self.soft and need_accept) else None,
                with_correct=use_focal,
                chunk_size=self.chunk_size,
            )
            ce = stats.soft_ce if self.soft else stats.nll  # (N, K) ℓ_k, 0 where masked
            log_accept = stats.log_accept if self.soft else -stats.nll  # (N, K) log a_k
            m = mask.to(ce.dtype)  # (N, K)
            if self.dpace:
                weights = LF.dpace_weights_from_accept(log_accept.detach().exp(), mask, self.dpace_alpha)
            else:
                weights = LF.positional_weights(K, self.gamma, self.schedule, device=ce.device, dtype=ce.dtype)
                weights = weights.expand(N, K) * m  # (N, K)
            blocks = mask.any(-1)  # (N,)
            first_error = LF.first_error_from_correct(stats.correct, mask) if use_focal else None
            local = torch.stack([
                weights.sum(), m.sum(), blocks.sum().to(ce.dtype),
                (first_error < K).sum().to(ce.dtype) if use_focal else ce.new_zeros(()),
            ])
            den_weights, den_slots, den_blocks, den_errors = _global_sum(local).unbind()
            scale = float(_world_size())

            term = scale * (weights * ce).sum() / den_weights.clamp_min(LF._tiny(ce.dtype))
            loss = term
            components = {"dpace" if self.dpace else "ce": term.detach()}
            components["ce_uniform"] = (scale * stats.nll.sum() / den_slots.clamp_min(1)).detach()
            if use_focal:
                per_block = LF.first_error_focal(ce, log_accept, first_error, self.focal_gamma)  # (N,)
                den = den_blocks if self.focal_norm == "blocks" else den_errors
                focal = scale * per_block.sum() / den.clamp_min(1)
                loss = loss + self.focal_weight * focal
                components["focal"] = focal.detach()
            if use_chain:
                reward = scale * LF.chain_reward(log_accept, mask).sum() / den_blocks.clamp_min(1)
                loss = loss - self.chain_weight * reward
                components["chain"] = reward.detach()
        return loss, components
