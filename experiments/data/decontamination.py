"""Decontamination: no evaluation suite prompt may appear in a training text.

:func:`find_overlap` / :func:`assert_disjoint` check texts against suite prompts (exact containment of
a normalised turn, or a shared word n-gram). ``gsm_symbolic`` evaluation uses seeds inside
:data:`experiments.data.suites.GSM_EVAL_SEEDS`; training corpora draw ``gsm_symbolic`` problems with
seeds from :data:`experiments.data.corpora.GSM_TRAIN_SEED` upwards.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from experiments.data.suites import Prompt, load_suites


@dataclass
class Overlap:
    """A suite prompt turn found in a training text: ``kind`` is "exact" (the whole normalised turn is
    contained) or "ngram" (a shared word n-gram, given in ``match``)."""

    prompt_id: str
    turn: int
    kind: str
    text_index: int
    match: str


def normalise_text(text: str) -> str:
    """NFKC, case-folded, whitespace runs collapsed to one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


_WORD = re.compile(r"\w+")


def _flatten(prompts: Mapping[str, Sequence[Prompt]] | Iterable[Prompt]) -> list[Prompt]:
    if isinstance(prompts, Mapping):
        return [p for ps in prompts.values() for p in ps]
    return list(prompts)


def find_overlap(
    texts: Iterable[str],
    prompts: Mapping[str, Sequence[Prompt]] | Iterable[Prompt],
    ngram: int | None = 13,
    min_chars: int = 20,
) -> list[Overlap]:
    """Suite prompt turns that appear in ``texts`` (one pass over ``texts``, which may be a generator).

    Two checks per (turn, text), at most one hit each, exact first:
    * exact: the normalised turn (:func:`normalise_text`, at least ``min_chars`` long) is a substring
      of the normalised text;
    * ngram: turn and text share a run of ``ngram`` words (``\\w+``, case-folded); ``None`` disables it.
      Note: gsm_symbolic problems from the same template share long n-grams whatever their seeds.
    """
    if ngram is not None and ngram < 1:
        raise ValueError(f"ngram must be >= 1 or None, got {ngram}")
    turns = [(p.id, i, normalise_text(t)) for p in _flatten(prompts) for i, t in enumerate(p.turns)]
    exact = [(pid, i, t) for pid, i, t in turns if len(t) >= min_chars]
    index: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    if ngram is not None:
        for pid, i, t in turns:
            words = _WORD.findall(t)
            for j in range(len(words) - ngram + 1):
                refs = index.setdefault(tuple(words[j:j + ngram]), [])
                if (pid, i) not in refs:
                    refs.append((pid, i))
    starts = {key[0] for key in index}
    hits: list[Overlap] = []
    for k, text in enumerate(texts):
        norm = normalise_text(text)
        found: set[tuple[str, int]] = set()
        for pid, i, t in exact:
            if t in norm:
                found.add((pid, i))
                hits.append(Overlap(pid, i, "exact", k, t[:120]))
        if index:
            words = _WORD.findall(norm)
            for j in range(len(words) - ngram + 1):
                if words[j] not in starts:  # cheap filter before building the n-gram
                    continue
                refs = index.get(tuple(words[j:j + ngram]))
                for ref in refs or ():
                    if ref not in found:
                        found.add(ref)
                        hits.append(Overlap(ref[0], ref[1], "ngram", k, " ".join(words[j:j + ngram])))
    return hits


def assert_disjoint(
    train_texts: Iterable[str],
    suites: Mapping[str, Sequence[Prompt]] | Iterable[Prompt],
    ngram: int | None = 13,
    min_chars: int = 20,
) -> None:
    """Raise ValueError if any suite prompt turn appears in the training texts (see find_overlap)."""
    hits = find_overlap(train_texts, suites, ngram=ngram, min_chars=min_chars)
    if hits:
        shown = "\n".join(f"  {h.prompt_id} turn {h.turn}: {h.kind} in text {h.text_index}: {h.match[:80]!r}"
                          for h in hits[:10])
        more = f"\n  ... and {len(hits) - 10} more" if len(hits) > 10 else ""
        raise ValueError(f"{len(hits)} evaluation prompt turn(s) appear in the training corpus:"
                         f"\n{shown}{more}")


def overlapping_prompts(prompts: Sequence[tuple[str, str, list[dict]]], suites, decontaminate) -> dict[str, str]:
    """``{training prompt id: what it shares}`` for every prompt ``(id, domain, messages)`` that overlaps a
    suite prompt turn. ``decontaminate``: ``ngram``, ``min_chars`` and ``exact_only_domains`` (domains
    checked for exact containment only)."""
    exact_only = set(decontaminate.get("exact_only_domains") or [])
    hits: dict[str, str] = {}
    for exact in (False, True):
        group = [p for p in prompts if (p[1] in exact_only) == exact]
        texts = [m["content"] for _, _, messages in group for m in messages]
        owner = [pid for pid, _, messages in group for _ in messages]
        ngram = None if exact else decontaminate.get("ngram")
        for h in find_overlap(texts, suites, ngram=ngram, min_chars=decontaminate.get("min_chars", 20)):
            hits.setdefault(owner[h.text_index], f"{h.prompt_id} turn {h.turn} ({h.kind}): {h.match[:80]!r}")
    return hits


def check_disjoint(prompts: Sequence[tuple[str, str, list[dict]]], cfg_suite, decontaminate) -> int:
    """Fail if any training prompt ``(id, domain, messages)`` overlaps an evaluation suite of ``cfg_suite``;
    returns the number of suite prompts (see :func:`overlapping_prompts` for ``decontaminate``)."""
    suites = load_suites(cfg_suite)
    hits = overlapping_prompts(prompts, suites, decontaminate)
    if hits:
        lines = [f"  {pid} ~ {what}" for pid, what in hits.items()]
        raise ValueError(f"{len(hits)} training prompt(s) overlap the evaluation suites "
                         f"{sorted(suites)}:\n" + "\n".join(lines[:20]))
    return sum(len(v) for v in suites.values())


def drop_overlapping(prompts: list[tuple[str, str, list[dict]]], cfg_suite, decontaminate
                     ) -> tuple[list[tuple[str, str, list[dict]]], dict[str, str], int]:
    """``(kept, dropped, suite prompts)``: the prompts without those that overlap an evaluation suite of
    ``cfg_suite``; ``dropped`` names each one left out and what it shares (for a record). For sources
    nobody curated against the suites (ShareGPT); curated sources use :func:`check_disjoint`."""
    suites = load_suites(cfg_suite)
    dropped = overlapping_prompts(prompts, suites, decontaminate)
    return [p for p in prompts if p[0] not in dropped], dropped, sum(len(v) for v in suites.values())
