"""BlockDiffusionDrafter: a DFlash-style block drafter attached to a frozen Hugging Face causal LM.

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

The layerwise design (``layerwise_context`` and ``shifted`` in :class:`DrafterConfig`; not servable
as DFlash) changes two things: drafter layer i reads ``input_norm_i(h_{target_layer_ids[i]})`` as its
context instead of the shared fused one (so layers copied from the target start with the target's own
context keys/values), and slot k is read from block position k - 1, so that the anchor's output
predicts the next token as the target's copied layers were trained to.

Training (:meth:`BlockDiffusionDrafter.forward_train`) and inference (:meth:`reset` /
:meth:`extend` / :meth:`draft` of the protocol in :mod:`verify.drafter`) go through the same two
functions: :meth:`context_kv` (per-layer keys/values of context columns) and :meth:`block_logits`
(the layers over the block slots).

The config and what it reads from the target live in :mod:`drafters.config`, the layers in
:mod:`drafters.layers`; this module holds the drafter and keeps their public names importable.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from drafters.attention import block_mask_subset, build_block_attention_mask, own_block_mask
from drafters.config import (
    FINGERPRINT_KEYS,
    DrafterConfig,
    accepts_argument,
    default_target_layer_ids,
    first_attr,
    target_final_norm_weight,
    target_fingerprint,
    target_sizes,
)
from drafters.hints import HintStore, compact_rows, lookup_hints
from drafters.layers import DrafterLayer, RMSNorm, copy_target_layers, draft_layer, rope_cos_sin
from drafters.shared_cache import same_keys_values, shareable_layers
from verify.rejection import sample_tokens, warp_probs

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class _Block(NamedTuple):
    """One block per row at inference, as the drafter's layers read it."""

    ids: torch.Tensor  # (B, N) long: anchor, then MASK or the lookup hint in each slot
    cos: torch.Tensor  # (B, N, d) RoPE
    sin: torch.Tensor  # (B, N, d)
    columns: int  # cached columns before the block
    mask: torch.Tensor  # (B, 1, 1, columns + N) bool: the keys each slot sees


# --------------------------------------------------------------------------------------------------
# The drafter


#: With ``store_hints``, slots whose prompt-lookup hint rests on fewer tokens than this read the store's instead
#: (a hint from the anchor token alone is mostly wrong: ``experiments.bench.hints``).
STORE_BELOW_NGRAM = 2


class BlockDiffusionDrafter(nn.Module):
    """DFlash-style block drafter; implements the :class:`verify.drafter.Drafter` protocol."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        if not config.layerwise_context:  # DFlash: one context for every layer
            self.fuse = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
            self.fuse_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                # std 1/sqrt(fan_in): each layer's output has the scale of its input, so the block
                # states are not dominated by the constant MASK embedding (see from_target).
                nn.init.normal_(module.weight, std=module.in_features ** -0.5)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if config.frozen_anchor:  # the output norm is read by the anchor too
            self.norm.requires_grad_(False)
        self.sync_anchor_path()
        # The frozen target, kept outside the module tree: not in state_dict(), parameters() or .to().
        object.__setattr__(self, "_target", None)
        # Inference cache: per layer (k, v) of shape (B, h_kv, C, d), and the column mask (B, C).
        self._cache_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._cache_mask: torch.Tensor | None = None
        #: With ``config.store_hints``: the training answers the weak slots' hints are retrieved from (set by
        #: training, saved and loaded beside the weights).
        self.hint_store: HintStore | None = None

    # ---- protocol attributes --------------------------------------------------------------------

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

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target: nn.Module,
        *,
        block_size: int = 16,
        num_layers: int = 1,
        target_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
        init_from: str | Path | None = None,
        init_layers_from_target: bool = False,
        gradient_checkpointing: bool = False,
        **overrides: Any,
    ) -> BlockDiffusionDrafter:
        """A freshly initialised drafter sized from ``target.config`` and attached to ``target``.

        ``overrides`` set other :class:`DrafterConfig` fields (num_heads, intermediate_size, ...);
        a ``None`` value keeps the value read from the target.

        ``init_from``: a saved drafter (blockdraft or DFlash format) to start from instead of a fresh
        initialisation; see :func:`_from_checkpoint` for how the other arguments apply then.
        ``init_layers_from_target``: start the drafter's layers as copies of the target's layers
        (:func:`copy_target_layers`) instead of random weights: its first layers, or with
        ``layerwise_context`` the layers whose inputs the drafter's layers read.
        """
        if init_from is not None:
            return _from_checkpoint(cls, target, init_from, block_size=block_size, num_layers=num_layers,
                                    target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                    **overrides).set_gradient_checkpointing(gradient_checkpointing)
        tcfg = getattr(target, "config", None)
        if tcfg is None:
            raise ValueError(f"target {type(target).__name__} has no .config; expected a HF causal LM")
        sizes = target_sizes(tcfg)
        fingerprint = target_fingerprint(tcfg)
        if target_layer_ids is None and overrides.get("layerwise_context"):
            target_layer_ids = tuple(range(num_layers))  # layer i reads the input of the target's layer i
        elif target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(sizes["num_hidden_layers"])
        if mask_token_id is None:
            mask_token_id = first_attr(tcfg, ["mask_token_id"], sizes["vocab_size"] - 1)
        fields = {k: v for k, v in sizes.items() if k != "num_hidden_layers"}
        fields.update(block_size=block_size, num_layers=num_layers, target_layer_ids=tuple(target_layer_ids),
                      mask_token_id=int(mask_token_id), target_fingerprint=fingerprint)
        allowed = {f.name for f in dataclasses.fields(DrafterConfig)} - {"target_fingerprint"}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"unknown drafter overrides {unknown}; allowed: {sorted(allowed)}")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        drafter = cls(DrafterConfig(**fields)).attach_target(target)
        # The output norm starts as the target's final norm, so the shared LM head sees inputs at the scale it
        # was trained on and the drafter can be as confident as the target from step 1. (Shrinking it, as the
        # first wave did with final norm / sqrt(H), capped the logit scale: the weight grows only ~lr per
        # step, and CE under a capped scale is minimised by one frequent-token direction, the collapse of
        # DESIGN.md §6. With the 0.02-std weights of then, the constant MASK embedding also outweighed what
        # the layers added to the block states; the fan-in init above fixes that. One batch of 8 answers:
        # slot-1 accuracy stuck at 0.07 for 75 steps before, 1.00 after 50 steps now.)
        final_norm = target_final_norm_weight(target)
        with torch.no_grad():
            if final_norm is not None and final_norm.shape == drafter.norm.weight.shape:
                drafter.norm.weight.copy_(final_norm.float())
        if init_layers_from_target:  # layer i <- the target layer whose input it reads (layerwise), else layer i
            copy_target_layers(drafter, target, sources=drafter.target_layer_ids if drafter.config.layerwise_context
                               else None)
        drafter.sync_anchor_path()
        return drafter.set_gradient_checkpointing(gradient_checkpointing)

    def sync_anchor_path(self) -> BlockDiffusionDrafter:
        """With ``frozen_anchor``: the anchor's frozen copies := each layer's current weights (at construction,
        after any warm start; a saved drafter loads its own). A no-op otherwise. Returns the drafter."""
        for layer in self.layers:
            layer.sync_anchor_path()
        return self

    def set_gradient_checkpointing(self, enabled: bool = True) -> BlockDiffusionDrafter:
        """Recompute each drafter layer's activations in the backward pass (``torch.utils.checkpoint``)
        instead of storing them: less memory per training step for one more forward of the layers; the
        gradients are the same. Inference is unaffected. Returns the drafter."""
        for layer in self.layers:
            layer.gradient_checkpointing = bool(enabled)
        return self

    def attach_target(self, target: nn.Module) -> BlockDiffusionDrafter:
        """Use ``target``'s input embedding and LM head (frozen in place); checks it fits the drafter."""
        tcfg = getattr(target, "config", None)
        if tcfg is None:
            raise ValueError(f"target {type(target).__name__} has no .config; expected a HF causal LM")
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
                f"fit hidden_size {self.config.hidden_size} and vocab_size {self.config.vocab_size}"
            )
        self._check_target_outputs(target)
        embed.requires_grad_(False)
        head.requires_grad_(False)
        object.__setattr__(self, "_target", target)
        return self

    @staticmethod
    def _probe_ids(target: nn.Module) -> torch.Tensor:
        param = next(target.parameters(), None)
        return torch.zeros(1, 1, dtype=torch.long, device=param.device if param is not None else "cpu")

    def _check_target_outputs(self, target: nn.Module) -> None:
        """Run the target on one token and check it returns enough hidden states of the right width."""
        with torch.no_grad():
            out = target(input_ids=self._probe_ids(target), output_hidden_states=True, use_cache=False)
        states = getattr(out, "hidden_states", None)
        if states is None:
            raise ValueError(
                f"target {type(target).__name__} returned no hidden_states for output_hidden_states=True; "
                "the drafter needs the target's per-layer hidden states"
            )
        bad = [i for i in self.config.target_layer_ids if not 0 <= i < len(states)]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for {len(states)} target hidden states")
        widths = {states[i].shape[-1] for i in self.config.target_layer_ids}
        if widths != {self.config.hidden_size}:
            raise ValueError(f"target hidden states have widths {widths}, expected {self.config.hidden_size}")

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("no target attached: call drafter.attach_target(target) first")
        return self._target

    # ---- saving ---------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``model.safetensors`` (drafter weights only) and ``config.json`` (the DrafterConfig)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME))
        (directory / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        if self.hint_store is not None:
            self.hint_store.save(directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: nn.Module | None = None) -> BlockDiffusionDrafter:
        """Load a saved drafter; with ``target``, attach it (refused if its fingerprint differs).

        ``directory`` holds either blockdraft's own format (:meth:`save_pretrained`) or a DFlash
        serving checkpoint (``config.json`` with an ``architectures`` list, DESIGN.md §5b), which is
        converted by :func:`drafters.dflash.load_dflash` and needs ``target``. Returned in eval mode, as
        transformers' ``from_pretrained`` does (with ``refine_passes``, train mode self-conditions).
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"drafter directory {directory} does not exist")
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"drafter directory {directory} has no {name}")
        from drafters.locks import check_safetensors, read_json

        raw = read_json(directory / CONFIG_NAME, "drafter config")  # a damaged file is named
        check_safetensors(directory / WEIGHTS_NAME)
        if "architectures" in raw or "dflash_config" in raw:  # a HF-style config: the DFlash format
            from drafters.dflash import load_dflash

            return load_dflash(directory, target, drafter_class=cls).eval()
        config = DrafterConfig.from_dict(raw)
        drafter = cls(config)
        drafter.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=True)
        if config.store_hints:
            drafter.hint_store = HintStore.load(directory)
        if target is not None:
            drafter.attach_target(target)
        return drafter.eval()

    # ---- the core forward (shared by training and inference) -------------------------------------

    def _check_cached_width(self, states: torch.Tensor) -> None:
        width = len(self.target_layer_ids) * self.config.hidden_size
        if states.shape[-1] != width:
            raise ValueError(f"cached features have width {states.shape[-1]}, expected {width} "
                             f"(target_layer_ids {self.target_layer_ids} x hidden {self.config.hidden_size})")

    def context_kv(self, states: Sequence[torch.Tensor] | torch.Tensor, positions: torch.Tensor):
        """Per-layer rotated keys/values, num_layers x ((Bt, h_kv, S, d), (Bt, h_kv, S, d)), of the
        context columns from their selected target hidden states: L x (Bt, S, H), or their
        concatenation (Bt, S, L*H) as :mod:`drafters.features` caches it.

        DFlash: ``context = RMSNorm(fuse(concat(states)))`` (Bt, S, H), the same for every layer;
        layerwise: layer i reads ``input_norm_i(states[i])``. Either way they depend only on the columns
        themselves: inference computes them once per column and caches them.
        """
        dtype = self.weight_ref.dtype
        if isinstance(states, torch.Tensor):
            self._check_cached_width(states)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        if self.config.layerwise_context:  # L = num_layers states, one per layer
            per_layer = states.split(self.config.hidden_size, dim=-1) if isinstance(states, torch.Tensor) else states
            return [layer.attn.key_value(layer.input_norm(h.to(dtype)), cos, sin)
                    for layer, h in zip(self.layers, per_layer)]
        x = states.to(dtype) if isinstance(states, torch.Tensor) else torch.cat([s.to(dtype) for s in states], -1)
        context = self.fuse_norm(self.fuse(x))  # (Bt, S, H)
        return [layer.attn.key_value(context, cos, sin) for layer in self.layers]

    @property
    def drafted_slots(self) -> slice:
        """The block positions whose outputs are the K drafts: 1..B-1 (DFlash), or 0..B-2 when shifted."""
        return slice(0, -1) if self.config.shifted else slice(1, None)

    def slot_ids(self, ids: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                 folds: Sequence[int] | None = None) -> torch.Tensor:
        """Input tokens (Bt, A, K) of block slots 1..K: MASK, or with ``lookup_hints`` the prompt-lookup
        continuation of ``ids[:, :anchor + 1]`` where one exists (:func:`drafters.hints.lookup_hints`), and with
        ``store_hints`` the hint store's where that rests on fewer than 2 tokens. ids: (Bt, S) long; mask:
        (Bt, S) bool real tokens; anchors: (Bt, A) long columns; folds: (Bt,) the rows' hint-store folds."""
        cfg = self.config
        if not cfg.lookup_hints:
            return anchors.new_full((*anchors.shape, cfg.num_draft_tokens), cfg.mask_token_id)
        return self._hinted_slots(ids, mask, anchors, folds)[0]

    def _hinted_slots(self, ids, mask, anchors, folds=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slot ids (Bt, A, K), ngram (Bt, A), from_store (Bt, A) bool)``: the hints, MASK where no n-gram
        matched (ngram 0), the length of the n-gram each rests on, and whether it is the store's (of the
        training answers) rather than the row's own tokens'."""
        cfg = self.config
        hints, ngram = lookup_hints(ids, mask, anchors, cfg.num_draft_tokens, cfg.lookup_max_ngram)
        from_store = torch.zeros_like(ngram, dtype=torch.bool)
        if cfg.store_hints:
            if self.hint_store is None:
                raise ValueError("store_hints: this drafter has no hint_store (training sets it from the data; "
                                 "from_pretrained loads it from the drafter's folder)")
            stored, n = self.hint_store.hints(ids, anchors, cfg.num_draft_tokens, ngram < STORE_BELOW_NGRAM, folds)
            from_store = n > 0
            hints, ngram = torch.where(from_store.unsqueeze(-1), stored, hints), torch.where(from_store, n, ngram)
        return hints.masked_fill(ngram.unsqueeze(-1) == 0, cfg.mask_token_id), ngram, from_store

    def block_logits(self, anchor_ids, anchor_positions, kv, mask, slot_ids=None, vocab_ids=None) -> torch.Tensor:
        """Logits (Bt, A, K, V) of blocks ``[anchor, slot_ids]`` (default ``[anchor, MASK x K]``).

        anchor_ids, anchor_positions: (Bt, A) long; kv: from :meth:`context_kv` over S columns;
        mask: (Bt, 1, A*B, S + A*B) bool from :func:`build_block_attention_mask`; slot_ids: (Bt, A, K)
        long from :meth:`slot_ids`.
        """
        target, cfg = self.target, self.config
        bt, num_blocks = anchor_ids.shape
        bs = cfg.block_size
        ids = anchor_ids.new_full((bt, num_blocks, bs), cfg.mask_token_id)  # (Bt, A, B)
        ids[:, :, 0] = anchor_ids
        if slot_ids is not None:
            ids[:, :, 1:] = slot_ids
        x = target.get_input_embeddings()(ids.view(bt, num_blocks * bs)).to(self.weight_ref.dtype)
        offsets = torch.arange(bs, device=anchor_positions.device)
        positions = (anchor_positions.unsqueeze(-1) + offsets).view(bt, num_blocks * bs)  # (Bt, A*B)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, kv):
            x = layer(x, cos, sin, ctx_k, ctx_v, mask, bs)  # (Bt, A*B, H)
        # (Bt, A, K, H): the drafted slots, made contiguous so the head runs as one plain matmul
        x = self.norm(x).view(bt, num_blocks, bs, -1)[:, :, self.drafted_slots].contiguous()
        head = target.get_output_embeddings()
        if vocab_ids is not None:  # a candidate vocabulary (drafters/vocab.py): (Bt, A, K, V')
            return torch.nn.functional.linear(x.to(head.weight.dtype), head.weight[vocab_ids]).float()
        return head(x.to(head.weight.dtype)).float()  # (Bt, A, K, V)

    # ---- training ---------------------------------------------------------------------------------

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
        prompt_len: torch.Tensor | None = None,  # (Bt,) long; with store_hints in training mode, required
        vocab_ids: torch.Tensor | None = None,  # (V',) long: logits over these ids only (drafters/vocab.py)
    ) -> torch.Tensor:
        """Teacher-forced logits (Bt, A, K, V); block a's slot k predicts ``input_ids[:, anchors[a] + k]``.

        With ``store_hints``, in training mode each row reads the hint store without its own answer (its fold
        is found from its prompt, ``prompt_len``); in eval mode every row reads the whole store, as inference."""
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
        mask = build_block_attention_mask(anchors, self.config.block_size, seq, context_mask, anchor_mask,
                                          self.config.causal_anchor)
        real = context_mask if context_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        folds = None
        if self.config.store_hints and self.training:
            if prompt_len is None or self.hint_store is None:
                raise ValueError("store_hints in training needs prompt_len (a row must not read its own answer "
                                 "from the hint store) and a hint_store")
            folds = self.hint_store.folds(input_ids, prompt_len)
        slots = self.slot_ids(input_ids, real, cols, folds)
        if vocab_ids is not None:
            if self.config.refine_passes:
                raise ValueError("a candidate vocabulary (vocab_ids) does not combine with refine_passes")
            return self.block_logits(input_ids.gather(1, cols), position_ids.gather(1, cols), kv, mask, slots, vocab_ids)
        return self.refined_block_logits(input_ids.gather(1, cols), position_ids.gather(1, cols), kv, mask, slots)

    def refined_block_logits(self, anchor_ids, anchor_positions, kv, mask, slot_ids) -> torch.Tensor:
        """:meth:`block_logits` (Bt, A, K, V) under ``config.refine_passes`` = r (0: one pass on ``slot_ids``).

        Eval mode does what :meth:`draft` does: r more passes, each with the previous pass's argmax in the
        slots. Training mode self-conditions: odd blocks (a = 1, 3, ...) run on the argmax of a first pass
        made without gradient, even blocks on ``slot_ids``, so one step trains both the first pass and a
        refining one. slot_ids: (Bt, A, K) long from :meth:`slot_ids`.
        """
        args = (anchor_ids, anchor_positions, kv, mask)
        if self.config.refine_passes == 0:
            return self.block_logits(*args, slot_ids)
        if self.training:  # the first pass only where its argmax is used: the odd blocks (blocks are independent)
            odd = torch.arange(1, anchor_ids.shape[1], 2, device=anchor_ids.device)  # (A // 2,)
            slots = slot_ids.clone()
            if odd.numel():
                with torch.no_grad():
                    slots[:, odd] = self.block_logits(anchor_ids[:, odd], anchor_positions[:, odd], kv,
                                                      block_mask_subset(mask, odd, self.config.block_size),
                                                      slot_ids[:, odd]).argmax(-1)  # (Bt, A // 2, K)
            return self.block_logits(*args, slots)
        logits = self.block_logits(*args, slot_ids)
        for _ in range(self.config.refine_passes):
            logits = self.block_logits(*args, logits.argmax(-1))
        return logits

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

    # ---- inference (the verify.drafter.Drafter protocol) -----------------------------------------
    # The cache holds, per drafter layer, the rotated keys/values of every column appended so far
    # (holes included, masked out by _cache_mask). Context features are the same in every layer, so
    # these never need recomputing: a draft step only runs the B block slots. Keys, values and the
    # column mask live in buffers with spare columns (_cache_kv and _cache_mask are views of their
    # first columns): extend writes the new columns in place, and a draft writes the block's own
    # keys/values just past the cached columns, so that attention reads one view and no step copies
    # the cache (torch.cat did, twice per layer and step).

    #: Truncate drafts before the first slot whose top-1 probability under the drafter's softmax is
    #: below this (None: never). The verifier then checks only the confident prefix, the same number
    #: of slots for every row (the longest row's). Exact, as any draft length fixed before the
    #: target runs is. Set it on a loaded drafter: ``drafter.confidence_threshold = 0.3``.
    confidence_threshold: float | None = None

    #: Hinted drafters only: draft the lookup hint's whole block instead of the drafter's tokens in rows
    #: where an n-gram matched and the drafter's argmax agrees with the hint on the first m slots
    #: (m = 0: wherever one matched); None: never. Exact at any temperature: the decision is made from
    #: the drafter's logits before anything is sampled, and a copied block is drafted with one-hot q.
    #: With :attr:`confidence_threshold` too, a step where no row copies drafts only the confident prefix.
    #: ``experiments.bench.hints`` measures the rule teacher-forced (``follow_hint_after_m``).
    follow_hint_after: int | None = None

    #: With :attr:`follow_hint_after`: copy the hint only where the n-gram it rests on is at least this
    #: long (1: any match). A hint found from the anchor token alone is mostly wrong; one from two or
    #: three tokens mostly right (``experiments.bench.hints``, ``follow_hint_min_ngram_n``).
    follow_hint_min_ngram: int = 1

    #: Verify at most this many drafted slots per step, the first W of the K (None: all K), in every row,
    #: copied hints included; the cut comes before :attr:`confidence_threshold`'s. Exact (fixed before the
    #: target runs). Where the target's forward costs about linearly in tokens (a CPU, a large batch),
    #: a shorter verified block can pay more than the accepted tokens it loses.
    max_draft_tokens: int | None = None

    #: The drafted slots the drafter's layers compute each step, the first W of the K (None: all K): the
    #: block run through the layers is ``[anchor, slot 1 .. slot W]``, W + 1 columns instead of K + 1 (on the
    #: tiny target at batch 8, 2 CPU threads: ~7-9 ms for 2-4 columns against ~11 ms for 16; README, "Narrow
    #: drafting"). Where some row copies its hint (:attr:`follow_hint_after`) the step still verifies that
    #: hint's whole block, and every other row proposes its own hint tokens past slot W; where none does, the
    #: step verifies W slots. Exact (the width is fixed before the target runs; hint tokens are one-hot
    #: proposals). The anchor's causal path makes slot 1 the same at any W; slots 2..W see the hints of the
    #: slots before W + 1 only, where training showed them all K.
    own_draft_tokens: int | None = None

    #: Read the context keys/values from the target's KV cache when the verifier offers it
    #: (:meth:`bind_target_cache`) and they are the same numbers (:mod:`drafters.shared_cache`): a step then
    #: computes and copies no context column, and the drafter keeps no cache of its own. False: always its own.
    share_target_cache: bool = True

    #: Under :attr:`follow_hint_after` = 0: run the drafter's layers only in steps where at least this many
    #: rows draft themselves (rows whose hint rests on fewer than :attr:`follow_hint_min_ngram` tokens); in the
    #: other steps every row copies its hint however short (a row with none proposes MASK tokens, rejected at
    #: once). At small batch on a CPU a pass costs nearly the same for one row as for all of them, so a step
    #: where few rows draft may be better off without it. Exact (decided from the hints, before any pass).
    #: None or 1: whenever some row drafts.
    min_drafting_rows: int | None = None

    def reset(self, batch_size: int) -> None:
        self._columns = 0
        self._kv_buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (B, h_kv, cap, d)
        self._target_layers: list | None = None  # the target cache's layers offered by bind_target_cache
        self._shared = False  # whether _target_layers' buffers are the context keys/values (decided at the first extend)
        self._mask_buffer = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.weight_ref.device)
        self._ids_buffer = torch.zeros(batch_size, 0, dtype=torch.long, device=self.weight_ref.device)  # lookup hints
        self._set_views()

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (keys, values) buffers (B, h_kv, capacity, d): the drafter's own, or the target cache's."""
        return [layer.buffers for layer in self._target_layers] if self._shared else self._kv_buffers

    def bind_target_cache(self, cache) -> None:
        """Offer the target's KV cache (the verifier, after :meth:`reset` and before the first :meth:`extend`).

        The first ``extend`` computes its last columns' keys/values and compares them with the target's
        (:func:`drafters.shared_cache.same_keys_values`); if they agree, the drafter reads its context from
        the target's cache from then on (the verifier crops it to the committed columns and selects its rows
        before calling :meth:`extend` and :meth:`select_rows`), else it keeps its own as without the offer.
        """
        self._require_cache()
        if self._columns:
            raise RuntimeError("bind_target_cache comes after reset and before the first extend")
        share = self.share_target_cache and self.config.layerwise_context
        self._target_layers = shareable_layers(cache, self.target_layer_ids) if share else None

    def _decide_sharing(self, hidden_states, position_ids) -> None:
        """At the first extend after :meth:`bind_target_cache`: share the target's cache if its last columns
        (up to 4) hold this drafter's own keys/values."""
        if self._target_layers is None or self._shared:
            return
        m = min(4, position_ids.shape[1])
        kv = self.context_kv([h[:, -m:] for h in hidden_states], position_ids[:, -m:])
        self._shared = same_keys_values(kv, self._target_layers, self._columns + position_ids.shape[1])
        if not self._shared:
            self._target_layers = None

    def _set_views(self) -> None:
        cfg, c, kv = self.config, self._columns, self._kv()
        if kv is None:
            empty = self.weight_ref.new_zeros(self._mask_buffer.shape[0], cfg.num_kv_heads, 0, cfg.head_dim)
            self._cache_kv = [(empty, empty) for _ in self.layers]
        else:
            self._cache_kv = [(k[:, :, :c], v[:, :, :c]) for k, v in kv]
        self._cache_mask = self._mask_buffer[:, :c]

    def _reserve(self, columns: int) -> None:
        """Room for ``columns`` columns in the buffers (they grow by a quarter, at least 64 columns)."""
        if self._shared:  # the block's scratch keys/values go just past the target's cached columns
            for layer in self._target_layers:
                layer.ensure_capacity(columns)
        capacity = self._mask_buffer.shape[1]
        # Buffers made under torch.inference_mode cannot be written outside it: copy them then.
        stale = self._mask_buffer.is_inference() and not torch.is_inference_mode_enabled()
        if columns <= capacity and not stale:
            return
        if columns > capacity:
            capacity = columns + max(64, columns // 4)
        cfg, c, w = self.config, self._columns, self.weight_ref
        rows = self._mask_buffer.shape[0]
        mask = torch.zeros(rows, capacity, dtype=torch.bool, device=w.device)
        mask[:, :c] = self._mask_buffer[:, :c]
        ids = torch.zeros(rows, capacity, dtype=torch.long, device=w.device)
        ids[:, :c] = self._ids_buffer[:, :c]
        self._mask_buffer, self._ids_buffer = mask, ids
        if self._shared:
            return
        buffers = []
        for i in range(len(self.layers)):
            k = w.new_empty(rows, cfg.num_kv_heads, capacity, cfg.head_dim)
            v = w.new_empty(rows, cfg.num_kv_heads, capacity, cfg.head_dim)
            if self._kv_buffers is not None and c > 0:
                k[:, :, :c] = self._kv_buffers[i][0][:, :, :c]
                v[:, :, :c] = self._kv_buffers[i][1][:, :, :c]
            buffers.append((k, v))
        self._kv_buffers = buffers

    def _require_cache(self) -> None:
        if self._cache_kv is None or self._cache_mask is None:
            raise RuntimeError("drafter cache is empty: call reset(batch_size) before extend/draft")

    @torch.no_grad()
    def extend(self, input_ids, attention_mask, position_ids, hidden_states) -> None:
        """Append n columns: input_ids/attention_mask/position_ids (B, n); hidden_states L x (B, n, H)."""
        self._require_cache()
        rows, n = attention_mask.shape
        if rows != self._cache_mask.shape[0]:
            raise ValueError(f"extend got {rows} rows, the cache holds {self._cache_mask.shape[0]}")
        if hidden_states is None or len(hidden_states) != len(self.target_layer_ids):
            got = None if hidden_states is None else len(hidden_states)
            raise ValueError(
                f"extend needs {len(self.target_layer_ids)} hidden states (target_layer_ids "
                f"{self.target_layer_ids}), got {got}"
            )
        if any(tuple(s.shape[:2]) != (rows, n) for s in hidden_states):
            shapes = [tuple(s.shape) for s in hidden_states]
            raise ValueError(f"hidden states {shapes} do not match the new columns {(rows, n)}")
        if n == 0:
            return
        self._decide_sharing(hidden_states, position_ids)
        c = self._columns
        self._reserve(c + n + self.config.block_size)  # room for the next draft's block too
        if self._shared:  # the target has cached these columns' keys/values: check it holds exactly them
            if any(layer.keys.shape[-2] != c + n or layer.keys.shape[0] != rows for layer in self._target_layers):
                raise RuntimeError(f"the shared target cache holds {tuple(self._target_layers[0].keys.shape)} "
                                   f"(B, h_kv, columns, d), expected {rows} rows and {c + n} columns")
        else:
            for (k_buffer, v_buffer), (k, v) in zip(self._kv_buffers, self.context_kv(hidden_states, position_ids)):
                k_buffer[:, :, c : c + n] = k
                v_buffer[:, :, c : c + n] = v
        self._mask_buffer[:, c : c + n] = attention_mask.bool()
        self._ids_buffer[:, c : c + n] = input_ids
        self._columns = c + n
        self._set_views()

    @torch.no_grad()
    def draft_logits(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, K, V) of one block per row, seeing every committed cached column.

        The same computation as :meth:`block_logits` with one block per row after every cached
        column, without building its mask or concatenating keys (see :func:`_draft_layer`).
        """
        return self._head(self._draft_states(anchor_ids, anchor_position_ids))

    def _draft_states(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor) -> torch.Tensor:
        """Normalised output states (B, K, H) of the drafted slots of one block per row (the LM head's input)."""
        return self._block_states(self._block_inputs(anchor_ids, anchor_position_ids))

    def _block_inputs(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor,
                      width: int | None = None) -> _Block:
        """The block tokens, RoPE and mask of one block per row after every cached column, cut to the columns
        that draft slots 1..``width`` (default K: the whole block); with lookup hints, the hints fill the slots
        and are kept, all K of them, in ``_block_hints`` for :attr:`follow_hint_after`."""
        self._require_cache()
        cfg = self.config
        rows, c = self._mask_buffer.shape[0], self._columns
        bs = cfg.block_size if width is None else width + 1  # shifted: column k - 1 drafts slot k (column B - 1 idle)
        self._reserve(c + bs)
        self._mask_buffer[:, c : c + bs] = True  # block slots: past the cached columns, see each other
        mask = self._mask_buffer[:, None, None, : c + bs]  # (B, 1, 1, C + B), the same for every slot
        if cfg.causal_anchor:  # (B, 1, B, C + B): the anchor's row sees no other block slot
            mask = torch.cat([mask[..., :c].expand(-1, -1, bs, -1), mask[..., c:] & own_block_mask(bs, mask.device)], dim=-1)
        ids = anchor_ids.new_full((rows, bs), cfg.mask_token_id)  # (B, B) [anchor, MASK x K]
        ids[:, 0] = anchor_ids.reshape(rows)
        if cfg.lookup_hints:  # the committed tokens (holes dropped) and the anchor, as training reads them
            slots, ngram, store = self._hinted_slots(*compact_rows(self._ids_buffer[:, :c], self._mask_buffer[:, :c], ids[:, 0]))
            ids[:, 1:] = slots[:, 0, : bs - 1]
            self._block_hints = slots[:, 0], ngram[:, 0], store[:, 0]  # (B, K), (B,), (B,): for follow_hint_after
        positions = anchor_position_ids.reshape(rows, 1) + torch.arange(bs, device=ids.device)  # (B, B)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.weight_ref.dtype)
        return _Block(ids, cos, sin, c, mask)

    def _block_states(self, block: _Block, rows: torch.Tensor | None = None) -> torch.Tensor:
        """States (b, K, H) of the drafted slots of ``block`` (after ``config.refine_passes``) for ``rows``
        (b,) long, default every row. Other rows' cached columns are copied, not computed on."""
        ids, cos, sin, columns, mask = block
        kv = self._kv()
        if rows is not None:  # the block's own keys/values are scratch: writing them into a copy is fine
            end = columns + ids.shape[1]
            ids, cos, sin, mask = ids[rows], cos[rows], sin[rows], mask[rows]
            kv = [(k[rows, :, :end], v[rows, :, :end]) for k, v in kv]
        states = self._block_pass(ids, cos, sin, columns, mask, kv)
        for _ in range(self.config.refine_passes):  # the previous pass's argmax in the slots (refined_block_logits)
            ids = ids.clone()
            ids[:, 1:] = self._head(states).argmax(-1)
            states = self._block_pass(ids, cos, sin, columns, mask, kv)
        return states

    def _block_pass(self, ids, cos, sin, columns: int, mask, kv) -> torch.Tensor:
        """One pass of the drafter's layers over the block tokens ids (B, B) after ``columns`` cached columns
        of ``kv`` (per layer (keys, values) buffers); normalised states (B, K, H) of the drafted slots. Writes
        the block's keys/values past the cached columns."""
        x = self.target.get_input_embeddings()(ids).to(self.weight_ref.dtype)  # (B, B, H)
        last = len(self.layers) - 1
        for i, (layer, (k_buffer, v_buffer)) in enumerate(zip(self.layers, kv)):
            x = draft_layer(layer, x, cos, sin, k_buffer, v_buffer, columns, mask,
                            keep=self.drafted_slots if i == last else None)
        return self.norm(x)  # (B, K, H): the last layer kept the drafted slots only

    def _head(self, states: torch.Tensor) -> torch.Tensor:  # (B, n, H) -> (B, n, V) float32
        head = self.target.get_output_embeddings()
        rows, n, width = states.shape
        return head(states.reshape(rows * n, width).to(head.weight.dtype)).view(rows, n, head.out_features).float()

    def confident_width(self, logits: torch.Tensor) -> int:
        """Slots (from slot 1) that every row's drafts need: the longest leading run over rows of slots
        whose top-1 probability is at least :attr:`confidence_threshold`. logits: (B, K, V)."""
        top1 = (logits.amax(-1) - logits.logsumexp(-1)).exp()  # (B, K)
        leading = (top1 >= self.confidence_threshold).long().cumprod(-1).sum(-1)  # (B,)
        return int(leading.max()) if leading.numel() else 0

    def _confident_logits(self, states: torch.Tensor) -> torch.Tensor:
        """``logits[:, :confident_width(logits)]`` for ``logits = _head(states)`` (B, K, H), with the LM
        head run slot chunk by slot chunk until every row has met a slot below the threshold.

        The first chunk covers the recent mean width plus one slot; each next one is twice as long.
        """
        rows, num_slots, _ = states.shape
        leading = torch.zeros(rows, dtype=torch.long, device=states.device)  # confident slots so far
        parts, start = [], 0
        size = max(1, math.ceil(getattr(self, "_width_mean", 2.0)) + 1)
        while start < num_slots:
            end = min(num_slots, start + size)
            logits = self._head(states[:, start:end])  # (B, n, V)
            top1 = (logits.amax(-1) - logits.logsumexp(-1)).exp()  # (B, n)
            run = (top1 >= self.confidence_threshold).long().cumprod(-1).sum(-1)  # (B,)
            leading = torch.where(leading == start, start + run, leading)
            parts.append(logits)
            if not bool((leading == end).any()):
                break
            start, size = end, 2 * size
        width = int(leading.max()) if rows else 0
        self._width_mean = 0.7 * getattr(self, "_width_mean", 2.0) + 0.3 * width
        return torch.cat(parts, dim=1)[:, :width]

    @torch.no_grad()
    def draft(
        self,
        anchor_ids: torch.Tensor,  # (B,) long
        anchor_position_ids: torch.Tensor,  # (B,) long
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, W) and, when sampling, q (B, W, V) float32: W = K, or :attr:`max_draft_tokens`; with
        :attr:`own_draft_tokens` W' < W, the drafter's W' slots unless some row copies its hint (then every
        other row proposes its hint tokens past its W' slots); with :attr:`confidence_threshold`, the
        :meth:`confident_width` within those (all W when some row copies its hint under :attr:`follow_hint_after`).

        Slots of a block are conditionally independent given the context (one forward pass, no
        feedback between slots), so sampling each slot from its own warped distribution makes
        ``tokens[:, k]`` a draw from ``q[:, k]`` given the drafts before it, as the verifier needs.
        The width W depends on the drafter's distributions only, not on the tokens drawn.
        """
        if self.follow_hint_after is not None and not self.config.lookup_hints:
            raise ValueError("follow_hint_after needs a drafter trained with lookup_hints")
        width = self.num_draft_tokens if self.max_draft_tokens is None else self.max_draft_tokens
        if not 1 <= width <= self.num_draft_tokens or (self.follow_hint_after or 0) > width:
            raise ValueError(f"max_draft_tokens={self.max_draft_tokens}: must be in 1..K={self.num_draft_tokens} "
                             f"and at least follow_hint_after={self.follow_hint_after}")
        if self.own_draft_tokens is not None and self.own_draft_tokens < 1:
            raise ValueError(f"own_draft_tokens={self.own_draft_tokens}: must be >= 1 (or None: all K)")
        own_width = width if self.own_draft_tokens is None else min(width, self.own_draft_tokens)
        block = self._block_inputs(anchor_ids, anchor_position_ids, None if self.own_draft_tokens is None else own_width)
        follow = self._copied_rows() if self.follow_hint_after == 0 else None  # (B,) bool: rows that copy their hint
        copies = follow is not None and bool(follow.any())  # some row copies its hint
        if copies:
            # Known before any pass: the drafter runs on the other rows only (a copied hint is drafted whole,
            # W slots); the copied rows' logits are placeholders, replaced by their hints below.
            own = (~follow).nonzero().squeeze(1)  # (b,)
            logits = torch.zeros(follow.shape[0], own_width, self.target.get_output_embeddings().out_features,
                                 device=follow.device)  # (B, W', V) float32, as _head returns
            if own.numel():
                logits[own] = self._head(self._block_states(block, own)[:, :own_width])
        else:
            states = self._block_states(block)[:, :own_width]  # (B, W', H)
            logits = self._head(states) if self.confidence_threshold is None else None  # (B, W', V)
            if self.follow_hint_after is not None:  # the head on the first m slots only, unless it ran on all
                follow = self._follows_hint(logits if logits is not None else self._head(states[:, : self.follow_hint_after]))
            copies = follow is not None and bool(follow.any())
            if logits is None:  # a copied hint is drafted whole (its W slots); otherwise the confident prefix
                logits = self._head(states) if copies else self._confident_logits(states)
        self._sources = self._label_rows(follow, logits.shape[0])
        return self._propose(logits, follow, copies, width, temperature, top_k, top_p, generator)

    def _propose(self, logits, follow, copies: bool, width: int, temperature, top_k, top_p, generator):
        """:meth:`draft`'s tokens (B, W) and q (B, W, V) or None from the drafter's logits (B, W', V) and the
        rows that copy their hint (``follow`` (B,) bool or None; ``copies``: whether any does). Where a row
        copies, the step drafts W slots: copied rows their hint (one-hot q), the others their W' slots and then
        their hint tokens (one-hot q); else the drafter's W' slots."""
        out_width = width if copies else logits.shape[1]
        hints = self._block_hints[0][:, :out_width] if follow is not None else None  # (B, W)
        past = hints[:, logits.shape[1]:] if copies else None  # (B, W - W') the other rows' hints past their slots
        if temperature == 0:
            tokens = logits.argmax(-1)
            if past is not None:
                tokens = torch.cat([tokens, past], dim=1)
            return (tokens if follow is None else torch.where(follow[:, None], hints, tokens)), None
        q = warp_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # (B, W', V) float32
        if past is not None:  # proposed as they are: one-hot q, so the hint token is the draw
            q = torch.cat([q, nn.functional.one_hot(past, q.shape[-1]).to(q.dtype)], dim=1)
        if follow is not None:  # copied rows: q is the point mass on the hint, from which the hint is the draw
            q = torch.where(follow[:, None, None], nn.functional.one_hot(hints, q.shape[-1]).to(q.dtype), q)
        return sample_tokens(q, generator), q  # (B, W): slot k drawn from q[:, k]

    def _label_rows(self, follow: torch.Tensor | None, rows: int) -> list[str] | None:
        """Per row, what drafts it: ``hint:prompt`` / ``hint:store`` (a copied hint of the row's own tokens or
        of the hint store), ``hint:none`` (a copied row with no hint: :attr:`min_drafting_rows`) or ``drafter``
        (the drafter's tokens); None for drafters without lookup hints."""
        if not self.config.lookup_hints:
            return None
        copied = follow.tolist() if follow is not None else [False] * rows
        _, ngram, store = (h.tolist() for h in self._block_hints)
        kinds = ["hint:store" if s else "hint:prompt" if n else "hint:none" for n, s in zip(ngram, store)]
        return [kind if c else "drafter" for c, kind in zip(copied, kinds)]

    def draft_sources(self) -> list[str] | None:
        """What drafted each row of the last :meth:`draft` (see :meth:`_label_rows`; the drafter protocol's
        optional labels, recorded by the verifier beside the accepted counts)."""
        return getattr(self, "_sources", None)

    def _hint_rows(self) -> torch.Tensor:
        """(B,) bool: rows whose hint rests on an n-gram of at least ``follow_hint_min_ngram`` tokens (under
        ``follow_hint_after = 0`` exactly the rows that copy it, known before any pass)."""
        return self._block_hints[1] >= max(1, self.follow_hint_min_ngram)

    def _copied_rows(self) -> torch.Tensor:
        """(B,) bool under ``follow_hint_after = 0``, before any pass: the rows whose hint rests on at least
        ``follow_hint_min_ngram`` tokens, or every row where fewer than :attr:`min_drafting_rows` would draft."""
        follow = self._hint_rows()
        if self.min_drafting_rows is not None and int((~follow).sum()) < self.min_drafting_rows:
            return torch.ones_like(follow)
        return follow

    def _follows_hint(self, logits: torch.Tensor) -> torch.Tensor:
        """(B,) bool: rows whose block is the lookup hint under :attr:`follow_hint_after` (logits (B, >= m, V))."""
        hints, m = self._block_hints[0], self.follow_hint_after
        return self._hint_rows() & (logits[:, :m].argmax(-1) == hints[:, :m]).all(-1)

    def select_rows(self, rows: torch.Tensor) -> None:
        self._require_cache()
        if self._shared and self._target_layers[0].keys.shape[0] != rows.shape[0]:
            raise RuntimeError("select the shared target cache's rows (batch_select_indices) before the drafter's")
        if self._kv_buffers is not None:
            self._kv_buffers = [(k[rows], v[rows]) for k, v in self._kv_buffers]
        self._mask_buffer, self._ids_buffer = self._mask_buffer[rows], self._ids_buffer[rows]
        self._set_views()

    def extra_repr(self) -> str:
        c = self.config
        return (f"block_size={c.block_size}, target_layer_ids={c.target_layer_ids}, "
                f"mask_token_id={c.mask_token_id}, params={sum(p.numel() for p in self.parameters()):,}")


def _from_checkpoint(cls, target: nn.Module, path: str | Path, *, block_size: int | None, num_layers: int | None,
                     target_layer_ids: Sequence[int] | None, mask_token_id: int | None,
                     **overrides: Any) -> BlockDiffusionDrafter:
    """``from_target(..., init_from=path)``: the saved drafter at ``path`` attached to ``target``.

    The checkpoint fixes the architecture. ``num_layers`` is the fresh-initialisation size, so a
    different value is only warned about (the checkpoint's layers are used); every other argument
    that is not None (``block_size``, ``target_layer_ids``, ``mask_token_id``, the overrides) must
    equal the checkpoint's value, else the call is refused naming the field.
    """
    drafter = cls.from_pretrained(path, target=target)
    cfg = drafter.config
    allowed = {f.name for f in dataclasses.fields(DrafterConfig)} - {"target_fingerprint"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown drafter overrides {unknown}; allowed: {sorted(allowed)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if block_size is not None:
        given["block_size"] = block_size
    if target_layer_ids is not None:
        given["target_layer_ids"] = tuple(int(i) for i in target_layer_ids)
    if mask_token_id is not None:
        given["mask_token_id"] = int(mask_token_id)
    diffs = [f"drafter.{k}={v!r} but the checkpoint has {k}={getattr(cfg, k)!r}"
             for k, v in given.items() if v != getattr(cfg, k)]
    if diffs:
        raise ValueError(f"drafter.init_from={path}: " + "; ".join(diffs)
                         + " (set these to the checkpoint's values or to null)")
    if num_layers is not None and num_layers != cfg.num_layers:
        import warnings

        warnings.warn(f"drafter.init_from={path}: using its {cfg.num_layers} layers "
                      f"(drafter.num_layers={num_layers} applies to fresh drafters only)", stacklevel=3)
    return drafter.train()  # a training start, like from_target's fresh drafters


# Re-exported: importable from drafters.model as before drafters.config and drafters.layers existed.
__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "BlockDiffusionDrafter", "DrafterConfig", "accepts_argument",
           "default_target_layer_ids", "target_final_norm_weight", "target_fingerprint"]
