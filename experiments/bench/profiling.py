"""Where the time of one speculative step goes: the step clock behind ``experiments.bench.suite_steps``.

:func:`verify.generate._decode` takes an optional *clock* whose ``start()`` it calls when a decode
begins, ``lap(name)`` at the end of each part of a step (``draft``, ``target_forward``, ``verify``, ``bookkeeping``, ``select_rows``,
``crop``, ``drafter_extend``) and whose ``next_step()`` it calls when a step ends, so the laps of
one step partition its wall time. :class:`StepClock` records them (wall and CPU time);
:func:`timed_parts` adds sub-parts timed inside a lap (the drafter's layers, the LM head,
attributed to the lap they fall in: ``lm_head@verify``). Everything here runs the real decoding
loop: a profiled step is a step of :func:`verify.speculative_generate`.

A *variant* is a drafter (None: target-only decoding), a sampling temperature and extra ``_decode``
keyword arguments; :func:`profile_decode` returns the laps of one decode of a variant, step by step, and
:func:`summarize_steps` their medians per part. The break-even τ of a speculative step is its cost over a
target-only step at the same batch (every row gains τ tokens per speculative step, 1 per target step).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

import verify.generate
import verify.hf


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

    def start(self) -> None:
        """A decode begins: the time since the last lap (between decodes) belongs to no part."""
        self.sync()
        self._last, self._last_cpu = time.perf_counter(), time.process_time()
        self._pending = {}

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
    """Time the drafter's layers (``drafter.block_states``) and the target's LM head (which the drafter
    shares; its forward, and its weight applied by :func:`verify.hf.linear_logits`) as sub-parts."""
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

        patched.append((owner, attr, owner.__dict__.get(attr)))
        object.__setattr__(owner, attr, timed)  # an instance attribute shadows the method

    head = target.get_output_embeddings()
    if head is not None:
        wrap(head, "forward", "lm_head")
    wrap(verify.hf, "linear_logits", "lm_head")  # the head's weight applied by the verifier or a drafter
    drafter = getattr(drafter, "drafter", drafter)  # a PolicyDrafter's block drafter
    if drafter is not None and hasattr(drafter, "block_states"):
        wrap(drafter, "block_states", "draft_states")
    try:
        yield
    finally:
        for owner, attr, old in reversed(patched):
            if old is None:
                object.__delattr__(owner, attr)
            else:
                object.__setattr__(owner, attr, old)


def device_sync(device: torch.device) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


# --------------------------------------------------------------------------------------------------
# Variants


@dataclass
class Variant:
    """What one profiled decode runs: ``generate`` (a module like :mod:`verify.generate`), a drafter
    (None: target-only), the sampling temperature and extra keyword arguments of its ``_decode``."""

    drafter: object | None = None
    generate: ModuleType = verify.generate
    kwargs: dict = field(default_factory=dict)
    temperature: float = 0.0


# --------------------------------------------------------------------------------------------------
# One step, part by part


def profile_decode(target, variant: Variant, input_ids, attention_mask, max_new_tokens: int,
                   skip: int = 4) -> tuple[list[dict], list[dict]]:
    """Per-step laps (seconds of wall and of CPU time) of one decode, without the prefill, the first
    ``skip`` steps and the last one (which may end early)."""
    gen = variant.generate
    attention_mask = gen._check_inputs(target, input_ids, attention_mask, max_new_tokens,
                                       target.get_output_embeddings().weight.shape[0])
    clock = StepClock(device_sync(input_ids.device))
    with timed_parts(clock, variant.drafter, target):
        generator = torch.Generator(device=input_ids.device).manual_seed(0) if variant.temperature else None
        gen._decode(target, variant.drafter, input_ids, attention_mask, max_new_tokens, variant.temperature,
                    None, None, gen._eos_tensor(None, input_ids.device), generator, clock=clock, **variant.kwargs)
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
