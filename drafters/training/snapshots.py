"""The drafter saved at chosen optimizer steps of one run: the suites' τ along its training (a learning curve)
without keeping an optimizer state per point.

:class:`DrafterSnapshots` writes ``<dirpath>/step-<N>/`` with :meth:`drafters.model.DFlashDrafter.save_pretrained`
(loadable by ``drafter.path=``) when the run reaches step N. A snapshot is written to a temporary folder and
renamed into place, so a killed run leaves whole snapshots only; a resumed run keeps those it has.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import lightning as L


class DrafterSnapshots(L.Callback):
    """Save ``pl_module.drafter`` at each of ``steps`` (optimizer steps) into ``<dirpath>/step-<N>``."""

    def __init__(self, dirpath: str | os.PathLike, steps: Sequence[int] = ()):
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"snapshot steps must be integers >= 1, got {bad}")
        self.dirpath, self.steps = Path(dirpath), set(steps)

    def folder(self, step: int) -> Path:
        return self.dirpath / f"step-{step}"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step not in self.steps or not trainer.is_global_zero or self.folder(step).is_dir():
            return
        tmp = self.dirpath / f".tmp-step-{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        pl_module.drafter.save_pretrained(tmp)
        os.replace(tmp, self.folder(step))
