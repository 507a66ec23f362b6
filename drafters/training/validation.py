"""The validation metrics of :class:`drafters.training.module.DrafterLightningModule`, summed over an epoch.

One ``torchmetrics`` metric holds float64 sums (summed over processes when it is computed) from
which the ``val/...`` values are ratios:

* ``val/loss`` and ``val/<component>``: the loss and its components, mean over batches;
* ``val/tau_greedy``: kept tokens / verification steps of the teacher-forced τ (:mod:`drafters.tau`);
* ``val/tau_soft``: mean over response anchors of the expected accepted length at temperature 1;
* ``val/acc_mean`` and ``val/acc_slot<k>``: teacher-forced top-1 accuracy, pooled and per slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torchmetrics import Metric

from drafters.tau import TauCounts


def _f64(value, device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=device).detach().double()


class ValidationSums(Metric):
    """Sums behind the ``val/`` metrics for a loss with the given component names and K slots."""

    full_state_update = False

    def __init__(self, num_slots: int, components: Sequence[str], **kwargs):
        super().__init__(**kwargs)
        self.components = tuple(components)
        shapes = {"loss": (), "batches": (), "parts": (len(self.components),), "correct": (num_slots,),
                  "count": (num_slots,), "kept": (), "steps": (), "soft_sum": (), "soft_count": ()}
        for name, shape in shapes.items():
            self.add_state(name, default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, components: Mapping[str, torch.Tensor], correct: torch.Tensor,
               count: torch.Tensor, tau: TauCounts) -> None:
        """One batch: loss (), its components, per-slot correct and label counts (K,), its τ counts."""
        device = self.loss.device
        self.loss += _f64(loss, device)
        self.batches += 1.0
        if self.components:
            self.parts += torch.stack([_f64(components[name], device) for name in self.components])
        self.correct += _f64(correct, device)
        self.count += _f64(count, device)
        self.kept += float(tau.kept)
        self.steps += float(tau.steps)
        self.soft_sum += _f64(tau.soft.double().sum(), device)
        self.soft_count += _f64(tau.soft.numel(), device)

    def compute(self) -> dict[str, torch.Tensor]:
        """``{"val/...": float64 scalar}``, ``val/tau_greedy`` first."""
        batches = self.batches.clamp(min=1)
        logs = {"val/tau_greedy": self.kept / self.steps.clamp(min=1),
                "val/loss": self.loss / batches,
                "val/tau_soft": self.soft_sum / self.soft_count.clamp(min=1),
                "val/acc_mean": self.correct.sum() / self.count.sum().clamp(min=1)}
        logs.update({f"val/{name}": self.parts[i] / batches for i, name in enumerate(self.components)})
        acc = self.correct / self.count.clamp(min=1)
        logs.update({f"val/acc_slot{k + 1}": acc[k] for k in range(acc.numel())})
        return logs
