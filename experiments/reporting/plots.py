"""The report's PNG plots: τ per suite, gain over the baseline, per-position acceptance, accepted-draft
histograms and training curves (matplotlib, Agg backend, imported when the first plot is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.reporting.paper import PAPER_TAU, gain_of
from experiments.reporting.runs import CURVE_METRIC


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(names: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _legend(fig, axes, names: Sequence[str]) -> None:
    handles, labels = [], []
    for ax in np.ravel(axes):
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if order := [labels.index(n) for n in names if n in labels]:  # none where no panel drew a line
        fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside lower center",
                   ncol=min(len(order), 5), title="configuration")


def _bar_panels(plt, report: dict, bars: int, panel_height: float, **kwargs):
    """One panel of grouped bars per temperature: as wide as the suites x ``bars`` bars need (6.5 to 16 in)."""
    keys = list(report["temperatures"])
    ncols = max(len(report["table"][k]) for k in keys)
    width_in = min(16.0, max(6.5, 1.5 + ncols * (0.25 * bars + 0.5)))
    return plt.subplots(len(keys), 1, figsize=(width_in, panel_height * len(keys) + 1.2), squeeze=False,
                        layout="constrained", **kwargs)


def _save(plt, fig, axes, names: Sequence[str], path: Path) -> Path:
    """The shared legend (``names`` in order), then the PNG at 120 dpi."""
    _legend(fig, axes, names)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tau(report: dict, path: Path,
             caption: str = "Accepted length τ per suite (error bars: 95% bootstrap CI over prompts)") -> Path:
    """Grouped bars of τ per suite (and mean), one bar per configuration, with error bars; a panel per T.

    Cells with ``taus`` (a :func:`seed_view`) also get one dot per seed."""
    plt = _pyplot()
    names = [c["name"] for c in report["configurations"]]
    colors = _colors(names)
    keys = list(report["temperatures"])
    fig, axes = _bar_panels(plt, report, len(names), 3.3, sharey=True)
    width = 0.8 / len(names)
    for ax, key in zip(axes[:, 0], keys):
        columns = list(report["table"][key])
        for j, name in enumerate(names):
            xs, ys, err = [], [], [[], []]
            for i, suite in enumerate(columns):
                cell = report["table"][key][suite].get(name)
                if cell is None:
                    continue
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(cell["tau"])
                low = cell["ci_low"] if cell.get("ci_low") is not None else cell["tau"]
                high = cell["ci_high"] if cell.get("ci_high") is not None else cell["tau"]
                err[0].append(max(cell["tau"] - low, 0.0))
                err[1].append(max(high - cell["tau"], 0.0))
            ax.bar(xs, ys, width, yerr=err, capsize=3, color=colors[name], label=name, edgecolor="black",
                   linewidth=0.5, error_kw={"elinewidth": 1})
            dots = [(x, t) for x, suite in zip(xs, [c for c in columns if name in report["table"][key][c]])
                    for t in report["table"][key][suite][name].get("taus", [])]
            if dots:
                ax.scatter(*zip(*dots), s=9, color="black", zorder=3)
        ax.set_xticks(range(len(columns)), columns)
        ax.set_ylabel("τ (tokens / step)")
        floor = min((c.get("ci_low") or c["tau"]) for cells in report["table"][key].values() for c in cells.values())
        if floor >= 1.0:  # τ >= 1 always (the bonus token): start the axis there so differences show
            ax.set_ylim(bottom=1.0)
        ax.set_title(f"temperature {report['temperatures'][key]:g}")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel("suite")
    fig.suptitle(caption)
    return _save(plt, fig, axes, names, path)


def has_gain(report: dict, name: str, seeds: bool) -> bool:
    """Whether ``name`` has a gain over the baseline in some cell (per run, or across seeds)."""
    tables = report["across_seeds"] if seeds else report["table"]
    return any((suites.get(name) or {}).get("gain_mean" if seeds else "gain") is not None
               for by_suite in tables.values() for suites in by_suite.values())


def plot_gain(report: dict, path: Path, seeds: bool = False) -> Path:
    """Grouped bars of the gain over the baseline (%) per suite, one bar per other configuration; a panel
    per temperature. Error bars: the paired-bootstrap 95% interval, or with ``seeds`` (a
    :func:`seed_view` of a report with ``across_seeds``) the range of per-seed gains, dots per seed."""
    plt = _pyplot()
    base = report["baseline"]
    keys = list(report["temperatures"])
    names = [c["name"] for c in report["configurations"] if base not in (c["name"], c["config"])
             and has_gain(report, c["name"], seeds)]  # across seeds, an untrained baseline row has none
    colors = _colors([c["name"] for c in report["configurations"]])
    fig, axes = _bar_panels(plt, report, len(names), 3.0)
    width = 0.8 / max(len(names), 1)
    for ax, key in zip(axes[:, 0], keys):
        columns = list(report["table"][key])
        for j, name in enumerate(names):
            xs, ys, err, dots = [], [], [[], []], []
            for i, suite in enumerate(columns):
                if seeds:
                    agg = report["across_seeds"][key][suite].get(name) or {}
                    gain, low, high = agg.get("gain_mean"), agg.get("gain_min"), agg.get("gain_max")
                    points = agg.get("gains", [])
                else:
                    cell = report["table"][key][suite].get(name) or {}
                    gain, low, high, points = cell.get("gain"), cell.get("gain_ci_low"), cell.get("gain_ci_high"), []
                if gain is None:
                    continue
                x = i - 0.4 + width * (j + 0.5)
                xs.append(x)
                ys.append(100 * gain)
                err[0].append(100 * max(gain - (low if low is not None else gain), 0.0))
                err[1].append(100 * max((high if high is not None else gain) - gain, 0.0))
                dots += [(x, 100 * g) for g in points]
            ax.bar(xs, ys, width, yerr=err, capsize=3, color=colors[name], label=name, edgecolor="black",
                   linewidth=0.5, error_kw={"elinewidth": 1})
            if dots:
                ax.scatter(*zip(*dots), s=9, color="black", zorder=3)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(columns)), columns)
        ax.set_ylabel(f"gain over {base} (%)")
        ax.set_title(f"temperature {report['temperatures'][key]:g}")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel("suite")
    what = "mean of per-seed gains (error bars: seed range, dots: seeds)" if seeds else \
        "error bars: paired-bootstrap 95% CI over prompts"
    fig.suptitle(f"τ / τ({base}) − 1 per suite\n{what}")
    return _save(plt, fig, axes, names, path)


def _curve_grid(report: dict, title: str):
    plt = _pyplot()
    keys = list(report["temperatures"])
    suites = report["suites"]
    fig, axes = plt.subplots(len(keys), len(suites), figsize=(4.2 * len(suites), 3.4 * len(keys) + 0.8),
                             squeeze=False, layout="constrained")
    fig.suptitle(title)
    return plt, fig, axes, keys, suites


def plot_position_acceptance(report: dict, path: Path, min_steps: int = 10) -> Path:
    """a_k = P(slot k accepted | slots < k accepted) vs k, one line per configuration; suites x temperatures.

    Points estimated from fewer than ``min_steps`` verification steps reaching slot k are left out
    (their a_k is 0 or 1 by chance).
    """
    names = [c["name"] for c in report["configurations"]]
    colors = _colors(names)
    plt, fig, axes, keys, suites = _curve_grid(
        report, f"Per-position conditional acceptance a_k (points with ≥ {min_steps} steps reaching slot k)")
    for r, key in enumerate(keys):
        for c, suite in enumerate(suites):
            ax, k_max = axes[r][c], 1
            for name in names:
                curve = report["curves"][key].get(suite, {}).get(name, {})
                acc, hist = curve.get("position_acceptance"), curve.get("accept_hist")
                if not acc:
                    continue
                # steps that reached slot k (all drafts before it accepted) = steps keeping >= k - 1 drafts
                reached = [sum(hist[k - 1:]) if hist else min_steps for k in range(1, len(acc) + 1)]
                ks = [k for k, a in enumerate(acc, start=1) if a is not None and reached[k - 1] >= min_steps]
                ax.plot(ks, [acc[k - 1] for k in ks], marker="o", markersize=3, color=colors[name], label=name)
                k_max = max(k_max, *ks, 2) if ks else k_max  # the axis ends at the last slot with data
            ax.set_ylim(0, 1.05)
            ax.set_xlim(0.5, k_max + 0.5)
            ax.set_title(f"{suite}, T={report['temperatures'][key]:g}")
            ax.set_xlabel("draft position k")
            ax.set_ylabel("a_k")
            ax.xaxis.set_major_locator(_integer_locator())
            ax.grid(alpha=0.3)
    return _save(plt, fig, axes, names, path)


def _plain_numbers():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _: f"{x:g}")


def _integer_locator():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def plot_accept_hist(report: dict, path: Path) -> Path:
    """Share of verification steps that kept 0..K drafts, bars per configuration; suites x temperatures."""
    names = [c["name"] for c in report["configurations"]]
    colors = _colors(names)
    plt, fig, axes, keys, suites = _curve_grid(report, "Accepted drafts per verification step "
                                                       "(up to the largest count seen)")
    width = 0.8 / len(names)
    for r, key in enumerate(keys):
        for c, suite in enumerate(suites):
            ax, last = axes[r][c], 2
            for j, name in enumerate(names):
                hist = report["curves"][key].get(suite, {}).get(name, {}).get("accept_hist")
                if not hist or sum(hist) == 0:
                    continue
                xs = np.arange(len(hist)) - 0.4 + width * (j + 0.5)
                ax.bar(xs, np.asarray(hist) / sum(hist), width, color=colors[name], label=name)
                last = max(last, max(i for i, n in enumerate(hist) if n))  # the axis ends at the last non-empty bin
                ax.set_xlim(-0.6, last + 0.6)
            ax.set_title(f"{suite}, T={report['temperatures'][key]:g}")
            ax.set_xlabel("drafts accepted in the step")
            ax.xaxis.set_major_locator(_integer_locator())
            ax.set_ylabel("share of steps")
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
    return _save(plt, fig, axes, names, path)


def plot_training_curves(curves: dict[str, tuple[list[int], list[float]]], path: Path,
                         title: str = f"Training: {CURVE_METRIC}",
                         ylabel: str = "teacher-forced τ (greedy), validation", legend: str = "configuration",
                         xlabel: str = "training step") -> Path:
    """A validation metric (default ``val/tau_greedy``) vs optimizer step (or another ``xlabel``), one line per
    configuration."""
    plt = _pyplot()
    colors = _colors(list(curves))
    fig, ax = plt.subplots(figsize=(6.5, 4.2), layout="constrained")
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o", markersize=3, color=colors[name], label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title=legend, fontsize="small")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tau_speed(points: dict[str, dict[str, tuple[float, list[float]]]], path: Path,
                   tau_bars: dict[str, float] | None = None, speed_bar: float | None = None,
                   title: str = "Accepted length against speed, one point per variant") -> Path:
    """One panel per suite: each variant's τ (x) against its speedups over the target (y: the mean, and each
    round as a faint dot). ``points``: ``{variant: {suite: (tau, [speedup per round])}}``; ``tau_bars``
    (per suite) and ``speed_bar`` draw dashed lines, so the corner both bars ask for is the upper right."""
    plt = _pyplot()
    names = list(points)
    suites = list(dict.fromkeys(s for by_suite in points.values() for s in by_suite))
    colors = _colors(names)
    fig, axes = plt.subplots(1, len(suites), figsize=(4.2 * len(suites), 4.4), squeeze=False, layout="constrained")
    for ax, suite in zip(axes[0], suites):
        for name in names:
            if suite not in points[name]:
                continue
            tau, speeds = points[name][suite]
            ax.scatter([tau] * len(speeds), speeds, color=colors[name], alpha=0.3, s=12)
            ax.scatter([tau], [sum(speeds) / len(speeds)], color=colors[name], s=40, label=name)
        if tau_bars and suite in tau_bars:
            ax.axvline(tau_bars[suite], color="grey", linestyle="--", linewidth=1)
        if speed_bar is not None:
            ax.axhline(speed_bar, color="grey", linestyle="--", linewidth=1)
        ax.set_title(suite)
        ax.set_xlabel("T=0 τ")
        ax.set_ylabel("speedup over the target alone")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(plt, fig, axes, names, path)


def plot_data_scale(doc: dict, path: Path) -> Path:
    """Two panels (:mod:`experiments.reporting.data_scale`): τ against the training answers (log scale, equal
    steps) and against the steps of the long runs; per loss, the suites' mean τ (solid) and the held-out τ (dashed)."""
    plt = _pyplot()
    colors = _colors(list(dict.fromkeys([*doc["answers"], *doc["steps"]])))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained", sharey=True)
    for ax, key, x, xlabel in ((axes[0], "answers", "train_rows", "training answers (log scale)"),
                               (axes[1], "steps", "steps", "optimizer step of the long run")):
        for loss, points in doc[key].items():
            for which, style in (("suites_tau", "-"), ("held_out_tau", "--")):
                pts = [(p[x], p[which]["mean"] if which == "suites_tau" else p[which]) for p in points
                       if p[which] is not None]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", markersize=4, color=colors[loss],
                            label=f"{loss}, {'suites (T=0)' if which == 'suites_tau' else 'held-out answers'}")
        if key == "answers":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    axes[0].set_ylabel("accepted length τ")
    axes[0].set_title("τ against the training answers, equal steps")
    axes[1].set_title("τ along the long runs, all the answers")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_reach(doc: dict, path: Path) -> Path:
    """τ at each drafter's chosen width against training hours (log2 scale, :mod:`experiments.reporting.reach`):
    the measured budgets (markers), each line (solid over the measured hours, dotted beyond, up to the furthest
    crossing; dash-dotted beyond, the slope of the last two budgets where there are three or more), and a constant
    for a drafter that trains nothing."""
    plt = _pyplot()
    names = list(doc["points"])
    colors = _colors(names)
    trained = [b["hours"] for d in doc["points"].values() for b in d["budgets"] if b["hours"] > 0]
    ends = [r["hours"] for row in doc["reach"].values() for r in row.values() if r["hours"]]
    lo, hi = min(trained), max([*trained, *ends]) * 1.2
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    for name, d in doc["points"].items():
        w = str(d["chosen_width"])
        ln = doc["lines"][name].get(w)
        pts = [(b["hours"], b["tau"][w]["mean"]) for b in d["budgets"] if w in b["tau"] and b["hours"] > 0]
        label = f"{name}, width {w}"
        if pts:
            ax.plot(*zip(*pts), "o", color=colors[name], label=label)
            label = None
        if ln is None:
            continue
        seen = max(p[0] for p in pts) if ln["budgets"] > 1 else hi  # a constant is measured everywhere
        for x0, x1, style in ((lo, seen, "-"), (seen, hi, ":")):
            xs = np.geomspace(x0, x1, 20)
            ax.plot(xs, ln["a"] + ln["b"] * np.log2(xs), style, color=colors[name], label=label)
            label = None
        if "b_last" in ln:   # three budgets or more: the last two budgets' slope onward
            xs = np.geomspace(seen, hi, 20)
            ax.plot(xs, ln["a_last"] + ln["b_last"] * np.log2(xs), "-.", color=colors[name], alpha=0.6,
                    label=f"{name}, the last two budgets' slope")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_plain_numbers())
    ax.set_xlabel("training hours (log2 scale)")
    ax.set_ylabel("accepted length τ (T=0, suites' mean)")
    ax.set_title(f"When does {doc['subject']} pass the others?")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_beside(columns: dict[str, tuple[dict, str]], configs: Sequence[str], path: Path) -> Path:
    """Grouped bars of each of ``configs``' gain over uniform on the suites' mean in several reports (``columns``, as
    :func:`experiments.reporting.paper.beside_lines` takes them: the budgets side by side) and the paper's (hatched);
    error bars: each cell's 95% interval; a panel per temperature."""
    plt = _pyplot()
    shown = [c for c in configs if any(gain_of(r, c + s) for r, s in columns.values())]
    bars = [*columns, "paper"]
    colors = _colors(bars)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.6 * len(shown) * len(bars) / 4), 7.0), squeeze=False,
                             layout="constrained")
    width = 0.8 / len(bars)
    for ax, key in zip(axes[:, 0], ("t0", "t1")):
        for j, heading in enumerate(bars):
            xs, ys, err = [], [], [[], []]
            for i, config in enumerate(shown):
                if heading == "paper":
                    cell = {"gain": PAPER_TAU[config] / PAPER_TAU["uniform"] - 1} if config in PAPER_TAU else None
                else:
                    report, suffix = columns[heading]
                    cell = gain_of(report, config + suffix, key)
                if cell is None:
                    continue
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(100 * cell["gain"])
                for side, bound in ((0, cell.get("ci_low")), (1, cell.get("ci_high"))):
                    err[side].append(100 * abs(cell["gain"] - bound) if bound is not None else 0.0)
            ax.bar(xs, ys, width, yerr=err, capsize=2, color=colors[heading], label=heading, edgecolor="black",
                   linewidth=0.5, hatch="//" if heading == "paper" else None)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shown)), shown)
        ax.set_ylabel("gain over uniform (%)")
        ax.set_title(f"T = {key[1:]}, mean over suites" + (" (the paper's: no temperature stated)" * (key == "t1")))
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    fig.suptitle("Each loss's gain over uniform across training budgets, beside the paper's")
    return _save(plt, fig, axes, bars, path)
