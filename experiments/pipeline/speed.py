"""Speed at batch 1 of several drafters against one timing of the target alone (``python -m experiments.speed``).

``experiments.evaluate`` times a drafter against the target alone prompt by prompt, so timing three drafters there
decodes every prompt three times with the target alone. Here each batch (one prompt at batch 1) is decoded once by
the target alone and then speculatively with every drafter in turn, in one process: each drafter's speedup is
its tokens/s over the same target-alone tokens/s, all measured interleaved under the same conditions.

Temperature 0 only: exact verification makes every drafter's output the target's greedy output, so the answers fed
back before MT-Bench's second turn are the target's own, the same for all, and ``greedy_match`` checks it.

Each drafter gets the results.json of a one-drafter evaluation (``<run dir>/<name>/results.json``, its config's
``drafter`` that drafter's), so ``experiments.report --speed <run dir>/<name>`` reads it as it reads
``experiments.evaluate``'s. A finished suite is saved at once; running again with ``hydra.run.dir=<that run dir>``
times only the suites some drafter lacks (all the drafters again: they share the target's timing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from drafters import locks
from drafters.storage import write_json_atomic
from experiments.data.suites import Prompt
from experiments.pipeline.evaluation import (
    build_drafter,
    load_evaluation,
    results_doc,
    resume_results,
    speculative_batch,
    target_batch,
    warm_up,
)
from experiments.pipeline.records import temperature_key
from experiments.pipeline.run_folder import commit_hydra_records, commit_job_log, discard_hydra_records
from experiments.pipeline.settings import DecodingSettings
from experiments.pipeline.suite_batches import start_decoding, suite_result, turn_batches
from verify.layout import set_weight_layout

T0 = temperature_key(0.0)


def time_suite(target, tokenizer, drafters: Mapping[str, object], prompts: Sequence[Prompt], *, suite: str,
               settings: DecodingSettings) -> dict[str, dict]:
    """One suite at T=0: every batch decoded by the target alone once, then speculatively with each drafter in turn.
    Returns each drafter's results.json entry (the fields of
    :func:`experiments.pipeline.evaluation.evaluate_suite`), its speedup over the shared target-alone timing."""
    alone = start_decoding(target, tokenizer, suite, 0.0, settings)
    runs = {name: start_decoding(target, tokenizer, suite, 0.0, settings) for name in drafters}
    answers: list[list[str]] = [[] for _ in prompts]  # the target's own, fed back before later turns
    turns = {name: [[] for _ in prompts] for name in drafters}
    for first, chunk, rows in turn_batches(target, tokenizer, prompts, answers, alone, settings, f"{suite} speed"):
        if first:  # each path's one-time costs outside the timings
            for drafter in drafters.values():
                warm_up(target, drafter, rows, alone)
        greedy = target_batch(target, rows, alone)
        for name, drafter in drafters.items():
            new_tokens, done = speculative_batch(target, tokenizer, drafter, rows, runs[name])
            runs[name].matches += sum(a == b for a, b in zip(new_tokens, greedy))
            for i, (record, _) in zip(chunk, done):
                turns[name][i].append(record)
        for i, new in zip(chunk, greedy):
            answers[i].append(tokenizer.decode(new, skip_special_tokens=True).strip())
    entries = {}
    for name, run in runs.items():
        run.target_time, run.target_new, run.truncated = alone.target_time, alone.target_new, alone.truncated
        entries[name] = suite_result(suite, 0.0, prompts, turns[name], run, drafters[name].num_draft_tokens, settings,
                                     measure_target_only=True)
    return entries


def drafter_run_config(cfg: DictConfig, name: str) -> DictConfig:
    """The config of a one-drafter evaluation of ``drafters.<name>`` into ``<run dir>/<name>/``."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["drafter"] = plain.pop("drafters")[name]
    plain["results_path"] = str(Path(cfg.paths.run_dir) / name / "results.json")
    return OmegaConf.create(plain)


def _settings(cfg: DictConfig) -> DecodingSettings:
    """The decoding settings, refused unless at T=0 with at least one drafter."""
    settings = DecodingSettings.from_config(cfg)
    if list(settings.temperatures) != [0.0]:
        raise ValueError(f"experiments.speed times temperature 0 only (temperatures=[0.0]), got "
                         f"{list(settings.temperatures)}: above 0 the drafters' answers differ")
    if not cfg.get("drafters"):
        raise ValueError("drafters: none given; name each with +drafter@drafters.<name>=<choice> (a conf/eval/drafter/ "
                         "choice: block, prompt_lookup, ar_assistant) and set its keys with drafters.<name>.<key>=...")
    return settings


def run_speed(cfg: DictConfig) -> dict[str, dict]:
    """Time every drafter of ``cfg.drafters`` against the target alone on ``cfg.suite`` at T=0 (the decoding
    settings of ``cfg``); returns (and writes to ``<run dir>/<name>/results.json``) each one's results document."""
    settings = _settings(cfg)
    run_dir = Path(cfg.paths.run_dir).expanduser()
    try:
        with locks.hold(run_dir, "run folder"):
            return _run_speed(cfg, settings, run_dir)
    finally:
        discard_hydra_records()  # refused before owning the run dir: its .hydra/ stays the owner's


def _run_speed(cfg: DictConfig, settings: DecodingSettings, run_dir: Path) -> dict[str, dict]:
    suites, target, tokenizer = load_evaluation(cfg, settings)
    configs = {name: drafter_run_config(cfg, name) for name in cfg.drafters}
    built = {name: build_drafter(c.drafter, target) for name, c in configs.items()}
    docs, paths = {}, {name: Path(c.results_path) for name, c in configs.items()}
    for name, c in configs.items():
        set_weight_layout(settings.weight_layout, target, built[name].drafter)
        if isinstance(built[name].drafter, torch.nn.Module):
            built[name].drafter.eval()
        docs[name] = results_doc(c, settings, built[name].info, target, suites)
        if paths[name].is_file():
            resume_results(docs[name], paths[name], redo_if_changed=True)  # kept aside, timed again
    commit_hydra_records(run_dir)
    commit_job_log(run_dir)
    drafters = {name: b.drafter for name, b in built.items()}
    for suite, prompts in suites.items():
        if all(T0 in docs[name]["results"].get(suite, {}) for name in docs):
            continue
        for name, entry in time_suite(target, tokenizer, drafters, prompts, suite=suite, settings=settings).items():
            docs[name]["results"].setdefault(suite, {})[T0] = entry
            write_json_atomic(paths[name], docs[name])
            print(f"[speed] {suite} {name}: tau {entry['tau']:.3f}, {entry['spec_tokens_per_s']:.1f} / "
                  f"{entry['target_tokens_per_s']:.1f} tok/s = {entry['speedup']:.2f}x over "
                  f"{entry['num_prompts']} prompts", flush=True)
    for name, doc in docs.items():
        write_json_atomic(paths[name], doc)  # the latest config and commit, also when nothing was left to do
    print(f"[speed] results in {run_dir}/<drafter>/results.json", flush=True)
    return docs
