"""Regenerated training data for block drafters: storage, anchor sampling, batching, the DataModule.

Storage (written by ``python -m experiments.regenerate``, read here). A *data dir* holds

* ``shards/shard-00000/``, ``shard-00001/``, ...: ``datasets`` ``save_to_disk`` folders with columns
  ``id`` (str), ``domain`` (str), ``input_ids`` (list of int: prompt + the target's response) and
  ``prompt_len`` (int: the first ``prompt_len`` ids are the rendered prompt). A shard is written to a
  temporary folder and renamed into place, so a killed job leaves only whole shards;
* ``regen.json``: the settings, the target's fingerprint and, once done, ``"complete": true``.

Validation split: a stable fraction of the rows held out by a hash of their id
(:func:`split_by_id`), so it never changes between runs that share a data dir.

Anchors, batches and the resumable training loader (:func:`sample_anchors`, :func:`collate`,
:class:`ResumableLoader`) live in :mod:`drafters.training.batching` and are re-exported here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import datasets
import lightning as L
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset

from drafters.config import target_fingerprint
from drafters.storage import (
    BrokenSealError,
    DamagedFileError,
    check_seal_entry,
    read_json,
    seal_entry,
    write_json_atomic,
)
from drafters.training.batching import EpochShuffle, ResumableLoader, collate, sample_anchors  # noqa: F401 (re-exported)
from drafters.training.features import FeatureStore, compute_features, features_dir

SHARDS = "shards"
META = "regen.json"
SHARD_SEALS = "seals.json"  # in each shard folder: every file's sha256, size and mtime when written
COLUMNS = ("id", "domain", "input_ids", "prompt_len")


# ----------------------------------------------------------------------------- storage


def shard_dirs(data_dir: str | Path) -> list[Path]:
    """Finished shards of a data dir, in order (temporary folders of a killed job are ignored)."""
    root = Path(data_dir).expanduser() / SHARDS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("shard-"))


def write_shard(rows: Sequence[dict], data_dir: str | Path) -> Path:
    """Save ``rows`` (dicts with :data:`COLUMNS`) as the next shard, atomically; returns its folder."""
    missing = [c for c in COLUMNS if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"shard rows lack columns {missing}; expected {list(COLUMNS)}")
    root = Path(data_dir).expanduser() / SHARDS
    root.mkdir(parents=True, exist_ok=True)
    existing = shard_dirs(data_dir)
    index = int(existing[-1].name.split("-")[1]) + 1 if existing else 0
    final, tmp = root / f"shard-{index:05d}", root / f".tmp-shard-{index:05d}-{os.getpid()}"
    string, int32 = datasets.Value("string"), datasets.Value("int32")
    features = datasets.Features({"id": string, "domain": string, "input_ids": datasets.Sequence(int32),
                                  "prompt_len": int32})
    columns = {c: [r[c] for r in rows] for c in COLUMNS}
    if tmp.exists():
        shutil.rmtree(tmp)
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
    seals = {f.name: seal_entry(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    write_json_atomic(tmp / SHARD_SEALS, seals)  # what load_shard checks each file against
    os.replace(tmp, final)
    return final


def check_shard_seals(shard: str | Path) -> None:
    """Refuse a shard whose files are not those :func:`write_shard` sealed (:data:`SHARD_SEALS`: each file's sha256,
    re-hashed only when its size or mtime changed), naming the file, both hashes and what to do. Shards written before
    seals have none and are read as they are."""
    shard = Path(shard)
    seals_path = shard / SHARD_SEALS
    if not seals_path.is_file():
        return
    seals = read_json(seals_path, "regenerated shard seals")
    for name, entry in seals.items():
        try:
            check_seal_entry(shard / name, entry, "regenerated shard file")
        except BrokenSealError as e:
            raise BrokenSealError(f"{e}; delete the folder {shard} and run experiments.regenerate with the same "
                                  "settings again: it regenerates the rows of that shard only") from None


def load_shard(shard: str | Path) -> datasets.Dataset:
    """One shard folder (:func:`write_shard`), or a one-line :class:`drafters.storage.DamagedFileError` naming it when
    it cannot be read (a truncated or garbage file: pyarrow's own error names no file)."""
    check_shard_seals(shard)
    try:
        return datasets.load_from_disk(str(shard))
    except (OSError, ValueError, KeyError, TypeError) as e:  # pyarrow's ArrowInvalid / ArrowIOError among them
        cause = " ".join(str(e).split())[:200]
        raise DamagedFileError(
            f"regenerated shard {shard} cannot be read ({type(e).__name__}: {cause}): it is damaged (e.g. truncated "
            f"by a full disk or a copy cut short); delete the folder {shard} and run experiments.regenerate with the "
            "same settings again: it regenerates the rows of that shard only") from None


def read_meta(data_dir: str | Path) -> dict:
    """``regen.json`` of a data dir ({} if absent)."""
    path = Path(data_dir).expanduser() / META
    return json.loads(path.read_text()) if path.is_file() else {}


def write_meta(data_dir: str | Path, meta: dict) -> None:
    path = Path(data_dir).expanduser() / META
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_regenerated(data_dir: str | Path, warn_incomplete: bool = True):
    """All shards of a data dir as one ``datasets.Dataset``; a clear error if there are none."""
    data_dir = Path(data_dir).expanduser()
    shards = shard_dirs(data_dir)
    if not shards:
        raise FileNotFoundError(
            f"regenerated dataset at {data_dir} is empty (no shards): run `python -m experiments.regenerate` "
            "with the same target and data settings first"
        )
    data = datasets.concatenate_datasets([load_shard(s) for s in shards])
    missing = [c for c in COLUMNS if c not in data.column_names]
    if missing:
        raise ValueError(f"regenerated dataset at {data_dir} lacks columns {missing}; has {data.column_names}")
    if len(data) == 0:
        raise ValueError(f"regenerated dataset at {data_dir} has no rows")
    if warn_incomplete and not read_meta(data_dir).get("complete"):
        warnings.warn(f"regenerated dataset at {data_dir} is incomplete (regeneration did not finish); "
                      f"using its {len(data)} rows", stacklevel=2)
    return data


def finished_ids(data_dir: str | Path) -> set[str]:
    """Ids already regenerated (for resuming a killed job)."""
    return {i for s in shard_dirs(data_dir) for i in load_shard(s)["id"]}


def id_hash(row_id: str) -> float:
    """A stable number in [0, 1) from an id (sha1)."""
    return int(hashlib.sha1(row_id.encode()).hexdigest()[:12], 16) / float(1 << 48)


def split_by_id(ids: Sequence[str], fraction: float) -> tuple[list[int], list[int]]:
    """Row indices ``(train, val)``: a row is held out when ``id_hash(id) < fraction``.

    With ``fraction > 0`` and at least two rows, validation gets at least the row of smallest hash.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {fraction}")
    hashes = [id_hash(i) for i in ids]
    val = [i for i, h in enumerate(hashes) if h < fraction]
    if fraction > 0 and not val and len(ids) >= 2:
        val = [min(range(len(ids)), key=hashes.__getitem__)]
    held = set(val)
    return [i for i in range(len(ids)) if i not in held], val


class RegenDataset(Dataset):
    """Rows of a regenerated dataset, cut to ``max_length`` tokens (rows left without a response
    token are dropped). Items are ``{"input_ids": list[int], "prompt_len": int, "row": int}`` (``row``: the index
    in ``data``), plus
    one (len, F) float tensor per :class:`drafters.training.features.FeatureStore` of the same rows and
    ``max_length`` in ``features``, under its key (``{"features": store, "head_states": store}``)."""

    def __init__(self, data, indices: Sequence[int] | None = None, max_length: int | None = None,
                 features: dict | None = None):
        indices = range(len(data)) if indices is None else indices
        prompt_lens = data.data.column("prompt_len").to_pylist()
        lengths = pc.list_value_length(data.data.column("input_ids")).to_pylist()
        limit = max_length if max_length is not None else max(lengths, default=0)
        keep = [i for i in indices if min(lengths[i], limit) > prompt_lens[i] >= 1]
        self.data, self.indices, self.max_length = data, keep, max_length
        self.num_dropped = len(indices) - len(keep)
        for store in (features or {}).values():
            if len(store) != len(data):
                raise ValueError(f"feature cache {store.root} holds {len(store)} rows, the data {len(data)}: "
                                 "it belongs to another data dir; delete it to recompute")
        self.features = dict(features or {})

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        row = self.data[self.indices[i]]
        ids = row["input_ids"] if self.max_length is None else row["input_ids"][: self.max_length]
        item = {"input_ids": ids, "prompt_len": int(row["prompt_len"]), "row": self.indices[i]}
        for key, store in self.features.items():
            item[key] = store[self.indices[i]]
            if item[key].shape[0] != len(ids):
                raise ValueError(f"feature cache {store.root} row {self.indices[i]} has "
                                 f"{item[key].shape[0]} columns, the data row {len(ids)}")
        return item


class RegenDataModule(L.LightningDataModule):
    """Train/validation loaders over a regenerated data dir (see the module docstring).

    Args:
        data_dir: folder written by ``experiments.regenerate``.
        batch_size / val_batch_size: sequences per batch (val defaults to batch_size), over all ranks:
            under DDP/FSDP each rank loads ``batch_size / world size`` of them (:meth:`per_rank`).
        max_length: tokens kept per sequence (prompt + response), from the left.
        val_fraction: share of ids held out for validation (stable hash of the id).
        max_val_samples: cap on validation sequences (the first ones by id hash), None = all.
        max_train_rows: cap on training sequences, the first ones by id hash (None = all): nested subsets of one
            data dir (each holds the smaller ones) for curves against the amount of data, with the same
            validation rows.
        num_workers, seed: DataLoader workers and the shuffling seed.
        features_dir: a complete feature cache of this data dir (:mod:`drafters.training.features`); training
            batches then carry ``features`` and the module skips the target forward. Validation
            batches never do (the teacher-forced τ needs the target's logits).
        head_states_dir: a complete cache of the target's final states (``drafters.training.features.HEAD``); training
            batches then carry ``head_states``, from which soft-label losses rebuild the target's logits.
    """

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        max_length: int | None = 512,
        val_fraction: float = 0.05,
        max_val_samples: int | None = 64,
        max_train_rows: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        pad_token_id: int = 0,
        features_dir: str | Path | None = None,
        head_states_dir: str | Path | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 (a prompt token and a response token), got {max_length}")
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        if max_train_rows is not None and max_train_rows < 1:
            raise ValueError(f"max_train_rows must be >= 1 or null, got {max_train_rows}")
        self.max_length, self.val_fraction, self.max_val_samples = max_length, val_fraction, max_val_samples
        self.max_train_rows = max_train_rows
        self.num_workers, self.seed, self.pad_token_id = num_workers, seed, pad_token_id
        self.features_dir, self.head_states_dir = features_dir, head_states_dir
        self.train_set: RegenDataset | None = None
        self.val_set: RegenDataset | None = None

    def _store(self, root):
        store = FeatureStore(root)
        if store.meta.get("max_length") != self.max_length:
            raise ValueError(f"feature cache {root} was cut at max_length {store.meta.get('max_length')}, "
                             f"the data module at {self.max_length}")
        return store

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = load_regenerated(self.data_dir)
        ids = data.data.column("id").to_pylist()
        train_idx, val_idx = split_by_id(ids, self.val_fraction)
        features = {key: self._store(root) for key, root in
                    (("features", self.features_dir), ("head_states", self.head_states_dir)) if root is not None}
        self.train_set = RegenDataset(data, train_idx, self.max_length, features)
        self.val_set = RegenDataset(data, val_idx, self.max_length)
        for dataset, cap in ((self.val_set, self.max_val_samples), (self.train_set, self.max_train_rows)):
            if cap is not None:  # the same rows whatever the data dir's size and order
                dataset.indices = sorted(sorted(dataset.indices, key=lambda i: id_hash(ids[i]))[:cap])
        if len(self.train_set) == 0:
            raise ValueError(
                f"regenerated dataset at {self.data_dir}: no training rows left ({len(data)} rows, "
                f"val_fraction={self.val_fraction}, max_length={self.max_length})"
            )

    def _loader(self, dataset, batch_size: int, shuffle: bool) -> DataLoader:
        """Training (``shuffle``): a :class:`ResumableLoader` over :class:`EpochShuffle`. Both loaders draw
        their workers' base seed from their own generator, not from torch's global random stream (which
        a resumed run restores, :mod:`drafters.training.resume`)."""
        return (ResumableLoader if shuffle else DataLoader)(
            dataset, batch_size=batch_size, sampler=EpochShuffle(len(dataset), self.seed) if shuffle else None,
            num_workers=self.num_workers, collate_fn=functools.partial(collate, pad_token_id=self.pad_token_id),
            drop_last=False, persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def per_rank(self, batch_size: int, key: str = "batch_size") -> int:
        """Rows each rank loads: ``batch_size`` is the global batch, split evenly over the Trainer's ranks
        (so a step sees the same batch whatever the world size); refuses a split that is not even."""
        world = self.trainer.world_size if self.trainer is not None else 1
        if batch_size % world:
            raise ValueError(f"data.datamodule.{key}={batch_size} is the global batch: it must be divisible by "
                             f"the world size {world} (trainer.devices x trainer.num_nodes)")
        return batch_size // world

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.per_rank(self.batch_size), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.per_rank(self.val_batch_size, "val_batch_size"), shuffle=False)


def ensure_features(target, data_dir: str | Path, target_layer_ids: Sequence[int], *, dtype: str = "float16",
                    max_length: int | None = None, batch_size: int = 8, progress: bool = True) -> Path:
    """The feature cache of a regenerated data dir for these layers, its missing or damaged parts computed first."""
    root = features_dir(data_dir, target_layer_ids, dtype, max_length)
    data = load_regenerated(data_dir)
    return compute_features(target, data["input_ids"], root, target_layer_ids=target_layer_ids, dtype=dtype,
                            max_length=max_length, fingerprint=target_fingerprint(target.config),
                            batch_size=batch_size, progress=progress)
