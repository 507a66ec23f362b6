"""Paths as committed files write them: relative to the repository or a run folder, regenerated data
as ``$BLOCKDRAFT_CACHE/...``, so that no record carries one machine's folders."""

from __future__ import annotations

import os
from pathlib import Path

from experiments.data.suites import DEFAULT_CACHE, cache_dir

REPO = Path(__file__).resolve().parents[2]  # the repository (or the installed packages' folder)


def inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def run_name_problem(value, key: str = "name") -> str | None:
    """Why ``value`` cannot be the run name ``key`` (one line: the key, the value and what to do), or None. A run
    name is one folder name: no path separator, not ``.`` or ``..`` (``name=../../x`` would write outside the
    runs' folder)."""
    text = str(value)
    if text.strip() and "/" not in text and "\\" not in text and text not in (".", "..") and "\0" not in text:
        return None
    return (f"{key}={text} is not a run name: it must be one folder name (no '/' or '\\', not '.' or '..', not "
            f"empty); choose a plain name such as {key}=my-run (where runs go: $BLOCKDRAFT_RUNS or hydra.run.dir)")


def portable_path(path: str | Path, *folders: Path | None) -> str:
    """``path`` relative to the repository when inside it, else to the first of ``folders`` (the runs'
    folder, ...) holding it; otherwise as given. Committed reports then carry no machine's folders."""
    full = Path(os.path.expanduser(str(path))).resolve()
    for folder in (REPO, *folders):
        if folder is not None and inside(full, folder):
            return full.relative_to(folder).as_posix() or "."
    return str(path)


def cache_path(path: str | Path) -> str:
    """A path inside the blockdraft cache (regenerated data) as ``$BLOCKDRAFT_CACHE/...``; others as given."""
    full = Path(os.path.expanduser(str(path))).resolve()
    for folder in dict.fromkeys([cache_dir().resolve(), Path(DEFAULT_CACHE).expanduser().resolve()]):
        if inside(full, folder):
            return "/".join(["$BLOCKDRAFT_CACHE", *full.relative_to(folder).parts])
    return str(path)


def runs_path(path: str | Path) -> str:
    """A path inside the repository as relative to it; inside ``$BLOCKDRAFT_RUNS`` as ``$BLOCKDRAFT_RUNS/...``;
    others as given."""
    full = Path(os.path.expanduser(str(path))).resolve()
    runs = os.environ.get("BLOCKDRAFT_RUNS")
    if not inside(full, REPO) and runs and inside(full, Path(runs).expanduser().resolve()):
        return "/".join(["$BLOCKDRAFT_RUNS", *full.relative_to(Path(runs).expanduser().resolve()).parts])
    return portable_path(path)


def record_path(path: str | Path | None) -> str | None:
    """A path as a committed record names it: relative to the repository, ``$BLOCKDRAFT_RUNS/...`` or
    ``$BLOCKDRAFT_CACHE/...``, else ``.../`` and its last three parts (no machine's folders)."""
    if path is None:
        return None
    named = cache_path(runs_path(str(path)))
    return named if not Path(named).is_absolute() else ".../" + "/".join(Path(named).parts[-3:])


def portable_override(override: str) -> str:
    """``key=value`` with a value that names an existing file or folder written as committed records write paths
    (``$BLOCKDRAFT_CACHE/...`` inside the data cache); several overrides joined by spaces, each so."""
    if " " in override:
        return " ".join(portable_override(o) for o in override.split(" ") if o)
    key, sep, value = override.partition("=")
    return f"{key}={portable_value(value)}" if sep else override


def portable_value(value: str) -> str:
    """A value naming an existing file or folder, or an absolute path in an existing folder (a file about to be
    written), as committed records write paths (``$BLOCKDRAFT_CACHE/...``, ``$BLOCKDRAFT_RUNS/...``); other values
    as given."""
    path = Path(value).expanduser() if value else None
    if path is None or not (path.exists() or (path.is_absolute() and path.parent.is_dir())):
        return value
    cached = cache_path(value)
    return cached if cached != value else runs_path(value)
