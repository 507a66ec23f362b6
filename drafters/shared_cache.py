"""Reading a drafter's context keys/values from the target's own KV cache.

A layerwise drafter's layer i computes a context column's keys/values from the input of the target layer
``target_layer_ids[i]``, through its own input norm, k/v projections, k norm and RoPE. When those are the
target layer's (layers copied from the target and kept frozen, as ``frozen_anchor`` does), the result is
exactly what the target cached for that column in that layer: the drafter can read the target's cache instead
of computing and keeping a copy of it. Which is the case is checked on numbers, not on names: the first
columns the drafter is given are computed both ways and compared (:func:`same_keys_values`).

The cache layers must be :class:`verify.kv_cache.GrowingLayer`-like (``buffers`` with spare columns and
``ensure_capacity``), so that a draft can write its block's scratch keys/values just past the cached columns,
where the target's next ``update`` overwrites them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Largest relative difference (Frobenius norm of the difference over that of the target's tensor, per layer)
#: at which the drafter's keys/values count as the target's: float rounding of the same computation (bf16
#: included) stays far below it; another layer's, or retrained projections', are of order 1.
TOLERANCE = 1e-2


def shareable_layers(cache, layer_ids: Sequence[int]) -> list | None:
    """The target cache's layers that drafter layer i would read (``layer_ids[i]``), or None where the cache
    cannot be shared (no per-layer list, a layer id past the target's layers, layers without spare columns)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not layer_ids or max(layer_ids) >= len(layers) or min(layer_ids) < 0:
        return None
    picked = [layers[i] for i in layer_ids]
    if not all(hasattr(layer, "buffers") and hasattr(layer, "ensure_capacity") for layer in picked):
        return None
    return picked


def same_keys_values(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layers: Sequence, end: int) -> bool:
    """Whether the drafter's keys/values ``kv`` (per layer (B, h_kv, m, d)) of the columns ``end - m .. end`` are
    the ones the target cached there, in every layer (same shape and dtype, within :data:`TOLERANCE`)."""
    for (k, v), layer in zip(kv, layers, strict=True):
        if layer.buffers is None or layer.keys.shape[-2] != end:
            return False
        m = k.shape[-2]
        for mine, theirs in ((k, layer.keys[..., end - m : end, :]), (v, layer.values[..., end - m : end, :])):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                return False
            scale = theirs.float().norm().clamp_min(1e-12)
            if (mine.float() - theirs.float()).norm() > TOLERANCE * scale:
                return False
    return True
