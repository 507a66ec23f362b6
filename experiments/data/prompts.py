"""Prompt rendering for evaluation and regeneration: user turns interleaved with the model's own
earlier answers, through the tokenizer's chat template when it has one; and left padding of token
lists into a batch (every decoding loop feeds left-padded rows)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

PLAIN_USER, PLAIN_ASSISTANT = "User: ", "Assistant:"


def render_prompt(
    tokenizer: Any,
    turns_so_far: Sequence[str],
    answers_so_far: Sequence[str],
    use_chat_template: bool = True,
) -> str:
    """The text the model continues: user turns interleaved with its own earlier answers.

    ``len(answers_so_far) == len(turns_so_far) - 1`` (the last turn awaits the answer). With a chat
    template (``tokenizer.chat_template`` set and ``use_chat_template``) this is
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``; otherwise the plain
    format ``"User: t1\\n\\nAssistant: a1\\n\\nUser: t2\\n\\nAssistant:"``. Encode with
    :func:`encode_prompt` to avoid a second BOS when the template already has one.
    """
    if len(turns_so_far) < 1 or len(answers_so_far) != len(turns_so_far) - 1:
        raise ValueError(f"render_prompt needs one answer fewer than turns, got {len(turns_so_far)} turns "
                         f"and {len(answers_so_far)} answers")
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages: list[dict[str, str]] = []
        for i, turn in enumerate(turns_so_far):
            messages.append({"role": "user", "content": turn})
            if i < len(answers_so_far):
                messages.append({"role": "assistant", "content": answers_so_far[i]})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    parts = []
    for i, turn in enumerate(turns_so_far):
        parts.append(PLAIN_USER + turn)
        parts.append(PLAIN_ASSISTANT + (" " + answers_so_far[i] if i < len(answers_so_far) else ""))
    return "\n\n".join(parts)


def encode_prompt(
    tokenizer: Any,
    turns_so_far: Sequence[str],
    answers_so_far: Sequence[str],
    use_chat_template: bool = True,
) -> list[int]:
    """Token ids of :func:`render_prompt`: a chat template brings its own special tokens (no extra
    BOS is added); the plain format gets the tokenizer's usual special tokens."""
    templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
    text = render_prompt(tokenizer, turns_so_far, answers_so_far, use_chat_template)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def as_messages(prompt) -> tuple[str, str, list[dict]]:
    """``(id, domain, messages)`` of a prompt dict ``{"id", "domain", "messages"}`` or a suite
    :class:`experiments.data.suites.Prompt` (its first turn)."""
    if isinstance(prompt, dict):
        missing = [k for k in ("id", "domain", "messages") if k not in prompt]
        if missing:
            raise ValueError(f"prompt {prompt.get('id', prompt)!r} lacks keys {missing}")
        messages = list(prompt["messages"])
        if not messages or messages[-1].get("role") != "user":
            raise ValueError(f"prompt {prompt['id']!r}: messages must end with a user turn")
        return str(prompt["id"]), str(prompt["domain"]), messages
    if hasattr(prompt, "turns") and hasattr(prompt, "id"):
        return str(prompt.id), str(prompt.domain), [{"role": "user", "content": prompt.turns[0]}]
    raise TypeError(f"a prompt must be a dict with id/domain/messages or a suites.Prompt, got {type(prompt)}")


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of the conversation so far plus the assistant cue (chat template when there is one)."""
    turns = [m["content"] for m in messages if m["role"] == "user"]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    return encode_prompt(tokenizer, turns, answers)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids (B, T), attention_mask (B, T))`` of token lists, left-padded to the longest."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row):] = 1
    return input_ids.to(device), mask.to(device)
