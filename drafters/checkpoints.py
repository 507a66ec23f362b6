"""Building, attaching, saving and loading drafters (the construction half of :class:`drafters.model.DFlashDrafter`).

A saved drafter is a folder: ``model.safetensors`` (the drafter's weights, never the target's embedding or
LM head) and ``config.json``: the core :class:`drafters.config.DrafterConfig`'s fields and ``variants``, the
options of each composed variant by name (:mod:`drafters.variants`). A ``config.json`` of an older blockdraft,
with the variants' switches as flat fields (``layerwise_context``, ``lookup_hints``, ...), loads into the
variants they name; a DFlash serving checkpoint (``architectures`` in its config) is converted by
:mod:`drafters.dflash`.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from drafters.checks import (
    WEIGHTS_KEY,
    check_dflash_fields,
    check_fields,
    check_target_weights,
    target_weights_sha1,
)
from drafters.config import (
    FINGERPRINT_KEYS,
    DrafterConfig,
    first_attr,
    target_final_norm_weight,
    target_fingerprint,
    target_sizes,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CORE_FIELDS = frozenset(f.name for f in dataclasses.fields(DrafterConfig)) - {"target_fingerprint"}


def _hf_config(target: nn.Module) -> Any:
    tcfg = getattr(target, "config", None)
    if tcfg is None:
        raise ValueError(f"target {type(target).__name__} has no .config; expected a HF causal LM")
    return tcfg


class CheckpointMixin:
    """``from_target``, ``attach_target``, ``save_pretrained``, ``from_pretrained`` and ``with_variant``."""

    @classmethod
    def from_target(cls, target: nn.Module, *, block_size: int = 16, num_layers: int = 1,
                    target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
                    init_from: str | Path | None = None, init_layers_from_target: bool = False,
                    allow_other_target: bool = False, gradient_checkpointing: bool = False, variants: Mapping[str, Any] | None = None,
                    **overrides: Any):
        """A freshly initialised drafter sized from ``target.config`` and attached to ``target``.

        ``variants``: ``{name: options}`` of :mod:`drafters.variants` to compose (e.g. ``{"layerwise":
        {"shifted": True}}``). ``overrides`` set other :class:`DrafterConfig` fields (num_heads, ...) or a
        variant's flat switch (``layerwise_context``, ``lookup_hints``, ...: :data:`drafters.variants.FLAT_KEYS`);
        a ``None`` value keeps the default.

        ``init_from``: a saved drafter (blockdraft or DFlash format) to start from instead of a fresh
        initialisation; the other arguments that are not None must equal its values.
        ``init_layers_from_target``: start the drafter's layers as copies of the target's layers.
        ``allow_other_target``: with ``init_from``, accept a checkpoint trained for a target with other weights
        (:func:`drafters.checks.check_target_weights`).
        """
        from drafters.variants import compose, split_flat

        core, variants = split_flat({k: v for k, v in overrides.items() if v is not None}, variants, cls.variant_names)
        unknown = sorted(set(core) - CORE_FIELDS)
        if unknown:
            raise ValueError(f"unknown drafter overrides {unknown}; allowed: {sorted(CORE_FIELDS)} and the "
                             "variants' switches (drafters.variants.FLAT_KEYS)")
        if init_from is not None:
            return _from_checkpoint(target, init_from, dict(core, block_size=block_size, target_layer_ids=target_layer_ids,
                                    mask_token_id=mask_token_id), variants, num_layers,
                                    allow_other_target).set_gradient_checkpointing(
                                        gradient_checkpointing)
        klass = compose(variants)
        tcfg = _hf_config(target)
        sizes = target_sizes(tcfg)
        if target_layer_ids is None:
            target_layer_ids = klass._default_layer_ids(num_layers, sizes["num_hidden_layers"])
        if mask_token_id is None:
            mask_token_id = first_attr(tcfg, ["mask_token_id"], sizes["vocab_size"] - 1)
        fields = {k: v for k, v in sizes.items() if k != "num_hidden_layers"}
        fingerprint = target_fingerprint(tcfg)
        fingerprint[WEIGHTS_KEY] = target_weights_sha1(target)  # which weights it is trained for (drafters/checks.py)
        fields.update(block_size=block_size, num_layers=num_layers, target_layer_ids=tuple(target_layer_ids),
                      mask_token_id=int(mask_token_id), target_fingerprint=fingerprint, **core)
        drafter = klass.build(DrafterConfig(**fields), variants).attach_target(target)
        # The output norm starts as the target's final norm, so the shared LM head sees inputs at the scale it
        # was trained on and the drafter can be as confident as the target from step 1 (a norm shrunk below
        # it caps the logit scale, and CE under a capped scale collapses onto frequent tokens).
        final_norm = target_final_norm_weight(target)
        with torch.no_grad():
            if final_norm is not None and final_norm.shape == drafter.norm.weight.shape:
                drafter.norm.weight.copy_(final_norm.float())
        if init_layers_from_target:
            drafter._copy_target_layers(target)
        drafter._after_init()
        return drafter.set_gradient_checkpointing(gradient_checkpointing)

    @classmethod
    def build(cls, config: DrafterConfig, variants: Mapping[str, Any] | None = None):
        """A fresh drafter of ``config`` with ``variants`` (``{name: options}``), not attached to a target."""
        from drafters.variants import compose, options_of

        klass = compose(variants or {})
        return klass(config, options_of(klass, variants or {}, config))

    def attach_target(self, target: nn.Module):
        """Use ``target``'s input embedding and LM head (frozen in place); checks it fits the drafter."""
        tcfg = _hf_config(target)
        theirs, ours = target_fingerprint(tcfg), self.config.target_fingerprint
        diffs = [f"{k}: drafter was built for {ours.get(k)!r}, target has {theirs[k]!r}"
                 for k in FINGERPRINT_KEYS if ours.get(k) != theirs[k]]
        if diffs:
            raise ValueError("target does not match the drafter's target fingerprint: " + "; ".join(diffs))
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"target {type(target).__name__} lacks an input embedding or an LM head")
        if embed.weight.shape[1] != self.config.hidden_size or head.weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"target embedding {tuple(embed.weight.shape)} / LM head {tuple(head.weight.shape)} do not "
                f"fit hidden_size {self.config.hidden_size} and vocab_size {self.config.vocab_size}")
        self._check_target_outputs(target)
        embed.requires_grad_(False)
        head.requires_grad_(False)
        object.__setattr__(self, "_target", target)
        return self

    def _check_target_outputs(self, target: nn.Module) -> None:
        """Run the target on one token and check it returns enough hidden states of the right width."""
        param = next(target.parameters(), None)
        probe = torch.zeros(1, 1, dtype=torch.long, device=param.device if param is not None else "cpu")
        with torch.no_grad():
            out = target(input_ids=probe, output_hidden_states=True, use_cache=False)
        states = getattr(out, "hidden_states", None)
        if states is None:
            raise ValueError(f"target {type(target).__name__} returned no hidden_states for output_hidden_states=True; "
                             "the drafter needs the target's per-layer hidden states")
        bad = [i for i in self.config.target_layer_ids if not 0 <= i < len(states)]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for {len(states)} target hidden states")
        widths = {states[i].shape[-1] for i in self.config.target_layer_ids}
        if widths != {self.config.hidden_size}:
            raise ValueError(f"target hidden states have widths {widths}, expected {self.config.hidden_size}")

    # ---- saving -----------------------------------------------------------------------------------

    def saved_config(self) -> dict[str, Any]:
        """What ``config.json`` holds: the core config's fields and ``variants`` ({name: options})."""
        return self.config.to_dict() | {"variants": {n: dataclasses.asdict(o) for n, o in self.variants.items()}}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``model.safetensors`` (drafter weights only), ``config.json`` and any variant's files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME))
        (directory / CONFIG_NAME).write_text(json.dumps(self.saved_config(), indent=2) + "\n")
        self._save_extras(directory)

    def _save_extras(self, directory: Path) -> None:
        """Files a variant keeps beside the weights (the hint store)."""

    def _load_extras(self, directory: Path) -> None:
        """Read what :meth:`_save_extras` wrote."""

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: nn.Module | None = None, allow_other_target: bool = False):
        """Load a saved drafter (its variants from its config); with ``target``, attach it (refused if its
        fingerprint differs, or its weights are not those the drafter was trained for unless
        ``allow_other_target``: :func:`drafters.checks.check_target_weights`). A DFlash serving checkpoint is converted (:func:`drafters.dflash.load_dflash`,
        needs ``target``). Returned in eval mode, as transformers' ``from_pretrained`` does."""
        from drafters.locks import check_safetensors, read_json
        from drafters.variants import read_saved_config

        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"drafter directory {directory} does not exist")
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"drafter directory {directory} has no {name}")
        raw = read_json(directory / CONFIG_NAME, "drafter config")  # a damaged file is named
        check_safetensors(directory / WEIGHTS_NAME)
        if "architectures" in raw or "dflash_config" in raw:  # a HF-style config: the DFlash format
            from drafters.dflash import load_dflash

            check_dflash_fields(raw, directory / CONFIG_NAME)
            drafter = load_dflash(directory, target).eval()
            check_target_weights(drafter.config.target_fingerprint, target, directory, allow_other_target)
            return drafter
        check_fields(DrafterConfig, raw, directory / CONFIG_NAME)  # a wrongly typed field is named
        config, variants = read_saved_config(raw, directory / CONFIG_NAME)
        drafter = cls.build(config, variants)
        drafter.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=True)
        drafter._load_extras(directory)
        if target is not None:
            drafter.attach_target(target)
            check_target_weights(config.target_fingerprint, target, directory, allow_other_target)
        return drafter.eval()

    def with_variant(self, name: str, **options: Any):
        """This drafter (same weights, target and mode) with variant ``name`` and these options, added or
        replacing its current ones; validated as at construction. For variants that add no weights
        (``refine``: passes at decoding time)."""
        return self._rebuilt({**self.variants, name: options})

    def without_variant(self, name: str):
        """This drafter (same weights, target and mode) without variant ``name`` (one that adds no weights)."""
        return self._rebuilt({k: v for k, v in self.variants.items() if k != name})

    def _rebuilt(self, variants: Mapping[str, Any]):
        drafter = self.build(self.config, variants)
        drafter.load_state_dict(self.state_dict(), strict=True)
        for key in ("hint_store",):
            if hasattr(self, key):
                setattr(drafter, key, getattr(self, key))
        if self._target is not None:
            object.__setattr__(drafter, "_target", self._target)
        return drafter.to(self.weight_ref).train(self.training)


def _from_checkpoint(target: nn.Module, path: str | Path, given: dict[str, Any], variants: Mapping[str, Any],
                     num_layers: int | None, allow_other_target: bool = False):
    """``from_target(..., init_from=path)``: the saved drafter at ``path`` attached to ``target``.

    The checkpoint fixes the architecture. ``num_layers`` is the fresh-initialisation size, so a
    different value is only warned about; every other given value that is not None (core fields, variants)
    must equal the checkpoint's, else the call is refused naming the field.
    """
    from drafters.model import DFlashDrafter
    from drafters.variants import compose, options_of

    drafter = DFlashDrafter.from_pretrained(path, target=target, allow_other_target=allow_other_target)
    cfg = drafter.config
    cfg.target_fingerprint[WEIGHTS_KEY] = target_weights_sha1(target)  # trained from here on for this target
    given = {k: v for k, v in given.items() if v is not None}
    if "target_layer_ids" in given:
        given["target_layer_ids"] = tuple(int(i) for i in given["target_layer_ids"])
    diffs = [f"drafter.{k}={v!r} but the checkpoint has {k}={getattr(cfg, k)!r}"
             for k, v in given.items() if v != getattr(cfg, k)]
    if variants:
        wanted = options_of(compose(variants), variants, cfg)
        if wanted != drafter.variants:
            diffs.append(f"drafter variants {wanted} but the checkpoint has {drafter.variants}")
    if diffs:
        raise ValueError(f"drafter.init_from={path}: " + "; ".join(diffs)
                         + " (set these to the checkpoint's values or to null)")
    if num_layers is not None and num_layers != cfg.num_layers:
        warnings.warn(f"drafter.init_from={path}: using its {cfg.num_layers} layers "
                      f"(drafter.num_layers={num_layers} applies to fresh drafters only)", stacklevel=3)
    return drafter.train()  # a training start, like from_target's fresh drafters
