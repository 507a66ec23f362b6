"""The speedup a drafter's drafts would give if drafting cost nothing: its own drafts, recorded, then replayed.

    python -m experiments.bench.free_drafts drafter.path=<run>/drafter drafter.follow_hint_after=0 \\
        drafter.follow_hint_min_ngram=3 drafter.own_draft_tokens=3 suite.humaneval.limit=32 \\
        suite.gsm_symbolic.limit=32 suite.mtbench.limit=16 [--rounds 2] [--out runs/free_drafts.json]

The arguments are ``experiments.evaluate``'s overrides (greedy only: ``temperatures=[0.0]``; ``num_threads=2`` unless
given). Greedy decoding is deterministic, so a suite decoded once with the drafter, its drafts recorded step by step,
can be decoded again with :class:`Replay`: the same drafts handed back from memory, the same target forwards, the same
tokens out. Every round then decodes each suite with the drafter and with its replay (each with its own target-only
decode, as ``experiments.evaluate`` measures speedups), in one process. The replay's speedup is what these drafts are
worth when drafting is free: the ceiling of any drafter, however cheap, that drafts the same tokens on this machine at
this batch. Replay checks each step's anchors against the record: a decode that diverges stops with an error.
"""

from __future__ import annotations

import argparse
import functools

import torch

from experiments.bench import evaluation_config, with_defaults, write_record
from experiments.data.suites import load_suites
from experiments.data.target import load_target
from experiments.pipeline.evaluation import build_drafter, evaluate_suite

KEYS = ("tau", "speedup", "mean_draft_width", "spec_wall_time_s", "target_wall_time_s")


class Replay:
    """A drafter that returns recorded drafts, step by step: ``records`` from :func:`record` (anchors, tokens,
    the drafter's row labels). It asks the target for the recorded drafter's hidden states (``target_layer_ids``)
    so that the target's forwards cost what they cost beside the drafter; it computes nothing itself."""

    def __init__(self, drafter, records: list[tuple[torch.Tensor, torch.Tensor, list[str] | None]]) -> None:
        self.num_draft_tokens, self.vocab_size = drafter.num_draft_tokens, drafter.vocab_size
        self.target_layer_ids = tuple(drafter.target_layer_ids)
        self.records, self.step, self._sources = records, 0, None

    def reset(self, batch_size: int) -> None:
        pass

    def extend(self, input_ids, attention_mask, position_ids, hidden_states) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def draft(self, anchor_ids, anchor_position_ids, **sampling):
        if self.step >= len(self.records):
            raise RuntimeError(f"replay: step {self.step} was not recorded ({len(self.records)} were)")
        anchors, tokens, self._sources = self.records[self.step]
        if not torch.equal(anchors, anchor_ids):
            raise RuntimeError(f"replay diverged at step {self.step}: anchors {anchor_ids.tolist()} were recorded as "
                               f"{anchors.tolist()} (greedy decoding must repeat itself)")
        self.step += 1
        return tokens, None

    def draft_sources(self) -> list[str] | None:
        return self._sources


def record(drafter, decode) -> list[tuple[torch.Tensor, torch.Tensor, list[str] | None]]:
    """Run ``decode()`` with ``drafter.draft`` recording every step's anchors, drafts and row labels."""
    records, draft = [], drafter.draft

    def recording(anchor_ids, anchor_position_ids, **sampling):
        tokens, q = draft(anchor_ids, anchor_position_ids, **sampling)
        if q is not None:
            raise ValueError("free_drafts replays greedy drafts only (temperatures=[0.0])")
        sources = drafter.draft_sources() if hasattr(drafter, "draft_sources") else None
        records.append((anchor_ids.clone(), tokens.clone(), sources))
        return tokens, q

    drafter.draft = recording  # an instance attribute: shadows the method until deleted
    try:
        decode()
    finally:
        del drafter.draft
    return records


def run(overrides: list[str], rounds: int) -> dict[str, dict[str, list[dict]]]:
    """``{suite: {"drafter": [one dict per round], "free": [...]}}`` (τ, speedup, mean draft width, wall times)."""
    cfg, settings = evaluation_config(overrides)
    if list(settings.temperatures) != [0.0]:
        raise ValueError(f"temperatures={list(settings.temperatures)}: free_drafts replays greedy decodes only ([0.0])")
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, settings.resolved_device(),
                                    cfg.target.trust_remote_code)
    drafter = build_drafter(cfg, target).drafter
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()

    def decode(suite, prompts, with_drafter):
        return evaluate_suite(target, tokenizer, with_drafter, prompts, suite=suite, temperature=0.0,
                              settings=settings)

    suites = load_suites(cfg.suite)
    records = {suite: record(drafter, functools.partial(decode, suite, prompts, drafter)) for suite, prompts in suites.items()}
    out: dict[str, dict[str, list[dict]]] = {suite: {"drafter": [], "free": []} for suite in suites}
    for r in range(rounds):
        for suite, prompts in suites.items():
            for name, used in (("drafter", drafter), ("free", Replay(drafter, records[suite]))):
                e = decode(suite, prompts, used)
                out[suite][name].append({k: e[k] for k in KEYS})
                print(f"[free_drafts] round {r} {suite} {name}: tau {e['tau']:.3f}, speedup {e['speedup']:.2f}x",
                      flush=True)
    return out


def summarize(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """Per suite: τ, each way's mean speedup over rounds, and the share of the speculative decode's wall time that
    drafting took (1 - free time / drafter time, summed over rounds)."""
    out = {}
    for suite, ways in runs.items():
        mean = {name: sum(r["speedup"] for r in rs) / len(rs) for name, rs in ways.items()}
        spec = {name: sum(r["spec_wall_time_s"] for r in rs) for name, rs in ways.items()}
        out[suite] = {"tau": ways["drafter"][0]["tau"], "mean_speedup": mean["drafter"],
                      "mean_speedup_free": mean["free"], "drafting_share": 1 - spec["free"] / spec["drafter"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="experiments.evaluate overrides")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="runs/free_drafts.json", help="the JSON written")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    overrides = with_defaults(args.overrides, {"temperatures": "[0.0]", "num_threads": "2"})
    runs = run(overrides, args.rounds)
    doc = write_record({"overrides": overrides, "rounds": args.rounds,
                        "results": runs, "summary": summarize(runs)}, args.out)
    for suite, s in doc["summary"].items():
        print(f"[free_drafts] {suite}: tau {s['tau']:.3f}, speedup {s['mean_speedup']:.2f}x, free drafts "
              f"{s['mean_speedup_free']:.2f}x (drafting {100 * s['drafting_share']:.0f}% of the speculative time)")
    print(f"[free_drafts] wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
