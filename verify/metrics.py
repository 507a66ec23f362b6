"""Acceptance metrics of speculative decoding (docs/method.md §4), as pure functions of plain lists.

Inputs, one entry per prompt (row):

* ``new_tokens_per_row[b]``: kept new tokens of row b (an int, or the token list itself);
* ``steps_per_row[b]``: verification steps (target forwards after prefill) row b took part in;
* ``accepted_counts[b][s]``: drafts kept at step s of row b, in 0..K.

Each step keeps at least one token, so ``steps <= new_tokens <= steps * (K + 1)`` per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _as_counts(values: Sequence, name: str) -> np.ndarray:
    counts = [len(v) if isinstance(v, (list, tuple)) else v for v in values]
    array = np.asarray(counts, dtype=np.int64) if counts else np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat list with one count per row, got shape {array.shape}")
    if (array < 0).any():
        raise ValueError(f"{name} must be non-negative, got {array.tolist()}")
    return array


def _check_rows(new_tokens_per_row: Sequence, steps_per_row: Sequence) -> tuple[np.ndarray, np.ndarray]:
    new = _as_counts(new_tokens_per_row, "new_tokens_per_row")
    steps = _as_counts(steps_per_row, "steps_per_row")
    if len(new) == 0:
        raise ValueError("no rows: new_tokens_per_row and steps_per_row are empty")
    if len(new) != len(steps):
        raise ValueError(
            f"new_tokens_per_row has {len(new)} rows but steps_per_row has {len(steps)}; they must match"
        )
    if (steps < 1).any():
        raise ValueError(f"every row needs at least one verification step, got steps_per_row={steps.tolist()}")
    if (new < steps).any():
        bad = int(np.flatnonzero(new < steps)[0])
        raise ValueError(
            f"row {bad} kept {new[bad]} new tokens in {steps[bad]} steps; every step keeps at least one token"
        )
    return new, steps


def _check_counts(accepted_counts: Sequence[Sequence[int]], num_draft_tokens: int) -> np.ndarray:
    if num_draft_tokens < 1:
        raise ValueError(f"K (num_draft_tokens) must be >= 1, got {num_draft_tokens}")
    flat = np.asarray([c for row in accepted_counts for c in row], dtype=np.int64)
    if flat.size == 0:
        raise ValueError("accepted_counts holds no verification steps")
    if flat.min() < 0 or flat.max() > num_draft_tokens:
        raise ValueError(
            f"accepted_counts must lie in 0..K={num_draft_tokens}, got values in [{flat.min()}, {flat.max()}]"
        )
    return flat


def tau_micro(new_tokens_per_row: Sequence, steps_per_row: Sequence) -> float:
    """Pooled accepted length: all kept new tokens / all verification steps."""
    new, steps = _check_rows(new_tokens_per_row, steps_per_row)
    return float(new.sum() / steps.sum())


def tau_macro(new_tokens_per_row: Sequence, steps_per_row: Sequence) -> float:
    """Mean over rows of each row's accepted length (new tokens / steps)."""
    new, steps = _check_rows(new_tokens_per_row, steps_per_row)
    return float((new / steps).mean())


def accept_histogram(accepted_counts: Sequence[Sequence[int]], num_draft_tokens: int) -> list[int]:
    """Number of verification steps that kept 0, 1, ..., K drafts (length K + 1)."""
    flat = _check_counts(accepted_counts, num_draft_tokens)
    return np.bincount(flat, minlength=num_draft_tokens + 1).tolist()


def position_acceptance(
    accepted_counts: Sequence[Sequence[int]], num_draft_tokens: int
) -> list[float | None]:
    """a_k = P(slot k accepted | slots < k accepted), k = 1..K, pooled over all steps.

    a_k = #steps with count >= k / #steps with count >= k - 1; ``None`` where no step reached slot k.
    """
    flat = _check_counts(accepted_counts, num_draft_tokens)
    reached = np.array([(flat >= k).sum() for k in range(num_draft_tokens + 1)])  # (K + 1,)
    return [
        float(reached[k] / reached[k - 1]) if reached[k - 1] > 0 else None
        for k in range(1, num_draft_tokens + 1)
    ]


def bootstrap_ci(
    per_prompt_new_tokens: Sequence,
    per_prompt_steps: Sequence,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float]:
    """Percentile bootstrap (1 - alpha) interval of micro tau, resampling prompts with replacement."""
    new, steps = _check_rows(per_prompt_new_tokens, per_prompt_steps)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    rng = np.random.default_rng(seed)
    chunk = max(1, 2**20 // len(new))  # resamples per chunk: bounds memory for large suites
    taus = []
    for start in range(0, n_boot, chunk):
        picks = rng.integers(0, len(new), size=(min(chunk, n_boot - start), len(new)))  # (chunk, N)
        taus.append(new[picks].sum(axis=1) / steps[picks].sum(axis=1))  # (chunk,)
    taus = np.concatenate(taus)  # (n_boot,)
    low, high = np.quantile(taus, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def summarize(
    accepted_counts: Sequence[Sequence[int]],
    new_tokens_per_row: Sequence,
    steps_per_row: Sequence,
    K: int,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """All metrics of one run as a JSON-serialisable dict."""
    new, steps = _check_rows(new_tokens_per_row, steps_per_row)
    if len(accepted_counts) != len(new):
        raise ValueError(f"accepted_counts has {len(accepted_counts)} rows but new_tokens_per_row has {len(new)}")
    for row, (counts, num_steps) in enumerate(zip(accepted_counts, steps)):
        if len(counts) != num_steps:
            raise ValueError(f"row {row}: {len(counts)} accepted counts but steps_per_row says {num_steps}")
    flat = _check_counts(accepted_counts, K)
    if (new > steps * (K + 1)).any():
        bad = int(np.flatnonzero(new > steps * (K + 1))[0])
        raise ValueError(f"row {bad} kept {new[bad]} tokens in {steps[bad]} steps, more than K + 1 = {K + 1} per step")
    low, high = bootstrap_ci(new, steps, n_boot=n_boot, seed=seed)
    return {
        "K": int(K),
        "num_prompts": len(new),
        "tau": tau_micro(new, steps),
        "tau_macro": tau_macro(new, steps),
        "tau_ci_low": low,
        "tau_ci_high": high,
        "mean_accepted": float(flat.sum() / steps.sum()),
        "accept_hist": accept_histogram(accepted_counts, K),
        "position_acceptance": position_acceptance(accepted_counts, K),
        "new_tokens": int(new.sum()),
        "target_forwards": int(steps.sum()),
    }


def accepted_by_source(accepted_counts: Sequence[Sequence[int]], draft_sources: Sequence[Sequence[str]]) -> dict:
    """Where the accepted drafts come from: per source label (``draft_sources[b][s]`` names what drafted step
    s of row b, e.g. ``hint`` or ``drafter``; see ``Drafter.draft_sources``), ``{"row_steps", "share",
    "mean_accepted", "zero_accepted"}``: its row-steps, their share of all, the drafts kept per such step and
    the share of them that kept none. Labels in sorted order; {} when no step is labelled."""
    totals: dict[str, list[int]] = {}
    for b, (counts, sources) in enumerate(zip(accepted_counts, draft_sources, strict=True)):
        if sources and len(sources) != len(counts):
            raise ValueError(f"row {b}: {len(sources)} draft sources for {len(counts)} steps")
        for count, source in zip(counts, sources):
            entry = totals.setdefault(str(source), [0, 0, 0])
            entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + int(count), entry[2] + int(count == 0)
    steps = sum(t[0] for t in totals.values())
    return {s: {"row_steps": n, "share": n / steps, "mean_accepted": kept / n, "zero_accepted": zero / n}
            for s, (n, kept, zero) in sorted(totals.items())}
