"""Regeneration through a real OpenAI-compatible server: ``transformers serve`` on 127.0.0.1, CPU.

The server (``transformers[serving]``, in the ``dev`` extra) serves the embedded tiny target in float32
(its ``target.dtype``); ``experiments.regenerate data/backend=openai`` answers 6 prompts through it and
is compared with in-process greedy regeneration of the same prompts.

Where the two can differ, and why:

* **Token ids.** ``transformers serve`` returns text only, so the answer is re-tokenized with the
  target's tokenizer. A model can emit a segmentation of a string that is not its tokenizer's own
  (e.g. ``"de" + "f"`` where the tokenizer writes ``"def"``); re-tokenizing gives the canonical one. So
  ids are asserted identical wherever the in-process answer is canonically tokenized, and the decoded
  texts everywhere. (A server returning ids, vLLM with ``return_token_ids``, has no such difference.)
* **Numerics.** In-process regeneration batches left-padded prompts; the server answers each alone.
  Padding changes float sums at ~1e-6, which can flip a near-tied greedy choice; the in-process run here
  uses ``batch_size=1`` so both run the same unpadded forwards on the same CPU kernels.
* **Sampling** (temperature > 0, not tested here) never matches token for token: the server draws from
  its own generator (one global torch seed per request, concurrent requests interleave), and its
  ``GenerationConfig`` defaults (``top_k=50`` when the model's generation config sets none) apply.

The server is killed after the first shard is written: the job fails naming ``data.backend.endpoint``;
restarted, the run keeps that shard and finishes the same rows.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from test_train import offline_env, run_main

from drafters.training import datamodule as regen_data
from experiments import regenerate
from experiments.data.target import TINY_TARGET_DIR

SERVING = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "openai"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.serving,
    pytest.mark.skipif(not SERVING, reason="`transformers serve` needs the transformers[serving] extra (fastapi, "
                                           "uvicorn, openai): pip install -e '.[dev]'"),
]

SERVE = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
COMMON = ["target=tiny", "data=regen_greedy", "+data.generation.prompts={_target_:test_regen_server.six_prompts}",
          "data.generation.max_new_tokens=20", "suite=[humaneval]", "num_threads=1"]
QUESTIONS = {"code": ["def add(a, b):", "Write a function that reverses a list.", "What does `import os` do?"],
             "dialogue": ["Hello, how are you?", "Tell me a joke."],
             "reasoning": ["Tom has 3 apples and buys 5 more. How many apples does he have?"]}


def six_prompts(**_) -> list[dict]:
    """The test's training prompts (``data.generation.prompts``; the corpora take ~15 s to read here)."""
    return [{"id": f"{domain}/{i}", "domain": domain, "messages": [{"role": "user", "content": q}]}
            for domain, questions in QUESTIONS.items() for i, q in enumerate(questions)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(port: int, root) -> subprocess.Popen:
    """``transformers serve <tiny target>`` on 127.0.0.1:port (float32, CPU), starting."""
    log = open(root / f"serve-{time.time_ns()}.log", "w")  # noqa: SIM115  (the server writes it until killed)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "hub"),
           "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
    (root / "hub").mkdir(exist_ok=True)  # an empty hub cache: /v1/models lists nothing (not an error)
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", str(TINY_TARGET_DIR), "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log.name
    return proc


def wait_ready(proc: subprocess.Popen, port: int) -> subprocess.Popen:
    """``proc`` once its /health answers (90 s at most)."""
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited ({proc.returncode}); log: {proc.log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"transformers serve did not answer /health in 90 s; log: {proc.log}")


def rows_by_id(data_dir) -> dict:
    data = regen_data.load_regenerated(data_dir)
    return {r["id"]: r for r in data}


def kill_after_first_shard(mp, server: subprocess.Popen) -> None:
    """The server dies right after the job saved its first shard (the job is mid-run)."""
    write = regen_data.write_shard

    def write_then_kill(rows, data_dir):
        out = write(rows, data_dir)
        if server.poll() is None:
            server.kill()
            server.wait()
        return out

    mp.setattr(regen_data, "write_shard", write_then_kill)


def test_regenerate_through_transformers_serve_matches_in_process_and_resumes(tmp_path):
    from transformers import AutoTokenizer

    from experiments.pipeline.regen_backends import EndpointUnreachable

    port = free_port()
    server = launch_server(port, tmp_path)  # loads while the in-process run works
    try:
        with pytest.MonkeyPatch.context() as mp:
            offline_env(mp, tmp_path)
            run_main(regenerate, [*COMMON, "batch_size=1"])  # in process, unpadded (see the docstring)
            wait_ready(server, port)
            (local,) = (tmp_path / "cache" / "regen" / "tiny").iterdir()
            served = [*COMMON, "data/backend=openai", f"data.backend.endpoint=http://127.0.0.1:{port}/v1",
                      f"data.backend.model={TINY_TARGET_DIR}", "data.backend.retries=1", "data.backend.backoff_s=0.2",
                      "data.backend.timeout_s=60", "data.backend.concurrency=2", "batch_size=2", "shard_size=2"]
            with pytest.MonkeyPatch.context() as kill:
                kill_after_first_shard(kill, server)
                with pytest.raises(EndpointUnreachable, match=f"data.backend.endpoint=http://127.0.0.1:{port}/v1"):
                    run_main(regenerate, served)
            (remote,) = {d for d in (tmp_path / "cache" / "regen" / "tiny").iterdir()} - {local}
            meta = regen_data.read_meta(remote)
            first = regen_data.shard_dirs(remote)
            assert not meta["complete"] and len(first) == 1 and meta["answers"]["retokenized"] == 2
            first_mtime = first[0].stat().st_mtime_ns

            server = wait_ready(launch_server(port, tmp_path), port)  # restarted: the same command resumes
            run_main(regenerate, served)
        meta = regen_data.read_meta(remote)
        assert meta["complete"] and meta["rows"] == 6 and meta["backend"]["kind"] == "openai"
        assert first[0].stat().st_mtime_ns == first_mtime and len(regen_data.shard_dirs(remote)) == 3
        assert meta["answers"]["retokenized"] == 6 and meta["answers"]["round_trip_mismatch_rate"] == 0.0
        assert meta["settings"]["generation"]["server"]["model"] == str(TINY_TARGET_DIR)
    finally:
        server.kill()
        server.wait()
    compare_rows(rows_by_id(local), rows_by_id(remote), AutoTokenizer.from_pretrained(str(TINY_TARGET_DIR)))


def compare_rows(local: dict, remote: dict, tok) -> None:
    """Same prompts, same prompt ids, same greedy texts; same ids wherever in-process ids are canonical."""
    assert set(local) == set(remote) and len(local) == 6
    canonical = 0
    for pid, a in local.items():
        b = remote[pid]
        assert a["prompt_len"] == b["prompt_len"] and a["input_ids"][: a["prompt_len"]] == b["input_ids"][: b["prompt_len"]]
        ra, rb = a["input_ids"][a["prompt_len"]:], b["input_ids"][b["prompt_len"]:]
        text = tok.decode(ra, skip_special_tokens=True)
        assert tok.decode(rb, skip_special_tokens=True) == text, pid
        body = [t for t in ra if t != tok.eos_token_id]
        if list(tok(text, add_special_tokens=False)["input_ids"]) == body:
            canonical += 1
            assert ra == rb, pid
    assert canonical >= 1
    print(json.dumps({"rows": len(local), "canonical_in_process": canonical}))
