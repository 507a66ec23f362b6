"""What a drafter is loaded from, checked: the types of its saved config's fields, the types of the target
config fields blockdraft reads, and which target's weights it was trained for.

* :func:`check_fields` refuses a value whose type is not its dataclass field's annotation (``DrafterConfig``
  loaded from ``config.json``), naming the file, the field, the value and the expected type;
* :func:`check_target_config` does the same for the fields of a target's config that :mod:`drafters.config`
  reads (``hidden_size``, ``num_hidden_layers``, ``rms_norm_eps``, ...);
* :func:`target_weights_sha1` is a sha1 over the target's weights as the drafter reads them (the input
  embedding and LM head in full, plus evenly spaced rows of every other parameter), all rounded to bfloat16
  so that a target loaded in float32 or bfloat16 has one signature. A drafter records it in its
  ``target_fingerprint`` (:data:`WEIGHTS_KEY`) when it is built, and :func:`check_target_weights` refuses
  another target of the same shapes (a fine-tuned sibling) unless ``drafter.allow_other_target=true``.
  A target loaded in float16 from float32 or bfloat16 files rounds twice and may get another signature.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import torch
import typing_extensions
from torch import nn

WEIGHTS_KEY = "weights_sha1"  # the key of the weights signature in a drafter's target_fingerprint
OVERRIDE = "drafter.allow_other_target=true"  # the one setting that accepts another target
SAMPLED_ROWS = 8  # rows hashed per parameter other than the embedding and the LM head
# Types of the fingerprint's keys (drafters.config.FINGERPRINT_KEYS plus the weights signature).
FINGERPRINT_TYPES = {"model_type": str, "vocab_size": int, "hidden_size": int, "num_hidden_layers": int,
                     WEIGHTS_KEY: str}
# Fields of a target's config that drafters.config reads (Llama/Qwen, GPT-2 and T5-style names) and their types.
TARGET_FIELD_TYPES = {name: int for name in (
    "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "vocab_size", "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "mask_token_id",
    "max_position_embeddings")} | {name: float for name in ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")}


class ConfigTypeError(TypeError):
    """A saved config's field holds a value of the wrong type."""


class TargetMismatchError(ValueError):
    """A drafter met a target other than the one it was trained for."""


def _describe(hint: Any) -> str:
    if hint is Any:
        return "any value"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict or hint is dict:
        return "an object (JSON mapping)"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


@functools.cache
def _schema(kinds: tuple[tuple[str, Any], ...]) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(typing_extensions.TypedDict("Fields", dict(kinds), total=False))


def _refuse_type(source: Any, name: str, value: Any, hint: Any) -> ConfigTypeError:
    return ConfigTypeError(f"{source}: field {name!r} is {value!r} ({type(value).__name__}), expected "
                           f"{_describe(hint)}; correct the file or re-create it")


def _check(kinds: Mapping[str, Any], fields: Any, source: Any, prefix: str = "", skip_none: bool = False) -> None:
    """Refuse the first field of ``fields`` (a mapping read from JSON; anything else is left alone) whose value
    does not fit its type in ``kinds`` (pydantic's strict validation as JSON: a list fits a tuple, an integer fits a
    float, a bool is never a number); ``prefix`` goes before the field's name in the message."""
    if not isinstance(fields, Mapping):
        return
    present = {k: fields[k] for k in kinds if k in fields and not (skip_none and fields[k] is None)}
    try:
        _schema(tuple(kinds.items())).validate_json(json.dumps(present, default=str), strict=True)
    except pydantic.ValidationError as e:
        name = e.errors()[0]["loc"][0]
        raise _refuse_type(source, prefix + name, fields[name], kinds[name]) from None


def check_fields(cls: type, data: Mapping[str, Any], source: Any) -> None:
    """Refuse a field of ``data`` (a saved ``cls`` dataclass, e.g. a drafter's ``config.json`` at ``source``)
    whose value does not fit the field's annotation, and in ``target_fingerprint`` one that does not fit
    :data:`FINGERPRINT_TYPES`. Unknown and missing fields are left to ``cls`` itself."""
    hints = typing.get_type_hints(cls)
    _check({f.name: hints[f.name] for f in dataclasses.fields(cls)}, data, source)
    _check(FINGERPRINT_TYPES, data.get("target_fingerprint"), source, "target_fingerprint.")


def check_target_config(config: Any, source: Any = None) -> None:
    """Refuse a field of a target's config (a Hugging Face config object, or the dict of its config.json) that
    blockdraft reads and whose value is not of :data:`TARGET_FIELD_TYPES`'s type; ``source`` names the file
    (default: the config's ``_name_or_path``/config.json)."""
    data = config if isinstance(config, Mapping) else getattr(config, "__dict__", {})
    if source is None:
        where = data.get("_name_or_path")
        source = f"{where}/config.json" if where else f"target config ({type(config).__name__})"
    nested = data.get("text_config")  # multimodal configs nest the language model's
    nested = nested if isinstance(nested, Mapping) else getattr(nested, "__dict__", {})
    for prefix, fields in (("", data), ("text_config.", nested)):
        _check(TARGET_FIELD_TYPES, fields, source, prefix, skip_none=True)


# DFlash-format config.json fields blockdraft reads beyond the target-style ones (drafters/dflash.py).
DFLASH_FIELD_TYPES = {"block_size": int, "mask_token_id": int, "target_layer_ids": list[int],
                      "num_target_layers": int, "target_hidden_size": int, "draft_vocab_size": int}


def check_dflash_fields(raw: Mapping[str, Any], source: Any) -> None:
    """Refuse a wrongly typed field of a DFlash-format ``config.json`` (``raw``, at ``source``): the Qwen3 sizes,
    ``dflash_config``'s settings (also read at the top level) and blockdraft's recorded target fingerprint."""
    check_target_config(raw, source)
    for prefix, fields in (("", raw), ("dflash_config.", raw.get("dflash_config") or {})):
        _check(DFLASH_FIELD_TYPES, fields, source, prefix, skip_none=True)
    recorded = (raw.get("blockdraft") or {}).get("target_fingerprint") or {}
    _check(FINGERPRINT_TYPES, recorded, source, "blockdraft.target_fingerprint.")


def legacy_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` (a checkpoint's drafter config dict) with the weights signature of ``current`` filled in when
    it was saved before signatures were recorded (warned about), so that the two compare on the rest."""
    saved = dict(saved)
    ours, theirs = current.get("target_fingerprint") or {}, saved.get("target_fingerprint")
    if isinstance(theirs, Mapping) and WEIGHTS_KEY not in theirs and WEIGHTS_KEY in ours:
        warnings.warn("the checkpoint records no signature of its target's weights (saved before blockdraft "
                      "recorded one): resumed without checking it was trained with this target", stacklevel=3)
        saved["target_fingerprint"] = {**theirs, WEIGHTS_KEY: ours[WEIGHTS_KEY]}
    return saved


def _rows(t: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` evenly spaced rows of ``t`` along dim 0 (all of a 0-/1-D tensor), as bfloat16 on the CPU."""
    t = t.detach()
    if t.dim() >= 2 and t.shape[0] > count:
        index = torch.tensor(sorted({i * (t.shape[0] - 1) // (count - 1) for i in range(count)}), device=t.device)
        t = t.index_select(0, index)
    return t.to(torch.bfloat16).cpu().contiguous()


def target_weights_sha1(target: nn.Module, rows: int = SAMPLED_ROWS) -> str:
    """The signature of ``target``'s weights: sha1 over the input embedding and LM head in full and
    ``rows`` evenly spaced rows of every other parameter (names' order, shapes included), rounded to bfloat16."""
    full = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(target, getter, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            full.append(module.weight)
    h = hashlib.sha1()
    for name, param in target.named_parameters():
        if param.is_meta:  # offloaded: nothing to read
            continue
        part = _rows(param, param.shape[0] if any(param is f for f in full) else rows)
        h.update(f"{name}:{tuple(param.shape)};".encode())
        h.update(part.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def _target_name(target: nn.Module) -> str:
    return str(getattr(getattr(target, "config", None), "_name_or_path", "") or type(target).__name__)


def check_target_weights(fingerprint: Mapping[str, Any], target: nn.Module, source: str | Path,
                         allow_other_target: bool = False) -> None:
    """Refuse ``target`` when its :func:`target_weights_sha1` is not the one the drafter saved at ``source``
    recorded (``fingerprint``, its ``target_fingerprint``), naming both; with ``allow_other_target`` warn
    instead. A drafter saved before the signature was recorded is accepted with a warning."""
    recorded = fingerprint.get(WEIGHTS_KEY)
    if recorded is None:
        warnings.warn(f"drafter {source} records no signature of its target's weights (saved before blockdraft "
                      f"recorded one): it cannot be checked against target {_target_name(target)}", stacklevel=3)
        return
    ours = target_weights_sha1(target)
    if ours == recorded:
        return
    shapes = ", ".join(f"{k}={fingerprint.get(k)}" for k in ("model_type", "vocab_size", "hidden_size",
                                                             "num_hidden_layers"))
    what = (f"drafter {source} was trained for another target: it records its target's {WEIGHTS_KEY} "
            f"{recorded}, target {_target_name(target)} has {ours} (same shapes: {shapes})")
    if allow_other_target:
        warnings.warn(f"{what}; used anyway ({OVERRIDE})", stacklevel=3)
        return
    raise TargetMismatchError(f"{what}. A drafter drafts well only for the weights it was trained on; use its own "
                              f"target, or set {OVERRIDE} if you mean to")


__all__ = ["DFLASH_FIELD_TYPES", "FINGERPRINT_TYPES", "OVERRIDE", "TARGET_FIELD_TYPES", "WEIGHTS_KEY",
           "ConfigTypeError", "TargetMismatchError", "check_dflash_fields", "check_fields", "check_target_config",
           "check_target_weights", "legacy_fingerprint", "target_weights_sha1"]
