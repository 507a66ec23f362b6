"""Benchmark: how fast a block drafter learns, on cached target features, for diagnosis.

    python -m experiments.bench.learning --data-dir <regenerated data dir> [--steps 300] [--lr 1e-3]
        [--layers 1] [--block-size 16] [--num-anchors 32] [--target-layer-ids 1 2 3 4 5]
        [--init current|first_wave|target_last|random] [--gamma G] [--loss-slots N] [--overfit]
        [--design dflash|layerwise] [--unshifted] [--out runs/bench_learning.json] [--val-from <another data dir>]

A plain loop (AdamW, warmup + cosine, uniform CE or ``--gamma`` decay, gradient clipping at 1.0), no Lightning: the
drafter from :func:`drafters.factory.from_target`, the context from the feature cache
of :mod:`drafters.training.features` (computed on first use), anchors from :func:`drafters.training.datamodule.sample_anchors`.
Every ``--eval-every`` steps it records, on the validation split (or the training batch with
``--overfit``): CE, top-1 accuracy per slot, and the teacher-forced greedy τ over every response
anchor (on greedy self-distilled data the data's tokens are the target's greedy tokens, so this τ is
the online T=0 τ; docs/method.md §4), plus the mean gradient norms of the context path (``fuse``; layerwise: layer 0's k projection) and
the drafter layers. ``--init first_wave`` rebuilds the first wave's initialisation (weights std
0.02, output norm = the target's final norm / sqrt(H)) for comparison; ``--init target_last`` starts
the drafter as the target's last layer(s) reading the deepest selected state (no help: see README).
``--design layerwise`` trains the layerwise drafter (``conf/drafter/layerwise.yaml``: layer i copied from
the target's layer i, reading its input state; slots shifted), ``--unshifted`` without the shift,
``--init random`` without the copy.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from drafters import factory
from drafters.config import target_final_norm_weight
from drafters.layers import copy_target_layers
from drafters.model import DFlashDrafter
from drafters.training.datamodule import (
    collate,
    ensure_features,
    load_regenerated,
    sample_anchors,
    split_by_id,
)
from drafters.training.features import FeatureStore
from experiments.data.target import TINY_TARGET_DIR, load_target
from losses import AcceptanceAlignedLoss


def first_wave_init(drafter: DFlashDrafter, target) -> None:
    """The first wave's initialisation (collapsed: docs/history.md, "Why the first-wave drafters did not draft")."""
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, 0.02)
        drafter.norm.weight.copy_(target_final_norm_weight(target).float() * drafter.config.hidden_size ** -0.5)


def target_last_init(drafter: DFlashDrafter, target) -> None:
    """Diagnosis: the drafter's layers <- the target's LAST layers, the fuse picks the deepest selected
    hidden state and fuse_norm is that layer's input norm, so the context keys/values start equal to
    the target's own in its last layer (build the drafter with qk_norm=False: Llama has none)."""
    first = len(target.model.layers) - len(drafter.layers)
    copy_target_layers(drafter, target, first=first)
    h = drafter.config.hidden_size
    with torch.no_grad():
        drafter.fuse.weight.zero_()
        drafter.fuse.weight[:, -h:].copy_(torch.eye(h))
        drafter.fuse_norm.weight.copy_(target.model.layers[first].input_layernorm.weight.float())


def rows_of(data, indices, store, max_length):
    return [{"input_ids": data[i]["input_ids"][:max_length], "prompt_len": data[i]["prompt_len"],
             "features": store[i]} for i in indices
            if min(len(data[i]["input_ids"]), max_length) > data[i]["prompt_len"] + 1]


@torch.no_grad()
def evaluate(drafter, rows, chunk: int = 64) -> dict:
    """CE, per-slot accuracy and the teacher-forced greedy τ over every response anchor."""
    k_slots = drafter.config.block_size - 1
    correct, count = torch.zeros(k_slots), torch.zeros(k_slots)
    ce_sum, kept, steps = 0.0, 0, 0
    for s in range(0, len(rows), 8):
        b = collate(rows[s: s + 8])
        lo, length = b["prompt_len"], b["length"]
        lead = torch.zeros(len(lo), b["input_ids"].shape[1] + 1, dtype=torch.long)
        for c in range(0, int((length - lo).max()), chunk):
            j = torch.arange(c, min(c + chunk, int((length - lo).max())))
            amask = j[None] < (length - lo)[:, None]
            anchors = (lo[:, None] - 1 + j).masked_fill(~amask, 0)
            logits = drafter.forward_train(b["features"], b["input_ids"], None, anchors, amask, b["attention_mask"])
            labels, mask = drafter.block_labels(b["input_ids"], anchors, amask, b["attention_mask"])
            ok = (logits.argmax(-1) == labels) & mask
            correct, count = correct + ok.sum((0, 1)), count + mask.sum((0, 1))
            ce_sum += F.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
            lead.scatter_(1, anchors.masked_fill(~amask, lead.shape[1] - 1), ok.long().cumprod(-1).sum(-1))
        for r in range(len(lo)):  # replay greedy verification: accept lead[a], move by lead[a] + 1
            a, n = int(lo[r]) - 1, int(length[r])
            while a < n - 1:
                step = min(int(lead[r, a]) + 1, n - 1 - a)
                kept, steps, a = kept + step, steps + 1, a + step
    acc = correct / count.clamp(min=1)
    return {"ce": ce_sum / max(float(count.sum()), 1.0), "acc_slot": [round(x, 4) for x in acc.tolist()],
            "acc_mean": float(correct.sum() / count.sum().clamp(min=1)), "tau": kept / max(steps, 1)}


def build_drafter(args, target) -> DFlashDrafter:
    if args.design == "layerwise":
        return factory.from_target(target, block_size=args.block_size, num_layers=args.layers,
                                                 target_layer_ids=args.target_layer_ids, layerwise_context=True,
                                                 shifted=not args.unshifted, qk_norm=False,
                                                 init_layers_from_target=args.init != "random")
    return factory.from_target(target, block_size=args.block_size, num_layers=args.layers,
                                             target_layer_ids=args.target_layer_ids,
                                             qk_norm=False if args.init == "target_last" else None)


def train(args, target, train_rows, val_rows) -> list[dict]:
    torch.manual_seed(args.seed)
    drafter = build_drafter(args, target)
    if args.init == "first_wave":
        first_wave_init(drafter, target)
    elif args.init == "target_last":
        target_last_init(drafter, target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, args.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warm if s < warm else
                                                 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm))))
    loss_fn = AcceptanceAlignedLoss(gamma=args.gamma)  # uniform CE, or positional decay exp(-(k-1)/gamma)
    generator, order, curve, norms, start = torch.Generator().manual_seed(args.seed), [], [], [], time.time()
    for step in tqdm(range(args.steps + 1), desc="bench_learning", unit="step"):
        if step % args.eval_every == 0 or step == args.steps:
            point = {"step": step, "seconds": round(time.time() - start, 1), **evaluate(drafter, val_rows)}
            if norms:
                point["grad_norm_context"], point["grad_norm_layers"] = (sum(x) / len(norms) for x in zip(*norms))
            curve.append(point)
            norms = []
            tqdm.write(json.dumps({k: v for k, v in point.items() if k != "acc_slot"} | {"acc_slot1": point["acc_slot"][0]}))
        if step == args.steps:
            return curve
        if len(order) < args.batch_size:
            order += torch.randperm(len(train_rows), generator=generator).tolist()
        b = collate([train_rows[order.pop()] for _ in range(args.batch_size)])
        anchors, amask = sample_anchors(b["prompt_len"], b["length"], args.num_anchors, generator)
        logits = drafter.forward_train(b["features"], b["input_ids"], None, anchors, amask, b["attention_mask"],
                                       b["prompt_len"])
        labels, mask = drafter.block_labels(b["input_ids"], anchors, amask, b["attention_mask"])
        if args.loss_slots:  # train on the first N slots only
            mask = mask & (torch.arange(mask.shape[-1]) < args.loss_slots)
        keep = mask.any(-1)  # (B, A): blocks with a label, flattened to (N, K, V) for the loss
        loss, _ = loss_fn(logits[keep], labels[keep], mask[keep], None)
        optimizer.zero_grad()
        loss.backward()
        layers = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in drafter.layers.parameters() if p.grad is not None))
        context = drafter.fuse.weight if hasattr(drafter, "fuse") else drafter.layers[0].attn.k_proj.weight
        norms.append((float(context.grad.norm()), layers))
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()


def load_rows(args, target, layer_ids) -> tuple[list[dict], list[dict]]:
    """Training rows of --data-dir; validation rows of --val-from (default: --data-dir's own split),
    training rows whose id is held out there dropped so both data sizes are judged on the same answers."""
    def open_dir(path):  # (data, feature store, (train indices, held-out indices))
        store = FeatureStore(ensure_features(target, path, layer_ids, max_length=args.max_length))
        data = load_regenerated(path)
        return data, store, split_by_id(data["id"], 0.05)

    data, store, (train_idx, held_out) = open_dir(args.data_dir)
    val_data, val_store, (_, val_held_out) = open_dir(args.val_from) if args.val_from else (data, store, (None, held_out))
    val_rows = rows_of(val_data, val_held_out[: args.val_rows], val_store, args.max_length)
    held_ids = {val_data["id"][i] for i in val_held_out}
    train_idx = [i for i in train_idx if data["id"][i] not in held_ids]  # a no-op without --val-from
    train_rows = rows_of(data, train_idx[: args.train_rows], store, args.max_length)
    return train_rows, (train_rows[: args.batch_size] if args.overfit else val_rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="a regenerated data dir (experiments.regenerate)")
    p.add_argument("--target", default=str(TINY_TARGET_DIR))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-anchors", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--gamma", type=float, default=None, help="positional decay rate (default: uniform CE)")
    p.add_argument("--loss-slots", type=int, default=None, help="train on the first N slots only")
    p.add_argument("--init", choices=["current", "first_wave", "target_last", "random"], default="current")
    p.add_argument("--design", choices=["dflash", "layerwise"], default="dflash")
    p.add_argument("--unshifted", action="store_true", help="layerwise: read slot k from block position k")
    p.add_argument("--overfit", action="store_true", help="train and evaluate on one fixed batch")
    p.add_argument("--train-rows", type=int, default=None, help="use only the first N training rows")
    p.add_argument("--val-rows", type=int, default=24)
    p.add_argument("--val-from", default=None, help="validate on this data dir's held-out answers (e.g. the main "
                   "job's, to compare data sizes on the same answers); its held-out ids are dropped from training")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench_learning.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)[0]
    layer_ids = args.target_layer_ids or build_drafter(args, target).target_layer_ids
    train_rows, val_rows = load_rows(args, target, layer_ids)
    if args.overfit:
        train_rows = val_rows
    if not train_rows or not val_rows:
        raise ValueError(f"{args.data_dir}: {len(train_rows)} training and {len(val_rows)} validation rows with a "
                         f"response inside --max-length {args.max_length}; need at least one of each")
    curve = train(args, target, train_rows, val_rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "train_rows": len(train_rows), "curve": curve}, indent=1) + "\n")
    print(f"[bench_learning] wrote {out}", flush=True)


if __name__ == "__main__":
    main()
