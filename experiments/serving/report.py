"""The serving check's tables (markdown) and plot (per-position acceptance, vLLM against blockdraft)."""

from __future__ import annotations

from pathlib import Path


def _fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def acceptance_table(doc: dict) -> list[str]:
    lines = [("| suite | vLLM drafts | vLLM accepted | vLLM acceptance length | blockdraft, vLLM's steps | "
              "difference | blockdraft τ (its own steps) | mismatched tokens |"), "|---" * 8 + "|"]
    for suite, row in doc["acceptance"].items():
        lines.append(f"| {suite} | {row['vllm']['num_drafts']} | {row['vllm']['num_accepted_tokens']} | "
                     f"{_fmt(row['vllm']['acceptance_length'])} | {_fmt(row['engine_steps']['acceptance_length'])} | "
                     f"{100 * row['relative_difference']:+.2f}% | {_fmt(row['blockdraft']['tau'])} | "
                     f"{row['mismatches']} |")
    return lines


def position_table(doc: dict) -> list[str]:
    lines = ["| suite | who | acceptance at positions 1, 2, 3, … |", "|---|---|---|"]
    for suite, row in doc["acceptance"].items():
        for who, key in (("vLLM", "vllm"), ("blockdraft, vLLM's steps", "engine_steps"),
                         ("blockdraft, its own steps", "blockdraft")):
            rates = ", ".join(_fmt(r, 2) for r in row[key]["position_acceptance"])
            lines.append(f"| {suite} | {who} | {rates} |")
    return lines


def speed_table(doc: dict) -> list[str]:
    speeds = doc["speed_tokens_per_s"]
    columns = sorted({c for row in speeds.values() for c in row}, key=lambda c: int(c[1:]))
    lines = ["| speculator | " + " | ".join(f"tokens/s, concurrency {c[1:]}" for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    base = speeds.get("target", {})
    for name, row in speeds.items():
        cells = []
        for c in columns:
            ratio = f" ({row[c] / base[c]:.2f}×)" if c in row and base.get(c) else ""
            cells.append(f"{_fmt(row.get(c), 1)}{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def step_cost_table(doc: dict) -> list[str]:
    """Per suite, what a verification step with the drafter costs against a token of the target alone (one request):
    the drafter is faster where its acceptance length exceeds that ratio."""
    lines = ["| suite | target alone, ms/token | with the drafter, ms/step | step cost (× target) | acceptance length |",
             "|---|---|---|---|---|"]
    for suite, row in doc.get("step_cost", {}).items():
        lines.append(f"| {suite} | {_fmt(row['target_ms_per_token'], 1)} | {_fmt(row['drafter_ms_per_step'], 1)} | "
                     f"{_fmt(row['step_cost'], 2)} | {_fmt(row['acceptance_length'])} |")
    return lines if len(lines) > 2 else []


def tables(doc: dict) -> str:
    """Markdown: acceptance per suite, per position, speed (ratios to the target alone) and the step cost."""
    parts = [f"vLLM {doc['vllm_version']}, T=0; outputs identical across engines: {doc['outputs_identical']}", ""]
    if doc["acceptance"]:
        parts += acceptance_table(doc) + [""] + position_table(doc) + [""]
    parts += speed_table(doc)
    costs = step_cost_table(doc)
    if costs:
        parts += [""] + costs
    return "\n".join(parts) + "\n"


def plot(doc: dict, path: str | Path) -> Path | None:
    """Per-position acceptance per suite: vLLM's bars against blockdraft's on the same steps. None: no data."""
    if not doc["acceptance"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(doc["acceptance"])
    fig, axes = plt.subplots(1, len(suites), figsize=(4 * len(suites), 3.2), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        row = doc["acceptance"][suite]
        ours, theirs = row["engine_steps"]["position_acceptance"], row["vllm"]["position_acceptance"]
        x = list(range(1, len(theirs) + 1))
        ax.bar([i - 0.2 for i in x], theirs, width=0.4, label="vLLM")
        ax.bar([i + 0.2 for i in x], ours, width=0.4, label="blockdraft (same steps)")
        ax.set_title(f"{suite}: {row['vllm']['acceptance_length']:.3f} vs "
                     f"{row['engine_steps']['acceptance_length']:.3f}", fontsize=9)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("acceptance rate")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
