"""Hugging Face model helpers the decoding loop needs: vocabulary and position limits, and KV caches.

A cache from :func:`new_kv_cache` is checked to support the verifier's column layout (see
:mod:`verify.drafter`); :func:`new_growing_kv_cache` is the same cache with its full-attention layers
appending in place (:mod:`verify.kv_cache`), so that a decoding step costs what it appends.
transformers is imported where it is used, so that ``import verify`` does not import it.
"""

from __future__ import annotations

import torch


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output distribution (the LM head's size, else ``config.vocab_size``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def max_positions(model: torch.nn.Module) -> int | None:
    """The model's position limit (``max_position_embeddings`` / ``n_positions``), or None if it has none."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def new_kv_cache(model: torch.nn.Module):
    """An empty ``DynamicCache`` for ``model``, checked to support the column layout.

    Sliding-window and linear-attention layers are refused: their caches cannot be rolled back
    after a rejection, and a window over columns (holes included) is not the model's window.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if any(cache.is_sliding) or any(getattr(cache, "is_linear", [])) or not cache.is_croppable:
        raise ValueError(
            f"{type(model).__name__} uses sliding-window or linear-attention cache layers, which the "
            "speculative verifier cannot crop; use a model with full attention in every layer"
        )
    return cache


def new_growing_kv_cache(model: torch.nn.Module, reserve: int):
    """:func:`new_kv_cache` with its full-attention layers appending in place (see
    :class:`verify.kv_cache.GrowingLayer`); caches of other layouts (older transformers) are returned as
    they are."""
    cache = new_kv_cache(model)
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list) and layers:
        from transformers.cache_utils import DynamicLayer

        from verify.kv_cache import GrowingLayer

        cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in layers]
    return cache
