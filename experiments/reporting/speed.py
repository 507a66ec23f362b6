"""The report's speed section: tokens per second at batch 1 against the target alone (``report --speed``).

τ is measured where it is cheap (batch 8); the latency a person feels is batch 1. ``experiments.main``
therefore runs a second, smaller evaluation of each drafter at ``batch_size=1`` and T=0, where
``experiments.evaluate`` times speculative and target-only decoding prompt by prompt, interleaved in one
process (``measure_target_only``), so each speedup is a ratio measured under the same conditions.
This module turns those runs into ``report.json["speed"]``, a Markdown table and ``speed.png``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.reporting.runs import Run


def speed_table(runs: Sequence[Run], key: str = "t0") -> dict:
    """``{name: {suite: {spec_tokens_per_s, target_tokens_per_s, speedup, tau, num_prompts}, "mean_speedup"}}``:
    per run, its suites' speeds at temperature ``key``; the mean is the unweighted mean of per-suite speedups."""
    table = {}
    for run in runs:
        cells = {}
        for suite, by_temperature in run.results.items():
            entry = by_temperature.get(key) if isinstance(by_temperature, dict) else None
            if not entry or entry.get("speedup") is None:
                continue
            cells[suite] = {k: entry.get(k) for k in ("spec_tokens_per_s", "target_tokens_per_s", "speedup", "tau",
                                                      "num_prompts")}
        if not cells:
            raise ValueError(f"{run.path}: no speedup at {key} (evaluate it with measure_target_only=true)")
        table[run.name] = {"suites": cells, "mean_speedup": float(np.mean([c["speedup"] for c in cells.values()])),
                           "batch_size": run.doc.get("settings", {}).get("batch_size")}
    return table


def speed_lines(table: dict) -> list[str]:
    """report.md's section: speculative / target-only tokens per second = speedup, per suite and mean."""
    suites = list(dict.fromkeys(s for row in table.values() for s in row["suites"]))
    lines = ["", "## Speed at batch 1, T=0 (speculative / target-only tokens/s = speedup; interleaved per prompt)", "",
             "| configuration | " + " | ".join(suites) + " | mean speedup |", "|---" * (len(suites) + 2) + "|"]
    for name, row in table.items():
        cells = []
        for s in suites:
            c = row["suites"].get(s)
            cells.append("—" if c is None else f"{c['spec_tokens_per_s']:.1f} / {c['target_tokens_per_s']:.1f} = "
                         f"{c['speedup']:.2f}× (τ {c['tau']:.2f}, {c['num_prompts']} prompts)")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['mean_speedup']:.2f}× |")
    return lines


def plot_speed(table: dict, path: str | Path) -> Path:
    """Grouped bars: each configuration's speedup per suite and on the mean, with the 1× line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(dict.fromkeys(s for row in table.values() for s in row["suites"]))
    groups = [*suites, "mean"]
    width = 0.8 / max(len(table), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.6))
    for i, (name, row) in enumerate(table.items()):
        values = [row["suites"].get(s, {}).get("speedup") or 0.0 for s in suites] + [row["mean_speedup"]]
        ax.bar(np.arange(len(groups)) + (i - (len(table) - 1) / 2) * width, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel("speedup over the target alone")
    ax.set_title("Batch 1, T=0: speculative vs target-only decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
