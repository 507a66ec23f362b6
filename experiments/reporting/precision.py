"""Issue 75's quality check of bfloat16 training: the same drafter (``l2r_all``, 5K steps, the same initialisation and
data order) trained in float32 and in bfloat16, each evaluated with the float32 target as served.

From the report of those runs (:func:`experiments.reporting.write.write_report`, float32 as the baseline) it writes,
beside report.md, ``quality.json`` and ``quality.md``: per suite and on the suites' mean at T=0, the bfloat16 drafter's
paired gain over the float32 one with its 95% interval (the mean over seeds where it has several) and whether
that interval holds 0; and each run's held-out τ at the end of training, with the float32 runs' seed-to-seed
difference as the yardstick. Every validation of every run goes to ``held_out.json``/``.md``/``.png``
(:mod:`experiments.reporting.held_out`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from experiments.reporting import held_out
from experiments.reporting.paper import gain_of
from experiments.reporting.runs import CURVE_METRIC, logged_rows
from experiments.reporting.stats import MEAN


def paired_gains(report: dict, config: str, key: str = "t0") -> dict[str, dict]:
    """``{suite: {gain, ci_low, ci_high, seeds, within}}`` of ``config`` over the report's baseline at ``key``
    (:func:`experiments.reporting.paper.gain_of`; ``within``: the interval holds 0, None without one)."""
    suites = [s for s in report.get("suites", []) if s != MEAN] + [MEAN]
    out = {}
    for suite in suites:
        if (cell := gain_of(report, config, key, suite)) is not None:
            low, high = cell["ci_low"], cell["ci_high"]
            out[suite] = {**cell, "within": None if low is None or high is None else low <= 0 <= high}
    return out


def held_out_gaps(doc: Mapping[str, dict], baseline: str, candidate: str) -> dict:
    """Each run's held-out τ at its last validation (``doc``: :func:`experiments.reporting.held_out.collect`'s, runs
    named ``<precision>-s<seed>``), the candidate's difference from the baseline seed by seed, and the baseline runs'
    spread over seeds (the largest minus the smallest), the yardstick of a difference between two trainings."""
    final = {name: run["points"][-1][CURVE_METRIC] for name, run in doc.items() if run["points"]}
    seeds = sorted({n.rsplit("-s", 1)[1] for n in final}, key=int)
    gaps = {s: round(final[f"{candidate}-s{s}"] - final[f"{baseline}-s{s}"], 4) for s in seeds
            if f"{candidate}-s{s}" in final and f"{baseline}-s{s}" in final}
    base = [t for n, t in final.items() if n.startswith(f"{baseline}-s")]
    return {"final": final, "gap_by_seed": gaps, "baseline_seed_spread": round(max(base) - min(base), 4)
            if len(base) > 1 else None}


def _markdown(quality: dict) -> str:
    lines = ["# bfloat16 against float32 training: the quality check", "",
             (f"`{quality['candidate']}` over `{quality['baseline']}` at T=0, paired over prompts (a gain over several "
             "seeds: the mean of each seed's and its interval); within: the 95% interval holds 0."), "",
             "| suite | gain | seeds | 95% interval | within |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {100 * c['gain']:+.1f}% | {c['seeds']} | " + ("— | — |" if c["within"] is None else
              f"[{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}] | {'yes' if c['within'] else 'no'} |")
              for s, c in quality["suites"].items()]
    held = quality["held_out"]
    if held["final"]:
        spread = held["baseline_seed_spread"]
        lines += ["", f"Held-out τ ({CURVE_METRIC}) at the end of training (every validation: held_out.md):", "",
                  "| run | held-out τ |", "|---|---|", *[f"| {n} | {t:.3f} |" for n, t in held["final"].items()], "",
                  "Difference seed by seed: " + (", ".join(f"s{s} {g:+.3f}" for s, g in held["gap_by_seed"].items())
                                                 or "none yet") +
                  (f"; the {quality['names'][0]} runs' spread over seeds: {spread:.3f}." if spread is not None else ".")]
    return "\n".join(lines + [""])


def write_quality(report: dict, runs: Mapping[tuple[str, int], Path], out: Path, candidate: str,
                  names: tuple[str, str] = ("float32", "bfloat16")) -> dict:
    """Write quality.json/.md (and held_out.* where the runs logged validations) into ``out``. ``runs``: ``{(precision,
    seed): training run folder}``, the precision one of ``names`` (the report's baseline's, then ``candidate``'s).
    Returns quality.json's content."""
    logged = {f"{p}-s{seed}": folder for (p, seed), folder in sorted(runs.items()) if logged_rows(folder)}
    doc = held_out.collect(logged) if logged else {}
    if doc:
        held_out.write(doc, out, f"Held-out τ along training: {names[0]} against {names[1]}")
    quality = {"baseline": report["baseline"], "candidate": candidate, "names": list(names),
               "suites": paired_gains(report, candidate), "held_out": held_out_gaps(doc, *names)}
    quality["within_on_mean"] = quality["suites"].get(MEAN, {}).get("within")
    (out / "quality.json").write_text(json.dumps(quality, indent=1) + "\n")
    (out / "quality.md").write_text(_markdown(quality))
    return quality
