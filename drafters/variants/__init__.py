"""Variants of the DFlash drafter: :class:`drafters.model.Variant` objects that a :class:`drafters.model.DFlashDrafter`
holds in ``variants`` and whose methods take over a few of its hooks; none adds a branch to the core's forward.
Each is one module, its options the dataclass's fields (its ``config.json`` entry). Reachable by name:

* ``layerwise`` (:mod:`.layerwise`): drafter layer i reads target hidden state i through its own input norm,
  instead of one fused context; ``shifted``: slot k read from block position k - 1;
* ``anchor`` (:mod:`.anchor`): the anchor attends to the context and itself only (causal); ``frozen``: it runs
  through frozen copies of the layers, so training never moves slot 1;
* ``hints`` (:mod:`.hints`): slots 1..K read what prompt lookup proposes instead of MASK;
* ``store_hints`` (:mod:`.store_hints`, needs ``hints``): weak hints come from an n-gram store of the training
  answers;
* ``refine`` (:mod:`.refine`): the block runs again with the previous pass's argmax in its slots.

What the hint variants read (prompt lookup's proposal at every anchor, the n-gram store of the training answers)
lives beside them in :mod:`.hint_lookup`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from drafters.model import Variant
from drafters.variants.anchor import CausalAnchor
from drafters.variants.hints import LookupHints
from drafters.variants.layerwise import Layerwise
from drafters.variants.refine import Refine
from drafters.variants.store_hints import StoreHints

#: name -> variant class, outermost first: the order of a drafter's ``variants`` (and of its saved config), in
#: which a hook two variants define is taken from the first that returns a value
#: (:func:`drafters.model.taken_over`).
REGISTRY: dict[str, type[Variant]] = {v.name: v for v in (Refine, StoreHints, LookupHints, CausalAnchor, Layerwise)}


def make_variants(spec: Mapping[str, Any] | None) -> dict[str, Variant]:
    """``{name: Variant}`` in :data:`REGISTRY`'s order from ``spec`` ({name: a Variant, an options dict or None});
    a ValueError names an unknown variant or option. (Their fit to a config: :func:`drafters.model.check_variants`.)"""
    spec = dict(spec or {})
    unknown = sorted(set(spec) - set(REGISTRY))
    if unknown:
        raise ValueError(f"unknown drafter variants {unknown}; registered: {list(REGISTRY)}")
    out = {}
    for name, klass in REGISTRY.items():
        if name not in spec:
            continue
        value = spec[name]
        if isinstance(value, klass):
            out[name] = value
            continue
        known = {f.name for f in dataclasses.fields(klass)}
        wrong = sorted(set(value or {}) - known)
        if wrong:
            raise ValueError(f"drafter variant {name!r}: unknown options {wrong}; known: {sorted(known)}")
        out[name] = klass(**(value or {}))
    return out


__all__ = ["REGISTRY", "CausalAnchor", "Layerwise", "LookupHints", "Refine", "StoreHints", "make_variants"]
