"""Who answers the training prompts in regeneration: the target in this process, or a serving engine.

The config group ``conf/data/backend/`` picks one (``_target_``): ``inprocess`` (default,
:class:`InProcessBackend`, ``target.generate`` on left-padded batches) or ``openai``
(:class:`OpenAIBackend`, any OpenAI-compatible server: vLLM, SGLang, ``transformers serve``)::

    python -m experiments.regenerate data/backend=openai data.backend.endpoint=http://host:8000/v1 \\
        data.backend.model=<served name>     # default: target.path, the name vLLM/SGLang serve it under

Both return the responses as the target's token ids (:class:`Answer`); the stage
(:mod:`experiments.pipeline.regeneration`) prepends the prompt ids it encoded itself with the target's
tokenizer and chat template, so stored rows have one format whoever answered.

Server answers. Each prompt is one ``POST <endpoint>/chat/completions`` (the server applies the
target's chat template), at most ``concurrency`` in flight, each with ``timeout_s``, sent by the
``openai`` client: refused connections, timeouts and HTTP 408/409/429/5xx are retried ``retries``
times after ``backoff_s * 2**k`` seconds (``GET <endpoint>/models`` too). Sampling maps to the
request: ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (only when set: a vLLM/SGLang extension
that other servers refuse), ``max_tokens`` = ``max_new_tokens``, and ``seed`` = a stable hash of
``generation.seed`` and the prompt id. ``extra_body`` is merged into every request (e.g.
``{return_token_ids: true}`` for vLLM, which then returns the response's token ids).

Token ids: taken from the answer when the server sends them (``choices[0].token_ids``, or
``logprobs`` tokens written ``token_id:<n>``, vLLM's ``--return-tokens-as-token-ids``); otherwise
the text is re-tokenized with the target's tokenizer. A response that stopped (``finish_reason:
stop``) gets the target's EOS id appended, as ``target.generate`` keeps it. The round trip is
recorded in ``regen.json`` (``answers``, counted by the stage): for server ids, whether re-tokenizing
the server's text would have given other ids; for re-tokenized text, whether decoding the ids gives
the text back (the ids the server sampled are not visible then: a model can emit a segmentation
other than its tokenizer's, and re-tokenizing replaces it by the canonical one).

Checks, each failing with :class:`EndpointError` naming the setting: the endpoint down or
unreachable (after the retries), an answer that is not the expected JSON, another model listed by
``GET <endpoint>/models`` or named in an answer than ``data.backend.model``, and (``check_prompt_tokens``)
a prompt the server counts in other tokens than the target's tokenizer and chat template give.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import DictConfig, OmegaConf

from drafters.storage import read_json
from experiments.data.hashing import stable_seed
from experiments.data.prompts import left_pad
from experiments.data.target import eos_token_ids, load_target

TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class EndpointError(ConnectionError):
    """The serving endpoint answers an error or malformed JSON, or serves another model (a job refuses it in one
    line, :data:`experiments.pipeline.run_folder.REFUSALS`)."""


class EndpointUnreachable(EndpointError):
    """No answer from the endpoint (refused, unreachable, timed out) after the retries."""


@dataclass
class Prompt:
    """One prompt to answer: its id, the target's prompt ids and the chat messages they render."""

    id: str
    tokens: list[int]
    messages: list[dict]


@dataclass
class Answer:
    """A response as the target's token ids; ``source``: ``generate``, ``server_ids`` or ``retokenized``;
    ``mismatch``: whether the text/id round trip disagreed (None in process)."""

    ids: list[int]
    source: str
    mismatch: bool | None = None


def cut_after_eos(ids: list[int], eos: list[int]) -> list[int]:
    """``ids`` up to and including the first EOS id."""
    stop = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
    return list(ids[:stop])


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], gen, pad_id: int, eos: list[int], seed: int) -> list[list[int]]:
    """Responses (cut after the first EOS) to a batch of prompts, left-padded through ``target.generate``."""
    ids, mask = left_pad(prompts, pad_id, next(target.parameters()).device)
    width = ids.shape[1]
    sample = gen.temperature > 0
    torch.manual_seed(seed)
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=gen.max_new_tokens, do_sample=sample,
        temperature=gen.temperature if sample else None, top_k=(gen.top_k or 0) if sample else None,
        top_p=(gen.top_p or 1.0) if sample else None, repetition_penalty=1.0, pad_token_id=pad_id,
        eos_token_id=eos or None,
    )
    return [cut_after_eos(row, eos) for row in out[:, width:].tolist()]


class InProcessBackend:
    """The target loaded in this process (``device`` of the regeneration settings), batch by batch."""

    def open(self, cfg: DictConfig):
        """Load the target; returns ``(target, tokenizer)``."""
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.target, self.tokenizer = load_target(cfg.target.path, cfg.target.dtype, device,
                                                  cfg.target.trust_remote_code)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.eos = eos_token_ids(self.target, self.tokenizer)
        return self.target, self.tokenizer

    def answer(self, prompts: list[Prompt], gen, seed: int) -> list[Answer]:
        """One ``generate`` call over the batch, seeded by ``seed``."""
        responses = generate_batch(self.target, [p.tokens for p in prompts], gen, self.pad_id, self.eos, seed)
        return [Answer(r, "generate") for r in responses]

    def describe(self) -> dict:
        return {"kind": "inprocess"}

    def close(self) -> None:
        pass


def load_target_files(path: str, trust_remote_code: bool = False):
    """The target's config, generation config and tokenizer without its weights (a server holds those)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    local = Path(str(path)).expanduser()
    if local.exists():
        read_json(local / "config.json", "target config")
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(str(path))
    except OSError:  # no generation_config.json: the config's own ids
        generation_config = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return SimpleNamespace(config=config, generation_config=generation_config), tokenizer


def _openai_client(endpoint: str, api_key: str | None, timeout_s: float, retries: int, backoff_s: float):
    """The openai client for ``endpoint``, retrying after ``backoff_s * 2**k`` seconds; loopback endpoints never
    go through a proxy from the environment. Without ``api_key``: a placeholder key, which local servers ignore."""
    import openai

    class Client(openai.OpenAI):
        # the client's delay before a retry (its own: 0.5 s doubling, jittered), as data.backend.backoff_s says
        def _calculate_retry_timeout(self, remaining_retries, options, response_headers=None) -> float:
            return backoff_s * 2 ** (options.get_max_retries(self.max_retries) - remaining_retries)

    host = urllib.parse.urlsplit(endpoint).hostname or ""
    http = openai.DefaultHttpxClient(trust_env=False) if host in {"127.0.0.1", "localhost", "::1"} else None
    return Client(base_url=endpoint, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=retries,
                  http_client=http)


class OpenAIBackend:
    """An OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) answering through
    ``/chat/completions``; see the module docstring for the request, retries and checks."""

    def __init__(self, endpoint: str, model: str, api_key: str | None = None, concurrency: int = 8,
                 timeout_s: float = 600.0, retries: int = 4, backoff_s: float = 1.0, extra_body=None,
                 check_prompt_tokens: bool = True):
        if not str(endpoint).startswith(("http://", "https://")):
            raise ValueError(f"data.backend.endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                             f"got {endpoint!r}")
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ValueError(f"data.backend needs concurrency >= 1, retries >= 0 and timeout_s > 0; got "
                             f"{concurrency}, {retries}, {timeout_s}")
        self.endpoint, self.model, self.api_key = str(endpoint).rstrip("/"), str(model), api_key
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        extra = OmegaConf.to_container(extra_body, resolve=True) if OmegaConf.is_config(extra_body) else extra_body
        self.extra_body = dict(extra or {})
        self.check_prompt_tokens = check_prompt_tokens
        self._pool: ThreadPoolExecutor | None = None
        self._client = _openai_client(self.endpoint, api_key, timeout_s, retries, backoff_s)

    # -- HTTP --------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, send) -> bytes:
        """The body of the answer to ``send()`` (``method path`` through the openai client, which retries it);
        a failure raises :class:`EndpointUnreachable` or :class:`EndpointError` naming the settings."""
        import openai

        try:
            return send().content
        except openai.APIStatusError as e:
            detail = e.response.text[:300]
            if e.status_code in (408, 409, 429) or e.status_code >= 500:  # the client retried it
                raise EndpointError(self._failed(method, path, f"HTTP {e.status_code}: {detail}")) from None
            raise EndpointError(f"data.backend.endpoint={self.endpoint}: {method} {self.endpoint}{path} answered "
                                f"HTTP {e.status_code}: {detail} (the request carries data.backend.model="
                                f"{self.model}, data.generation's sampling and data.backend.extra_body)") from None
        except openai.APIConnectionError as e:  # refused, unreachable, timed out, connection reset
            cause = e.__cause__ or e
            raise EndpointUnreachable(self._failed(method, path, f"{type(cause).__name__}: {cause}")) from None

    def _failed(self, method: str, path: str, why: str) -> str:
        return (f"data.backend.endpoint={self.endpoint}: {method} {path} failed {self.retries + 1} times ({why}); "
                "is the server up and reachable? (retries: data.backend.retries, per-request limit: "
                "data.backend.timeout_s)")

    def _json(self, body: bytes, what: str) -> dict:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise EndpointError(f"data.backend.endpoint={self.endpoint} answered malformed JSON to {what}: "
                                f"{body[:200]!r}")
        return data

    # -- opening: the target's files and the served model ------------------------------------------

    def open(self, cfg: DictConfig):
        """Read the target's config and tokenizer (no weights), check the served model; returns
        ``(target-like with .config and .generation_config, tokenizer)``."""
        target, self.tokenizer = load_target_files(cfg.target.path, cfg.target.trust_remote_code)
        self.eos = eos_token_ids(target, self.tokenizer)
        tok_eos = self.tokenizer.eos_token_id
        self.eos_id = tok_eos if tok_eos in self.eos else (self.eos[0] if self.eos else None)
        self._check_models()
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regen-http")
        return target, self.tokenizer

    def _served(self, name) -> bool:
        """``name`` (from the server) is ``data.backend.model``; ``transformers serve`` appends ``@<revision>``."""
        return name is None or str(name) == self.model or str(name).rsplit("@", 1)[0] == self.model

    def _check_models(self) -> None:
        try:
            body = self._call("GET", "/models", self._client.models.with_raw_response.list)
        except EndpointUnreachable:
            raise
        except EndpointError as e:  # transformers serve lists the hub cache and fails without one
            print(f"[regenerate] warning: cannot list the served models ({e}); each answer's `model` is "
                  "checked instead", file=sys.stderr, flush=True)
            return
        listed = self._json(body, "GET /models").get("data")
        if not isinstance(listed, list):
            raise EndpointError(f"data.backend.endpoint={self.endpoint} answered malformed JSON to GET /models "
                                f"(no `data` list): {body[:200]!r}")
        names = [m.get("id") for m in listed if isinstance(m, dict)]
        if names and not any(self._served(n) for n in names):
            raise EndpointError(f"data.backend.model={self.model} is not served at data.backend.endpoint="
                                f"{self.endpoint}, which serves {names}: start the server with the target "
                                "or set data.backend.model to the name it serves the target under")

    # -- answering ---------------------------------------------------------------------------------

    def payload(self, prompt: Prompt, gen) -> dict:
        """The chat-completions request for one prompt (seeded by ``generation.seed`` and its id, so a
        resumed run asks the same)."""
        body = {"model": self.model, "messages": prompt.messages, "max_tokens": int(gen.max_new_tokens),
                "temperature": float(gen.temperature), "seed": stable_seed(gen.seed, prompt.id) % 2**31}
        if gen.temperature > 0:
            body["top_p"] = float(gen.top_p or 1.0)
            if gen.top_k:
                body["top_k"] = int(gen.top_k)
        return {**body, **self.extra_body}

    def _server_ids(self, choice: dict) -> list[int] | None:
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return ids
        content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        if content:
            found = [TOKEN_ID.match(str(c.get("token", ""))) for c in content if isinstance(c, dict)]
            if found and all(found):
                return [int(m.group(1)) for m in found]
        return None

    def _check_answer(self, data: dict, prompt: Prompt) -> dict:
        """The first choice of a well-formed answer from the right model, with the prompt counted right."""
        try:
            choice = data["choices"][0]
            if not isinstance(choice["message"]["content"], str):
                raise TypeError("message.content is not a string")
        except (KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"data.backend.endpoint={self.endpoint} answered malformed JSON for prompt "
                                f"{prompt.id} ({type(e).__name__}: {e}): {json.dumps(data)[:200]}") from None
        if not self._served(data.get("model")):
            raise EndpointError(f"data.backend.endpoint={self.endpoint} answered with model {data.get('model')!r}, "
                                f"not data.backend.model={self.model}")
        counted = (data.get("usage") or {}).get("prompt_tokens")
        if self.check_prompt_tokens and counted is not None and counted != len(prompt.tokens):
            raise EndpointError(
                f"the server counts prompt {prompt.id} as {counted} tokens, the target's tokenizer and chat "
                f"template (target.path) as {len(prompt.tokens)}: data.backend.model={self.model} at "
                f"data.backend.endpoint={self.endpoint} is not served with the target's tokenizer/template "
                "(data.backend.check_prompt_tokens=false skips this check)")
        return choice

    def _to_answer(self, choice: dict) -> Answer:
        text = choice["message"]["content"]
        server = self._server_ids(choice)
        retokenized = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if server is not None:
            body = [t for t in server if t not in self.eos]
            ids, source, mismatch = list(server), "server_ids", retokenized != body
        else:
            decoded = self.tokenizer.decode(retokenized, skip_special_tokens=True)
            ids, source, mismatch = retokenized, "retokenized", decoded != text
        stop = choice.get("stop_reason")
        if choice.get("finish_reason") == "stop" and not (ids and ids[-1] in self.eos):
            end = stop if isinstance(stop, int) else self.eos_id
            ids = ids + ([end] if end is not None else [])
        return Answer(cut_after_eos(ids, self.eos), source, mismatch)

    def _answer_one(self, prompt: Prompt, gen) -> Answer:
        payload, chat = self.payload(prompt, gen), self._client.chat.completions.with_raw_response
        rest = {k: v for k, v in payload.items() if k not in ("model", "messages")}  # untyped: extra body
        body = self._call("POST", "/chat/completions", lambda: chat.create(
            model=payload["model"], messages=payload["messages"], extra_body=rest))
        data = self._json(body, f"POST /chat/completions (prompt {prompt.id})")
        return self._to_answer(self._check_answer(data, prompt))

    def answer(self, prompts: list[Prompt], gen, seed: int) -> list[Answer]:
        """The batch's prompts, ``concurrency`` requests at a time (``seed`` unused: each request is seeded
        by its prompt id); the first failure stops the job."""
        futures = [self._pool.submit(self._answer_one, p, gen) for p in prompts]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def describe(self) -> dict:
        return {"kind": "openai", "endpoint": self.endpoint, "model": self.model,
                "concurrency": self.concurrency, "extra_body": self.extra_body}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._client.close()
