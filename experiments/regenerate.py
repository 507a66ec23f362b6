"""Regenerate drafter training data with the target: ``python -m experiments.regenerate target=tiny``.

The target answers training prompts (``data.generation.prompts``, default
:func:`experiments.corpora.training_prompts`: code stubs, gsm problems from their own seeds,
dialogues) rendered with its chat template. Rows ``id, domain, input_ids (prompt + response),
prompt_len`` are written in shards (see :mod:`drafters.data`) to ``data.data_dir``, by default

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
suites (``suite``, default all) with :func:`experiments.suites.find_overlap`; any hit stops the job.
The word n-gram check is skipped for ``decontaminate.exact_only_domains`` (gsm_symbolic problems of
one template share long n-grams whatever their seeds; their disjointness comes from the seed
ranges), which still get the exact-containment check.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from drafters import data as regen
from drafters import locks
from experiments import settings_hash  # noqa: F401  (re-exported; the resolver lives there)

# ----------------------------------------------------------------------------- prompts


def as_messages(prompt) -> tuple[str, str, list[dict]]:
    """``(id, domain, messages)`` of a prompt dict ``{"id", "domain", "messages"}`` or a suite
    :class:`experiments.suites.Prompt` (its first turn)."""
    if isinstance(prompt, dict):
        missing = [k for k in ("id", "domain", "messages") if k not in prompt]
        if missing:
            raise ValueError(f"prompt {prompt.get('id', prompt)!r} lacks keys {missing}")
        messages = list(prompt["messages"])
        if not messages or messages[-1].get("role") != "user":
            raise ValueError(f"prompt {prompt['id']!r}: messages must end with a user turn")
        return str(prompt["id"]), str(prompt["domain"]), messages
    if hasattr(prompt, "turns") and hasattr(prompt, "id"):
        return str(prompt.id), str(prompt.domain), [{"role": "user", "content": prompt.turns[0]}]
    raise TypeError(f"a prompt must be a dict with id/domain/messages or a suites.Prompt, got {type(prompt)}")


def encode(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of the conversation so far plus the assistant cue (chat template when there is one)."""
    from experiments.suites import encode_prompt

    turns = [m["content"] for m in messages if m["role"] == "user"]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    return encode_prompt(tokenizer, turns, answers)


def check_disjoint(prompts: Sequence[tuple[str, str, list[dict]]], cfg_suite, decontaminate) -> int:
    """Fail if any prompt text overlaps an evaluation suite; returns the number of suite prompts."""
    from experiments.suites import find_overlap, load_suites

    suites = load_suites(cfg_suite)
    exact_only = set(decontaminate.get("exact_only_domains") or [])
    hits = []
    for exact in (False, True):
        group = [p for p in prompts if (p[1] in exact_only) == exact]
        texts = [m["content"] for _, _, messages in group for m in messages]
        owner = [pid for pid, _, messages in group for _ in messages]
        ngram = None if exact else decontaminate.get("ngram")
        for h in find_overlap(texts, suites, ngram=ngram, min_chars=decontaminate.get("min_chars", 20)):
            hits.append(f"  {owner[h.text_index]} ~ {h.prompt_id} turn {h.turn} ({h.kind}): {h.match[:80]!r}")
    if hits:
        raise ValueError(f"{len(hits)} training prompt(s) overlap the evaluation suites "
                         f"{sorted(suites)}:\n" + "\n".join(hits[:20]))
    return sum(len(v) for v in suites.values())


# ----------------------------------------------------------------------------- generation


def eos_ids(target, tokenizer) -> list[int]:
    ids = getattr(target.generation_config, "eos_token_id", None)
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], gen, pad_id: int, eos: list[int], seed: int) -> list[list[int]]:
    """Responses (cut after the first EOS) to a batch of prompts, left-padded through ``target.generate``."""
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    sample = gen.temperature > 0
    torch.manual_seed(seed)
    out = target.generate(
        ids.to(device), attention_mask=mask.to(device), max_new_tokens=gen.max_new_tokens, do_sample=sample,
        temperature=gen.temperature if sample else None, top_k=(gen.top_k or 0) if sample else None,
        top_p=(gen.top_p or 1.0) if sample else None, repetition_penalty=1.0, pad_token_id=pad_id,
        eos_token_id=eos or None,
    )
    responses = []
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:stop])
    return responses


def target_signature(path: str) -> dict:
    """What identifies the target's files: config.json's sha1, the weight files' sizes and mtimes."""
    root = Path(os.path.expanduser(str(path)))
    if not root.is_dir():
        return {"path": str(path)}
    sig = {"path": str(root.resolve())}
    if (root / "config.json").is_file():
        sig["config_sha1"] = hashlib.sha1((root / "config.json").read_bytes()).hexdigest()
    sig["weights"] = {p.name: [p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(root.glob("*.safetensors"))}
    return sig


def run(cfg: DictConfig) -> Path:
    """Regenerate (or finish regenerating) ``cfg.data.data_dir``; returns it.

    The data dir is owned by one process at a time (:mod:`drafters.locks`): a second job with the same
    settings waits for the first, then finds its shards finished.
    """
    with locks.hold(Path(cfg.data.data_dir).expanduser(), "data folder", wait=True):
        return _regenerate(cfg)


def _regenerate(cfg: DictConfig) -> Path:
    from datasets.utils.logging import disable_progress_bar

    from drafters.model import target_fingerprint
    from experiments.target import load_target

    disable_progress_bar()  # one bar (ours) is enough
    gen = cfg.data.generation
    if gen.max_new_tokens < 1:
        raise ValueError(f"data.generation.max_new_tokens must be >= 1, got {gen.max_new_tokens}")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    data_dir = Path(cfg.data.data_dir).expanduser()
    prompts = [as_messages(p) for p in hydra.utils.instantiate(gen.prompts)]
    if not prompts:
        raise ValueError(f"data.generation.prompts ({gen.prompts.get('_target_')}) returned no prompts")
    ids = [p[0] for p in prompts]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"prompt ids must be unique; duplicated: {dup}")
    num_suite = check_disjoint(prompts, cfg.suite, cfg.decontaminate)
    print(f"[regenerate] {len(prompts)} prompts, disjoint from {num_suite} suite prompts; data dir {data_dir}",
          flush=True)

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, device, cfg.target.trust_remote_code)
    settings = {"target": OmegaConf.to_container(cfg.target, resolve=True),
                "generation": OmegaConf.to_container(gen, resolve=True)}
    settings["target"].pop("recipe", None)
    meta = regen.read_meta(data_dir)
    signature = target_signature(cfg.target.path)
    if meta and meta.get("target_signature") != signature:
        raise ValueError(f"{data_dir} was regenerated by a different target ({meta.get('target_signature')}); "
                         f"the target now is {signature}. Delete the folder or set data.data_dir elsewhere")
    meta = {"settings": settings, "target_signature": signature,
            "target_fingerprint": target_fingerprint(target.config), "complete": False}
    regen.write_meta(data_dir, meta)

    done = regen.finished_ids(data_dir)
    limit = getattr(target.config, "max_position_embeddings", None) or getattr(target.config, "n_positions", None)
    max_prompt = min(gen.max_prompt_tokens, limit - gen.max_new_tokens) if limit else gen.max_prompt_tokens
    todo, skipped = [], 0
    for pid, domain, messages in prompts:
        if pid in done:
            continue
        tokens = encode(tokenizer, messages)
        if len(tokens) > max_prompt:
            skipped += 1
            continue
        todo.append((pid, domain, tokens))
    todo.sort(key=lambda x: (len(x[2]), x[0]))  # similar lengths share a batch: little padding
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(target, tokenizer)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate", unit="prompt", mininterval=5)
    pending: list[dict] = []
    start = time.time()
    for i in range(0, len(todo), cfg.batch_size):
        batch = todo[i: i + cfg.batch_size]
        seed = int(hashlib.sha1(f"{gen.seed}/{batch[0][0]}".encode()).hexdigest()[:8], 16)
        responses = generate_batch(target, [t for _, _, t in batch], gen, pad_id, eos, seed)
        for (pid, domain, tokens), response in zip(batch, responses):
            pending.append({"id": pid, "domain": domain, "input_ids": tokens + response, "prompt_len": len(tokens)})
        bar.update(len(batch))
        if len(pending) >= cfg.shard_size:
            regen.write_shard(pending, data_dir)
            pending = []
    if pending:
        regen.write_shard(pending, data_dir)
    bar.close()
    data = regen.load_regenerated(data_dir, warn_incomplete=False) if regen.shard_dirs(data_dir) else None
    meta.update(complete=True, rows=len(data) if data is not None else 0, skipped_long_prompts=skipped,
                seconds_last_run=round(time.time() - start, 1))
    regen.write_meta(data_dir, meta)
    if data is None:
        raise ValueError(f"no prompt fits max_prompt_tokens={max_prompt}: nothing regenerated into {data_dir}")
    import pyarrow.compute as pc

    new = pc.sum(pc.list_value_length(data.data.column("input_ids"))).as_py() - sum(data["prompt_len"])
    print(f"[regenerate] {len(data)} rows ({new} response tokens, {skipped} prompts too long) in {data_dir}",
          flush=True)
    return data_dir


def needs_regeneration(data_dir: str | Path) -> bool:
    """True when ``data_dir`` holds no shards yet or an interrupted regeneration (``complete: false``).

    A folder of shards without ``regen.json`` is someone's own data and is never regenerated into.
    """
    meta = regen.read_meta(data_dir)
    return not regen.shard_dirs(data_dir) or (bool(meta) and not meta.get("complete"))


def ensure_data(cfg: DictConfig) -> Path:
    """Regenerate the data another entry point's config points at (``experiments.train``) if it is missing.

    Uses that config's ``target``, ``data``, ``suite``, ``seed`` and ``num_threads`` and this entry point's
    own defaults (``conf/regenerate.yaml``) for the rest, so the folder is the one
    ``python -m experiments.regenerate`` with the same target and data settings writes.
    """
    data_dir = Path(cfg.data.data_dir).expanduser()
    if not needs_regeneration(data_dir):
        return data_dir
    with locks.hold(data_dir, "data folder", wait=True):  # another job may be regenerating it: wait
        if not needs_regeneration(data_dir):
            print(f"[regenerate] {data_dir} was regenerated by another job meanwhile: using it", flush=True)
            return data_dir
        return _ensure_data(cfg, data_dir)


def _ensure_data(cfg: DictConfig, data_dir: Path) -> Path:
    own = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "regenerate.yaml")
    sub = OmegaConf.create({k: own[k] for k in ("device", "batch_size", "shard_size", "decontaminate")})
    for key in ("target", "data", "suite", "seed", "num_threads"):
        sub[key] = OmegaConf.to_container(cfg[key], resolve=True) if isinstance(cfg[key], DictConfig) else cfg[key]
    print(f"[regenerate] {data_dir} is missing or incomplete: regenerating it first "
          "(data.regenerate_if_missing=false turns this off)", flush=True)
    return run(sub)


@hydra.main(version_base="1.3", config_path="../conf", config_name="regenerate")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(cfg)


if __name__ == "__main__":
    main()
