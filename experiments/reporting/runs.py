"""Finding and naming evaluated runs: every ``results.json`` under the given paths, one :class:`Run`
per configuration, named by the drafter's own name (baselines), the loss of the training run it came
from (:func:`experiments.pipeline.records.training_run_info`) or its directory; and their training
curves (a CSV logger's ``metrics.csv``)."""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.pipeline.export import shipped_budget
from experiments.pipeline.records import drafter_training_run, temperature_key, training_run_info

CURVE_METRIC = "val/tau_greedy"


def suites_tau(results: Path, suites: Sequence[str], temperature: float = 0.0) -> dict | None:
    """``{suite: τ, ..., "mean": τ}`` of an evaluation's results.json, None until every suite is there."""
    doc = json.loads(results.read_text()) if results.is_file() else None
    key = temperature_key(temperature)
    if doc is None or not all(key in doc["results"].get(s, {}) for s in suites):
        return None
    taus = {s: round(float(doc["results"][s][key]["tau"]), 4) for s in suites}
    return {**taus, "mean": round(statistics.fmean(taus.values()), 4)}


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

    def drafted_width(self) -> int | None:
        """The most slots one step drafts: a chain's W (``max_draft_tokens``), a tree's deepest path (its chain
        width or N nodes), or a hybrid's lookup depth where deeper; None where the record does not say (every slot
        of its K counts)."""
        drafter = self.doc.get("drafter") or {}
        config = drafter.get("config") or {}
        tree = config.get("tree_policy")
        if tree is None:
            return config.get("max_draft_tokens")
        own = (tree.get("chain_width") or tree.get("budget") or 0) if drafter.get("path") else 0
        return max(own, (tree.get("lookup_depth") or 0) if config.get("lookup") else 0) or None

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


def _json_or_none(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def training_budget(run: Run) -> dict | None:
    """``{"steps", "train_seconds"}`` a trained drafter had in all: a shipped drafter's card (``card.json``; a
    continuation's totals), else its training run's ``train_summary.json``; None where neither says (baselines)."""
    drafter_path = (run.doc.get("drafter") or {}).get("path")
    card = _json_or_none(Path(drafter_path) / "card.json") if drafter_path else None
    training = (card or {}).get("training") or {}
    if training.get("steps"):
        return shipped_budget(training)
    for folder in run.training_dirs():
        summary = _json_or_none(folder / "train_summary.json") or {}
        if summary.get("steps"):
            return {"steps": summary["steps"], "train_seconds": summary.get("train_seconds")}
    return None


def auto_name(path: Path, doc: dict) -> tuple[str, Any]:
    """``(name, seed)``: the drafter's own name (baselines: ``prompt_lookup``, ``ar_assistant``; a trained drafter
    evaluated with ``drafter.name=...``, with its training run's seed), else the loss choice beside the results or
    of the drafter's training run, else the dir name."""
    drafter = doc.get("drafter") or {}
    # the drafter's training run where its record lacks it (a snapshot evaluated before records found its run)
    look_up = (drafter.get("training_run") or {}).get("seed") is None and drafter.get("path")
    run = (drafter_training_run(drafter["path"]) if look_up else None) or drafter.get("training_run") or {}
    if drafter.get("name"):
        return str(drafter["name"]), run.get("seed")
    for info in (training_run_info(path.parent) or {}, run):
        if info.get("loss"):
            return info["loss"], info.get("seed")
    return path.parent.name or str(path), None


def _distinct(configs: list[str], seeds: list[Any], files: list[Path]) -> list[str]:
    """Labels for auto-named runs: a configuration found once keeps its name; repeats are told apart by
    their seed (``decay-s1``), and runs that share configuration and seed (e.g. two drafter designs trained
    with one loss into one sweep dir) by their directory (``decay (hinted-decay-s0)``)."""
    labels = []
    for name, seed, f in zip(configs, seeds, files):
        same = [s for c, s in zip(configs, seeds) if c == name]
        if len(same) == 1:
            labels.append(name)
        elif seed is not None and same.count(seed) == 1:
            labels.append(f"{name}-s{seed}")
        else:
            labels.append(f"{name} ({f.parent.name})")
    return labels


def _whole_temperatures(doc: dict, path: Path) -> dict:
    """``doc`` without the temperatures some of its suites lack (an evaluation under way, or cut): they would narrow
    every configuration's mean over suites at that temperature. Named when dropped."""
    suites = doc["results"]
    every = set.intersection(*(set(entries) for entries in suites.values())) if suites else set()
    partial = sorted({key for entries in suites.values() for key in entries} - every)
    if not partial:
        return doc
    print(f"[report] {path}: {', '.join(partial)} not evaluated on every suite yet: left out", flush=True)
    return {**doc, "results": {s: {k: e for k, e in entries.items() if k in every} for s, entries in suites.items()}}


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
        docs.append(_whole_temperatures(doc, f))
    if names is not None:
        labels = list(names)
        configs, seeds = list(names), [None] * len(names)
    else:
        auto = [auto_name(f, d) for f, d in zip(files, docs)]
        configs, seeds = [a[0] for a in auto], [a[1] for a in auto]
        labels = _distinct(configs, seeds, files)
    given = list(labels)
    for i, label in enumerate(given):  # the same name twice (given so, or equal directory names)
        if given.count(label) > 1:
            labels[i] = f"{label} #{given[: i + 1].count(label)}"
    # Seeds are only aggregated when every repeat of a configuration is told apart by its seed.
    pairs = list(zip(configs, seeds))
    for i, pair in enumerate(pairs):
        if pair[1] is None or pairs.count(pair) > 1:
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


def logged_rows(folder: Path, metric: str = CURVE_METRIC) -> list[dict[str, str]]:
    """The rows of the first CSV-logger metrics.csv in a training run folder that logs ``metric`` ([] if none)."""
    for path in [folder / "metrics.csv", folder / "logs" / "metrics.csv", *sorted(folder.glob("*/*/metrics.csv"))]:
        if not path.is_file():
            continue
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows and metric in rows[0] and any(r.get(metric) for r in rows):
            return rows
    return []


def logged_metric(folder: Path, metric: str = CURVE_METRIC) -> dict[int, float]:
    """``{step: value}`` of ``metric`` from the first CSV-logger metrics.csv in a training run folder that has it."""
    rows = logged_rows(folder, metric)
    return {int(float(r["step"])): float(r[metric]) for r in rows if r.get(metric) and r.get("step")}


def training_curve(run: Run, metric: str = CURVE_METRIC) -> tuple[list[int], list[float]] | None:
    """``(steps, values)`` of ``metric`` from the first CSV-logger metrics.csv near the run that has it."""
    for d in run.training_dirs():
        points = logged_metric(d, metric)
        if points:
            steps = sorted(points)
            return steps, [points[s] for s in steps]
    return None
