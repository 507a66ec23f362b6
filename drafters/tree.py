"""Tree and hybrid drafting policies: what a step verifies as a tree (:mod:`verify.tree`), decided per row.

* **Best-first tree** (:func:`best_first_tree`, DDTree's rule): from one pass of a block drafter, the N token
  paths of highest score, a path's score being the product of its slots' drafter probabilities
  q_1(t_1) · … · q_d(t_d). Every prefix of a kept path scores at least as high, so the N paths form a tree.
* **Lookup paths** (:func:`verify.lookup.lookup_paths`): the distinct continuations of the row's longest
  recurring suffix n-gram, merged into a tree on their shared prefixes.
* **Hybrid** (:class:`TreeDrafter` with both parts): a row whose last ``lookup_min_match`` or more tokens recur
  earlier in the row verifies lookup's paths; the other rows the block drafter's tree (or its argmax chain). The
  drafter's pass runs only on those other rows, and not at all in a step where every row is served by lookup.
* **Merged** (``merge=True``): lookup's paths where the row's suffix recurs, plus the drafter's best-first nodes,
  in every row.

Exactness: the tree of a row is fixed from the row's committed tokens and the drafter's distributions before the
target runs, and the walk draws the target's own tokens (docs/method.md §3, "Trees"), so any rule here is exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drafters.policy import PolicyDrafter
from verify.lookup import PromptLookupDrafter, lookup_paths
from verify.tree import DraftTree, pad_trees


def best_first_tree(log_probs: torch.Tensor, budget: int) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` of the ``budget`` highest-scoring paths over slot log-probabilities (K, V): score =
    sum of the slots' log-probabilities along the path; nodes in the order they were taken (parents first)."""
    values, ids = log_probs.float().topk(min(budget, log_probs.shape[-1]), dim=-1)  # (K, n): per slot, best first
    return best_first_from_top(values.tolist(), ids.tolist(), budget)


def best_first_from_top(values: list[list[float]], ids: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """:func:`best_first_tree` from each slot's top log-probabilities ``values`` and tokens ``ids`` (K lists of n,
    best first; n >= ``budget`` or the vocabulary).

    Best-first search: a frontier of candidate nodes, each the next sibling (next-ranked token of the same slot
    under the same parent) or the first child (top token of the next slot) of a taken node; the best candidate is
    taken until ``budget`` nodes are."""
    slots = len(values)
    if budget < 1 or slots < 1:
        return [], []
    ranks = len(values[0])
    tokens, parents, scores = [], [], []
    frontier = [(-values[0][0], -1, 0, 0)]  # (-score, parent node, slot, rank in the slot)
    while frontier and len(tokens) < budget:
        neg, parent, slot, rank = heapq.heappop(frontier)
        tokens.append(ids[slot][rank])
        parents.append(parent)
        scores.append(-neg)
        node = len(tokens) - 1
        base = 0.0 if parent < 0 else scores[parent]
        if rank + 1 < ranks:
            heapq.heappush(frontier, (-(base + values[slot][rank + 1]), parent, slot, rank + 1))
        if slot + 1 < slots:
            heapq.heappush(frontier, (-(-neg + values[slot + 1][0]), node, slot + 1, 0))
    return tokens, parents


def merge_paths(tokens: list[int], parents: list[int], paths: list[list[int]]) -> tuple[list[int], list[int]]:
    """A tree ``(tokens, parents)`` with token ``paths`` (each from the root) added where they are not in it yet."""
    tokens, parents = list(tokens), list(parents)
    children = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
    for path in paths:
        parent = -1
        for token in path:
            if (parent, token) not in children:
                children[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = children[(parent, token)]
    return tokens, parents


def accepted_depth(tokens: list[int], parents: list[int], continuation: Sequence[int]) -> int:
    """How many tokens of ``continuation`` (the target's greedy tokens after the anchor) a tree ``(tokens,
    parents)`` holds as a root path: the drafts a T = 0 walk accepts (:func:`verify.tree.walk_tree`)."""
    child: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        child.setdefault((parent, token), i)  # the walk follows the first child holding the token
    node, depth = -1, 0
    while depth < len(continuation) and (node, continuation[depth]) in child:
        node = child[(node, continuation[depth])]
        depth += 1
    return depth


@dataclass(frozen=True)
class TreePolicy:
    """What a :class:`TreeDrafter` verifies each step (Hydra: ``conf/eval/drafter/tree.yaml``, ``hybrid.yaml``)."""

    #: N, the drafter's best-first nodes per row (its tree); with ``chain_width`` unused.
    budget: int = 4
    #: The tree ranks paths by slot probabilities softmax(logits / this): above 1 flattens each slot, so the N
    #: nodes go wider (more runners-up) and less deep; 1 = the drafter's own. Any value is exact.
    score_temperature: float = 1.0
    #: Draft the drafter's argmax chain of this many slots instead of a tree (null: the tree).
    chain_width: int | None = None
    #: Lookup's rows: those whose longest recurring suffix n-gram has at least this many tokens.
    lookup_min_match: int = 2
    #: Depth of lookup's paths (K of prompt lookup).
    lookup_depth: int = 5
    #: Distinct continuations of the matched n-gram verified as paths (1: lookup's chain).
    lookup_paths: int = 1
    #: Every row verifies lookup's paths (where its suffix recurs) and the drafter's nodes together.
    merge: bool = False

    def drafter_width(self, block_slots: int) -> int:
        """Slots of the drafter's block its tree (or chain) reads."""
        return block_slots if self.chain_width is None else self.chain_width

    def row_tree(self, lookup: list[list[int]] | None, top: tuple[list, list] | None) -> tuple[list, list, str]:
        """One row's ``(tokens, parents, source)`` from lookup's paths (None: the row is not lookup's) and the
        drafter's per-slot top log-probabilities and tokens (None: no drafter pass for the row)."""
        tokens, parents = [], []
        if top is not None:
            values, ids = top
            if self.chain_width is not None:
                tokens, parents = [slot[0] for slot in ids[: self.chain_width]], list(range(-1, self.chain_width - 1))
            else:
                tokens, parents = best_first_from_top(values, ids, self.budget)
        if lookup is not None:
            tokens, parents = merge_paths(tokens, parents, lookup)
        source = "merged" if top is not None and lookup is not None else "drafter" if top is not None else "lookup"
        return tokens, parents, source

    def check(self, block: PolicyDrafter | None, lookup: PromptLookupDrafter | None) -> None:
        """Refuse what cannot be drafted, naming the key (``drafter.<key>``)."""
        if block is None and lookup is None:
            raise ValueError("a tree policy needs a drafter (drafter.path=<a trained block drafter>) or prompt lookup")
        if block is not None and not 1 <= self.budget <= 64:
            raise ValueError(f"drafter.budget={self.budget}: the tree's node count N must be in 1..64")
        if not self.score_temperature > 0:
            raise ValueError(f"drafter.score_temperature={self.score_temperature}: must be > 0")
        k = block.num_draft_tokens if block is not None else None
        if self.chain_width is not None and (block is None or not 1 <= self.chain_width <= k):
            raise ValueError(f"drafter.chain_width={self.chain_width}: must be in 1..{k} (K of the block drafter)")
        if lookup is not None and (self.lookup_min_match < 1 or self.lookup_depth < 1 or self.lookup_paths < 1):
            raise ValueError(f"drafter.lookup_min_match={self.lookup_min_match}, lookup_depth={self.lookup_depth}, "
                             f"lookup_paths={self.lookup_paths}: each must be >= 1")
        if lookup is not None and block is not None and self.lookup_min_match > lookup.max_ngram:
            raise ValueError(f"drafter.lookup_min_match={self.lookup_min_match} exceeds prompt lookup's max_ngram="
                             f"{lookup.max_ngram}: no match that long is looked for, so lookup would never draft")
        if self.merge and (block is None or lookup is None):
            raise ValueError("drafter.merge=true merges lookup's paths with a block drafter's tree: it needs both")


class TreeDrafter:
    """Drafts one tree per row (the :class:`verify.tree.TreeDrafter` protocol) from a block drafter, prompt lookup,
    or both under a :class:`TreePolicy` (see the module docstring). ``draft_sources()`` labels each row's tree
    ``lookup``, ``drafter`` or ``merged``."""

    def __init__(self, block: PolicyDrafter | None, lookup: PromptLookupDrafter | None,
                 policy: TreePolicy | None = None) -> None:
        self.block, self.lookup, self.policy = block, lookup, policy or TreePolicy()
        self.policy.check(block, lookup)
        depths = [self.policy.lookup_depth] if lookup is not None else []
        if block is not None:
            depths.append(block.num_draft_tokens if self.policy.chain_width is None else self.policy.chain_width)
        self.num_draft_tokens = max(depths)
        self.vocab_size = (block or lookup).vocab_size
        self.target_layer_ids = tuple(block.target_layer_ids) if block is not None else ()
        self._sources: list[str] = []

    # ---- the drafter protocol: both parts follow the committed columns ----------------------------------------

    def _parts(self):
        return [part for part in (self.block, self.lookup) if part is not None]

    def reset(self, batch_size: int) -> None:
        for part in self._parts():
            part.reset(batch_size)

    def bind_target_cache(self, cache) -> None:
        if self.block is not None:
            self.block.bind_target_cache(cache)

    def extend(self, input_ids, attention_mask, position_ids, hidden_states) -> None:
        if self.block is not None:
            self.block.extend(input_ids, attention_mask, position_ids, hidden_states)
        if self.lookup is not None:
            self.lookup.extend(input_ids, attention_mask, position_ids)

    def select_rows(self, rows: torch.Tensor) -> None:
        for part in self._parts():
            part.select_rows(rows)

    def draft_sources(self) -> list[str]:
        return list(self._sources)

    # ---- one tree per row ------------------------------------------------------------------------------------

    def lookup_for(self, seq: torch.Tensor) -> list[list[int]] | None:
        """Lookup's paths for a row whose tokens up to its anchor are ``seq`` (L,), or None where the row is the
        drafter's (its longest recurring suffix n-gram is shorter than ``lookup_min_match``; no lookup: always)."""
        if self.lookup is None:
            return None
        p = self.policy
        n, paths = lookup_paths(seq, self.lookup.max_ngram, self.lookup.min_ngram, p.lookup_depth, p.lookup_paths)
        return paths if n >= p.lookup_min_match or self.block is None else None

    def needs_pass(self, lookup: list[list[int]] | None) -> bool:
        """Whether a row with lookup's paths ``lookup`` (None: not lookup's) reads the drafter's pass."""
        return self.block is not None and (self.policy.merge or lookup is None)

    @torch.no_grad()
    def _drafter_top(self, anchor_ids, anchor_position_ids, rows: list[int]) -> dict[int, tuple[list, list]]:
        """Per row of ``rows``, the top log-probabilities and tokens of each slot the policy reads, from one pass of
        the block drafter over those rows only."""
        if not rows:
            return {}
        d = self.block.drafter
        block = d.block_inputs(anchor_ids, anchor_position_ids)
        every = len(rows) == anchor_ids.shape[0]
        states = d.block_states(block, None if every else torch.tensor(rows, device=anchor_ids.device))  # (b, K, H)
        states = states[:, : self.policy.drafter_width(states.shape[1])]
        logits, vocab = self.block.candidate_logits(states)  # (b, W, V'): the rest of the vocabulary has q = 0
        logits = logits.float() / self.policy.score_temperature
        values, ids = logits.log_softmax(-1).topk(min(self.policy.budget, logits.shape[-1]), dim=-1)  # (b, W, n)
        ids = ids if vocab is None else vocab[ids]
        return {row: (v, i) for row, v, i in zip(rows, values.tolist(), ids.tolist())}

    def draft_tree(self, anchor_ids, anchor_position_ids, *, temperature: float = 0.0, top_k=None, top_p=None,
                   generator=None) -> DraftTree:
        rows = anchor_ids.shape[0]
        seqs = self.lookup.sequences(anchor_ids) if self.lookup is not None else [None] * rows
        lookups = [self.lookup_for(seq) for seq in seqs]
        top = self._drafter_top(anchor_ids, anchor_position_ids, [b for b in range(rows) if self.needs_pass(lookups[b])])
        trees = [self.policy.row_tree(lookups[b], top.get(b)) for b in range(rows)]
        self._sources = [source for _, _, source in trees]
        return pad_trees([(tokens, parents) for tokens, parents, _ in trees], anchor_ids.device)
