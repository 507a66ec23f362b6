"""Drafting: the :class:`verify.drafter.Drafter` protocol of a block drafter (the inference half of
:class:`drafters.model.DFlashDrafter`).

The cache holds, per drafter layer, the rotated keys/values of every column appended so far (holes
included, masked out by the column mask). Context features depend on the columns only, so these never
need recomputing: a draft step runs the B block slots only. Keys, values and the column mask live in
buffers with spare columns: :meth:`DraftingMixin.extend` writes the new columns in place, and a draft
writes the block's own keys/values just past the cached columns (:class:`drafters.layers.CachedContext`),
so that attention reads one view and no step copies the cache.

How many slots a step verifies, and whether a row copies a lookup hint instead, is decoding policy:
:class:`drafters.policy.PolicyDrafter` wraps a drafter with those settings; :meth:`DraftingMixin.draft`
here drafts every slot of every row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from drafters.attention import draft_block_mask
from drafters.layers import CachedContext, rope_cos_sin
from drafters.shared_cache import same_keys_values
from verify.rejection import sample_tokens, warp_probs


class Block(NamedTuple):
    """One block per row at drafting, as the drafter's layers read it (:meth:`DraftingMixin.block_inputs`)."""

    ids: torch.Tensor  # (B, N) long: anchor, then MASK or a slot input (lookup hint) in each slot
    cos: torch.Tensor  # (B, N, d) RoPE
    sin: torch.Tensor  # (B, N, d)
    columns: int  # cached columns before the block
    mask: torch.Tensor  # (B, 1, 1 or N, columns + N) bool: the keys each slot sees
    #: Slot inputs of variants that read them (lookup hints): ``(hints (B, K), ngram (B,), from_store (B,) bool)``
    #: over all K slots, else None.
    hints: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def propose(logits: torch.Tensor, temperature: float, top_k, top_p, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from slot logits (B, W, V): ``(argmax (B, W), None)`` at temperature 0, else ``(tokens drawn from
    q, q (B, W, V) float32)`` with q the warped distributions. Slots of a block are conditionally independent
    given the context (one forward pass), so ``tokens[:, k]`` is a draw from ``q[:, k]`` given the drafts before it."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = warp_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return sample_tokens(q, generator), q


class DraftingMixin:
    """reset / bind_target_cache / extend / draft / select_rows over a per-layer key/value cache."""

    def reset(self, batch_size: int) -> None:
        self._columns = 0
        self._kv_buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (B, h_kv, cap, d)
        self._target_layers: list | None = None  # the target cache's layers offered by bind_target_cache
        self._shared = False  # whether _target_layers' buffers are the context keys/values (decided at the first extend)
        self._mask_buffer = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.weight_ref.device)
        self._ids_buffer = torch.zeros(batch_size, 0, dtype=torch.long, device=self.weight_ref.device)
        self._set_views()

    @property
    def shares_target_cache(self) -> bool:
        """Whether the context keys/values are read from the target's KV cache (see :meth:`bind_target_cache`)."""
        return bool(getattr(self, "_shared", False))

    def _shareable_layers(self, cache) -> list | None:
        """The target cache's layers holding this drafter's context keys/values, if it could (a variant whose
        layer i reads the input of a target layer); None: the fused DFlash context is never the target's."""
        return None

    def bind_target_cache(self, cache) -> None:
        """Offer the target's KV cache (the verifier, after :meth:`reset` and before the first :meth:`extend`).

        The first ``extend`` computes its last columns' keys/values and compares them with the target's
        (:func:`drafters.shared_cache.same_keys_values`); if they agree, the drafter reads its context from
        the target's cache from then on (the verifier crops it to the committed columns and selects its rows
        before calling :meth:`extend` and :meth:`select_rows`), else it keeps its own as without the offer.
        """
        self._require_cache()
        if self._columns:
            raise RuntimeError("bind_target_cache comes after reset and before the first extend")
        self._target_layers = self._shareable_layers(cache)

    def _decide_sharing(self, hidden_states, position_ids) -> None:
        """At the first extend after :meth:`bind_target_cache`: share the target's cache if its last columns
        (up to 4) hold this drafter's own keys/values."""
        if self._target_layers is None or self._shared:
            return
        m = min(4, position_ids.shape[1])
        kv = self.context_kv([h[:, -m:] for h in hidden_states], position_ids[:, -m:])
        self._shared = same_keys_values(kv, self._target_layers, self._columns + position_ids.shape[1])
        if not self._shared:
            self._target_layers = None

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (keys, values) buffers (B, h_kv, capacity, d): the drafter's own, or the target cache's."""
        return [layer.buffers for layer in self._target_layers] if self._shared else self._kv_buffers

    def _set_views(self) -> None:
        cfg, c, kv = self.config, self._columns, self._kv()
        if kv is None:
            empty = self.weight_ref.new_zeros(self._mask_buffer.shape[0], cfg.num_kv_heads, 0, cfg.head_dim)
            self._cache_kv = [(empty, empty) for _ in self.layers]
        else:
            self._cache_kv = [(k[:, :, :c], v[:, :, :c]) for k, v in kv]
        self._cache_mask = self._mask_buffer[:, :c]

    def _reserve(self, columns: int) -> None:
        """Room for ``columns`` columns in the buffers (they grow by a quarter, at least 64 columns)."""
        if self._shared:  # the block's scratch keys/values go just past the target's cached columns
            for layer in self._target_layers:
                layer.ensure_capacity(columns)
        capacity = self._mask_buffer.shape[1]
        # Buffers made under torch.inference_mode cannot be written outside it: copy them then.
        stale = self._mask_buffer.is_inference() and not torch.is_inference_mode_enabled()
        if columns <= capacity and not stale:
            return
        if columns > capacity:
            capacity = columns + max(64, columns // 4)
        cfg, c, w = self.config, self._columns, self.weight_ref
        rows = self._mask_buffer.shape[0]
        mask = torch.zeros(rows, capacity, dtype=torch.bool, device=w.device)
        mask[:, :c] = self._mask_buffer[:, :c]
        ids = torch.zeros(rows, capacity, dtype=torch.long, device=w.device)
        ids[:, :c] = self._ids_buffer[:, :c]
        self._mask_buffer, self._ids_buffer = mask, ids
        if self._shared:
            return
        buffers = []
        for i in range(len(self.layers)):
            k = w.new_empty(rows, cfg.num_kv_heads, capacity, cfg.head_dim)
            v = w.new_empty(rows, cfg.num_kv_heads, capacity, cfg.head_dim)
            if self._kv_buffers is not None and c > 0:
                k[:, :, :c] = self._kv_buffers[i][0][:, :, :c]
                v[:, :, :c] = self._kv_buffers[i][1][:, :, :c]
            buffers.append((k, v))
        self._kv_buffers = buffers

    def _require_cache(self) -> None:
        if self._cache_kv is None or self._cache_mask is None:
            raise RuntimeError("drafter cache is empty: call reset(batch_size) before extend/draft")

    def _check_extend(self, attention_mask, hidden_states) -> None:
        rows, n = attention_mask.shape
        if rows != self._cache_mask.shape[0]:
            raise ValueError(f"extend got {rows} rows, the cache holds {self._cache_mask.shape[0]}")
        if hidden_states is None or len(hidden_states) != len(self.target_layer_ids):
            got = None if hidden_states is None else len(hidden_states)
            raise ValueError(f"extend needs {len(self.target_layer_ids)} hidden states (target_layer_ids "
                             f"{self.target_layer_ids}), got {got}")
        if any(tuple(s.shape[:2]) != (rows, n) for s in hidden_states):
            shapes = [tuple(s.shape) for s in hidden_states]
            raise ValueError(f"hidden states {shapes} do not match the new columns {(rows, n)}")

    @torch.no_grad()
    def extend(self, input_ids, attention_mask, position_ids, hidden_states) -> None:
        """Append n columns: input_ids/attention_mask/position_ids (B, n); hidden_states L x (B, n, H)."""
        self._require_cache()
        self._check_extend(attention_mask, hidden_states)
        rows, n = attention_mask.shape
        if n == 0:
            return
        self._decide_sharing(hidden_states, position_ids)
        c = self._columns
        self._reserve(c + n + self.config.block_size)  # room for the next draft's block too
        if self._shared:  # the target has cached these columns' keys/values: check it holds exactly them
            if any(layer.keys.shape[-2] != c + n or layer.keys.shape[0] != rows for layer in self._target_layers):
                raise RuntimeError(f"the shared target cache holds {tuple(self._target_layers[0].keys.shape)} "
                                   f"(B, h_kv, columns, d), expected {rows} rows and {c + n} columns")
        else:
            for (k_buffer, v_buffer), (k, v) in zip(self._kv_buffers, self.context_kv(hidden_states, position_ids)):
                k_buffer[:, :, c : c + n] = k
                v_buffer[:, :, c : c + n] = v
        self._mask_buffer[:, c : c + n] = attention_mask.bool()
        self._ids_buffer[:, c : c + n] = input_ids
        self._columns = c + n
        self._set_views()

    def select_rows(self, rows: torch.Tensor) -> None:
        self._require_cache()
        if self._shared and self._target_layers[0].keys.shape[0] != rows.shape[0]:
            raise RuntimeError("select the shared target cache's rows (batch_select_indices) before the drafter's")
        if self._kv_buffers is not None:
            self._kv_buffers = [(k[rows], v[rows]) for k, v in self._kv_buffers]
        self._mask_buffer, self._ids_buffer = self._mask_buffer[rows], self._ids_buffer[rows]
        self._set_views()

    # ---- one block per row ------------------------------------------------------------------------

    def _slot_inputs(self, ids: torch.Tensor, columns: int):
        """Fill slots 1.. of the block tokens ids (B, N) in place (DFlash: they stay MASK); returns the
        :attr:`Block.hints` of variants that read slot inputs, else None."""
        return

    def block_inputs(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor,
                     width: int | None = None) -> Block:
        """The :class:`Block` of one block per row after every cached column: anchor_ids, anchor_position_ids
        (B,) long; cut to the columns that draft slots 1..``width`` (default K: the whole block)."""
        self._require_cache()
        cfg = self.config
        rows, c = self._mask_buffer.shape[0], self._columns
        bs = cfg.block_size if width is None else width + 1
        self._reserve(c + bs)
        self._mask_buffer[:, c : c + bs] = True  # block slots: past the cached columns, see each other
        mask = draft_block_mask(self._mask_buffer[:, : c + bs], self._own_mask(bs, self._mask_buffer.device))
        ids = anchor_ids.new_full((rows, bs), cfg.mask_token_id)  # (B, N) [anchor, MASK x (N - 1)]
        ids[:, 0] = anchor_ids.reshape(rows)
        hints = self._slot_inputs(ids, c)
        positions = anchor_position_ids.reshape(rows, 1) + torch.arange(bs, device=ids.device)  # (B, N)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.weight_ref.dtype)
        return Block(ids, cos, sin, c, mask, hints)

    def block_states(self, block: Block, rows: torch.Tensor | None = None) -> torch.Tensor:
        """States (b, K', H) of the drafted slots of ``block`` (the LM head's input) for ``rows`` (b,) long,
        default every row. Other rows' cached columns are copied, not computed on."""
        ids, cos, sin, columns, mask, _ = block
        kv = self._kv()
        if rows is not None:  # the block's own keys/values are scratch: writing them into a copy is fine
            end = columns + ids.shape[1]
            ids, cos, sin, mask = ids[rows], cos[rows], sin[rows], mask[rows]
            kv = [(k[rows, :, :end], v[rows, :, :end]) for k, v in kv]
        return self.block_passes(ids, cos, sin, columns, mask, kv)

    def block_passes(self, ids, cos, sin, columns: int, mask, kv) -> torch.Tensor:
        """The passes over the block that give its drafted states: one :meth:`block_pass` (DFlash)."""
        return self.block_pass(ids, cos, sin, columns, mask, kv)

    def block_pass(self, ids, cos, sin, columns: int, mask, kv) -> torch.Tensor:
        """One pass of the drafter's layers over the block tokens ids (B, N) after ``columns`` cached columns
        of ``kv`` (per layer (keys, values) buffers); normalised states (B, K', H) of the drafted slots. Writes
        the block's keys/values past the cached columns."""
        x = self.target.get_input_embeddings()(ids).to(self.weight_ref.dtype)  # (B, N, H)
        last, n = len(self.layers) - 1, ids.shape[1]
        for i, (layer, (k_buffer, v_buffer)) in enumerate(zip(self.layers, kv)):
            x = layer(x, cos, sin, CachedContext(k_buffer, v_buffer, columns, mask), n,
                      keep=self.drafted_slots if i == last else None)
        return self.norm(x)  # (B, K', H): the last layer kept the drafted slots only

    @torch.no_grad()
    def draft_logits(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, K, V) of one block per row, seeing every committed cached column: the same computation
        as :meth:`block_logits` with one block per row after every cached column."""
        return self.head(self.block_states(self.block_inputs(anchor_ids, anchor_position_ids)))

    @torch.no_grad()
    def draft(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor, *, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, K) and, when sampling, q (B, K, V) float32: every slot of every row (:func:`propose`)."""
        block = self.block_inputs(anchor_ids, anchor_position_ids)
        self._sources = self.source_labels(block, None)
        return propose(self.head(self.block_states(block)), temperature, top_k, top_p, generator)

    def source_labels(self, block: Block, copied: torch.Tensor | None) -> list[str] | None:
        """Per row of ``block``, what drafts it, given the rows that copy a slot input (``copied`` (B,) bool or
        None); None: unlabelled (DFlash: the drafter drafts every row)."""
        return None

    def draft_sources(self) -> list[str] | None:
        """What drafted each row of the last :meth:`draft` (the drafter protocol's optional labels, recorded by
        the verifier beside the accepted counts)."""
        return getattr(self, "_sources", None)


__all__ = ["Block", "DraftingMixin", "propose"]
