"""The DFlash block drafter, attached to a frozen Hugging Face causal LM.

Shapes: Bt = batch rows, S = context columns, A = blocks (anchors) per row, B = block size,
K = B - 1 drafted tokens per block, H = hidden size (equal to the target's), V = vocabulary,
L = number of selected target layers.

One block is ``[anchor, MASK x K]`` at the target's absolute positions ``p..p+K`` of the anchor and
the K tokens after it. The drafter never sees the context tokens directly: it sees the target's
hidden states of every column strictly before the anchor, through

    context = RMSNorm(Linear_noBias(concat(h_l for l in target_layer_ids)))        # (Bt, S, H)

which every drafter layer projects with its own k/v projections into extra keys/values (the block
slots use the same projections for their own keys/values). Queries come from block slots only,
attention inside a block is bidirectional, and blocks never see each other. Slot k (k = 1..K) is
read from block position k. The target's input embedding and LM head are used frozen and are never
part of the drafter's state dict.

Training (:meth:`DFlashDrafter.forward_train`) and drafting (reset / extend / draft / select_rows, below it)
run the same layer (:class:`drafters.layers.DrafterLayer`) over the keys/values of
:meth:`DFlashDrafter.context_kv`, and the same LM head (:meth:`DFlashDrafter.head`).

Drafting appends each committed column's context keys/values once (:meth:`DFlashDrafter.extend`, into a
:class:`drafters.draft_cache.DraftCache`), so a draft step runs the B block slots only. How many slots a step
verifies, and whether a row copies a lookup hint instead, is decoding policy (:class:`drafters.policy.PolicyDrafter`).

Without variants this class is the DFlash drafter: what the DFlash serving format expresses
(:mod:`drafters.dflash`). Research variants (layerwise context, lookup hints, anchor policies, refinement;
:mod:`drafters.variants`) are :class:`Variant` objects the drafter holds in ``variants``; each takes over a few
hooks of the core (the methods of :class:`Variant`; the core's methods that call one are marked "hook").
Building, loading and the same-config check: :mod:`drafters.factory`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from drafters.config import DrafterConfig, check_target
from drafters.draft_cache import DraftCache
from drafters.integrity import write_record
from drafters.layers import (
    BlockContext,
    CachedContext,
    DrafterLayer,
    RMSNorm,
    build_block_attention_mask,
    copy_target_layers,
    draft_block_mask,
    rope_cos_sin,
)
from verify import hf as verify_hf
from verify.rejection import sample_tokens, warp_probs

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
T = TypeVar("T")


@dataclass(frozen=True)
class Variant:
    """A research variant: its options (the dataclass fields, its entry under ``variants`` in ``config.json``) and
    the hooks of :class:`DFlashDrafter` it takes over: the methods below, each taking the drafter first.
    Subclasses: :mod:`drafters.variants`.

    A hook that returns a value takes over the core's computation where it returns something other than
    None: the drafter asks its variants outermost first (:data:`drafters.variants.REGISTRY`'s order) and uses
    the first value that is not None, else its own (:func:`taken_over`). ``after_init``, ``save_extras`` and
    ``load_extras`` run on every variant in that order."""

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()  # the variants it needs beside it
    export_refusal: ClassVar[str] = ""  # why the DFlash format cannot express it
    fused_context: ClassVar[bool] = True  # False: no fused context (fuse, fuse_norm) is built

    def check(self, config: DrafterConfig, variants: Mapping[str, Variant]) -> None:
        """Refuse options that do not fit ``config`` or the other variants (a ValueError naming the field)."""

    @staticmethod
    def default_layer_ids(num_layers: int, num_hidden_layers: int) -> tuple[int, ...] | None:
        """The target layers a new drafter of ``num_layers`` reads by default; None: DFlash's spread."""
        return None

    # ---- building and saving ------------------------------------------------------------------------

    def new_layer(self, drafter: DFlashDrafter) -> nn.Module | None:
        """A new drafter layer (called ``num_layers`` times in ``__init__``); None: :class:`DrafterLayer`."""
        return None

    def after_init(self, drafter: DFlashDrafter) -> None:
        """Adjust the drafter at the end of ``__init__`` and after a warm start (from_target)."""

    def layer_sources(self, drafter: DFlashDrafter) -> tuple[int, ...] | None:
        """The target layer each drafter layer is copied from at a warm start; None: layer i from layer i."""
        return None

    def save_extras(self, drafter: DFlashDrafter, directory: Path) -> None:
        """Write the variant's own files beside the weights (:meth:`DFlashDrafter.save_pretrained`)."""

    def load_extras(self, drafter: DFlashDrafter, directory: Path) -> None:
        """Read back what :meth:`save_extras` wrote (:func:`drafters.factory.load`)."""

    # ---- the forward --------------------------------------------------------------------------------

    def context_kv(self, drafter: DFlashDrafter, states: Sequence[torch.Tensor] | torch.Tensor,
                   positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per-layer context keys/values (:meth:`DFlashDrafter.context_kv`); None: the fused context's."""
        return None

    def drafted_slots(self, drafter: DFlashDrafter) -> slice | None:
        """The block positions whose outputs are the drafts; None: 1..B-1."""
        return None

    def own_mask(self, drafter: DFlashDrafter, block_size: int, device) -> torch.Tensor | None:
        """(B, B) bool: which slots of its own block each slot sees; None: all of them."""
        return None

    def slot_ids(self, drafter: DFlashDrafter, ids: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                 prompt_len: torch.Tensor | None = None) -> torch.Tensor | None:
        """Training's input tokens (Bt, A, K) of block slots 1..K; None: MASK."""
        return None

    def train_logits(self, drafter: DFlashDrafter, anchor_ids, anchor_positions, kv, mask, slot_ids,
                     vocab_ids=None, width: int | None = None) -> torch.Tensor | None:
        """Teacher-forced logits (Bt, A, K, V); None: one :meth:`DFlashDrafter.block_logits` pass."""
        return None

    # ---- drafting -----------------------------------------------------------------------------------

    def shareable_layers(self, drafter: DFlashDrafter, cache) -> list | None:
        """The target cache's layers holding the drafter's context keys/values; None: not shareable."""
        return None

    def slot_inputs(self, drafter: DFlashDrafter, ids: torch.Tensor,
                    columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Fill slots 1.. of a drafting block's ``ids`` in place, return its ``Block.hints``; None: MASK."""
        return None

    def block_passes(self, drafter: DFlashDrafter, ids, cos, sin, columns: int, mask,
                     kv) -> torch.Tensor | None:
        """A drafting block's drafted states (B, K', H); None: one :meth:`DFlashDrafter.block_pass`."""
        return None

    def source_labels(self, drafter: DFlashDrafter, block: Block,
                      copied: torch.Tensor | None) -> list[str] | None:
        """Per row of ``block``, what drafts it; None: unlabelled (the drafter drafts every row)."""
        return None


def taken_over(values: Iterable[T | None]) -> T | None:
    """The first of the variants' hook values (lazily, outermost first) that is not None: the variant that
    takes the hook over; None: none does, the core computes it."""
    return next((value for value in values if value is not None), None)


def check_variants(config: DrafterConfig, variants: Mapping[str, Variant]) -> None:
    """Each variant under its own name, with those it requires, and its options checked."""
    wrong = [f"{n}: {type(v).__name__}" for n, v in variants.items() if not isinstance(v, Variant) or v.name != n]
    if wrong:
        raise ValueError(f"drafter variants must be Variant objects under their names, got {wrong}")
    missing = [f"{n} needs {r}" for n, v in variants.items() for r in v.requires if r not in variants]
    if missing:
        raise ValueError("drafter variants: " + "; ".join(missing))
    for variant in variants.values():
        variant.check(config, variants)


def saved_config(config: DrafterConfig, variants: Mapping[str, Variant]) -> dict[str, Any]:
    """A drafter's ``config.json``: the core config's fields and ``variants`` ({name: options})."""
    return config.to_dict() | {"variants": {n: dataclasses.asdict(v) for n, v in variants.items()}}


class Block(NamedTuple):
    """One block per row at drafting, as the drafter's layers read it (:meth:`DFlashDrafter.block_inputs`)."""

    ids: torch.Tensor  # (B, N) long: anchor, then MASK or a slot input (lookup hint) in each slot
    cos: torch.Tensor  # (B, N, d) RoPE
    sin: torch.Tensor  # (B, N, d)
    columns: int  # cached columns before the block
    mask: torch.Tensor  # (B, 1, 1 or N, columns + N) bool: the keys each slot sees
    #: Slot inputs of variants that read them (lookup hints): ``(hints (B, K), ngram (B,), from_store (B,) bool)``
    #: over all K slots, else None.
    hints: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def propose(logits: torch.Tensor, temperature: float, top_k, top_p, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts from slot logits (B, W, V): ``(argmax (B, W), None)`` at temperature 0, else ``(tokens drawn from
    q, q (B, W, V) float32)`` with q the warped distributions. Slots of a block are conditionally independent
    given the context (one forward pass), so ``tokens[:, k]`` is a draw from ``q[:, k]`` given the drafts before it."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = warp_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return sample_tokens(q, generator), q


class DFlashDrafter(nn.Module):
    """DFlash-style block drafter; implements the :class:`verify.drafter.Drafter` protocol."""

    #: The store_hints variant's n-gram store of training answers (:class:`drafters.variants.hint_lookup.HintStore`; set by
    #: training, saved and loaded beside the weights); None for other drafters.
    hint_store = None

    def __init__(self, config: DrafterConfig, variants: Mapping[str, Variant] | None = None) -> None:
        super().__init__()
        self.config = config
        #: The composed variants by name, outermost first (:data:`drafters.variants.REGISTRY`'s order).
        self.variants = dict(variants or {})
        check_variants(config, self.variants)
        if all(v.fused_context for v in self.variants.values()):  # DFlash: one fused context for every layer
            h = config.hidden_size
            self.fuse = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
            self.fuse_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(self._new_layer() for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                # std 1/sqrt(fan_in): each layer's output has the scale of its input, so the block
                # states are not dominated by the constant MASK embedding (see drafters.factory.from_target).
                nn.init.normal_(module.weight, std=module.in_features ** -0.5)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.after_init()
        # The frozen target, kept outside the module tree: not in state_dict(), parameters() or .to().
        object.__setattr__(self, "_target", None)
        self._cache: DraftCache | None = None  # drafting's columns, from reset

    # ---- variants ---------------------------------------------------------------------------------

    def _new_layer(self) -> nn.Module:
        """A new drafter layer: :class:`DrafterLayer`, or a variant's (anchor: :meth:`Variant.new_layer`)."""
        layer = taken_over(v.new_layer(self) for v in self.variants.values())
        return layer if layer is not None else DrafterLayer(self.config)

    @property
    def variant_names(self) -> tuple[str, ...]:
        return tuple(self.variants)

    def after_init(self) -> None:
        """Called at the end of ``__init__`` and after a warm start (from_target): each variant's
        :meth:`Variant.after_init` (anchor)."""
        for variant in self.variants.values():
            variant.after_init(self)

    def with_variants(self, variants: Mapping[str, Variant]) -> DFlashDrafter:
        """This drafter (same weights, hint store, target and mode) with ``variants`` instead of its own: for
        variants that add no weights (``refine``: passes at decoding time; :func:`drafters.factory.with_variant`)."""
        drafter = DFlashDrafter(self.config, variants)
        drafter.load_state_dict(self.state_dict(), strict=True)
        drafter.hint_store = self.hint_store
        object.__setattr__(drafter, "_target", self._target)
        return drafter.to(self.weight_ref).train(self.training)

    # ---- protocol attributes ----------------------------------------------------------------------

    @property
    def num_draft_tokens(self) -> int:
        return self.config.block_size - 1

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def weight_ref(self) -> torch.Tensor:
        """A parameter that every drafter has (the output norm's weight): its dtype and device are the drafter's."""
        return self.norm.weight

    @property
    def drafted_slots(self) -> slice:
        """The block positions whose outputs are the K drafts: 1..B-1 (DFlash); hook (layerwise, shifted)."""
        slots = taken_over(v.drafted_slots(self) for v in self.variants.values())
        return slots if slots is not None else slice(1, None)

    def own_mask(self, block_size: int, device) -> torch.Tensor | None:
        """(B, B) bool: which slots of its own block each slot sees; None: all (DFlash); hook (anchor)."""
        return taken_over(v.own_mask(self, block_size, device) for v in self.variants.values())

    def set_gradient_checkpointing(self, enabled: bool = True) -> DFlashDrafter:
        """Recompute each drafter layer's activations in the backward pass (``torch.utils.checkpoint``)
        instead of storing them: less memory per training step for one more forward of the layers; the
        gradients are the same. Inference is unaffected. Returns the drafter."""
        for layer in self.layers:
            layer.gradient_checkpointing = bool(enabled)
        return self

    # ---- the target -------------------------------------------------------------------------------

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("no target attached: call drafter.attach_target(target) first")
        return self._target

    def attach_target(self, target: nn.Module) -> DFlashDrafter:
        """Use ``target``'s input embedding and LM head (frozen in place), once :func:`drafters.config.check_target`
        found that it fits the drafter."""
        embed, head = check_target(self.config, target)
        embed.requires_grad_(False)
        head.requires_grad_(False)
        object.__setattr__(self, "_target", target)
        return self

    def copy_target_layers(self, target: nn.Module) -> None:
        """Warm start (``init_layers_from_target``): drafter layer i <- the target's layer i, or (hook,
        layerwise) the target layer whose input it reads."""
        sources = taken_over(v.layer_sources(self) for v in self.variants.values())
        copy_target_layers(self, target, sources=sources)

    # ---- saving -----------------------------------------------------------------------------------

    def saved_config(self) -> dict[str, Any]:
        """What ``config.json`` holds: :func:`saved_config`."""
        return saved_config(self.config, self.variants)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``model.safetensors`` (drafter weights only), ``config.json``, any variant's files, and the
        record of their sha256 and of the saved config (:func:`drafters.integrity.write_record`)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        config = self.saved_config()
        save_file(state, str(directory / WEIGHTS_NAME))
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for variant in self.variants.values():
            variant.save_extras(self, directory)
        write_record(directory, config, [p.name for p in directory.glob("*.safetensors")])

    # ---- the forward shared by training and drafting ----------------------------------------------

    def _check_cached_width(self, states: torch.Tensor) -> None:
        width = len(self.target_layer_ids) * self.config.hidden_size
        if states.shape[-1] != width:
            raise ValueError(f"cached features have width {states.shape[-1]}, expected {width} "
                             f"(target_layer_ids {self.target_layer_ids} x hidden {self.config.hidden_size})")

    def context_kv(self, states: Sequence[torch.Tensor] | torch.Tensor, positions: torch.Tensor):
        """Per-layer rotated keys/values, num_layers x ((Bt, h_kv, S, d), (Bt, h_kv, S, d)), of the
        context columns from their selected target hidden states: L x (Bt, S, H), or their
        concatenation (Bt, S, L*H) as :mod:`drafters.training.features` caches it.

        ``context = RMSNorm(fuse(concat(states)))`` (Bt, S, H), the same for every layer. It depends only on
        the columns themselves: drafting computes it once per column and caches the keys/values.
        """
        kv = taken_over(v.context_kv(self, states, positions) for v in self.variants.values())
        if kv is not None:  # layerwise: each layer reads its own state
            return kv
        dtype = self.weight_ref.dtype
        if isinstance(states, torch.Tensor):
            self._check_cached_width(states)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        x = states.to(dtype) if isinstance(states, torch.Tensor) else torch.cat([s.to(dtype) for s in states], -1)
        context = self.fuse_norm(self.fuse(x))  # (Bt, S, H)
        return [layer.attn.key_value(context, cos, sin) for layer in self.layers]

    def head(self, states: torch.Tensor, vocab_ids: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's frozen LM head on drafter states (..., H) -> logits (..., V) float32.

        ``vocab_ids`` (V',) long: the logits of those tokens only (..., V'), the columns ``vocab_ids`` of the
        full logits (a training step over a frequent-token subset); None = the whole vocabulary. ``rows`` (V', H):
        the head's weight rows of ``vocab_ids`` gathered beforehand (a decoding policy keeps its candidates'; at a
        few slots gathering them costs several times the product)."""
        head = self.target.get_output_embeddings()
        x = states.reshape(-1, states.shape[-1]).to(head.weight.dtype)  # one plain matmul
        if vocab_ids is None:
            plain = type(head) is nn.Linear and head.bias is None  # verify.hf.linear_logits: the fast product on CPU
            out = verify_hf.linear_logits(head.weight, x) if plain else head(x)
        else:
            bias = getattr(head, "bias", None)
            weight = head.weight[vocab_ids] if rows is None else rows
            out = F.linear(x, weight, None if bias is None else bias[vocab_ids])
        return out.view(*states.shape[:-1], out.shape[-1]).float()

    def block_ids(self, anchor_ids: torch.Tensor, slot_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Block tokens (..., B): the anchor (...,) long, then ``slot_ids`` (..., K) or MASK x K."""
        ids = anchor_ids.new_full((*anchor_ids.shape, self.config.block_size), self.config.mask_token_id)
        ids[..., 0] = anchor_ids
        if slot_ids is not None:
            ids[..., 1:] = slot_ids
        return ids

    def block_logits(self, anchor_ids, anchor_positions, kv, mask, slot_ids=None,
                     vocab_ids: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """Logits (Bt, A, K, V) of blocks ``[anchor, slot_ids]`` (default ``[anchor, MASK x K]``).

        anchor_ids, anchor_positions: (Bt, A) long; kv: from :meth:`context_kv` over S columns;
        mask: (Bt, 1, A*B, S + A*B) bool from :meth:`training_mask`; slot_ids: (Bt, A, K) long from
        :meth:`slot_ids`; vocab_ids: see :meth:`head` (then (Bt, A, K, V')); width: blocks of W + 1 columns, as
        :meth:`block_inputs` drafts them (and vLLM with W speculative tokens): slots past W are seen by none.
        """
        bt, num_blocks = anchor_ids.shape
        bs = self.config.block_size
        ids = self.block_ids(anchor_ids, slot_ids)  # (Bt, A, B)
        x = self.target.get_input_embeddings()(ids.view(bt, num_blocks * bs)).to(self.weight_ref.dtype)
        offsets = torch.arange(bs, device=anchor_positions.device)
        positions = (anchor_positions.unsqueeze(-1) + offsets).view(bt, num_blocks * bs)  # (Bt, A*B)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        own = self.own_mask(bs, x.device)
        if width is not None:  # a block of width + 1 columns: the later slots are keys no slot sees
            seen = (offsets <= width).expand(bs, bs)
            own = seen if own is None else own & seen
        for layer, (ctx_k, ctx_v) in zip(self.layers, kv):
            x = layer(x, cos, sin, BlockContext(ctx_k, ctx_v, mask, bs, own), bs)  # (Bt, A*B, H)
        # (Bt, A, K, H): the drafted slots, made contiguous so the head runs as one plain matmul
        x = self.norm(x).view(bt, num_blocks, bs, -1)[:, :, self.drafted_slots].contiguous()
        return self.head(x, vocab_ids)  # (Bt, A, K, V)

    def training_mask(self, anchors, seq: int, context_mask=None, anchor_mask=None) -> torch.Tensor:
        """(Bt, 1, A*B, S + A*B) bool: :func:`build_block_attention_mask` under :meth:`own_mask`."""
        own = self.own_mask(self.config.block_size, anchors.device)
        return build_block_attention_mask(anchors, self.config.block_size, seq, context_mask, anchor_mask,
                                          causal_anchor=own is not None)

    # ---- training ---------------------------------------------------------------------------------

    def slot_ids(self, ids: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                 prompt_len: torch.Tensor | None = None) -> torch.Tensor:
        """Input tokens (Bt, A, K) of block slots 1..K: MASK (DFlash). ids: (Bt, S) long; mask: (Bt, S) bool
        real tokens; anchors: (Bt, A) long columns; prompt_len: (Bt,) long, for variants that need it. Hook (hints)."""
        slots = taken_over(v.slot_ids(self, ids, mask, anchors, prompt_len) for v in self.variants.values())
        if slots is not None:
            return slots
        return anchors.new_full((*anchors.shape, self.num_draft_tokens), self.config.mask_token_id)

    def train_logits(self, anchor_ids, anchor_positions, kv, mask, slot_ids, vocab_ids=None,
                     width: int | None = None) -> torch.Tensor:
        """Teacher-forced logits (Bt, A, K, V) of :meth:`forward_train`: :meth:`block_logits` (one pass); hook (refine)."""
        args = (anchor_ids, anchor_positions, kv, mask, slot_ids, vocab_ids, width)
        logits = taken_over(v.train_logits(self, *args) for v in self.variants.values())
        if logits is not None:
            return logits
        return self.block_logits(anchor_ids, anchor_positions, kv, mask, slot_ids, vocab_ids, width)

    def select_hidden_states(self, hidden_states: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Pick ``target_layer_ids`` from the full HF ``hidden_states`` tuple."""
        if hidden_states is None:
            raise ValueError("hidden_states is None: run the target with output_hidden_states=True")
        n = len(hidden_states)
        bad = [i for i in self.target_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a hidden_states tuple of length {n}")
        return [hidden_states[i] for i in self.target_layer_ids]

    def forward_train(
        self,
        hidden_states: Sequence[torch.Tensor] | torch.Tensor,  # full HF tuple of (Bt, S, H), or cached (Bt, S, L*H)
        input_ids: torch.Tensor,  # (Bt, S) long
        position_ids: torch.Tensor | None,  # (Bt, S) long; None = cumsum(context_mask) - 1
        anchors: torch.Tensor,  # (Bt, A) long column indices
        anchor_mask: torch.Tensor | None = None,  # (Bt, A) bool, False = padding anchor
        context_mask: torch.Tensor | None = None,  # (Bt, S) bool/long, False = padding column
        prompt_len: torch.Tensor | None = None,  # (Bt,) long; read by variants' slot inputs (store hints)
        vocab_ids: torch.Tensor | None = None,  # (V',) long: logits of these tokens only (see head)
        width: int | None = None,  # blocks of width + 1 columns (see block_logits); None = the whole block
    ) -> torch.Tensor:
        """Teacher-forced logits (Bt, A, K, V); block a's slot k predicts ``input_ids[:, anchors[a] + k]``."""
        if width is not None and not 1 <= width <= self.num_draft_tokens:
            raise ValueError(f"width={width}: must be in 1..{self.num_draft_tokens} (K of the drafter) or None")
        cached = isinstance(hidden_states, torch.Tensor)
        states = hidden_states if cached else self.select_hidden_states(hidden_states)
        bt, seq = input_ids.shape
        if anchors.dim() != 2 or anchors.shape[0] != bt:
            raise ValueError(f"anchors must be (Bt={bt}, A), got {tuple(anchors.shape)}")
        if any(tuple(s.shape[:2]) != (bt, seq) for s in ([states] if cached else states)):
            shapes = [tuple(s.shape) for s in ([states] if cached else states)]
            raise ValueError(f"hidden states {shapes} do not match input_ids {(bt, seq)}")
        if context_mask is not None:
            context_mask = context_mask.bool()
        if position_ids is None:
            m = context_mask.long() if context_mask is not None else torch.ones_like(input_ids)
            position_ids = (m.cumsum(-1) - 1).clamp(min=0)
        kv = self.context_kv(states, position_ids)
        cols = anchors.clamp(0, seq - 1)  # padding anchors may hold any index
        mask = self.training_mask(anchors, seq, context_mask, anchor_mask)
        real = context_mask if context_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        slots = self.slot_ids(input_ids, real, cols, prompt_len)
        return self.train_logits(input_ids.gather(1, cols), position_ids.gather(1, cols), kv, mask, slots, vocab_ids,
                                 width)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Same as :meth:`forward_train` (so hooks, wrappers and ``torch.compile`` see a forward)."""
        return self.forward_train(*args, **kwargs)

    def block_labels(self, input_ids, anchors, anchor_mask=None, valid_mask=None):
        """Labels and label mask (Bt, A, K) for :meth:`forward_train`'s logits.

        Slot k of block a is labelled ``input_ids[:, anchors[a] + k]``; it is valid iff the anchor is
        valid and a real token, and every column anchors[a]+1 .. anchors[a]+k is inside the sequence
        and a real token (``valid_mask``). Invalid labels are 0 (a safe index), masked out.
        """
        bt, seq = input_ids.shape
        k = torch.arange(1, self.config.block_size, device=input_ids.device)
        if valid_mask is None:
            valid_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if anchor_mask is None:
            anchor_mask = torch.ones_like(anchors, dtype=torch.bool)
        valid_mask = valid_mask.bool()
        idx = anchors.unsqueeze(-1) + k  # (Bt, A, K)
        inside = (idx >= 0) & (idx < seq)
        flat = idx.clamp(0, seq - 1).view(bt, -1)  # (Bt, A*K)
        labels = input_ids.gather(1, flat).view_as(idx)
        anchor_ok = anchor_mask.bool() & valid_mask.gather(1, anchors.clamp(0, seq - 1))  # (Bt, A)
        ok = inside & valid_mask.gather(1, flat).view_as(idx) & anchor_ok.unsqueeze(-1)
        ok = ok.long().cumprod(-1).bool()  # a hole ends the block's labels
        return labels.masked_fill(~ok, 0), ok

    # ---- drafting: the verify.drafter.Drafter protocol over a DraftCache ---------------------------

    def reset(self, batch_size: int) -> None:
        cfg = self.config
        self._cache = DraftCache(batch_size, len(self.layers), cfg.num_kv_heads, cfg.head_dim, self.weight_ref)

    @property
    def draft_cache(self) -> DraftCache:
        """The columns appended since :meth:`reset` (:class:`drafters.draft_cache.DraftCache`)."""
        if self._cache is None:
            raise RuntimeError("drafter cache is empty: call reset(batch_size) before extend/draft")
        return self._cache

    @property
    def shares_target_cache(self) -> bool:
        """Whether the context keys/values are read from the target's KV cache (see :meth:`bind_target_cache`)."""
        return self._cache is not None and self._cache.shared

    def bind_target_cache(self, cache) -> None:
        """Offer the target's KV cache (the verifier, after :meth:`reset` and before the first :meth:`extend`).

        The first ``extend`` computes its last columns' keys/values and compares them with the target's
        (:func:`drafters.shared_cache.same_keys_values`); if they agree, the drafter reads its context from
        the target's cache from then on (the verifier crops it to the committed columns and selects its rows
        before calling :meth:`extend` and :meth:`select_rows`), else it keeps its own as without the offer.
        """
        # hook (layerwise): the target cache's layers holding this drafter's context keys/values, if they could;
        # None: the fused DFlash context is never the target's
        self.draft_cache.offer(taken_over(v.shareable_layers(self, cache) for v in self.variants.values()))

    def _check_extend(self, attention_mask, hidden_states) -> None:
        rows, n = attention_mask.shape
        if rows != self.draft_cache.rows:
            raise ValueError(f"extend got {rows} rows, the cache holds {self.draft_cache.rows}")
        if hidden_states is None or len(hidden_states) != len(self.target_layer_ids):
            got = None if hidden_states is None else len(hidden_states)
            raise ValueError(f"extend needs {len(self.target_layer_ids)} hidden states (target_layer_ids "
                             f"{self.target_layer_ids}), got {got}")
        if any(tuple(s.shape[:2]) != (rows, n) for s in hidden_states):
            shapes = [tuple(s.shape) for s in hidden_states]
            raise ValueError(f"hidden states {shapes} do not match the new columns {(rows, n)}")

    @torch.no_grad()
    def extend(self, input_ids, attention_mask, position_ids, hidden_states) -> None:
        """Append n columns: input_ids/attention_mask/position_ids (B, n); hidden_states L x (B, n, H)."""
        cache = self.draft_cache
        self._check_extend(attention_mask, hidden_states)
        n = attention_mask.shape[1]
        if n == 0:
            return
        if cache.awaits_sharing_check:  # after bind_target_cache: compare the last columns (up to 4)
            m = min(4, n)
            cache.decide_sharing(self.context_kv([h[:, -m:] for h in hidden_states], position_ids[:, -m:]), n)
        cache.reserve(cache.columns + n + self.config.block_size)  # room for the next draft's block too
        cache.append(None if cache.shared else self.context_kv(hidden_states, position_ids), attention_mask, input_ids)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.draft_cache.select_rows(rows)

    # ---- one block per row ------------------------------------------------------------------------

    def block_inputs(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor,
                     width: int | None = None) -> Block:
        """The :class:`Block` of one block per row after every cached column: anchor_ids, anchor_position_ids
        (B,) long; cut to the columns that draft slots 1..``width`` (default K: the whole block)."""
        cfg, cache = self.config, self.draft_cache
        rows, c = cache.rows, cache.columns
        bs = cfg.block_size if width is None else width + 1
        mask = draft_block_mask(cache.open_block(bs), self.own_mask(bs, anchor_ids.device))
        ids = anchor_ids.new_full((rows, bs), cfg.mask_token_id)  # (B, N) [anchor, MASK x (N - 1)]
        ids[:, 0] = anchor_ids.reshape(rows)
        # hook (hints): fill slots 1.. of ids in place and return the Block.hints (DFlash: MASK, None)
        hints = taken_over(v.slot_inputs(self, ids, c) for v in self.variants.values())
        positions = anchor_position_ids.reshape(rows, 1) + torch.arange(bs, device=ids.device)  # (B, N)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.weight_ref.dtype)
        return Block(ids, cos, sin, c, mask, hints)

    def block_states(self, block: Block, rows: torch.Tensor | None = None) -> torch.Tensor:
        """States (b, K', H) of the drafted slots of ``block`` (the LM head's input) for ``rows`` (b,) long,
        default every row. Other rows' cached columns are copied, not computed on."""
        ids, cos, sin, columns, mask, _ = block
        kv = self.draft_cache.kv_buffers()
        if rows is not None:  # the block's own keys/values are scratch: writing them into a copy is fine
            end = columns + ids.shape[1]
            ids, cos, sin, mask = ids[rows], cos[rows], sin[rows], mask[rows]
            kv = [(k[rows, :, :end], v[rows, :, :end]) for k, v in kv]
        return self.block_passes(ids, cos, sin, columns, mask, kv)

    def block_passes(self, ids, cos, sin, columns: int, mask, kv) -> torch.Tensor:
        """The passes over the block that give its drafted states: one :meth:`block_pass` (DFlash); hook (refine)."""
        args = (ids, cos, sin, columns, mask, kv)
        states = taken_over(v.block_passes(self, *args) for v in self.variants.values())
        if states is not None:
            return states
        return self.block_pass(ids, cos, sin, columns, mask, kv)

    def block_pass(self, ids, cos, sin, columns: int, mask, kv) -> torch.Tensor:
        """One pass of the drafter's layers over the block tokens ids (B, N) after ``columns`` cached columns
        of ``kv`` (per layer (keys, values) buffers); normalised states (B, K', H) of the drafted slots. Writes
        the block's keys/values past the cached columns."""
        x = self.target.get_input_embeddings()(ids).to(self.weight_ref.dtype)  # (B, N, H)
        last, n = len(self.layers) - 1, ids.shape[1]
        for i, (layer, (k_buffer, v_buffer)) in enumerate(zip(self.layers, kv)):
            x = layer(x, cos, sin, CachedContext(k_buffer, v_buffer, columns, mask), n,
                      keep=self.drafted_slots if i == last else None)
        return self.norm(x)  # (B, K', H): the last layer kept the drafted slots only

    @torch.no_grad()
    def draft_logits(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, K, V) of one block per row, seeing every committed cached column: the same computation
        as :meth:`block_logits` with one block per row after every cached column."""
        return self.head(self.block_states(self.block_inputs(anchor_ids, anchor_position_ids)))

    @torch.no_grad()
    def draft(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor, *, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, K) and, when sampling, q (B, K, V) float32: every slot of every row (:func:`propose`)."""
        block = self.block_inputs(anchor_ids, anchor_position_ids)
        self._sources = self.source_labels(block, None)
        return propose(self.head(self.block_states(block)), temperature, top_k, top_p, generator)

    def source_labels(self, block: Block, copied: torch.Tensor | None) -> list[str] | None:
        """Per row of ``block``, what drafts it, given the rows that copy a slot input (``copied`` (B,) bool or
        None); None: unlabelled (DFlash: the drafter drafts every row); hook (hints)."""
        return taken_over(v.source_labels(self, block, copied) for v in self.variants.values())

    def draft_sources(self) -> list[str] | None:
        """What drafted each row of the last :meth:`draft` (the drafter protocol's optional labels, recorded by
        the verifier beside the accepted counts)."""
        return getattr(self, "_sources", None)

    def extra_repr(self) -> str:
        c = self.config
        variants = f", variants={list(self.variants)}" if self.variant_names else ""
        return (f"block_size={c.block_size}, target_layer_ids={c.target_layer_ids}, "
                f"mask_token_id={c.mask_token_id}{variants}, params={sum(p.numel() for p in self.parameters()):,}")


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "Block", "DFlashDrafter", "DrafterConfig", "Variant", "check_variants",
           "propose", "saved_config", "taken_over"]
