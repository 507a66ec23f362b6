"""Folders owned by one process at a time (files checked before they are trusted: :mod:`drafters.storage`).

Locks. A folder (a regenerated data dir, a feature cache, a training run dir) is owned through two files:
``<folder>/.lock.flock``, locked with the ``filelock`` package (its contents are that package's), and
``<folder>/.lock``, the owner's record ``{"pid", "pid_start", "host", "since", "argv"}``, which names the owner in
messages. The kernel drops the lock when its process dies, so a lock left behind by a killed job is free:
the next job takes it over and says whose it was (from the record it left). Released records are marked
``"released"``, never deleted. One process may take the same lock again (nested ``with``): it is counted.

* :func:`hold` with ``wait=False`` refuses (:class:`FolderBusyError`, naming the owner's pid, host
  and start time) when another process owns the folder;
* ``wait=True`` waits (polling, one message) until the owner is done, then owns it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from drafters.storage import write_json_atomic

LOCK_NAME = ".lock"  # the owner's record
KERNEL_LOCK_NAME = ".lock.flock"  # the file the kernel lock is taken on


class FolderBusyError(RuntimeError):
    """Another live process owns the folder."""


_held: dict[str, tuple[FileLock, int]] = {}  # resolved record path -> (its lock, depth) in this process


def _read_owner(path: Path) -> dict:
    try:
        text = path.read_text()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def describe_owner(owner: dict) -> str:
    if not owner:
        return "another process (owner unknown)"
    return f"pid {owner.get('pid')} on host {owner.get('host')} since {owner.get('since')}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def _start_ticks(pid) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat``); None where unknown."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; the name in () may hold spaces
    except (OSError, ValueError, TypeError, IndexError):
        return None


def _live_elsewhere(owner: dict) -> bool:
    """The record names a live process of this host other than this one, and was not released. A live process
    that started at another time than the one the record names is a later one with the same pid: not the owner."""
    if not owner or owner.get("host") != socket.gethostname() or owner.get("pid") == os.getpid() \
            or owner.get("released") or not _pid_alive(owner.get("pid")):
        return False
    recorded = owner.get("pid_start")
    return recorded is None or _start_ticks(owner["pid"]) in (None, recorded)


def _try_lock(lock: FileLock, record: Path) -> tuple[bool, dict]:
    """``(True, previous owner)`` when the lock was taken, ``(False, owner)`` when someone holds it."""
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return False, _read_owner(record)
    previous = _read_owner(record)
    if _live_elsewhere(previous):  # the file system ignores the kernel lock: trust the pid
        lock.release()
        return False, previous
    return True, previous


def _say_taken_over(what: str, folder: Path, owner: dict) -> None:
    if owner and not owner.get("released") and owner.get("pid") != os.getpid():
        state = "dead" if owner.get("host") == socket.gethostname() and not _pid_alive(owner.get("pid")) \
            else "gone"
        print(f"[lock] {what} {folder}: taking over the lock of {describe_owner(owner)} ({state}; "
              "killed before it finished)", file=sys.stderr, flush=True)


def acquire(folder: str | Path, what: str = "folder", *, wait: bool = False, poll_s: float = 1.0,
            timeout_s: float | None = None) -> Path:
    """Own ``folder`` (created if missing); see the module docstring. Returns the owner's record file."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    key = str(path.resolve())
    if key in _held:
        lock, depth = _held[key]
        _held[key] = (lock, depth + 1)
        return path
    lock = FileLock(folder / KERNEL_LOCK_NAME, thread_local=False)
    start, told = time.monotonic(), False
    while True:
        taken, owner = _try_lock(lock, path)
        if taken:
            break
        if not wait:
            raise FolderBusyError(f"{what} {folder} is in use by {describe_owner(owner)} (lock {path}); "
                                  "wait for that job to finish or stop it, or use another folder")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what} {folder}, "
                               f"in use by {describe_owner(owner)} (lock {path})")
        if not told:
            print(f"[lock] {what} {folder} is in use by {describe_owner(owner)}: waiting for it to finish",
                  file=sys.stderr, flush=True)
            told = True
        time.sleep(poll_s)
    _say_taken_over(what, folder, owner)
    write_json_atomic(path, {"pid": os.getpid(), "pid_start": _start_ticks(os.getpid()), "host": socket.gethostname(),
                             "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                             "argv": sys.argv[:8]})
    _held[key] = (lock, 1)
    return path


def release(folder: str | Path) -> None:
    """Give up one hold on ``folder`` (the last one frees it)."""
    path = Path(folder).expanduser() / LOCK_NAME
    key = str(path.resolve())
    if key not in _held:
        return
    lock, depth = _held[key]
    if depth > 1:
        _held[key] = (lock, depth - 1)
        return
    del _held[key]
    try:
        owner = _read_owner(path)
        if owner:
            write_json_atomic(path, {**owner, "released": True})
    finally:
        lock.release()


@contextmanager
def hold(folder: str | Path, what: str = "folder", *, wait: bool = False, poll_s: float = 1.0,
         timeout_s: float | None = None) -> Iterator[Path]:
    """``with hold(folder, "data folder", wait=True):`` own ``folder`` for the block."""
    path = acquire(folder, what, wait=wait, poll_s=poll_s, timeout_s=timeout_s)
    try:
        yield path
    finally:
        release(folder)


def owner(folder: str | Path) -> dict:
    """The current owner's record of ``folder`` ({} when free)."""
    info = _read_owner(Path(folder).expanduser() / LOCK_NAME)
    return {} if info.get("released") else info


__all__ = ["FolderBusyError", "acquire", "describe_owner", "hold", "owner", "release"]

