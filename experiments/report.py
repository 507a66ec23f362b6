"""Compare evaluated drafters: ``python -m experiments.report <run dirs or results.json> --out DIR``.

Gathers every ``results.json`` written by :mod:`experiments.evaluate` under the given paths (a run
dir, a multirun dir searched recursively, or the files themselves) and writes to ``--out``:

* ``report.md``: per temperature, a table of τ per suite (and their mean) per configuration with
  95% bootstrap intervals, the gain over the baseline configuration (``--baseline``, default
  ``uniform``) as relative % with a 95% interval of the ratio τ/τ_baseline from *paired* resampling of
  the prompts both evaluated (when per-prompt records are present), and the measured speeds;
* ``report.json``: the same numbers;
* PNG plots: ``tau.png`` (grouped bars with CI error bars, one panel per temperature), ``gain.png``
  (gain over the baseline per suite with paired intervals),
  ``position_acceptance.png`` (a_k vs k per suite), ``accept_hist.png`` (share of steps keeping
  0..K drafts) and, when the training logs are found (a CSV logger's ``metrics.csv`` with a
  ``val/tau_greedy`` column), ``training_curves.png``.

Seeds: when a configuration was trained with several seeds (e.g. ``seed=0,1,2`` on a multirun),
each run is labelled ``<loss>-s<seed>`` and compared with the baseline run of the *same* seed, and
report.md opens with across-seeds tables (τ mean ± SD over seeds; the mean of per-seed gains, each
seed's gain, and how many seeds gained); the plots then show one bar/line per configuration (seed
means; error bars = the range over seeds).

A configuration is named by the drafter's ``name`` in results.json when it has one (the baselines
``prompt_lookup`` and ``ar_assistant``, which have no training curves), else by the ``loss`` group
choice of the training run it came from, read from ``.hydra/hydra.yaml`` (or the ``loss=`` override in
``train_summary.json``) beside the results or beside the evaluated drafter; otherwise by its directory
name. ``--names`` overrides, in the order
the files are found. ``--wandb`` also logs the plots and the table to Weights & Biases (offline
unless ``--wandb-mode online``).
"""

from __future__ import annotations

import argparse
import csv
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

MEAN = "mean"  # the pseudo-suite: unweighted mean of the per-suite τ
OVERLAP_MARK = "°"
CURVE_METRIC = "val/tau_greedy"


# ------------------------------------------------------------------------------------------------
# Finding and naming runs


def find_results(paths: Sequence[str | Path]) -> list[Path]:
    """Every results.json under ``paths`` (files taken as they are, directories searched recursively)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            hits = [p]
        elif p.is_dir():
            hits = sorted(p.rglob("results.json"))
            if not hits:
                raise FileNotFoundError(f"{p}: no results.json found in this directory or below it")
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
        found += [h for h in hits if h.resolve() not in {f.resolve() for f in found}]
    if not found:
        raise FileNotFoundError("no results.json given")
    return found


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _override_value(overrides: Sequence[str], key: str) -> str | None:
    for item in overrides or ():
        name, _, value = str(item).lstrip("+~").partition("=")
        if name == key and value:
            return value
    return None


def loss_choice(run_dir: str | Path) -> str | None:
    """The ``loss`` config group chosen for a training run dir, or None if the dir does not say."""
    run_dir = Path(run_dir)
    hydra_cfg = _read_yaml(run_dir / ".hydra" / "hydra.yaml")
    if isinstance(hydra_cfg, dict):
        choices = ((hydra_cfg.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
        if choices.get("loss"):
            return str(choices["loss"])
    summary = run_dir / "train_summary.json"
    if summary.is_file():
        try:
            value = _override_value(json.loads(summary.read_text()).get("overrides", []), "loss")
        except (OSError, json.JSONDecodeError):
            value = None
        if value:
            return value
    overrides = _read_yaml(run_dir / ".hydra" / "overrides.yaml")
    return _override_value(overrides, "loss") if isinstance(overrides, list) else None


def training_run_info(run_dir: str | Path) -> dict | None:
    """``{run_dir, loss, name, seed}`` of a training run dir (one with train_summary.json or .hydra/)."""
    run_dir = Path(run_dir)
    markers = [run_dir / "train_summary.json", run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "hydra.yaml"]
    if not any(m.is_file() for m in markers):
        return None
    config = _read_yaml(run_dir / ".hydra" / "config.yaml")
    config = config if isinstance(config, dict) else {}
    name = config.get("name")
    if (run_dir / "train_summary.json").is_file():
        try:
            name = json.loads((run_dir / "train_summary.json").read_text()).get("name", name)
        except (OSError, json.JSONDecodeError):
            pass
    return {"run_dir": str(run_dir.resolve()), "loss": loss_choice(run_dir), "name": name, "seed": config.get("seed")}


@dataclass
class Run:
    """One evaluated configuration: its name, results.json path and content."""

    name: str
    path: Path
    doc: dict = field(repr=False)
    config: str = ""  # the configuration without the seed (== name unless seeds were disambiguated)
    seed: Any = None  # the training seed when known

    def __post_init__(self) -> None:
        self.config = self.config or self.name

    @property
    def results(self) -> dict:
        return self.doc.get("results", {})

    def training_dirs(self) -> list[Path]:
        """Directories that may hold this configuration's training logs (nearest first)."""
        dirs = [self.path.parent]
        info = (self.doc.get("drafter") or {}).get("training_run") or {}
        if info.get("run_dir"):
            dirs.append(Path(info["run_dir"]))
        drafter_path = (self.doc.get("drafter") or {}).get("path")
        if drafter_path:
            dirs.append(Path(drafter_path).parent)
        return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def _auto_name(path: Path, doc: dict) -> tuple[str, Any]:
    """``(name, seed)``: the drafter's own name (baselines: ``prompt_lookup``, ``ar_assistant``), else the
    loss choice beside the results or of the drafter's training run, else the dir name."""
    if (doc.get("drafter") or {}).get("name"):
        return str(doc["drafter"]["name"]), None
    info = training_run_info(path.parent) or {}
    if info.get("loss"):
        return info["loss"], info.get("seed")
    info = (doc.get("drafter") or {}).get("training_run") or {}
    if info.get("loss"):
        return info["loss"], info.get("seed")
    drafter_path = (doc.get("drafter") or {}).get("path")
    if drafter_path and Path(drafter_path).parent.is_dir():
        info = training_run_info(Path(drafter_path).parent) or {}
        if info.get("loss"):
            return info["loss"], info.get("seed")
    return path.parent.name or str(path), None


def load_runs(paths: Sequence[str | Path], names: Sequence[str] | None = None) -> list[Run]:
    """Read every results.json under ``paths`` and name each configuration (see the module docstring)."""
    files = find_results(paths)
    if names is not None and len(names) != len(files):
        listing = "\n  ".join(map(str, files))
        raise ValueError(f"--names gives {len(names)} names for {len(files)} results files:\n  {listing}")
    docs = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
            raise TypeError(f"{f}: not an experiments.evaluate results.json (no `results` mapping)")
        docs.append(doc)
    if names is not None:
        labels = list(names)
        configs, seeds = list(names), [None] * len(names)
    else:
        auto = [_auto_name(f, d) for f, d in zip(files, docs)]
        configs, seeds = [a[0] for a in auto], [a[1] for a in auto]
        labels = list(configs)
        for i, (name, seed) in enumerate(auto):  # disambiguate repeats (e.g. seeds of one loss)
            if configs.count(name) > 1:
                labels[i] = f"{name}-s{seed}" if seed is not None else f"{name} ({files[i].parent.name})"
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label} #{labels[: i + 1].count(label)}"
    # Seeds are only aggregated when every repeat of a configuration is told apart by its seed.
    for i, (config, seed) in enumerate(zip(configs, seeds)):
        if seed is None or sum(c == config and s == seed for c, s in zip(configs, seeds)) > 1:
            configs[i], seeds[i] = labels[i], None
    return [Run(name, f, d, config=c, seed=s) for name, f, d, c, s in zip(labels, files, docs, configs, seeds)]


def order_runs(runs: Sequence[Run], order: Sequence[str] = (), baseline: str | None = None) -> list[Run]:
    """Runs sorted by configuration: ``baseline`` first, then those named in ``order`` (configuration or
    run names) in that order, then the rest as found; a configuration's seeds in seed order."""
    first = [baseline] if baseline else []
    rank = {name: i for i, name in enumerate(dict.fromkeys([*first, *order]))}
    found = {c: i for i, c in enumerate(dict.fromkeys(r.config for r in runs))}

    def key(item: tuple[int, Run]) -> tuple:
        i, run = item
        r = rank.get(run.config, rank.get(run.name))
        seed = run.seed if isinstance(run.seed, int) else i
        return (0, r) if r is not None else (1, found[run.config]), seed, i

    return [run for _, run in sorted(enumerate(runs), key=key)]


# ------------------------------------------------------------------------------------------------
# Numbers


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
                 seed: int = 0) -> dict:
    """All numbers of the report (the content of report.json).

    ``table[t_key][suite][config]`` holds ``tau, ci_low, ci_high, num_prompts`` (plus speeds for real
    suites) and, for configurations other than the baseline, ``gain`` (τ/τ_baseline − 1),
    ``gain_ci_low/high`` (paired bootstrap, None without per-prompt records), ``paired_prompts`` and
    ``ci_overlap`` (whether the τ intervals of the configuration and the baseline overlap). The
    ``mean`` pseudo-suite averages the suites every configuration evaluated at that temperature.
    """
    if not runs:
        raise ValueError("no runs to report")
    names = [r.name for r in runs]
    if baseline is not None and baseline not in names and baseline not in {r.config for r in runs}:
        raise ValueError(f"baseline configuration {baseline!r} is not among the runs {names}; "
                         "pass --baseline <name> (or --baseline none)")
    base_of = {r.name: b.name for r in runs if (b := _baseline_run(runs, r, baseline)) is not None}
    suites: list[str] = []
    temps: dict[str, float] = {}
    for run in runs:
        for suite, entries in run.results.items():
            suites += [suite] if suite not in suites else []
            for key, entry in entries.items():
                temps[key] = float(entry.get("temperature", key.lstrip("t")))
    t_keys = sorted(temps, key=temps.get)
    table: dict[str, dict[str, dict[str, dict]]] = {}
    curves: dict[str, dict[str, dict[str, dict]]] = {}
    for key in t_keys:
        table[key], curves[key] = {}, {}
        common = [s for s in suites if all(key in run.results.get(s, {}) for run in runs)]
        columns = suites + ([MEAN] if len(common) > 1 else [])
        for suite in columns:
            cells = {}
            for run in runs:
                if suite == MEAN:
                    cells[run.name] = _mean_cell([run.results[s][key] for s in common], num_bootstrap,
                                                 _rng(seed, key, suite, run.name))
                elif key in run.results.get(suite, {}):
                    entry = run.results[suite][key]
                    cells[run.name] = _entry_cell(entry)
                    curves[key].setdefault(suite, {})[run.name] = {
                        "position_acceptance": entry.get("position_acceptance"),
                        "accept_hist": entry.get("accept_hist"),
                    }
            group = common if suite == MEAN else [suite]
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
            table[key][suite] = cells
    report = {
        "baseline": baseline,
        "configurations": [{
            "name": r.name,
            "config": r.config,
            "seed": r.seed,
            "results_path": str(r.path),
            "drafter_path": (r.doc.get("drafter") or {}).get("path"),
            "description": (r.doc.get("drafter") or {}).get("description"),
            "training_run": (r.doc.get("drafter") or {}).get("training_run"),
            "git_commit": r.doc.get("git_commit"),
        } for r in runs],
        "suites": suites,
        "temperatures": {k: temps[k] for k in t_keys},
        "num_bootstrap": num_bootstrap,
        "table": table,
        "curves": curves,
    }
    report["across_seeds"] = aggregate_seeds(report)
    return report


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


def training_curve(run: Run, metric: str = CURVE_METRIC) -> tuple[list[int], list[float]] | None:
    """``(steps, values)`` of ``metric`` from the first CSV-logger metrics.csv near the run that has it."""
    for d in run.training_dirs():
        for path in [d / "metrics.csv", d / "logs" / "metrics.csv", *sorted(d.glob("*/*/metrics.csv"))]:
            if not path.is_file():
                continue
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            if not rows or metric not in rows[0]:
                continue
            points = {int(float(r["step"])): float(r[metric]) for r in rows if r.get(metric) and r.get("step")}
            if points:
                steps = sorted(points)
                return steps, [points[s] for s in steps]
    return None


# ------------------------------------------------------------------------------------------------
# Markdown


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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _fmt_seed_tau(agg: dict | None) -> str:
    if agg is None:
        return "—"
    if len(agg["taus"]) == 1:
        return f"{agg['tau_mean']:.3f} (1 seed)"
    return f"{agg['tau_mean']:.3f} ± {agg['tau_sd']:.3f}"


def _fmt_seed_gain(agg: dict | None) -> str:
    if agg is None or "gains" not in agg:
        return "—"
    per_seed = ", ".join(f"{100 * g:+.1f}" for g in agg["gains"])
    return f"{100 * agg['gain_mean']:+.1f}% ({per_seed}; {agg['gains_positive']}/{len(agg['gains'])} > 0)"


def _seed_sections(report: dict, seeds: dict) -> list[str]:
    """The across-seeds tables: τ mean ± SD over seeds, and the mean of per-seed paired gains."""
    configs = list(dict.fromkeys(c["config"] for c in report["configurations"]))
    base = report["baseline"]
    counts = {c: sum(m["config"] == c for m in report["configurations"]) for c in configs}
    lines = ["", "# Across seeds", "",
             "Each configuration was trained once per seed (" + ", ".join(f"{c}: {n}" for c, n in counts.items())
             + " runs). τ: mean ± sample SD of the per-seed τ."]
    if base is not None:
        lines += ["", (f"Gain: mean over seeds of τ / τ({base}, same seed) − 1; in brackets each seed's gain (%) "
                       "and how many seeds gained. The per-run sections below give each run's prompt-bootstrap "
                       "intervals.")]
    for key, temperature in report["temperatures"].items():
        columns = list(seeds[key])
        lines += ["", f"## Temperature {temperature:g}, across seeds", "", "### τ (mean ± SD over seeds)", ""]
        lines += _table(["configuration", *columns],
                        [[c, *(_fmt_seed_tau(seeds[key][s].get(c)) for s in columns)] for c in configs])
        if base is not None:
            lines += ["", f"### Gain over {base} (mean of per-seed gains)", ""]
            lines += _table(["configuration", *columns],
                            [[c, *(_fmt_seed_gain(seeds[key][s].get(c)) for s in columns)]
                             for c in configs if c != base])
    return lines


def render_markdown(report: dict, plots: Sequence[str] = ()) -> str:
    """report.md: per temperature, tables of τ, gain over the baseline, and speed."""
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
    lines += ["", "Configurations:", ""]
    lines += [f"- **{c['name']}**: `{c['results_path']}`"
              + (f" (drafter `{c['drafter_path']}`)" if c.get("drafter_path") else "")
              + (f" — {c['description']}" if c.get("description") else "")
              for c in report["configurations"]]
    for key, temperature in report["temperatures"].items():
        columns = list(report["table"][key])
        lines += ["", f"## Temperature {temperature:g}", "", "### τ (95% CI)", ""]
        lines += _table(["configuration", *columns],
                        [[n, *(_fmt_tau(report["table"][key][s].get(n)) for s in columns)] for n in names])
        if base is not None:
            lines += ["", f"### Gain over {base} (95% CI)", ""]
            lines += _table(["configuration", *columns],
                            [[n, *(_fmt_gain(report["table"][key][s].get(n)) for s in columns)]
                             for n, c in zip(names, report["configurations"]) if base not in (n, c["config"])])
        speed_cols = [s for s in columns if s != MEAN]
        lines += ["", "### Speed (speculative / target-only tokens per second = speedup)", ""]
        lines += _table(["configuration", *speed_cols],
                        [[n, *(_fmt_speed(report["table"][key][s].get(n)) for s in speed_cols)] for n in names])
    if plots:
        lines += ["", "## Plots"]
        for p in plots:
            lines += ["", f"![{Path(p).stem}]({Path(p).name})"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Plots


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
    order = [labels.index(n) for n in names if n in labels]
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside lower center",
               ncol=min(len(order), 5), title="configuration")


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
                hist = np.sum(hists, axis=0).tolist() if hists and len({len(h) for h in hists}) == 1 else None
                acc = None
                if accs and len({len(a) for a in accs}) == 1:
                    acc = [float(np.mean(vals)) if (vals := [a[k] for a in accs if a[k] is not None]) else None
                           for k in range(len(accs[0]))]
                curves[key][suite][c] = {"position_acceptance": acc, "accept_hist": hist}
    return {**report, "configurations": [{"name": c, "config": c, "seed": None} for c in configs],
            "table": table, "curves": curves}


def plot_tau(report: dict, path: Path,
             caption: str = "Accepted length τ per suite (error bars: 95% bootstrap CI over prompts)") -> Path:
    """Grouped bars of τ per suite (and mean), one bar per configuration, with error bars; a panel per T.

    Cells with ``taus`` (a :func:`seed_view`) also get one dot per seed."""
    plt = _pyplot()
    names = [c["name"] for c in report["configurations"]]
    colors = _colors(names)
    keys = list(report["temperatures"])
    ncols = max(len(report["table"][k]) for k in keys)
    width_in = min(16.0, max(6.5, 1.5 + ncols * (0.25 * len(names) + 0.5)))
    fig, axes = plt.subplots(len(keys), 1, figsize=(width_in, 3.3 * len(keys) + 1.2), squeeze=False,
                             sharey=True, layout="constrained")
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
    _legend(fig, axes, names)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_gain(report: dict, path: Path, seeds: bool = False) -> Path:
    """Grouped bars of the gain over the baseline (%) per suite, one bar per other configuration; a panel
    per temperature. Error bars: the paired-bootstrap 95% interval, or with ``seeds`` (a
    :func:`seed_view` of a report with ``across_seeds``) the range of per-seed gains, dots per seed."""
    plt = _pyplot()
    base = report["baseline"]
    names = [c["name"] for c in report["configurations"] if base not in (c["name"], c["config"])]
    colors = _colors([c["name"] for c in report["configurations"]])
    keys = list(report["temperatures"])
    ncols = max(len(report["table"][k]) for k in keys)
    width_in = min(16.0, max(6.5, 1.5 + ncols * (0.25 * len(names) + 0.5)))
    fig, axes = plt.subplots(len(keys), 1, figsize=(width_in, 3.0 * len(keys) + 1.2), squeeze=False,
                             layout="constrained")
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
    fig.suptitle(f"τ / τ({base}) − 1 per suite; {what}")
    _legend(fig, axes, names)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    _legend(fig, axes, names)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    _legend(fig, axes, names)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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


def plot_training_curves(curves: dict[str, tuple[list[int], list[float]]], path: Path,
                         title: str = f"Training: {CURVE_METRIC}") -> Path:
    """``val/tau_greedy`` vs optimizer step, one line per configuration."""
    plt = _pyplot()
    colors = _colors(list(curves))
    fig, ax = plt.subplots(figsize=(6.5, 4.2), layout="constrained")
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o", markersize=3, color=colors[name], label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("teacher-forced τ (greedy), validation")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title="configuration")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# Writing


def write_report(runs: Sequence[Run], out: str | Path, baseline: str | None = "uniform",
                 num_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Write report.md, report.json and the PNGs to ``out``; returns report.json's content (with ``files``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(runs, baseline=baseline, num_bootstrap=num_bootstrap, seed=seed)
    if report["across_seeds"]:  # plots show configurations (seed means), not every run
        view = seed_view(report)
        plots = [plot_tau(view, out / "tau.png", "Accepted length τ per suite: mean over seeds "
                          "(error bars: seed range, dots: seeds)")]
    else:
        view = report
        plots = [plot_tau(report, out / "tau.png")]
    if baseline is not None and report["baseline"] is not None and len(view["configurations"]) > 1:
        plots.append(plot_gain(view, out / "gain.png", seeds=bool(report["across_seeds"])))
    plots += [plot_position_acceptance(view, out / "position_acceptance.png"),
              plot_accept_hist(view, out / "accept_hist.png")]
    curves = {r.name: c for r in runs if (c := training_curve(r)) is not None}
    report["training_curves"] = {n: {"steps": s, CURVE_METRIC: v} for n, (s, v) in curves.items()}
    if curves and report["across_seeds"]:
        plots.append(plot_training_curves(mean_curves(curves, {r.name: r.config for r in runs}),
                                          out / "training_curves.png", f"Training: {CURVE_METRIC}, mean over seeds"))
    elif curves:
        plots.append(plot_training_curves(curves, out / "training_curves.png"))
    (out / "report.md").write_text(render_markdown(report, plots))
    report["files"] = [str(out / "report.md"), str(out / "report.json"), *map(str, plots)]
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def log_to_wandb(report: dict, out: str | Path, project: str = "blockdraft", mode: str = "offline",
                 name: str | None = None) -> str:
    """Log the PNGs and the τ table to a W&B run (offline by default); returns the run's directory."""
    import wandb

    run = wandb.init(project=project, mode=mode, dir=str(out), name=name, job_type="report",
                     config={"baseline": report["baseline"], "configurations": report["configurations"]})
    images = {f"report/{Path(f).stem}": wandb.Image(f) for f in report["files"] if f.endswith(".png")}
    columns = ["configuration", "temperature", "suite", "tau", "ci_low", "ci_high", "gain", "gain_ci_low",
               "gain_ci_high"]
    rows = [[n, report["temperatures"][k], s, c["tau"], c.get("ci_low"), c.get("ci_high"), c.get("gain"),
             c.get("gain_ci_low"), c.get("gain_ci_high")]
            for k, suites in report["table"].items() for s, cells in suites.items() for n, c in cells.items()]
    run.log({**images, "report/tau_table": wandb.Table(columns=columns, data=rows)})
    run_dir = run.dir
    run.finish()
    return run_dir


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="run dirs (searched recursively) or results.json files")
    parser.add_argument("--out", required=True, help="output directory for report.md, report.json and PNGs")
    parser.add_argument("--names", nargs="+", help="configuration names, in the order the results are found")
    parser.add_argument("--baseline", default="uniform", help="configuration the gains are relative to "
                        "('none': no gains; default uniform, skipped with a note when absent)")
    parser.add_argument("--order", nargs="+", default=[], help="configurations to list first, in this order "
                        "(the baseline always comes first)")
    parser.add_argument("--num-bootstrap", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wandb", action="store_true", help="also log the plots and table to W&B")
    parser.add_argument("--wandb-project", default="blockdraft")
    parser.add_argument("--wandb-mode", default="offline", choices=["offline", "online"])
    args = parser.parse_args(argv)
    if args.num_bootstrap < 1:
        parser.error(f"--num-bootstrap must be >= 1, got {args.num_bootstrap}")
    runs = load_runs(args.paths, args.names)
    baseline = None if args.baseline.lower() == "none" else args.baseline
    if baseline == "uniform" and baseline not in [r.name for r in runs] + [r.config for r in runs]:
        print(f"[report] no configuration named 'uniform' among {[r.name for r in runs]}: no gains "
              "(pass --baseline <name>)", flush=True)
        baseline = None
    runs = order_runs(runs, args.order, baseline)
    report = write_report(runs, args.out, baseline=baseline, num_bootstrap=args.num_bootstrap, seed=args.seed)
    if args.wandb:
        report["wandb_dir"] = log_to_wandb(report, args.out, project=args.wandb_project, mode=args.wandb_mode)
    print(f"[report] {len(runs)} configurations -> {Path(args.out) / 'report.md'}", flush=True)
    return report


if __name__ == "__main__":
    main()


class MultirunReport(Callback):
    """Hydra callback: when a multirun (e.g. ``experiment=l2r_ablation``) ends, write one report of
    every job's ``results.json`` to ``<sweep dir>/report`` (configure under ``hydra.callbacks``)."""

    def __init__(self, baseline: str | None = "uniform", num_bootstrap: int = 1000, out: str | None = None,
                 name_by_dir: bool = False):
        self.baseline, self.num_bootstrap, self.out, self.name_by_dir = baseline, num_bootstrap, out, name_by_dir

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            found = find_results([sweep_dir])
        except FileNotFoundError as err:
            print(f"[report] nothing to report: {err}", flush=True)
            return
        out = Path(self.out) if self.out else sweep_dir / "report"
        names = [p.parent.name for p in found] if self.name_by_dir else None
        swept = OmegaConf.select(config, "hydra.sweeper.params.loss", default=None)
        order = [x.strip() for x in str(swept).split(",")] if swept else []
        runs = order_runs(load_runs([sweep_dir], names=names), order, self.baseline)
        report = write_report(runs, out, baseline=self.baseline, num_bootstrap=self.num_bootstrap)
        print(f"[report] {len(report['configurations'])} configurations -> {out / 'report.md'}", flush=True)
