"""One teacher-forced training step's inputs: the frozen target's pass and the blocks that have labels.

Used by :class:`drafters.training.module.DrafterLightningModule` (training and validation steps) and by the
training benchmark (``experiments/bench/train.py``), so both run exactly the same step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from drafters.training.datamodule import sample_anchors
from drafters.training.vocab import TrainVocab, remap_labels
from verify.lookup import recurring_suffixes


def slot_positions(anchors: torch.Tensor, num_slots: int, seq_len: int) -> torch.Tensor:
    """Column whose target logits predict slot k of each block: ``anchor + k - 1``, (B, A, K) clamped."""
    offsets = torch.arange(num_slots, device=anchors.device)
    return (anchors.unsqueeze(-1) + offsets).clamp(max=seq_len - 1)


@torch.no_grad()
def run_target(target: nn.Module, batch: dict[str, torch.Tensor], full_logits: bool = True,
               logits_to_keep: bool = False):
    """The frozen target's forward over a right-padded batch, with hidden states and no cache.

    ``full_logits=False`` with ``logits_to_keep=True`` (the target's ``forward`` takes that argument,
    see :func:`drafters.config.accepts_argument`) computes the logits of the last column only.
    """
    kwargs = {} if full_logits or not logits_to_keep else {"logits_to_keep": 1}
    out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 output_hidden_states=True, use_cache=False, **kwargs)
    if getattr(out, "hidden_states", None) is None:
        raise ValueError(f"target {type(target).__name__} returned no hidden_states; the drafter "
                         "needs them (output_hidden_states=True)")
    return out


def select_blocks(
    drafter: nn.Module,
    batch: dict[str, torch.Tensor],
    states: Sequence[torch.Tensor] | torch.Tensor,
    target_logits: torch.Tensor | None,
    num_anchors: int,
    generator: torch.Generator,
    soft: bool = False,
    vocab: TrainVocab | None = None,
    anchor_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drafter logits and labels of the blocks that have labels: (N, K, V), (N, K), (N, K), probs.

    ``num_anchors`` blocks per row are anchored at random response columns
    (:func:`drafters.training.datamodule.sample_anchors` with ``generator``). ``states``: the target's hidden states
    (full HF tuple) or cached features (B, S, L*H). With ``soft``, the target's distributions at the
    blocks' slots (N, K, V) come from ``target_logits`` (B, S, V) or, when it is None, from the batch's cached
    ``head_states`` (B, S, H) through the frozen LM head; else probs is None. ``vocab``: a candidate
    vocabulary (:class:`drafters.training.vocab.TrainVocab`): logits (N, K, V' + R) over the candidates and R sampled
    negatives, labels as candidate indices, each block's labels cut at its first one outside; soft labels are
    then the target's distribution over those same columns (renormalised there, as the drafter's is).
    ``anchor_weights`` (B, S): the anchors drawn in proportion to them (:func:`lookup_anchor_weights`).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"]
    anchors, amask = sample_anchors(batch["prompt_len"], batch["length"], num_anchors, generator, anchor_weights)
    columns = None if vocab is None else vocab.columns(generator)  # (V' + R,)
    extra = {} if columns is None else {"vocab_ids": columns}
    logits = drafter.forward_train(states, ids, None, anchors, amask, attn, batch["prompt_len"], **extra)  # (B,A,K,V)
    labels, mask = drafter.block_labels(ids, anchors, amask, attn)  # (B, A, K)
    if vocab is not None:
        labels, mask = remap_labels(labels, mask, vocab.table)
    keep = mask.any(-1)  # (B, A)
    # Drop padding blocks; when there are none, flatten instead (indexing would copy the logits
    # and scatter their gradient back, ~10% of a CPU step).
    select = (lambda t: t.flatten(0, 1)) if bool(keep.all()) else (lambda t: t[keep])
    target_probs = None
    if soft:
        cols = select(slot_positions(anchors, labels.shape[-1], ids.shape[1]))  # (N, K)
        rows = select(torch.arange(ids.shape[0], device=ids.device).view(-1, 1).expand_as(anchors))  # (N,)
        target_probs = slot_target_logits(drafter, batch, target_logits, rows.unsqueeze(-1), cols,
                                          columns).float().softmax(-1)  # (N, K, V or V' + R)
    return select(logits), select(labels), select(mask), target_probs


def lookup_anchor_weights(batch: dict[str, torch.Tensor], weight: float, min_match: int) -> torch.Tensor:
    """(B, S) float: ``weight`` at the columns a hybrid would draft by prompt lookup from (the row's last
    ``min_match`` tokens recur earlier in it: :func:`verify.lookup.recurring_suffixes`), 1 elsewhere. A drafter
    trained with these anchor weights learns less of what lookup serves in the hybrid."""
    ids, length = batch["input_ids"].cpu(), batch["length"].cpu()
    out = torch.ones(ids.shape)  # (B, S)
    for row, (tokens, n) in enumerate(zip(ids, length.tolist())):
        served = torch.tensor(recurring_suffixes(tokens[:n].tolist(), min_match) + [False] * (ids.shape[1] - n))
        out[row, served] = weight
    return out


def slot_target_logits(drafter: nn.Module, batch: dict[str, torch.Tensor], target_logits: torch.Tensor | None,
                       rows: torch.Tensor, cols: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
    """The target's logits at positions (rows, cols) (N, K), over ``columns`` (all when None): (N, K, V').

    From ``target_logits`` (B, S, V) when given, else from the batch's cached final states ``head_states``
    (B, S, H) through the target's LM head (:data:`drafters.training.features.HEAD`), which the drafter shares."""
    if target_logits is not None:
        picked = target_logits[rows, cols]  # (N, K, V)
        return picked if columns is None else picked[..., columns]
    if "head_states" not in batch:
        raise ValueError("soft labels need the target's logits or cached head_states in the batch "
                         "(data.features with a soft loss caches them)")
    return drafter.head(batch["head_states"][rows, cols], columns)


def slot_stats(logits, labels, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot correct and label counts (K,), and per-block leading-correct counts (N,)."""
    correct = (logits.argmax(-1) == labels) & mask  # (N, K)
    return correct.sum(0), mask.sum(0), correct.long().cumprod(-1).sum(-1)
