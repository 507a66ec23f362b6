"""Run records: what a stage writes about itself and reads about the stages before it.

* ``results.json`` (written by :mod:`experiments.pipeline.evaluation`): its format number, the settings
  that must agree for a resume (:func:`check_resumable`), the target's description, the suites'
  digests, the git commit, the metric names sent to the logger;
* training run folders (written by :mod:`experiments.pipeline.training`): which loss, name and seed a
  run had (:func:`training_run_info`, read from ``.hydra/`` and ``train_summary.json``);
* any script's JSON record (:func:`write_record`: the machine it ran on, the paths it names written portably).
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from drafters.config import target_fingerprint
from drafters.storage import write_json_atomic
from experiments.data.suites import Prompt
from experiments.pipeline.paths import portable_override, portable_value

RESULTS_FORMAT = 1
# Settings that change the numbers: a run dir's results.json is only resumed when these agree.
GENERATION_KEYS = ("top_k", "top_p", "max_new_tokens", "batch_size", "max_prompt_tokens", "use_chat_template",
                   "seed", "num_bootstrap", "measure_target_only", "replay_greedy")
# Scalars of an entry sent to the logger (position acceptance goes as a1, a2, ...).
LOGGED_METRICS = ("tau", "tau_macro", "tau_ci_low", "tau_ci_high", "mean_accepted", "new_tokens",
                  "target_forwards", "spec_tokens_per_s", "target_tokens_per_s", "speedup", "greedy_match")
# What a speed depends on (of :func:`machine`): results with speeds resume only where these agree.
MACHINE_KEYS = ("cpu", "isa", "torch", "threads")
# Entry fields measured with a clock: they differ between runs, everything else must not.
TIMING_KEYS = ("spec_wall_time_s", "spec_tokens_per_s", "target_wall_time_s", "target_tokens_per_s", "speedup")


def temperature_key(temperature: float) -> str:
    """The results/logger key of a temperature: 0.0 -> "t0", 1.0 -> "t1", 0.7 -> "t0.7"."""
    return f"t{float(temperature):g}"


# ------------------------------------------------------------------------------------------------
# results.json


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the source tree, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def describe_target(target, path: str) -> dict:
    """The target's fingerprint (what a drafter depends on) and where it was loaded from."""
    return {**target_fingerprint(target.config), "path": str(path)}


def suite_digests(suites: Mapping[str, Sequence[Prompt]]) -> dict[str, str]:
    """Per suite, a sha256 of its prompts' ids and turns (what a resumed entry must have answered)."""
    return {name: hashlib.sha256(json.dumps([[p.id, list(p.turns)] for p in prompts]).encode()).hexdigest()
            for name, prompts in suites.items()}


def check_resumable(previous: dict, current: dict, path: Path) -> None:
    """Refuse to resume a results.json written with another drafter (config or weights: the content hash
    of its safetensors), target, suite prompts or generation settings, or, where it holds speeds, on another kind
    of machine (:data:`MACHINE_KEYS`)."""
    diffs = []
    answered = sorted(set(previous.get("results") or {}) & set(current.get("suites") or {}))  # suites to resume
    for section, keys in (("settings", GENERATION_KEYS), ("target", None),
                          ("drafter", ("kind", "config", "weights_sha256")), ("suites", answered)):
        if section == "suites" and not keys:
            continue
        old, new = previous.get(section) or {}, current.get(section) or {}
        for k in keys or sorted(set(old) | set(new)):
            if old.get(k) != new.get(k):
                diffs.append(f"{section}.{k}: {old.get(k)!r} -> {new.get(k)!r}")
    timed = any(e.get("speedup") is not None for by_key in (previous.get("results") or {}).values()
                for e in by_key.values())
    if timed:  # speeds measured on one machine are not resumed on another (τ alone is)
        old, new = previous.get("machine") or {}, current.get("machine") or {}
        diffs += [f"machine.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in MACHINE_KEYS if old.get(k) != new.get(k)]
    if diffs:
        raise ValueError(f"{path} was written by an evaluation with other settings ({'; '.join(diffs[:5])}); "
                         "resume only with the same drafter, target and generation settings, or use a new run dir")


def logged_metrics(suite: str, key: str, entry: Mapping[str, Any]) -> dict[str, float]:
    """Scalars of one entry named ``eval/<suite>/<metric>_<key>`` (position acceptance as ``a<k>``)."""
    metrics = {f"eval/{suite}/{m}_{key}": float(entry[m]) for m in LOGGED_METRICS if entry.get(m) is not None}
    for k, a in enumerate(entry.get("position_acceptance") or [], start=1):
        if a is not None:
            metrics[f"eval/{suite}/a{k}_{key}"] = float(a)
    return metrics


# ------------------------------------------------------------------------------------------------
# Training run folders


def _read_yaml(path: Path) -> Any:
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


def drafter_training_run(drafter_dir: str | Path) -> dict | None:
    """:func:`training_run_info` of the run a saved drafter came from: its folder's parent (``<run>/drafter``), or for
    a snapshot along training (``<run>/snapshots/step-<N>``) the run two levels up."""
    parent = Path(drafter_dir).parent
    return training_run_info(parent) or (training_run_info(parent.parent) if parent.name == "snapshots" else None)


def portable_argument(value):
    """A script argument (or a record of them) with the paths it names written portably: a path, ``name=path``, or a
    list or dict of them."""
    if isinstance(value, dict):
        return {k: portable_argument(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_argument(v) for v in value]
    if not isinstance(value, str):
        return value
    return portable_override(value) if "=" in value else portable_value(value)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; where there is none, what :mod:`platform` says)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else (platform.processor() or "unknown")


def machine() -> dict:
    """What a timing depends on: the platform, the CPU's model and the widest vector ISA torch's kernels use on it
    (``isa``: e.g. AVX2 or AVX512; speed ratios differ between them, not only absolute speeds), torch, threads."""
    return {"platform": platform.platform(), "cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def median_seconds(fn, reps: int = 5) -> float:
    """The median wall time of ``reps`` calls of ``fn``, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def matmul_gflops(rows: int = 1536, inner: int = 576, outer: int = 1536, device: str = "cpu") -> float:
    """A machine's yardstick: the GFLOP/s of a plain float32 matmul ``(rows, inner) @ (inner, outer)`` at the
    current thread count (the default shape: SmolLM2-135M's MLP over 4 rows of 384 tokens). Machines of one kind
    differ by up to ~3x in it, so a wall time is read beside it."""
    a, b = torch.randn(rows, inner, device=device), torch.randn(inner, outer, device=device)
    return 2 * rows * inner * outer / median_seconds(lambda: a @ b) / 1e9


def write_record(doc: dict, out: str | Path) -> dict:
    """``doc`` with ``machine`` (:func:`machine`) added and its ``overrides`` written portably
    (:func:`portable_override`), written as JSON to ``out`` (its folder made)."""

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)  # first: ``out`` itself is then written as a path
    doc = {**doc, "machine": machine()}
    if "overrides" in doc:
        doc["overrides"] = [portable_override(o) for o in doc["overrides"]]
    if isinstance(doc.get("config"), dict):  # a script's arguments: paths written as the overrides' are
        doc["config"] = {k: portable_argument(v) for k, v in doc["config"].items()}
    write_json_atomic(path, doc)  # a stop mid-write leaves the old record or none, never half of one
    return doc
