"""Recorded target answers: regeneration shipped as a small asset, checked on a sample.

A real target answers ~1 prompt per second on a 2-core CPU, so the main job cannot regenerate a
thousand answers itself. ``python -m experiments.regenerate target=smollm2 data=regen_greedy
export_answers=<folder>`` regenerates in process and then writes the answers (response token ids
only; prompts are re-rendered by the stage) with their record: the target's signature (the GGUF's
sha256 where the target was converted from one, its config's sha1), the generation settings, the
regeneration batch size and the commit. The ``recorded`` backend (``data/backend=recorded``,
:class:`RecordedBackend`) then answers from that file, after regenerating its first
``check_batches`` batches in process and comparing them token for token (greedy answers depend on the
batch they were generated in, so the record's batch size is required).

Integrity: the record holds the archive's sha256 (``answers_sha256``), its row and token counts, and a
sha256 of the record's own fields (``record_sha256``). :func:`load_answers` refuses, naming the file and both
values, an archive whose bytes changed, a record whose fields were edited, and counts that disagree with the
archive; the regenerated batches then check the target, not the file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from drafters.storage import read_json, sha256_file, write_json_atomic
from drafters.training import datamodule as regen
from experiments.data import sharegpt
from experiments.data.target import eos_token_ids
from experiments.pipeline.paths import REPO, portable_path
from experiments.pipeline.regen_backends import Answer, InProcessBackend, Prompt, load_target_files

ANSWERS = "answers.npz"
RECORD = "record.json"


class RecordMismatch(ValueError):
    """The recorded answers do not belong to this target, these settings or these prompts."""


def record_digest(record: dict) -> str:
    """sha256 of a record's fields other than ``record_sha256`` (canonical JSON)."""
    fields = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def seal(record: dict) -> dict:
    """``record`` with ``record_sha256`` set: an edit of any field is then detected on load."""
    return {**record, "record_sha256": record_digest(record)}


def _check_record(folder: Path, record: dict, num_ids: int, num_tokens: int) -> None:
    """Refuse an edited record, a changed archive, or counts that disagree with the archive (each named)."""
    restore = "restore both files (git checkout) or export the answers again"
    if "record_sha256" not in record or "answers_sha256" not in record:
        raise RecordMismatch(f"{folder / RECORD} records no sha256 (written before blockdraft checked them); "
                             "export the answers again")
    if record_digest(record) != record["record_sha256"]:
        raise RecordMismatch(f"{folder / RECORD} was edited: its fields hash to {record_digest(record)}, it records "
                             f"record_sha256 {record['record_sha256']}; {restore}")
    found = sha256_file(folder / ANSWERS)
    if found != record["answers_sha256"]:
        raise RecordMismatch(f"{folder / ANSWERS} has sha256 {found}, {folder / RECORD} records "
                             f"{record['answers_sha256']}: the answers were changed; {restore}")
    if (record.get("rows"), record.get("response_tokens")) != (num_ids, num_tokens):
        raise RecordMismatch(f"{folder / RECORD} records {record.get('rows')} rows and {record.get('response_tokens')} "
                             f"response tokens, {folder / ANSWERS} holds {num_ids} and {num_tokens}; {restore}")


def _target_record(path: str) -> dict:
    folder = Path(path).expanduser()
    conversion = folder / "conversion.json"
    record = {"name": folder.name}
    if conversion.is_file():
        record["gguf_sha256"] = read_json(conversion, "target conversion record")["gguf_sha256"]
    return record


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def sources_record(generation: dict) -> dict:
    """Where each prompt source came from: ShareGPT's file (its sha256), the packages' versions of the others."""
    sources = (generation.get("prompts") or {}).get("sources") or []
    packages = {"code_chat": ("python (standard library)", platform.python_version()),
                "reasoning": ("reasoning-gym", _version("reasoning-gym")),
                "dialogue": ("chatterbot-corpus", _version("chatterbot-corpus"))}
    record = {}
    for name in sources:
        if name == "sharegpt":
            record[name] = sharegpt.source_record()
        elif name in packages:
            record[name] = {"package": packages[name][0], "version": packages[name][1]}
    return record


def _cut_share(responses: list[list[int]], max_new_tokens: int, eos: list[int]) -> float:
    """The share of answers cut off at ``max_new_tokens`` (no EOS at the end)."""
    cut = sum(1 for r in responses if len(r) >= max_new_tokens and (not r or r[-1] not in eos))
    return round(cut / max(1, len(responses)), 4)


def _regeneration_record(data_dir: Path, target_path: str, generation: dict, responses) -> dict:
    """What the data folder's regen.json and its agreement check say of how the answers were made."""
    meta = regen.read_meta(data_dir) or {}
    target, tokenizer = load_target_files(target_path)
    record = {"engine": meta.get("backend"), "sources": sources_record(generation),
              "cut_at_max_new_tokens": _cut_share(responses, generation["max_new_tokens"],
                                                  eos_token_ids(target, tokenizer)),
              "decontamination": {"dropped": len((meta.get("decontamination") or {}).get("dropped") or {}),
                                  "suite_prompts": (meta.get("decontamination") or {}).get("suite_prompts")},
              "skipped_long_prompts": meta.get("skipped_long_prompts")}
    agreement = Path(data_dir) / "agreement.json"
    if agreement.is_file():  # measured on these answers' own data folder: its machine path is left out
        measured = read_json(agreement, "engine agreement record")
        record["agreement_with_in_process_target"] = {k: v for k, v in measured.items() if k != "data_dir"}
    return record


def export_answers(data_dir: str | Path, out: str | Path, target_path: str, generation: dict, batch_size: int) -> Path:
    """Write ``answers.npz`` (ids, domains, response token ids as uint32 with offsets) and ``record.json``
    (module doc: target, settings, how the answers were made, counts, hashes)."""
    rows = regen.load_regenerated(data_dir)
    responses = [row[p:] for row, p in zip(rows["input_ids"], rows["prompt_len"])]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(r) for r in responses]).astype(np.int64)
    tokens = np.fromiter((t for r in responses for t in r), dtype=np.uint32, count=int(offsets[-1]))
    np.savez_compressed(out / ANSWERS, ids=np.array(rows["id"]), domains=np.array(rows["domain"]),
                        tokens=tokens, offsets=offsets)
    record = {"target": _target_record(target_path), "generation": generation, "batch_size": int(batch_size),
              "rows": len(responses), "response_tokens": int(offsets[-1]), "commit": _commit(),
              **_regeneration_record(Path(data_dir), target_path, generation, responses),
              "answers_sha256": sha256_file(out / ANSWERS)}
    write_json_atomic(out / RECORD, seal(record))
    print(f"[regenerate] {len(responses)} answers ({int(offsets[-1])} tokens) recorded in {portable_path(out)}",
          flush=True)
    return out


def load_answers(folder: str | Path) -> tuple[dict, dict[str, list[int]]]:
    """``(record, {prompt id: response ids})`` of a recorded-answers folder; a damaged, changed or edited file is
    named (module doc)."""
    folder = Path(folder)
    record = read_json(folder / RECORD, "recorded answers record")
    try:
        with np.load(folder / ANSWERS) as f:
            ids, tokens, offsets = f["ids"], f["tokens"], f["offsets"]
    except (OSError, KeyError, ValueError) as err:
        raise RecordMismatch(f"{folder / ANSWERS} is missing or damaged ({err})") from err
    if len(offsets) != len(ids) + 1 or offsets[-1] != len(tokens):
        raise RecordMismatch(f"{folder / ANSWERS}: offsets do not match ids/tokens (a damaged file)")
    _check_record(folder, record, len(ids), len(tokens))
    answers = {str(i): tokens[offsets[k]: offsets[k + 1]].tolist() for k, i in enumerate(ids)}
    return record, answers


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


SUBSET, WHOLE = "experiments.data.corpora.training_prompt_subset", "experiments.data.corpora.training_prompts"


def whole_set(generation: dict) -> dict:
    """``generation`` with a :func:`experiments.data.corpora.training_prompt_subset` of prompts replaced by the
    whole set it draws from: recorded answers to the whole set answer the subset (every id is still looked up)."""
    prompts = generation.get("prompts") or {}
    if prompts.get("_target_") != SUBSET:
        return generation
    whole = {k: v for k, v in prompts.items() if k != "count"}
    return {**generation, "prompts": {**whole, "_target_": WHOLE}}


class RecordedBackend(InProcessBackend):
    """Answers from a recorded-answers folder; its first ``check_batches`` batches regenerated and compared."""

    def __init__(self, path: str, check_batches: int = 1):
        self.path, self.check_batches, self.checked_rows, self._batches = Path(path), check_batches, 0, 0
        self.record, self.answers = load_answers(self.path)

    def open(self, cfg):
        self._check_settings(cfg)
        return super().open(cfg)

    def _check_settings(self, cfg) -> None:
        generation = whole_set(OmegaConf.to_container(cfg.data.generation, resolve=True))
        if generation != self.record["generation"]:
            raise RecordMismatch(f"{self.path / RECORD} was generated with data.generation="
                                 f"{self.record['generation']}, this job asks for {generation}")
        if cfg.batch_size != self.record["batch_size"]:
            raise RecordMismatch(f"{self.path / RECORD} was generated in batches of {self.record['batch_size']} "
                                 f"(greedy answers depend on their batch); set batch_size={self.record['batch_size']}")
        expected = self.record["target"].get("gguf_sha256")
        found = _target_record(cfg.target.path).get("gguf_sha256")
        if expected and found != expected:
            raise RecordMismatch(f"{self.path / RECORD} answers a target converted from GGUF sha256 {expected}; "
                                 f"target.path={cfg.target.path} has {found}")

    def answer(self, prompts: list[Prompt], gen, seed: int) -> list[Answer]:
        missing = [p.id for p in prompts if p.id not in self.answers]
        if missing:
            raise RecordMismatch(f"{self.path / ANSWERS} has no answer for prompts {missing[:5]} "
                                 f"({len(missing)} of this batch): other prompts than were recorded")
        recorded = [self.answers[p.id] for p in prompts]
        if self._batches < self.check_batches:
            self._check(prompts, recorded, super().answer(prompts, gen, seed))
        self._batches += 1
        return [Answer(r, "recorded") for r in recorded]

    def _check(self, prompts, recorded, generated) -> None:
        for p, want, got in zip(prompts, recorded, generated):
            if got.ids != want:
                at = first_difference(got.ids, want)
                raise RecordMismatch(f"prompt {p.id}: the target's answer differs from {self.path / ANSWERS} at "
                                     f"response token {at} (generated {got.ids[at:at + 5]}, recorded {want[at:at + 5]})")
        self.checked_rows += len(prompts)
        print(f"[regenerate] {self.checked_rows} recorded answers regenerated and identical", flush=True)

    def describe(self) -> dict:
        return {"kind": "recorded", "path": portable_path(self.path), "record": self.record,
                "check_batches": self.check_batches}
