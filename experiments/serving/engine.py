"""Driving vLLM from blockdraft's environment: the engine runs in its own virtual environment
(vLLM pins another transformers), as a child process group that is stopped on every exit path.

:func:`run_engines` writes one job (JSON) per engine for :mod:`experiments.serving.vllm_worker`, starts
each with the vLLM environment's Python and waits for it to come up, so that all engines are loaded at
once; then it hands out the phases in turns (phase 1 to every engine, then phase 2, …, the engine that
goes first rotating from one phase to the next), so that a machine whose load drifts slows every engine
alike and their speed ratios compare like with like. :func:`run_engine` runs one engine. Every failure is a
:class:`ServingError` that names the step: ``environment`` (no vLLM environment), ``engine start``
(the engine did not come up in time, or its process died while loading the model), ``decoding``
(it died or timed out while decoding) or ``metrics`` (see :mod:`experiments.serving.check`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_VARIABLE = "BLOCKDRAFT_VLLM_ENV"  # where the vLLM environment is; default REPO_ROOT/.venv-vllm
INSTALL_COMMAND = "bash experiments/serving/install_vllm.sh"
WORKER = Path(__file__).with_name("vllm_worker.py")
GENERATE_WORKER = Path(__file__).with_name("vllm_generate_worker.py")  # regeneration (VLLMBackend)


class ServingError(RuntimeError):
    """A serving step that failed; ``step`` names it."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"[{step}] {message}")
        self.step = step


def vllm_env_dir(path: str | os.PathLike | None = None) -> Path:
    """The vLLM environment: ``path``, else ``$BLOCKDRAFT_VLLM_ENV``, else ``.venv-vllm`` in the repository."""
    chosen = path or os.environ.get(ENV_VARIABLE) or REPO_ROOT / ".venv-vllm"
    chosen = Path(chosen).expanduser()
    return chosen if chosen.is_absolute() else REPO_ROOT / chosen


def vllm_python(path: str | os.PathLike | None = None) -> Path:
    """The vLLM environment's interpreter; :class:`ServingError` (step ``environment``) when there is none."""
    env = vllm_env_dir(path)
    python = env / "bin" / "python"
    if not python.is_file():
        raise ServingError("environment", f"no vLLM environment at {env} ({python} missing); create it with "
                                          f"`{INSTALL_COMMAND} {env}` or point {ENV_VARIABLE} at one")
    if not any((env / "lib").glob("python3*/site-packages/vllm/__init__.py")):
        raise ServingError("environment", f"{env} has no vllm package; create it with `{INSTALL_COMMAND} {env}`")
    return python


def stop(proc: subprocess.Popen) -> None:
    """Stop the worker's whole process group (the engine's own processes included)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group, if any
    except ProcessLookupError:
        pass


def tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-chars:]


def wait_for(proc, until, deadline: float, log: Path, step: str, what: str) -> None:
    """Poll until ``until()`` holds; ServingError ``step`` when the worker exits first or ``deadline`` passes."""
    while not until():
        if proc.poll() is not None:
            raise ServingError(step, f"the vLLM worker exited with code {proc.returncode} {what}; its log "
                                     f"ends:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise ServingError(step, f"timed out {what}; the worker's log ends:\n{tail(log)}")
        time.sleep(0.5)


def engine_environment(threads: int | None, kv_cache_gb: int, threads_bind: str | None = None) -> dict[str, str]:
    """The worker's environment. ``threads_bind``: VLLM_CPU_OMP_THREADS_BIND (vLLM's default ``auto`` pins its
    threads to cores; ``nobind`` lets them move, which a machine shared with other jobs needs)."""
    env = dict(os.environ)
    if threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb)))  # vLLM reads an int (GiB)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # The engine core in the worker's own process: vLLM is imported once, not in three processes.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def launch(python: Path, job: dict, tmp: Path, env: dict[str, str], worker: Path = WORKER
           ) -> tuple[subprocess.Popen, Path]:
    """Start ``worker`` (a script of the vLLM environment) on ``job`` in ``tmp``, in its own process group;
    the process and its log file."""
    (tmp / "job.json").write_text(json.dumps(job))
    log = tmp / "worker.log"
    with log.open("w") as log_file:
        proc = subprocess.Popen([str(python), str(worker), str(tmp / "job.json")], stdout=log_file,
                                stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True, env=env)
    return proc, log


def turn_order(names: list[str], phase: int) -> list[str]:
    """The engines' order in ``phase``: rotated by one from each phase to the next."""
    shift = phase % len(names)
    return names[shift:] + names[:shift]


def run_engines(jobs: dict[str, dict], *, env_dir: str | os.PathLike | None = None, start_timeout: float = 300,
                run_timeout: float = 1800, threads: int | None = None, kv_cache_gb: int = 2,
                threads_bind: str | None = None, workdir: str | os.PathLike | None = None) -> dict[str, dict]:
    """Run every job of ``{name: job}`` (see :mod:`experiments.serving.vllm_worker`) with its phases
    interleaved (module doc); ``{name: result}``.

    ``start_timeout``: seconds for each engine to load its model; ``run_timeout``: seconds for each engine's
    phases together (its own turns only: waiting for the other engines does not count). Every worker's process
    group is stopped whatever happens (errors, timeouts, Ctrl-C).
    """
    python = vllm_python(env_dir)
    env = engine_environment(threads, kv_cache_gb, threads_bind)
    with tempfile.TemporaryDirectory(prefix="vllm-jobs-", dir=workdir) as root, contextlib.ExitStack() as stack:
        workers = {}
        for name, job in jobs.items():
            tmp = Path(root) / name
            tmp.mkdir()
            files = {"ready_file": str(tmp / "ready"), "out": str(tmp / "result.json"), "turns_dir": str(tmp)}
            proc, log = launch(python, {**job, **files}, tmp, env)
            stack.callback(stop, proc)
            workers[name] = (proc, log, tmp)
            wait_for(proc, (tmp / "ready").is_file, time.monotonic() + start_timeout, log, "engine start",
                  f"before the engine started (limit {start_timeout:.0f} s, model {job['model']}, engine {name})")
        left = dict.fromkeys(jobs, float(run_timeout))  # each engine's own decoding time still allowed
        for phase in range(max(len(job.get("phases", [])) for job in jobs.values())):
            for name in turn_order(list(jobs), phase):
                if phase < len(jobs[name].get("phases", [])):
                    proc, log, tmp = workers[name]
                    start = time.monotonic()
                    (tmp / f"go_{phase}").write_text("")
                    wait_for(proc, (tmp / f"done_{phase}").is_file, start + left[name], log, "decoding",
                          f"before engine {name} finished phase {phase} (limit {run_timeout:.0f} s for its phases)")
                    left[name] -= time.monotonic() - start
        results = {}
        for name, (proc, log, tmp) in workers.items():
            wait_for(proc, (tmp / "result.json").is_file, time.monotonic() + max(left[name], 30.0), log, "decoding",
                  f"before engine {name} wrote its result (limit {run_timeout:.0f} s for its phases)")
            results[name] = json.loads((tmp / "result.json").read_text())
            results[name]["log_tail"] = tail(log, 2000)
        return results


def run_engine(job: dict, **settings) -> dict:
    """Run one engine's ``job``; its result. ``settings``: those of :func:`run_engines`."""
    return run_engines({"engine": job}, **settings)["engine"]
