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

Training (:meth:`DFlashDrafter.forward_train`) and drafting (:class:`drafters.drafting.DraftingMixin`:
reset / extend / draft / select_rows) run the same layer (:class:`drafters.layers.DrafterLayer`) over
the keys/values of :meth:`DFlashDrafter.context_kv`, and the same LM head (:meth:`DFlashDrafter.head`).

This class is the DFlash drafter and nothing else: what the DFlash serving format expresses
(:mod:`drafters.dflash`). Research variants (layerwise context, lookup hints, anchor policies,
refinement) are mixins in :mod:`drafters.variants` that override a few of its hooks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafters.attention import build_block_attention_mask
from drafters.checkpoints import CONFIG_NAME, WEIGHTS_NAME, CheckpointMixin
from drafters.config import (
    DrafterConfig,
    accepts_argument,
    default_target_layer_ids,
    target_final_norm_weight,
    target_fingerprint,
)
from drafters.drafting import DraftingMixin
from drafters.layers import BlockContext, DrafterLayer, RMSNorm, copy_target_layers, rope_cos_sin
from verify import hf as verify_hf


class DFlashDrafter(CheckpointMixin, DraftingMixin, nn.Module):
    """DFlash-style block drafter; implements the :class:`verify.drafter.Drafter` protocol."""

    #: The variants (:mod:`drafters.variants`) composed into this class, outermost first; () for the core.
    variant_names: tuple[str, ...] = ()

    def __init__(self, config: DrafterConfig, variants: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.config = config
        #: Options of each composed variant, by name (each variant's options dataclass).
        self.variants = dict(variants or {})
        self._build_context()
        self.layers = nn.ModuleList(self._new_layer() for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                # std 1/sqrt(fan_in): each layer's output has the scale of its input, so the block
                # states are not dominated by the constant MASK embedding (see from_target).
                nn.init.normal_(module.weight, std=module.in_features ** -0.5)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self._after_init()
        # The frozen target, kept outside the module tree: not in state_dict(), parameters() or .to().
        object.__setattr__(self, "_target", None)
        self._cache_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._cache_mask: torch.Tensor | None = None

    # ---- hooks a variant overrides ----------------------------------------------------------------

    def _build_context(self) -> None:
        """DFlash: one fused context for every layer (``fuse``, ``fuse_norm``)."""
        h = self.config.hidden_size
        self.fuse = nn.Linear(len(self.config.target_layer_ids) * h, h, bias=False)
        self.fuse_norm = RMSNorm(h, self.config.rms_norm_eps)

    def _new_layer(self) -> DrafterLayer:
        return DrafterLayer(self.config)

    def _after_init(self) -> None:
        """Called at the end of ``__init__`` and after a warm start (from_target)."""

    @classmethod
    def _default_layer_ids(cls, num_layers: int, num_hidden_layers: int) -> tuple[int, ...]:
        return default_target_layer_ids(num_hidden_layers)

    def _copy_target_layers(self, target: nn.Module) -> None:
        """Warm start (``init_layers_from_target``): drafter layer i <- the target's layer i."""
        copy_target_layers(self, target)

    def _own_mask(self, block_size: int, device) -> torch.Tensor | None:
        """(B, B) bool: which slots of its own block each slot sees; None: all (DFlash)."""
        return None

    @property
    def drafted_slots(self) -> slice:
        """The block positions whose outputs are the K drafts: 1..B-1 (DFlash)."""
        return slice(1, None)

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
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("no target attached: call drafter.attach_target(target) first")
        return self._target

    def set_gradient_checkpointing(self, enabled: bool = True) -> DFlashDrafter:
        """Recompute each drafter layer's activations in the backward pass (``torch.utils.checkpoint``)
        instead of storing them: less memory per training step for one more forward of the layers; the
        gradients are the same. Inference is unaffected. Returns the drafter."""
        for layer in self.layers:
            layer.gradient_checkpointing = bool(enabled)
        return self

    # ---- the forward shared by training and drafting ----------------------------------------------

    def _check_cached_width(self, states: torch.Tensor) -> None:
        width = len(self.target_layer_ids) * self.config.hidden_size
        if states.shape[-1] != width:
            raise ValueError(f"cached features have width {states.shape[-1]}, expected {width} "
                             f"(target_layer_ids {self.target_layer_ids} x hidden {self.config.hidden_size})")

    def context_kv(self, states: Sequence[torch.Tensor] | torch.Tensor, positions: torch.Tensor):
        """Per-layer rotated keys/values, num_layers x ((Bt, h_kv, S, d), (Bt, h_kv, S, d)), of the
        context columns from their selected target hidden states: L x (Bt, S, H), or their
        concatenation (Bt, S, L*H) as :mod:`drafters.features` caches it.

        ``context = RMSNorm(fuse(concat(states)))`` (Bt, S, H), the same for every layer. It depends only on
        the columns themselves: drafting computes it once per column and caches the keys/values.
        """
        dtype = self.weight_ref.dtype
        if isinstance(states, torch.Tensor):
            self._check_cached_width(states)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        x = states.to(dtype) if isinstance(states, torch.Tensor) else torch.cat([s.to(dtype) for s in states], -1)
        context = self.fuse_norm(self.fuse(x))  # (Bt, S, H)
        return [layer.attn.key_value(context, cos, sin) for layer in self.layers]

    def head(self, states: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The target's frozen LM head on drafter states (..., H) -> logits (..., V) float32.

        ``vocab_ids`` (V',) long: the logits of those tokens only (..., V'), the columns ``vocab_ids`` of the
        full logits (a training step over a frequent-token subset); None = the whole vocabulary."""
        head = self.target.get_output_embeddings()
        x = states.reshape(-1, states.shape[-1]).to(head.weight.dtype)  # one plain matmul
        if vocab_ids is None:
            plain = type(head) is nn.Linear and head.bias is None  # verify.hf.linear_logits: the fast product on CPU
            out = verify_hf.linear_logits(head.weight, x) if plain else head(x)
        else:
            bias = getattr(head, "bias", None)
            out = F.linear(x, head.weight[vocab_ids], None if bias is None else bias[vocab_ids])
        return out.view(*states.shape[:-1], out.shape[-1]).float()

    def block_ids(self, anchor_ids: torch.Tensor, slot_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Block tokens (..., B): the anchor (...,) long, then ``slot_ids`` (..., K) or MASK x K."""
        ids = anchor_ids.new_full((*anchor_ids.shape, self.config.block_size), self.config.mask_token_id)
        ids[..., 0] = anchor_ids
        if slot_ids is not None:
            ids[..., 1:] = slot_ids
        return ids

    def block_logits(self, anchor_ids, anchor_positions, kv, mask, slot_ids=None,
                     vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (Bt, A, K, V) of blocks ``[anchor, slot_ids]`` (default ``[anchor, MASK x K]``).

        anchor_ids, anchor_positions: (Bt, A) long; kv: from :meth:`context_kv` over S columns;
        mask: (Bt, 1, A*B, S + A*B) bool from :meth:`training_mask`; slot_ids: (Bt, A, K) long from
        :meth:`slot_ids`; vocab_ids: see :meth:`head` (then (Bt, A, K, V')).
        """
        bt, num_blocks = anchor_ids.shape
        bs = self.config.block_size
        ids = self.block_ids(anchor_ids, slot_ids)  # (Bt, A, B)
        x = self.target.get_input_embeddings()(ids.view(bt, num_blocks * bs)).to(self.weight_ref.dtype)
        offsets = torch.arange(bs, device=anchor_positions.device)
        positions = (anchor_positions.unsqueeze(-1) + offsets).view(bt, num_blocks * bs)  # (Bt, A*B)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        own = self._own_mask(bs, x.device)
        for layer, (ctx_k, ctx_v) in zip(self.layers, kv):
            x = layer(x, cos, sin, BlockContext(ctx_k, ctx_v, mask, bs, own), bs)  # (Bt, A*B, H)
        # (Bt, A, K, H): the drafted slots, made contiguous so the head runs as one plain matmul
        x = self.norm(x).view(bt, num_blocks, bs, -1)[:, :, self.drafted_slots].contiguous()
        return self.head(x, vocab_ids)  # (Bt, A, K, V)

    def training_mask(self, anchors, seq: int, context_mask=None, anchor_mask=None) -> torch.Tensor:
        """(Bt, 1, A*B, S + A*B) bool: :func:`build_block_attention_mask` under :meth:`_own_mask`."""
        own = self._own_mask(self.config.block_size, anchors.device)
        return build_block_attention_mask(anchors, self.config.block_size, seq, context_mask, anchor_mask,
                                          causal_anchor=own is not None)

    # ---- training ---------------------------------------------------------------------------------

    def slot_ids(self, ids: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                 prompt_len: torch.Tensor | None = None) -> torch.Tensor:
        """Input tokens (Bt, A, K) of block slots 1..K: MASK (DFlash). ids: (Bt, S) long; mask: (Bt, S) bool
        real tokens; anchors: (Bt, A) long columns; prompt_len: (Bt,) long, for variants that need it."""
        return anchors.new_full((*anchors.shape, self.num_draft_tokens), self.config.mask_token_id)

    def train_logits(self, anchor_ids, anchor_positions, kv, mask, slot_ids, vocab_ids=None) -> torch.Tensor:
        """Teacher-forced logits (Bt, A, K, V) of :meth:`forward_train`: :meth:`block_logits` (one pass)."""
        return self.block_logits(anchor_ids, anchor_positions, kv, mask, slot_ids, vocab_ids)

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
    ) -> torch.Tensor:
        """Teacher-forced logits (Bt, A, K, V); block a's slot k predicts ``input_ids[:, anchors[a] + k]``."""
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
        return self.train_logits(input_ids.gather(1, cols), position_ids.gather(1, cols), kv, mask, slots, vocab_ids)

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

    def extra_repr(self) -> str:
        c = self.config
        variants = f", variants={list(self.variant_names)}" if self.variant_names else ""
        return (f"block_size={c.block_size}, target_layer_ids={c.target_layer_ids}, "
                f"mask_token_id={c.mask_token_id}{variants}, params={sum(p.numel() for p in self.parameters()):,}")


#: The name the rest of the toolkit (and saved Hydra configs: ``drafters.BlockDiffusionDrafter.from_target``)
#: use for the drafter; the core class, whose ``from_target`` / ``from_pretrained`` compose variants by name.
BlockDiffusionDrafter = DFlashDrafter

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "BlockDiffusionDrafter", "DFlashDrafter", "DrafterConfig",
           "accepts_argument", "default_target_layer_ids", "target_final_norm_weight", "target_fingerprint"]
