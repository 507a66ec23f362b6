"""Where a suite's speculative steps spend their time, and which drafts they keep.

    python -m experiments.bench.suite_steps drafter.path=<run>/drafter drafter.follow_hint_after=0 \\
        drafter.follow_hint_min_ngram=2 suite.humaneval.limit=32 suite.gsm_symbolic.limit=32 \\
        suite.mtbench.limit=16 [--out runs/suite_steps.json]

The arguments are ``experiments.evaluate``'s overrides (``temperatures=[0.0]`` unless given), and the decoding is
its own (:func:`experiments.pipeline.evaluation.evaluate_suite`, target-only runs included), with a step clock
(:class:`.profiling.StepClock`) in the speculative loop. Per suite and temperature the JSON gives τ, the
speedup, the mean draft width, ``by_draft_source`` (what drafted the steps and how many drafts each kept) and
``ms_per_step``: the mean wall time per speculative step of each part (``draft``, ``target_forward``,
``verify``, ``drafter_extend``, ``select_rows``, ``crop``, ``bookkeeping``; ``prefill`` amortised over the
steps) and of the sub-parts ``draft_states@draft`` (the drafter's layers) and ``lm_head@<part>``. Means, not
medians: a suite's time is their sum. One run of one machine: compare parts within it.
"""

from __future__ import annotations

import argparse

import torch

from experiments.bench import evaluation_config, with_defaults
from experiments.bench.profiling import StepClock, device_sync, timed_parts
from experiments.data.suites import load_suites
from experiments.data.target import load_target
from experiments.pipeline.evaluation import build_drafter, evaluate_suite
from experiments.pipeline.records import write_record


def per_step_ms(clock: StepClock, steps: int) -> dict[str, float]:
    """Mean ms per speculative step of every part the clock timed (summed over all its steps, the prefills
    included, over ``steps`` verification steps)."""
    totals: dict[str, float] = {}
    for step in clock.steps:
        for part, seconds in step.items():
            totals[part] = totals.get(part, 0.0) + seconds
    out = {part: 1e3 * seconds / max(steps, 1) for part, seconds in sorted(totals.items())}
    out["total"] = sum(v for k, v in out.items() if "@" not in k)
    return out


def profile_suites(cfg, settings) -> dict[str, dict[str, dict]]:
    """``{suite: {t_key: summary}}`` for the evaluation config ``cfg`` (``experiments.evaluate``'s) and its
    decoding ``settings``."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    device = settings.resolved_device()
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, device, cfg.target.trust_remote_code)
    drafter = build_drafter(cfg.drafter, target).drafter
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()
    out: dict[str, dict[str, dict]] = {}
    for suite, prompts in load_suites(cfg.suite).items():
        for temperature in settings.temperatures:
            clock = StepClock(device_sync(torch.device(device)))
            with timed_parts(clock, drafter, target):
                entry = evaluate_suite(target, tokenizer, drafter, prompts, suite=suite, temperature=temperature,
                                       settings=settings, clock=clock)
            out.setdefault(suite, {})[f"t{temperature:g}"] = {
                **{k: entry[k] for k in ("tau", "speedup", "mean_draft_width", "batched_forwards",
                                         "spec_wall_time_s", "target_wall_time_s", "by_draft_source")},
                "ms_per_step": per_step_ms(clock, entry["batched_forwards"]),
            }
            print(f"[suite_steps] {suite} T={temperature:g}: tau {entry['tau']:.3f}, speedup {entry['speedup'] or 0:.2f}x, "
                  f"{out[suite][f't{temperature:g}']['ms_per_step']['total']:.1f} ms per step", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="experiments.evaluate overrides (drafter.path=..., suite...)")
    parser.add_argument("--out", default="runs/suite_steps.json", help="the JSON written")
    args = parser.parse_args(argv)
    overrides = with_defaults(args.overrides, {"temperatures": "[0.0]"})
    cfg, settings = evaluation_config(overrides)
    doc = write_record({"overrides": overrides, "suites": profile_suites(cfg, settings)}, args.out)
    print(f"[suite_steps] wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
