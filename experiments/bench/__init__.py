"""Benchmarks and diagnosis loops (plain argparse scripts, ``python -m experiments.bench.<name>``):
``learning`` (the drafter learning diagnosis), ``losses`` (loss forward+backward cost), ``scale`` (costs
at a real model's shape, random weights), ``step`` (one speculative step vs one target step, with
:mod:`.profiling`), ``suite_steps`` (a suite's speculative steps, timed in their parts, and where their
accepted drafts come from), ``interleave`` (evaluation settings A/B, in one process; ``interleave_plot``: τ against speedup), ``free_drafts`` (the
speedup of a drafter's own drafts replayed at no drafting cost), ``draft_cost`` (one draft against the target's
forwards), ``train`` (training step throughput),
``verify`` (the verifier vs transformers' assisted generation), ``step_parts`` (a batch-1 speculative step at
SmolLM2's size against its parts run alone, before and after a revision)."""

from __future__ import annotations

import json
import platform
import resource
from collections.abc import Iterable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from drafters.tau import greedy_walk
from verify.hf import cache_argument, new_growing_kv_cache

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
    import dataclasses

    from omegaconf import OmegaConf

    from experiments.pipeline.settings import DecodingSettings

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=list(overrides))
    fields = [f.name for f in dataclasses.fields(DecodingSettings)]
    return cfg, DecodingSettings.from_config(OmegaConf.masked_copy(cfg, [f for f in fields if f in cfg]))


def portable_override(override: str) -> str:
    """``key=value`` with a value that names an existing file or folder written as committed records write paths
    (``$BLOCKDRAFT_CACHE/...`` inside the data cache); several overrides joined by spaces, each so."""
    if " " in override:
        return " ".join(portable_override(o) for o in override.split(" ") if o)
    key, sep, value = override.partition("=")
    return f"{key}={portable_value(value)}" if sep else override


def portable_value(value: str) -> str:
    """A value naming an existing file or folder as committed records write paths (``$BLOCKDRAFT_CACHE/...``,
    ``$BLOCKDRAFT_RUNS/...``); other values as given."""
    from experiments.pipeline.paths import cache_path, runs_path

    if not (value and Path(value).expanduser().exists()):
        return value
    cached = cache_path(value)
    return cached if cached != value else runs_path(value)


def with_defaults(overrides: Iterable[str], defaults: dict[str, str]) -> list[str]:
    """``overrides`` plus ``key=value`` for each key of ``defaults`` they do not set."""
    out = list(overrides)
    out += [f"{k}={v}" for k, v in defaults.items() if not any(o.startswith(f"{k}=") for o in out)]
    return out


def _portable_argument(value):
    """A bench argument with the paths it names written portably: a path, ``name=path`` or a list of them."""
    if isinstance(value, list):
        return [_portable_argument(v) for v in value]
    if not isinstance(value, str):
        return value
    return portable_override(value) if "=" in value else portable_value(value)


def write_record(doc: dict, out: str | Path) -> dict:
    """``doc`` with ``machine`` (platform, torch, threads) added and its ``overrides`` written portably
    (:func:`portable_override`), written as JSON to ``out`` (its folder made)."""

    doc = {**doc, "machine": {"platform": platform.platform(), "torch": torch.__version__,
                              "threads": torch.get_num_threads()}}
    if "overrides" in doc:
        doc["overrides"] = [portable_override(o) for o in doc["overrides"]]
    if isinstance(doc.get("config"), dict):  # a bench's arguments: paths written as the overrides' are
        doc["config"] = {k: _portable_argument(v) for k, v in doc["config"].items()}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def lookup_replay(prompt: list[int], response: list[int], num_draft_tokens: int, max_ngram: int, min_ngram: int) -> int:
    """Speculative steps prompt lookup (:class:`verify.PromptLookupDrafter`'s rule) needs to emit ``response`` after
    ``prompt`` under greedy verification (``experiments.bench.lookup``, ``experiments.bench.choose_k``)."""
    from experiments.pipeline.replay import (
        lookup_leads,  # the pipeline's replay; benches import this module early
    )

    ids = list(prompt) + list(response)
    return len(greedy_walk(lookup_leads(ids, num_draft_tokens, max_ngram, min_ngram), len(prompt), len(ids))[0])


def prefill(target, drafter, batch: int, context: int, seed: int = 0):
    """The target's cache over ``context`` random tokens per row, handed to the drafter; the rows' anchors and their
    positions."""
    vocab = target.get_output_embeddings().out_features
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed)).to(target.device)
    mask = torch.ones_like(ids[:, :-1])
    positions = torch.arange(context - 1, device=ids.device).expand(batch, -1)
    cache = new_growing_kv_cache(target, 64)
    out = target(input_ids=ids[:, :-1], attention_mask=mask, position_ids=positions, use_cache=True,
                 output_hidden_states=True, logits_to_keep=1, **{cache_argument(target): cache})
    drafter.reset(batch)
    drafter.bind_target_cache(cache)
    drafter.extend(ids[:, :-1], mask, positions, [out.hidden_states[i] for i in drafter.target_layer_ids])
    return cache, ids[:, -1], torch.full((batch,), context - 1, device=ids.device)
