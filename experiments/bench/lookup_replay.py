"""Prompt lookup replayed against a stored answer (greedy verification), for the benches that estimate its τ
without running the target (:mod:`experiments.bench.lookup`, :mod:`experiments.bench.choose_k`)."""

from __future__ import annotations

import torch

from verify.drafter import copy_tokens, lookup_start


def replay(prompt: list[int], response: list[int], num_draft_tokens: int, max_ngram: int, min_ngram: int) -> int:
    """Speculative steps prompt lookup needs to emit ``response`` after ``prompt`` under greedy verification."""
    seq, done, steps = list(prompt), 0, 0
    while done < len(response):
        row = torch.tensor(seq)
        draft = copy_tokens(row, lookup_start(row, max_ngram, min_ngram), num_draft_tokens).tolist()
        accepted = 0
        while accepted < len(draft) and done + accepted < len(response) and draft[accepted] == response[done + accepted]:
            accepted += 1
        emitted = min(accepted + 1, len(response) - done)  # the accepted drafts and the target's next token
        seq += response[done: done + emitted]
        done, steps = done + emitted, steps + 1
    return steps
