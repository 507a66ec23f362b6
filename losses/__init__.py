"""Acceptance-aligned training losses for block drafters (docs/method.md §2).

Pure functions live in :mod:`losses.functional`; :class:`AcceptanceAlignedLoss` composes them and is
built by Hydra from ``conf/loss/*.yaml``.
"""

from losses.functional import (
    SlotStats,
    chain_reward,
    chain_surrogate,
    dpace_weights,
    dpace_weights_from_accept,
    first_error_focal,
    first_error_from_argmax,
    first_error_from_correct,
    first_error_index,
    positional_weights,
    slot_cross_entropy,
    slot_statistics,
)
from losses.module import AcceptanceAlignedLoss

__all__ = [
    "AcceptanceAlignedLoss",
    "SlotStats",
    "chain_reward",
    "chain_surrogate",
    "dpace_weights",
    "dpace_weights_from_accept",
    "first_error_focal",
    "first_error_from_argmax",
    "first_error_from_correct",
    "first_error_index",
    "positional_weights",
    "slot_cross_entropy",
    "slot_statistics",
]
