"""What the decoding of one (suite, temperature) is made of, apart from the decoding itself
(:func:`experiments.pipeline.evaluation.evaluate_suite`, and the replayed T=0 of :mod:`experiments.pipeline.replay`):
the prompt budget, the shared settings and generators (:class:`Decoding`), the batches turn after turn
(:func:`turn_batches`), the per-prompt records and the suite's results.json entry (:func:`suite_entry`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from experiments.data.hashing import stable_seed
from experiments.data.prompts import encode_prompt
from experiments.data.suites import Prompt
from experiments.data.target import eos_token_ids
from experiments.pipeline.settings import DecodingSettings
from verify.hf import max_positions
from verify.metrics import accepted_by_source, summarize


def prompt_budget(target, max_prompt_tokens: int | None, max_new_tokens: int) -> int:
    """Prompt tokens kept (the last ones) so that prompt + ``max_new_tokens`` fits the target's positions."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions(target)
    if max_prompt_tokens is None:
        if limit is None:
            raise ValueError("max_prompt_tokens=null needs a target with a position limit; set max_prompt_tokens")
        max_prompt_tokens = limit - max_new_tokens
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1 (or null), got {max_prompt_tokens}")
    if limit is not None and max_prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"max_prompt_tokens {max_prompt_tokens} + max_new_tokens {max_new_tokens} exceeds the "
                         f"target's {limit} positions; lower max_prompt_tokens (or set it to null)")
    return int(max_prompt_tokens)


@dataclass
class Decoding:
    """What every batch of one (suite, temperature) shares: the decoding call's arguments, the two
    generators (speculative, target-only) and the running totals."""

    kwargs: dict
    gen_spec: torch.Generator
    gen_target: torch.Generator
    device: torch.device
    spec_time: float = 0.0
    target_time: float = 0.0
    target_new: int = 0
    batched_forwards: int = 0
    verified_slots: int = 0
    truncated: int = 0
    matches: int = 0


def start_decoding(target, tokenizer, suite: str, temperature: float, s: DecodingSettings) -> Decoding:
    device = next(target.parameters()).device
    eos = eos_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    gen_spec = torch.Generator(device=device).manual_seed(stable_seed(s.seed, suite, float(temperature)))
    gen_target = torch.Generator(device=device).manual_seed(stable_seed(s.seed, suite, float(temperature), "target"))
    kwargs = {"max_new_tokens": s.max_new_tokens, "temperature": float(temperature), "top_k": s.top_k,
              "top_p": s.top_p, "eos_token_id": eos, "pad_token_id": pad_id}
    return Decoding(kwargs, gen_spec, gen_target, device)


def encode_turn(tokenizer, prompts, answers, live, turn: int, budget: int, use_chat_template: bool,
                 run: Decoding) -> dict[int, list[int]]:
    """Token ids of turn ``turn`` of the ``live`` prompts (after their own earlier answers), left-truncated."""
    encoded = {}
    for i in live:
        ids = encode_prompt(tokenizer, prompts[i].turns[: turn + 1], answers[i], use_chat_template)
        if len(ids) > budget:
            ids, run.truncated = ids[-budget:], run.truncated + 1
        encoded[i] = ids
    return encoded


def turn_batches(target, tokenizer, prompts: Sequence[Prompt], answers: list[list[str]], run: Decoding,
                 s: DecodingSettings, desc: str) -> Iterator[tuple[bool, list[int], list[list[int]]]]:
    """The batches of a suite's decoding, turn after turn: ``(first, prompt indices, token ids)``. Within a turn the
    prompts go sorted by length; turn r + 1 is encoded after the caller appended every turn-r answer to
    ``answers[i]`` (the model's own answers are fed back). ``first``: the suite's first batch."""
    budget = prompt_budget(target, s.max_prompt_tokens, s.max_new_tokens)
    bar = tqdm(total=sum(len(p.turns) for p in prompts), desc=desc, unit="turn", disable=not s.progress,
               mininterval=2)
    for turn in range(max(len(p.turns) for p in prompts)):
        live = [i for i, p in enumerate(prompts) if len(p.turns) > turn]
        encoded = encode_turn(tokenizer, prompts, answers, live, turn, budget, s.use_chat_template, run)
        order = sorted(live, key=lambda i: (len(encoded[i]), prompts[i].id))
        for start in range(0, len(order), s.batch_size):
            chunk = order[start: start + s.batch_size]
            yield turn == 0 and start == 0, chunk, [encoded[i] for i in chunk]
            bar.update(len(chunk))
    bar.close()


def prompt_records(prompts: Sequence[Prompt], turns: list[list[dict]]) -> list[dict]:
    """One record per prompt: its turns pooled (kept tokens and steps summed, accepted counts concatenated)."""
    return [{
        "id": p.id,
        "turns": len(p.turns),
        "new_tokens": sum(t["new_tokens"] for t in turns[i]),
        "steps": sum(t["steps"] for t in turns[i]),
        "new_tokens_per_turn": [t["new_tokens"] for t in turns[i]],
        "steps_per_turn": [t["steps"] for t in turns[i]],
        "accepted_counts": [c for t in turns[i] for c in t["accepted_counts"]],
        "draft_sources": [c for t in turns[i] for c in t["draft_sources"]],
    } for i, p in enumerate(prompts)]


def suite_result(suite: str, temperature: float, prompts: Sequence[Prompt], turns: list[list[dict]], run: Decoding,
                 num_draft_tokens: int, s: DecodingSettings, measure_target_only: bool) -> dict:
    """A suite's results.json entry from its per-prompt, per-turn records (:func:`prompt_records`): the metrics of
    :func:`verify.metrics.summarize` with a bootstrap seeded from ``(seed, suite, temperature)``, and
    :func:`suite_entry`'s fields."""
    records = prompt_records(prompts, turns)
    metrics = summarize([r["accepted_counts"] for r in records], [r["new_tokens"] for r in records],
                        [r["steps"] for r in records], num_draft_tokens, n_boot=s.num_bootstrap,
                        seed=stable_seed(s.seed, suite, float(temperature), "bootstrap"))
    return suite_entry(suite, temperature, metrics, sum(len(p.turns) for p in prompts), run, records,
                       measure_target_only)


def suite_entry(suite: str, temperature: float, metrics: dict, total: int, run: Decoding, records: list[dict],
           measure_target_only: bool) -> dict:
    spec_tps = metrics["new_tokens"] / max(run.spec_time, 1e-9)
    target_tps = run.target_new / max(run.target_time, 1e-9) if measure_target_only else None
    return {
        "suite": suite,
        "temperature": float(temperature),
        **metrics,
        "num_turns": total,
        "truncated_prompts": run.truncated,  # turns whose prompt lost its first tokens to max_prompt_tokens
        "batched_forwards": run.batched_forwards,  # target calls after prefill, summed over batches
        # Drafts the target verified per call (the width W <= K; the block is W + 1 tokens per row).
        "mean_draft_width": run.verified_slots / max(run.batched_forwards, 1),
        "spec_wall_time_s": run.spec_time,
        "spec_tokens_per_s": spec_tps,
        "target_new_tokens": run.target_new if measure_target_only else None,
        "target_wall_time_s": run.target_time if measure_target_only else None,
        "target_tokens_per_s": target_tps,
        "speedup": spec_tps / target_tps if target_tps else None,
        # Turns whose speculative output equals target-only decoding: 1.0 at T=0 (exactness); at T>0 the
        # two runs draw different random numbers, so this is only the chance of equal samples.
        "greedy_match": run.matches / total if measure_target_only and temperature == 0 else None,
        # Per label of the drafter's draft_sources() (e.g. hint:store, hint:prompt, drafter): row-steps, share,
        # drafts kept per step, share keeping none; {} for drafters that do not label their drafts.
        "by_draft_source": accepted_by_source([r["accepted_counts"] for r in records],
                                              [r["draft_sources"] for r in records]),
        "prompts": records,
    }
