"""Hugging Face model helpers the decoding loop needs: vocabulary and position limits, and KV caches.

A cache from :func:`new_kv_cache` is checked to support the verifier's column layout (see
:mod:`verify.drafter`); :func:`new_growing_kv_cache` is the same cache with its full-attention layers
appending in place (:mod:`verify.kv_cache`), so that a decoding step costs what it appends;
:func:`cache_argument` names the keyword under which a model's forward takes that cache.
:func:`linear_logits` applies an LM head's weight the way that is fastest on the device.
transformers is imported where it is used, so that ``import verify`` does not import it.
"""

from __future__ import annotations

import inspect

import torch

#: Vocabulary rows per matrix product of :func:`linear_logits` on CPU, and the numbers of hidden states it
#: chunks for. With 4-15 states and SmolLM2's 49,152 x 576 head, one product over the whole vocabulary cost
#: 1.2-2.3x the chunked one on this project's CPU; with 1-3 or 16 and more, the chunks cost as much or up to
#: 1.3x more (``experiments/results/bench/step_parts_smollm2.json``, ``head``).
HEAD_CHUNK = 256
CHUNKED_ROWS = range(4, 16)


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


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes its KV cache: ``cache`` where the forward names it (newer
    transformers, which warn that ``past_key_values`` is deprecated), else ``past_key_values``. A forward that
    names neither (``*args, **kwargs``, e.g. a subclass's wrapper) passes it on: its base class's forward decides."""
    for cls in type(model).__mro__:
        forward = vars(cls).get("forward")
        if forward is None:
            continue
        try:
            parameters = inspect.signature(forward).parameters  # follows functools.wraps to the real forward
        except (TypeError, ValueError):
            break
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    return "past_key_values"


def linear_logits(weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:  # (V, H), (N, H) -> (N, V)
    """``states @ weight.T``: the logits of an LM head without bias, e.g. ``head.weight``.

    On CPU, for :data:`CHUNKED_ROWS` states, in chunks of :data:`HEAD_CHUNK` vocabulary rows written into one
    output:
    every logit is the same dot product as in one product over the whole vocabulary (bit-identical on this
    project's CPU), but a chunk of the weight stays in cache while the states stream past it. With
    other numbers of states, on another device, or where autograd must record it, one product.
    """
    if weight.ndim != 2 or states.ndim != 2 or states.shape[1] != weight.shape[1]:
        raise ValueError(f"expected a head weight (V, H) and states (N, H), got {tuple(weight.shape)} and "
                         f"{tuple(states.shape)}")
    needs_grad = torch.is_grad_enabled() and (states.requires_grad or weight.requires_grad)  # out= has no autograd
    chunked = states.shape[0] in CHUNKED_ROWS and weight.shape[0] > HEAD_CHUNK and states.device.type == "cpu"
    if needs_grad or not chunked:
        return torch.nn.functional.linear(states, weight)
    out = states.new_empty(states.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], HEAD_CHUNK):
        torch.mm(states, weight[start : start + HEAD_CHUNK].T, out=out[:, start : start + HEAD_CHUNK])
    return out
