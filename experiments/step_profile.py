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


class StepClock:
    """Records the laps of every decoding step: ``steps[i][part]`` in seconds of wall time, and
    ``cpu_steps[i][part]`` in seconds of this process's CPU time (robust to other processes taking
    the CPU away on a shared machine, when torch runs one thread).

    Sub-parts (:meth:`add`) are attributed to the lap they fall in: ``lm_head@verify``.
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.steps: list[dict[str, float]] = []
        self.cpu_steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._current_cpu: dict[str, float] = {}
        self._pending: dict[str, tuple[float, float]] = {}
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()

    def lap(self, name: str) -> None:
        self.sync()
        now, now_cpu = time.perf_counter(), time.process_time()
        self._current[name] = self._current.get(name, 0.0) + now - self._last
        self._current_cpu[name] = self._current_cpu.get(name, 0.0) + now_cpu - self._last_cpu
        for sub, (wall, cpu) in self._pending.items():
            key = f"{sub}@{name}"
            self._current[key] = self._current.get(key, 0.0) + wall
            self._current_cpu[key] = self._current_cpu.get(key, 0.0) + cpu
        self._pending = {}
        self._last, self._last_cpu = now, now_cpu

    def add(self, name: str, wall: float, cpu: float) -> None:
        """A sub-part measured inside the lap in progress (not part of the step's total)."""
        old_wall, old_cpu = self._pending.get(name, (0.0, 0.0))
        self._pending[name] = (old_wall + wall, old_cpu + cpu)

    def next_step(self) -> None:
        self.steps.append(self._current)
        self.cpu_steps.append(self._current_cpu)
        self._current, self._current_cpu = {}, {}


@contextlib.contextmanager
def timed_parts(clock: StepClock, drafter, target) -> Iterator[None]:
    """Time ``drafter.draft_logits`` and the target's LM head as sub-parts while the block runs."""
    patched: list[tuple[object, str]] = []

    def wrap(owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            clock.sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            out = inner(*args, **kwargs)
            clock.sync()
            clock.add(name, time.perf_counter() - start, time.process_time() - start_cpu)
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


def profile_decode(target, drafter, input_ids, attention_mask, max_new_tokens: int, skip: int = 4,
                   **decode_kwargs) -> tuple[list[dict], list[dict]]:
    """Per-step laps (seconds of wall and of CPU time) of one greedy decode, without the prefill, the
    first ``skip`` steps and the last one (which may end early)."""
    attention_mask = _check_inputs(target, input_ids, attention_mask, max_new_tokens,
                                   target.get_output_embeddings().weight.shape[0])
    clock = StepClock(device_sync(input_ids.device))
    with timed_parts(clock, drafter, target):
        _decode(target, drafter, input_ids, attention_mask, max_new_tokens, 0.0, None, None,
                _eos_tensor(None, input_ids.device), None, clock=clock, **decode_kwargs)
    # steps[0] is the prefill
    return clock.steps[1:][skip:-1], clock.cpu_steps[1:][skip:-1]


def summarize_steps(steps: Sequence[dict], suffix: str = "ms") -> dict:
    """Median ms per part and of the step total (the sum of its laps; sub-parts ``a@b`` excluded)."""
    parts = sorted({k for s in steps for k in s})
    out = {}
    for part in parts:
        out[f"{part}_{suffix}"] = 1e3 * statistics.median(s.get(part, 0.0) for s in steps)
    totals = [sum(v for k, v in s.items() if "@" not in k) for s in steps]
    out[f"total_{suffix}"] = 1e3 * statistics.median(totals)
    return out


def profile_steps(target, variants: dict, batches: dict, max_new_tokens: int, rounds: int, skip: int = 4) -> dict:
    """``{batch name: {variant: summary}}`` for every drafter in ``variants`` (None = target only) on every
    batch in ``batches`` ({name: [(input_ids, attention_mask), ...]}), interleaved round by round."""
    steps = {b: {v: ([], []) for v in variants} for b in batches}
    for batch_name, inputs in batches.items():  # one warm-up decode per variant and batch
        for drafter, kwargs in map(_variant, variants.values()):
            ids, mask = inputs[0]
            profile_decode(target, drafter, ids, mask, min(max_new_tokens, skip + 4), 0, **kwargs)
    for _ in range(rounds):
        for batch_name, inputs in batches.items():
            for name, (drafter, kwargs) in zip(variants, map(_variant, variants.values())):
                for ids, mask in inputs:
                    wall, cpu = profile_decode(target, drafter, ids, mask, max_new_tokens, skip, **kwargs)
                    steps[batch_name][name][0].extend(wall)
                    steps[batch_name][name][1].extend(cpu)
    return {b: {v: {"steps": len(wall), **summarize_steps(wall), **summarize_steps(cpu, "cpu_ms")}
                for v, (wall, cpu) in per.items()} for b, per in steps.items()}


def _variant(spec) -> tuple:
    """A variant is a drafter (or None), or a (drafter, extra ``_decode`` keyword arguments) pair."""
    return spec if isinstance(spec, tuple) else (spec, {})


def break_even(summary: dict, baseline: str = "target", key: str = "total_ms") -> dict:
    """Per speculative variant: its step cost over the target-only step = the τ it needs to break even."""
    base = summary[baseline][key]
    return {name: s[key] / base for name, s in summary.items() if name != baseline and key in s}


# --------------------------------------------------------------------------------------------------
# End to end


def end_to_end(target, variants: dict, batches: Sequence, max_new_tokens: int, rounds: int,
               eos_token_id=None) -> dict:
    """Greedy tokens/s of each speculative variant and of target-only decoding over the same batches,
    interleaved batch by batch and round by round; medians over rounds of the summed wall (and CPU)
    seconds.

    Returns per variant: tokens/s, τ, speedup (its tokens/s over target-only), the break-even τ
    (τ / speedup: the τ at which this variant would match target-only speed) and whether its tokens
    equal target-only's; ``*_cpu`` the same from this process's CPU time.
    """
    names = ["target", *variants]
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, int] = dict.fromkeys(names, 0)
    steps: dict[str, int] = dict.fromkeys(names, 0)
    outputs: dict[str, list] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up
        round_wall, round_cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        for ids, mask in batches:
            for name in names:
                start_cpu = time.process_time()
                if name == "target":
                    out = target_generate(target, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          eos_token_id=eos_token_id)
                else:
                    out = speculative_generate(target, variants[name], ids, attention_mask=mask,
                                               max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
                round_cpu[name] += time.process_time() - start_cpu
                round_wall[name] += out.wall_time
                if r == 0:
                    tokens[name] += out.num_new_tokens
                    steps[name] += out.num_target_forwards
                    outputs[name].extend(out.new_tokens)
        if r > 0:
            for name in names:
                wall[name].append(round_wall[name])
                cpu[name].append(round_cpu[name])
    result = {}
    base = tokens["target"] / statistics.median(wall["target"])
    base_cpu = tokens["target"] / statistics.median(cpu["target"])
    result["target"] = {"tokens_per_s": base, "tokens_per_cpu_s": base_cpu, "new_tokens": tokens["target"],
                        "seconds": [round(s, 4) for s in wall["target"]]}
    for name in variants:
        tps = tokens[name] / statistics.median(wall[name])
        tps_cpu = tokens[name] / statistics.median(cpu[name])
        tau = tokens[name] / steps[name]
        result[name] = {
            "tokens_per_s": tps, "tau": tau, "speedup": tps / base, "break_even_tau": tau * base / tps,
            "tokens_per_cpu_s": tps_cpu, "speedup_cpu": tps_cpu / base_cpu,
            "break_even_tau_cpu": tau * base_cpu / tps_cpu,
            "new_tokens": tokens[name], "identical_to_target": outputs[name] == outputs["target"],
            "seconds": [round(s, 4) for s in wall[name]],
        }
    return result
