"""DrafterLightningModule: teacher-forced training of a block drafter against a frozen target.

Each step runs the frozen target once over the batch (no grad, ``output_hidden_states=True``; full
logits only when the loss needs soft labels) or reads the batch's cached features, samples random
anchors in every response and runs the drafter on all blocks at once (:mod:`drafters.training.blocks`), and
applies the loss to the blocks that have labels.

Validation measures, on held-out regenerated sequences (docs/method.md §4; the sums are in
:mod:`drafters.training.validation`): ``val/loss`` and its components (the training objective on seeded
random anchors), ``val/tau_greedy`` and ``val/tau_soft`` (the teacher-forced τ of
:mod:`drafters.tau`) and ``val/acc_slot<k>`` (teacher-forced top-1 accuracy of slot k).

Checkpoints hold the drafter's weights only (the target lives outside the module tree) plus the
drafter's config, so resuming with another target or another drafter shape fails with a message.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

from drafters.config import accepts_argument
from drafters.factory import check_same_config
from drafters.tau import batch_tau_counts
from drafters.training.batching import SOURCE_ROWS
from drafters.training.blocks import lookup_anchor_weights, run_target, select_blocks, slot_stats
from drafters.training.compat import register_output_recording, strip_output_capturing_hooks
from drafters.training.optim import warmup_cosine, weight_decay_groups
from drafters.training.validation import ValidationSums
from drafters.training.vocab import TrainVocab

# warmup_cosine stays importable from here: the configs (and saved runs' configs) name it
# drafters.training.module.warmup_cosine.
__all__ = ["DrafterLightningModule", "NonFiniteLossError", "warmup_cosine"]


class NonFiniteLossError(FloatingPointError):
    """A training step's loss is NaN or infinite: training stops before the optimizer step applies it."""


class DrafterLightningModule(L.LightningModule):
    """Training hooks and logging for a block drafter; the target is frozen and never saved.

    Args:
        drafter: a :class:`drafters.model.DFlashDrafter` attached to ``target``.
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
        train_vocab_size: training logits over this many frequent response tokens only (a cheaper step;
            :mod:`drafters.training.vocab`; set by :meth:`set_train_vocab`); None = the full vocabulary. Validation
            and drafting always use the full vocabulary.
        train_vocab_negatives: ids outside the candidate vocabulary scored each step (a sampled softmax).
        lookup_anchor_weight: training anchors where a hybrid would draft by prompt lookup instead (the row's last
            ``lookup_min_match`` tokens recur in it) are drawn this much less often, in (0, 1]; 1 = uniform
            (:func:`drafters.training.blocks.lookup_anchor_weights`). Validation draws every anchor alike.
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
        train_vocab_size: int | None = None,
        train_vocab_negatives: int = 0,
        lookup_anchor_weight: float = 1.0,
        lookup_min_match: int = 2,
    ):
        super().__init__()
        if num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
        if not 0 < lookup_anchor_weight <= 1 or lookup_min_match < 1:
            raise ValueError(f"need 0 < module.lookup_anchor_weight <= 1 and module.lookup_min_match >= 1, got "
                             f"{lookup_anchor_weight} and {lookup_min_match}")
        if getattr(drafter, "_target", None) is not None and drafter.target is not target:
            raise ValueError("the drafter is attached to a different target than the one given")
        self.drafter, self.loss = drafter, loss
        object.__setattr__(self, "target", target.eval().requires_grad_(False))
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.num_anchors, self.val_anchor_chunk, self.seed = num_anchors, val_anchor_chunk, seed
        self._logits_to_keep = accepts_argument(target.forward, "logits_to_keep")
        self.val_sums: ValidationSums | None = None  # made by the first validation step (loss components)
        self.train_vocab_size, self.train_vocab_negatives = train_vocab_size, train_vocab_negatives
        self.train_vocab: TrainVocab | None = None
        self.lookup_anchor_weight, self.lookup_min_match = float(lookup_anchor_weight), int(lookup_min_match)

    def __getstate__(self) -> dict:
        strip_output_capturing_hooks(self.target)  # picklable for ddp_spawn
        return super().__getstate__()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        register_output_recording(self.target)

    # ---- the step's inputs (drafters.training.blocks) ----------------------------------------------------

    def _target_on_device(self) -> None:
        if next(self.target.parameters()).device != self.device:
            self.target.to(self.device)

    def _generator(self, *key: int) -> torch.Generator:
        return torch.Generator().manual_seed(hash((self.seed, *key)) & 0x7FFF_FFFF_FFFF_FFFF)

    def context_states(self, batch, full_logits: bool):
        """``(states, target_logits)`` of a batch: its cached features (``batch["features"]``, see
        :mod:`drafters.training.features`) when present and no logits are needed or the batch carries the target's
        cached final states (``head_states``, the logits' source), else a target forward."""
        if "features" in batch and (not full_logits or "head_states" in batch):
            return batch["features"], None
        self._target_on_device()
        out = run_target(self.target, batch, full_logits, self._logits_to_keep)
        return out.hidden_states, out.logits

    def set_train_vocab(self, vocab_ids: torch.Tensor) -> None:
        """The candidate vocabulary (V',) of the training loss (:func:`drafters.training.vocab.frequent_tokens`)."""
        self.train_vocab = TrainVocab.build(vocab_ids, self.drafter.vocab_size, self.train_vocab_negatives)

    def _blocks(self, batch, states, target_logits, generator, vocab=None, weighted=False):
        if vocab is not None:
            vocab = vocab.to(self.device)
        weights = (lookup_anchor_weights(batch, self.lookup_anchor_weight, self.lookup_min_match)
                   if weighted and self.lookup_anchor_weight < 1 else None)
        return select_blocks(self.drafter, batch, states, target_logits, self.num_anchors, generator,
                             soft=getattr(self.loss, "soft", False), vocab=vocab, anchor_weights=weights)

    # ---- training and validation ----------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        states, target_logits = self.context_states(batch, full_logits=getattr(self.loss, "soft", False))
        if self.train_vocab_size and self.train_vocab is None:
            raise ValueError("module.train_vocab_size is set but no candidate vocabulary was given (set_train_vocab)")
        logits, labels, mask, target_probs = self._blocks(batch, states, target_logits,
                                                          self._generator(self.global_step, self.global_rank),
                                                          self.train_vocab, weighted=True)
        loss, components = self.loss(logits, labels, mask, target_probs)
        self._check_finite_loss(loss, batch, batch_idx)
        bsz = batch["input_ids"].shape[0]
        with torch.no_grad():
            correct, count, lead = slot_stats(logits, labels, mask)
            acc = correct.float() / count.clamp(min=1)
            logs = {"train/acc_slot1": acc[0], "train/acc_mean": correct.sum() / count.sum().clamp(min=1),
                    "train/tau_tf": 1 + lead.float().mean(), "train/blocks": float(logits.shape[0]),
                    "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"]}
            logs.update({f"train/{k}": v for k, v in components.items()})
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=bsz)
        self.log_dict(logs, batch_size=bsz)
        return loss

    def _check_finite_loss(self, loss: torch.Tensor, batch, batch_idx: int) -> None:
        """Stop training on a NaN or infinite loss (before it reaches the weights), naming the step and the data
        rows of the batch. Every rank decides together (one rank stopping alone would leave the others waiting)."""
        finite = bool(torch.isfinite(loss.detach()).all())
        if self.trainer.strategy.reduce_boolean_decision(finite, all=True):
            return
        where = f"training loss is {loss.detach().float().cpu().tolist()} at step {self.global_step}"
        if finite:
            raise NonFiniteLossError(f"{where} on another rank (this rank's loss is finite); that rank's error "
                                     "names the rows; training stopped")
        raise NonFiniteLossError(f"{where} (batch {batch_idx} of epoch {self.current_epoch}), {self._rows_of(batch)}; "
                                 "training stopped: check these rows (and their cached features), or lower the "
                                 "learning rate")

    def _rows_of(self, batch) -> str:
        """The data rows of a batch as a message names them: indices into the data dir, and ids when known."""
        if SOURCE_ROWS not in batch:
            return "its source rows unknown (the batch carries no source_rows)"
        rows = batch[SOURCE_ROWS].tolist()
        train_set = getattr(getattr(self.trainer, "datamodule", None), "train_set", None)
        data = getattr(train_set, "data", None)
        try:
            ids = [data[i]["id"] for i in rows] if data is not None else None
        except (IndexError, KeyError, TypeError):
            ids = None
        root = getattr(self.trainer.datamodule, "data_dir", None) if data is not None else None
        shown = f"source rows {rows}" + (f" of data dir {root}" if root is not None else "")
        return shown + (f" (ids {ids})" if ids else "")

    def on_validation_epoch_start(self) -> None:
        if self.val_sums is not None:
            self.val_sums.reset()

    def validation_step(self, batch, batch_idx):
        self._target_on_device()
        out = run_target(self.target, batch, full_logits=True)
        logits, labels, mask, target_probs = self._blocks(batch, out.hidden_states, out.logits,
                                                          self._generator(-1, batch_idx))
        loss, components = self.loss(logits, labels, mask, target_probs)
        correct, count, _ = slot_stats(logits, labels, mask)
        tau = batch_tau_counts(self.drafter, out.hidden_states, out.logits, batch, self.val_anchor_chunk)
        if self.val_sums is None:
            self.val_sums = ValidationSums(labels.shape[-1], sorted(components)).to(self.device)
        self.val_sums.update(loss, components, correct, count, tau)

    def on_validation_epoch_end(self) -> None:
        if self.val_sums is None or self.val_sums.update_count == 0:
            return
        logs = {k: v.float() for k, v in self.val_sums.compute().items()}  # summed over ranks
        # sync_dist only averages the ranks' equal values (and silences Lightning).
        self.log("val/tau_greedy", logs.pop("val/tau_greedy"), prog_bar=True, sync_dist=True)
        self.log_dict(logs, sync_dist=True)
        self.val_sums.reset()

    # ---- optimisation and checkpoints ----------------------------------------------------------

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(weight_decay_groups(self.drafter))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if not k.startswith(("drafter.", "loss."))]:
            del state[key]  # never store the frozen target
        checkpoint["drafter_config"] = self.drafter.saved_config()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("drafter_config")
        if saved is None:
            raise ValueError("checkpoint has no drafter_config: it was not written by DrafterLightningModule")
        check_same_config(saved, self.drafter.saved_config())
