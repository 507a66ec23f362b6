"""The Lightning side of every training stage: the Trainer and its callbacks built from their
``_target_`` configs (``conf/trainer/``, ``conf/callbacks/``), the precision it trains in (``trainer.precision=auto``
resolved for this machine, :func:`resolve_precision`), and a CSV log that survives resuming."""

from __future__ import annotations

import csv
import os
import time
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from drafters.training.resume import RandomStreams

# The /proc/cpuinfo flags of the CPU instructions that make bfloat16 matmuls fast: Intel's AMX tiles (Sapphire
# Rapids on) and AVX512-BF16 (Cooper Lake, Sapphire Rapids; AMD Zen 4 on). Without either, torch emulates
# bfloat16 arithmetic in float32 and a bfloat16 step is no faster, or slower (docs/bench.md, `precision`).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Set, it replaces /proc/cpuinfo's flags (space- or comma-separated; empty: none): the tests set it empty so
# that ``auto`` means float32 on every machine, and a user can see what ``auto`` does on another CPU.
FLAGS_ENV = "BLOCKDRAFT_CPU_FLAGS"
FLOAT32 = "32-true"
BF16 = "bf16-mixed"


def cpuinfo_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (the first processor's ``flags`` line); empty where
    there is no such file (not Linux)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return frozenset()
    return next((frozenset(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")),
                frozenset())


def cpu_flags() -> frozenset[str]:
    """The flags :func:`resolve_precision` reads: ``$BLOCKDRAFT_CPU_FLAGS`` when set, else :func:`cpuinfo_flags`."""
    if FLAGS_ENV in os.environ:
        return frozenset(os.environ[FLAGS_ENV].replace(",", " ").split())
    return cpuinfo_flags()


def bf16_flags() -> list[str]:
    """Those of :data:`BF16_FLAGS` this CPU has (:func:`cpu_flags`), in that order."""
    flags = cpu_flags()
    return [f for f in BF16_FLAGS if f in flags]


def _on_cpu(accelerator) -> bool:
    return str(accelerator) == "cpu" or (str(accelerator) == "auto" and not torch.cuda.is_available())


def resolve_precision(precision, accelerator="cpu") -> str | int:
    """The Lightning ``precision`` a Trainer gets for ``trainer.precision``. ``auto``: on a CPU, bf16 autocast
    (``bf16-mixed``: float32 weights and optimiser state, bfloat16 matmuls) where it has :data:`BF16_FLAGS`,
    else float32 (``32-true``); on a GPU, ``bf16-mixed`` where it supports bfloat16. Any other value is
    Lightning's own (``32``: float32 on request), except that bfloat16 on a CPU without those instructions is
    refused, naming them and the fallback."""
    value = str(precision)
    cpu = _on_cpu(accelerator)
    if value == "auto":
        if cpu:
            return BF16 if bf16_flags() else FLOAT32
        return BF16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else FLOAT32
    if cpu and value.startswith("bf16") and not bf16_flags():
        raise ValueError(f"trainer.precision={value}: this CPU has neither {' nor '.join(BF16_FLAGS)} (its "
                         "/proc/cpuinfo flags), so bfloat16 would be emulated, not faster; use trainer.precision=auto "
                         f"(float32, {FLOAT32}, here) or trainer.precision=32")
    return precision


def trainer_precision(cfg: DictConfig) -> str | int:
    """:func:`resolve_precision` of ``cfg.trainer`` (checked before a stage computes anything)."""
    return resolve_precision(cfg.trainer.get("precision", FLOAT32), cfg.trainer.get("accelerator", "cpu"))


def arithmetic(cfg: DictConfig) -> str:
    """The arithmetic ``cfg`` trains in (:func:`trainer_precision`): ``"bfloat16"``, ``"float16"``, ``"float64"``
    or ``"float32"``; what a run resumes in (:mod:`experiments.pipeline.run_settings`)."""
    resolved = str(trainer_precision(cfg))
    return next((name for prefix, name in (("bf16", "bfloat16"), ("16", "float16"), ("64", "float64"))
                 if resolved.startswith(prefix)), "float32")


def compute_dtype(cfg: DictConfig) -> str:
    """The precision of the drafters' target feature pass: ``"bfloat16"`` under bfloat16 autocast, else
    ``"float32"``."""
    return "bfloat16" if arithmetic(cfg) == "bfloat16" else "float32"


def precision_record(cfg: DictConfig) -> dict:
    """What a training summary says of its precision: asked for, trained in, and the CPU flags that decided."""
    return {"requested": str(cfg.trainer.get("precision", FLOAT32)), "resolved": str(trainer_precision(cfg)),
            "cpu_bf16_flags": bf16_flags(), "isa": torch.backends.cpu.get_cpu_capability()}


def build_trainer(cfg: DictConfig, logger) -> L.Trainer:
    """``cfg.trainer`` instantiated with ``logger``, its precision resolved (:func:`trainer_precision`), and every
    callback of ``cfg.callbacks`` (in order), plus :class:`drafters.training.resume.RandomStreams` (the random
    streams in every checkpoint: exact resumes)."""
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    return hydra.utils.instantiate(cfg.trainer, logger=logger, callbacks=[*callbacks, RandomStreams()],
                                   precision=trainer_precision(cfg))


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
