"""Variants of the DFlash drafter: composable mixins over :class:`drafters.model.DFlashDrafter`'s hooks.

Each variant is one module with its own options dataclass (its ``config.json`` entry) and a mixin that
overrides a few hooks of the core; none adds a branch to the core's forward. Reachable by name:

* ``layerwise`` (:mod:`.layerwise`): drafter layer i reads target hidden state i through its own input norm,
  instead of one fused context; ``shifted``: slot k read from block position k - 1;
* ``anchor`` (:mod:`.anchor`): the anchor attends to the context and itself only (causal); ``frozen``: it runs
  through frozen copies of the layers, so training never moves slot 1;
* ``hints`` (:mod:`.hints`): slots 1..K read what prompt lookup proposes instead of MASK;
* ``store_hints`` (:mod:`.store_hints`, needs ``hints``): weak hints come from an n-gram store of the training
  answers;
* ``refine`` (:mod:`.refine`): the block runs again with the previous pass's argmax in its slots.

:func:`compose` builds the drafter class of a set of variants (``DFlashDrafter`` itself for none). Older
blockdraft configs spelt the variants as flat switches (:data:`FLAT_KEYS`); :func:`split_flat` reads them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from drafters.config import DrafterConfig
from drafters.variants.anchor import CausalAnchor
from drafters.variants.hints import LookupHints
from drafters.variants.layerwise import Layerwise
from drafters.variants.refine import Refine
from drafters.variants.store_hints import StoreHints

#: name -> mixin, outermost first (the order of the composed class's bases).
REGISTRY: dict[str, type] = {m.variant_name: m for m in (Refine, StoreHints, LookupHints, CausalAnchor, Layerwise)}

#: The flat switches of older configs (and of ``conf/drafter/*.yaml``) that name variants' options.
FLAT_KEYS = ("layerwise_context", "shifted", "causal_anchor", "frozen_anchor", "lookup_hints", "lookup_max_ngram",
             "store_hints", "store_num_folds", "refine_passes")


def _names(variants) -> tuple[str, ...]:
    unknown = sorted(set(variants) - set(REGISTRY))
    if unknown:
        raise ValueError(f"unknown drafter variants {unknown}; registered: {list(REGISTRY)}")
    missing = [f"{n} needs {r}" for n in variants for r in REGISTRY[n].requires if r not in variants]
    if missing:
        raise ValueError("drafter variants: " + "; ".join(missing))
    return tuple(n for n in REGISTRY if n in variants)


def compose(variants) -> type:
    """The drafter class with ``variants`` (names, or a mapping whose keys are names): the core for none."""
    return _compose(_names(variants))


@functools.cache
def _compose(names: tuple[str, ...]) -> type:
    from drafters.model import DFlashDrafter

    if not names:
        return DFlashDrafter
    bases = tuple(REGISTRY[n] for n in names) + (DFlashDrafter,)
    name = "__".join(("DFlashDrafter", *names))  # importable by this name: module __getattr__ (pickling, ddp_spawn)
    return type(name, bases, {"variant_names": names, "__module__": __name__, "__qualname__": name})


def __getattr__(name: str) -> type:
    """The composed classes by their names (``DFlashDrafter__hints__layerwise``), so that pickle finds them."""
    if name.startswith("DFlashDrafter__"):
        return compose(name.split("__")[1:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def options_of(klass: type, variants: Mapping[str, Any], config: DrafterConfig) -> dict[str, Any]:
    """``{name: options dataclass}`` for ``klass``'s variants from ``variants`` (options, dicts or None),
    each checked against ``config`` and the others (a ValueError names the field)."""
    out = {}
    for name in klass.variant_names:
        value = variants.get(name)
        options_class = REGISTRY[name].Options
        if isinstance(value, options_class):
            out[name] = value
            continue
        known = {f.name for f in dataclasses.fields(options_class)}
        unknown = sorted(set(value or {}) - known)
        if unknown:
            raise ValueError(f"drafter variant {name!r}: unknown options {unknown}; known: {sorted(known)}")
        out[name] = options_class(**(value or {}))
    for options in out.values():
        options.check(config, out)
    return out


def split_flat(flat: Mapping[str, Any], variants: Mapping[str, Any] | None = None,
               base: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(core fields, variants)`` of a mapping that may hold the flat switches of :data:`FLAT_KEYS`, merged
    with ``variants`` ({name: options}) and the variant names ``base``."""
    f = {k: flat[k] for k in FLAT_KEYS if k in flat}
    out: dict[str, Any] = {name: {} for name in base} | dict(variants or {})
    if f.get("refine_passes", 0) < 0:
        raise ValueError(f"refine_passes must be >= 0, got {f['refine_passes']}")
    if f.get("layerwise_context"):
        out["layerwise"] = {"shifted": bool(f.get("shifted", False))}
    elif f.get("shifted") and "layerwise" not in out:
        raise ValueError("shifted needs layerwise_context (the layerwise variant reads slot k from position k - 1)")
    if f.get("frozen_anchor") and not (f.get("causal_anchor") or "anchor" in out):
        raise ValueError("frozen_anchor needs causal_anchor and shifted (slot 1 read from an anchor that sees no "
                         f"other slot), got causal_anchor={f.get('causal_anchor')}, shifted={f.get('shifted')}")
    if f.get("causal_anchor") or f.get("frozen_anchor"):
        out["anchor"] = {"frozen": bool(f.get("frozen_anchor", False))}
    if f.get("lookup_hints"):
        out["hints"] = {"max_ngram": int(f.get("lookup_max_ngram", 3))}
    if f.get("store_hints") and "hints" not in out:
        raise ValueError("store_hints needs lookup_hints (the store fills the slots prompt lookup leaves weak)")
    if f.get("store_hints"):
        out["store_hints"] = {"num_folds": int(f.get("store_num_folds", 4))}
    if f.get("refine_passes"):
        out["refine"] = {"passes": int(f["refine_passes"])}
    return {k: v for k, v in flat.items() if k not in FLAT_KEYS}, out


def flat_settings(variants: Mapping[str, Any]) -> dict[str, Any]:
    """The flat switches (:data:`FLAT_KEYS`) that describe ``variants`` ({name: options dataclass}): the
    inverse of :func:`split_flat`, for records that compare drafters by field."""
    lw, an, hi, st, rf = (variants.get(n) for n in ("layerwise", "anchor", "hints", "store_hints", "refine"))
    return {"layerwise_context": lw is not None, "shifted": bool(lw and lw.shifted), "causal_anchor": an is not None,
            "frozen_anchor": bool(an and an.frozen), "lookup_hints": hi is not None,
            "lookup_max_ngram": hi.max_ngram if hi else 3, "store_hints": st is not None,
            "store_num_folds": st.num_folds if st else 4, "refine_passes": rf.passes if rf else 0}


def read_saved_config(raw: Mapping[str, Any], path: Path | str = "config.json") -> tuple[DrafterConfig, dict]:
    """``(core config, variants)`` of a saved ``config.json``: ``variants`` ({name: options}) beside the core
    fields, or (older blockdraft) the flat switches of :data:`FLAT_KEYS`, read into the variants they name."""
    raw = dict(raw)
    variants = raw.pop("variants", None)
    try:
        core, variants = split_flat(raw, variants)
        _names(variants)
        return DrafterConfig.from_dict(core), variants
    except (TypeError, ValueError) as e:
        raise ValueError(f"drafter config {path}: {e}") from e


__all__ = ["FLAT_KEYS", "REGISTRY", "compose", "flat_settings", "options_of", "read_saved_config", "split_flat"]
