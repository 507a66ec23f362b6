"""The OpenAI-compatible regeneration backend against a tiny fake server (``http.server`` in a thread):
malformed JSON, another model, an unreachable or silent endpoint, retries after HTTP 503, the request
fields and where the answer's token ids come from."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf

from experiments.data.target import TINY_TARGET_DIR
from experiments.pipeline.regen_backends import EndpointError, EndpointUnreachable, OpenAIBackend, Prompt
from experiments.pipeline.run_folder import job

MODEL = "tiny"
GEN = OmegaConf.create({"temperature": 0.0, "top_p": None, "top_k": None, "max_new_tokens": 8, "seed": 0})


class FakeServer:
    """Answers ``GET /v1/models`` with ``models`` and each ``POST /v1/chat/completions`` with the next of
    ``answers`` (``(status, body)``; a ``float`` sleeps that long instead); records the request bodies."""

    def __init__(self, answers, models=(MODEL,)):
        self.answers, self.models, self.requests = list(answers), models, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                listed = None if fake.models is None else [{"id": m, "object": "model"} for m in fake.models]
                self._send(200, {"object": "list", "data": listed})

            def do_POST(self):
                fake.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                answer = fake.answers.pop(0) if len(fake.answers) > 1 else fake.answers[0]
                if isinstance(answer, float):
                    time.sleep(answer)
                    return
                self._send(*answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def chat(text: str, model: str = MODEL, finish: str = "length", prompt_tokens=None, **choice) -> tuple[int, dict]:
    usage = {"prompt_tokens": prompt_tokens} if prompt_tokens is not None else {}
    return 200, {"model": model, "usage": usage,
                 "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text},
                              **choice}]}


@pytest.fixture
def serve():
    servers = []

    def start(answers, models=(MODEL,)):
        servers.append(FakeServer(answers, models))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def opened(endpoint: str, **kw) -> OpenAIBackend:
    kw = {"retries": 1, "backoff_s": 0.05, "timeout_s": 5.0, **kw}
    backend = OpenAIBackend(endpoint, MODEL, **kw)
    backend.open(OmegaConf.create({"target": {"path": str(TINY_TARGET_DIR), "trust_remote_code": False}}))
    return backend


PROMPT = Prompt("p/0", [5, 6, 7], [{"role": "user", "content": "def add(a, b):"}])


def test_malformed_json_is_named(serve):
    for body in (b"<html>not json", {"choices": []}, {"choices": [{"message": {}}]}):
        server = serve([(200, body)])
        backend = opened(server.endpoint)
        with pytest.raises(EndpointError, match=f"data.backend.endpoint={server.endpoint} answered malformed JSON"):
            backend.answer([PROMPT], GEN, 0)
        backend.close()
    server = serve([chat("x")])
    server.models = None  # GET /models answers {"data": null}
    with pytest.raises(EndpointError, match="malformed JSON to GET /models"):
        opened(server.endpoint)


def test_another_model_is_refused(serve):
    server = serve([chat("x")], models=["meta-llama/Llama-3.1-8B"])
    with pytest.raises(EndpointError, match=r"data.backend.model=tiny is not served .* serves \['meta-llama"):
        opened(server.endpoint)
    server = serve([chat("x", model="other")], models=[])  # nothing listed: each answer's `model` is checked
    backend = opened(server.endpoint)
    with pytest.raises(EndpointError, match="answered with model 'other', not data.backend.model=tiny"):
        backend.answer([PROMPT], GEN, 0)
    backend.close()
    server = serve([(400, {"detail": "Server is pinned to 'x'; requested 'tiny'."})], models=[])
    backend = opened(server.endpoint)
    with pytest.raises(EndpointError, match=r"HTTP 400: .*pinned.*data.backend.model=tiny"):
        backend.answer([PROMPT], GEN, 0)
    backend.close()


def test_unreachable_and_silent_endpoints_fail_fast(serve):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EndpointUnreachable, match=rf"data.backend.endpoint=http://127.0.0.1:{port}/v1: GET /models "
                                                  r"failed 2 times .*is the server up"):
        opened(f"http://127.0.0.1:{port}/v1")
    server = serve([2.0])  # accepts, never answers in time
    backend = opened(server.endpoint, timeout_s=0.3, retries=0)
    with pytest.raises(EndpointUnreachable, match="failed 1 times .*timed out"):
        backend.answer([PROMPT], GEN, 0)
    backend.close()
    with pytest.raises(ValueError, match="data.backend.endpoint must be an http"):
        OpenAIBackend("127.0.0.1:8000", MODEL)


def test_a_job_refuses_a_down_endpoint_in_one_line(monkeypatch):
    """An entry point's job (``experiments.regenerate``'s) exits with the endpoint's one-line message, no traceback."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as info, job():
        opened(f"http://127.0.0.1:{port}/v1")
    message = str(info.value.code)
    assert message.startswith(f"error: data.backend.endpoint=http://127.0.0.1:{port}/v1: GET /models failed")
    assert "\n" not in message and "Traceback" not in message


def test_retries_after_503_with_backoff(serve, monkeypatch):
    server = serve([(503, {"detail": "loading"}), (503, {"detail": "loading"}), chat("def add(a, b):")])
    backend = opened(server.endpoint, retries=2, backoff_s=0.1)
    slept = []
    monkeypatch.setattr("openai._base_client.time.sleep", slept.append)  # the client's waits before its retries
    (answer,) = backend.answer([PROMPT], GEN, 0)
    assert len(server.requests) == 3 and slept == [0.1, 0.2]  # backoff_s * 2**k
    assert answer.source == "retokenized" and not answer.mismatch
    assert backend.tokenizer.decode(answer.ids) == "def add(a, b):"
    backend.close()
    server = serve([(503, {"detail": "overloaded"})])
    backend = opened(server.endpoint, retries=1)
    with pytest.raises(EndpointError, match="failed 2 times \\(HTTP 503: .*overloaded"):
        backend.answer([PROMPT], GEN, 0)
    backend.close()


def test_request_fields_token_ids_and_eos(serve):
    server = serve([chat("ab", finish="stop", token_ids=[40, 41, 1], prompt_tokens=3),
                    chat("hello", finish="stop", prompt_tokens=3)])
    backend = opened(server.endpoint, concurrency=1, extra_body={"return_token_ids": True})
    sampled = OmegaConf.merge(GEN, {"temperature": 0.7, "top_k": 20})
    first, second = backend.answer([PROMPT, Prompt("p/1", PROMPT.tokens, PROMPT.messages)], sampled, 0)
    assert first.ids == [40, 41, 1] and first.source == "server_ids"  # the server's ids, its EOS kept
    assert first.mismatch == (backend.tokenizer("ab", add_special_tokens=False)["input_ids"] != [40, 41])
    assert second.source == "retokenized" and second.ids[-1] == backend.tokenizer.eos_token_id  # stopped: EOS
    body = server.requests[0]
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "return_token_ids")} == {
        "model": MODEL, "max_tokens": 8, "temperature": 0.7, "top_p": 1.0, "top_k": 20, "return_token_ids": True}
    assert body["seed"] != server.requests[1]["seed"]  # seeded per prompt id
    backend.close()
    server = serve([chat("x", prompt_tokens=9)])  # another tokenizer or chat template on the server
    backend = opened(server.endpoint)
    with pytest.raises(EndpointError, match="counts prompt p/0 as 9 tokens.*check_prompt_tokens=false"):
        backend.answer([PROMPT], GEN, 0)
    backend.close()
