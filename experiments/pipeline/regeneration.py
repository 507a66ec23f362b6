"""Regeneration: the target answers the training prompts (``python -m experiments.regenerate target=tiny``).

The target answers training prompts (``data.generation.prompts``, default
:func:`experiments.data.corpora.training_prompts`: code stubs, gsm problems from their own seeds,
dialogues) rendered with its chat template. Rows ``id, domain, input_ids (prompt + response),
prompt_len`` are written in shards (see :mod:`drafters.training.datamodule`) to ``data.data_dir``, by default

    $BLOCKDRAFT_CACHE/regen/<target name>/<hash of target path + data.generation>

(``~/.cache/blockdraft`` without the variable), so every training run with the same target and data
settings reuses it. A killed job resumes: finished shards are kept and their ids skipped.

Sampling: ``data.generation.temperature`` (default 1.0, no top-k/top-p) samples each response from
the target's own distribution, as DFlash regenerates with the target's sampling; responses cover
what the verifier sees at temperature 1 and the target's greedy choices are still available as
soft labels at training time. ``temperature=0`` (``data=regen_greedy``) gives greedy
self-distillation, on which the teacher-forced ``val/tau_greedy`` equals the online τ at
temperature 0 exactly. Each batch is seeded from ``seed`` and its first prompt id.

Decontamination: before anything is generated, every prompt is checked against the evaluation
suites (``suite``, default all) with :func:`experiments.data.decontamination.check_disjoint`; any hit stops
the job, unless ``decontaminate.drop_overlapping`` (for uncurated sources such as ShareGPT) leaves the
overlapping prompts out and lists them in ``regen.json`` (``decontamination.dropped``).
The word n-gram check is skipped for ``decontaminate.exact_only_domains`` (gsm_symbolic problems of
one template share long n-grams whatever their seeds; their disjointness comes from the seed
ranges), which still get the exact-containment check.

Who answers: ``data.backend`` (the group ``conf/data/backend/``, built with ``_target_``): the target
in this process (``inprocess``, default) or any OpenAI-compatible server (``openai``: vLLM, SGLang,
``transformers serve``; :mod:`experiments.pipeline.regen_backends`). A server's model name and request
settings join ``data.generation`` (``generation.server``), so they are hashed into the folder name;
``regen.json`` records the backend and how each stored answer got its token ids (``answers``).

Settings: the stage's own (device, batch size, shard size, decontamination) are the config group
``conf/regeneration/`` (composed at the root by ``experiments.regenerate`` and under ``regenerate:`` by
``experiments.train``, which regenerates missing data itself: :func:`ensure_data`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import hydra
import pyarrow.compute as pc
import torch
from datasets.utils.logging import disable_progress_bar
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from drafters import locks
from drafters.config import target_fingerprint
from drafters.training import datamodule as regen
from experiments.data.decontamination import check_disjoint, drop_overlapping
from experiments.data.hashing import stable_seed
from experiments.data.prompts import as_messages, encode_messages
from experiments.data.target import signature_matches, target_signature
from experiments.pipeline.recorded_answers import export_answers
from experiments.pipeline.regen_backends import Answer, Prompt


def regenerate(cfg: DictConfig) -> Path:
    """Regenerate (or finish regenerating) ``cfg.data.data_dir``; returns it.

    ``cfg`` holds ``target``, ``data``, ``suite``, ``num_threads`` and the regeneration settings
    (``conf/regeneration/default.yaml``: ``device``, ``batch_size``, ``shard_size``, ``decontaminate``).
    The data dir is owned by one process at a time (:mod:`drafters.locks`): a second job with the same
    settings waits for the first, then finds its shards finished.
    """
    with locks.hold(Path(cfg.data.data_dir).expanduser(), "data folder", wait=True):
        data_dir = _regenerate(cfg)
    if cfg.get("export_answers"):
        export_answers(data_dir, cfg.export_answers, cfg.target.path,
                       OmegaConf.to_container(cfg.data.generation, resolve=True), cfg.batch_size)
    return data_dir


def _training_prompts(gen) -> list[tuple[str, str, list[dict]]]:
    """``(id, domain, messages)`` of ``data.generation.prompts``; ids must be unique."""
    prompts = [as_messages(p) for p in hydra.utils.instantiate(gen.prompts)]
    if not prompts:
        raise ValueError(f"data.generation.prompts ({gen.prompts.get('_target_')}) returned no prompts")
    ids = [p[0] for p in prompts]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"prompt ids must be unique; duplicated: {dup}")
    return prompts


def _start_meta(cfg: DictConfig, data_dir: Path, target, backend) -> dict:
    """Refuse a folder regenerated by other target files; write ``regen.json`` marked incomplete
    (keeping the answer counts of the shards already there)."""
    settings = {"target": OmegaConf.to_container(cfg.target, resolve=True),
                "generation": OmegaConf.to_container(cfg.data.generation, resolve=True)}
    settings["target"].pop("recipe", None)
    meta = regen.read_meta(data_dir)
    signature = target_signature(cfg.target.path)
    if meta and not signature_matches(meta.get("target_signature") or {}, cfg.target.path):
        raise ValueError(f"{data_dir} was regenerated by a different target ({meta.get('target_signature')}); "
                         f"the target now is {signature}. Delete the folder or set data.data_dir elsewhere")
    answers = (meta or {}).get("answers") if regen.shard_dirs(data_dir) else None
    meta = {"settings": settings, "target_signature": signature,
            "target_fingerprint": target_fingerprint(target.config), "backend": backend.describe(),
            "answers": answers or {}, "complete": False}
    regen.write_meta(data_dir, meta)
    return meta


def _prompt_limit(target, gen) -> int:
    """Prompt tokens a prompt may have: ``max_prompt_tokens``, and room for the answer in the positions."""
    limit = getattr(target.config, "max_position_embeddings", None) or getattr(target.config, "n_positions", None)
    return min(gen.max_prompt_tokens, limit - gen.max_new_tokens) if limit else gen.max_prompt_tokens


def _prompts_to_do(prompts, done: set[str], tokenizer, max_prompt: int) -> tuple[list[tuple], int]:
    """``(todo, skipped)``: ``(domain, Prompt)`` not yet answered, shortest first; how many were too long."""
    todo, skipped = [], 0
    for pid, domain, messages in prompts:
        if pid in done:
            continue
        tokens = encode_messages(tokenizer, messages)
        if len(tokens) > max_prompt:
            skipped += 1
            continue
        todo.append((domain, Prompt(pid, tokens, messages)))
    todo.sort(key=lambda x: (len(x[1].tokens), x[1].id))  # similar lengths share a batch: little padding
    return todo, skipped


def _count_answers(counts: dict, answers: list[Answer]) -> dict:
    """``regen.json``'s ``answers``: rows per source (``generate``, ``server_ids``, ``retokenized``), how
    many round trips disagreed, and that share of the server's answers (see regen_backends)."""
    counts = dict(counts)
    for a in answers:
        counts[a.source] = counts.get(a.source, 0) + 1
        counts["round_trip_mismatch"] = counts.get("round_trip_mismatch", 0) + bool(a.mismatch)
    served = counts.get("server_ids", 0) + counts.get("retokenized", 0)
    counts["round_trip_mismatch_rate"] = round(counts["round_trip_mismatch"] / served, 6) if served else None
    return counts


def _generate_shards(cfg: DictConfig, backend, todo: list[tuple], total: int, data_dir: Path, meta: dict) -> None:
    """Answer ``todo`` in batches (each seeded from ``generation.seed`` and its first id), saving shards
    (and ``regen.json``'s answer counts with each)."""
    gen = cfg.data.generation
    bar = tqdm(total=total, initial=total - len(todo), desc="regenerate", unit="prompt", mininterval=5)
    pending: list[dict] = []
    answered: list[Answer] = []
    for i in range(0, len(todo), cfg.batch_size):
        batch = todo[i: i + cfg.batch_size]
        answers = backend.answer([p for _, p in batch], gen, stable_seed(gen.seed, batch[0][1].id))
        for (domain, p), answer in zip(batch, answers):
            pending.append({"id": p.id, "domain": domain, "input_ids": p.tokens + answer.ids,
                            "prompt_len": len(p.tokens)})
        answered += answers
        bar.update(len(batch))
        if len(pending) >= cfg.shard_size or (pending and i + cfg.batch_size >= len(todo)):
            regen.write_shard(pending, data_dir)
            meta["answers"] = _count_answers(meta["answers"], answered)
            regen.write_meta(data_dir, meta)
            pending, answered = [], []
    bar.close()


def _finish_meta(data_dir: Path, meta: dict, skipped: int, seconds: float, max_prompt: int) -> None:
    """Mark ``regen.json`` complete with the row count; print what the folder holds."""
    data = regen.load_regenerated(data_dir, warn_incomplete=False) if regen.shard_dirs(data_dir) else None
    meta.update(complete=True, rows=len(data) if data is not None else 0, skipped_long_prompts=skipped,
                seconds_last_run=round(seconds, 1))
    regen.write_meta(data_dir, meta)
    if data is None:
        raise ValueError(f"no prompt fits max_prompt_tokens={max_prompt}: nothing regenerated into {data_dir}")
    new = pc.sum(pc.list_value_length(data.data.column("input_ids"))).as_py() - sum(data["prompt_len"])
    print(f"[regenerate] {len(data)} rows ({new} response tokens, {skipped} prompts too long) in {data_dir}",
          flush=True)


def _regenerate(cfg: DictConfig) -> Path:
    disable_progress_bar()  # one bar (ours) is enough
    gen = cfg.data.generation
    if gen.max_new_tokens < 1:
        raise ValueError(f"data.generation.max_new_tokens must be >= 1, got {gen.max_new_tokens}")
    for key in ("temperature", "top_p"):
        value = gen.get(key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"data.generation.{key} is {value}: give a finite number >= 0")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    data_dir = Path(cfg.data.data_dir).expanduser()
    prompts = _training_prompts(gen)
    dropped: dict[str, str] = {}
    if cfg.decontaminate.get("drop_overlapping"):
        prompts, dropped, num_suite = drop_overlapping(prompts, cfg.suite, cfg.decontaminate)
    else:
        num_suite = check_disjoint(prompts, cfg.suite, cfg.decontaminate)
    print(f"[regenerate] {len(prompts)} prompts, disjoint from {num_suite} suite prompts ({len(dropped)} overlapping "
          f"prompts left out); data dir {data_dir}", flush=True)
    backend = hydra.utils.instantiate(cfg.data.backend)  # conf/data/backend/: in process or a server
    try:
        target, tokenizer = backend.open(cfg)
        meta = _start_meta(cfg, data_dir, target, backend)
        meta["decontamination"] = {"suite_prompts": num_suite, "dropped": dropped}
        max_prompt = _prompt_limit(target, gen)
        todo, skipped = _prompts_to_do(prompts, regen.finished_ids(data_dir), tokenizer, max_prompt)
        start = time.time()
        _generate_shards(cfg, backend, todo, len(prompts), data_dir, meta)
    finally:
        backend.close()
    _finish_meta(data_dir, meta, skipped, time.time() - start, max_prompt)
    return data_dir


def needs_regeneration(data_dir: str | Path) -> bool:
    """True when ``data_dir`` holds no shards yet or an interrupted regeneration (``complete: false``).

    A folder of shards without ``regen.json`` is someone's own data and is never regenerated into.
    """
    meta = regen.read_meta(data_dir)
    return not regen.shard_dirs(data_dir) or (bool(meta) and not meta.get("complete"))


def ensure_data(cfg: DictConfig) -> Path:
    """Regenerate the data a training config points at (``experiments.train``) if it is missing.

    Uses that config's ``target``, ``data``, ``suite``, ``seed`` and ``num_threads`` and its ``regenerate``
    section (the regeneration settings, ``conf/regeneration/default.yaml``), so the folder is the one
    ``python -m experiments.regenerate`` with the same target and data settings writes.
    """
    data_dir = Path(cfg.data.data_dir).expanduser()
    if not needs_regeneration(data_dir):
        return data_dir
    with locks.hold(data_dir, "data folder", wait=True):  # another job may be regenerating it: wait
        if not needs_regeneration(data_dir):
            print(f"[regenerate] {data_dir} was regenerated by another job meanwhile: using it", flush=True)
            return data_dir
        sub = OmegaConf.create(OmegaConf.to_container(cfg.regenerate, resolve=True))
        for key in ("target", "data", "suite", "seed", "num_threads"):
            sub[key] = OmegaConf.to_container(cfg[key], resolve=True) if isinstance(cfg[key], DictConfig) else cfg[key]
        print(f"[regenerate] {data_dir} is missing or incomplete: regenerating it first "
              "(data.regenerate_if_missing=false turns this off)", flush=True)
        return regenerate(sub)
