"""Optimiser parameter groups and learning-rate schedules of drafter training."""

from __future__ import annotations

import math

import torch
from torch import nn


def weight_decay_groups(model: nn.Module) -> list[dict]:
    """Parameter groups of ``model``'s trainable parameters: biases and norm weights get no weight
    decay (``{"params": decay}, {"params": no_decay, "weight_decay": 0.0}``)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        leaf = name.split(".")
        (no_decay if leaf[-1] == "bias" or "norm" in leaf[-2] else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x lr at ``max_steps``."""
    if warmup_steps < 0 or max_steps < 1 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"bad schedule: warmup_steps={warmup_steps}, max_steps={max_steps}, "
                         f"min_lr_ratio={min_lr_ratio}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
