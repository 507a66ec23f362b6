"""``GrowingLayer``: a transformers KV-cache layer that appends in place (used by
:func:`verify.hf.new_growing_kv_cache`; this module imports transformers)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a buffer with spare columns.

    ``DynamicLayer.update`` concatenates, which copies the layer's whole cache at every step; here
    an update writes the new columns in place and ``crop`` only moves the end, so a step costs
    what it appends. A full buffer grows by a quarter (at least ``reserve`` columns).
    """

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers, self._length = None, 0

    def _set_views(self) -> None:
        self.keys = self._buffers[0][..., : self._length, :]
        self.values = self._buffers[1][..., : self._length, :]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (keys, values) buffers (B, h_kv, capacity, d): columns past ``keys.shape[-2]`` are spare."""
        return self._buffers

    def ensure_capacity(self, columns: int) -> None:
        """Room for ``columns`` columns (for a reader that writes scratch columns past the cached ones, e.g. a
        drafter sharing this cache: the next ``update`` overwrites them)."""
        if self._buffers is not None and columns > self._buffers[0].shape[-2]:
            self._grow(columns)

    def _grow(self, end: int) -> None:
        capacity = end + max(self.reserve, end // 4, 16)
        grown = []
        for old in self._buffers:
            buffer = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
            buffer[..., : self._length, :] = old[..., : self._length, :]
            grown.append(buffer)
        self._buffers = (grown[0], grown[1])
        self._set_views()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if self._buffers is None:
            self._buffers = (key_states.new_empty(*key_states.shape[:-2], 0, key_states.shape[-1]),
                             value_states.new_empty(*value_states.shape[:-2], 0, value_states.shape[-1]))
        if end > self._buffers[0].shape[-2]:
            self._grow(end)
        self._buffers[0][..., start:end, :] = key_states
        self._buffers[1][..., start:end, :] = value_states
        self._length = end
        self._set_views()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self._buffers is not None:
            self._length = self.keys.shape[-2]

    def reset(self) -> None:
        super().reset()
        self._buffers, self._length = None, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self._buffers is not None:
            self._buffers = (self._buffers[0][indices], self._buffers[1][indices])
            self._set_views()
