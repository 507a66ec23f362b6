"""One progress line every so often for a run without a progress bar (a background job's log, a queue's).

A tqdm bar redraws itself with carriage returns, which a log file keeps as one ever-growing line, so the long
regimes turn it off (``trainer.enable_progress_bar: false``); :class:`ProgressLog` then prints, every ``every_s``
seconds of training, ``[train] step 2,000/10,000 (20%) · 2.31 steps/s · eta 58 min · train/loss 2.604``: the rate
over the interval since the last line, so a resumed run or one sharing the machine shows its rate now.
"""

from __future__ import annotations

import sys
import time

import lightning as L

clock = time.monotonic  # seconds; a test replaces it


def progress_line(step: int, total: int | None, rate: float, metrics: dict[str, float]) -> str:
    """The line for ``step`` of ``total`` (None or < 1: no total) at ``rate`` steps a second."""
    done = f"step {step:,}" + (f"/{total:,} ({100 * step / total:.0f}%)" if total and total > 0 else "")
    left = (total - step) / rate if total and total > step and rate > 0 else None  # seconds
    eta = "" if left is None else f" · eta {left:.0f} s" if left < 90 else f" · eta {left / 60:.0f} min"
    shown = "".join(f" · {name} {value:.4g}" for name, value in metrics.items())
    return f"[train] {done} · {rate:.2f} steps/s{eta}{shown}"


class ProgressLog(L.Callback):
    """Print :func:`progress_line` to stderr every ``every_s`` seconds of training where the trainer has no
    progress bar; ``metrics``: the logged metrics to show when present."""

    def __init__(self, every_s: float = 60.0, metrics: tuple[str, ...] = ("train/loss",)):
        if every_s <= 0:
            raise ValueError(f"ProgressLog every_s must be > 0 seconds, got {every_s}")
        self.every_s, self.metrics = float(every_s), tuple(metrics)
        self._last: tuple[float, int] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = (clock(), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._last is None or not trainer.is_global_zero or trainer.progress_bar_callback is not None:
            return
        now, step = clock(), trainer.global_step
        if now - self._last[0] < self.every_s:
            return
        rate = (step - self._last[1]) / (now - self._last[0])
        metrics = {m: float(trainer.callback_metrics[m]) for m in self.metrics if m in trainer.callback_metrics}
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        print(progress_line(step, total, rate, metrics), file=sys.stderr, flush=True)
        self._last = (now, step)
