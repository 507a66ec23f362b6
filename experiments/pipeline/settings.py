"""Typed settings of the pipeline stages, built from their config sections.

:class:`DecodingSettings` is the one home of the decoding settings that ``experiments.evaluate`` and the
evaluation at the end of ``experiments.train`` (``evaluate:``) share: both compose the config group
``conf/decoding/`` (``default.yaml`` holds the values), and both hand the settings to
:func:`experiments.pipeline.evaluation.evaluate` as one object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from experiments.pipeline.records import GENERATION_KEYS
from verify.layout import LAYOUTS


@dataclass(frozen=True)
class DecodingSettings:
    """How a drafter is evaluated (the defaults are those of ``conf/decoding/default.yaml``)."""

    temperatures: tuple[float, ...] = (0.0, 1.0)  # docs/method.md §4: report T=0 and T=1
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 128
    batch_size: int = 8  # prompts per speculative_generate call (sorted by length: little padding)
    max_prompt_tokens: int | None = 384  # longer prompts keep their last tokens; None = as many as fit
    use_chat_template: bool = True
    seed: int = 0  # one generator per (suite, temperature), seeded from (seed, suite, temperature)
    num_bootstrap: int = 1000  # resamples of prompts for the 95% interval of tau
    measure_target_only: bool = True  # target-only decoding of the same batches, for the speedup
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    progress: bool = True  # a tqdm bar per (suite, temperature)
    #: T=0 entries replayed from the target's greedy answers (experiments.pipeline.replay): no speeds, no decoding
    replay_greedy: bool = False
    #: how the target's and drafter's linear weights are stored (verify/layout.py): row_major (PyTorch's) or
    #: column_major (no sgemm cliff at 4+ rows on CPU BLAS; same values)
    weight_layout: str = "row_major"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> DecodingSettings:
        """The settings named in ``cfg`` (a config section holding them, among other keys)."""
        plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
        values = {f.name: plain[f.name] for f in dataclasses.fields(cls) if f.name in plain}
        if "temperatures" in values:
            values["temperatures"] = tuple(values["temperatures"])
        return cls(**values)

    def __post_init__(self) -> None:
        """Refuse settings no evaluation can run with, naming the key, before anything is loaded."""
        positive = {"max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size,
                    "num_bootstrap": self.num_bootstrap}
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        numbers = {"top_p": self.top_p, **{f"temperatures[{i}]": t for i, t in enumerate(self.temperatures)}}
        for key, value in numbers.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"decoding setting {key} is {value}: give a finite number "
                                 "(temperatures >= 0, top_p in (0, 1] or null)")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {list(self.temperatures)}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or null, got {self.top_p}")
        if self.weight_layout not in LAYOUTS:
            raise ValueError(f"weight_layout: {self.weight_layout!r} is not one of {list(LAYOUTS)}")

    def generation(self) -> dict[str, Any]:
        """The settings that change the numbers (results.json's ``settings``: resumed only when equal)."""
        return {k: getattr(self, k) for k in GENERATION_KEYS}

    def resolved_device(self) -> str:
        """``device``, with ``auto`` = cuda when available, else cpu."""
        return self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
