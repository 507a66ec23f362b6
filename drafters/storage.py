"""Files checked before they are trusted, and written so that a killed job never leaves half of one.

:func:`read_json`, :func:`check_safetensors` and :func:`read_checkpoint` raise :class:`DamagedFileError` naming the
file (never advising to load it unsafely); :func:`write_json_atomic` renames a finished file into place;
:func:`sha256_file` and :func:`file_digest` are the content hashes that records and model cards carry.

Sealed files (caches that are read back later, e.g. the T=0 replay's greedy answers): :func:`write_sealed_json`
writes the file and then its seal beside it, ``<name>.sha256`` (``sha256sum``'s format, so ``sha256sum -c`` checks
it too); :func:`read_sealed_json` reads the file only when its sha256 is the sealed one, else raises
:class:`BrokenSealError` naming the file and both hashes (an edited or truncated file), or the missing seal. A hash
once checked is remembered for the file's (size, mtime), so reading an unchanged file again hashes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch


class DamagedFileError(ValueError):
    """A file exists but cannot be read as what it should be (truncated, garbage)."""


def read_json(path: str | Path, what: str = "JSON file") -> dict:
    """``json.loads`` of a file, or :class:`DamagedFileError` naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedFileError(f"{what} {path} is damaged (not valid JSON: {e}); restore or re-create it") from e


def check_safetensors(path: str | Path) -> None:
    """Refuse a truncated or garbage ``.safetensors`` file (header and sizes checked, not the values)."""
    path = Path(path)
    size = path.stat().st_size
    reason = None
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                reason = f"{size} bytes, shorter than the header"
            else:
                n = struct.unpack("<Q", head)[0]
                if n > size - 8:
                    reason = f"the header claims {n} bytes, the file has {size}"
                else:
                    header = json.loads(f.read(n))
                    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                              default=0)
                    if 8 + n + end > size:
                        reason = f"the tensors need {8 + n + end} bytes, the file has {size} (truncated)"
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        reason = f"unreadable header ({type(e).__name__})"
    if reason:
        raise DamagedFileError(f"weights file {path} is damaged: {reason}; restore or re-create it")


def check_model_weights(folder: str | Path) -> None:
    """Check a Hugging Face model folder's weights before transformers reads them: every ``*.safetensors`` file
    (:func:`check_safetensors`), or, in a folder with none, every pickled ``*.bin`` loaded as tensors only
    (``weights_only``): a truncated file, or a pickle that holds more than tensors (code torch refuses to run), is
    named in one line instead of transformers' traceback, which names no file."""
    folder = Path(folder)
    safetensors = sorted(folder.glob("*.safetensors"))
    for weights in safetensors:
        check_safetensors(weights)
    for weights in [] if safetensors else sorted(folder.glob("*.bin")):
        try:
            torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            cause = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), "")
            raise DamagedFileError(
                f"weights file {weights} is a pickle that holds more than tensors ({cause[:160] or type(e).__name__}): "
                "blockdraft reads pickled weights as tensors only and never runs what a pickle names; use the model "
                "saved as model.safetensors (save_pretrained writes it)") from None
        except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as e:
            raise DamagedFileError(f"weights file {weights} cannot be read ({type(e).__name__}): it is damaged (e.g. "
                                   "truncated); restore or re-create it") from None


def read_checkpoint(path: str | Path, required: Sequence[str] = ("state_dict", "global_step")) -> dict:
    """A Lightning checkpoint loaded with ``weights_only=True``, or :class:`DamagedFileError` naming it."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError,
            AttributeError, ImportError, KeyError, IndexError) as e:
        raise DamagedFileError(f"checkpoint {path} cannot be read ({type(e).__name__}): the file is damaged "
                               f"(e.g. written by a job killed mid-save). Move it away to start the run over, "
                               f"or restore it; nothing in the run was changed") from None
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise DamagedFileError(f"checkpoint {path} lacks {missing}: not a checkpoint of this trainer, or "
                               "damaged; move it away to start the run over")
    return ckpt


class BrokenSealError(DamagedFileError):
    """A sealed file whose bytes are not those sealed (edited, truncated), or whose seal is missing or unreadable."""


SEAL_SUFFIX = ".sha256"
_CHECKED: dict[tuple, str] = {}  # (path, inode, size, mtime_ns) -> sha256 of a file hashed in this process


def seal_path(path: str | Path) -> Path:
    """Where the seal of ``path`` lives: ``<path>.sha256`` beside it."""
    path = Path(path)
    return path.with_name(path.name + SEAL_SUFFIX)


def sha256_checked(path: str | Path) -> str:
    """:func:`sha256_file`, remembered for the file's (size, mtime): an unchanged file is hashed once per process."""
    path = Path(path)
    info = path.stat()
    key = (str(path.resolve()), info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _CHECKED:
        _CHECKED[key] = sha256_file(path)
    return _CHECKED[key]


def write_seal(path: str | Path) -> str:
    """Seal the finished file ``path``: its sha256 written (atomically) to :func:`seal_path`; returns the hash."""
    path = Path(path)
    digest = sha256_file(path)
    seal = seal_path(path)
    tmp = seal.with_name(f".{seal.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{digest}  {path.name}\n")
    os.replace(tmp, seal)
    return digest


def check_seal(path: str | Path, what: str = "file") -> None:
    """Refuse ``path`` unless its sha256 is the one its seal records (:class:`BrokenSealError`, one line naming the
    file and both hashes, or the missing seal)."""
    path, seal = Path(path), seal_path(path)
    try:
        recorded = seal.read_text().split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        raise BrokenSealError(f"{what} {path} has no readable seal {seal.name} (written by an older blockdraft, or "
                              "by a job killed before sealing it): it cannot be checked") from None
    found = sha256_checked(path)
    if found != recorded:
        raise BrokenSealError(f"{what} {path} has sha256 {found} but its seal {seal.name} records {recorded}: the "
                              "file was edited or truncated after it was written")


def seal_entry(path: str | Path) -> dict:
    """A large file's seal kept in a record (e.g. a feature cache's ``meta.json``): its sha256, and its size and
    mtime when sealed, so that :func:`check_seal_entry` re-hashes it only when either changed."""
    path = Path(path)
    info = path.stat()
    return {"sha256": sha256_checked(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def check_seal_entry(path: str | Path, entry: dict, what: str = "file") -> None:
    """Refuse ``path`` unless it is the file ``entry`` (:func:`seal_entry`) sealed: a file of the recorded size and
    mtime is taken as sealed without reading it (cheap for large caches); another is hashed, and one whose sha256
    differs raises :class:`BrokenSealError` naming it and both hashes."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError:
        raise BrokenSealError(f"{what} {path} is missing but was sealed with sha256 {entry.get('sha256')}") from None
    if info.st_size == entry.get("size") and info.st_mtime_ns == entry.get("mtime_ns"):
        return
    found = sha256_checked(path)
    if found != entry.get("sha256"):
        raise BrokenSealError(f"{what} {path} has sha256 {found} but was sealed with {entry.get('sha256')}: the file "
                              "was edited or truncated after it was written")


def write_sealed_json(path: str | Path, obj) -> None:
    """:func:`write_json_atomic`, then the file's seal (:func:`write_seal`); a stale seal is removed first, so a job
    killed in between leaves a file without a seal (refused when read), never a file with another's seal."""
    seal_path(path).unlink(missing_ok=True)
    write_json_atomic(path, obj)
    write_seal(path)


def read_sealed_json(path: str | Path, what: str = "JSON file") -> dict:
    """The JSON of a file written by :func:`write_sealed_json`, checked against its seal first
    (:class:`BrokenSealError` when it is not the sealed file)."""
    check_seal(path, what)
    return read_json(path, what)


def write_json_atomic(path: str | Path, obj) -> None:
    """Write ``obj`` as JSON to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename: a machine that goes down leaves the old file or the new
    os.replace(tmp, path)


def file_digest(paths: Sequence[str | Path]) -> str:
    """sha256 over the names and bytes of ``paths`` (the content hash of a model's weights)."""
    h = hashlib.sha256()
    for p in sorted(Path(p) for p in paths):
        h.update(p.name.encode() + b"\0")
        _hash_bytes(h, p)
    return h.hexdigest()


def _hash_bytes(h, path: str | Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes (``sha256sum`` gives the same)."""
    h = hashlib.sha256()
    _hash_bytes(h, path)
    return h.hexdigest()


__all__ = ["BrokenSealError", "DamagedFileError", "check_model_weights", "check_safetensors", "check_seal",
           "check_seal_entry", "file_digest", "read_checkpoint", "read_json", "read_sealed_json", "seal_entry",
           "seal_path", "sha256_checked", "sha256_file", "write_json_atomic",
           "write_seal", "write_sealed_json"]
