"""The layerwise context: drafter layer i reads the target's hidden state ``target_layer_ids[i]`` through its own
input norm (as the target's layer of that index reads its input), instead of DFlash's one fused context shared
by all layers. With the layers copied from the target (``init_layers_from_target``) the context keys/values start
as the target's own, and a drafter whose copied layers stay frozen can read them from the target's KV cache
(:mod:`drafters.shared_cache`). ``shifted``: slot k is read from block position k - 1, so the anchor's output
predicts the next token as the target's copied layers were trained to. Not servable as DFlash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from drafters.layers import rope_cos_sin
from drafters.model import Variant
from drafters.shared_cache import shareable_layers


@dataclass(frozen=True)
class Layerwise(Variant):
    name: ClassVar[str] = "layerwise"
    export_refusal: ClassVar[str] = ("layerwise (drafter layer i reads its own target hidden state; slots maybe "
                                     "shifted): DFlash has one fused context for all layers and reads slot k from "
                                     "block position k")
    fused_context: ClassVar[bool] = False  # each layer's input norm reads its own state
    shifted: bool = False  # slot k read from block position k - 1 (the anchor predicts slot 1)

    def check(self, config, variants) -> None:
        if len(config.target_layer_ids) != config.num_layers:
            raise ValueError(
                f"layerwise_context: each of the {config.num_layers} drafter layers reads one target hidden "
                f"state, but target_layer_ids {list(config.target_layer_ids)} lists {len(config.target_layer_ids)}")


    @staticmethod
    def default_layer_ids(num_layers: int, num_hidden_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers))  # layer i reads the input of the target's layer i

    def layer_sources(self, drafter) -> tuple[int, ...]:
        """Drafter layer i <- the target layer whose input it reads."""
        return drafter.target_layer_ids

    def context_kv(self, drafter, states, positions):
        """Layer i's keys/values of ``input_norm_i(states[i])``; states: L = num_layers x (Bt, S, H), or their
        concatenation (Bt, S, L*H)."""
        dtype, cfg = drafter.weight_ref.dtype, drafter.config
        if not isinstance(states, (list, tuple)):
            drafter._check_cached_width(states)
            states = states.split(cfg.hidden_size, dim=-1)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        return [layer.attn.key_value(layer.input_norm(h.to(dtype)), cos, sin) for layer, h in zip(drafter.layers, states)]

    def drafted_slots(self, drafter) -> slice:
        return slice(0, -1) if self.shifted else slice(1, None)

    def shareable_layers(self, drafter, cache):
        return shareable_layers(cache, drafter.target_layer_ids)
