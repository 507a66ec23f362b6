"""Loading a target LM: the embedded tiny target, any local Hugging Face folder, or a hub name."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafters.locks import check_safetensors, read_json

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TINY_TARGET_DIR = ASSETS / "tiny_target"


def asset_path(name: str) -> str:
    """Absolute path of a file shipped under ``experiments/assets`` (Hydra: ``${asset:name}``)."""
    return str(ASSETS / name)


def load_target(path: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """Load a frozen causal LM and its tokenizer from a local folder or (where reachable) the hub.

    Returns ``(model, tokenizer)`` with the model in eval mode and every parameter frozen.
    """
    local = Path(os.path.expanduser(str(path)))
    looks_local = local.is_absolute() or str(path).startswith((".", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        hint = ""
        if local.resolve() == TINY_TARGET_DIR.resolve():
            hint = " (the embedded target is trained by `python -m experiments.train_target target=tiny`)"
        raise FileNotFoundError(f"target.path={path}: no Hugging Face model (config.json) there{hint}")
    if looks_local:  # a damaged file is named before transformers reads it
        read_json(local / "config.json", "target config")
        for weights in sorted(local.glob("*.safetensors")):
            check_safetensors(weights)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(
        str(local if looks_local else path), dtype=torch_dtype, trust_remote_code=trust_remote_code
    )
    tokenizer = AutoTokenizer.from_pretrained(str(local if looks_local else path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def eos_token_ids(target, tokenizer) -> list[int]:
    """EOS ids of the target's generation config plus the tokenizer's EOS (chat turns end there)."""
    config = getattr(target, "generation_config", None)
    ids = getattr(config, "eos_token_id", None) if config is not None else None
    ids = [] if ids is None else ([int(ids)] if isinstance(ids, int) else [int(i) for i in ids])
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids
