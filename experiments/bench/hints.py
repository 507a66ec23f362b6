"""Benchmark: does a hinted drafter follow its lookup hint when the hint is right? Teacher-forced.

    python -m experiments.bench.hints --drafter <saved drafter dir> --data-dir <its regenerated data dir>
        [--val-rows 64] [--out runs/bench_hints.json]

On the data dir's held-out answers (the split training holds out, ``val_fraction`` 0.05), for every
response anchor: how many slots a greedy verifier would accept from prompt lookup's hint (its correct
prefix; 0 where no n-gram matches, :func:`drafters.hints.lookup_hints`) and from the drafter (its
argmax's correct prefix). The JSON gives, per hint accept h = 0..K, the number of blocks, the
drafter's mean accept and how often it accepts at least h: a drafter that trusts right hints accepts
>= h wherever the hint accepts h. On greedy self-distilled data these are the online T=0 accepts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from drafters import BlockDiffusionDrafter
from drafters.data import collate, load_regenerated, split_by_id
from drafters.features import FeatureStore, ensure_features
from drafters.hints import lookup_hints
from experiments.data.target import TINY_TARGET_DIR, load_target
from experiments.pipeline.paths import cache_path, portable_path, runs_path


def correct_prefix(guess: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(Bt, A, K) guesses and labels -> (Bt, A) length of the leading run of right guesses."""
    return ((guess == labels) & mask).long().cumprod(-1).sum(-1)


@torch.no_grad()
def accepts(drafter: BlockDiffusionDrafter, rows: list[dict], chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Hint accepts and drafter accepts, one entry per response anchor of ``rows`` (row by row, anchors in
    order): (N,), (N,)."""
    cfg, hint_acc, draft_acc = drafter.config, [], []
    for s in range(0, len(rows), 8):
        b = collate(rows[s: s + 8])
        lo, length = b["prompt_len"], b["length"]
        chunks = []  # (hint, draft, anchor mask), each (Bt, chunk): joined per row so rows keep their anchors' order
        for c in range(0, int((length - lo).max()), chunk):
            j = torch.arange(c, min(c + chunk, int((length - lo).max())))
            amask = j[None] < (length - lo)[:, None]  # (Bt, A)
            anchors = (lo[:, None] - 1 + j).masked_fill(~amask, 0)  # (Bt, A)
            logits = drafter.forward_train(b["features"], b["input_ids"], None, anchors, amask, b["attention_mask"])
            labels, mask = drafter.block_labels(b["input_ids"], anchors, amask, b["attention_mask"])  # (Bt, A, K)
            hints, found = lookup_hints(b["input_ids"], b["attention_mask"].bool(), anchors,
                                        cfg.num_draft_tokens, cfg.lookup_max_ngram or 3)
            chunks.append((correct_prefix(hints, labels, mask) * found, correct_prefix(logits.argmax(-1), labels, mask), amask))
        hint, draft, amask = (torch.cat(parts, dim=1) for parts in zip(*chunks))  # (Bt, anchors)
        hint_acc.append(hint[amask])
        draft_acc.append(draft[amask])
    return torch.cat(hint_acc), torch.cat(draft_acc)


def by_hint(hint: torch.Tensor, draft: torch.Tensor, num_slots: int) -> list[dict]:
    """Per hint accept h: blocks, the drafter's mean accept, and the share of blocks it accepts >= h."""
    table = []
    for h in range(num_slots + 1):
        sel = hint == h
        n = int(sel.sum())
        table.append({"hint_accept": h, "blocks": n,
                      "drafter_mean_accept": round(float(draft[sel].float().mean()), 3) if n else None,
                      "drafter_at_least_hint": round(float((draft[sel] >= h).float().mean()), 3) if n else None})
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a saved drafter dir (experiments.train's <run>/drafter)")
    p.add_argument("--data-dir", required=True, help="the regenerated data dir it was trained on")
    p.add_argument("--target", default=str(TINY_TARGET_DIR))
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--out", default="runs/bench_hints.json")
    args = p.parse_args(argv)
    target = load_target(args.target)[0]
    drafter = BlockDiffusionDrafter.from_pretrained(args.drafter, target).eval()
    store = FeatureStore(ensure_features(target, args.data_dir, drafter.target_layer_ids, max_length=args.max_length))
    data = load_regenerated(args.data_dir)
    held_out = split_by_id(data["id"], 0.05)[1][: args.val_rows]
    rows = [{"input_ids": data[i]["input_ids"][: args.max_length], "prompt_len": data[i]["prompt_len"],
             "features": store[i]} for i in held_out
            if min(len(data[i]["input_ids"]), args.max_length) > data[i]["prompt_len"] + 1]
    if not rows:
        raise ValueError(f"{args.data_dir}: no held-out answer with a response inside --max-length {args.max_length}")
    hint, draft = accepts(drafter, rows)
    k = drafter.config.num_draft_tokens
    result = {"config": {**vars(args), "drafter": runs_path(args.drafter), "data_dir": cache_path(args.data_dir),
                         "target": portable_path(args.target)},
              "lookup_hints": bool(drafter.config.lookup_hints), "blocks": int(hint.numel()),
              "mean_accept": {"hint": round(float(hint.float().mean()), 3), "drafter": round(float(draft.float().mean()), 3),
                              "best_of_both": round(float(torch.maximum(hint, draft).float().mean()), 3)},
              "by_hint_accept": by_hint(hint, draft, k)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["mean_accept"]), f"full-block hints: {result['by_hint_accept'][k]}", flush=True)
    return result


if __name__ == "__main__":
    main()
