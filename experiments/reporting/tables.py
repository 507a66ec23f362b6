"""report.md: per temperature, tables of τ, gain over the baseline and speed (and across seeds)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.reporting.stats import MEAN

OVERLAP_MARK = "°"


def _fmt_tau(cell: dict | None) -> str:
    if cell is None:
        return "—"
    ci = f" [{cell['ci_low']:.3f}, {cell['ci_high']:.3f}]" if cell.get("ci_low") is not None else ""
    return f"{cell['tau']:.3f}{ci}"


def _fmt_gain(cell: dict | None) -> str:
    if cell is None or "gain" not in cell:
        return "—"
    ci = ""
    if cell.get("gain_ci_low") is not None:
        ci = f" [{100 * cell['gain_ci_low']:+.1f}%, {100 * cell['gain_ci_high']:+.1f}%]"
    mark = OVERLAP_MARK if cell.get("ci_overlap") else ""
    return f"{100 * cell['gain']:+.1f}%{ci}{mark}"


def _fmt_speed(cell: dict | None) -> str:
    if cell is None or cell.get("spec_tokens_per_s") is None:
        return "—"
    if cell.get("speedup") is None:
        return f"{cell['spec_tokens_per_s']:.0f} tok/s"
    return f"{cell['spec_tokens_per_s']:.0f} / {cell['target_tokens_per_s']:.0f} tok/s = {cell['speedup']:.2f}×"


def _speed_section(table: dict, suites: list[str], names: list[str]) -> list[str]:
    """The speed table of one temperature: speedups where the target alone was timed, else the speculative
    tokens/s at the evaluation's batch size (titled so); nothing where no configuration has either."""
    cells = [table[s].get(n) for n in names for s in suites]
    if not any(c and c.get("spec_tokens_per_s") is not None for c in cells):
        return []
    timed = any(c and c.get("speedup") is not None for c in cells)
    title = ("### Speed (speculative / target-only tokens per second = speedup)" if timed else
             "### Throughput (speculative tokens per second at the evaluation's batch size; target alone not timed)")
    return ["", title, ""] + _table(["configuration", *suites],
                                    [[n, *(_fmt_speed(table[s].get(n)) for s in suites)] for n in names])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _fmt_seed_tau(agg: dict | None) -> str:
    if agg is None:
        return "—"
    if len(agg["taus"]) == 1:
        return f"{agg['tau_mean']:.3f} (1 run)"
    return f"{agg['tau_mean']:.3f} ± {agg['tau_sd']:.3f}"


def _fmt_seed_gain(agg: dict | None) -> str:
    if agg is None or "gains" not in agg:
        return "—"
    per_seed = ", ".join(f"{100 * g:+.1f}" for g in agg["gains"])
    ci = f" [{100 * agg['gain_ci_low']:+.1f}, {100 * agg['gain_ci_high']:+.1f}]" if "gain_ci_low" in agg else ""
    return f"{100 * agg['gain_mean']:+.1f}%{ci} ({per_seed}; {agg['gains_positive']}/{len(agg['gains'])} > 0)"


def _seed_sections(report: dict, seeds: dict) -> list[str]:
    """The across-seeds tables: τ mean ± SD over seeds, and the mean of per-seed paired gains."""
    configs = list(dict.fromkeys(c["config"] for c in report["configurations"]))
    base = report["baseline"]
    counts = {c: sum(m["config"] == c for m in report["configurations"]) for c in configs}
    lines = ["", "# Across seeds", "",
             "Runs per configuration, one per training seed (" + ", ".join(f"{c}: {n}" for c, n in counts.items())
             + "; an untrained baseline is one evaluation). τ: mean ± sample SD of the per-seed τ."]
    if base is not None:
        lines += ["", (f"Gain: mean over seeds of τ / τ({base}, same seed) − 1, with its 95% interval over prompts "
                       "(the same resample for every seed and both sides); in parentheses each seed's gain (%) and how "
                       "many seeds gained. The per-run sections below give each run's prompt-bootstrap intervals.")]
    for key, temperature in report["temperatures"].items():
        columns = list(seeds[key])
        lines += ["", f"## Temperature {temperature:g}, across seeds", "", "### τ (mean ± SD over seeds)", ""]
        lines += _table(["configuration", *columns],
                        [[c, *(_fmt_seed_tau(seeds[key][s].get(c)) for s in columns)] for c in configs])
        if base is not None:
            lines += ["", f"### Gain over {base} (mean of per-seed gains)", ""]
            lines += _table(["configuration", *columns],
                            [[c, *(_fmt_seed_gain(seeds[key][s].get(c)) for s in columns)]
                             for c in configs if any("gains" in (seeds[key][s].get(c) or {}) for s in columns)])
    return lines


def _source_section(sources: dict[str, dict[str, dict]], names: list[str]) -> list[str]:
    """Per drafter that labels its drafts and per label: share of row-steps · drafts kept per such step."""
    if not sources:
        return []
    suites = list(sources)
    rows = []
    for name in names:
        labels = sorted({label for s in suites for label in sources[s].get(name, {})})
        for label in labels:
            cells = [sources[s].get(name, {}).get(label) for s in suites]
            rows.append([name, f"`{label}`", *(f"{c['share']:.0%} · {c['mean_accepted']:.2f}" if c else "—"
                                               for c in cells)])
    return ["", "### Where the accepted drafts come from (share of row-steps · drafts kept per such step)", "",
            *_table(["configuration", "drafted by", *suites], rows)]


def _fmt_budget(budget: dict) -> str:
    seconds = budget.get("train_seconds")
    time = "" if seconds is None else f", {seconds / 3600:.1f} h" if seconds >= 3600 else f", {seconds / 60:.1f} min"
    return f"{budget['steps']:,} steps{time}"


def budget_lines(configurations: Sequence[dict], base: str) -> list[str]:
    """A line under a gain table naming the configurations trained for another number of steps than the baseline
    (their gain is the budget's as well as the loss's); nothing where every known budget is the baseline's."""
    ref = next((c.get("budget") for c in configurations if base in (c["name"], c["config"])), None)
    other = [c for c in configurations if ref and c.get("budget") and c["budget"]["steps"] != ref["steps"]]
    if not other:
        return []
    listed = "; ".join(f"{c['name']} {_fmt_budget(c['budget'])}" for c in other)
    line = (f"Training budgets differ from {base}'s ({_fmt_budget(ref)}): {listed}. Their gains measure the longer "
            "or shorter training as well as the loss; a loss's own gain is measured at an equal budget.")
    return ["", line]


def render_markdown(report: dict, plots: Sequence[str] = (), untimed: str | None = None) -> str:
    """report.md: per temperature, tables of τ, gain over the baseline, and speed (``untimed``: why the evaluations'
    speeds mean nothing, said once instead of their tables)."""
    names = [c["name"] for c in report["configurations"]]
    base = report["baseline"]
    lines = ["# blockdraft: accepted length per configuration", ""]
    lines.append("τ = new tokens kept per target verification step (bonus token counted), pooled over a suite's "
                 "prompts (both MT-Bench turns included); `mean` = unweighted mean over the suites. Intervals: "
                 f"95% percentile bootstrap over prompts ({report['num_bootstrap']} resamples).")
    if base is not None:
        lines += ["", (f"Gain = τ / τ({base}) − 1, with the 95% interval of the ratio from paired resampling "
                       f"of the prompts both configurations evaluated. {OVERLAP_MARK} marks a gain whose τ "
                       f"interval overlaps the {base} interval.")]
    seeds = report.get("across_seeds")
    if seeds:
        lines += _seed_sections(report, seeds)
        lines += ["", "# Per run", ""]
    lines += ["", f"Speeds are not shown: {untimed}."] if untimed else []
    lines += ["", "Configurations:", ""]
    if report.get("runs_folder"):
        lines += [f"(Paths from the repository's root, or else from the runs' folder `{report['runs_folder']}`.)", ""]
    lines += [f"- **{c['name']}**: `{c['results_path']}`"
              + (f" (drafter `{c['drafter_path']}`)" if c.get("drafter_path") else "")
              + (f" — {c['description']}" if c.get("description") else "")
              for c in report["configurations"]]
    for key, temperature in report["temperatures"].items():
        columns = list(report["table"][key])
        here = [n for n in names if any(n in report["table"][key][s] for s in columns)]  # evaluated at this T
        lines += ["", f"## Temperature {temperature:g}", "", "### τ (95% CI)", ""]
        lines += _table(["configuration", *columns],
                        [[n, *(_fmt_tau(report["table"][key][s].get(n)) for s in columns)] for n in here])
        if base is not None:
            lines += ["", f"### Gain over {base} (95% CI)", ""]
            lines += _table(["configuration", *columns],
                            [[n, *(_fmt_gain(report["table"][key][s].get(n)) for s in columns)]
                             for n, c in zip(names, report["configurations"])
                             if n in here and base not in (n, c["config"])])
            lines += budget_lines([c for c in report["configurations"] if c["name"] in here], base)
        lines += _speed_section(report["table"][key], [s for s in columns if s != MEAN], here) if not untimed else []
        lines += _source_section(report.get("draft_sources", {}).get(key, {}), names)
    if plots:
        lines += ["", "## Plots"]
        for p in plots:
            lines += ["", f"![{Path(p).stem}]({Path(p).name})"]
    return "\n".join(lines) + "\n"


REACH_COLUMNS = 6  # reach_lines' k = 1..6, then the deepest any step reached


def reach_lines(report: dict) -> list[str]:
    """Markdown: per temperature, each configuration's accept histograms summed over its suites (and seeds, in a
    seed view): the share of verification steps that keep at least k drafts (k = 1 to :data:`REACH_COLUMNS`, then
    the most any step kept), and the acceptance at slot k among the steps that reached it, a_k = P(keep >= k | keep
    >= k - 1), with how many steps reached it: where drafts pass slot 1, 2, ... Nothing where no histogram was
    recorded."""
    lines = []
    for key, temperature in report["temperatures"].items():
        totals = _summed_hists(report["curves"].get(key, {}))
        deepest = max((int(np.flatnonzero(t)[-1]) for t in totals.values()), default=0)
        if deepest == 0:
            continue
        names = [c["name"] for c in report["configurations"] if c["name"] in totals]
        ks = [*range(1, min(deepest, REACH_COLUMNS) + 1), *([deepest] if deepest > REACH_COLUMNS else [])]
        rows = [[n, *(f"{100 * totals[n][k:].sum() / totals[n].sum():.1f}%" for k in ks)] for n in names]
        lines += ["", f"### Steps keeping at least k drafts (T={temperature:g}, summed over suites)", ""]
        lines += _table(["configuration", *(f"k ≥ {k}" for k in ks)], rows)
        ks = range(1, min(deepest, REACH_COLUMNS) + 1)
        rows = [[n, *(_slot_acceptance(totals[n], k) for k in ks)] for n in names]
        title = f"### Acceptance at slot k among the steps that reached it (T={temperature:g}, summed over suites)"
        lines += ["", title, "", "a_k = P(keep ≥ k | keep ≥ k − 1); in parentheses, the steps that reached slot k.", ""]
        lines += _table(["configuration", *(f"a_{k}" for k in ks)], rows)
    return lines


def _summed_hists(curves: dict) -> dict[str, np.ndarray]:
    """Per configuration, its accept histograms (steps keeping 0, 1, ... drafts) summed over suites, padded to the
    longest; configurations with no step left out."""
    totals: dict[str, np.ndarray] = {}
    for by_name in curves.values():
        for name, curve in by_name.items():
            if curve.get("accept_hist"):
                hist = np.asarray(curve["accept_hist"], dtype=np.int64)
                have = totals.get(name, np.zeros(0, dtype=np.int64))
                width = max(len(have), len(hist))
                totals[name] = np.pad(have, (0, width - len(have))) + np.pad(hist, (0, width - len(hist)))
    return {n: t for n, t in totals.items() if t.sum() > 0}


def _slot_acceptance(hist: np.ndarray, k: int) -> str:
    """``a_k (n)``: the share of the n steps that kept at least k - 1 drafts which kept at least k; "—" where none."""
    reached = int(hist[k - 1:].sum())
    return f"{100 * hist[k:].sum() / reached:.1f}% ({reached})" if reached else "—"
