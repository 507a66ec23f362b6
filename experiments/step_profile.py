"""Where the time of one speculative step goes: the library behind ``python -m experiments.bench_step``.

:func:`verify.generate._decode` takes an optional *clock* whose ``lap(name)`` it calls at the end of
each part of a step (``draft``, ``target_forward``, ``verify``, ``bookkeeping``, ``select_rows``,
``crop``, ``drafter_extend``) and whose ``next_step()`` it calls when a step ends, so the laps of
one step partition its wall time. :class:`StepClock` records them; :func:`timed_parts` adds
sub-parts measured inside a lap (the drafter's ``draft_logits``, the target's LM head). Everything
here runs the real decoding loop: a profiled step is a step of :func:`verify.speculative_generate`.

Costs are medians over the steps of several decodes, the variants interleaved round by round so that
load from other processes hits them alike. The break-even τ of a speculative step is its cost over
a target-only step at the same batch (every row gains τ tokens per speculative step, 1 per target
step).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from verify.generate import _check_inputs, _decode, _eos_tensor, speculative_generate, target_generate

SPEC_PARTS = ("draft", "target_forward", "verify", "bookkeeping", "select_rows", "crop", "drafter_extend")
SUB_PARTS = {"draft_logits": "draft", "lm_head": "target_forward"}  # sub-part -> the lap it lies in


class StepClock:
    """Records the laps of every decoding step: ``steps[i][part]`` in seconds."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        self.sync()
        now = time.perf_counter()
        self._current[name] = self._current.get(name, 0.0) + now - self._last
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        """A sub-part measured inside a lap (not part of the step's total)."""
        self._current[name] = self._current.get(name, 0.0) + seconds

    def next_step(self) -> None:
        self.steps.append(self._current)
        self._current = {}


@contextlib.contextmanager
def timed_parts(clock: StepClock, drafter, target) -> Iterator[None]:
    """Time ``drafter.draft_logits`` and the target's LM head as sub-parts while the block runs."""
    patched: list[tuple[object, str]] = []

    def wrap(owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            clock.sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            clock.sync()
            clock.add(name, time.perf_counter() - start)
            return out

        object.__setattr__(owner, attr, timed)  # an instance attribute shadows the method
        patched.append((owner, attr))

    head = target.get_output_embeddings()
    if head is not None:
        wrap(head, "forward", "lm_head")
    if drafter is not None and hasattr(drafter, "draft_logits"):
        wrap(drafter, "draft_logits", "draft_logits")
    try:
        yield
    finally:
        for owner, attr in patched:
            object.__delattr__(owner, attr)


def device_sync(device: torch.device) -> Callable[[], None] | None:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return None


def profile_decode(target, drafter, input_ids, attention_mask, max_new_tokens: int, skip: int = 4) -> list[dict]:
    """Per-step laps (seconds) of one greedy decode, without the prefill, the first ``skip`` steps and
    the last one (which may end early)."""
    attention_mask = _check_inputs(target, input_ids, attention_mask, max_new_tokens,
                                   target.get_output_embeddings().weight.shape[0])
    clock = StepClock(device_sync(input_ids.device))
    with timed_parts(clock, drafter, target):
        _decode(target, drafter, input_ids, attention_mask, max_new_tokens, 0.0, None, None,
                _eos_tensor(None, input_ids.device), None, clock=clock)
    steps = clock.steps[1:]  # steps[0] is the prefill
    return steps[skip:-1]


def summarize_steps(steps: Sequence[dict]) -> dict:
    """Median ms per part and of the step total (the sum of its laps; sub-parts excluded)."""
    parts = sorted({k for s in steps for k in s})
    out = {"steps": len(steps)}
    for part in parts:
        out[f"{part}_ms"] = 1e3 * statistics.median(s.get(part, 0.0) for s in steps)
    totals = [sum(v for k, v in s.items() if k not in SUB_PARTS) for s in steps]
    out["total_ms"] = 1e3 * statistics.median(totals)
    out["total_mean_ms"] = 1e3 * statistics.fmean(totals)
    return out


def profile_steps(target, variants: dict, batches: dict, max_new_tokens: int, rounds: int, skip: int = 4) -> dict:
    """``{batch name: {variant: summary}}`` for every drafter in ``variants`` (None = target only) on every
    batch in ``batches`` ({name: [(input_ids, attention_mask), ...]}), interleaved round by round."""
    steps = {b: {v: [] for v in variants} for b in batches}
    for batch_name, inputs in batches.items():  # one warm-up decode per variant and batch
        for drafter in variants.values():
            ids, mask = inputs[0]
            profile_decode(target, drafter, ids, mask, min(max_new_tokens, skip + 4), skip=0)
    for _ in range(rounds):
        for batch_name, inputs in batches.items():
            for name, drafter in variants.items():
                for ids, mask in inputs:
                    steps[batch_name][name].extend(profile_decode(target, drafter, ids, mask, max_new_tokens, skip))
    return {b: {v: summarize_steps(s) for v, s in per.items()} for b, per in steps.items()}


def break_even(summary: dict, baseline: str = "target") -> dict:
    """Per speculative variant: its step cost over the target-only step = the τ it needs to break even."""
    base = summary[baseline]["total_ms"]
    return {name: s["total_ms"] / base for name, s in summary.items() if name != baseline}


# --------------------------------------------------------------------------------------------------
# End to end


def end_to_end(target, variants: dict, batches: Sequence, max_new_tokens: int, rounds: int,
               eos_token_id=None) -> dict:
    """Greedy tokens/s of each speculative variant and of target-only decoding over the same batches,
    interleaved batch by batch and round by round; medians over rounds of the summed wall times.

    Returns per variant: tokens/s, τ, speedup (its tokens/s over target-only) and the break-even τ
    (τ / speedup: the τ at which this variant would match target-only speed), and whether its tokens
    equal target-only's.
    """
    names = ["target", *variants]
    seconds: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, int] = {}
    steps: dict[str, int] = {}
    outputs: dict[str, list] = {}
    for r in range(rounds + 1):  # round 0 warms up
        wall = dict.fromkeys(names, 0.0)
        for ids, mask in batches:
            for name in names:
                if name == "target":
                    out = target_generate(target, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          eos_token_id=eos_token_id)
                else:
                    out = speculative_generate(target, variants[name], ids, attention_mask=mask,
                                               max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
                wall[name] += out.wall_time
                if r == 0:
                    tokens[name] = tokens.get(name, 0) + out.num_new_tokens
                    steps[name] = steps.get(name, 0) + out.num_target_forwards
                    outputs.setdefault(name, []).extend(out.new_tokens)
        if r > 0:
            for name in names:
                seconds[name].append(wall[name])
    result = {}
    base_tps = tokens["target"] / statistics.median(seconds["target"])
    result["target"] = {"tokens_per_s": base_tps, "new_tokens": tokens["target"],
                        "seconds": [round(s, 4) for s in seconds["target"]]}
    for name in variants:
        tps = tokens[name] / statistics.median(seconds[name])
        tau = tokens[name] / steps[name]
        speedup = tps / base_tps
        result[name] = {
            "tokens_per_s": tps, "tau": tau, "speedup": speedup, "break_even_tau": tau / speedup,
            "new_tokens": tokens[name], "identical_to_target": outputs[name] == outputs["target"],
            "seconds": [round(s, 4) for s in seconds[name]],
        }
    return result
