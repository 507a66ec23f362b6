"""The K that serves each baseline best, and the width W a trained block drafter verifies best, chosen on held-out
training answers (never on the suites): a stage of the main job (:mod:`.main_job`), runnable on its own.

    python -m experiments.pipeline.choose_k --data-dir <regenerated data> --target <HF folder> \\
        [--assistant <HF folder>] [--drafter NAME=<drafter dir> ...] [--ks 2 3 4 5 7 10 15] \\
        [--draft-vocab-sizes 0 8192 --draft-vocab-from <data or answers folder>] [--out runs/choose_k.json]

On greedy data the stored answers are the target's own greedy output, so a drafter's τ at T=0 on them is exact
without running the target: prompt lookup is replayed (:func:`experiments.pipeline.replay.lookup_replay`), the assistant's
drafts are its teacher-forced argmax (right while the earlier drafts were right; :mod:`experiments.pipeline.replay`). A step
costs the target's forward over K + 1 new columns plus the drafting (the assistant: K one-token forwards), timed at
batch 1 over a 200-column cache, interleaved round by round. The estimated speedup over the target alone is
τ(K) · t_target(1) / (t_target(K + 1) + t_draft(K)); the K with the largest one is chosen. A trained block drafter
drafts its whole block in one pass but verifies only its first W drafts (``drafter.max_draft_tokens``: the LM head
runs over W slots, the drafts are the full block's): τ(W) replayed from one teacher-forced target pass
(:func:`experiments.pipeline.replay.block_leads`), t_draft(W) timed like the target's forwards. With
``--draft-vocab-sizes``, each W is also tried drafting from the N most frequent response tokens of
``--draft-vocab-from`` (FR-Spec's candidate vocabulary, ``drafter.draft_vocab_size``; 0: the whole vocabulary): τ
replayed from the candidates, the drafts of every (W, N) timed interleaved; the (W, N) with the largest estimate is
chosen. With ``--weight-layouts``, every step cost is timed again with the weights laid out each way (the decoding
setting ``weight_layout``, :mod:`verify.layout`), and the layout with the largest mean estimate over the drafters is
chosen (``chosen_layout``; each layout's choices under ``by_layout``). Rows: the validation split of the data folder
(the same ``val_fraction`` as training).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from drafters import factory
from drafters.policy import DraftingPolicy, PolicyDrafter
from drafters.tau import greedy_walk
from drafters.training.datamodule import load_regenerated, split_by_id
from drafters.tree import TreeDrafter, TreePolicy
from experiments.data.target import load_target
from experiments.pipeline.assistant import leading_correct
from experiments.pipeline.eval_drafters import candidate_vocab
from experiments.pipeline.records import write_record
from experiments.pipeline.replay import (
    TreeLeads,
    assistant_correct,
    block_leads_by_vocab,
    lookup_replay,
    teacher_passes,
    tree_tops,
)
from experiments.pipeline.timing import prefill
from verify.hf import cache_argument, new_growing_kv_cache
from verify.layout import LAYOUTS, set_weight_layout
from verify.lookup import PromptLookupDrafter
from verify.tree import ancestor_mask, node_depths, pad_trees


def held_out_rows(data_dir: str, fraction: float, limit: int) -> list[tuple[list[int], int]]:
    data = load_regenerated(data_dir)
    _, val = split_by_id(data["id"], fraction)
    return [(list(data[i]["input_ids"]), int(data[i]["prompt_len"])) for i in val[:limit]]


def lookup_tau(rows, k: int) -> float:
    steps = sum(lookup_replay(ids[:cut], ids[cut:], k, 3, 1) for ids, cut in rows)
    return sum(len(ids) - cut for ids, cut in rows) / steps


def assistant_taus(model, rows, ks) -> dict[int, float]:
    """The assistant's τ drafting K tokens a step, per K in ``ks``, from one teacher-forced forward per row."""
    tokens, steps = sum(len(ids) - cut for ids, cut in rows), dict.fromkeys(ks, 0)
    for ids, cut in rows:
        correct = assistant_correct(model, ids)
        for k in ks:
            steps[k] += len(greedy_walk(leading_correct(correct, k), cut, len(ids))[0])
    return {k: tokens / n for k, n in steps.items()}


def held_out_passes(target, rows, drafter, passes: dict) -> list:
    """The target's teacher-forced passes over ``rows`` with ``drafter``'s target layers
    (:func:`experiments.pipeline.replay.teacher_passes`), made once per layers into ``passes`` and kept there."""
    layers = tuple(drafter.target_layer_ids)
    if layers not in passes:
        passes[layers] = list(teacher_passes(target, rows, layers))
    return passes[layers]


def block_taus(drafter, passes: list, rows, widths, vocabs: dict) -> dict:
    """τ of a block drafter verifying its first W drafts (``drafter.max_draft_tokens`` = W), per W in ``widths`` and
    per candidate vocabulary (``vocabs``: key -> ids (V',) or None for the whole vocabulary), from the target's
    ``passes`` over ``rows`` (:func:`held_out_passes`)."""
    by_vocab, _ = block_leads_by_vocab(drafter, passes, list(vocabs.values()))
    tokens = sum(len(ids) - cut for ids, cut in rows)
    return {key: {w: tokens / sum(len(greedy_walk([min(n, w) for n in lead], cut, len(ids))[0])
                                  for lead, (ids, cut) in zip(leads, rows)) for w in widths}
            for key, leads in zip(vocabs, by_vocab)}


@torch.no_grad()
def draft_ms(target, drafters: dict, rounds: int, context: int = 200) -> dict:
    """Median ms of one draft by each of ``drafters`` (key -> :class:`PolicyDrafter`, all wrapping one block drafter),
    batch 1, after a ``context``-column prefill; interleaved round by round."""
    _cache, anchor, position = prefill(target, next(iter(drafters.values())), 1, context)  # the drafter reads it
    times: dict = {key: [] for key in drafters}
    for _ in range(rounds):
        for key, drafter in drafters.items():
            t = time.perf_counter()
            drafter.draft(anchor, position)
            times[key].append(1000 * (time.perf_counter() - t))
    return {key: statistics.median(v[1:] if len(v) > 1 else v) for key, v in times.items()}


@torch.no_grad()
def forward_ms(model, widths: list[int], rounds: int, context: int = 200, trees: bool = False) -> dict[int, float]:
    """Median ms of one forward over w new columns after a ``context``-column cache, batch 1, per width. ``trees``:
    the columns are a tree's (a random tree of w - 1 nodes under the anchor, the ancestor-only mask of
    :mod:`verify.tree` passed as a 4-D mask, as the decoding loop does), else a chain's (the model's causal mask)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, context + max(widths)), generator=generator)
    masks = {w: _tree_mask_4d(w - 1, context, model.get_input_embeddings().weight.dtype, generator) if trees else {}
             for w in widths}
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(rounds):  # one prefill a round; each timed forward is cropped off again, as a rejection is
        cache = new_growing_kv_cache(model, context + max(widths))
        model(input_ids=ids[:, :context], use_cache=True, **{cache_argument(model): cache})
        for w in widths:
            t = time.perf_counter()
            model(input_ids=ids[:, context:context + w], use_cache=True, **masks[w], **{cache_argument(model): cache})
            times[w].append(1000 * (time.perf_counter() - t))
            cache.crop(-w)
    return {w: statistics.median(v[1:] if len(v) > 1 else v) for w, v in times.items()}


def _tree_mask_4d(nodes: int, context: int, dtype: torch.dtype, generator: torch.Generator) -> dict:
    """A random tree's ``attention_mask`` (1, 1, N + 1, C + N + 1) and ``position_ids`` after ``context`` columns."""
    parents = [int(torch.randint(i + 1, (1,), generator=generator)) - 1 for i in range(nodes)]
    tree = pad_trees([([3] * nodes, parents)])
    seen = torch.cat([torch.ones(1, nodes + 1, context, dtype=torch.bool), ancestor_mask(tree)], dim=2)
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[:, None]
    return {"attention_mask": mask, "position_ids": context + node_depths(tree)}


def choose(taus: dict[int, float], step_ms: dict[int, float], one_ms: float) -> dict:
    rows = {k: {"tau": round(t, 4), "step_ms": round(step_ms[k], 2), "speedup_estimate": round(t * one_ms / step_ms[k], 4)}
            for k, t in taus.items()}
    return {"by_k": rows, "chosen_k": max(rows, key=lambda k: rows[k]["speedup_estimate"])}


def choose_block(drafter, target, rows, widths, vocabs: dict, target_ms: dict[int, float], rounds: int,
                 taus: dict | None = None) -> dict:
    """The width W and candidate vocabulary (``vocabs``: size N -> ids (N',), 0 -> None for the whole vocabulary) a
    block drafter verifies best: :func:`choose` per N, the N of the largest estimate chosen (``chosen_vocab``).
    ``taus``: :func:`block_taus`' result when it is known already."""
    variants = {(w, n): PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=w), ids)
                for n, ids in vocabs.items() for w in widths}
    ms = draft_ms(target, variants, rounds)
    taus = taus or block_taus(drafter, held_out_passes(target, rows, drafter, {}), rows, widths, vocabs)
    by_vocab = {n: choose(taus[n], {w: target_ms[w + 1] + ms[w, n] for w in widths}, target_ms[1]) for n in vocabs}
    best = max(by_vocab, key=lambda n: best_estimate(by_vocab[n]))
    return {**by_vocab[best], "chosen_vocab": best, "by_vocab": by_vocab}


def best_estimate(choice: dict) -> float:
    """The estimated speedup of a :func:`choose` (or :func:`choose_block`) result at the K it chose."""
    return choice["by_k"][choice["chosen_k"]]["speedup_estimate"]


class _Steps:
    """A ``lead`` sequence that records, per step the walk takes, what drafted the step's tree and its node count."""

    def __init__(self, leads: TreeLeads):
        self.leads, self.steps = leads, []

    def __getitem__(self, a: int) -> int:
        lead = self.leads[a]
        self.steps.append((self.leads.source, self.leads.nodes))
        return lead


def tree_settings(budgets, matches, lookup_depths) -> dict[str, TreePolicy]:
    """The tree policies tried: the drafter's best-first tree of N nodes (``tree_n<N>``) and the hybrid with it
    (``hybrid_n<N>_m<m>_k<K>``: lookup's chain of K where the row's last m tokens recur). A hybrid's lookup serves
    only rows whose suffix recurs, whose continuations run longer than lookup's own average, so its K is chosen
    with the rest rather than taken from lookup's."""
    out = {f"tree_n{n}": TreePolicy(budget=n) for n in budgets}
    out |= {f"hybrid_n{n}_m{m}_k{k}": TreePolicy(budget=n, lookup_min_match=m, lookup_depth=k)
            for n in budgets for m in matches for k in lookup_depths}
    return out


@torch.no_grad()
def tree_draft_ms(target, drafter: TreeDrafter, rounds: int, context: int = 200) -> float:
    """Median ms of one tree drafted by the block drafter alone (its pass, the top tokens, the best-first search),
    batch 1, after a ``context``-column prefill."""
    _cache, anchor, position = prefill(target, drafter, 1, context)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        drafter.draft_tree(anchor, position)
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times[1:] if len(times) > 1 else times)


def tree_walk(variant: TreeDrafter, rows, tops) -> list[tuple[str, int]]:
    """A tree policy replayed on ``rows`` from the drafter's per-anchor ``tops``: per step (greedy_walk reads one lead
    a step), what drafted the step's tree and its node count (what a step costs depends on the machine, these not)."""
    parts = []
    for (ids, cut), top in zip(rows, tops):
        walk = _Steps(TreeLeads(variant, ids, top))
        greedy_walk(walk, cut, len(ids))
        parts += walk.steps
    return parts


def choose_tree(drafter, target, rows, vocab, policies: dict[str, TreePolicy], target_ms: dict[int, float],
                rounds: int, tops=None, walks: dict | None = None) -> dict:
    """τ and the estimated speedup of each tree policy over ``drafter`` (a block drafter drafting from the candidate
    ids ``vocab``), replayed on ``rows``: a step costs the target's forward over the tree's nodes + 1 columns
    (timed with a causal mask, which costs what the ancestor-only mask does) plus the drafter's pass where the step
    used it (lookup's own cost is left out: ~0.3% of a step). ``walks``: the policies' :func:`tree_walk` by name,
    filled here where missing (another weight layout's call reuses them). Returns ``by_setting`` and the ``chosen``
    policy."""
    block = PolicyDrafter(drafter, DraftingPolicy(), vocab)
    top_k = max(p.budget for p in policies.values())
    tops = tops or tree_tops(drafter, vocab, held_out_passes(target, rows, drafter, {}), top_k,
                             drafter.num_draft_tokens)[0]
    ms = {n: tree_draft_ms(target, TreeDrafter(block, None, TreePolicy(budget=n)), rounds)
          for n in sorted({p.budget for p in policies.values()})}
    tokens = sum(len(ids) - cut for ids, cut in rows)
    walks = {} if walks is None else walks
    by_setting = {}
    for name, policy in policies.items():
        if name not in walks:
            lookup = PromptLookupDrafter(drafter.vocab_size, policy.lookup_depth) if name.startswith("hybrid") else None
            walks[name] = tree_walk(TreeDrafter(block, lookup, policy), rows, tops)
        steps, parts = len(walks[name]), walks[name]
        cost = sum(target_ms[min(nodes + 1, max(target_ms))] + (ms[policy.budget] if source != "lookup" else 0.0)
                   for source, nodes in parts)
        by_setting[name] = {"tau": round(tokens / steps, 4), "step_ms": round(cost / steps, 2),
                            "speedup_estimate": round(tokens * target_ms[1] / cost, 4), **asdict(policy)}
    best = {kind: max((n for n in by_setting if n.startswith(kind)), key=lambda n: by_setting[n]["speedup_estimate"],
                      default=None) for kind in ("tree", "hybrid")}
    return {"draft_ms": ms, "by_setting": by_setting, "chosen": best}


def choose_all(args, rows, layout: str, replayed: dict) -> dict:
    """Every choice of this module with the weights of the target, the assistant and the block drafters laid out as
    ``layout`` (:func:`verify.layout.set_weight_layout`), which only the step costs depend on: the τ's (and a block
    drafter's candidate vocabularies) are made once, before any weight is re-laid, into ``replayed`` (filled on the
    first call, read on the later ones)."""
    target = load_target(args.target)[0]
    widths = sorted({1, *(k + 1 for k in args.ks)})
    if "prompt_lookup" not in replayed:
        replayed["prompt_lookup"] = {k: lookup_tau(rows, k) for k in args.ks}
    assistant = load_target(args.assistant)[0] if args.assistant else None
    if assistant is not None and "ar_assistant" not in replayed:
        replayed["ar_assistant"] = assistant_taus(assistant, rows, args.ks)
    blocks = {}
    for name, path in (item.split("=", 1) for item in args.drafter):
        drafter = factory.load(path, target=target).eval()
        ws = [w for w in args.ks if w <= drafter.num_draft_tokens]
        if name not in replayed:
            vocabs = {n: candidate_vocab(target, n, args.draft_vocab_from or args.data_dir, Path(path)) if n else None
                      for n in args.draft_vocab_sizes}
            passes = held_out_passes(target, rows, drafter, replayed.setdefault("passes", {}))
            replayed[name] = vocabs, block_taus(drafter, passes, rows, ws, vocabs)
        blocks[name] = drafter, ws, *replayed[name]
    for name, path in (item.split("=", 1) for item in args.tree):  # the trees' candidates and top tokens, once
        if f"tree:{name}" not in replayed:
            drafter = factory.load(path, target=target).eval()
            vocab = (candidate_vocab(target, args.tree_vocab_size, args.draft_vocab_from or args.data_dir, Path(path))
                     if args.tree_vocab_size else None)
            passes = held_out_passes(target, rows, drafter, replayed.setdefault("passes", {}))
            tops = tree_tops(drafter, vocab, passes, max(args.tree_budgets), drafter.num_draft_tokens)[0]
            replayed[f"tree:{name}"] = {"vocab": vocab, "tops": tops, "walks": {}}
    replayed.pop("passes", None)  # the τ's and tops are made: their target passes are not needed again
    set_weight_layout(layout, target, assistant, *(block[0] for block in blocks.values()))
    target_ms = forward_ms(target, widths, args.rounds)
    result = {"target_ms": target_ms,
              "prompt_lookup": choose(replayed["prompt_lookup"], {k: target_ms[k + 1] for k in args.ks}, target_ms[1])}
    if assistant is not None:
        one = forward_ms(assistant, [1], args.rounds)[1]
        result["assistant_token_ms"] = one
        result["ar_assistant"] = choose(replayed["ar_assistant"], {k: target_ms[k + 1] + k * one for k in args.ks},
                                        target_ms[1])
    for name, (drafter, ws, vocabs, taus) in blocks.items():
        result.setdefault("block_width", {})[name] = choose_block(drafter, target, rows, ws, vocabs, target_ms,
                                                                  args.rounds, taus)
    lookup_k = result["prompt_lookup"]["chosen_k"]
    for name, path in (item.split("=", 1) for item in args.tree):
        drafter = factory.load(path, target=target).eval()
        set_weight_layout(layout, drafter)
        made = replayed[f"tree:{name}"]
        policies = tree_settings(args.tree_budgets, args.hybrid_matches, sorted({lookup_k, *args.hybrid_depths}))
        if "tree_ms" not in result:  # the target over a tree's columns, with its mask: 1 .. N + K + 1 columns
            top = max(args.tree_budgets) + max(*args.ks, *args.hybrid_depths) + 1
            result["tree_ms"] = forward_ms(target, list(range(1, top + 1)), args.rounds, trees=True)
        result.setdefault("tree", {})[name] = choose_tree(drafter, target, rows, made["vocab"], policies,
                                                          result["tree_ms"], args.rounds, made["tops"], made["walks"])
    return result


def choose_layout(by_layout: dict[str, dict]) -> str:
    """The weight layout whose choices have the largest mean estimated speedup over the drafters (prompt lookup, the
    assistant, each block drafter): the one decoding setting they share in a timing (``experiments.speed``)."""
    def mean_estimate(result: dict) -> float:
        choices = [result[b] for b in ("prompt_lookup", "ar_assistant") if b in result]
        choices += list(result.get("block_width", {}).values())
        return statistics.fmean(best_estimate(c) for c in choices)
    return max(by_layout, key=lambda layout: mean_estimate(by_layout[layout]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--assistant", default=None, help="an ar_assistant folder (experiments.train_assistant's export)")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="a trained block drafter: the width W of its drafts to verify (drafter.max_draft_tokens)")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 7, 10, 15])
    p.add_argument("--draft-vocab-sizes", type=int, nargs="+", default=[0],
                   help="block drafters: candidate vocabulary sizes tried (drafter.draft_vocab_size; 0: the whole)")
    p.add_argument("--draft-vocab-from", default=None,
                   help="the data or recorded-answers folder the candidates are counted in (default: --data-dir)")
    p.add_argument("--weight-layouts", nargs="+", default=["row_major"], choices=LAYOUTS,
                   help="the decoding setting weight_layout: each one's step costs timed, the best one chosen")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="a trained block drafter drafting trees: the node budget N of its best-first tree, and of "
                        "the hybrid with prompt lookup (its chosen K) and the match length m (drafter.budget, "
                        "drafter.lookup_min_match of conf/eval/drafter/tree.yaml and hybrid.yaml)")
    p.add_argument("--tree-budgets", type=int, nargs="+", default=[2, 3, 4, 6, 8, 16])
    p.add_argument("--hybrid-matches", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--hybrid-depths", type=int, nargs="+", default=[5, 7, 10],
                   help="the hybrid's lookup depths K tried, beside prompt lookup's chosen K (drafter.lookup_depth)")
    p.add_argument("--tree-vocab-size", type=int, default=0,
                   help="the trees' candidate vocabulary (drafter.draft_vocab_size; 0: the whole vocabulary)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/choose_k.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = held_out_rows(args.data_dir, args.val_fraction, args.rows)
    replayed: dict = {}
    by_layout = {layout: choose_all(args, rows, layout, replayed) for layout in dict.fromkeys(args.weight_layouts)}
    layout = choose_layout(by_layout)
    result = {"rows": len(rows), **by_layout[layout], "chosen_layout": layout}
    if len(by_layout) > 1:
        result["by_layout"] = by_layout
    write_record({"config": vars(args), **result}, args.out)
    for name, chosen in result.get("block_width", {}).items():
        print(f"[choose_k] {name}: W = {chosen['chosen_k']}, candidate vocabulary {chosen['chosen_vocab'] or 'all'}  "
              f"{chosen['by_k']}", flush=True)
    print(f"[choose_k] weight layout: {layout}", flush=True)
    for name, chosen in result.get("tree", {}).items():
        print(f"[choose_k] {name}: tree {chosen['chosen']['tree']}, hybrid {chosen['chosen']['hybrid']}  "
              f"{ {k: v['speedup_estimate'] for k, v in chosen['by_setting'].items()} }", flush=True)
    for name in ("prompt_lookup", "ar_assistant"):
        if name in result:
            print(f"[choose_k] {name}: K = {result[name]['chosen_k']}  {result[name]['by_k']}", flush=True)
    return result


if __name__ == "__main__":
    main()
