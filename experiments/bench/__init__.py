"""Benchmarks a user runs (plain argparse scripts, ``python -m experiments.bench.<name>``; each one's section in
docs/bench.md): ``draft_cost`` (one draft against the target's forwards), ``suite_steps`` (a suite's speculative
steps, timed in their parts, and where their accepted drafts come from), ``interleave`` (evaluation settings A/B in
one process; ``interleave_plot``: τ against speedup), ``verify`` (the verifier against transformers' assisted
generation), ``train`` (training step throughput), ``losses`` (loss forward+backward cost), ``scale`` (costs at a
real model's shape, random weights). :mod:`.profiling` is the step clock ``suite_steps`` reads; this module the
helpers they share."""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Iterable
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from experiments.pipeline.settings import DecodingSettings

CONF = Path(__file__).resolve().parents[2] / "conf"


def loss_configs(names: Iterable[str]) -> dict[str, DictConfig]:
    """``conf/loss/<name>.yaml`` of each name as ``experiments.train loss=<name>`` composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return {name: compose(config_name="train", overrides=[f"loss={name}"]).loss for name in names}


def loss_names() -> list[str]:
    """Every loss config under ``conf/loss/``, sorted."""
    return sorted(p.stem for p in (CONF / "loss").glob("*.yaml"))


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """The process's peak resident memory since the last reset (Linux VmHWM; else the lifetime peak)."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def evaluation_config(overrides: Iterable[str]):
    """``(cfg, settings)``: ``conf/evaluate.yaml`` composed with ``overrides`` as ``experiments.evaluate`` composes
    it, and its :class:`experiments.pipeline.settings.DecodingSettings` (only the settings' keys are read: the rest
    of a composed, not run, config holds ``${hydra:...}`` it cannot resolve)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=list(overrides))
    fields = [f.name for f in dataclasses.fields(DecodingSettings)]
    return cfg, DecodingSettings.from_config(OmegaConf.masked_copy(cfg, [f for f in fields if f in cfg]))


def with_defaults(overrides: Iterable[str], defaults: dict[str, str]) -> list[str]:
    """``overrides`` plus ``key=value`` for each key of ``defaults`` they do not set."""
    out = list(overrides)
    out += [f"{k}={v}" for k, v in defaults.items() if not any(o.startswith(f"{k}=") for o in out)]
    return out
