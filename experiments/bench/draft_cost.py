"""What one draft costs against the target's own forwards, on one batch: the drafter at each width, the target at the
widths a step verifies, interleaved in one process.

    python -m experiments.bench.draft_cost drafter.path=<run>/drafter [--batch 8] [--context 200] \\
        [--widths 1 2 3 0] [--target-widths 1 4 16] [--vocab-sizes 0 8192] [--rounds 25] [--out runs/draft_cost.json]

The arguments are ``experiments.evaluate``'s overrides (``num_threads=2`` unless given); the drafter is built as the
evaluation builds it. One batch of ``--batch`` rows of ``--context`` random tokens (seeded) is prefilled through the
target, its KV cache offered to the drafter and its hidden states handed over, as :func:`verify.speculative_generate`
does. Then, round after round, each ``draft`` under ``own_draft_tokens`` = each of ``--widths`` (0: the whole
block), and each target forward over ``--target-widths`` new columns of that cache (cropped back after each: a
1-column forward is one target-only decoding step). ``--vocab-sizes``: each draft also from the N most frequent
response tokens of ``drafter.draft_vocab_from`` (FR-Spec's candidate vocabulary; 0: the whole vocabulary), timed
beside the others; without it, the drafter's own (``drafter.draft_vocab_size``). Random tokens match no n-gram, so no row copies a hint: these are
the steps where the drafter drafts. Medians over rounds, the first 3 left out; wall ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from drafters.policy import DraftingPolicy, PolicyDrafter
from experiments.bench import evaluation_config, with_defaults
from experiments.data.target import load_target
from experiments.pipeline.eval_drafters import candidate_vocab
from experiments.pipeline.evaluation import build_drafter
from experiments.pipeline.records import write_record
from experiments.pipeline.timing import prefill
from verify.hf import cache_argument
from verify.layout import set_weight_layout

SKIP = 3  # first rounds left out of the medians


def measure(target, drafter, *, batch: int, context: int, widths, target_widths, rounds: int,
            vocabs: dict[int, torch.Tensor | None] | None = None) -> dict[str, float]:
    """Median wall ms of each ``draft W'=<w>`` (``whole block`` for 0) and ``target <n> columns`` forward; with
    ``vocabs`` ({N: candidate ids (N',) or None for the whole vocabulary}), each draft per N (``... V'=<N>``)."""
    vocab = target.get_output_embeddings().out_features
    with torch.inference_mode():
        cache, anchor, anchor_pos = prefill(target, drafter, batch, context)
        columns = cache.get_seq_length()

        inner = getattr(drafter, "drafter", drafter)  # a PolicyDrafter's block drafter
        policy = getattr(drafter, "policy", DraftingPolicy())
        own = {None: getattr(drafter, "draft_vocab", None)}  # drafter.draft_vocab_size's candidates, kept
        narrowed = {(w, n): PolicyDrafter(inner, replace(policy, own_draft_tokens=w or None), ids)
                    for n, ids in (vocabs or own).items() for w in widths}

        def draft(key):
            narrowed[key].draft(anchor, anchor_pos)

        def forward(n):
            ids = torch.randint(3, vocab, (batch, n), device=anchor.device)
            target(input_ids=ids, attention_mask=torch.ones(batch, columns + n, dtype=torch.long, device=ids.device),
                   position_ids=anchor_pos[:, None] + torch.arange(n, device=ids.device), use_cache=True,
                   logits_to_keep=n, **{cache_argument(target): cache})
            cache.crop(-n)  # back to the prefilled columns

        cases = {(f"draft W'={w}" if w else "draft whole block") + ("" if n is None else f" V'={n or 'all'}"):
                 (draft, (w, n)) for w, n in narrowed}
        cases |= {f"target {n} column{'s' * (n > 1)}": (forward, n) for n in target_widths}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (run, arg) in cases.items():
                start = time.perf_counter()
                run(arg)
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(ts[SKIP:] or ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="experiments.evaluate overrides (the drafter's)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=200, help="cached columns per row")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 0],
                        help="drafter.own_draft_tokens of each timed draft (0: the whole block)")
    parser.add_argument("--target-widths", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=None,
                        help="draft also from the N most frequent tokens of drafter.draft_vocab_from (0: all)")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--out", default="runs/draft_cost.json", help="the JSON written")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batch < 1 or args.context < 2 or min(args.widths + args.target_widths
                                                                          + (args.vocab_sizes or [])) < 0:
        parser.error("--rounds and --batch must be >= 1, --context >= 2, the widths and vocabulary sizes >= 0")
    overrides = with_defaults(args.overrides, {"num_threads": "2"})
    cfg, settings = evaluation_config(overrides)
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    target, _ = load_target(cfg.target.path, cfg.target.dtype, settings.resolved_device(), cfg.target.trust_remote_code)
    drafter = build_drafter(cfg.drafter, target).drafter.eval()
    vocabs = None if args.vocab_sizes is None else {n: candidate_vocab(
        target, n, cfg.drafter.get("draft_vocab_from"), Path(cfg.drafter.path)) if n else None for n in args.vocab_sizes}
    set_weight_layout(settings.weight_layout, target, drafter)
    ms = measure(target, drafter, batch=args.batch, context=args.context, widths=args.widths,
                 target_widths=args.target_widths, rounds=args.rounds, vocabs=vocabs)
    doc = write_record({"overrides": overrides, "batch": args.batch, "vocab_sizes": args.vocab_sizes,
                        "context": args.context, "rounds": args.rounds, "median_ms": ms}, args.out)
    for name, value in ms.items():
        print(f"[draft_cost] {name}: {value:.2f} ms")
    print(f"[draft_cost] wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
