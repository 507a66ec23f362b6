"""The Lightning side of every training stage: the Trainer and its callbacks built from their
``_target_`` configs (``conf/trainer/``, ``conf/callbacks/``), and a CSV log that survives resuming."""

from __future__ import annotations

import csv
import os
import time
import warnings
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig

from drafters.training.resume import RandomStreams


def build_trainer(cfg: DictConfig, logger) -> L.Trainer:
    """``cfg.trainer`` instantiated with ``logger`` and every callback of ``cfg.callbacks`` (in order), plus
    :class:`drafters.training.resume.RandomStreams` (the random streams in every checkpoint: exact resumes)."""
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    return hydra.utils.instantiate(cfg.trainer, logger=logger, callbacks=[*callbacks, RandomStreams()])


def train_seconds(trainer: L.Trainer) -> float | None:
    """The run's training time in seconds, added up across resumes, from its
    :class:`lightning.pytorch.callbacks.Timer` (``conf/callbacks/checkpoint.yaml``: ``train_clock``); None without one."""
    clocks = [c for c in trainer.callbacks if isinstance(c, L.pytorch.callbacks.Timer)]
    return round(clocks[0].time_elapsed("train"), 3) if clocks else None


def keep_csv_history(logger) -> Path | None:
    """Lightning's CSVLogger deletes an existing metrics.csv when it starts: move it aside first.

    Returns the log dir for :func:`merge_csv_history` (None for other loggers).
    """
    if not isinstance(logger, L.pytorch.loggers.CSVLogger):
        return None
    log_dir = Path(logger.log_dir)
    current = log_dir / "metrics.csv"
    if current.is_file():  # named in run order, also for several restarts within a second
        number = len(list(log_dir.glob("metrics.part-*.csv")))
        current.rename(log_dir / f"metrics.part-{time.strftime('%Y%m%d-%H%M%S')}-{number:04d}-{os.getpid()}.csv")
    warnings.filterwarnings("ignore", message="Experiment logs directory .* will be deleted")  # moved aside
    return log_dir


def merge_csv_history(log_dir: Path) -> None:
    """Join the moved-aside parts and the current metrics.csv into one file, in run order. Rows of a
    part at or after the step where the next part starts (logged after the checkpoint a killed run
    resumed from) are dropped."""
    parts = sorted(log_dir.glob("metrics.part-*.csv")) + [log_dir / "metrics.csv"]
    tables = []
    for path in parts:
        if path.is_file():
            with open(path, newline="") as f:
                tables.append(list(csv.DictReader(f)))
    rows = []
    for i, table in enumerate(tables):
        later = [int(r["step"]) for t in tables[i + 1:] for r in t[:1] if r.get("step")]
        cut = min(later) if later else None
        rows += [r for r in table if cut is None or int(r.get("step") or 0) < cut]
    keys = sorted({k for r in rows for k in r})
    with open(log_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    for path in parts[:-1]:
        path.unlink(missing_ok=True)
