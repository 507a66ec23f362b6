"""Cached target features: the frozen target's selected hidden states, computed once per sequence.

A drafter step then costs only the drafter: the target forward (the larger share of a training
step, see ``experiments.bench.train``) runs once per regenerated sequence instead of once per step.

Layout, beside the regenerated data (``<data dir>/features/<key>/``, ``key`` names the layers, the
dtype, the length limit and, for a bfloat16 pass, ``_bf16``)::

    meta.json               layer ids, dtype, max_length, target fingerprint, rows, precision, "complete",
                            part_seals: each file's sha256, size and mtime (an edited or cut part is named, redone)
    part-00000.npy          (tokens, L*H) the concatenated hidden states of rows [0, n0), flat
    part-00000.offsets.npy  (n0 + 1,) int64: row i of the part spans offsets[i]:offsets[i + 1]
    part-00001.npy ...

Row order is the data dir's row order (``drafters.training.datamodule.load_regenerated``); part i holds rows
[i * rows_per_part, (i + 1) * rows_per_part). Parts are written to a temporary name and renamed into place, so a
killed job leaves only whole parts; computing again (:func:`compute_features`) redoes the parts that are missing or
damaged (unreadable, or holding another token count than their offsets say), and only those. Parts are memory-mapped when read, so the cache may exceed the machine's memory.
The feature of column c is ``concat(hidden_states[i][c] for i in target_layer_ids)``: exactly what
:meth:`drafters.model.DFlashDrafter.context_kv` reads, so the drafter's context path (trained)
still runs on every step.

``target_layer_ids == ("head",)`` (:data:`HEAD`) caches instead the input of the target's output embeddings
(its final, normed state, (tokens, H)): the frozen LM head turns it back into the target's logits, so a
soft-label loss gets the target's distributions at the drafted slots without running the target
(:func:`drafters.training.blocks.select_blocks`).

Precision and storage. The target's pass runs in ``precision``: ``float32``, or ``bfloat16`` (autocast: the
target's matmuls in bfloat16, its weights, norms and residual sums in float32), which training chooses where it
trains under bfloat16 autocast (``experiments.pipeline.trainer.compute_dtype``: a CPU with bfloat16
instructions), ~1.7x the tokens/s of float32 on a Zen 4 EPYC (docs/bench.md, ``precision``). Either way the
features are stored in ``dtype``, float16 by default: half the disk and page cache of float32, and 11 significant bits, more than the
8 of a bfloat16 matmul's output, so storing adds little to what the pass rounded (numpy has no bfloat16 to store
them in as computed). They are read back as float32 (:class:`FeatureStore`); under bfloat16 autocast the drafter's
context projection rounds them to bfloat16 again. ``meta.json`` records the precision; a cache computed in another
precision is named and computed again in full (:func:`compute_features`), never mixed part by part with this one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from drafters.config import accepts_argument
from drafters.storage import BrokenSealError, check_seal_entry, seal_entry, write_json_atomic

META = "meta.json"
SEALS = "part_seals"  # meta.json's seals of the parts: {file name: {sha256, size, mtime_ns}} (drafters.storage)
HEAD = "head"  # the layer id of the target's final state, the input of its LM head
DTYPES = {"float16": np.float16, "float32": np.float32}
PRECISIONS = ("float32", "bfloat16")  # the target's pass (module doc); the cache key names the second ``_bf16``
REDO = "run the training again: it computes the damaged parts, and only those, again"


def features_key(target_layer_ids: Sequence[int], dtype: str, max_length: int | None,
                 precision: str = "float32") -> str:
    """Folder name of a feature cache: ``layers-1-3-6_float16_len512``, ``..._len512_bf16`` for a bfloat16 pass
    (so caches of both precisions live side by side)."""
    if dtype not in DTYPES:
        raise ValueError(f"features dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _check_precision(precision)
    layers = "-".join(str(_layer_id(i)) for i in target_layer_ids)
    suffix = "_bf16" if precision == "bfloat16" else ""
    return f"layers-{layers}_{dtype}_len{max_length if max_length is not None else 'all'}{suffix}"


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"features precision must be one of {list(PRECISIONS)}, got {precision!r}")


def _layer_id(i):
    return HEAD if i == HEAD else int(i)


def features_dir(data_dir: str | Path, target_layer_ids: Sequence[int], dtype: str,
                 max_length: int | None, precision: str = "float32") -> Path:
    return Path(data_dir).expanduser() / "features" / features_key(target_layer_ids, dtype, max_length, precision)


def _parts(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("part-*.npy") if not p.name.endswith(".offsets.npy"))


def _part(root: Path, index: int) -> Path:
    return root / f"part-{index:05d}.npy"


def _whole_rows(part: Path) -> int | None:
    """The rows of a readable, whole part (its token count is its offsets' last); None: missing or damaged."""
    try:
        offsets = np.load(part.with_suffix(".offsets.npy"), mmap_mode="r")
        tokens = np.load(part, mmap_mode="r").shape[0]
    except (OSError, ValueError):
        return None
    return len(offsets) - 1 if len(offsets) and tokens == offsets[-1] else None


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


@torch.no_grad()
def _encode(target, rows: Sequence[list[int]], layer_ids: Sequence[int], device,
            precision: str = "float32") -> list[torch.Tensor]:
    """Selected hidden states of right-padded rows: one (len_i, L*H) float tensor per row, the target run in
    ``precision`` (module doc)."""
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        return _encode_padded(target, rows, layer_ids, device)


def _encode_padded(target, rows: Sequence[list[int]], layer_ids: Sequence[int], device) -> list[torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.as_tensor(r)
        mask[b, : len(r)] = 1
    if list(layer_ids) == [HEAD]:
        states = _head_states(target, ids.to(device), mask.to(device))
    else:
        out = target(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                     use_cache=False,
                     **({"logits_to_keep": 1} if accepts_argument(target.forward, "logits_to_keep") else {}))
        states = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1).float().cpu()  # (B, S, L*H)
    return [states[b, : len(r)] for b, r in enumerate(rows)]


def _head_states(target, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, S, H) float: what the target's output embeddings read at every column. Refuses a target whose
    logits are not that head's output (e.g. soft-capped after it): the cache could not reproduce them."""
    head, seen = target.get_output_embeddings(), []
    hook = head.register_forward_pre_hook(lambda _module, args: seen.append(args[0].detach()))
    try:
        logits = target(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        hook.remove()
    if len(seen) != 1 or seen[0].shape[:2] != ids.shape:
        raise ValueError(f"target {type(target).__name__}: its output embeddings ran {len(seen)} times, not once over "
                         "every column; the head-state cache needs logits = lm_head(final state)")
    if not torch.allclose(head(seen[0][:, -1:]).float(), logits[:, -1:].float(), atol=1e-3, rtol=1e-3):
        raise ValueError(f"target {type(target).__name__}: its logits are not its LM head's output (post-processed, "
                         "e.g. soft-capped); soft labels cannot be rebuilt from cached final states")
    return seen[0].float().cpu()


def _encode_rows(target, rows: list[list[int]], layer_ids: Sequence[int], device, batch_size: int, bar,
                 precision: str = "float32") -> list:
    """:func:`_encode` of ``rows`` in batches of like lengths (little padding), in the rows' order."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    feats: list[torch.Tensor | None] = [None] * len(rows)
    for s in range(0, len(rows), batch_size):
        batch = order[s: s + batch_size]
        for i, feat in zip(batch, _encode(target, [rows[i] for i in batch], layer_ids, device, precision)):
            feats[i] = feat
        bar.update(len(batch))
    return feats


def compute_features(target, input_ids: Sequence[Sequence[int]], out_dir: str | Path, *,
                     target_layer_ids: Sequence[int], dtype: str = "float16", max_length: int | None = None,
                     fingerprint: dict | None = None, batch_size: int = 8, rows_per_part: int = 256,
                     progress: bool = True, precision: str = "float32") -> Path:
    """Write the feature cache of ``input_ids`` (every row, cut to ``max_length``) into ``out_dir``, the target
    run in ``precision`` (``float32`` or ``bfloat16``, module doc), stored in ``dtype``.

    Computes only the parts that are missing or damaged (a complete, whole cache returns at once); a folder
    computed in another precision (one without a recorded precision was float32) is named and computed again in
    full; a folder written with other settings is refused.
    """
    _check_precision(precision)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    meta = {"target_layer_ids": [_layer_id(i) for i in target_layer_ids], "dtype": dtype,
            "max_length": max_length, "target_fingerprint": fingerprint, "rows": len(input_ids)}
    old = _same_precision_meta(root, precision)
    if old and {k: old.get(k) for k in meta} != meta:
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        raise ValueError(f"feature cache {root} was written with other settings {diff} (saved, now): "
                         "delete the folder or change data.features")
    spans = [(a, min(a + rows_per_part, len(input_ids))) for a in range(0, len(input_ids), rows_per_part)]
    todo = [i for i, (a, b) in enumerate(spans) if _whole_rows(_part(root, i)) != b - a]
    seals = dict(old.get(SEALS) or {})
    for i in range(len(spans)):
        broken = None if i in todo else _broken_seal(_part(root, i), seals)
        if broken:
            print(f"[features] {broken}: computing its rows again", flush=True)
            todo.append(i)
    unsealed = [i for i in range(len(spans)) if i not in todo and not _sealed(_part(root, i), seals)]
    if old.get("complete") and not todo:
        if unsealed:  # a cache from before seals, whole: sealed as it is now
            meta_now = {**old, SEALS: {**seals, **_seal(root, unsealed)}}
            write_json_atomic(root / META, meta_now)
        return root
    for i in todo:
        if _part(root, i).exists() or _part(root, i).with_suffix(".offsets.npy").exists():
            print(f"[features] {_part(root, i)} is damaged: computing its rows again", flush=True)
    meta["precision"] = precision
    redone = {path.name for i in todo for path in _files(_part(root, i))}
    seals = {name: entry for name, entry in seals.items() if name not in redone}  # kept through a killed run
    write_json_atomic(root / META, {**meta, "complete": False, SEALS: seals})  # a stop mid-write keeps the old one
    device = next(target.parameters()).device
    rows = [list(r[:max_length] if max_length else r) for r in input_ids]
    bar = tqdm(total=len(rows), initial=len(rows) - sum(spans[i][1] - spans[i][0] for i in todo),
               desc="target features", unit="row", disable=not progress)
    for index in todo:
        feats = _encode_rows(target, rows[spans[index][0]: spans[index][1]], target_layer_ids, device, batch_size, bar,
                             precision)
        offsets = np.cumsum([0] + [len(f) for f in feats]).astype(np.int64)
        part = _part(root, index)
        _save_atomic(part.with_suffix(".offsets.npy"), offsets)  # offsets first: a part implies them
        _save_atomic(part, torch.cat(feats).numpy().astype(DTYPES[dtype]))
    bar.close()
    seals = {**seals, **_seal(root, sorted(set(todo) | set(unsealed)))}
    write_json_atomic(root / META, {**meta, "complete": True, SEALS: seals})
    return root


def _same_precision_meta(root: Path, precision: str) -> dict:
    """The cache's meta.json; a cache computed in another precision (none recorded: float32) is named and deleted
    (every part, and its meta: {}), so that it is computed again in full, never mixed with parts of this one."""
    old = read_features_meta(root)
    if old and old.get("precision", "float32") != precision:
        print(f"[features] {root} was computed in {old.get('precision', 'float32')}, this run's feature pass is "
              f"{precision}: computing every part again", flush=True)
        for path in root.glob("part-*.npy"):
            path.unlink()
        (root / META).unlink()
        return {}
    return old


def _files(part: Path) -> tuple[Path, Path]:
    return part, part.with_suffix(".offsets.npy")


def _seal(root: Path, indices: Sequence[int]) -> dict:
    """The seals (:func:`drafters.storage.seal_entry`) of parts ``indices`` and their offsets, by file name."""
    return {path.name: seal_entry(path) for i in indices for path in _files(_part(root, i))}


def _sealed(part: Path, seals: dict) -> bool:
    return all(path.name in seals for path in _files(part))


def _broken_seal(part: Path, seals: dict) -> str | None:
    """Why a part (or its offsets) is not the file sealed in ``seals`` (both hashes named), or None (sealed as it is,
    or not sealed at all)."""
    for path in _files(part):
        if path.name in seals:
            try:
                check_seal_entry(path, seals[path.name], "feature part")
            except BrokenSealError as e:
                return str(e)
    return None


def read_features_meta(root: str | Path) -> dict:
    path = Path(root) / META
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"feature cache metadata {path} is not valid JSON ({e}); delete the folder") from e


class FeatureStore:
    """Read access to a complete feature cache: ``store[row]`` is a (len, L*H) float tensor."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.meta = read_features_meta(self.root)
        if not self.meta.get("complete"):
            raise FileNotFoundError(f"feature cache {self.root} is missing or incomplete; it is written by "
                                    "drafters.training.features.compute_features (experiments.train does it first)")
        self._arrays, self._offsets, self._first = [], [], [0]
        for part in _parts(self.root):
            try:
                offsets = np.load(part.with_suffix(".offsets.npy"))
                array = np.load(part, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ValueError(f"feature part {part} cannot be read ({e}): the file is damaged; {REDO}") from e
            if array.shape[0] != offsets[-1]:
                raise ValueError(f"feature part {part} holds {array.shape[0]} tokens, its offsets say "
                                 f"{offsets[-1]}: the file is damaged; {REDO}")
            broken = _broken_seal(part, self.meta.get(SEALS) or {})  # what the structure cannot show: other values
            if broken:
                raise ValueError(f"{broken}; {REDO}")
            self._arrays.append(array)
            self._offsets.append(offsets)
            self._first.append(self._first[-1] + len(offsets) - 1)
        if self._first[-1] != self.meta["rows"]:
            raise ValueError(f"feature cache {self.root} holds {self._first[-1]} rows, meta.json says "
                             f"{self.meta['rows']}; delete the folder")

    def __len__(self) -> int:
        return self._first[-1]

    def __getitem__(self, row: int) -> torch.Tensor:
        part = int(np.searchsorted(self._first, row, side="right")) - 1
        offsets, local = self._offsets[part], row - self._first[part]
        chunk = self._arrays[part][offsets[local]: offsets[local + 1]]
        return torch.from_numpy(np.array(chunk, dtype=np.float32))  # a copy: the map stays read-only


__all__ = ["HEAD", "PRECISIONS", "FeatureStore", "compute_features", "features_dir", "features_key"]
