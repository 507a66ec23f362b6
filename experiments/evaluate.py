"""Evaluate a drafter: ``python -m experiments.evaluate drafter.path=<dir> [suite=all] [...]``.

The drafter is a config group (``conf/eval/drafter/``, searched by this entry point only), built by
:mod:`experiments.eval_drafters`: ``drafter=block`` (the default: a trained block drafter,
``drafter.path=<run dir>/drafter``), ``drafter=prompt_lookup`` (n-gram lookup, no model) or
``drafter=ar_assistant`` (a small causal LM, ``drafter.path=<HF model dir>``, default the shipped
``experiments/assets/ar_assistant``). The baselines draft K = 15 tokens (``drafter.num_draft_tokens``).

For every suite (``suite``, default all three of DESIGN.md §5) and temperature (``temperatures``,
default 0 and 1) the target decodes every prompt speculatively with the drafter
(:func:`verify.speculative_generate`, exact verification) and, with ``measure_target_only``, once more
alone (:func:`verify.target_generate`, same prompts, same batches, interleaved batch by batch) for the
speedup. Prompts are sorted by length before batching (little padding); results keep their ids.

Multi-turn prompts (MT-Bench): turn r + 1 is asked after the model's own answers to turns 1..r from
the same speculative run (a second round of batches); every turn counts towards the suite's
statistics. A prompt's turns are pooled into one per-prompt record (kept tokens and steps summed,
accepted counts concatenated), and the bootstrap resamples these records (prompts, not turns).

``results.json`` (see :func:`evaluate` for one entry) holds the resolved config, the drafter's
description (``name``, the report's row for baselines; ``kind``, ``path``, ``config``, ...), the target's
fingerprint and path, the git commit, and ``results[suite]["t<temperature>"]``.
Each finished (suite, temperature) is written at once (temp file + rename); running again with
``hydra.run.dir=<that run dir>`` skips it. Each (suite, temperature) has its own generator seeded from
``(seed, suite, temperature)``, so a resumed evaluation gives the same numbers as an uninterrupted one
(wall-clock speeds aside). The metrics also go to the logger as ``eval/<suite>/<metric>_t<T>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import experiments  # noqa: F401  (registers the ${asset:...} resolver)
from experiments.eval_drafters import EvalDrafter
from experiments.suites import Prompt, encode_prompt
from verify.drafter import max_positions
from verify.generate import speculative_generate, target_generate
from verify.metrics import summarize

RESULTS_FORMAT = 1
# Settings that change the numbers: a run dir's results.json is only resumed when these agree.
GENERATION_KEYS = ("top_k", "top_p", "max_new_tokens", "batch_size", "max_prompt_tokens", "use_chat_template",
                   "seed", "num_bootstrap", "measure_target_only")
# Scalars of an entry sent to the logger (position acceptance goes as a1, a2, ...).
LOGGED_METRICS = ("tau", "tau_macro", "tau_ci_low", "tau_ci_high", "mean_accepted", "new_tokens",
                  "target_forwards", "spec_tokens_per_s", "target_tokens_per_s", "speedup", "greedy_match")
# Entry fields measured with a clock: they differ between runs, everything else must not.
TIMING_KEYS = ("spec_wall_time_s", "spec_tokens_per_s", "target_wall_time_s", "target_tokens_per_s", "speedup")


def temperature_key(temperature: float) -> str:
    """The results/logger key of a temperature: 0.0 -> "t0", 1.0 -> "t1", 0.7 -> "t0.7"."""
    return f"t{float(temperature):g}"


def stable_seed(*parts: Any) -> int:
    """A 32-bit seed from the parts' string forms (stable across processes, unlike ``hash``)."""
    return int(hashlib.sha1("/".join(str(p) for p in parts).encode()).hexdigest()[:8], 16)


def eos_token_ids(target, tokenizer) -> list[int]:
    """EOS ids of the target's generation config plus the tokenizer's EOS (chat turns end there)."""
    config = getattr(target, "generation_config", None)
    ids = getattr(config, "eos_token_id", None) if config is not None else None
    ids = [] if ids is None else ([int(ids)] if isinstance(ids, int) else [int(i) for i in ids])
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def prompt_budget(target, max_prompt_tokens: int | None, max_new_tokens: int) -> int:
    """Prompt tokens kept (the last ones) so that prompt + ``max_new_tokens`` fits the target's positions."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions(target)
    if max_prompt_tokens is None:
        if limit is None:
            raise ValueError("max_prompt_tokens=null needs a target with a position limit; set max_prompt_tokens")
        max_prompt_tokens = limit - max_new_tokens
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 (or null), got {max_prompt_tokens}")
    if limit is not None and max_prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"max_prompt_tokens {max_prompt_tokens} + max_new_tokens {max_new_tokens} exceeds the "
                         f"target's {limit} positions; lower max_prompt_tokens (or set it to null)")
    return int(max_prompt_tokens)


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids (B, T), attention_mask (B, T))`` of token lists, left-padded to the longest."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row):] = 1
    return input_ids.to(device), mask.to(device)


def _check_suites(suites: Mapping[str, Sequence[Prompt]]) -> None:
    if not suites:
        raise ValueError("no suites to evaluate: the suites mapping is empty")
    for name, prompts in suites.items():
        if not prompts:
            raise ValueError(f"suite {name!r} is empty: it has no prompts to evaluate")
        ids = [p.id for p in prompts]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
            raise ValueError(f"suite {name!r}: prompt ids must be unique; duplicated: {dup}")


def evaluate_suite(
    target,
    tokenizer,
    drafter,
    prompts: Sequence[Prompt],
    *,
    suite: str,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    max_prompt_tokens: int | None = 384,
    seed: int = 0,
    num_bootstrap: int = 1000,
    measure_target_only: bool = True,
    use_chat_template: bool = True,
    progress: bool = True,
) -> dict:
    """One (suite, temperature) entry of results.json (see :func:`evaluate` for its fields)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if temperature < 0:
        raise ValueError(f"temperatures must be >= 0, got {temperature}")
    budget = prompt_budget(target, max_prompt_tokens, max_new_tokens)
    device = next(target.parameters()).device
    eos = eos_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    gen_spec = torch.Generator(device=device).manual_seed(stable_seed(seed, suite, float(temperature)))
    gen_target = torch.Generator(device=device).manual_seed(stable_seed(seed, suite, float(temperature), "target"))
    decode_kwargs = {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_k": top_k,
                     "top_p": top_p, "eos_token_id": eos, "pad_token_id": pad_id}

    answers: list[list[str]] = [[] for _ in prompts]  # the model's own answers, fed back before later turns
    turns: list[list[dict]] = [[] for _ in prompts]  # per prompt, per turn: new_tokens, steps, accepted_counts
    spec_time = target_time = 0.0
    target_new = batched_forwards = truncated = matches = 0
    total = sum(len(p.turns) for p in prompts)
    bar = tqdm(total=total, desc=f"{suite} T={temperature:g}", unit="turn", disable=not progress, mininterval=2)
    for turn in range(max(len(p.turns) for p in prompts)):
        live = [i for i, p in enumerate(prompts) if len(p.turns) > turn]
        encoded = {}
        for i in live:
            ids = encode_prompt(tokenizer, prompts[i].turns[: turn + 1], answers[i], use_chat_template)
            if len(ids) > budget:
                ids, truncated = ids[-budget:], truncated + 1
            encoded[i] = ids
        order = sorted(live, key=lambda i: (len(encoded[i]), prompts[i].id))
        for start in range(0, len(order), batch_size):
            chunk = order[start: start + batch_size]
            input_ids, mask = _left_pad([encoded[i] for i in chunk], pad_id, device)
            out = speculative_generate(target, drafter, input_ids, attention_mask=mask, generator=gen_spec,
                                       **decode_kwargs)
            spec_time += out.wall_time
            batched_forwards += out.num_batched_forwards
            for row, i in enumerate(chunk):
                turns[i].append({"new_tokens": len(out.new_tokens[row]), "steps": out.target_forwards_per_row[row],
                                 "accepted_counts": list(out.accepted_counts[row])})
                answers[i].append(tokenizer.decode(out.new_tokens[row], skip_special_tokens=True).strip())
            if measure_target_only:
                base = target_generate(target, input_ids, attention_mask=mask, generator=gen_target, **decode_kwargs)
                target_time += base.wall_time
                target_new += base.num_new_tokens
                matches += sum(a == b for a, b in zip(out.new_tokens, base.new_tokens))
            bar.update(len(chunk))
    bar.close()

    records = [{
        "id": p.id,
        "turns": len(p.turns),
        "new_tokens": sum(t["new_tokens"] for t in turns[i]),
        "steps": sum(t["steps"] for t in turns[i]),
        "new_tokens_per_turn": [t["new_tokens"] for t in turns[i]],
        "steps_per_turn": [t["steps"] for t in turns[i]],
        "accepted_counts": [c for t in turns[i] for c in t["accepted_counts"]],
    } for i, p in enumerate(prompts)]
    metrics = summarize([r["accepted_counts"] for r in records], [r["new_tokens"] for r in records],
                        [r["steps"] for r in records], drafter.num_draft_tokens, n_boot=num_bootstrap,
                        seed=stable_seed(seed, suite, float(temperature), "bootstrap"))
    spec_tps = metrics["new_tokens"] / max(spec_time, 1e-9)
    target_tps = target_new / max(target_time, 1e-9) if measure_target_only else None
    return {
        "suite": suite,
        "temperature": float(temperature),
        **metrics,
        "num_turns": total,
        "truncated_prompts": truncated,  # turns whose prompt lost its first tokens to max_prompt_tokens
        "batched_forwards": batched_forwards,  # target calls after prefill, summed over batches
        "spec_wall_time_s": spec_time,
        "spec_tokens_per_s": spec_tps,
        "target_new_tokens": target_new if measure_target_only else None,
        "target_wall_time_s": target_time if measure_target_only else None,
        "target_tokens_per_s": target_tps,
        "speedup": spec_tps / target_tps if target_tps else None,
        # Turns whose speculative output equals target-only decoding: 1.0 at T=0 (exactness); at T>0 the
        # two runs draw different random numbers, so this is only the chance of equal samples.
        "greedy_match": matches / total if measure_target_only and temperature == 0 else None,
        "prompts": records,
    }


def evaluate(
    target,
    tokenizer,
    drafter,
    suites: Mapping[str, Sequence[Prompt]],
    *,
    temperatures: Sequence[float] = (0.0, 1.0),
    top_k: int | None = None,
    top_p: float | None = None,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    max_prompt_tokens: int | None = 384,
    seed: int = 0,
    num_bootstrap: int = 1000,
    measure_target_only: bool = True,
    use_chat_template: bool = True,
    done: Mapping[str, Mapping[str, dict]] | None = None,
    on_result: Callable[[str, str, dict], None] | None = None,
    progress: bool = True,
) -> dict[str, dict[str, dict]]:
    """Speculative decoding with ``drafter`` on every suite at every temperature.

    Returns ``{suite: {temperature_key(T): entry}}``. An entry holds the metrics of
    :func:`verify.metrics.summarize` over the suite's prompts (``tau`` micro, ``tau_macro``,
    ``tau_ci_low``/``tau_ci_high`` 95% bootstrap over prompts, ``mean_accepted``, ``accept_hist`` over
    0..K, ``position_acceptance`` a_1..a_K, ``new_tokens``, ``target_forwards``), the speeds
    (``spec_tokens_per_s``, ``target_tokens_per_s``, ``speedup``; wall clock, prefill included),
    ``greedy_match`` (T=0), and ``prompts``: per-prompt records ``id, turns, new_tokens, steps,
    new_tokens_per_turn, steps_per_turn, accepted_counts`` from which any metric can be recomputed.

    ``done`` holds entries already computed (a resumed run): they are returned as they are, not rerun.
    ``on_result(suite, key, entry)`` is called after each new entry (the entry point saves there).
    """
    _check_suites(suites)
    if not temperatures:
        raise ValueError("temperatures is empty: give at least one (e.g. [0.0, 1.0])")
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()
    done = done or {}
    out: dict[str, dict[str, dict]] = {}
    for suite, prompts in suites.items():
        for temperature in temperatures:
            key = temperature_key(temperature)
            entry = done.get(suite, {}).get(key)
            if entry is not None:
                ids = [r["id"] for r in entry.get("prompts", [])]
                if sorted(ids) != sorted(p.id for p in prompts):
                    raise ValueError(f"the saved result of suite {suite!r} at {key} covers other prompts than the "
                                     f"suite now has ({len(ids)} vs {len(prompts)}); evaluate in a new run dir")
            else:
                entry = evaluate_suite(
                    target, tokenizer, drafter, prompts, suite=suite, temperature=temperature, top_k=top_k,
                    top_p=top_p, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    max_prompt_tokens=max_prompt_tokens, seed=seed, num_bootstrap=num_bootstrap,
                    measure_target_only=measure_target_only, use_chat_template=use_chat_template,
                    progress=progress,
                )
                if on_result is not None:
                    on_result(suite, key, entry)
            out.setdefault(suite, {})[key] = entry
    return out


# ------------------------------------------------------------------------------------------------
# results.json


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the source tree, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def describe_target(target, path: str) -> dict:
    """The target's fingerprint (what a drafter depends on) and where it was loaded from."""
    from drafters.model import target_fingerprint

    return {**target_fingerprint(target.config), "path": str(path)}


def suite_digests(suites: Mapping[str, Sequence[Prompt]]) -> dict[str, str]:
    """Per suite, a sha256 of its prompts' ids and turns (what a resumed entry must have answered)."""
    return {name: hashlib.sha256(json.dumps([[p.id, list(p.turns)] for p in prompts]).encode()).hexdigest()
            for name, prompts in suites.items()}


def check_resumable(previous: dict, current: dict, path: Path) -> None:
    """Refuse to resume a results.json written with another drafter (config or weights: the content hash
    of its safetensors), target, suite prompts or generation settings."""
    diffs = []
    answered = sorted(set(previous.get("results") or {}) & set(current.get("suites") or {}))  # suites to resume
    for section, keys in (("settings", GENERATION_KEYS), ("target", None),
                          ("drafter", ("kind", "config", "weights_sha256")), ("suites", answered)):
        if section == "suites" and not keys:
            continue
        old, new = previous.get(section) or {}, current.get(section) or {}
        for k in keys or sorted(set(old) | set(new)):
            if old.get(k) != new.get(k):
                diffs.append(f"{section}.{k}: {old.get(k)!r} -> {new.get(k)!r}")
    if diffs:
        raise ValueError(f"{path} was written by an evaluation with other settings ({'; '.join(diffs[:5])}); "
                         "resume only with the same drafter, target and generation settings, or use a new run dir")


def logged_metrics(suite: str, key: str, entry: Mapping[str, Any]) -> dict[str, float]:
    """Scalars of one entry named ``eval/<suite>/<metric>_<key>`` (position acceptance as ``a<k>``)."""
    metrics = {f"eval/{suite}/{m}_{key}": float(entry[m]) for m in LOGGED_METRICS if entry.get(m) is not None}
    for k, a in enumerate(entry.get("position_acceptance") or [], start=1):
        if a is not None:
            metrics[f"eval/{suite}/a{k}_{key}"] = float(a)
    return metrics


def build_drafter(cfg: DictConfig, target) -> EvalDrafter:
    """The drafter of ``cfg.drafter`` (a ``conf/eval/drafter/`` choice) for ``target``, with its description."""
    factory = hydra.utils.instantiate(cfg.drafter, _partial_=True)  # called here: its errors are not wrapped
    built = factory(target=target)
    if not isinstance(built, EvalDrafter):
        raise TypeError(f"drafter: {cfg.drafter.get('_target_')} is not an evaluation drafter; choose one of "
                        "conf/eval/drafter/ (block drafter.path=<dir>, prompt_lookup, ar_assistant)")
    return built


def run(cfg: DictConfig) -> dict:
    """Evaluate the drafter of ``cfg.drafter`` on ``cfg.suite``; returns (and writes) the results.json document."""
    from experiments.suites import load_suites
    from experiments.target import load_target

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    suites = load_suites(cfg.suite)
    _check_suites(suites)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, device, cfg.target.trust_remote_code)
    built = build_drafter(cfg, target)
    drafter = built.drafter

    settings = {k: OmegaConf.to_container(cfg[k]) if OmegaConf.is_config(cfg[k]) else cfg[k] for k in GENERATION_KEYS}
    doc = {
        "format": RESULTS_FORMAT,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "settings": settings,
        "drafter": built.info,
        "target": describe_target(target, cfg.target.path),
        "git_commit": git_commit(),
        "suites": suite_digests(suites),
        "results": {},
    }
    results_path = Path(cfg.results_path)
    if results_path.is_file():
        from drafters.locks import read_json

        previous = read_json(results_path, "results file")
        try:
            check_resumable(previous, doc, results_path)
        except ValueError as e:
            if not cfg.get("redo_if_changed", False):
                raise
            aside = results_path.with_name(f"{results_path.stem}.replaced-{time.strftime('%Y%m%d-%H%M%S')}.json")
            results_path.rename(aside)  # kept, not lost: the drafter changed since (e.g. trained further)
            print(f"[evaluate] {e}\n[evaluate] evaluating again; the old results moved to {aside}", flush=True)
            previous = {}
        doc["results"] = previous.get("results", {})
        doc["suites"] = {**(previous.get("suites") or {}), **doc["suites"]}
        finished = [f"{s}/{k}" for s, v in doc["results"].items() for k in v]
        if finished:
            print(f"[evaluate] resuming {results_path}: {len(finished)} finished ({', '.join(finished)})",
                  flush=True)

    logger = hydra.utils.instantiate(cfg.logger)
    for suite, entries in doc["results"].items():  # a restarted CSV logger starts a fresh file: log them again
        for key, entry in entries.items():
            logger.log_metrics(logged_metrics(suite, key, entry), step=0)

    def on_result(suite: str, key: str, entry: dict) -> None:
        doc["results"].setdefault(suite, {})[key] = entry
        write_json_atomic(results_path, doc)
        logger.log_metrics(logged_metrics(suite, key, entry), step=0)
        logger.save()
        speed = f", speedup {entry['speedup']:.2f}x" if entry.get("speedup") else ""
        print(f"[evaluate] {suite} {key}: tau {entry['tau']:.3f} [{entry['tau_ci_low']:.3f}, "
              f"{entry['tau_ci_high']:.3f}] over {entry['num_prompts']} prompts{speed}", flush=True)

    evaluate(target, tokenizer, drafter, suites, temperatures=list(cfg.temperatures), top_k=cfg.top_k,
             top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
             max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed, num_bootstrap=cfg.num_bootstrap,
             measure_target_only=cfg.measure_target_only, use_chat_template=cfg.use_chat_template,
             done=doc["results"], on_result=on_result, progress=cfg.progress)
    write_json_atomic(results_path, doc)  # the latest config and commit, also when nothing was left to do
    logger.save()
    logger.finalize("success")
    print(f"[evaluate] results in {results_path}", flush=True)
    return doc


def evaluate_training_run(cfg: DictConfig) -> dict:
    """Evaluate the drafter a training run just saved (``experiments.train`` with ``evaluate.enabled``).

    Uses the training config's target, suites and logger (under the name ``eval``, so a CSV logger
    does not overwrite the training curves) and writes ``<run dir>/results.json`` beside
    ``train_summary.json``, where ``experiments.report`` finds both.
    """
    run_dir = Path(cfg.paths.run_dir)
    settings = {k: v for k, v in OmegaConf.to_container(cfg.evaluate, resolve=True).items() if k != "enabled"}
    logger = OmegaConf.to_container(cfg.logger, resolve=True) | {"name": "eval"}
    eval_cfg = OmegaConf.create(settings | {
        "target": OmegaConf.to_container(cfg.target, resolve=True),
        "suite": OmegaConf.to_container(cfg.suite, resolve=True),
        "logger": logger,
        "drafter": {"_target_": "experiments.eval_drafters.block_drafter", "path": str(run_dir / "drafter"),
                    "name": None},
        "paths": {"run_dir": str(run_dir)},
        "results_path": str(run_dir / "results.json"),
        "redo_if_changed": True,  # the drafter was (re)trained: old results of other weights are redone
    })
    return run(eval_cfg)


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(cfg)


if __name__ == "__main__":
    main()
