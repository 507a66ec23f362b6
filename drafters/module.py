"""DrafterLightningModule: teacher-forced training of a block drafter against a frozen target.

Each step runs the frozen target once over the batch (no grad, ``output_hidden_states=True``; full
logits only when the loss needs soft labels), samples random anchors in every response
(:func:`drafters.data.sample_anchors`), runs the drafter on all blocks at once
(``forward_train``) and applies the loss to the blocks that have labels.

Validation measures, on held-out regenerated sequences (DESIGN.md §4):

* ``val/loss`` and its components: the training objective on seeded random anchors;
* ``val/tau_greedy``: a block-by-block simulation of greedy verification. Every response column a
  is tried as an anchor (:func:`anchor_acceptance`): the drafter drafts K tokens from the true
  context, and the draft is accepted up to its first slot that differs from the target's greedy
  token (argmax of the target's logits at column a + k − 1, on the true context). Then
  :func:`greedy_walk` replays verification: start at the prompt's last token, accept n drafts,
  emit n + 1 tokens, next anchor = a + n + 1, truncated at the end of the sequence. τ = kept
  tokens / steps, pooled over sequences. On sequences the target generated greedily this equals
  the online τ of ``verify.speculative_generate`` at temperature 0 exactly (the data *is* the
  target's greedy output, so the true context is the context the verifier would have); on
  sampled data it is an estimate;
* ``val/tau_soft``: the expected accepted length per step at temperature 1 for greedy drafts,
  where slot k is accepted with probability a_k = p_target(d_k) (the verifier's min(1, p/q) for
  a one-hot q): per anchor, E = 1 + Σ_k Π_{j≤k} a_j over the block's in-sequence slots, averaged
  over every response anchor;
* ``val/acc_slot<k>``: teacher-forced top-1 accuracy of slot k against the data's tokens.

Checkpoints hold the drafter's weights only (the target lives outside the module tree) plus the
drafter's config, so resuming with another target or another drafter shape fails with a message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import lightning as L
import torch
from torch import nn

from drafters.data import sample_anchors
from drafters.model import accepts_argument

# ----------------------------------------------------------------------------- schedules


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x lr at ``max_steps``."""
    if warmup_steps < 0 or max_steps < 1 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"bad schedule: warmup_steps={warmup_steps}, max_steps={max_steps}, "
                         f"min_lr_ratio={min_lr_ratio}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- teacher-forced τ


def slot_positions(anchors: torch.Tensor, num_slots: int, seq_len: int) -> torch.Tensor:
    """Column whose target logits predict slot k of each block: ``anchor + k - 1``, (B, A, K) clamped."""
    offsets = torch.arange(num_slots, device=anchors.device)
    return (anchors.unsqueeze(-1) + offsets).clamp(max=seq_len - 1)


@torch.no_grad()
def anchor_acceptance(
    drafter,
    hidden_states: Sequence[torch.Tensor],  # full HF tuple, each (B, S, H)
    target_logits: torch.Tensor,  # (B, S, V)
    input_ids: torch.Tensor,  # (B, S) long, right-padded
    attention_mask: torch.Tensor,  # (B, S)
    prompt_len: torch.Tensor,  # (B,) long
    length: torch.Tensor,  # (B,) long
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy-draft acceptance of a block anchored at every response column.

    Returns, indexed by anchor column (B, S): ``lead`` (long, the number of leading drafts equal to
    the target's greedy tokens, counting only slots inside the sequence), ``soft`` (float,
    1 + Σ_k Π_{j≤k} p_target(d_j)) and ``valid`` (bool, the anchor columns prompt_len-1..length-2).
    """
    bsz, seq = input_ids.shape
    k_slots = drafter.config.block_size - 1
    ref = target_logits.argmax(-1)  # (B, S): the target's greedy token for column c + 1
    lse = torch.stack([row.float().logsumexp(-1) for row in target_logits])  # (B, S)
    # One spare column (index S) receives the padding anchors' values and is dropped at the end.
    lead = torch.zeros(bsz, seq + 1, dtype=torch.long, device=input_ids.device)
    soft = torch.zeros(bsz, seq + 1, dtype=torch.float32, device=input_ids.device)
    valid = torch.zeros(bsz, seq + 1, dtype=torch.bool, device=input_ids.device)
    lo, count = prompt_len - 1, length - prompt_len  # first anchor column, anchors per row
    rows = torch.arange(bsz, device=input_ids.device).view(bsz, 1, 1)
    for start in range(0, int(count.max()), chunk):
        j = torch.arange(start, min(start + chunk, int(count.max())), device=input_ids.device)  # (A,)
        amask = j.unsqueeze(0) < count.unsqueeze(1)  # (B, A)
        anchors = (lo.unsqueeze(1) + j).masked_fill(~amask, 0)  # (B, A)
        logits = drafter.forward_train(hidden_states, input_ids, None, anchors, amask, attention_mask)
        drafts = logits.argmax(-1)  # (B, A, K)
        cols = slot_positions(anchors, k_slots, seq)  # (B, A, K)
        inside = (anchors.unsqueeze(-1) + torch.arange(1, k_slots + 1, device=anchors.device)
                  < length.view(bsz, 1, 1)) & amask.unsqueeze(-1)  # (B, A, K): column a+k is a token
        match = (drafts == ref.gather(1, cols.view(bsz, -1)).view_as(drafts)) & inside
        p = (target_logits[rows, cols, drafts].float() - lse.gather(1, cols.view(bsz, -1)).view_as(cols)).exp()
        block_soft = 1 + (p * inside).cumprod(-1).sum(-1)  # (B, A)
        block_lead = match.long().cumprod(-1).sum(-1)  # (B, A)
        where = anchors.masked_fill(~amask, seq)  # (B, A)
        lead.scatter_(1, where, block_lead)
        soft.scatter_(1, where, block_soft)
        valid.scatter_(1, where, amask)
    return lead[:, :seq], soft[:, :seq], valid[:, :seq]


def greedy_walk(lead: Sequence[int], prompt_len: int, length: int) -> tuple[list[int], list[int]]:
    """Replay greedy verification over one sequence of ``length`` tokens.

    ``lead[a]`` is the number of leading accepted drafts of the block anchored at column a. The
    first anchor is column ``prompt_len - 1``; a step that accepts n of the r tokens left keeps
    min(n + 1, r) tokens and moves the anchor by that much. Returns per-step
    ``(accepted_counts, kept_tokens)``, as ``speculative_generate`` counts them.
    """
    anchor, accepted, kept = prompt_len - 1, [], []
    while anchor < length - 1:
        left = length - 1 - anchor
        n = min(int(lead[anchor]), left)
        step = min(n + 1, left)
        accepted.append(n)
        kept.append(step)
        anchor += step
    return accepted, kept


@torch.no_grad()
def teacher_forced_tau(drafter, target, batch: dict[str, torch.Tensor], chunk: int = 64) -> dict:
    """Teacher-forced τ of a right-padded batch (see :func:`drafters.data.collate`).

    Returns ``accepted_counts`` (per row, per step), ``tau_greedy`` (pooled kept tokens / steps) and
    ``tau_soft`` (mean over response anchors of the expected accepted length at temperature 1).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"]
    out = target(input_ids=ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
    lead, soft, valid = anchor_acceptance(drafter, out.hidden_states, out.logits, ids, attn,
                                          batch["prompt_len"], batch["length"], chunk)
    counts, kept = [], 0
    for b, row in enumerate(lead.tolist()):
        acc, step_kept = greedy_walk(row, int(batch["prompt_len"][b]), int(batch["length"][b]))
        counts.append(acc)
        kept += sum(step_kept)
    steps = sum(len(c) for c in counts)
    return {
        "accepted_counts": counts,
        "tau_greedy": kept / max(steps, 1),
        "tau_soft": float(soft[valid].mean()) if valid.any() else float("nan"),
    }


# ----------------------------------------------------------------------------- the module


def strip_output_capturing_hooks(model: nn.Module) -> None:
    """Remove the forward hooks transformers 5 installs the first time a model returns hidden states.

    They are local functions, which cannot be pickled (``ddp_spawn`` pickles the module and with it
    the target); transformers installs them again on the next forward that needs them.
    """
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__qualname__", "").endswith("output_capturing_hook"):
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False


def register_output_recording(model: nn.Module) -> None:
    """Make an unpickled transformers-5 model return hidden states again.

    transformers records which outputs a model class can capture in a registry filled by the
    model's ``__init__``; a model unpickled in a fresh process (``ddp_spawn``) never ran it there, so
    ``output_hidden_states=True`` would silently return None. Fill the registry from the instances.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:  # other transformers versions: nothing to do
        return
    for module in model.modules():
        if getattr(module, "_can_record_outputs", None) is not None and not registry.get(module):
            registry[module] = module._can_record_outputs



class DrafterLightningModule(L.LightningModule):
    """Training hooks and logging for a block drafter; the target is frozen and never saved.

    Args:
        drafter: a :class:`drafters.BlockDiffusionDrafter` attached to ``target``.
        target: the frozen Hugging Face causal LM (kept outside the module tree: not in the state
            dict, not seen by DDP/FSDP; moved to the module's device when a step runs).
        loss: an ``nn.Module`` ``(logits (N,K,V), labels (N,K), mask (N,K), target_probs) ->
            (loss, components)`` with a bool attribute ``soft`` (e.g. AcceptanceAlignedLoss).
        optimizer: ``params -> Optimizer`` (Hydra ``_partial_: true``); norm weights get no decay.
        scheduler: optional ``optimizer -> LRScheduler``, stepped every optimizer step.
        num_anchors: blocks per training sequence (at most the response length).
        val_anchor_chunk: anchors per drafter call in the teacher-forced τ (memory bound).
        seed: anchors of step s on rank r come from seed (seed, s, r), so a resumed run draws the
            same anchors it would have drawn.
    """

    def __init__(
        self,
        drafter: nn.Module,
        target: nn.Module,
        loss: nn.Module,
        optimizer: Callable,
        scheduler: Callable | None = None,
        num_anchors: int = 32,
        val_anchor_chunk: int = 64,
        seed: int = 0,
    ):
        super().__init__()
        if num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
        if getattr(drafter, "_target", None) is not None and drafter.target is not target:
            raise ValueError("the drafter is attached to a different target than the one given")
        self.drafter, self.loss = drafter, loss
        object.__setattr__(self, "target", target.eval().requires_grad_(False))
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.num_anchors, self.val_anchor_chunk, self.seed = num_anchors, val_anchor_chunk, seed
        self._logits_to_keep = accepts_argument(target.forward, "logits_to_keep")
        self._val_sums: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        strip_output_capturing_hooks(self.target)  # picklable for ddp_spawn
        return super().__getstate__()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        register_output_recording(self.target)

    # ---- helpers -------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.drafter.config.block_size - 1

    def _target_on_device(self) -> None:
        param = next(self.target.parameters())
        if param.device != self.device:
            self.target.to(self.device)

    def _run_target(self, batch, full_logits: bool):
        kwargs = {} if full_logits or not self._logits_to_keep else {"logits_to_keep": 1}
        with torch.no_grad():
            out = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              output_hidden_states=True, use_cache=False, **kwargs)
        if getattr(out, "hidden_states", None) is None:
            raise ValueError(f"target {type(self.target).__name__} returned no hidden_states; the drafter "
                             "needs them (output_hidden_states=True)")
        return out

    def _generator(self, *key: int) -> torch.Generator:
        seed = hash((self.seed, *key)) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator().manual_seed(seed)

    def context_states(self, batch, full_logits: bool):
        """``(states, target_logits)`` of a batch: its cached features (``batch["features"]``, see
        :mod:`drafters.features`) when present and no logits are needed, else a target forward."""
        if "features" in batch and not full_logits:
            return batch["features"], None
        self._target_on_device()
        out = self._run_target(batch, full_logits)
        return out.hidden_states, out.logits

    def _blocks(self, batch, states, target_logits, generator):
        """Drafter logits and labels of the blocks that have labels: (N, K, V), (N, K), (N, K), probs.

        ``states``: the target's hidden states (full HF tuple) or cached features (B, S, L*H).
        """
        ids, attn = batch["input_ids"], batch["attention_mask"]
        anchors, amask = sample_anchors(batch["prompt_len"], batch["length"], self.num_anchors, generator)
        logits = self.drafter.forward_train(states, ids, None, anchors, amask, attn)  # (B,A,K,V)
        labels, mask = self.drafter.block_labels(ids, anchors, amask, attn)  # (B, A, K)
        keep = mask.any(-1)  # (B, A)
        # Drop padding blocks; when there are none, flatten instead (indexing would copy the logits
        # and scatter their gradient back, ~10% of a CPU step).
        select = (lambda t: t.flatten(0, 1)) if bool(keep.all()) else (lambda t: t[keep])
        target_probs = None
        if getattr(self.loss, "soft", False):
            cols = select(slot_positions(anchors, self.num_slots, ids.shape[1]))  # (N, K)
            rows = select(torch.arange(ids.shape[0], device=ids.device).view(-1, 1).expand_as(anchors))  # (N,)
            target_probs = target_logits[rows.unsqueeze(-1), cols].float().softmax(-1)  # (N, K, V)
        return select(logits), select(labels), select(mask), target_probs

    @staticmethod
    def _slot_stats(logits, labels, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-slot correct and label counts (K,), and per-block leading-correct counts (N,)."""
        correct = (logits.argmax(-1) == labels) & mask  # (N, K)
        return correct.sum(0), mask.sum(0), correct.long().cumprod(-1).sum(-1)

    # ---- training ------------------------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        states, target_logits = self.context_states(batch, full_logits=getattr(self.loss, "soft", False))
        generator = self._generator(self.global_step, self.global_rank)
        logits, labels, mask, target_probs = self._blocks(batch, states, target_logits, generator)
        loss, components = self.loss(logits, labels, mask, target_probs)
        bsz = batch["input_ids"].shape[0]
        with torch.no_grad():
            correct, count, lead = self._slot_stats(logits, labels, mask)
            acc = correct.float() / count.clamp(min=1)
            logs = {"train/loss": loss.detach(), "train/acc_slot1": acc[0],
                    "train/acc_mean": correct.sum() / count.sum().clamp(min=1),
                    "train/tau_tf": 1 + lead.float().mean(), "train/blocks": float(logits.shape[0]),
                    "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"]}
            logs.update({f"train/{k}": v for k, v in components.items()})
        self.log("train/loss", logs.pop("train/loss"), prog_bar=True, batch_size=bsz)
        self.log_dict(logs, batch_size=bsz)
        return loss

    # ---- validation ----------------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def _add(self, name: str, value) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().double()
        self._val_sums[name] = self._val_sums.get(name, 0) + value

    def validation_step(self, batch, batch_idx):
        self._target_on_device()
        out = self._run_target(batch, full_logits=True)
        logits, labels, mask, target_probs = self._blocks(batch, out.hidden_states, out.logits,
                                                          self._generator(-1, batch_idx))
        loss, components = self.loss(logits, labels, mask, target_probs)
        correct, count, _ = self._slot_stats(logits, labels, mask)
        self._add("loss", loss)
        self._add("batches", 1.0)
        for k, v in components.items():
            self._add(f"c_{k}", v)
        self._add("correct", correct)
        self._add("count", count)

        ids, attn = batch["input_ids"], batch["attention_mask"]
        lead, soft, valid = anchor_acceptance(self.drafter, out.hidden_states, out.logits, ids, attn,
                                              batch["prompt_len"], batch["length"], self.val_anchor_chunk)
        kept = steps = 0
        for b, row in enumerate(lead.tolist()):
            acc, step_kept = greedy_walk(row, int(batch["prompt_len"][b]), int(batch["length"][b]))
            kept, steps = kept + sum(step_kept), steps + len(acc)
        self._add("kept", float(kept))
        self._add("steps", float(steps))
        self._add("soft_sum", soft[valid].double().sum())
        self._add("soft_count", valid.sum())

    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        names = sorted(self._val_sums)  # same keys on every rank
        flat = torch.cat([self._val_sums[n].reshape(-1) for n in names])
        flat = self.trainer.strategy.reduce(flat, reduce_op="sum")
        sums, offset = {}, 0
        for n in names:
            size = self._val_sums[n].numel()
            sums[n] = flat[offset: offset + size].reshape(self._val_sums[n].shape)
            offset += size
        batches = sums["batches"].clamp(min=1)
        logs = {"val/loss": sums["loss"] / batches,
                "val/tau_greedy": sums["kept"] / sums["steps"].clamp(min=1),
                "val/tau_soft": sums["soft_sum"] / sums["soft_count"].clamp(min=1),
                "val/acc_mean": sums["correct"].sum() / sums["count"].sum().clamp(min=1)}
        logs.update({f"val/{n[2:]}": sums[n] / batches for n in names if n.startswith("c_")})
        acc = sums["correct"] / sums["count"].clamp(min=1)
        logs.update({f"val/acc_slot{k + 1}": acc[k] for k in range(acc.numel())})
        # Already summed over ranks: sync_dist only averages equal values (and silences Lightning).
        self.log("val/tau_greedy", logs.pop("val/tau_greedy").float(), prog_bar=True, sync_dist=True)
        self.log_dict({k: v.float() for k, v in logs.items()}, sync_dist=True)
        self._val_sums = {}

    # ---- optimisation and checkpoints ----------------------------------------------------------

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, param in self.drafter.named_parameters():
            if not param.requires_grad:
                continue
            leaf = name.split(".")
            (no_decay if leaf[-1] == "bias" or "norm" in leaf[-2] else decay).append(param)
        optimizer = self.optimizer_factory([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if not k.startswith(("drafter.", "loss."))]:
            del state[key]  # never store the frozen target
        checkpoint["drafter_config"] = self.drafter.config.to_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("drafter_config")
        if saved is None:
            raise ValueError("checkpoint has no drafter_config: it was not written by DrafterLightningModule")
        ours = self.drafter.config.to_dict()
        if saved.get("target_fingerprint") != ours["target_fingerprint"]:
            raise ValueError(
                f"checkpoint was trained for another target: its target fingerprint is "
                f"{saved.get('target_fingerprint')}, the current target's is {ours['target_fingerprint']}"
            )
        diffs = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
        if diffs:
            shown = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diffs.items())
            raise ValueError(f"checkpoint's drafter config differs from the current one: {shown}")
