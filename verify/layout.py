"""Column-major linear weights: the same values and shapes as PyTorch's ``(out, in)`` weights, stored so that
``F.linear`` hands BLAS a plain (untransposed) operand.

On this CPU's BLAS, ``F.linear`` over a row-major weight falls off a cliff at 4 rows and more: SmolLM2's 576->1536
projection costs several times more at 4 rows than at 3 (``experiments/results/bench/weight_layout_smollm2.json``),
which makes a target forward over 4+ verified columns cost far more than its arithmetic. A column-major weight has
no such cliff. The values are untouched, so a model's outputs are those of the same matrix products (to float
rounding of the BLAS kernel, like any change of batch shape).
"""

from __future__ import annotations

import torch
from torch import nn

LAYOUTS = ("row_major", "column_major")  # the values of the decoding setting ``weight_layout``


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


def modules_of(obj, depth: int = 2) -> list[nn.Module]:
    """The ``nn.Module`` s an object is or holds: itself, or its attributes' (wrappers of wrappers, ``depth``
    levels: a policy wrapper around a block drafter, an assistant's draft model)."""
    if isinstance(obj, nn.Module):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    return [m for value in vars(obj).values() for m in modules_of(value, depth - 1)]


def set_weight_layout(layout: str, *models) -> int:
    """Lay out the linear weights of ``models`` (modules or drafter wrappers): ``row_major`` leaves them as loaded,
    ``column_major`` re-lays them (:func:`column_major_linears`). Returns how many weights were re-laid."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout: {layout!r} is not one of {list(LAYOUTS)}")
    if layout == "row_major":
        return 0
    return sum(column_major_linears(m) for obj in models for m in modules_of(obj))
