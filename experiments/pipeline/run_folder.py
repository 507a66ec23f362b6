"""A run folder's records are written only by the job that owns it, and a folder that cannot be written is
named before anything else happens.

Hydra writes ``.hydra/`` (``config.yaml``, ``hydra.yaml``, ``overrides.yaml``) before the job runs, so a job
refused afterwards (the folder is locked by another job, or a resumed run's settings differ) would leave its
own settings there, contradicting the run's weights, ``run_settings.json`` and ``results.json``.
``experiments.train`` and ``experiments.evaluate`` therefore have Hydra write them to a staging folder of the
process outside the run folder (``hydra.output_subdir: ${hydra_staging:}``, :func:`staging_dir`), and the stage
copies them into ``<run folder>/.hydra`` (:func:`commit_hydra_records`) only once it owns the folder and its
checks passed; a job that ends before that leaves the folder as it was (:func:`discard_hydra_records`). The job's
log file is staged alike (``<staging folder>.<job name>.log``) and moved to ``<run folder>/<job name>.log`` (appended
to the owner's) at the same point, its handler then writing there.

:class:`RunFolderCheck` (a Hydra callback of every entry point, ``conf/run_dirs.yaml``) refuses a run folder that
cannot be written before Hydra configures its log file there, with one line naming the folder and the permission,
and a run name that is a path (``name=../../x``: :func:`experiments.pipeline.paths.run_name_problem`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from drafters.locks import FolderBusyError
from experiments.pipeline.paths import run_name_problem

HYDRA_RECORDS = ".hydra"
_PREEXISTING: set[Path] = set()  # run folders that existed before this process's Hydra job started


def staging_dir() -> str:
    """Where Hydra writes this process's job records until the job owns its run folder (the ``${hydra_staging:}``
    resolver): a folder of this user, host and process under the system's temporary folder. Its parent
    (``blockdraft-hydra-<uid>``, where the job log is staged beside it) is created here, so that Hydra can open
    the staged log on a machine that never ran a job before."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    parent = Path(tempfile.gettempdir()) / f"blockdraft-hydra-{uid}"
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(parent / f"{socket.gethostname()}-{os.getpid()}")


def temp_problem() -> str | None:
    """Why the temporary folder cannot hold the staged records (one line naming ``$TMPDIR``), or None.
    Python would silently fall back to another folder when ``$TMPDIR`` is unusable; a job says so instead."""
    chosen = os.environ.get("TMPDIR")
    if not chosen:
        return None
    folder = Path(chosen)
    if not folder.is_dir():
        return f"TMPDIR={chosen} is not a folder: create it or point TMPDIR at a writable folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return (f"TMPDIR={chosen} is not writable ({_mode(folder)}): make it writable or point TMPDIR at a "
                "writable folder")
    return None


def _staged_for(run_dir: Path, require_records: bool = True) -> Path | None:
    """The staged records of the current Hydra job when ``run_dir`` is its output folder, else None (no Hydra job,
    records written in place or not at all, or another folder, e.g. an evaluation a training job runs elsewhere).
    ``require_records=False``: the staging folder whether or not this job writes records there (DDP workers)."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    output_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None)
    subdir = OmegaConf.select(hydra_cfg, "output_subdir", default=None)
    if output_dir is None or Path(output_dir).resolve() != Path(run_dir).expanduser().resolve():
        return None
    if subdir is None:
        return None if require_records else Path(staging_dir())
    staged = (Path(output_dir) / str(subdir)).resolve()
    return staged if staged == Path(staging_dir()).resolve() else None


def commit_hydra_records(run_dir: str | Path) -> None:
    """Copy the current job's staged Hydra records into ``<run_dir>/.hydra`` (each file replaced atomically) and
    drop the staging folder. Call it once the job owns ``run_dir`` and its checks passed; a no-op otherwise."""
    staged = _staged_for(Path(run_dir))
    if staged is None or not staged.is_dir():
        return
    target = Path(run_dir) / HYDRA_RECORDS
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(staged.iterdir()):
        if path.is_file():
            tmp = target / f".{path.name}.{os.getpid()}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, target / path.name)
    shutil.rmtree(staged, ignore_errors=True)


def _staged_logs() -> list[logging.FileHandler]:
    """The file handlers of the root logger writing into this process's staged job logs."""
    prefix = Path(staging_dir()).name + "."
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
            and Path(h.baseFilename).parent == Path(staging_dir()).parent and Path(h.baseFilename).name.startswith(prefix)]


def commit_job_log(run_dir: str | Path) -> None:
    """Append this job's staged log to ``<run_dir>/<job name>.log`` and point its handler there (every rank of a
    job calls it once the job owns ``run_dir``); a no-op when the log is written in place."""
    if _staged_for(Path(run_dir), require_records=False) is None:
        return
    for handler in _staged_logs():
        staged = Path(handler.baseFilename)
        dest = Path(run_dir) / staged.name[len(Path(staging_dir()).name) + 1:]
        handler.acquire()
        try:
            handler.flush()
            with open(dest, "ab") as out:
                out.write(staged.read_bytes() if staged.is_file() else b"")
            old, handler.baseFilename = handler.stream, str(dest.absolute())
            handler.stream = open(dest, "a", encoding=handler.encoding or "utf-8")  # noqa: SIM115 (the handler's)
            if old is not None:
                old.close()
            staged.unlink(missing_ok=True)
        finally:
            handler.release()


def discard_hydra_records() -> None:
    """Drop this process's staged Hydra records and job log (a job that ended before owning its run folder)."""
    shutil.rmtree(staging_dir(), ignore_errors=True)
    for handler in _staged_logs():
        Path(handler.baseFilename).unlink(missing_ok=True)


def _remove_if_ours_and_empty() -> None:
    """Remove the Hydra job's run folder when this job created it (Hydra does, before the job starts) and it
    holds nothing but its released lock file: a refused job leaves no folder behind."""
    if not HydraConfig.initialized():
        return
    folder = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)
    if folder is None or Path(folder).resolve() in _PREEXISTING or not Path(folder).is_dir():
        return
    inside = list(Path(folder).iterdir())
    if all(p.is_file() and p.name.startswith(".lock") for p in inside):
        with contextlib.suppress(OSError):  # something arrived meanwhile: leave it
            for path in inside:
                path.unlink()
            Path(folder).rmdir()


# What a job refuses with (bad settings or input, a busy or damaged folder, a serving endpoint that is down or
# answers wrongly): one line, not a traceback.
REFUSALS = (ValueError, KeyError, FileNotFoundError, PermissionError, TimeoutError, ConnectionError, FolderBusyError)
# Loggers that do not propagate to the root logger (their own terminal handler) but belong in the job log.
OWN_HANDLER_LOGGERS = ("lightning.pytorch", "lightning.fabric")


class _Tee(io.TextIOBase):
    """A terminal stream whose writes also go to the job's log files (each handler's current stream, which
    :func:`commit_job_log` moves from the staging folder to the run folder)."""

    def __init__(self, stream, handlers: list[logging.FileHandler]):
        self.stream, self.handlers = stream, handlers

    def write(self, text: str) -> int:
        self.stream.write(text)
        if "\r" in text:  # a progress bar redrawing its line: the terminal's, not the log's
            return len(text)
        for handler in self.handlers:
            with contextlib.suppress(ValueError, OSError):  # a handler closed at exit
                handler.acquire()
                try:
                    if handler.stream is not None:
                        handler.stream.write(text)
                finally:
                    handler.release()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        for handler in self.handlers:
            with contextlib.suppress(ValueError, OSError):
                handler.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ... of the terminal stream
        return getattr(self.stream, name)


@contextlib.contextmanager
def _messages_in_job_log():
    """While the job runs, what it prints and what Lightning logs also reach its log file (staged, then
    ``<run folder>/<job name>.log``), not only the terminal."""
    handlers = _staged_logs() or [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not handlers:
        yield
        return
    own = [logger for logger in map(logging.getLogger, OWN_HANDLER_LOGGERS) if not logger.propagate]
    for logger in own:
        for handler in handlers:
            logger.addHandler(handler)
    old, sys.stdout = sys.stdout, _Tee(sys.stdout, handlers)
    try:
        yield
    finally:
        sys.stdout = old
        for logger in own:
            for handler in handlers:
                logger.removeHandler(handler)


@contextlib.contextmanager
def job():
    """Run an entry point's job. What it prints joins its log file. A refusal (:data:`REFUSALS`) leaves the run
    folder as it was when the job did not own it yet (staged records dropped, a folder this job created and left
    empty removed) and exits with one line, ``error: <message>``; ``HYDRA_FULL_ERROR=1`` shows the traceback."""
    try:
        with _messages_in_job_log():
            yield
    except REFUSALS as e:
        discard_hydra_records()
        _remove_if_ours_and_empty()
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.exit(f"error: {e} (HYDRA_FULL_ERROR=1 shows the traceback)")


def _mode(path: Path) -> str:
    info = path.stat()
    return f"mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}"


def unwritable(folder: str | Path) -> str | None:
    """Why a job could not write its run folder ``folder`` (one line: the folder and the permission), or None.
    A missing folder is judged by its nearest existing parent, where it would be created."""
    folder = Path(os.path.expanduser(str(folder))).absolute()
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    me = f"uid {os.getuid()}" if hasattr(os, "getuid") else "this user"
    if not existing.is_dir():
        return f"run folder {folder} cannot be created: {existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = f"run folder {folder}" if existing == folder else f"run folder {folder} cannot be created: {existing}"
        return (f"{what} is not writable ({_mode(existing)}; this job runs as {me}): permission denied. "
                "Make it writable or choose another folder (hydra.run.dir=..., $BLOCKDRAFT_RUNS)")
    for inside in (folder / HYDRA_RECORDS, *sorted(folder.glob("*.log"))):
        if inside.exists() and not os.access(inside, os.W_OK | (os.X_OK if inside.is_dir() else 0)):
            return (f"run folder {folder}: {inside.name} is not writable ({_mode(inside)}; this job runs as {me}): "
                    "permission denied. Make it writable or choose another folder (hydra.run.dir=...)")
    return None


def _run_name_problem(config: DictConfig) -> str | None:
    """Why the run name (``name``, read by ``conf/train.yaml``'s run folder) is not one, or None: its value, and
    each value a multirun sweeps it over (``name=a,b``)."""
    values = [] if OmegaConf.is_missing(config, "name") else [OmegaConf.select(config, "name", default=None)]
    for override in OmegaConf.select(config, "hydra.overrides.task", default=None) or []:
        key, sep, value = str(override).partition("=")
        if sep and key.lstrip("+~") == "name":
            values += value.split(",")  # a sweep's values (a value with no '/' or '..' stays so when split)
    return next((p for p in (run_name_problem(v) for v in values if v is not None) if p), None)


class RunFolderCheck(Callback):
    """Hydra callback: exit with one line naming the run folder and the permission when it cannot be written,
    before Hydra creates it, configures its log file there or writes its records (``conf/run_dirs.yaml``)."""

    @staticmethod
    def _check(config: DictConfig, key: str) -> None:
        HydraConfig.instance().set_config(config)  # the name and folder may read ${hydra:...}: this job's, set early
        problem = _run_name_problem(config)  # the folder's name may read it: checked before the folder exists
        if problem:
            sys.exit(f"error: {problem}")
        folder = OmegaConf.select(config, key, default=None)
        problem = temp_problem() or (unwritable(folder) if folder is not None else None)
        if problem:
            sys.exit(f"error: {problem}")
        if folder is not None and Path(folder).expanduser().exists():
            _PREEXISTING.add(Path(folder).expanduser().resolve())

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config, "hydra.sweep.dir")
