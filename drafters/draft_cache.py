"""What a drafter keeps of the columns it has been shown while drafting: :class:`DraftCache`.

Context features depend on the columns only, so a drafter computes each column's context keys/values once, when
the verifier appends it (:meth:`drafters.model.DFlashDrafter.extend`), and a draft step runs its block's slots
only. Per drafter layer the cache holds the rotated keys/values of every column appended so far (holes included,
masked out by the column mask), plus the columns' mask and token ids, in buffers with spare columns: appending
writes in place, and a draft writes its block's own keys/values just past the cached columns
(:class:`drafters.layers.CachedContext`), so that attention reads one view and no step copies the cache.

Where a drafter's context keys/values are exactly what the target cached (:mod:`drafters.shared_cache`), the
keys/values are the target cache's own layers instead of a copy: offered before the first column
(:meth:`DraftCache.offer`), kept after the first columns compare equal (:meth:`DraftCache.decide_sharing`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drafters.shared_cache import same_keys_values

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer (keys, values), each (B, h_kv, columns, d)


class DraftCache:
    """The appended columns of ``rows`` rows for a drafter of ``num_layers`` layers (keys/values shaped
    (rows, num_kv_heads, columns, head_dim), of ``like``'s dtype and device)."""

    def __init__(self, rows: int, num_layers: int, num_kv_heads: int, head_dim: int, like: torch.Tensor) -> None:
        self.columns = 0
        self.num_layers, self.num_kv_heads, self.head_dim, self.like = num_layers, num_kv_heads, head_dim, like
        self.own: KV | None = None  # the drafter's own keys/values buffers, made at the first reserve
        self.target_layers: list | None = None  # the target cache's layers offered, kept while they may be shared
        self.shared = False  # whether target_layers' buffers are the context keys/values (decided at the first columns)
        self.mask_buffer = torch.zeros(rows, 0, dtype=torch.bool, device=like.device)
        self.ids_buffer = torch.zeros(rows, 0, dtype=torch.long, device=like.device)

    @property
    def rows(self) -> int:
        return self.mask_buffer.shape[0]

    @property
    def mask(self) -> torch.Tensor:
        """(B, columns) bool: the appended columns that are real tokens."""
        return self.mask_buffer[:, : self.columns]

    @property
    def ids(self) -> torch.Tensor:
        """(B, columns) long: the appended columns' token ids."""
        return self.ids_buffer[:, : self.columns]

    def kv_buffers(self) -> KV | None:
        """Per layer (keys, values) buffers with spare columns: the target cache's when shared, else the own."""
        return [layer.buffers for layer in self.target_layers] if self.shared else self.own

    def offer(self, layers: Sequence | None) -> None:
        """The target cache's layers holding this drafter's context keys/values if they could (None: never)."""
        if self.columns:
            raise RuntimeError("bind_target_cache comes after reset and before the first extend")
        self.target_layers = None if layers is None else list(layers)

    @property
    def awaits_sharing_check(self) -> bool:
        return self.target_layers is not None and not self.shared

    def decide_sharing(self, kv: KV, new_columns: int) -> None:
        """Share the offered layers if ``kv``, the drafter's own keys/values of the last (up to 4) of the
        ``new_columns`` about to be appended, are what the target cached there; else forget the offer."""
        self.shared = same_keys_values(kv, self.target_layers, self.columns + new_columns)
        if not self.shared:
            self.target_layers = None

    def reserve(self, columns: int) -> None:
        """Room for ``columns`` columns in the buffers (they grow by a quarter, at least 64 columns)."""
        if self.shared:  # the block's scratch keys/values go just past the target's cached columns
            for layer in self.target_layers:
                layer.ensure_capacity(columns)
        capacity = self.mask_buffer.shape[1]
        # Buffers made under torch.inference_mode cannot be written outside it: copy them then.
        stale = self.mask_buffer.is_inference() and not torch.is_inference_mode_enabled()
        if columns <= capacity and not stale:
            return
        if columns > capacity:
            capacity = columns + max(64, columns // 4)
        c, device = self.columns, self.like.device
        mask = torch.zeros(self.rows, capacity, dtype=torch.bool, device=device)
        ids = torch.zeros(self.rows, capacity, dtype=torch.long, device=device)
        mask[:, :c] = self.mask_buffer[:, :c]
        ids[:, :c] = self.ids_buffer[:, :c]
        self.mask_buffer, self.ids_buffer = mask, ids
        if not self.shared:
            self.own = [self._grown_kv(layer, capacity) for layer in range(self.num_layers)]

    def _grown_kv(self, layer: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s own keys/values buffers with ``capacity`` columns, holding the appended ones."""
        c, shape = self.columns, (self.rows, self.num_kv_heads, capacity, self.head_dim)
        k, v = self.like.new_empty(shape), self.like.new_empty(shape)
        if self.own is not None and c > 0:
            k[:, :, :c] = self.own[layer][0][:, :, :c]
            v[:, :, :c] = self.own[layer][1][:, :, :c]
        return k, v

    def append(self, kv: KV | None, attention_mask: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Append n columns (room reserved): their keys/values ``kv`` (per layer (B, h_kv, n, d); None when shared,
        the target having cached them), attention_mask and input_ids (B, n)."""
        c, n = self.columns, attention_mask.shape[1]
        if self.shared:  # the target has cached these columns' keys/values: check it holds exactly them
            if any(layer.keys.shape[-2] != c + n or layer.keys.shape[0] != self.rows for layer in self.target_layers):
                raise RuntimeError(f"the shared target cache holds {tuple(self.target_layers[0].keys.shape)} "
                                   f"(B, h_kv, columns, d), expected {self.rows} rows and {c + n} columns")
        else:
            for (k_buffer, v_buffer), (k, v) in zip(self.own, kv, strict=True):
                k_buffer[:, :, c : c + n] = k
                v_buffer[:, :, c : c + n] = v
        self.mask_buffer[:, c : c + n] = attention_mask.bool()
        self.ids_buffer[:, c : c + n] = input_ids
        self.columns = c + n

    def open_block(self, width: int) -> torch.Tensor:
        """Room for a block of ``width`` columns past the appended ones, marked as seen; the mask (B, columns +
        width) bool a draft's attention reads."""
        c = self.columns
        self.reserve(c + width)
        self.mask_buffer[:, c : c + width] = True  # block slots: past the cached columns, see each other
        return self.mask_buffer[:, : c + width]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (b,) long (the target's shared cache must have selected them first)."""
        if self.shared and self.target_layers[0].keys.shape[0] != rows.shape[0]:
            raise RuntimeError("select the shared target cache's rows (batch_select_indices) before the drafter's")
        if self.own is not None:
            self.own = [(k[rows], v[rows]) for k, v in self.own]
        self.mask_buffer, self.ids_buffer = self.mask_buffer[rows], self.ids_buffer[rows]
