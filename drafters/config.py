"""DrafterConfig, and what a drafter reads from its target's Hugging Face config.

:func:`target_sizes` reads the sizes a fresh drafter copies (Llama/Qwen or GPT-2 names);
:func:`target_fingerprint` is what a trained drafter depends on, saved in its config and compared
when it is attached to a target or resumed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from drafters.checks import check_target_config

FINGERPRINT_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
MAX_DEFAULT_TARGET_LAYERS = 5


@dataclass
class DrafterConfig:
    """The core (DFlash) drafter's shape: exactly what the DFlash serving format expresses; saved as
    ``config.json`` next to the weights, with the options of any variant (:mod:`drafters.variants`) beside it."""

    block_size: int  # B: anchor slot + K = B - 1 drafted slots
    num_layers: int
    hidden_size: int  # must equal the target's hidden size (shared embedding and LM head)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # indices into the target's hidden_states tuple (0 = embeddings)
    target_fingerprint: dict[str, Any] = field(default_factory=dict)  # FINGERPRINT_KEYS of the target
    # Qwen3 / DFlash layer details (what the DFlash serving format needs, drafters/dflash.py):
    qk_norm: bool = True  # per-head RMSNorm of queries and keys (context keys included) before RoPE
    attention_bias: bool = False  # biases on the q/k/v/o projections
    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        missing = [k for k in FINGERPRINT_KEYS if k not in self.target_fingerprint]
        if missing:
            raise ValueError(f"target_fingerprint lacks {missing}; expected keys {list(FINGERPRINT_KEYS)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self.vocab_size != self.target_fingerprint["vocab_size"]:
            raise ValueError(
                f"vocab_size {self.vocab_size} != target vocab_size {self.target_fingerprint['vocab_size']}"
            )
        if self.hidden_size != self.target_fingerprint["hidden_size"]:
            raise ValueError(
                f"hidden_size {self.hidden_size} must equal the target's hidden size "
                f"{self.target_fingerprint['hidden_size']} (the drafter shares its embedding and LM head)"
            )
        num_states = self.target_fingerprint["num_hidden_layers"] + 1
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must list at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_states]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} out of range: the target has {num_states} hidden states "
                f"(0 = embeddings .. {num_states - 1} = last layer)"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Rebuild a saved config (older ones: :func:`drafters.factory.upgrade_saved_config` first)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DrafterConfig keys {unknown}; known: {sorted(names)}")
        return cls(**d)


def target_fingerprint(target_config: Any) -> dict[str, Any]:
    """The fields of a target's config that a trained drafter depends on."""
    sizes = target_sizes(target_config)
    return {
        "model_type": getattr(target_config, "model_type", None) or type(target_config).__name__,
        "vocab_size": sizes["vocab_size"],
        "hidden_size": sizes["hidden_size"],
        "num_hidden_layers": sizes["num_hidden_layers"],
    }


def check_target(config: DrafterConfig, target: nn.Module) -> tuple[nn.Module, nn.Module]:
    """That ``target`` fits a drafter of ``config``: a Hugging Face causal LM with its fingerprint
    (:data:`FINGERPRINT_KEYS`), an input embedding and LM head of the drafter's sizes, and the hidden states
    ``config.target_layer_ids`` names, at the drafter's width (one token run through it). Returns the embedding
    and the head; a ValueError names what does not fit."""
    tcfg = getattr(target, "config", None)
    if tcfg is None:
        raise ValueError(f"target {type(target).__name__} has no .config; expected a HF causal LM")
    theirs, ours = target_fingerprint(tcfg), config.target_fingerprint
    diffs = [f"{k}: drafter was built for {ours.get(k)!r}, target has {theirs[k]!r}"
             for k in FINGERPRINT_KEYS if ours.get(k) != theirs[k]]
    if diffs:
        raise ValueError("target does not match the drafter's target fingerprint: " + "; ".join(diffs))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if embed is None or head is None:
        raise ValueError(f"target {type(target).__name__} lacks an input embedding or an LM head")
    if embed.weight.shape[1] != config.hidden_size or head.weight.shape[0] != config.vocab_size:
        raise ValueError(
            f"target embedding {tuple(embed.weight.shape)} / LM head {tuple(head.weight.shape)} do not "
            f"fit hidden_size {config.hidden_size} and vocab_size {config.vocab_size}")
    _check_target_outputs(config, target)
    return embed, head


def _check_target_outputs(config: DrafterConfig, target: nn.Module) -> None:
    """Run the target on one token and check it returns enough hidden states of the right width."""
    param = next(target.parameters(), None)
    probe = torch.zeros(1, 1, dtype=torch.long, device=param.device if param is not None else "cpu")
    with torch.no_grad():
        out = target(input_ids=probe, output_hidden_states=True, use_cache=False)
    states = getattr(out, "hidden_states", None)
    if states is None:
        raise ValueError(f"target {type(target).__name__} returned no hidden_states for output_hidden_states=True; "
                         "the drafter needs the target's per-layer hidden states")
    bad = [i for i in config.target_layer_ids if not 0 <= i < len(states)]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for {len(states)} target hidden states")
    widths = {states[i].shape[-1] for i in config.target_layer_ids}
    if widths != {config.hidden_size}:
        raise ValueError(f"target hidden states have widths {widths}, expected {config.hidden_size}")


def target_final_norm_weight(target: nn.Module) -> torch.Tensor | None:
    """The weight of the target's final norm (Llama/Qwen ``model.norm``, GPT-2 ``transformer.ln_f``)."""
    base = getattr(target, "base_model", target)
    for name in ("norm", "ln_f", "final_layernorm"):
        module = getattr(base, name, None)
        if module is not None and getattr(module, "weight", None) is not None:
            return module.weight.detach()
    return None


def default_target_layer_ids(
    num_hidden_layers: int, max_layers: int = MAX_DEFAULT_TARGET_LAYERS
) -> tuple[int, ...]:
    """Up to ``max_layers`` indices into the hidden_states tuple spread evenly over layers 1..L-1.

    The last state (index L) is left out: Hugging Face returns it after the final norm, and serving
    engines that capture layer inputs (vLLM) cannot produce it, so a drafter reading it could not be
    served. On the tiny target, layers (1..5) and (1, 2, 4, 5, 6) train alike (slot-1 accuracy 0.225
    vs 0.231 after 200 steps). A one-layer target has only its final state to offer.
    """
    last = max(1, num_hidden_layers - 1)
    n = max(1, min(max_layers, last))
    if n == 1:
        return (last,)
    step = (last - 1) / (n - 1)
    return tuple(sorted({round(1 + i * step) for i in range(n)}))


def accepts_argument(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a keyword ``name`` (e.g. a target's forward and ``logits_to_keep``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def first_attr(config: Any, names: Sequence[str], default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _rope_theta(config: Any) -> float:
    """The target's RoPE base (transformers 5 keeps it in ``rope_parameters``), 10000 if it has none."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        for sub in params.values():  # per-layer-type parameters, e.g. {"full_attention": {...}}
            if isinstance(sub, dict) and "rope_theta" in sub:
                return float(sub["rope_theta"])
    return float(first_attr(config, ["rope_theta"], 10000.0))


def target_sizes(config: Any) -> dict[str, Any]:
    """Sizes read from a HF config (Llama/Qwen names, or GPT-2's n_embd / n_layer / n_head)."""
    if hasattr(config, "get_text_config"):  # multimodal configs nest the language model's config
        config = config.get_text_config()
    check_target_config(config)  # a wrongly typed field is named
    hidden = first_attr(config, ["hidden_size", "n_embd", "d_model"])
    layers = first_attr(config, ["num_hidden_layers", "n_layer"])
    heads = first_attr(config, ["num_attention_heads", "n_head"])
    vocab = first_attr(config, ["vocab_size"])
    missing = [n for n, v in [("hidden_size", hidden), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)] if v is None]
    if missing:
        raise ValueError(f"target config {type(config).__name__} lacks {missing}")
    kv_heads = first_attr(config, ["num_key_value_heads"], heads)
    head_dim = first_attr(config, ["head_dim"], hidden // heads)
    return {
        "hidden_size": int(hidden),
        "num_hidden_layers": int(layers),
        "num_heads": int(heads),
        "num_kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "intermediate_size": int(first_attr(config, ["intermediate_size", "n_inner"], 4 * hidden)),
        "rms_norm_eps": float(first_attr(config, ["rms_norm_eps", "layer_norm_epsilon"], 1e-6)),
        "rope_theta": _rope_theta(config),
        "vocab_size": int(vocab),
    }

