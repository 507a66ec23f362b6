"""Runs inside the vLLM environment (``.venv-vllm``), never in blockdraft's: one engine, several phases.

``python vllm_worker.py <job.json>``: builds one offline ``vllm.LLM`` (target, optional speculative
config), writes ``<ready_file>`` once the engine is up, then for each phase decodes its token-id
prompts greedily, at ``concurrency`` 1 (one request at a time) or all at once (the engine runs up to
``max_num_seqs`` of them together), and writes ``<out>``: per phase the output token ids, finish
reasons, wall time and the engine's speculative-decoding counters over that phase (differences of
``LLM.get_metrics()``'s cumulative ``vllm:spec_decode_*`` counters). With ``turns_dir`` set, phase i
waits for the file ``<turns_dir>/go_i`` and writes ``<turns_dir>/done_i`` after it, so that a driver can
take turns between engines (:func:`experiments.serving.engine.run_engines`). Imports vLLM and the standard
library only: this file is the whole interface between the two environments (job and result as JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """The engine's cumulative speculative-decoding counters: ``{name: int}`` plus ``per_pos: [int]``
    (empty when the engine reports none, e.g. without a speculator)."""
    found: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in SPEC_COUNTERS:
            found[name] = found.get(name, 0) + int(metric.value)
        elif name == PER_POS:
            values = [int(v) for v in metric.values]
            old = found.get("per_pos", [0] * len(values))
            found["per_pos"] = [a + b for a, b in zip(old, values, strict=True)]
    return found


def _difference(after: dict, before: dict) -> dict:
    out = {k.removeprefix("vllm:spec_decode_"): after[k] - before.get(k, 0) for k in after if k != "per_pos"}
    if "per_pos" in after:
        old = before.get("per_pos") or [0] * len(after["per_pos"])
        out["accepted_per_pos"] = [a - b for a, b in zip(after["per_pos"], old, strict=True)]
    return out


def run_phase(llm, phase: dict, stop_token_ids: list[int]) -> dict:
    """Decode one phase's prompts greedily; its outputs, wall time and spec-decode counters."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(phase["max_tokens"]), ignore_eos=bool(phase["ignore_eos"]),
                            stop_token_ids=list(stop_token_ids), detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in phase["prompts"]]
    before = spec_counters(llm)
    start = time.perf_counter()
    if int(phase["concurrency"]) == 1:
        results = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    outputs = [list(r.outputs[0].token_ids) for r in results]
    return {"name": phase["name"], "concurrency": int(phase["concurrency"]), "wall_s": wall,
            "outputs": outputs, "finish_reasons": [r.outputs[0].finish_reason for r in results],
            "num_tokens": sum(len(o) for o in outputs), "spec": _difference(spec_counters(llm), before)}


def build_engine(job: dict):
    from vllm import LLM

    kwargs = {"model": job["model"], "dtype": job.get("dtype", "float32"), "enforce_eager": True,
                  "max_model_len": int(job["max_model_len"]), "max_num_seqs": int(job["max_num_seqs"]),
                  "seed": int(job.get("seed", 0)), "disable_log_stats": False, "skip_tokenizer_init": True,
                  "distributed_executor_backend": "uni"}  # the model runs in this process
    if job.get("speculative_config"):
        kwargs["speculative_config"] = dict(job["speculative_config"])
    return LLM(**kwargs)


def engine_version() -> str:
    import vllm

    return vllm.__version__


def run_phases(llm, job: dict) -> list[dict]:
    """Every phase of ``job``, each after its turn file when ``turns_dir`` is set (module doc)."""
    turns = Path(job["turns_dir"]) if job.get("turns_dir") else None
    phases = []
    for index, phase in enumerate(job["phases"]):
        while turns is not None and not (turns / f"go_{index}").is_file():
            time.sleep(0.05)
        phases.append(run_phase(llm, phase, job.get("stop_token_ids") or []))
        if turns is not None:
            (turns / f"done_{index}").write_text("")
    return phases


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    start = time.perf_counter()
    llm = build_engine(job)
    startup = time.perf_counter() - start
    Path(job["ready_file"]).write_text(f"{startup:.1f}\n")
    phases = run_phases(llm, job)
    result = {"vllm_version": engine_version(), "startup_s": startup, "phases": phases}
    tmp = Path(job["out"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(job["out"])


if __name__ == "__main__":  # vLLM's engine spawns processes: LLM(...) must not run on import
    if len(sys.argv) != 2:
        sys.exit("usage: python vllm_worker.py <job.json>")
    main(sys.argv[1])
