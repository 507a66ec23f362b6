"""One speculative step at batch 1 at SmolLM2-135M's size, part by part, against its parts run alone; before and after.

    python -m experiments.bench.step_parts [--target DIR] [--baseline REV] [--accept 2] [--threads 1] \\
        [--out experiments/results/bench/step_parts_smollm2.json]

The target is ``--target`` (a Hugging Face folder, e.g. the converted SmolLM2), else a random Llama of
SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 / 3 heads, intermediate 1536, vocabulary 49,152, tied
embeddings: random weights cost what trained ones do). The drafter is a fresh DFlash drafter
(``conf/drafter/dflash.yaml``, ``--num-layers``, ``--block-size``). One prompt of ``--context`` random tokens
(seeded). Every step keeps ``--accept`` drafts: :class:`ScriptedDrafts` runs the drafter (so a step pays for a
draft) and then replaces its tokens by the target's greedy continuation for ``--accept`` slots and wrong tokens
after, which is what a drafter at τ = accept + 1 does to the verifier.

In one process, interleaved round by round (CPU time of this process is the unit: ``--threads 1`` makes it robust
to other processes on a shared machine; wall times are recorded too):

* ``head``: the LM head over n hidden states, one product (``F.linear``) against :func:`verify.hf.linear_logits`;
* ``alone``: the parts of a step run alone: the target's forward over 1 column with its logits (a target-only
  step), over the W + 1 columns of a block without logits, and one draft;
* ``steps``: real decoding steps (:mod:`experiments.bench.profiling`), target-only and speculative, of today's
  ``verify/`` and, with ``--baseline REV``, of ``verify/`` as it was at REV (``before/...``, its drafter's head one
  product over the vocabulary as ``drafters/model.py`` computed it there); medians per part;
* ``ratios``: per version, the speculative step over the target-only step, and the step over the sum of its parts
  alone (draft + block forward + the verifier's head over ``accept + 2`` columns): what the loop adds.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import verify.generate
from experiments.bench import drafter_factory, write_record
from experiments.bench.profiling import Variant, profile_steps
from experiments.pipeline.paths import cache_path, portable_path
from verify.hf import linear_logits, new_growing_kv_cache

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
                 "max_position_embeddings": 8192, "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2,
                 "pad_token_id": 2}
MODULES = ("drafter", "generate", "hf", "kv_cache", "metrics", "rejection")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="a Hugging Face folder (default: random SmolLM2-135M shape)")
    parser.add_argument("--block-size", type=int, default=16, help="drafter block: K + 1")
    parser.add_argument("--num-layers", type=int, default=1, help="drafter layers")
    parser.add_argument("--accept", type=int, default=2, help="drafts kept per step (ScriptedDrafts)")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens per profiled decode")
    parser.add_argument("--skip", type=int, default=2, help="first steps of a decode left out")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--baseline", default=None, metavar="REV", help="also run verify/ as it was at REV")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/step_parts.json")
    args = parser.parse_args(argv)
    if not 0 <= args.accept < args.block_size - 1 or args.context < 2 or args.rounds < 1:
        parser.error("need 0 <= --accept < --block-size - 1, --context >= 2 and --rounds >= 1")
    return args


def load_verify_at(rev: str):
    """The package ``verify`` as it was at git revision ``rev``, importable beside today's (as ``verify_<rev>``:
    its modules import each other, not today's)."""
    name = "verify_" + re.sub(r"\W", "_", rev)
    folder = Path(tempfile.mkdtemp(prefix="blockdraft-verify-")) / name
    folder.mkdir()
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:verify"], check=True,
                            capture_output=True, text=True).stdout.split()
    for file in (f for f in listed if f.endswith(".py")):
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:verify/{file}"], check=True,
                                capture_output=True, text=True).stdout
        source = re.sub(r"\bfrom verify import\b", f"from {name} import", source)
        source = re.sub(rf"\bverify\.(?=({'|'.join(MODULES)})\b)", f"{name}.", source)
        (folder / file).write_text(source)
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module(name)


class ScriptedDrafts:
    """A drafter that runs ``inner`` and then proposes the target's greedy continuation ``continuation`` (the new
    tokens after a prompt of ``prompt_len`` tokens, batch 1) for ``accept`` slots and a wrong token in every slot
    after: each step keeps ``accept`` drafts (fewer where the batched forward's argmax differs)."""

    def __init__(self, inner, continuation: list[int], prompt_len: int, accept: int):
        self.inner, self.continuation, self.prompt_len, self.accept = inner, continuation, prompt_len, accept

    def __getattr__(self, name):  # num_draft_tokens, target_layer_ids, vocab_size, reset, extend, select_rows ...
        return getattr(self.inner, name)

    def draft(self, anchor_ids, anchor_position_ids, **sampling):
        tokens, _ = self.inner.draft(anchor_ids, anchor_position_ids, **sampling)
        emitted = int(anchor_position_ids[0]) - (self.prompt_len - 1)
        width = tokens.shape[1]
        script = torch.tensor(self.continuation[emitted: emitted + width], dtype=torch.long)
        if script.numel() < width:
            raise ValueError(f"the continuation ({len(self.continuation)} tokens) is shorter than the decode")
        wrong = (script + 1) % self.inner.vocab_size
        script = torch.where(torch.arange(width) < self.accept, script, wrong)
        return script.view(1, width).to(tokens.device), None


class OneProductHead:
    """``inner`` drafting with its LM head as one product over the vocabulary (``head(states)``), as
    ``drafters/model.py`` computed it before :func:`verify.hf.linear_logits`."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, *args, **kwargs):
        inner = self.inner

        def head(states, vocab_ids=None):
            if vocab_ids is not None:
                raise ValueError("OneProductHead times drafting: the full vocabulary only")
            module = inner.target.get_output_embeddings()
            out = module(states.reshape(-1, states.shape[-1]).to(module.weight.dtype))
            return out.view(*states.shape[:-1], out.shape[-1]).float()

        object.__setattr__(inner, "head", head)  # an instance attribute shadows the method for this draft
        try:
            return inner.draft(*args, **kwargs)
        finally:
            object.__delattr__(inner, "head")


def build(args):
    """``(target, drafter, target description)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.target:
        from experiments.data.target import load_target

        target, _ = load_target(args.target, "float32", "cpu")
        described = portable_path(cache_path(args.target))  # no machine paths in the record
    else:
        target = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
        described = {"random_llama": SMOLLM2_SHAPE}
    make = drafter_factory("dflash", [f"drafter.block_size={args.block_size}", f"drafter.num_layers={args.num_layers}"])
    return target, make(target).eval(), described


def _timed(run) -> tuple[float, float]:
    start, start_cpu = time.perf_counter(), time.process_time()
    run()
    return 1e3 * (time.perf_counter() - start), 1e3 * (time.process_time() - start_cpu)


def _medians(times: dict[str, list[tuple[float, float]]], skip: int = 2) -> dict[str, dict[str, float]]:
    return {name: {"ms": statistics.median(t[0] for t in ts[skip:] or ts),
                   "cpu_ms": statistics.median(t[1] for t in ts[skip:] or ts)} for name, ts in times.items()}


def head_costs(target, rows=(1, 2, 3, 4, 5, 8, 9, 15, 16, 32), repeats: int = 12) -> dict:
    """Median ms of the LM head over n hidden states: ``F.linear`` (one product) and ``linear_logits``."""
    weight = target.get_output_embeddings().weight
    states = {n: torch.randn(n, weight.shape[1], generator=torch.Generator().manual_seed(n)) for n in rows}
    kinds = {"one_product": lambda x: torch.nn.functional.linear(x, weight),
             "linear_logits": lambda x: linear_logits(weight, x)}
    cases = {f"{kind} {n}": (kinds[kind], states[n]) for n in rows for kind in kinds}
    times: dict[str, list] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, (fn, x) in cases.items():
                times[name].append(_timed(lambda fn=fn, x=x: fn(x)))
    return _medians(times)


def alone_costs(target, drafter, ids, width: int, repeats: int = 12) -> dict:
    """Median ms of the parts of a step run alone, against the KV cache of the prompt ``ids`` (1, T)."""
    cache = new_growing_kv_cache(target, 64)
    context = ids.shape[1] - 1
    none = torch.zeros(0, dtype=torch.long)
    key = verify.hf.cache_argument(target)
    with torch.inference_mode():
        positions = torch.arange(context)[None]
        out = target(input_ids=ids[:, :-1], position_ids=positions, use_cache=True, output_hidden_states=True,
                     logits_to_keep=1, **{key: cache})
        drafter.reset(1)
        drafter.bind_target_cache(cache)
        drafter.extend(ids[:, :-1], torch.ones_like(ids[:, :-1]), positions,
                       [out.hidden_states[i] for i in drafter.target_layer_ids])
        anchor, anchor_pos = ids[:, -1], torch.tensor([context])

        def forward(n: int, logits: bool):
            block = ids[:, -n:]
            target(input_ids=block, attention_mask=torch.ones(1, context + n, dtype=torch.long),
                   position_ids=anchor_pos[:, None] + torch.arange(n), use_cache=True,
                   output_hidden_states=not logits, logits_to_keep=1 if logits else none, **{key: cache})
            cache.crop(-n)

        cases = {"target_forward 1 column with logits": lambda: forward(1, True),
                 f"target_forward {width} columns without logits": lambda: forward(width, False),
                 "draft": lambda: drafter.draft(anchor, anchor_pos)}
        times: dict[str, list] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, run in cases.items():
                times[name].append(_timed(run))
    return _medians(times)


def step_variants(args, target, drafter, ids, baseline) -> dict[str, Variant]:
    """Target-only and speculative variants of today's loop and (``baseline``) of the old one."""
    cont = verify.generate.target_generate(target, ids, max_new_tokens=args.new_tokens + args.block_size + 2)
    scripted = ScriptedDrafts(drafter, cont.new_tokens[0], ids.shape[1], args.accept)
    variants = {"target": Variant(), f"spec_K{args.block_size - 1}": Variant(scripted)}
    if baseline is not None:
        old = ScriptedDrafts(OneProductHead(drafter), cont.new_tokens[0], ids.shape[1], args.accept)
        variants |= {"before/target": Variant(generate=baseline.generate),
                     f"before/spec_K{args.block_size - 1}": Variant(old, baseline.generate)}
    return variants


def ratios(steps: dict, alone: dict, head: dict, accept: int, width: int, unit: str = "total_cpu_ms") -> dict:
    """Per version: the speculative step over the target-only step; the step over the sum of its parts alone (the
    draft, the block's forward, the verifier's head over ``accept + 2`` columns; ``before/``: the draft with its head
    over the ``width`` drafted slots as one product, i.e. the draft alone plus that product's extra cost)."""
    out = {}
    block = next(v["cpu_ms"] for k, v in alone.items() if k.endswith("columns without logits"))
    chunk = min(accept + 2, width + 1)
    for name, summary in steps.items():
        if name.rpartition("/")[2].startswith("target"):
            continue
        prefix = name.rpartition("/")[0]
        base = steps[f"{prefix}/target" if prefix else "target"][unit]
        kind = "one_product" if prefix else "linear_logits"
        draft = alone["draft"]["cpu_ms"]
        if prefix:
            draft += head[f"one_product {width}"]["cpu_ms"] - head[f"linear_logits {width}"]["cpu_ms"]
        parts = draft + block + head[f"{kind} {chunk}"]["cpu_ms"]
        out[name] = {"spec_over_target_step": summary[unit] / base, "step_over_parts_alone": summary[unit] / parts,
                     "loop_overhead_cpu_ms": summary[unit] - parts, "parts_alone_cpu_ms": parts}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, drafter, described = build(args)
    baseline = load_verify_at(args.baseline) if args.baseline else None
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (1, args.context), generator=torch.Generator().manual_seed(args.seed))
    variants = step_variants(args, target, drafter, ids, baseline)
    head = head_costs(target, sorted({1, 2, 3, 4, 5, 8, 9, 15, 16, 32, args.block_size - 1,
                                      min(args.accept + 2, args.block_size)}))
    alone = alone_costs(target, drafter, ids, args.block_size)
    steps = profile_steps(target, variants, {"batch_1": [(ids, torch.ones_like(ids))]}, args.new_tokens,
                          args.rounds, args.skip)["batch_1"]
    words = [described if a == args.target else a for a in (argv if argv is not None else sys.argv[1:])]
    doc = {"command": " ".join(["python -m experiments.bench.step_parts", *map(str, words)]),
           "config": {k: v for k, v in vars(args).items() if k != "target"}, "target": described,
           "head": head, "alone": alone, "steps": steps, "ratios": ratios(steps, alone, head, args.accept, args.block_size - 1)}
    doc = write_record(doc, args.out)
    for name, summary in steps.items():
        print(f"[step_parts] {name}: " + ", ".join(f"{k[:-7]} {v:.1f}" for k, v in summary.items()
                                                   if k.endswith("_cpu_ms")) + " (CPU ms)")
    for name, r in doc["ratios"].items():
        print(f"[step_parts] {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    print(f"[step_parts] wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
