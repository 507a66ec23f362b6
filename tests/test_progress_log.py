"""drafters.training.progress: a progress line every so often in a run without a bar (a background job's log)."""

from __future__ import annotations

import itertools

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from drafters.training import progress
from drafters.training.progress import ProgressLog, progress_line


def test_the_line_names_step_total_rate_eta_and_metrics():
    assert progress_line(2000, 10000, 2.5, {"train/loss": 2.60449}) == (
        "[train] step 2,000/10,000 (20%) · 2.50 steps/s · eta 53 min · train/loss 2.604")
    assert progress_line(7, None, 0.0, {}) == "[train] step 7 · 0.00 steps/s"  # no total, no rate: no eta
    assert progress_line(6, 50, 0.5, {}) == "[train] step 6/50 (12%) · 0.50 steps/s · eta 88 s"


class _LossModel(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


@pytest.mark.parametrize("bar", [False, True])
def test_a_run_without_a_bar_prints_a_line_every_interval(monkeypatch, capsys, bar):
    ticks = itertools.count()  # every clock reading is one second later
    monkeypatch.setattr(progress, "clock", lambda: float(next(ticks)))
    trainer = L.Trainer(max_steps=12, callbacks=[ProgressLog(every_s=3)], enable_progress_bar=bar, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(_LossModel())
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[train] step")]
    if bar:
        assert lines == []  # the bar already shows progress
        return
    # one reading at the start, one per batch: a line at the 3rd batch, then every 3rd (rate 1 step/s)
    assert [line.split(" · ")[0] for line in lines] == [f"[train] step {s}/12 ({100 * s / 12:.0f}%)" for s in (3, 6, 9, 12)]
    assert lines[0].split(" · ")[1:3] == ["1.00 steps/s", "eta 9 s"] and "· train/loss " in lines[0]


def test_a_bad_interval_is_named():
    with pytest.raises(ValueError, match="every_s must be > 0 seconds, got 0"):
        ProgressLog(every_s=0)
