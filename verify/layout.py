"""Linear weights laid out for the row counts that decoding multiplies them by (the decoding setting
``weight_layout``); the values, shapes, parameters and ties of a model are untouched.

At batch 1 a target forward over a few verified columns should cost about one 1-column step: the weights are read
from memory once either way. MKL's ``F.linear`` does not manage that on every CPU: on a Xeon (AVX-512) it falls off
a cliff at 4 rows (``experiments/results/bench/weight_layout_smollm2.json``), on an AMD EPYC (AVX2) it reads the
weights again for each added row, a 3-column forward costing 2.1x a step
(``experiments/results/bench/draft_cost_smollm2_avx2.json``).

- ``row_major``: as loaded.
- ``column_major``: each weight stored column-major, so that BLAS gets an untransposed operand (no 4-row cliff on
  the Xeon; slower there at 2-3 rows).
- ``onednn_packed``: each ``nn.Linear`` also keeps a copy of its weight packed for oneDNN, which multiplies every
  row count by it without a gradient (the kernels PyTorch's compiler uses for frozen CPU weights). On the AMD EPYC
  a 3-column forward then costs ~1.1x a 1-column step (which itself gets ~8% faster than MKL's, so target-only
  decoding, the speed baseline, uses it too). It costs a second copy of the linear weights in memory, and the copy
  does not follow later changes to the weights (lay out after loading, for decoding only).

Outputs are those of the same matrix products to float rounding of the kernel, like any change of batch shape.
"""

from __future__ import annotations

import torch
from torch import nn

LAYOUTS = ("row_major", "column_major", "onednn_packed")  # the values of the decoding setting ``weight_layout``


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) with the same values, stored column-major: strides (1, out)."""
    return weight.t().contiguous().t()


def is_column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


@torch.no_grad()
def column_major_linears(model: nn.Module) -> int:
    """Store every ``nn.Linear`` weight of ``model`` column-major, in place; a weight shared by several modules (tied
    embeddings and LM head) stays shared. Returns how many distinct weights were re-laid. Idempotent."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, nn.Linear) and not is_column_major(m.weight)}
    for key, old in weights.items():
        new = nn.Parameter(column_major(old.data), requires_grad=old.requires_grad)
        for module, name in holders[key]:
            setattr(module, name, new)
    return len(weights)


class OneDNNPackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products use ``packed``, its weight packed for oneDNN
    (:func:`onednn_packed_linears`); no rows, a gradient, another dtype or device go through ``F.linear``."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows < 1 or not x.is_cpu or x.dtype != self.packed.dtype or (torch.is_grad_enabled() and x.requires_grad):
            return super().forward(x)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


@torch.no_grad()
def onednn_packed_linears(model: nn.Module) -> int:
    """Give every float32 ``nn.Linear`` of ``model`` a oneDNN-packed copy of its weight (:class:`OneDNNPackedLinear`),
    in place; parameters and ties stay as they are. Returns how many were packed. Idempotent."""
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("weight_layout: 'onednn_packed' needs a PyTorch built with oneDNN (mkldnn), which this "
                           "one is not: use row_major or column_major")
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32]
    for module in linears:
        module.__class__ = OneDNNPackedLinear
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
    return len(linears)


def modules_of(obj, depth: int = 2) -> list[nn.Module]:
    """The ``nn.Module`` s an object is or holds: itself, or its attributes' (wrappers of wrappers, ``depth``
    levels: a policy wrapper around a block drafter, an assistant's draft model)."""
    if isinstance(obj, nn.Module):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    return [m for value in vars(obj).values() for m in modules_of(value, depth - 1)]


def set_weight_layout(layout: str, *models) -> int:
    """Lay out the linear weights of ``models`` (modules or drafter wrappers; the module doc): ``row_major`` leaves
    them as loaded. Returns how many weights were re-laid or packed."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout: {layout!r} is not one of {list(LAYOUTS)}")
    if layout == "row_major":
        return 0
    lay = column_major_linears if layout == "column_major" else onednn_packed_linears
    return sum(lay(m) for obj in models for m in modules_of(obj))
