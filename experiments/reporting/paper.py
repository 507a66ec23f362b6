"""The ablation beside the paper's figures (``python -m experiments.report ... --paper``).

"Teaching Diffusion to Speculate Left-to-Right" (arXiv 2606.11552), a 4-layer block-diffusion drafter against
Llama-3-8B-Instruct, mean accepted length over six benchmarks (figures reconstructed, docs/method.md): each loss
configuration's τ and its gain over the position-uniform baseline. The table puts this report's T=0 mean τ and its
gain over ``uniform`` (over seeds when there are several: the mean of per-seed paired gains with its 95% interval
over prompts and how many seeds gained; else the paired gain with its 95% interval) beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments.reporting.stats import MEAN

#: τ per loss configuration in the paper (conf/loss/ names); D-PACE and the soft-label variants are not in it.
PAPER_TAU = {"uniform": 2.376, "decay": 2.583, "focal": 2.736, "chain": 2.919, "decay_focal": 2.892, "l2r_all": 3.420}


def _ours(report: dict, config: str, key: str) -> tuple[str, str]:
    """This report's (τ, gain) cells for ``config`` on the suites' mean at ``key``."""
    seeds = (report.get("across_seeds") or {}).get(key, {}).get(MEAN, {}).get(config)
    if seeds is not None and len(seeds["taus"]) > 1:  # one seed: its run's own cell and paired interval, below
        tau = f"{seeds['tau_mean']:.3f} ± {seeds['tau_sd']:.3f} ({len(seeds['taus'])} seeds)"
        if "gains" not in seeds:
            return tau, "—"
        ci = (f" [{100 * seeds['gain_ci_low']:+.1f}, {100 * seeds['gain_ci_high']:+.1f}]"
              if "gain_ci_low" in seeds else "")
        return tau, f"{100 * seeds['gain_mean']:+.1f}%{ci} ({seeds['gains_positive']}/{len(seeds['gains'])} > 0)"
    cell = report["table"].get(key, {}).get(MEAN, {}).get(config)
    if cell is None:
        return "—", "—"
    gain = "—"
    if "gain" in cell:
        ci = (f" [{100 * cell['gain_ci_low']:+.1f}, {100 * cell['gain_ci_high']:+.1f}]"
              if cell.get("gain_ci_low") is not None else "")
        gain = f"{100 * cell['gain']:+.1f}%{ci}"
    return f"{cell['tau']:.3f}", gain


def paper_lines(report: dict, key: str = "t0") -> list[str]:
    """Markdown: one row per configuration of the paper or of this report (paper's first), both τ and gains; none
    when no configuration of the paper was evaluated at ``key``."""
    if all(_ours(report, config, key)[0] == "—" for config in PAPER_TAU):
        return []
    configs = list(PAPER_TAU) + [c for c in dict.fromkeys(c["config"] for c in report["configurations"])
                                 if c not in PAPER_TAU]
    lines = [f"## Beside the paper (T={key[1:]}, mean over suites)", "",
             ("The paper: a 4-layer drafter, Llama-3-8B-Instruct, mean over six benchmarks (reconstructed figures). "
             "Here: the drafter, target and suites of this report."
             + ("" if key == "t0" else " The paper's figures are one set, its temperature not stated; they are "
                "repeated unchanged beside this temperature's results.")), "",
             "| configuration | paper τ | paper gain | τ here | gain here |", "|---|---|---|---|---|"]
    base = PAPER_TAU["uniform"]
    for config in configs:
        paper = PAPER_TAU.get(config)
        tau, gain = _ours(report, config, key)
        lines.append(f"| {config} | {paper if paper is not None else '—'} | "
                     f"{f'{100 * (paper / base - 1):+.1f}%' if paper is not None and config != 'uniform' else '—'} | "
                     f"{tau} | {gain if config != 'uniform' else '—'} |")
    return lines + [""]


#: The composite configurations and the single terms they add to uniform CE.
COMPOSITES = {"decay_focal": ("decay", "focal"), "l2r_all": ("decay", "focal", "chain")}


def gain_of(report: dict, config: str, key: str = "t0", suite: str = MEAN) -> dict | None:
    """``{gain, ci_low, ci_high, seeds}`` of ``config`` over the report's baseline on ``suite`` at ``key``: the mean
    of its per-seed paired gains and that mean's 95% interval where it has several seeds, else its one run's paired
    gain and interval (``ci_*`` None without per-prompt records); None where it has no gain there."""
    seeds = (report.get("across_seeds") or {}).get(key, {}).get(suite, {}).get(config)
    if seeds is not None and seeds.get("gain_mean") is not None and len(seeds.get("gains") or ()) != 1:
        return {"gain": seeds["gain_mean"], "ci_low": seeds.get("gain_ci_low"), "ci_high": seeds.get("gain_ci_high"),
                "seeds": len(seeds.get("gains") or ()) or None}
    runs = [c["name"] for c in report["configurations"] if c["config"] == config]
    cell = report["table"].get(key, {}).get(suite, {}).get(runs[0]) if len(runs) == 1 else None
    if cell is None or cell.get("gain") is None:
        return None
    return {"gain": cell["gain"], "ci_low": cell.get("gain_ci_low"), "ci_high": cell.get("gain_ci_high"), "seeds": 1}


def suffixed_composites(suffix: str = "") -> dict[str, tuple[str, ...]]:
    """:data:`COMPOSITES` with ``suffix`` on every name (a tree report's rows: ``l2r_all_tree``)."""
    return {c + suffix: tuple(p + suffix for p in parts) for c, parts in COMPOSITES.items()}


def _paper_ratio(composite: str, parts: Sequence[str]) -> tuple[float, float, float] | None:
    """The paper's (composite gain, sum of its terms' gains, ratio), the names read without a suffix the composite
    adds to a name of :data:`COMPOSITES` (``l2r_all_tree``); None where they are not the paper's."""
    suffix = next((composite[len(c):] for c in COMPOSITES if composite.startswith(c)), "")
    names = [c.removesuffix(suffix) if suffix else c for c in (composite, *parts)]
    if not all(c in PAPER_TAU for c in names):
        return None
    whole, *alone = (PAPER_TAU[c] / PAPER_TAU["uniform"] - 1 for c in names)
    return whole, sum(alone), whole / sum(alone)


def composition_of(report: dict, composite: str, parts: Sequence[str], key: str = "t0") -> dict | None:
    """``report["composition"][key][composite]`` (:func:`experiments.reporting.stats.build_report`: the ratio with its
    interval); else, for a report written without it, the ratio of the gains on the suites' mean, each the mean over
    the seeds the composite and every term have, without an interval; None where they share no seed with a gain."""
    cell = (report.get("composition") or {}).get(key, {}).get(composite)
    if cell is not None:
        return cell
    cells = report["table"].get(key, {}).get(MEAN, {})
    by_seed = [{c["seed"]: cells[c["name"]]["gain"] for c in report["configurations"]
                if c["config"] == config and cells.get(c["name"], {}).get("gain") is not None}
               for config in (composite, *parts)]
    shared = set.intersection(*(set(gains) for gains in by_seed))
    if not shared:
        return None
    whole, *alone = (sum(gains[s] for s in shared) / len(shared) for gains in by_seed)
    total = sum(alone)
    return {"gain": whole, "terms": dict(zip(parts, alone)), "sum": total,
            "ratio": whole / total if total > 0 else None, "ratio_ci_low": None, "ratio_ci_high": None,
            "seeds": sorted(shared, key=str)}


def _ratio_words(cell: dict | None, seeds: bool = False) -> str:
    if cell is None or cell["ratio"] is None:
        return "—"
    words = f"{cell['ratio']:.2f}"
    if cell["ratio_ci_low"] is not None:
        words += f" [{cell['ratio_ci_low']:.2f}, {cell['ratio_ci_high']:.2f}]"
    elif cell.get("sum_ci_low") is not None:
        words += f" (the sum's interval [{100 * cell['sum_ci_low']:+.1f}%, {100 * cell['sum_ci_high']:+.1f}%] holds 0)"
    return words + (f" ({len(cell['seeds'])} seeds)" if seeds and len(cell["seeds"]) > 1 else "")


def composition_lines(report: dict, key: str = "t0") -> list[str]:
    """Markdown: each composite's gain beside the sum of its terms' gains alone (``report["composition"]``, from
    ``build_report(..., composites=...)``), here with the ratio's 95% interval, and in the paper (a ratio near 1: the
    terms add; below: they overlap)."""
    rows = []
    for composite, cell in (report.get("composition") or {}).get(key, {}).items():
        parts = list(cell["terms"])
        paper = _paper_ratio(composite, parts)
        paper_cells = "— | — | —" if paper is None else f"{100 * paper[0]:+.1f}% | {100 * paper[1]:+.1f}% | {paper[2]:.2f}"
        rows.append(f"| {composite} = {' + '.join(parts)} | {len(cell['seeds'])} | {100 * cell['gain']:+.1f}% | "
                    f"{100 * cell['sum']:+.1f}% | {_ratio_words(cell)} | {paper_cells} |")
    if not rows:
        return []
    return [f"## Do the terms compose? (T={key[1:]}, mean over suites)", "",
            (f"Each composite's gain over {report.get('baseline') or 'the baseline'} beside the sum of its terms' "
             "gains alone, each the mean of its paired gains over the seeds all of them have; the ratio is 1 where "
             "they add. Its 95% interval: one bootstrap over the prompts for every run, given these trainings (the "
             "spread between seeds is not in it)."), "",
            "| composite | seeds | gain here | sum of terms here | ratio [95%] | paper gain | paper sum | paper ratio |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


def _gain_words(cell: dict | None) -> str:
    if cell is None:
        return "—"
    interval = f" [{100 * cell['ci_low']:+.1f}, {100 * cell['ci_high']:+.1f}]" if cell["ci_low"] is not None else ""
    return f"{100 * cell['gain']:+.1f}%{interval}" + (f" ({cell['seeds']} seeds)" if (cell["seeds"] or 0) > 1 else "")


def beside_lines(columns: dict[str, tuple[dict, str]], configs: list[str], key: str = "t0") -> list[str]:
    """Markdown: each of ``configs``' gain over uniform on the suites' mean at ``key`` in several reports side by side
    (e.g. the 700-step ablation, the long budget as a chain and as a tree), then the paper's; a configuration no report
    has is left out. ``columns``: ``{heading: (report.json content, the suffix of its rows' names: "" or "_tree")}``."""
    cells = {c: [gain_of(report, c + suffix, key) for report, suffix in columns.values()] for c in configs}
    rows = [f"| {c} | " + " | ".join(map(_gain_words, cells[c])) + " | "
            + (f"{100 * (PAPER_TAU[c] / PAPER_TAU['uniform'] - 1):+.1f}%" if c in PAPER_TAU else "—") + " |"
            for c in configs if any(cell is not None for cell in cells[c])]
    return [f"## Gains over uniform across budgets (T={key[1:]}, mean over suites)", "",
            "| configuration | " + " | ".join(columns) + " | paper |", "|---" * (len(columns) + 2) + "|", *rows, ""]


def beside_composition_lines(columns: dict[str, tuple[dict, str]], key: str = "t0") -> list[str]:
    """Markdown: each composite's ratio to the sum of its terms (:func:`composition_of`) in several reports side by
    side, then the paper's; none where no report has one. ``columns`` as :func:`beside_lines`'."""
    rows = []
    for composite, parts in COMPOSITES.items():
        cells = [composition_of(report, composite + suffix, [p + suffix for p in parts], key)
                 for report, suffix in columns.values()]
        if any(cell is not None for cell in cells):
            rows.append(f"| {composite} / ({' + '.join(parts)}) | " + " | ".join(_ratio_words(c, True) for c in cells)
                        + f" | {_paper_ratio(composite, parts)[2]:.2f} |")
    if not rows:
        return []
    return [f"## Do the terms compose across budgets? (T={key[1:]}, mean over suites)", "",
            ("Each composite's gain over the sum of its terms' gains alone (1: they add), with its 95% interval where the "
             "report kept every run's prompts."), "",
            "| ratio | " + " | ".join(columns) + " | paper |", "|---" * (len(columns) + 2) + "|", *rows, ""]
