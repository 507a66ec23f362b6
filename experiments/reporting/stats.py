"""The numbers of a report: τ per (temperature, suite, configuration) with bootstrap intervals, gains
over the baseline with paired intervals, the unweighted mean over suites, and aggregates over seeds."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.reporting.runs import Run, training_budget

MEAN = "mean"  # the pseudo-suite: unweighted mean of the per-suite τ


def _records(entry: dict) -> dict[str, tuple[int, int]] | None:
    """``{prompt id: (new tokens, steps)}`` of an entry, or None without per-prompt records."""
    prompts = entry.get("prompts")
    if not prompts:
        return None
    return {str(r["id"]): (int(r["new_tokens"]), int(r["steps"])) for r in prompts}


def _rng(seed: int, *parts: Any) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32("/".join(map(str, parts)).encode())])


def _tau_draws(records: dict[str, tuple[int, int]], ids: Sequence[str], picks: np.ndarray) -> np.ndarray:
    """Micro τ of each bootstrap resample: picks (n_boot, N) indexes ``ids`` -> (n_boot,)."""
    arr = np.array([records[i] for i in ids], dtype=np.float64)  # (N, 2) new tokens, steps
    return arr[picks, 0].sum(axis=1) / arr[picks, 1].sum(axis=1)


def _interval(draws: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _paired_gain(
    cfg: list[dict[str, tuple[int, int]] | None], base: list[dict[str, tuple[int, int]] | None],
    num_bootstrap: int, rng: np.random.Generator,
) -> tuple[float | None, float | None, int]:
    """95% interval of mean_s τ_cfg,s / mean_s τ_base,s − 1, resampling the prompts both share, per suite.

    One suite gives the plain ratio; several give the ratio of the unweighted means over suites.
    Returns ``(low, high, paired prompts)``; (None, None, n) when a suite lacks records or shared prompts.
    """
    draws_c, draws_b, paired = [], [], 0
    for rc, rb in zip(cfg, base):
        common = sorted(set(rc) & set(rb)) if rc is not None and rb is not None else []
        if len(common) < 2:
            return None, None, paired
        picks = rng.integers(0, len(common), size=(num_bootstrap, len(common)))
        draws_c.append(_tau_draws(rc, common, picks))
        draws_b.append(_tau_draws(rb, common, picks))
        paired += len(common)
    return (*_interval(np.mean(draws_c, axis=0) / np.mean(draws_b, axis=0) - 1.0), paired)


def _mean_cell(entries: list[dict], num_bootstrap: int, rng: np.random.Generator) -> dict:
    """The unweighted mean of per-suite τ, with a stratified bootstrap interval (prompts resampled per suite)."""
    cell = {"tau": float(np.mean([e["tau"] for e in entries])), "ci_low": None, "ci_high": None,
            "num_prompts": sum(int(e.get("num_prompts", 0)) for e in entries)}
    recs = [_records(e) for e in entries]
    if all(r is not None and len(r) >= 1 for r in recs):
        draws = []
        for r in recs:
            ids = sorted(r)
            draws.append(_tau_draws(r, ids, rng.integers(0, len(ids), size=(num_bootstrap, len(ids)))))
        cell["ci_low"], cell["ci_high"] = _interval(np.mean(draws, axis=0))
    return cell


def _entry_cell(entry: dict) -> dict:
    return {
        "tau": float(entry["tau"]),
        "ci_low": entry.get("tau_ci_low"),
        "ci_high": entry.get("tau_ci_high"),
        "tau_macro": entry.get("tau_macro"),
        "num_prompts": entry.get("num_prompts"),
        "spec_tokens_per_s": entry.get("spec_tokens_per_s"),
        "target_tokens_per_s": entry.get("target_tokens_per_s"),
        "speedup": entry.get("speedup"),
    }


def _overlap(a: dict, b: dict) -> bool | None:
    if None in (a.get("ci_low"), a.get("ci_high"), b.get("ci_low"), b.get("ci_high")):
        return None
    return not (a["ci_low"] > b["ci_high"] or a["ci_high"] < b["ci_low"])


def build_report(runs: Sequence[Run], baseline: str | None = "uniform", num_bootstrap: int = 1000,
                 seed: int = 0, composites: dict[str, Sequence[str]] | None = None) -> dict:
    """All numbers of the report (the content of report.json).

    ``table[t_key][suite][config]`` holds ``tau, ci_low, ci_high, num_prompts`` (plus speeds for real
    suites) and, for configurations other than the baseline, ``gain`` (τ/τ_baseline − 1),
    ``gain_ci_low/high`` (paired bootstrap, None without per-prompt records), ``paired_prompts`` and
    ``ci_overlap`` (whether the τ intervals of the configuration and the baseline overlap). The
    ``mean`` pseudo-suite averages the suites every configuration evaluated at that temperature (a configuration
    not evaluated at a temperature at all, e.g. a baseline at T=0 only, has no cells there). ``composites``
    (name -> its single terms' configurations) adds ``composition`` (:func:`_composition`).
    """
    if not runs:
        raise ValueError("no runs to report")
    names = [r.name for r in runs]
    if baseline is not None and baseline not in names and baseline not in {r.config for r in runs}:
        raise ValueError(f"baseline configuration {baseline!r} is not among the runs {names}; "
                         "pass --baseline <name> (or --baseline none)")
    base_of = {r.name: b.name for r in runs if (b := _baseline_run(runs, r, baseline)) is not None}
    suites, temps = _suites_and_temperatures(runs)
    t_keys = sorted(temps, key=temps.get)
    table: dict[str, dict[str, dict[str, dict]]] = {}
    curves: dict[str, dict[str, dict[str, dict]]] = {}
    common_suites: dict[str, list[str]] = {}
    for key in t_keys:
        table[key], curves[key] = {}, {}
        at_key = [run for run in runs if any(key in by_t for by_t in run.results.values())]
        common = common_suites[key] = [s for s in suites if all(key in run.results.get(s, {}) for run in at_key)]
        for suite in suites + ([MEAN] if len(common) > 1 else []):
            cells = _tau_cells(at_key, key, suite, common, curves[key], num_bootstrap, seed)
            _add_gains(runs, cells, base_of, key, suite, common if suite == MEAN else [suite], num_bootstrap, seed)
            table[key][suite] = cells
    report = {
        "baseline": baseline,
        "configurations": [_configuration(r) for r in runs],
        "suites": suites,
        "temperatures": {k: temps[k] for k in t_keys},
        "num_bootstrap": num_bootstrap,
        "table": table,
        "curves": curves,
        "draft_sources": _draft_sources(runs, t_keys),
    }
    report["across_seeds"] = aggregate_seeds(report)
    if report["across_seeds"]:
        _add_seed_gain_intervals(report["across_seeds"], runs, base_of, common_suites, num_bootstrap, seed)
    if composites:
        report["composition"] = _composition(runs, table, base_of, common_suites, composites, num_bootstrap, seed)
    return report


def _add_seed_gain_intervals(seeds: dict, runs: Sequence[Run], base_of: dict[str, str],
                             common: dict[str, list[str]], num_bootstrap: int, seed: int) -> None:
    """Add ``gain_ci_low/high`` to each across-seeds cell with gains: the 95% interval of the mean over seeds of
    the paired gains, resampling the prompts (one resample for every seed and both sides, per suite)."""
    by_name = {r.name: r for r in runs}
    for key, suites in seeds.items():
        for suite, cells in suites.items():
            group = common[key] if suite == MEAN else [suite]
            for config, agg in cells.items():
                pairs = [(r, by_name[base_of[r.name]]) for r in runs
                         if r.config == config and r.seed in agg["seeds"] and r.name in base_of]
                if "gains" not in agg or len(pairs) < 2:
                    continue
                interval = _seed_mean_gain(pairs, group, key, num_bootstrap, _rng(seed, key, suite, config, "seeds"))
                if interval is not None:
                    agg["gain_ci_low"], agg["gain_ci_high"] = interval


def _seed_mean_gain(pairs: list[tuple[Run, Run]], group: list[str], key: str, num_bootstrap: int,
                    rng: np.random.Generator) -> tuple[float, float] | None:
    """Interval of mean_pairs(τ_run / τ_base − 1), τ the unweighted mean over ``group``'s suites; None without
    per-prompt records or two prompts every run shares."""
    draws = _gain_draws([pairs], group, key, num_bootstrap, rng)
    return None if draws is None else _interval(draws[0])


def _gain_draws(groups: list[list[tuple[Run, Run]]], suites: list[str], key: str, num_bootstrap: int,
                rng: np.random.Generator) -> np.ndarray | None:
    """Bootstrap draws of each group's mean over its (run, base) pairs of τ_run / τ_base − 1, τ the unweighted mean
    over ``suites``, every run resampled with the same prompts (those all of them share, per suite):
    (groups, num_bootstrap); None without per-prompt records or two prompts every run shares."""
    pairs = [pair for group in groups for pair in group]
    draws = np.zeros((2, len(pairs), num_bootstrap))  # (run or base, pair, resample): τ summed over suites
    for suite in suites:
        records = [[_records(r.results.get(suite, {}).get(key, {})) for r in pair] for pair in pairs]
        if any(rec is None for pair in records for rec in pair):
            return None
        ids = sorted(set.intersection(*(set(rec) for pair in records for rec in pair)))
        if len(ids) < 2:
            return None
        picks = rng.integers(0, len(ids), size=(num_bootstrap, len(ids)))
        for i, pair in enumerate(records):
            for side, rec in enumerate(pair):
                draws[side, i] += _tau_draws(rec, ids, picks)
    gains = draws[0] / draws[1] - 1.0  # (pair, resample)
    bounds = np.cumsum([0] + [len(group) for group in groups])
    return np.stack([gains[a:b].mean(axis=0) for a, b in itertools.pairwise(bounds)])


def _composition(runs: Sequence[Run], table: dict, base_of: dict[str, str], common: dict[str, list[str]],
                 composites: dict[str, Sequence[str]], num_bootstrap: int, seed: int) -> dict:
    """``{t_key: {composite: cell}}``: each composite's gain over the baseline on the suites' mean beside the sum of
    its single terms' gains, each the mean of its paired gains over the ``seeds`` every one of them has, and ``ratio`` =
    gain / sum, with the 95% intervals of one bootstrap over the prompts for every run (given these trainings: seed
    to seed variance is not in them): ``sum_ci_low/high`` and ``ratio_ci_low/high`` (None without per-prompt records,
    and the ratio's where the sum's interval reaches 0). A composite is left out where it and its terms share no seed
    with a gain at that temperature."""
    by_name, out = {r.name: r for r in runs}, {}
    for key, suites in common.items():
        cells = table[key].get(MEAN if len(suites) > 1 else suites[0], {}) if suites else {}
        for composite, parts in composites.items():
            groups = [[(r, by_name[base_of[r.name]]) for r in runs
                       if r.config == c and r.name in base_of and "gain" in cells.get(r.name, {})]
                      for c in (composite, *parts)]
            shared = set.intersection(*({r.seed for r, _ in group} for group in groups))  # one seed set for all
            groups = [[pair for pair in group if pair[0].seed in shared] for group in groups]
            if not all(groups):
                continue
            gains = [float(np.mean([cells[r.name]["gain"] for r, _ in group])) for group in groups]
            total = sum(gains[1:])
            cell = {"gain": gains[0], "terms": dict(zip(parts, gains[1:])), "sum": total,
                    "ratio": gains[0] / total if total > 0 else None, "ratio_ci_low": None, "ratio_ci_high": None,
                    "seeds": sorted(shared, key=str)}
            draws = _gain_draws(groups, suites, key, num_bootstrap, _rng(seed, key, composite, "composition"))
            if draws is not None:
                cell["sum_ci_low"], cell["sum_ci_high"] = _interval(draws[1:].sum(axis=0))
                if cell["sum_ci_low"] > 0:  # else a ratio to a sum near 0 has no interval worth giving
                    cell["ratio_ci_low"], cell["ratio_ci_high"] = _interval(draws[0] / draws[1:].sum(axis=0))
            out.setdefault(key, {})[composite] = cell
    return out


def _draft_sources(runs: Sequence[Run], t_keys: Sequence[str]) -> dict[str, dict[str, dict[str, dict]]]:
    """``{t_key: {suite: {run: by_draft_source}}}`` for the runs whose drafter labels its drafts (results'
    ``by_draft_source``: row-steps, share and drafts kept per label, e.g. copied hint vs the drafter's own)."""
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for key in t_keys:
        for run in runs:
            for suite, entries in run.results.items():
                sources = entries.get(key, {}).get("by_draft_source")
                if sources:
                    out.setdefault(key, {}).setdefault(suite, {})[run.name] = sources
    return out


def _suites_and_temperatures(runs: Sequence[Run]) -> tuple[list[str], dict[str, float]]:
    """Every suite in the order found, and every temperature key with its temperature."""
    suites: list[str] = []
    temps: dict[str, float] = {}
    for run in runs:
        for suite, entries in run.results.items():
            suites += [suite] if suite not in suites else []
            for key, entry in entries.items():
                temps[key] = float(entry.get("temperature", key.lstrip("t")))
    return suites, temps


def _tau_cells(runs: Sequence[Run], key: str, suite: str, common: list[str], curves: dict,
               num_bootstrap: int, seed: int) -> dict[str, dict]:
    """Per run, the τ cell of ``suite`` at ``key`` (for ``mean``: over the ``common`` suites); records
    the a_k and histogram curves of real suites into ``curves``."""
    cells = {}
    for run in runs:
        if suite == MEAN:
            cells[run.name] = _mean_cell([run.results[s][key] for s in common], num_bootstrap,
                                         _rng(seed, key, suite, run.name))
        elif key in run.results.get(suite, {}):
            entry = run.results[suite][key]
            cells[run.name] = _entry_cell(entry)
            width, rates = run.drafted_width(), entry.get("position_acceptance")
            curves.setdefault(suite, {})[run.name] = {  # a_k past the slots a step drafts: none (not a rejection)
                "position_acceptance": rates if width is None or rates is None else
                [a if k < width else None for k, a in enumerate(rates)],
                "accept_hist": entry.get("accept_hist"),
            }
    return cells


def _add_gains(runs: Sequence[Run], cells: dict[str, dict], base_of: dict[str, str], key: str, suite: str,
               group: list[str], num_bootstrap: int, seed: int) -> None:
    """Add to each cell its gain over its baseline run's cell, with the paired interval over ``group``."""
    names = [r.name for r in runs]
    for run in runs:
        cell, base_name = cells.get(run.name), base_of.get(run.name)
        if cell is None or base_name is None or base_name not in cells:
            continue
        base, base_run = cells[base_name], runs[names.index(base_name)]
        cell["gain"] = cell["tau"] / base["tau"] - 1.0
        low, high, paired = _paired_gain([_records(run.results[s][key]) for s in group],
                                         [_records(base_run.results[s][key]) for s in group],
                                         num_bootstrap, _rng(seed, key, suite, run.name, "gain"))
        cell.update(baseline_run=base_name, gain_ci_low=low, gain_ci_high=high, paired_prompts=paired,
                    ci_overlap=_overlap(cell, base))


def _configuration(r: Run) -> dict:
    """A run as report.json lists it (paths as found; :mod:`.write` makes them portable)."""
    drafter = r.doc.get("drafter") or {}
    return {
        "name": r.name,
        "config": r.config,
        "seed": r.seed,
        "results_path": str(r.path),
        "drafter_path": drafter.get("path"),
        "description": drafter.get("description"),
        "training_run": drafter.get("training_run"),
        "budget": training_budget(r),
        "git_commit": r.doc.get("git_commit"),
    }


def _baseline_run(runs: Sequence[Run], run: Run, baseline: str | None) -> Run | None:
    """The run ``run`` is compared with: the run named ``baseline``; else the ``baseline``
    configuration's run with the same seed, or its only run. None for the baseline itself."""
    if baseline is None or run.config == baseline or run.name == baseline:
        return None
    named = [r for r in runs if r.name == baseline]
    if named:
        return named[0]
    same = [r for r in runs if r.config == baseline and r.seed == run.seed]
    every = [r for r in runs if r.config == baseline]
    return same[0] if same else (every[0] if len(every) == 1 else None)


def aggregate_seeds(report: dict) -> dict | None:
    """Per configuration over its seeds, or None when no configuration has two seeds.

    ``[t_key][suite][config]`` holds ``seeds``, per-seed ``taus``, ``tau_mean``, ``tau_sd`` (sample SD;
    0 for one seed), ``tau_min/max`` and, against the baseline, per-seed ``gains`` (each seed against
    the baseline run it was paired with), ``gain_mean`` (mean of per-seed gains), ``gain_min/max`` and
    ``gains_positive`` (how many seeds gained).
    """
    configs: dict[str, list[dict]] = {}
    for c in report["configurations"]:
        configs.setdefault(c["config"], []).append(c)
    if not any(len(v) > 1 and all(c["seed"] is not None for c in v) for v in configs.values()):
        return None
    out: dict[str, dict] = {}
    for key, suites in report["table"].items():
        out[key] = {}
        for suite, cells in suites.items():
            out[key][suite] = {}
            for config, members in configs.items():
                hits = [(m["seed"], cells[m["name"]]) for m in members if m["name"] in cells]
                if not hits:
                    continue
                taus = [c["tau"] for _, c in hits]
                agg = {"seeds": [s for s, _ in hits], "taus": taus, "tau_mean": float(np.mean(taus)),
                       "tau_sd": float(np.std(taus, ddof=1)) if len(taus) > 1 else 0.0,
                       "tau_min": float(min(taus)), "tau_max": float(max(taus))}
                gains = [c["gain"] for _, c in hits if "gain" in c]
                if gains:
                    agg.update(gains=gains, gain_mean=float(np.mean(gains)), gain_min=float(min(gains)),
                               gain_max=float(max(gains)), gains_positive=sum(g > 0 for g in gains))
                out[key][suite][config] = agg
    return out


def mean_curves(curves: dict[str, tuple[list[int], list[float]]], groups: dict[str, str]
                ) -> dict[str, tuple[list[int], list[float]]]:
    """Curves of the runs of each group (``groups``: run name -> group) averaged at the steps all of them logged."""
    out = {}
    for group in dict.fromkeys(groups.values()):
        got = [curves[n] for n, g in groups.items() if g == group and n in curves]
        if not got:
            continue
        steps = sorted(set.intersection(*(set(s) for s, _ in got)))
        out[group] = (steps, [float(np.mean([dict(zip(s, v))[t] for s, v in got])) for t in steps])
    return out


def seed_view(report: dict) -> dict:
    """A report-shaped dict with one configuration per seed group, for the plots: τ = mean over seeds with
    ``ci_low/high`` = the seed range (and ``taus`` per seed); accept histograms summed over seeds and
    a_k averaged over the seeds that reached slot k."""
    seeds = report["across_seeds"]
    configs = list(dict.fromkeys(c["config"] for c in report["configurations"]))
    members = {c: [m["name"] for m in report["configurations"] if m["config"] == c] for c in configs}
    table = {key: {suite: {c: {"tau": a["tau_mean"], "ci_low": a["tau_min"], "ci_high": a["tau_max"],
                                "taus": a["taus"]} for c, a in cells.items()}
                   for suite, cells in suites.items()} for key, suites in seeds.items()}
    curves: dict = {}
    for key, suites in report["curves"].items():
        curves[key] = {}
        for suite, by_run in suites.items():
            curves[key][suite] = {}
            for c in configs:
                got = [by_run[n] for n in members[c] if n in by_run]
                hists = [g["accept_hist"] for g in got if g.get("accept_hist")]
                accs = [g["position_acceptance"] for g in got if g.get("position_acceptance")]
                if not got:
                    continue
                width = max(map(len, hists), default=0)  # padded: a seed's histogram may stop short of another's
                hist = np.sum([np.pad(h, (0, width - len(h))) for h in hists], axis=0).tolist() if hists else None
                acc = None
                if accs and len({len(a) for a in accs}) == 1:
                    acc = [float(np.mean(vals)) if (vals := [a[k] for a in accs if a[k] is not None]) else None
                           for k in range(len(accs[0]))]
                curves[key][suite][c] = {"position_acceptance": acc, "accept_hist": hist}
    return {**report, "configurations": [{"name": c, "config": c, "seed": None} for c in configs],
            "table": table, "curves": curves}
