"""The serving check (issue 41): does vLLM accept what blockdraft says the drafter will, and how fast is it?

:func:`run_serve_check` (``python -m experiments.serve_check``, settings ``conf/serve_check.yaml``):

1. loads the target, its tokenizer and the drafter (refused, step ``drafter``, when the drafter was
   trained for another target), and every suite's prompts, first turn only, rendered and encoded as
   ``experiments.evaluate`` does (chat template, the last ``max_prompt_tokens`` tokens);
2. exports the drafter in the DFlash format (:func:`drafters.dflash.export_dflash`) into the run folder;
3. loads one vLLM engine per speculator (target alone, vLLM's n-gram lookup, the drafter; its own
   environment, :mod:`experiments.serving.engine`), all at once, and runs each on every suite at
   ``concurrency`` 1 (one request at a time) and 8 (all of a suite's prompts submitted together, up to 8
   decoded at once), T=0, the engines taking turns phase by phase;
4. reads the engine's speculative-decoding counters per suite (step ``metrics`` when absent) and
   replays blockdraft's verification of the same drafter on the engine's own output sequences
   (:mod:`experiments.serving.compare`);
5. writes ``serve_check.json``, ``serve_check.md`` (tables) and ``serve_check.png`` into the run folder.

Acceptance is read from the concurrency-1 phase. vLLM loads one model configuration per engine, so the
engines are separate processes; taking turns phase by phase (the first engine rotating) interleaves them, so
their speed ratios are measured under the same load even on a shared machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from drafters import factory
from drafters.dflash import DFlashFormatError, export_dflash, reads_final_output
from drafters.model import DFlashDrafter
from drafters.storage import write_json_atomic
from experiments.data.prompts import encode_prompt
from experiments.data.suites import load_suites
from experiments.data.target import eos_token_ids, load_target
from experiments.pipeline.evaluation import prompt_budget
from experiments.pipeline.paths import record_path
from experiments.pipeline.records import machine
from experiments.serving.compare import sequence_acceptance
from experiments.serving.engine import ServingError, vllm_python
from experiments.serving.engine import run_engines as serve
from experiments.serving.report import plot, tables

SPECULATORS = ("target", "ngram", "drafter")


def load_drafter(path: str, target) -> DFlashDrafter:
    """The saved drafter at ``path`` attached to ``target``; ServingError ``drafter`` when it cannot be."""
    try:
        return factory.load(Path(path).expanduser(), target)
    except (FileNotFoundError, ValueError) as e:
        raise ServingError("drafter", f"drafter.path={path} cannot draft for this target: {e}") from e


def encode_suites(cfg: DictConfig, tokenizer, target) -> dict[str, list[list[int]]]:
    """Every suite's first-turn prompts as token ids, as ``experiments.evaluate`` renders them."""
    budget = prompt_budget(target, cfg.max_prompt_tokens, cfg.max_new_tokens)
    encoded = {}
    for suite, prompts in load_suites(cfg.suite).items():
        rows = [encode_prompt(tokenizer, p.turns[:1], [], cfg.use_chat_template) for p in prompts]
        encoded[suite] = [ids[-budget:] for ids in rows]
    return encoded


def served_width(cfg: DictConfig, drafter) -> int:
    """vLLM's num_speculative_tokens W for the drafter: ``num_speculative_tokens`` (null: K, the whole block).
    vLLM drafts a block of W + 1 columns that attend to each other, the block blockdraft drafts with
    ``drafter.own_draft_tokens=W`` and replays with ``width=W``; W < K verifies fewer columns a step."""
    k = drafter.num_draft_tokens
    width = k if cfg.get("num_speculative_tokens") is None else int(cfg.num_speculative_tokens)
    if not 1 <= width <= k:
        raise ValueError(f"num_speculative_tokens={width}: must be in 1..{k} (K of the drafter) or null")
    return width


def speculative_config(name: str, cfg: DictConfig, drafter_dir: Path, num_drafts: int) -> dict | None:
    if name == "target":
        return None
    if name == "ngram":
        return {"method": "ngram", **OmegaConf.to_container(cfg.ngram, resolve=True)}
    return {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": num_drafts}


def engine_job(cfg: DictConfig, spec: dict | None, suites: dict[str, list[list[int]]], stop_ids: list[int]) -> dict:
    phases = [{"name": f"{suite}/c{c}", "suite": suite, "prompts": prompts, "max_tokens": int(cfg.max_new_tokens),
               "concurrency": int(c), "ignore_eos": False}
              for suite, prompts in suites.items() for c in cfg.concurrency]
    return {"model": str(Path(cfg.target.path).expanduser()), "speculative_config": spec,
            "dtype": cfg.vllm.dtype, "max_model_len": int(cfg.vllm.max_model_len),
            "max_num_seqs": max(int(c) for c in cfg.concurrency), "seed": 0, "stop_token_ids": stop_ids,
            "phases": phases}


def _check_metrics(name: str, phases: list[dict]) -> None:
    """ServingError ``metrics`` when a speculating engine reported no drafts."""
    missing = [p["name"] for p in phases if not p["spec"].get("num_drafts")]
    if missing:
        raise ServingError("metrics", f"the {name} engine reported no vllm:spec_decode_num_drafts for "
                                      f"{missing}: the speculator did not run or its counters are absent "
                                      "(the worker builds LLM with disable_log_stats=False)")


def run_engines(cfg: DictConfig, drafter_dir: Path, num_drafts: int, suites, stop_ids) -> dict[str, dict]:
    """Each speculator's engine result, all engines loaded at once and their phases taken in turns
    (:func:`experiments.serving.engine.run_engines`)."""
    unknown = [name for name in cfg.speculators if name not in SPECULATORS]
    if unknown:
        raise ValueError(f"speculators: unknown {unknown}; expected some of {SPECULATORS}")
    jobs = {name: engine_job(cfg, speculative_config(name, cfg, drafter_dir, num_drafts), suites, stop_ids)
            for name in cfg.speculators}
    print(f"[serve_check] vLLM with {', '.join(jobs)} in turns: {sum(len(p) for p in suites.values())} prompts x "
          f"{len(cfg.concurrency)} concurrency settings", flush=True)
    results = serve(jobs, env_dir=cfg.vllm.env, start_timeout=float(cfg.vllm.start_timeout),
                    run_timeout=float(cfg.vllm.run_timeout), threads=cfg.vllm.threads,
                    kv_cache_gb=int(cfg.vllm.kv_cache_gb), threads_bind=cfg.vllm.threads_bind)
    for name, result in results.items():
        if name != "target":
            _check_metrics(name, result["phases"])
    return results


def _outputs(phase: dict, stop_ids: list[int]) -> list[list[int]]:
    """Output ids as blockdraft keeps them: a stop (EOS) token the engine dropped is put back."""
    outs = []
    for ids, reason in zip(phase["outputs"], phase["finish_reasons"], strict=True):
        outs.append(list(ids) if reason != "stop" or (ids and ids[-1] in stop_ids) else list(ids) + [stop_ids[0]])
    return outs


def suite_acceptance(phase: dict, prompts, drafter, target, stop_ids, k: int) -> dict:
    """vLLM's counters on one suite (``k`` speculative tokens) next to blockdraft's replay on the engine's outputs."""
    spec = phase["spec"]
    steps = spec["num_drafts"]
    vllm = {"num_drafts": steps, "num_accepted_tokens": spec["num_accepted_tokens"],
            "accepted_per_pos": spec["accepted_per_pos"][:k],
            "acceptance_length": 1 + spec["num_accepted_tokens"] / steps,
            "position_acceptance": [c / steps for c in spec["accepted_per_pos"][:k]]}
    ours = sequence_acceptance(drafter, target, prompts, _outputs(phase, stop_ids), lookahead=k,
                               width=None if k == drafter.num_draft_tokens else k)
    ours.pop("engine_steps_accepted")
    gap = vllm["acceptance_length"] / ours["engine_steps"]["acceptance_length"] - 1
    return {"vllm": vllm, **ours, "relative_difference": gap}


def speeds(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """tokens/s per speculator and concurrency, pooled over suites."""
    table: dict[str, dict[str, float]] = {}
    for name, result in results.items():
        for phase in result["phases"]:
            row = table.setdefault(name, {}).setdefault(f"c{phase['concurrency']}", [0, 0.0])
            row[0] += phase["num_tokens"]
            row[1] += phase["wall_s"]
    return {n: {c: tok / wall for c, (tok, wall) in row.items()} for n, row in table.items()}


def step_costs(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per suite at concurrency 1, the cost model of serving the drafter: the target alone's ms per token, the drafter
    engine's ms per verification step (its wall time over its drafts, prefill included), their ratio (the acceptance
    length the drafter needs to break even) and vLLM's acceptance length."""
    if "target" not in results or "drafter" not in results:
        return {}
    target = {p["name"]: p for p in results["target"]["phases"] if p["concurrency"] == 1}
    costs = {}
    for phase in results["drafter"]["phases"]:
        alone, steps = target.get(phase["name"]), phase["spec"].get("num_drafts", 0)
        if phase["concurrency"] != 1 or alone is None or not steps or not alone["num_tokens"]:
            continue
        per_token, per_step = 1e3 * alone["wall_s"] / alone["num_tokens"], 1e3 * phase["wall_s"] / steps
        costs[phase["name"].split("/")[0]] = {
            "target_ms_per_token": per_token, "drafter_ms_per_step": per_step, "step_cost": per_step / per_token,
            "acceptance_length": 1 + phase["spec"].get("num_accepted_tokens", 0) / steps}
    return costs


def settings(cfg: DictConfig) -> dict:
    """What the record keeps of the settings: no machine paths."""
    kept = OmegaConf.to_container(cfg, resolve=True)
    kept.pop("out_dir", None)
    kept["drafter"]["path"] = record_path(cfg.drafter.path)
    kept["target"]["path"] = record_path(cfg.target.path)
    kept["vllm"]["env"] = record_path(cfg.vllm.env)
    return kept


def _identical_outputs(results: dict[str, dict]) -> bool:
    outputs = [[p["outputs"] for p in r["phases"]] for r in results.values()]
    return all(o == outputs[0] for o in outputs)


def run_serve_check(cfg: DictConfig) -> dict:
    """The whole check (module doc); returns the document written to ``serve_check.json``."""
    vllm_python(cfg.vllm.env)  # a missing environment fails before any model is loaded
    torch.set_num_threads(int(cfg.num_threads)) if cfg.num_threads else None
    out_dir = Path(cfg.out_dir)
    target, tokenizer = load_target(cfg.target.path, "float32", "cpu", cfg.target.trust_remote_code)
    drafter = load_drafter(cfg.drafter.path, target)
    if reads_final_output(drafter.config):
        raise ServingError("drafter", f"drafter.path={cfg.drafter.path} reads the target's final-norm hidden "
                                      "state, which vLLM never provides: it would be served wrongly")
    try:
        drafter_dir = export_dflash(drafter, out_dir / "drafter_dflash")
    except DFlashFormatError as e:
        raise ServingError("export", str(e)) from e
    suites = encode_suites(cfg, tokenizer, target)
    stop_ids = eos_token_ids(target, tokenizer)
    num_drafts = served_width(cfg, drafter)
    results = run_engines(cfg, drafter_dir, num_drafts, suites, stop_ids)
    doc = {"settings": settings(cfg), "vllm_version": next(iter(results.values()))["vllm_version"],
           "num_prompts": {s: len(p) for s, p in suites.items()}, "speed_tokens_per_s": speeds(results),
           "speed_by_phase": {n: {p["name"]: p["num_tokens"] / p["wall_s"] for p in r["phases"]}
                              for n, r in results.items()},
           "step_cost": step_costs(results), "outputs_identical": _identical_outputs(results), "acceptance": {},
           "engine_start_s": {n: r["startup_s"] for n, r in results.items()}, "machine": machine()}
    if "drafter" in results:
        for phase in results["drafter"]["phases"]:
            if phase["concurrency"] == 1:
                doc["acceptance"][phase["name"].split("/")[0]] = suite_acceptance(
                    phase, suites[phase["name"].split("/")[0]], drafter, target, stop_ids, num_drafts)
    out_dir.mkdir(parents=True, exist_ok=True)
    if "drafter" in results:  # what the acceptance was replayed on, to replay it again
        (out_dir / "engine_outputs.json").write_text(json.dumps(
            {p["name"]: {"prompts": suites[p["name"].split("/")[0]], "outputs": p["outputs"],
                         "finish_reasons": p["finish_reasons"]}
             for p in results["drafter"]["phases"] if p["concurrency"] == 1}) + "\n")
    (out_dir / "serve_check.md").write_text(tables(doc))
    plot(doc, out_dir / "serve_check.png")
    write_json_atomic(out_dir / "serve_check.json", doc)  # last: its presence means the check finished
    print(tables(doc), flush=True)
    return doc
