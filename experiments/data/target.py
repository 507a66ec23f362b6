"""Loading a target LM: the embedded tiny target, any local Hugging Face folder, or a hub name."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafters.checks import check_target_config
from drafters.storage import check_model_weights, read_json

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TINY_TARGET_DIR = ASSETS / "tiny_target"


def asset_path(name: str) -> str:
    """Absolute path of a file shipped under ``experiments/assets`` (Hydra: ``${asset:name}``)."""
    return str(ASSETS / name)


#: the ar_assistant shipped for each target of conf/target/ (its asset folder), trained on that target's answers
SHIPPED_ASSISTANTS = {"tiny": "ar_assistant", "smollm2": "ar_assistant_smollm2"}


def shipped_assistant(target_name: str) -> str:
    """The folder of the ar_assistant shipped for the target named ``target_name`` (Hydra:
    ``${assistant_for:${target.name}}``, ``conf/eval/drafter/ar_assistant.yaml``); a target without one is refused,
    naming what to give instead."""
    if target_name in SHIPPED_ASSISTANTS:
        return asset_path(SHIPPED_ASSISTANTS[target_name])
    shipped = ", ".join(f"experiments/assets/{a} for target={t}" for t, a in SHIPPED_ASSISTANTS.items())
    raise ValueError(f"drafter=ar_assistant: no assistant is shipped for target={target_name}; give drafter.path=<a "
                     f"Hugging Face causal LM folder with the target's vocabulary> (shipped: {shipped})")


def target_signature(path: str) -> dict:
    """What identifies a target's files wherever they lie (a moved or re-cloned folder keeps it): config.json's
    sha1 and, per ``*.safetensors`` file, its size and the sha1 of its first and last MiB (the header and the
    first and last tensors' bytes, which retraining changes). A hub name (no such folder) is its own signature."""
    root = Path(os.path.expanduser(str(path)))
    if not root.is_dir():
        return {"path": str(path)}
    sig: dict = {}
    if (root / "config.json").is_file():
        sig["config_sha1"] = hashlib.sha1((root / "config.json").read_bytes()).hexdigest()
    sig["weights"] = {p.name: [p.stat().st_size, _ends_sha1(p)] for p in sorted(root.glob("*.safetensors"))}
    return sig


def signature_matches(recorded: dict, path: str) -> bool:
    """Whether a recorded :func:`target_signature` names the target files at ``path``. A signature recorded before
    signatures left out the folder (it holds ``path`` beside ``weights``: sizes and mtimes) is compared on
    config.json's sha1 and the weight files' names and sizes."""
    now = target_signature(path)
    if recorded == now:
        return True
    if "path" in recorded and "weights" in recorded and "path" not in now:
        def sizes(sig):
            return {name: entry[0] for name, entry in sig.get("weights", {}).items()}
        return recorded.get("config_sha1") == now.get("config_sha1") and sizes(recorded) == sizes(now)
    return False


def target_id(path: str) -> str:
    """A short hash of :func:`target_signature` (Hydra: ``${target_id:${target.path}}``, in cache folder names)."""
    return hashlib.sha1(json.dumps(target_signature(path), sort_keys=True).encode()).hexdigest()[:12]


def target_depth(path: str) -> int:
    """The target's number of layers, ``num_hidden_layers`` of its config (Hydra: ``${target_depth:${target.path}}``,
    e.g. a drafter with every one of the target's layers). A local folder's config.json, else the hub's."""
    local = Path(os.path.expanduser(str(path)))
    if (local / "config.json").is_file():
        config = read_json(local / "config.json", "target config")
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path)).to_dict()
    depth = config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"target.path={path}: its config has no num_hidden_layers (got {depth!r}); "
                         "set drafter.num_layers yourself")
    return depth


def _ends_sha1(path: Path, size: int = 1 << 20) -> str:
    with open(path, "rb") as f:
        head = f.read(size)
        f.seek(max(path.stat().st_size - size, len(head)))
        return hashlib.sha1(head + f.read(size)).hexdigest()


def load_target(path: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """Load a frozen causal LM and its tokenizer from a local folder or (where reachable) the hub.

    Returns ``(model, tokenizer)`` with the model in eval mode and every parameter frozen.
    """
    model, where = load_target_model(path, dtype, device, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(where)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_target_model(path: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """``(model, where)``: the frozen causal LM of :func:`load_target` without its tokenizer, and the folder or
    hub name it was read from. A local folder's files are checked first: a damaged file or a wrongly typed field
    of config.json is named."""
    local = Path(os.path.expanduser(str(path)))
    looks_local = local.is_absolute() or str(path).startswith((".", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        hint = ""
        if local.resolve() == TINY_TARGET_DIR.resolve():
            hint = " (the embedded target is trained by `python -m experiments.train_target target=tiny`)"
        raise FileNotFoundError(f"target.path={path}: no Hugging Face model (config.json) there{hint}")
    if looks_local:  # a damaged file is named before transformers reads it
        check_target_config(read_json(local / "config.json", "target config"), local / "config.json")
        check_model_weights(local)  # safetensors, or pickled .bin files read as tensors only
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    where = str(local if looks_local else path)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    model.to(device).eval().requires_grad_(False)
    return model, where


def eos_token_ids(target, tokenizer) -> list[int]:
    """EOS ids of the target's generation config plus the tokenizer's EOS (chat turns end there)."""
    config = getattr(target, "generation_config", None)
    ids = getattr(config, "eos_token_id", None) if config is not None else None
    ids = [] if ids is None else ([int(ids)] if isinstance(ids, int) else [int(i) for i in ids])
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids
