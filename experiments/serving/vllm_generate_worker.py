"""Runs inside the vLLM environment (``.venv-vllm``), never in blockdraft's: one engine answering batches.

``python vllm_generate_worker.py <job.json>`` builds one offline ``vllm.LLM`` for the target (``model``,
``dtype``, ``max_model_len``, ``max_num_seqs``, ``seed``), writes ``<inbox>/ready`` (with the engine's
versions), then serves requests until ``<inbox>/stop`` appears: for each ``<inbox>/request_<n>.json``
(``{"prompts": [[ids]], "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"}``) it
generates every prompt in one ``LLM.generate`` call and writes ``<inbox>/answer_<n>.json``
(``{"outputs": [[ids]], "finish_reasons": [...], "wall_s"}``, renamed into place when complete). The driver
is :class:`experiments.serving.vllm_backend.VLLMBackend`. Imports vLLM and the standard library only:
job, requests and answers as JSON are the whole interface between the two environments.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def answer(llm, request: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    temperature = float(request.get("temperature") or 0.0)
    params = SamplingParams(
        temperature=temperature, top_p=float(request.get("top_p") or 1.0), top_k=int(request.get("top_k") or 0),
        max_tokens=int(request["max_tokens"]), stop_token_ids=list(request["stop_token_ids"]),
        seed=int(request["seed"]) if temperature > 0 else None, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    return {"outputs": [list(r.outputs[0].token_ids) for r in results],
            "finish_reasons": [r.outputs[0].finish_reason for r in results],
            "wall_s": time.perf_counter() - start}


def main(job_path: str) -> None:
    import torch
    import vllm
    from vllm import LLM

    job = json.loads(Path(job_path).read_text())
    inbox = Path(job["inbox"])
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=True,
              max_model_len=int(job["max_model_len"]), max_num_seqs=int(job["max_num_seqs"]),
              seed=int(job.get("seed", 0)), skip_tokenizer_init=True, distributed_executor_backend="uni")
    write_json(inbox / "ready", {"vllm": vllm.__version__, "torch": torch.__version__})
    served = 0
    while not (inbox / "stop").exists():
        request = inbox / f"request_{served}.json"
        if not request.exists():
            time.sleep(0.05)
            continue
        write_json(inbox / f"answer_{served}.json", answer(llm, json.loads(request.read_text())))
        request.unlink()
        served += 1


if __name__ == "__main__":
    main(sys.argv[1])
