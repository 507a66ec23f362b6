"""Import and export of the DFlash serving format (docs/method.md §6).

vLLM (``"method": "dflash"``), SGLang (``--speculative-algorithm DFLASH``) and the ``dflash`` package
load block drafters from one directory:

* ``config.json``: a Qwen3 config of the drafter (``model_type: qwen3``; hidden size = the target's;
  ``num_hidden_layers`` = drafter layers) with ``architectures: ["DFlashDraftModel"]``, top-level
  ``block_size`` and ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``;
* ``model.safetensors``: the drafter's weights only (the target's embedding and LM head are shared).

blockdraft adds ``blockdraft`` (the target fingerprint) to ``config.json`` and ``blockdraft_record.json`` beside it
(the weights' sha256 and the settings exported: :mod:`drafters.integrity`), both ignored by servers.

The forward is the core drafter's (:class:`drafters.model.DFlashDrafter`) with ``qk_norm=True``: context features
``hidden_norm(fc(concat(h)))`` enter every layer's k/v projections un-normalised, queries come from
the block ``[anchor, MASK x K]`` only, keys are ``k_norm`` + RoPE of context and block alike,
attention over context + block is bidirectional, ``norm`` then the target's LM head.

Two conventions differ and are converted here:

* **layer ids**: a DFlash target layer id ``i`` reads ``hidden_states[i + 1]`` (layer i's output);
  blockdraft's ids index ``hidden_states`` directly, so blockdraft id = DFlash id + 1 and blockdraft's
  id 0 (the embeddings) has no DFlash equivalent;
* **parameter names** (``_TOP`` and ``_LAYER`` below).

What blockdraft cannot express is refused on import, naming the field and the value it needs:
another architecture (DFlash2), sliding-window or causal layers, a RoPE scaling type, another
activation, non-neutral embedding/logit scales, a target of another size.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config

from drafters.config import DrafterConfig, target_fingerprint
from drafters.integrity import write_record
from drafters.model import CONFIG_NAME, WEIGHTS_NAME, DFlashDrafter
from drafters.model_card import model_card, reads_final_output, serving_commands

ARCHITECTURE = "DFlashDraftModel"
MODEL_TYPE = "qwen3"
DEFAULT_BLOCK_SIZE = 16  # what the reference assumes when a config names none
# dflash_config keys blockdraft reads, and the keys the reference reads with the value that makes them
# a no-op (anything else changes the forward in a way blockdraft does not implement).
_DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size")
_NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
            # read by vLLM's DFlash model (dflash_config first, then the top level)
            "causal": False, "use_swa": False, "attention_sink_bias": False, "is_neox_style": True,
            "use_aux_hidden_state": True, "logit_scale": 1.0}
# blockdraft module names -> DFlash names: top level, and inside ``layers.N``.
_TOP = {"fuse": "fc", "fuse_norm": "hidden_norm", "norm": "norm"}
_LAYER = {"input_norm": "input_layernorm", "attn": "self_attn", "post_attn_norm": "post_attention_layernorm",
          "mlp": "mlp"}


class DFlashFormatError(ValueError):
    """A DFlash checkpoint (or a drafter to export) that blockdraft cannot convert exactly."""


# --------------------------------------------------------------------------------------------------
# Names


def _rename(key: str, top: dict[str, str], layer: dict[str, str]) -> str:
    parts = key.split(".")
    table, i = (layer, 2) if parts[0] == "layers" and len(parts) > 2 else (top, 0)
    if parts[i] not in table:
        raise KeyError(key)
    parts[i] = table[parts[i]]
    return ".".join(parts)


def to_dflash_name(key: str) -> str:
    """``layers.0.attn.q_proj.weight`` -> ``layers.0.self_attn.q_proj.weight``, ``fuse.weight`` -> ``fc.weight``."""
    return _rename(key, _TOP, _LAYER)


def from_dflash_name(key: str) -> str:
    """The inverse of :func:`to_dflash_name`."""
    return _rename(key, {v: k for k, v in _TOP.items()}, {v: k for k, v in _LAYER.items()})


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default DFlash layer ids when a config lists none (one per drafter layer,
    spread over target layers 1 .. L-3; the middle layer for a 1-layer drafter)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------------------------------
# Export


def _embedding_scale(target: nn.Module | None) -> float:
    """The factor a target's embedding module applies on top of its weight lookup (Gemma-style)."""
    if target is None:
        return 1.0
    embed = target.get_input_embeddings()
    scale = getattr(embed, "embed_scale", None)
    if scale is None:
        return 1.0
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


FINAL_OUTPUT_WARNING = (
    "target_layer_ids {ids} include {last}, the target's last hidden state, which Hugging Face returns after "
    "the final norm (DFlash layer id {dflash}). The dflash package reads it the same way, but vLLM "
    "captures the residual stream at the input of target layers and never provides this state: to serve "
    "with vLLM, train the drafter with target_layer_ids below {last}")


def _check_exportable(drafter: DFlashDrafter) -> None:
    """Raise :class:`DFlashFormatError` where DFlash cannot express ``drafter``; warn where vLLM cannot serve it."""
    cfg: DrafterConfig = drafter.config
    if not isinstance(drafter, DFlashDrafter):
        raise DFlashFormatError(f"{type(drafter).__name__} is not a blockdraft drafter; expected a DFlashDrafter")
    if drafter.variants:
        reasons = "; ".join(v.export_refusal for v in drafter.variants.values())
        raise DFlashFormatError(
            f"{type(drafter).__name__} with variants {list(drafter.variants)}: a variant of the DFlash drafter, which the DFlash format cannot express "
            f"({reasons}). Only the core drafter exports; evaluate this one with experiments.evaluate instead")
    if not cfg.qk_norm:
        raise DFlashFormatError(
            "drafter config qk_norm=False (a drafter saved before q/k norm existed): DFlash layers always "
            "apply per-head q/k RMSNorm, so it cannot be exported exactly; expected qk_norm=True "
            "(train a new drafter, the default)")
    if 0 in cfg.target_layer_ids:
        raise DFlashFormatError(
            f"target_layer_ids {list(cfg.target_layer_ids)} include 0 (the target's embeddings): a DFlash "
            "target layer id i reads hidden_states[i + 1], so only ids >= 1 (layer outputs) can be exported")
    if reads_final_output(cfg):
        warnings.warn(FINAL_OUTPUT_WARNING.format(ids=list(cfg.target_layer_ids),
                                                  last=cfg.target_fingerprint["num_hidden_layers"],
                                                  dflash=cfg.target_fingerprint["num_hidden_layers"] - 1),
                      stacklevel=4)
    scale = _embedding_scale(getattr(drafter, "_target", None))
    if scale != 1.0:
        raise DFlashFormatError(
            f"the target's input embedding scales its rows by {scale}: DFlash servers embed the block with "
            "the raw embedding weight (scale 1.0), so this drafter's inputs would differ")


def dflash_settings(cfg: DrafterConfig) -> dict[str, Any]:
    """The fields of ``cfg``'s DFlash ``config.json`` that define the drafter: all of :func:`dflash_config`'s but
    the serving choices (``max_position_embeddings``, ``dtype``). Export records them and import compares the
    imported drafter's with that record (:mod:`drafters.integrity`)."""
    n = cfg.num_layers
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": cfg.vocab_size,
        # both spellings: rope_theta/rope_scaling (transformers 4) and rope_parameters (transformers 5)
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_fingerprint["num_hidden_layers"],
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
        },
        # Provenance (ignored by servers): lets blockdraft refuse a different target on import.
        "blockdraft": {"target_fingerprint": dict(cfg.target_fingerprint)},
    }


def dflash_config(drafter: DFlashDrafter, *, max_position_embeddings: int | None = None,
                  dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The DFlash ``config.json`` of ``drafter`` (refuses what DFlash cannot express): :func:`dflash_settings`
    and the serving choices (default: the attached target's context length, else 32768; the weights' dtype)."""
    _check_exportable(drafter)
    if max_position_embeddings is None:
        target = getattr(drafter, "_target", None)
        limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
        max_position_embeddings = int(limit) if limit else 32768
    weight_dtype = dtype or drafter.weight_ref.dtype
    return {**dflash_settings(drafter.config), "max_position_embeddings": max_position_embeddings,
            "dtype": str(weight_dtype).removeprefix("torch.")}


def dflash_state_dict(drafter: DFlashDrafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's weights under DFlash names (contiguous CPU tensors, optionally cast)."""
    return {to_dflash_name(k): v.detach().to(device="cpu", dtype=dtype or v.dtype).contiguous()
            for k, v in drafter.state_dict().items()}


def export_dflash(drafter: DFlashDrafter, out_dir: str | Path, *, card: str | None = None,
                  max_position_embeddings: int | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``drafter`` to ``out_dir`` in the DFlash format: config.json, model.safetensors, README.md, and the
    record of the weights' sha256 and of :func:`dflash_settings` (:func:`drafters.integrity.write_record`).

    ``card``: the model card's text (default: :func:`model_card` with no training information).
    ``max_position_embeddings``: written to the config (default: the attached target's, else 32768).
    ``dtype``: cast the weights (e.g. ``torch.bfloat16`` for serving); default: keep the drafter's.
    """
    config = dflash_config(drafter, max_position_embeddings=max_position_embeddings, dtype=dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dflash_state_dict(drafter, dtype), str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "README.md").write_text(card if card is not None else model_card(drafter, out_dir))
    # config.json's settings, not its bytes: its serving choices (max_position_embeddings, dtype) are the user's
    write_record(out_dir, dflash_settings(drafter.config), [WEIGHTS_NAME], covered=())
    return out_dir


# --------------------------------------------------------------------------------------------------
# Import


def _refuse(directory: Path, message: str) -> DFlashFormatError:
    return DFlashFormatError(f"DFlash checkpoint {directory}: {message}")


def _draft_value(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash setting as the reference reads it: ``dflash_config`` first, then the top level."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def _check_dflash_keys(raw: dict[str, Any], directory: Path) -> None:
    """Refuse a DFlash ``config.json`` of another architecture or with settings blockdraft does not implement."""
    archs = raw.get("architectures")
    if archs != [ARCHITECTURE]:
        extra = " (DFlash2: dynamic convolutions and a candidate selector)" if archs and "DFlash2DraftModel" in archs else ""
        raise _refuse(directory, f"architectures={archs!r}{extra} cannot be imported; expected [{ARCHITECTURE!r}]")
    if raw.get("model_type") != MODEL_TYPE:
        raise _refuse(directory, f"model_type={raw.get('model_type')!r}; expected {MODEL_TYPE!r}")
    extra_keys = sorted(set(raw.get("dflash_config") or {}) - set(_DFLASH_KEYS) - set(_NEUTRAL))
    if extra_keys:
        raise _refuse(directory, f"dflash_config has keys {extra_keys} that blockdraft does not implement; "
                                 f"expected only {sorted(_DFLASH_KEYS + tuple(_NEUTRAL))}")
    for name, neutral in _NEUTRAL.items():
        value = _draft_value(raw, name, neutral)
        if not (value == neutral or (neutral is None and not value)):
            raise _refuse(directory, f"{name}={value!r}; expected {neutral!r} (blockdraft applies no such scaling)")
    for name in ("target_hidden_size", "draft_vocab_size"):
        other = "hidden_size" if name == "target_hidden_size" else "vocab_size"
        if raw.get(name) is not None and raw[name] != raw.get(other):
            raise _refuse(directory, f"{name}={raw[name]} differs from {other}={raw.get(other)}; expected "
                                     f"{name}={raw.get(other)} (blockdraft drafters are as wide as the target "
                                     "and share its vocabulary)")


def _check_layers(qc: Any, directory: Path) -> float:
    """Refuse drafter layers that are not blockdraft's (SwiGLU, full bidirectional attention, plain RoPE);
    returns the RoPE base theta. ``qc``: the config as transformers' ``Qwen3Config`` reads it."""
    if qc.hidden_act != "silu":
        raise _refuse(directory, f"hidden_act={qc.hidden_act!r}; expected 'silu' (blockdraft's SwiGLU MLP)")
    layer_types = list(getattr(qc, "layer_types", None) or ["full_attention"] * qc.num_hidden_layers)
    for i, kind in enumerate(layer_types):
        if kind != "full_attention":
            raise _refuse(directory, f"layer_types[{i}]={kind!r} (sliding_window={qc.sliding_window}); expected "
                                     "'full_attention' (blockdraft layers attend bidirectionally to all columns)")
    if getattr(qc, "is_causal", None):
        raise _refuse(directory, f"is_causal={qc.is_causal!r}; expected false (bidirectional blocks)")
    rope = getattr(qc, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _refuse(directory, f"rope_parameters.rope_type={rope_type!r}; expected 'default' (plain RoPE)")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(directory, f"partial_rotary_factor={rope['partial_rotary_factor']}; expected 1.0")
    return float(rope.get("rope_theta", getattr(qc, "rope_theta", 10000.0)))


def _dflash_layer_ids(raw: dict[str, Any], num_layers: int, target_layers: int, directory: Path) -> list[int]:
    """The DFlash target layer ids (hidden_states index - 1) of ``raw``, checked against the target's
    ``target_layers`` layers (DFlash's default choice for ``num_layers`` drafter layers when absent)."""
    layer_ids = _draft_value(raw, "target_layer_ids")
    if layer_ids is None:
        layer_ids = dflash_target_layer_ids(target_layers, num_layers)
    layer_ids = [int(i) for i in layer_ids]
    bad = [i for i in layer_ids if not 0 <= i < target_layers]
    if bad:
        raise _refuse(directory, f"dflash_config.target_layer_ids {bad} out of range for a target with "
                                 f"{target_layers} layers; expected ids in 0..{target_layers - 1}")
    eagle_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if eagle_ids and [int(i) for i in eagle_ids] != [i + 1 for i in layer_ids]:
        raise _refuse(directory, f"eagle_aux_hidden_state_layer_ids={list(eagle_ids)} disagrees with "
                                 f"dflash_config.target_layer_ids={layer_ids}; expected "
                                 f"{[i + 1 for i in layer_ids]} (DFlash id + 1) or no such key")
    return layer_ids


def dflash_drafter_config(raw: dict[str, Any], target_config: Any, directory: Path = Path(".")) -> DrafterConfig:
    """The :class:`DrafterConfig` of a DFlash ``config.json`` (``raw``) for a target with ``target_config``.

    The JSON is read through transformers' ``Qwen3Config``, as the reference reads it (so derived
    fields such as ``layer_types`` and ``head_dim`` get the same defaults).
    """
    _check_dflash_keys(raw, directory)
    qc = Qwen3Config.from_dict(raw)
    rope_theta = _check_layers(qc, directory)

    fingerprint = target_fingerprint(target_config)
    target_layers = fingerprint["num_hidden_layers"]
    for field, theirs in (("hidden_size", fingerprint["hidden_size"]), ("vocab_size", fingerprint["vocab_size"])):
        if getattr(qc, field) != theirs:
            raise _refuse(directory, f"{field}={getattr(qc, field)} but the target has {field}={theirs} "
                                     "(the drafter shares the target's embedding and LM head); expected "
                                     f"{field}={theirs}")
    num_target_layers = raw.get("num_target_layers")
    if num_target_layers is not None and int(num_target_layers) != target_layers:
        raise _refuse(directory, f"num_target_layers={num_target_layers} but the target has {target_layers} "
                                 f"layers; expected num_target_layers={target_layers}")
    layer_ids = _dflash_layer_ids(raw, qc.num_hidden_layers, target_layers, directory)
    mask_token_id = _draft_value(raw, "mask_token_id")
    if mask_token_id is None:
        raise _refuse(directory, "dflash_config.mask_token_id is missing; expected the id of the mask token")
    recorded = (raw.get("blockdraft") or {}).get("target_fingerprint")
    if recorded:  # exported by blockdraft: keep what it was trained for, so attach_target compares it
        fingerprint = dict(recorded)
    return DrafterConfig(
        block_size=int(_draft_value(raw, "block_size", DEFAULT_BLOCK_SIZE)),
        num_layers=int(qc.num_hidden_layers),
        hidden_size=int(qc.hidden_size),
        num_heads=int(qc.num_attention_heads),
        num_kv_heads=int(qc.num_key_value_heads),
        head_dim=int(getattr(qc, "head_dim", None) or qc.hidden_size // qc.num_attention_heads),
        intermediate_size=int(qc.intermediate_size),
        rms_norm_eps=float(qc.rms_norm_eps),
        rope_theta=rope_theta,
        vocab_size=int(qc.vocab_size),
        mask_token_id=int(mask_token_id),
        target_layer_ids=tuple(i + 1 for i in layer_ids),
        target_fingerprint=fingerprint,
        qk_norm=True,
        attention_bias=bool(qc.attention_bias),
    )


def load_dflash(directory: str | Path, target: nn.Module | None) -> DFlashDrafter:
    """A DFlash checkpoint as a :class:`DFlashDrafter` (the core drafter) attached to ``target``."""
    directory = Path(directory)
    if target is None or getattr(target, "config", None) is None:
        raise _refuse(directory, "importing a DFlash checkpoint needs the target model "
                                 "(drafters.factory.load(dir, target)): its config does not "
                                 "record the target's architecture")
    raw = json.loads((directory / CONFIG_NAME).read_text())
    config = dflash_drafter_config(raw, target.config, directory)
    drafter = DFlashDrafter(config)
    expected = {to_dflash_name(k): k for k in drafter.state_dict()}
    weights = load_file(str(directory / WEIGHTS_NAME))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise _refuse(directory, f"{WEIGHTS_NAME} does not match its config.json: missing {missing[:8]}, "
                                 f"unexpected {unexpected[:8]} (expected the {len(expected)} tensors of a "
                                 f"{config.num_layers}-layer DFlashDraftModel)")
    state = drafter.state_dict()
    bad = [f"{name}: {tuple(w.shape)}, expected {tuple(state[expected[name]].shape)}"
           for name, w in weights.items() if tuple(w.shape) != tuple(state[expected[name]].shape)]
    if bad:
        raise _refuse(directory, "tensor shapes do not match its config.json: " + "; ".join(bad[:4]))
    drafter.load_state_dict({expected[name]: w for name, w in weights.items()}, strict=True)
    return drafter.attach_target(target)


__all__ = ["DFlashFormatError", "dflash_config", "dflash_drafter_config", "dflash_settings", "dflash_state_dict",
           "dflash_target_layer_ids", "export_dflash", "from_dflash_name", "load_dflash", "model_card",
           "serving_commands", "to_dflash_name"]
