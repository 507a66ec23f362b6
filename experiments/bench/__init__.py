"""Benchmarks a user runs (plain argparse scripts, ``python -m experiments.bench.<name>``; each one's section in
docs/bench.md): ``draft_cost`` (one draft against the target's forwards), ``suite_steps`` (a suite's speculative
steps, timed in their parts, and where their accepted drafts come from), ``interleave`` (evaluation settings A/B in
one process; ``interleave_plot``: τ against speedup), ``verify`` (the verifier against transformers' assisted
generation), ``train`` (training step throughput), ``precision`` (float32 against bfloat16 autocast: matmul, training
step, feature pass), ``losses`` (loss forward+backward cost), ``scale`` (costs at a real model's shape, random
weights). :mod:`.profiling` is the step clock ``suite_steps`` reads; this module the
helpers they share."""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Iterable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

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


def random_target(device: str):
    """A random Llama shaped like the embedded tiny target (conf/target/tiny.yaml's recipe)."""
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval().requires_grad_(False)


def make_batch(batch_size: int, seq_len: int, prompt_len: int, vocab: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "prompt_len": torch.full((batch_size,), prompt_len, device=device),
            "length": torch.full((batch_size,), seq_len, device=device)}


def with_cached_features(batch: dict, target, layer_ids) -> dict:
    """The batch plus ``features`` (B, S, L*H), as drafters.training.features caches them (float16 on disk)."""
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    return {**batch, "features": feats.half().float()}
