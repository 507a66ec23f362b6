"""Making drafters: :func:`from_target` (a fresh drafter sized from its target, or one started from a saved
drafter), :func:`build` (from a config), :func:`load` (a saved folder, blockdraft or DFlash format),
:func:`check_same_config` (resuming), :func:`with_variant` / :func:`without_variant` (the same weights with
other decoding-time variants), and :func:`upgrade_saved_config`, the one place older saved configs are read.

A saved drafter is a folder: ``model.safetensors`` (the drafter's weights, never the target's embedding or LM
head) and ``config.json``: the core :class:`drafters.config.DrafterConfig`'s fields and ``variants``, the options
of each composed variant by name (:mod:`drafters.variants`), and ``blockdraft_record.json``, the sha256 of its
weights and the settings it was saved with, checked on load (:mod:`drafters.integrity`). A DFlash serving checkpoint
(``architectures`` in its config) is converted by :mod:`drafters.dflash`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from drafters import integrity
from drafters.checks import (
    WEIGHTS_KEY,
    check_dflash_fields,
    check_fields,
    check_target_weights,
    legacy_fingerprint,
    target_weights_sha1,
)
from drafters.config import (
    DrafterConfig,
    default_target_layer_ids,
    first_attr,
    target_final_norm_weight,
    target_fingerprint,
    target_sizes,
)
from drafters.dflash import dflash_settings, load_dflash
from drafters.model import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DFlashDrafter,
    Variant,
    check_variants,
    saved_config,
    taken_over,
)
from drafters.storage import check_safetensors, read_json
from drafters.variants import REGISTRY, make_variants

CORE_FIELDS = frozenset(f.name for f in dataclasses.fields(DrafterConfig)) - {"target_fingerprint"}

# ---- older saved configs ------------------------------------------------------------------------------

#: Values of DrafterConfig fields for saved configs that predate them (their drafters had no such part).
LEGACY_DEFAULTS = {"qk_norm": False, "attention_bias": False}
#: The flat switches older configs spelt the variants' options with, and the variant option each sets.
FLAT_KEYS = {"layerwise_context": ("layerwise", None), "shifted": ("layerwise", "shifted"),
             "causal_anchor": ("anchor", None), "frozen_anchor": ("anchor", "frozen"),
             "lookup_hints": ("hints", None), "lookup_max_ngram": ("hints", "max_ngram"),
             "store_hints": ("store_hints", None), "store_num_folds": ("store_hints", "num_folds"),
             "refine_passes": ("refine", "passes")}


def upgrade_saved_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A saved drafter config (``config.json``, or a training checkpoint's ``drafter_config``) as today's code
    writes it: the one conversion of older spellings, done once when a saved config is read.

    * fields added since it was saved get the value its drafter was trained with (:data:`LEGACY_DEFAULTS`: no
      q/k norm, no attention biases), not the defaults of new drafters;
    * the flat switches of older blockdraft (:data:`FLAT_KEYS`: ``layerwise_context``, ``shifted``,
      ``lookup_hints``, ``refine_passes``, ...) become the ``variants`` they name, with their options; a switch
      that is off names no variant (``refine_passes: 0``: no refine), and the options of a variant that is off
      are dropped (they were saved at their defaults), but ``shifted`` or ``frozen_anchor`` without their
      variant is refused.
    """
    raw = dict(raw)
    if "variants" not in raw:  # saved before variants: flat switches (all off when absent)
        flat = {k: raw.pop(k) for k in list(raw) if k in FLAT_KEYS}
        raw["variants"] = {name: {} for k, (name, option) in FLAT_KEYS.items() if option is None and flat.get(k)}
        if flat.get("refine_passes"):
            raw["variants"]["refine"] = {}
        for key, (name, option) in FLAT_KEYS.items():
            if option is not None and key in flat and name in raw["variants"]:
                raw["variants"][name][option] = flat[key]
            elif option in ("shifted", "frozen") and flat.get(key):
                raise ValueError(f"{key}=true needs the {name} variant's switch, which is off")
    return {**LEGACY_DEFAULTS, **raw}


def read_saved_config(raw: Mapping[str, Any], path: Path | str = "config.json") -> tuple[DrafterConfig, dict]:
    """``(core config, {name: Variant})`` of a saved drafter config (:func:`upgrade_saved_config` first); a
    ValueError names ``path``."""
    try:
        raw = upgrade_saved_config(raw)
        variants = make_variants(raw.pop("variants"))
        config = DrafterConfig.from_dict(raw)
        return config, variants
    except (TypeError, ValueError) as e:
        raise ValueError(f"drafter config {path}: {e}") from e


# ---- making drafters ----------------------------------------------------------------------------------


def build(config: DrafterConfig, variants: Mapping[str, Any] | None = None) -> DFlashDrafter:
    """A fresh drafter of ``config`` with ``variants`` ({name: options dict or Variant}), not attached to a target."""
    return DFlashDrafter(config, make_variants(variants))


def from_target(target: nn.Module, *, block_size: int = 16, num_layers: int = 1,
                target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
                init_from: str | Path | None = None, init_layers_from_target: bool = False,
                allow_other_target: bool = False, allow_edited_settings: bool = False,
                gradient_checkpointing: bool = False, variants: Mapping[str, Any] | None = None,
                **overrides: Any) -> DFlashDrafter:
    """A freshly initialised drafter sized from ``target.config`` and attached to ``target`` (``_target_`` of
    ``conf/drafter/dflash.yaml``).

    ``variants``: ``{name: options}`` of :mod:`drafters.variants` (e.g. ``{"layerwise": {"shifted": True}}``).
    ``overrides`` set other :class:`DrafterConfig` fields (num_heads, ...); a ``None`` value keeps the default.
    ``init_from``: a saved drafter (blockdraft or DFlash format) to start from instead of a fresh
    initialisation; the other arguments that are not None must equal its values.
    ``init_layers_from_target``: start the drafter's layers as copies of the target's layers.
    ``allow_other_target``: with ``init_from``, accept a checkpoint trained for a target with other weights
    (:func:`drafters.checks.check_target_weights`).
    ``allow_edited_settings``: with ``init_from``, accept a checkpoint whose config.json was edited after it was
    saved (:func:`drafters.integrity.check_saved_record`).
    """
    core = {k: v for k, v in overrides.items() if v is not None}
    _check_overrides(core)
    if init_from is not None:
        given = dict(core, block_size=block_size, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id)
        drafter = _from_checkpoint(target, init_from, given, variants, num_layers, allow_other_target,
                                   allow_edited_settings)
        return drafter.set_gradient_checkpointing(gradient_checkpointing)
    chosen = make_variants(variants)
    tcfg = getattr(target, "config", None)
    if tcfg is None:
        raise ValueError(f"target {type(target).__name__} has no .config; expected a HF causal LM")
    sizes = target_sizes(tcfg)
    if target_layer_ids is None:
        total = sizes["num_hidden_layers"]
        target_layer_ids = taken_over(v.default_layer_ids(num_layers, total) for v in chosen.values())
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(total)
    if mask_token_id is None:
        mask_token_id = first_attr(tcfg, ["mask_token_id"], sizes["vocab_size"] - 1)
    fingerprint = target_fingerprint(tcfg)
    fingerprint[WEIGHTS_KEY] = target_weights_sha1(target)  # which weights it is trained for (drafters/checks.py)
    fields = {k: v for k, v in sizes.items() if k != "num_hidden_layers"}
    fields.update(block_size=block_size, num_layers=num_layers, target_layer_ids=tuple(target_layer_ids),
                  mask_token_id=int(mask_token_id), target_fingerprint=fingerprint, **core)
    drafter = DFlashDrafter(DrafterConfig(**fields), chosen).attach_target(target)
    # The output norm starts as the target's final norm, so the shared LM head sees inputs at the scale it
    # was trained on and the drafter can be as confident as the target from step 1 (a norm shrunk below
    # it caps the logit scale, and CE under a capped scale collapses onto frequent tokens).
    final_norm = target_final_norm_weight(target)
    with torch.no_grad():
        if final_norm is not None and final_norm.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(final_norm.float())
    if init_layers_from_target:
        drafter.copy_target_layers(target)
    drafter.after_init()
    return drafter.set_gradient_checkpointing(gradient_checkpointing)


def _check_overrides(core: Mapping[str, Any]) -> None:
    flat = sorted(set(core) & set(FLAT_KEYS))
    if flat:
        spelt = ", ".join(f"{k} -> variants.{FLAT_KEYS[k][0]}" + (f".{FLAT_KEYS[k][1]}" if FLAT_KEYS[k][1] else "")
                          for k in flat)
        raise ValueError(f"drafter overrides {flat} are the flat switches of older configs; name the variant "
                         f"instead ({spelt}: conf/drafter/variant/)")
    unknown = sorted(set(core) - CORE_FIELDS)
    if unknown:
        raise ValueError(f"unknown drafter overrides {unknown}; allowed: {sorted(CORE_FIELDS)} and variants")


def load(directory: str | Path, target: nn.Module | None = None, allow_other_target: bool = False,
         allow_edited_settings: bool = False) -> DFlashDrafter:
    """A saved drafter (its variants from its config); with ``target``, attached (refused if its fingerprint
    differs, or its weights are not those the drafter was trained for unless ``allow_other_target``:
    :func:`drafters.checks.check_target_weights`). A DFlash serving checkpoint is converted
    (:func:`drafters.dflash.load_dflash`, needs ``target``). Its weights files and settings are checked against
    the record saved with them (:func:`drafters.integrity.check_saved_record`): changed weights are refused, and
    edited settings unless ``allow_edited_settings``; so are weights that are not all finite
    (:func:`drafters.integrity.check_finite_weights`). Returned in eval mode."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"drafter directory {directory} does not exist")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"drafter directory {directory} has no {name}")
    raw = read_json(directory / CONFIG_NAME, "drafter config")  # a damaged file is named
    check_safetensors(directory / WEIGHTS_NAME)
    load_format = _load_dflash_format if _is_dflash(raw) else _load_blockdraft
    drafter = load_format(directory, raw, target)
    integrity.check_finite_weights(drafter.state_dict(), directory / WEIGHTS_NAME)
    integrity.check_saved_record(directory, CONFIG_NAME, _settings(raw, drafter), allow_edited_settings)
    if target is not None:
        check_target_weights(drafter.config.target_fingerprint, target, directory, allow_other_target)
    return drafter.eval()


def _is_dflash(raw: Mapping[str, Any]) -> bool:
    """Whether a drafter's ``config.json`` is HF-style: the DFlash format."""
    return "architectures" in raw or "dflash_config" in raw


def _load_dflash_format(directory: Path, raw: Mapping[str, Any], target: nn.Module | None) -> DFlashDrafter:
    """The DFlash checkpoint in ``directory`` (``raw``: its config.json) converted and attached to ``target``."""
    check_dflash_fields(raw, directory / CONFIG_NAME)  # a wrongly typed field is named
    return load_dflash(directory, target)


def _load_blockdraft(directory: Path, raw: Mapping[str, Any], target: nn.Module | None) -> DFlashDrafter:
    """The blockdraft-format drafter in ``directory`` (``raw``: its config.json), attached to ``target`` if given."""
    check_fields(DrafterConfig, raw, directory / CONFIG_NAME)  # a wrongly typed field is named
    config, variants = read_saved_config(raw, directory / CONFIG_NAME)
    drafter = DFlashDrafter(config, variants)
    drafter.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=True)
    for variant in variants.values():
        variant.load_extras(drafter, directory)
    return drafter if target is None else drafter.attach_target(target)


def _settings(raw: Mapping[str, Any], drafter: DFlashDrafter) -> dict[str, Any]:
    """The settings of ``drafter``, loaded from a folder whose ``config.json`` is ``raw``, in the spelling of the
    record saved with it (:mod:`drafters.integrity`): its DFlash config fields
    (:func:`drafters.dflash.dflash_settings`) in the DFlash format, else its ``config.json`` as saving writes it."""
    return dflash_settings(drafter.config) if _is_dflash(raw) else drafter.saved_config()


def edited_settings(directory: str | Path, drafter: DFlashDrafter) -> dict[str, dict[str, Any]]:
    """``{key: {"recorded", "found"}}`` of the settings of ``drafter``, loaded from ``directory`` with
    ``allow_edited_settings``, that differ from those recorded when it was saved ({} when none)."""
    raw = read_json(Path(directory) / CONFIG_NAME, "drafter config")
    return integrity.edited_settings(directory, _settings(raw, drafter))


def _from_checkpoint(target: nn.Module, path: str | Path, given: dict[str, Any], variants: Mapping[str, Any] | None,
                     num_layers: int | None, allow_other_target: bool = False,
                     allow_edited_settings: bool = False) -> DFlashDrafter:
    """``from_target(..., init_from=path)``: the saved drafter at ``path`` attached to ``target``.

    The checkpoint fixes the architecture. ``num_layers`` is the fresh-initialisation size, so a
    different value is only warned about; every other given value that is not None (core fields, variants)
    must equal the checkpoint's, else the call is refused naming the field.
    """
    drafter = load(path, target=target, allow_other_target=allow_other_target,
                   allow_edited_settings=allow_edited_settings)
    cfg = drafter.config
    cfg.target_fingerprint[WEIGHTS_KEY] = target_weights_sha1(target)  # trained from here on for this target
    given = {k: v for k, v in given.items() if v is not None}
    if "target_layer_ids" in given:
        given["target_layer_ids"] = tuple(int(i) for i in given["target_layer_ids"])
    diffs = [f"drafter.{k}={v!r} but the checkpoint has {k}={getattr(cfg, k)!r}"
             for k, v in given.items() if v != getattr(cfg, k)]
    if variants:
        wanted = make_variants(variants)
        if wanted != drafter.variants:
            diffs.append(f"drafter variants {wanted} but the checkpoint has {drafter.variants}")
    if diffs:
        raise ValueError(f"drafter.init_from={path}: " + "; ".join(diffs)
                         + " (set these to the checkpoint's values or to null)")
    if num_layers is not None and num_layers != cfg.num_layers:
        warnings.warn(f"drafter.init_from={path}: using its {cfg.num_layers} layers "
                      f"(drafter.num_layers={num_layers} applies to fresh drafters only)", stacklevel=3)
    return drafter.train()  # a training start, like from_target's fresh drafters


def with_variant(drafter: DFlashDrafter, name: str, **options: Any) -> DFlashDrafter:
    """``drafter`` (same weights, target and mode) with variant ``name`` and these options, added or replacing its
    current ones; checked as at construction. For variants that add no weights (``refine``)."""
    return drafter.with_variants(make_variants({**drafter.variants, name: options}))


def without_variant(drafter: DFlashDrafter, name: str) -> DFlashDrafter:
    """``drafter`` (same weights, target and mode) without variant ``name`` (one that adds no weights)."""
    return drafter.with_variants({k: v for k, v in drafter.variants.items() if k != name})


def check_same_config(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse to resume a checkpoint whose drafter config (``saved``, a drafter's ``saved_config()``, or that of an
    older blockdraft) is not ``current`` (the drafter's ``saved_config()``): another target (fingerprint), or
    another drafter shape or variant (the fields named)."""
    saved = legacy_fingerprint(saved, current)  # a checkpoint from before the weights signature: compared without it
    if saved.get("target_fingerprint") != current["target_fingerprint"]:
        raise ValueError(
            f"checkpoint was trained for another target: its target fingerprint is "
            f"{saved.get('target_fingerprint')}, the current target's is {current['target_fingerprint']}"
        )
    config, variants = read_saved_config(saved, "in the checkpoint")
    check_variants(config, variants)
    saved = saved_config(config, variants)
    diffs = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if diffs:
        shown = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diffs.items())
        raise ValueError(f"checkpoint's drafter config differs from the current one: {shown}")


__all__ = ["FLAT_KEYS", "LEGACY_DEFAULTS", "REGISTRY", "Variant", "build", "check_same_config", "edited_settings",
           "from_target", "load", "read_saved_config", "upgrade_saved_config", "with_variant",
           "without_variant"]
