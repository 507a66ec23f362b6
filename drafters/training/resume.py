"""Exact resume: what a Lightning checkpoint must hold besides weights and optimiser state so that a
run killed at any step and resumed ends as the uninterrupted run would (bit-identical on CPU).

* the training data's position: :class:`drafters.training.datamodule.ResumableLoader` (Lightning saves it with the
  fit loop);
* the global random streams (torch CPU and CUDA, numpy, Python's ``random``): :class:`RandomStreams`,
  a callback every training stage gets (:func:`experiments.pipeline.trainer.build_trainer`). They are
  saved with the checkpoint and put back just before the first training step of the resumed run, the
  point where the uninterrupted run went on with them (nothing between a checkpoint and the next step
  draws from them: the data loaders have their own generators, validation its seeded ones).

The drafter's anchors need nothing here: each step draws them from a generator seeded by
``(seed, step, rank)`` (:class:`drafters.training.module.DrafterLightningModule`). Everything is stored as
tensors, numbers and tuples, so the checkpoint still loads with ``weights_only=True``.
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch


def random_streams() -> dict:
    """The global random states, in types ``torch.load(weights_only=True)`` accepts."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }


def set_random_streams(state: dict) -> None:
    """Put back what :func:`random_streams` returned."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


class RandomStreams(L.Callback):
    """Saves the global random streams in every checkpoint; a resumed run gets them back before its first
    training step. Under DDP rank 0's streams are saved and every rank gets them back (the ranks start
    from the same seed)."""

    def __init__(self):
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        return random_streams()

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending = state_dict

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending is not None:
            state, self._pending = self._pending, None
            set_random_streams(state)


__all__ = ["RandomStreams", "random_streams", "set_random_streams"]
