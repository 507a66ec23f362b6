"""How much prompt lookup would accept on a regenerated data folder: its teacher-forced τ, per domain.

On greedy data (``data=regen_greedy``) the stored answers are the target's greedy output, so replaying
:class:`verify.PromptLookupDrafter`'s rule against them (copy the K tokens after the latest earlier
occurrence of the last 3, 2 or 1 tokens; accept the matching prefix, plus the target's own token) gives
exactly the τ it would reach online at T=0 on those prompts. A domain where this is high has loops and
repeats a drafter could learn to copy (docs/history.md, "Lookup hints").

    python -m experiments.bench.lookup --data-dir <data dir> [--out runs/bench_lookup.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafters.training.datamodule import load_regenerated
from experiments.bench import lookup_replay as replay
from experiments.pipeline.paths import cache_path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="a regenerated data folder (experiments.regenerate)")
    p.add_argument("--num-draft-tokens", type=int, default=15)
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--min-ngram", type=int, default=1)
    p.add_argument("--out", default="runs/bench_lookup.json")
    args = p.parse_args(argv)
    totals: dict[str, list[int]] = {}  # domain -> [tokens, steps]
    for row in load_regenerated(args.data_dir):
        ids, cut = list(row["input_ids"]), int(row["prompt_len"])
        steps = replay(ids[:cut], ids[cut:], args.num_draft_tokens, args.max_ngram, args.min_ngram)
        for key in (row["domain"], "all"):
            tokens_steps = totals.setdefault(key, [0, 0])
            tokens_steps[0] += len(ids) - cut
            tokens_steps[1] += steps
    result = {"config": {**vars(args), "data_dir": cache_path(args.data_dir)},
              "tau": {k: round(t / max(s, 1), 4) for k, (t, s) in sorted(totals.items())},
              "response_tokens": {k: t for k, (t, _) in sorted(totals.items())}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["tau"]))
    return result


if __name__ == "__main__":
    main()
