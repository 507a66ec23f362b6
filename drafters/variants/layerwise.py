"""The layerwise context: drafter layer i reads the target's hidden state ``target_layer_ids[i]`` through its own
input norm (as the target's layer of that index reads its input), instead of DFlash's one fused context shared
by all layers. With the layers copied from the target (``init_layers_from_target``) the context keys/values start
as the target's own, and a drafter whose copied layers stay frozen can read them from the target's KV cache
(:mod:`drafters.shared_cache`). ``shifted``: slot k is read from block position k - 1, so the anchor's output
predicts the next token as the target's copied layers were trained to. Not servable as DFlash.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.layers import copy_target_layers, rope_cos_sin
from drafters.shared_cache import shareable_layers


@dataclass(frozen=True)
class LayerwiseOptions:
    shifted: bool = False  # slot k read from block position k - 1 (the anchor predicts slot 1)

    def check(self, config, variants) -> None:
        if len(config.target_layer_ids) != config.num_layers:
            raise ValueError(
                f"layerwise_context: each of the {config.num_layers} drafter layers reads one target hidden "
                f"state, but target_layer_ids {list(config.target_layer_ids)} lists {len(config.target_layer_ids)}")


class Layerwise:
    variant_name = "layerwise"
    Options = LayerwiseOptions
    requires: tuple[str, ...] = ()
    export_refusal = ("layerwise (drafter layer i reads its own target hidden state; slots maybe shifted): DFlash "
                      "has one fused context for all layers and reads slot k from block position k")

    def _build_context(self) -> None:  # no fused context: each layer's input norm reads its own state
        pass

    @classmethod
    def _default_layer_ids(cls, num_layers: int, num_hidden_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers))  # layer i reads the input of the target's layer i

    def _copy_target_layers(self, target) -> None:
        """Drafter layer i <- the target layer whose input it reads."""
        copy_target_layers(self, target, sources=self.target_layer_ids)

    def context_kv(self, states, positions):
        """Layer i's keys/values of ``input_norm_i(states[i])``; states: L = num_layers x (Bt, S, H), or their
        concatenation (Bt, S, L*H)."""
        dtype = self.weight_ref.dtype
        if not isinstance(states, (list, tuple)):
            self._check_cached_width(states)
            states = states.split(self.config.hidden_size, dim=-1)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        return [layer.attn.key_value(layer.input_norm(h.to(dtype)), cos, sin) for layer, h in zip(self.layers, states)]

    @property
    def drafted_slots(self) -> slice:
        return slice(0, -1) if self.variants["layerwise"].shifted else slice(1, None)

    def _shareable_layers(self, cache):
        return shareable_layers(cache, self.target_layer_ids)
