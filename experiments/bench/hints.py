"""Benchmark: does a hinted drafter follow its lookup hint when the hint is right? Teacher-forced.

    python -m experiments.bench.hints --drafter <saved drafter dir> --data-dir <its regenerated data dir>
        [--val-rows 64] [--refine-passes N] [--out runs/bench_hints.json]

On the data dir's held-out answers (those training validates on: ``val_fraction`` 0.05, the first
``--val-rows`` by id hash, so ``tau["drafter"]`` is the run's logged ``val/tau_greedy``), for every
response anchor: how many slots a greedy verifier would accept from prompt lookup's hint (its correct
prefix; 0 where no n-gram matches, :func:`drafters.hints.lookup_hints`) and from the drafter (its
argmax's correct prefix). The JSON gives, per hint accept h = 0..K, the number of blocks, the
drafter's mean accept and how often it accepts at least h: a drafter that trusts right hints accepts
>= h wherever the hint accepts h; ``by_ngram`` the hint's and the drafter's mean accept per length of
the hint's n-gram match. ``mean_accept`` adds the rules ``follow_hint_after_m`` (draft the hint's block
where the drafter agrees with it on the first m slots), ``follow_hint_min_ngram_n`` (m = 0, only hints
whose n-gram match is at least n tokens long) and the oracle ``best_of_both`` (the better of hint and
drafter per block: a bound on any switch); ``tau`` replays greedy verification along each answer with each rule's accepts (the teacher-forced τ).
On greedy self-distilled data these are the online T=0 accepts and τ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from drafters import factory
from drafters.hints import lookup_hints
from drafters.model import DFlashDrafter
from drafters.training.datamodule import collate, ensure_features, id_hash, load_regenerated, split_by_id
from drafters.training.features import FeatureStore
from experiments.data.target import TINY_TARGET_DIR, load_target
from experiments.pipeline.paths import cache_path, portable_path, runs_path


def correct_prefix(guess: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(Bt, A, K) guesses and labels -> (Bt, A) length of the leading run of right guesses."""
    return ((guess == labels) & mask).long().cumprod(-1).sum(-1)


@torch.no_grad()
def accepts(drafter: DFlashDrafter, rows: list[dict], chunk: int = 64) -> tuple[torch.Tensor, ...]:
    """Hint accepts, drafter accepts, how many leading slots the drafter's argmax agrees with a found hint,
    and the length of the hint's n-gram match (0: none found), one entry per response anchor of ``rows``
    (row by row, anchors in order): four (N,)."""
    hinted = drafter.variants.get("hints")
    max_ngram, out = hinted.max_ngram if hinted is not None else 3, []
    for s in range(0, len(rows), 8):
        b = collate(rows[s: s + 8])
        lo, length = b["prompt_len"], b["length"]
        chunks = []  # (hint, draft, agree, anchor mask), each (Bt, chunk): joined per row, anchors in order
        for c in range(0, int((length - lo).max()), chunk):
            j = torch.arange(c, min(c + chunk, int((length - lo).max())))
            amask = j[None] < (length - lo)[:, None]  # (Bt, A)
            anchors = (lo[:, None] - 1 + j).masked_fill(~amask, 0)  # (Bt, A)
            logits = drafter.forward_train(b["features"], b["input_ids"], None, anchors, amask, b["attention_mask"])
            labels, mask = drafter.block_labels(b["input_ids"], anchors, amask, b["attention_mask"])  # (Bt, A, K)
            hints, ngram = lookup_hints(b["input_ids"], b["attention_mask"].bool(), anchors,
                                        drafter.num_draft_tokens, max_ngram)
            found = ngram > 0
            guess = logits.argmax(-1)  # (Bt, A, K)
            chunks.append((correct_prefix(hints, labels, mask) * found, correct_prefix(guess, labels, mask),
                           correct_prefix(guess, hints, torch.ones_like(mask)) * found, ngram, amask))
        *columns, amask = (torch.cat(parts, dim=1) for parts in zip(*chunks))  # (Bt, anchors) each
        out.append([c[amask] for c in columns])
    return tuple(torch.cat(parts) for parts in zip(*out))


def follow_hint_after(hint: torch.Tensor, draft: torch.Tensor, agree: torch.Tensor, ngram: torch.Tensor,
                      m: int, min_ngram: int = 1) -> torch.Tensor:
    """Accepts of the rule "draft the hint's whole block where one was found from an n-gram of at least
    ``min_ngram`` tokens and the drafter agrees with it on the first m slots (m = 0: wherever found), else
    the drafter's own block" (no oracle: both are known before verification)."""
    return torch.where((agree >= m) & (ngram >= max(1, min_ngram)), hint, draft)


def replay_tau(accept: torch.Tensor, anchors_per_row: list[int]) -> float:
    """Greedy verification replayed along each row: from the first response anchor, keep accept + 1 tokens
    (capped at the row's end) and move there. Tokens kept per step over all rows: the teacher-forced τ."""
    kept = steps = start = 0
    for n in anchors_per_row:  # row r's anchors are accept[start:start + n], in order
        a = 0
        while a < n:
            step = min(int(accept[start + a]) + 1, n - a)
            kept, steps, a = kept + step, steps + 1, a + step
        start += n
    return kept / max(steps, 1)


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


def by_ngram(hint: torch.Tensor, draft: torch.Tensor, ngram: torch.Tensor) -> list[dict]:
    """Per length n of the hint's n-gram match (0: none): blocks, the hint's and the drafter's mean accept."""
    table = []
    for n in range(int(ngram.max()) + 1 if ngram.numel() else 0):
        sel = ngram == n
        if bool(sel.any()):
            table.append({"ngram": n, "blocks": int(sel.sum()), "hint_mean_accept": round(float(hint[sel].float().mean()), 3),
                          "drafter_mean_accept": round(float(draft[sel].float().mean()), 3)})
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a saved drafter dir (experiments.train's <run>/drafter)")
    p.add_argument("--data-dir", required=True, help="the regenerated data dir it was trained on")
    p.add_argument("--target", default=str(TINY_TARGET_DIR))
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--refine-passes", type=int, default=None,
                   help="passes with the drafter's own argmax in the slots (the refine variant's); default: as trained")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--out", default="runs/bench_hints.json")
    args = p.parse_args(argv)
    target = load_target(args.target)[0]
    drafter = factory.load(args.drafter, target)  # eval mode
    if args.refine_passes is not None:
        drafter = (factory.with_variant(drafter, "refine", passes=args.refine_passes) if args.refine_passes
                   else factory.without_variant(drafter, "refine"))
    store = FeatureStore(ensure_features(target, args.data_dir, drafter.target_layer_ids, max_length=args.max_length))
    data = load_regenerated(args.data_dir)
    # the rows training validates on (drafters.training.datamodule: held out by id hash, the first max_val_samples by hash)
    held_out = sorted(sorted(split_by_id(data["id"], 0.05)[1], key=lambda i: id_hash(data["id"][i]))[: args.val_rows])
    rows = [{"input_ids": data[i]["input_ids"][: args.max_length], "prompt_len": data[i]["prompt_len"],
             "features": store[i]} for i in held_out
            if min(len(data[i]["input_ids"]), args.max_length) > data[i]["prompt_len"] + 1]
    if not rows:
        raise ValueError(f"{args.data_dir}: no held-out answer with a response inside --max-length {args.max_length}")
    hint, draft, agree, ngram = accepts(drafter, rows)
    per_row = [len(r["input_ids"]) - r["prompt_len"] for r in rows]
    rules = {"hint": hint, "drafter": draft,
             **{f"follow_hint_after_{m}": follow_hint_after(hint, draft, agree, ngram, m) for m in (0, 1, 2, 3, 4)},
             **{f"follow_hint_min_ngram_{n}": follow_hint_after(hint, draft, agree, ngram, 0, n)
                for n in range(2, (drafter.variants["hints"].max_ngram if "hints" in drafter.variants else 3) + 1)},
             "best_of_both": torch.maximum(hint, draft)}  # the oracle: not a rule, a bound on any switch
    k = drafter.config.num_draft_tokens
    result = {"config": {**vars(args), "drafter": runs_path(args.drafter), "data_dir": cache_path(args.data_dir),
                         "target": portable_path(args.target)},
              "lookup_hints": "hints" in drafter.variants, "blocks": int(hint.numel()),
              "tau": {k: round(replay_tau(v, per_row), 3) for k, v in rules.items()},
              "mean_accept": {k: round(float(v.float().mean()), 3) for k, v in rules.items()},
              "by_hint_accept": by_hint(hint, draft, k), "by_ngram": by_ngram(hint, draft, ngram)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["tau"]), f"full-block hints: {result['by_hint_accept'][k]}", flush=True)
    return result


if __name__ == "__main__":
    main()
