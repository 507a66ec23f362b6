"""Interleaved A/B of evaluation settings: speedups measured in one process, variant after variant, round after round.

    python -m experiments.bench.interleave drafter.path=<run>/drafter drafter.follow_hint_after=0 \\
        drafter.follow_hint_min_ngram=3 suite.humaneval.limit=32 suite.gsm_symbolic.limit=32 suite.mtbench.limit=16 \\
        --variants drafter.own_draft_tokens=null drafter.own_draft_tokens=3 --rounds 2 [--out runs/interleave.json]

The positional arguments are ``experiments.evaluate``'s overrides shared by every variant (``temperatures=[0.0]``
and ``num_threads=2`` unless given); each ``--variants`` item is one variant's own overrides (several joined by
spaces, quoted). The target is loaded once; each variant's drafter is built from its config once; then every round
evaluates every suite with every variant in turn, target-only decoding included, so that the speedups of the
variants share the machine's state of the moment. On a 2-core machine one evaluation's speedup moves by ±15%
between runs (docs/history.md, "Narrow drafting"): compare variants within one file, by their mean over rounds.
"""

from __future__ import annotations

import argparse
import shlex

import torch

from experiments.bench import evaluation_config, with_defaults
from experiments.data.suites import load_suites
from experiments.data.target import load_target
from experiments.pipeline.evaluation import build_drafter, evaluate_suite
from experiments.pipeline.paths import portable_override
from experiments.pipeline.records import write_record


def summarize(rounds: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per variant and suite: τ (the same every round at T=0), each round's speedup and their mean."""
    out: dict[str, dict[str, dict]] = {}
    for variant, suites in rounds.items():
        for suite, runs in suites.items():
            speedups = [r["speedup"] for r in runs]
            out.setdefault(variant, {})[suite] = {
                "tau": [r["tau"] for r in runs], "speedup": speedups,
                "mean_speedup": sum(speedups) / len(speedups), "mean_draft_width": [r["mean_draft_width"] for r in runs]}
    return out


def run(shared: list[str], variants: list[str], rounds: int) -> dict[str, dict[str, list[dict]]]:
    """``{variant: {suite: [one dict per round]}}`` (τ, speedup, mean draft width, wall times) at the first
    temperature of the composed config."""
    configs = {v: evaluation_config([*shared, *shlex.split(v)]) for v in variants}
    cfg, settings = next(iter(configs.values()))
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, settings.resolved_device(),
                                    cfg.target.trust_remote_code)
    drafters = {v: build_drafter(c.drafter, target).drafter for v, (c, _) in configs.items()}
    suites = load_suites(cfg.suite)
    temperature = settings.temperatures[0]
    out: dict[str, dict[str, list[dict]]] = {v: {} for v in variants}
    for r in range(rounds):
        for variant, (_, variant_settings) in configs.items():
            for suite, prompts in suites.items():
                e = evaluate_suite(target, tokenizer, drafters[variant], prompts, suite=suite, temperature=temperature,
                                   settings=variant_settings)
                out[variant].setdefault(suite, []).append(
                    {k: e[k] for k in ("tau", "speedup", "mean_draft_width", "spec_wall_time_s", "target_wall_time_s")})
                print(f"[interleave] round {r} {variant!r} {suite}: tau {e['tau']:.3f}, speedup {e['speedup']:.2f}x",
                      flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="experiments.evaluate overrides shared by every variant")
    parser.add_argument("--variants", nargs="+", required=True, help="each variant's own overrides (quoted, spaces)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="runs/interleave.json", help="the JSON written")
    args = parser.parse_args(argv)
    if args.rounds < 1 or len(set(args.variants)) != len(args.variants):
        parser.error("--rounds must be >= 1 and the --variants distinct")
    shared = with_defaults(args.overrides, {"temperatures": "[0.0]", "num_threads": "2"})
    rounds = {portable_override(v): r for v, r in run(shared, args.variants, args.rounds).items()}
    doc = write_record({"overrides": shared, "variants": list(rounds),
                        "rounds": args.rounds, "results": rounds, "summary": summarize(rounds)}, args.out)
    for variant, suites in doc["summary"].items():
        print(f"[interleave] {variant!r}: " + ", ".join(
            f"{s} tau {v['tau'][0]:.3f} speedup {v['mean_speedup']:.2f}x" for s, v in suites.items()))
    print(f"[interleave] wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
