"""Evaluation: a drafter through the exact verifier on every suite and temperature (``python -m experiments.evaluate``).

The drafter is a config group (``conf/eval/drafter/``, searched by this entry point only), built by
:mod:`experiments.pipeline.eval_drafters`: ``drafter=block`` (the default: a trained block drafter,
``drafter.path=<run dir>/drafter``), ``drafter=prompt_lookup`` (n-gram lookup, no model) or
``drafter=ar_assistant`` (a small causal LM, ``drafter.path=<HF model dir>``, default the one shipped for the
target: ``experiments/assets/ar_assistant`` for tiny, ``ar_assistant_smollm2`` for smollm2). The baselines draft
K = 15 tokens (``drafter.num_draft_tokens``).

For every suite (``suite``, default all three of docs/method.md §5) and temperature (``temperatures``,
default 0 and 1) the target decodes every prompt speculatively with the drafter
(:func:`verify.speculative_generate`, exact verification) and, with ``measure_target_only``, once more
alone (:func:`verify.target_generate`, same prompts, same batches, interleaved batch by batch) for the
speedup. Prompts are sorted by length before batching (little padding); results keep their ids.

Multi-turn prompts (MT-Bench): turn r + 1 is asked after the model's own answers to turns 1..r from
the same speculative run (a second round of batches); every turn counts towards the suite's
statistics. A prompt's turns are pooled into one per-prompt record (kept tokens and steps summed,
accepted counts concatenated), and the bootstrap resamples these records (prompts, not turns).

``results.json`` (see :func:`evaluate` for one entry; :mod:`experiments.pipeline.records`) holds the resolved config, the drafter's
description (``name``, the report's row for baselines; ``kind``, ``path``, ``config``, ...), the target's
fingerprint and path, the git commit, and ``results[suite]["t<temperature>"]``.
Each finished (suite, temperature) is written at once (temp file + rename); running again with
``hydra.run.dir=<that run dir>`` skips it. Each (suite, temperature) has its own generator seeded from
``(seed, suite, temperature)``, so a resumed evaluation gives the same numbers as an uninterrupted one
(wall-clock speeds aside). One process owns the run dir at a time (``<run dir>/.lock``): a second
evaluation into the same run dir refuses, naming the owner. The metrics also go to the logger as ``eval/<suite>/<metric>_t<T>``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from drafters import locks
from drafters.storage import read_json, write_json_atomic
from experiments.data.prompts import left_pad
from experiments.data.suites import Prompt, load_suites
from experiments.data.target import load_target
from experiments.pipeline.eval_drafters import EvalDrafter, drafter_config
from experiments.pipeline.records import (
    RESULTS_FORMAT,
    check_resumable,
    describe_target,
    git_commit,
    logged_metrics,
    machine,
    suite_digests,
    temperature_key,
)
from experiments.pipeline.replay import replay_suite
from experiments.pipeline.run_folder import commit_hydra_records, commit_job_log, discard_hydra_records
from experiments.pipeline.settings import DecodingSettings
from experiments.pipeline.suite_batches import (  # noqa: F401 (prompt_budget re-exported)
    Decoding,
    prompt_budget,
    start_decoding,
    suite_result,
    turn_batches,
)
from verify.generate import speculative_generate, target_generate
from verify.layout import set_weight_layout


def check_suites(suites: Mapping[str, Sequence[Prompt]]) -> None:
    if not suites:
        raise ValueError("no suites to evaluate: the suites mapping is empty")
    for name, prompts in suites.items():
        if not prompts:
            raise ValueError(f"suite {name!r} is empty: it has no prompts to evaluate")
        ids = [p.id for p in prompts]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
            raise ValueError(f"suite {name!r}: prompt ids must be unique; duplicated: {dup}")


# ------------------------------------------------------------------------------------------------
# One (suite, temperature): batches from experiments.pipeline.suite_batches


def speculative_batch(target, tokenizer, drafter, rows: list[list[int]], run: Decoding,
                      clock=None) -> tuple[list[list[int]], list[tuple[dict, str]]]:
    """One batch decoded speculatively (timed into ``run``): per row its new tokens, and its turn record and answer."""
    input_ids, mask = left_pad(rows, run.kwargs["pad_token_id"], run.device)
    out = speculative_generate(target, drafter, input_ids, attention_mask=mask, generator=run.gen_spec,
                               clock=clock, **run.kwargs)
    run.spec_time += out.wall_time
    run.batched_forwards += out.num_batched_forwards
    run.verified_slots += out.num_verified_slots
    done = [({"new_tokens": len(out.new_tokens[row]), "steps": out.target_forwards_per_row[row],
              "accepted_counts": list(out.accepted_counts[row]), "draft_sources": list(out.draft_sources[row])},
             tokenizer.decode(out.new_tokens[row], skip_special_tokens=True).strip()) for row in range(len(rows))]
    return out.new_tokens, done


def target_batch(target, rows: list[list[int]], run: Decoding) -> list[list[int]]:
    """One batch decoded by the target alone (timed into ``run``): per row its new tokens."""
    input_ids, mask = left_pad(rows, run.kwargs["pad_token_id"], run.device)
    base = target_generate(target, input_ids, attention_mask=mask, generator=run.gen_target, **run.kwargs)
    run.target_time += base.wall_time
    run.target_new += base.num_new_tokens
    return base.new_tokens


def _decode_batch(target, tokenizer, drafter, rows: list[list[int]], run: Decoding,
                  measure_target_only: bool, clock=None) -> list[tuple[dict, str]]:
    """One batch, speculatively (and target-only for the speedup): per row its turn record and answer."""
    new_tokens, done = speculative_batch(target, tokenizer, drafter, rows, run, clock)
    if measure_target_only:
        run.matches += sum(a == b for a, b in zip(new_tokens, target_batch(target, rows, run)))
    return done


#: New tokens of the untimed decodes that warm both paths up before a suite's timed ones (:func:`warm_up`).
WARM_UP_NEW_TOKENS = 2


def warm_up(target, drafter, rows: list[list[int]], run: Decoding) -> None:
    """A short untimed decode of ``rows`` each way before a suite's timed ones: a process's first decodes pay
    one-time costs (allocations, kernel set-up) that would otherwise land on the speculative side, which runs
    first. Its own generator: the suite's seeded ones are untouched, so sampled answers do not change."""
    input_ids, mask = left_pad(rows, run.kwargs["pad_token_id"], run.device)
    kwargs = {**run.kwargs, "max_new_tokens": min(WARM_UP_NEW_TOKENS, run.kwargs["max_new_tokens"])}
    generator = torch.Generator(device=run.device).manual_seed(0)
    speculative_generate(target, drafter, input_ids, attention_mask=mask, generator=generator, **kwargs)
    target_generate(target, input_ids, attention_mask=mask, generator=generator, **kwargs)


def evaluate_suite(target, tokenizer, drafter, prompts: Sequence[Prompt], *, suite: str, temperature: float,
                   settings: DecodingSettings | None = None, clock=None) -> dict:
    """One (suite, temperature) entry of results.json (see :func:`evaluate` for its fields). ``clock`` times
    the parts of the speculative steps (:func:`verify.speculative_generate`; ``experiments.bench.suite_steps``)."""
    s = settings or DecodingSettings()
    if s.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {s.batch_size}")
    if not temperature >= 0 or temperature == float("inf"):  # NaN fails every comparison
        raise ValueError(f"temperatures must be finite numbers >= 0, got {temperature}")
    run = start_decoding(target, tokenizer, suite, temperature, s)
    answers: list[list[str]] = [[] for _ in prompts]  # the model's own answers, fed back before later turns
    turns: list[list[dict]] = [[] for _ in prompts]  # per prompt, per turn: new_tokens, steps, accepted_counts
    for first, chunk, rows in turn_batches(target, tokenizer, prompts, answers, run, s, f"{suite} T={temperature:g}"):
        if first and s.measure_target_only:  # speeds are measured: warm both paths up first
            warm_up(target, drafter, rows, run)
        done = _decode_batch(target, tokenizer, drafter, rows, run, s.measure_target_only, clock)
        for i, (record, answer) in zip(chunk, done):
            turns[i].append(record)
            answers[i].append(answer)
    return suite_result(suite, temperature, prompts, turns, run, drafter.num_draft_tokens, s, s.measure_target_only)


def _suite_evaluator(settings: DecodingSettings, temperature: float) -> Callable[..., dict]:
    """:func:`evaluate_suite`, or at T=0 with ``replay_greedy`` the replay of the target's greedy answers."""
    return replay_suite if settings.replay_greedy and temperature == 0 else evaluate_suite


def evaluate(
    target,
    tokenizer,
    drafter,
    suites: Mapping[str, Sequence[Prompt]],
    settings: DecodingSettings | None = None,
    *,
    done: Mapping[str, Mapping[str, dict]] | None = None,
    on_result: Callable[[str, str, dict], None] | None = None,
) -> dict[str, dict[str, dict]]:
    """Speculative decoding with ``drafter`` on every suite at every temperature of ``settings``.

    Returns ``{suite: {temperature_key(T): entry}}``. An entry holds the metrics of
    :func:`verify.metrics.summarize` over the suite's prompts (``tau`` micro, ``tau_macro``,
    ``tau_ci_low``/``tau_ci_high`` 95% bootstrap over prompts, ``mean_accepted``, ``accept_hist`` over
    0..K, ``position_acceptance`` a_1..a_K, ``new_tokens``, ``target_forwards``), the speeds
    (``spec_tokens_per_s``, ``target_tokens_per_s``, ``speedup``; wall clock, prefill included),
    ``greedy_match`` (T=0), ``by_draft_source`` (:func:`verify.metrics.accepted_by_source`: the accepted
    drafts per label of the drafter's ``draft_sources()``, e.g. copied hint or the drafter's own tokens), and
    ``prompts``: per-prompt records ``id, turns, new_tokens, steps, new_tokens_per_turn, steps_per_turn,
    accepted_counts, draft_sources`` from which any metric can be recomputed.

    ``done`` holds entries already computed (a resumed run): they are returned as they are, not rerun.
    ``on_result(suite, key, entry)`` is called after each new entry (the entry point saves there).
    """
    check_suites(suites)
    settings = settings or DecodingSettings()
    if not settings.temperatures:
        raise ValueError("temperatures is empty: give at least one (e.g. [0.0, 1.0])")
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()
    done = done or {}
    out: dict[str, dict[str, dict]] = {}
    for suite, prompts in suites.items():
        for temperature in settings.temperatures:
            key = temperature_key(temperature)
            entry = done.get(suite, {}).get(key)
            if entry is not None:
                ids = [r["id"] for r in entry.get("prompts", [])]
                if sorted(ids) != sorted(p.id for p in prompts):
                    raise ValueError(f"the saved result of suite {suite!r} at {key} covers other prompts than the "
                                     f"suite now has ({len(ids)} vs {len(prompts)}); evaluate in a new run dir")
            else:
                entry = _suite_evaluator(settings, temperature)(target, tokenizer, drafter, prompts, suite=suite,
                                                                 temperature=temperature, settings=settings)
                if on_result is not None:
                    on_result(suite, key, entry)
            out.setdefault(suite, {})[key] = entry
    return out


# ------------------------------------------------------------------------------------------------
# The evaluation stage: config -> results.json


def check_drafter_settings(drafter_cfg) -> None:
    """Refuse a ``drafter`` section that leaves a setting its builder needs unset (``drafter=block`` without
    ``drafter.path``), naming the key, before anything is loaded (the builder would fail with a bare TypeError)."""
    if not isinstance(drafter_cfg, Mapping) or "_target_" not in drafter_cfg:
        return
    try:
        builder = hydra.utils.get_method(str(drafter_cfg["_target_"]))
        params = inspect.signature(builder).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return  # an unknown builder: instantiating it names it
    given = drafter_cfg if OmegaConf.is_config(drafter_cfg) else OmegaConf.create(dict(drafter_cfg))
    for p in params:
        unset = p.name not in given or OmegaConf.is_missing(given, p.name)
        if p.name != "target" and p.default is p.empty and p.kind is not p.VAR_KEYWORD and unset:
            example = " (a folder saved by experiments.train, e.g. runs/train/<name>/drafter)" if p.name == "path" else ""
            raise ValueError(f"drafter.{p.name} is not set: {drafter_cfg['_target_']} needs it; give "
                             f"drafter.{p.name}=...{example}")


def build_drafter(drafter_cfg, target) -> EvalDrafter:
    """The drafter of ``drafter_cfg`` (a ``conf/eval/drafter/`` choice, e.g. an evaluation's ``drafter``) for
    ``target``, with its description."""
    check_drafter_settings(drafter_cfg)
    factory = hydra.utils.instantiate(drafter_cfg, _partial_=True)  # called here: its errors are not wrapped
    built = factory(target=target)
    if not isinstance(built, EvalDrafter):
        raise TypeError(f"drafter: {drafter_cfg.get('_target_')} is not an evaluation drafter; choose one of "
                        "conf/eval/drafter/ (block drafter.path=<dir>, prompt_lookup, ar_assistant)")
    return built


def results_doc(cfg: DictConfig, settings: DecodingSettings, drafter_info: dict, target, suites) -> dict:
    """A results.json document with no results yet: the resolved config, settings, drafter, target, commit, suites."""
    return {
        "format": RESULTS_FORMAT,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "settings": settings.generation(),
        "drafter": drafter_info,
        "target": describe_target(target, cfg.target.path),
        "git_commit": git_commit(),
        "machine": machine(),  # speed ratios hold for the kind of machine they were measured on
        "suites": suite_digests(suites),
        "results": {},
    }


def resume_results(doc: dict, results_path: Path, redo_if_changed: bool) -> None:
    """Take the finished entries of an earlier results.json at ``results_path`` into ``doc`` (same drafter,
    target, prompts and settings only; with ``redo_if_changed`` another one is moved aside instead)."""
    previous = read_json(results_path, "results file")
    try:
        check_resumable(previous, doc, results_path)
    except ValueError as e:
        if not redo_if_changed:
            raise
        aside = results_path.with_name(f"{results_path.stem}.replaced-{time.strftime('%Y%m%d-%H%M%S')}.json")
        results_path.rename(aside)  # kept, not lost: the drafter changed since (e.g. trained further)
        print(f"[evaluate] {e}\n[evaluate] evaluating again; the old results moved to {aside}", flush=True)
        previous = {}
    doc["results"] = previous.get("results", {})
    doc["suites"] = {**(previous.get("suites") or {}), **doc["suites"]}
    finished = [f"{s}/{k}" for s, v in doc["results"].items() for k in v]
    if finished:
        print(f"[evaluate] resuming {results_path}: {len(finished)} finished ({', '.join(finished)})", flush=True)


def _result_writer(doc: dict, results_path: Path, logger) -> Callable[[str, str, dict], None]:
    """``on_result`` of :func:`evaluate`: save results.json at once, log the entry, print a line."""
    def on_result(suite: str, key: str, entry: dict) -> None:
        doc["results"].setdefault(suite, {})[key] = entry
        write_json_atomic(results_path, doc)
        logger.log_metrics(logged_metrics(suite, key, entry), step=0)
        logger.save()
        speed = f", speedup {entry['speedup']:.2f}x" if entry.get("speedup") else ""
        print(f"[evaluate] {suite} {key}: tau {entry['tau']:.3f} [{entry['tau_ci_low']:.3f}, "
              f"{entry['tau_ci_high']:.3f}] over {entry['num_prompts']} prompts{speed}", flush=True)

    return on_result


def run_evaluation(cfg: DictConfig) -> dict:
    """Evaluate the drafter of ``cfg.drafter`` on ``cfg.suite`` with the decoding settings of ``cfg``;
    returns (and writes to ``cfg.results_path``) the results.json document.

    The folder of ``results.json`` (the run dir) is owned by one process at a time
    (:mod:`drafters.locks`, as a training run dir): a second evaluation into it refuses, naming the owner.
    """
    settings = DecodingSettings.from_config(cfg)  # bad settings are refused before the run folder is touched
    check_drafter_settings(cfg.drafter)
    try:
        with locks.hold(Path(cfg.results_path).expanduser().parent, "run folder"):
            return _run_evaluation(cfg, settings)
    finally:
        discard_hydra_records()  # refused before owning the run dir: its .hydra/ stays the owner's


def load_evaluation(cfg: DictConfig, settings: DecodingSettings) -> tuple[dict, object, object]:
    """What an evaluation reads, after setting its threads: ``(suites, target, tokenizer)`` of ``cfg``."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    suites = load_suites(cfg.suite)
    check_suites(suites)
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, settings.resolved_device(),
                                    cfg.target.trust_remote_code)
    return suites, target, tokenizer


def _run_evaluation(cfg: DictConfig, settings: DecodingSettings) -> dict:
    suites, target, tokenizer = load_evaluation(cfg, settings)
    built = build_drafter(cfg.drafter, target)
    set_weight_layout(settings.weight_layout, target, built.drafter)
    doc = results_doc(cfg, settings, built.info, target, suites)
    results_path = Path(cfg.results_path)
    if results_path.is_file():
        resume_results(doc, results_path, bool(cfg.get("redo_if_changed", False)))
    run_dir = Path(OmegaConf.select(cfg, "paths.run_dir", default=None) or results_path.parent)
    commit_hydra_records(run_dir)  # checked: this job's .hydra/ replaces the folder's, its log joins
    commit_job_log(run_dir)
    logger = hydra.utils.instantiate(cfg.logger)
    for suite, entries in doc["results"].items():  # a restarted CSV logger starts a fresh file: log them again
        for key, entry in entries.items():
            logger.log_metrics(logged_metrics(suite, key, entry), step=0)
    evaluate(target, tokenizer, built.drafter, suites, settings, done=doc["results"],
             on_result=_result_writer(doc, results_path, logger))
    write_json_atomic(results_path, doc)  # the latest config and commit, also when nothing was left to do
    logger.save()
    logger.finalize("success")
    print(f"[evaluate] results in {results_path}", flush=True)
    return doc


def block_drafter_settings(settings: Mapping | None) -> dict:
    """``evaluate.drafter`` of a training config: the trained drafter's inference settings, keys of
    ``conf/eval/drafter/block.yaml`` other than ``path`` and ``name`` (e.g. ``follow_hint_after``,
    ``own_draft_tokens``); an unknown key is named with the ones there are."""
    settings = OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else dict(settings or {})
    known = set(drafter_config("block")) - {"_target_", "path", "name"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"evaluate.drafter.{unknown[0]}: not a setting of the block drafter "
                         f"(conf/eval/drafter/block.yaml has {sorted(known)})")
    return settings


def evaluate_training_run(cfg: DictConfig) -> dict:
    """Evaluate the drafter a training run just saved (``experiments.train`` with ``evaluate.enabled``).

    Uses the training config's target, suites, decoding settings (``evaluate:``), the drafter's inference
    settings (``evaluate.drafter``, :func:`block_drafter_settings`) and logger (under the
    name ``eval``, so a CSV logger does not overwrite the training curves) and writes
    ``<run dir>/results.json`` beside ``train_summary.json``, where ``experiments.report`` finds both.
    """
    run_dir = Path(cfg.paths.run_dir)
    logger = OmegaConf.to_container(cfg.logger, resolve=True) | {"name": "eval"}
    drafter = {"_target_": "experiments.pipeline.eval_drafters.block_drafter", "path": str(run_dir / "drafter"),
               "name": None, **block_drafter_settings(cfg.evaluate.get("drafter"))}
    # The drafter was (re)trained: old results of other weights are redone.
    return evaluate_like_training(cfg, drafter, run_dir, logger=logger, redo_if_changed=True)


def evaluate_like_training(cfg: DictConfig, drafter: dict, run_dir: Path, *, logger: dict | None = None,
                           redo_if_changed: bool = False, seed: int | None = None) -> dict:
    """Evaluate ``drafter`` (a ``conf/eval/drafter/`` mapping with its ``_target_``) with a training
    config's target, suites and decoding settings (``cfg.evaluate``) into ``<run_dir>/results.json``.

    ``logger``: a logger config (default: a CSV logger in ``run_dir``); ``seed``: replaces
    ``cfg.evaluate.seed`` (the T > 0 sampling streams); ``redo_if_changed``: see :func:`_resume`.
    """
    settings = {k: v for k, v in OmegaConf.to_container(cfg.evaluate, resolve=True).items()
                if k not in ("enabled", "drafter")}  # evaluate.drafter: the trained drafter's, not the baselines'
    if seed is not None:
        settings["seed"] = seed
    eval_cfg = OmegaConf.create(settings | {
        "target": OmegaConf.to_container(cfg.target, resolve=True),
        "suite": OmegaConf.to_container(cfg.suite, resolve=True),
        "logger": logger or {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(run_dir),
                             "name": "eval", "version": ""},
        "drafter": drafter,
        "paths": {"run_dir": str(run_dir)},
        "results_path": str(run_dir / "results.json"),
        "redo_if_changed": redo_if_changed,
    })
    return run_evaluation(eval_cfg)
