"""Exact verification of draft trees (docs/method.md §3, "Trees"): pure functions, no model.

A step drafts, per row, a tree of N node slots over the row's anchor (the root, column 0 of the step): node i
holds ``tokens[b, i]`` and hangs from ``parents[b, i]`` (-1: the root; else an earlier node, ``< i``).
``valid[b, i] = False`` marks padding (rows hold trees of different sizes). A chain d_1..d_K is the tree
``parents = [-1, 0, 1, ..., K - 2]``.

The target runs once over the N + 1 columns ``[anchor, node_1..node_N]``, each column attending to the row's
committed context and to its own ancestors in the tree (:func:`ancestor_mask`), at position ``anchor + depth``
(:func:`node_depths`). :func:`walk_tree` then draws the target's token at the root (the argmax at T = 0),
moves to the child holding it, draws again there, and stops where no child holds the draw; the last draw is
emitted after the path. Every emitted token is a draw from the target's own distribution given the accepted
prefix, whatever the tree holds, so the output is distributed as the target's (token-identical to its
greedy decoding at T = 0) without using the drafter's q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from verify.rejection import check_finite, sample_tokens, warp_probs


@dataclass
class DraftTree:
    """A batch of ragged draft trees (see the module docstring)."""

    tokens: torch.Tensor  # (B, N) long
    parents: torch.Tensor  # (B, N) long, -1 = the root, else an earlier node's index
    valid: torch.Tensor  # (B, N) bool, False = padding

    @staticmethod
    def chain(drafts: torch.Tensor) -> DraftTree:
        """The tree of a chain of drafts (B, K): node k hangs from node k - 1."""
        rows, width = drafts.shape
        parents = (torch.arange(width, device=drafts.device) - 1).expand(rows, width)
        return DraftTree(drafts.long(), parents.clone(), torch.ones_like(drafts, dtype=torch.bool))

    @staticmethod
    def from_paths(paths: list[list[list[int]]], device=None) -> DraftTree:
        """Trees from token paths per row (each path starts below the root): shared prefixes become shared
        nodes, nodes in order of first appearance (a parent always before its children)."""
        rows: list[tuple[list[int], list[int]]] = []
        for row_paths in paths:
            tokens, parents, index = [], [], {}
            for path in row_paths:
                parent = -1
                for token in path:
                    key = (parent, int(token))
                    if key not in index:
                        index[key] = len(tokens)
                        tokens.append(int(token))
                        parents.append(parent)
                    parent = index[key]
            rows.append((tokens, parents))
        return pad_trees(rows, device)

    @property
    def num_nodes(self) -> torch.Tensor:  # (B,) long
        return self.valid.sum(dim=1)

    def select(self, rows: torch.Tensor) -> DraftTree:
        return DraftTree(self.tokens[rows], self.parents[rows], self.valid[rows])


def pad_trees(rows: list[tuple[list[int], list[int]]], device=None) -> DraftTree:
    """One :class:`DraftTree` from per-row ``(tokens, parents)`` lists of different lengths (padded, invalid)."""
    width = max((len(tokens) for tokens, _ in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    parents = torch.full((len(rows), width), -1, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (row_tokens, row_parents) in enumerate(rows):
        n = len(row_tokens)
        if len(row_parents) != n:
            raise ValueError(f"tree row {b}: {n} tokens but {len(row_parents)} parent indices")
        tokens[b, :n] = torch.tensor(row_tokens, dtype=torch.long)
        parents[b, :n] = torch.tensor(row_parents, dtype=torch.long)
        valid[b, :n] = True
    return DraftTree(tokens.to(device), parents.to(device), valid.to(device))


def check_tree(tree: DraftTree, max_depth: int | None = None) -> torch.Tensor:
    """Refuse a malformed tree, naming the row and node: shapes that differ, a parent that is not an earlier node
    or the root, a valid node under a padding node, or (with ``max_depth``) a node deeper than ``max_depth``.
    Returns the tree's :func:`node_depths`."""
    if tree.tokens.ndim != 2 or tree.parents.shape != tree.tokens.shape or tree.valid.shape != tree.tokens.shape:
        raise ValueError(f"draft tree: tokens {tuple(tree.tokens.shape)}, parents {tuple(tree.parents.shape)} and "
                         f"valid {tuple(tree.valid.shape)} must be the same (B, N)")
    n = tree.tokens.shape[1]
    index = torch.arange(n, device=tree.parents.device)
    bad = tree.valid & ((tree.parents < -1) | (tree.parents >= index))  # (B, N)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"draft tree row {b}, node {i}: parent {int(tree.parents[b, i])} is not the root (-1) or "
                         f"an earlier node (0..{i - 1})")
    parent_valid = torch.where(tree.parents >= 0, tree.valid.gather(1, tree.parents.clamp_min(0)),
                               torch.ones_like(tree.valid))
    orphan = tree.valid & ~parent_valid
    if bool(orphan.any()):
        b, i = (int(x) for x in orphan.nonzero()[0])
        raise ValueError(f"draft tree row {b}, node {i}: its parent {int(tree.parents[b, i])} is a padding node")
    depths = node_depths(tree)  # (B, N + 1)
    if max_depth is not None:
        deep = tree.valid & (depths[:, 1:] > max_depth)
        if bool(deep.any()):
            b, i = (int(x) for x in deep.nonzero()[0])
            raise ValueError(f"draft tree row {b}, node {i}: depth {int(depths[b, i + 1])} is deeper than the "
                             f"drafter's {max_depth} draft slots")
    return depths


def node_depths(tree: DraftTree) -> torch.Tensor:  # (B, N + 1) long, the root's 0 first
    """Depth of every column of the step ``[root, node_1..node_N]`` (padding nodes: 1)."""
    rows, n = tree.tokens.shape
    depth = torch.zeros(rows, n + 1, dtype=torch.long, device=tree.tokens.device)
    for i in range(n):  # parents come first: one pass in node order
        depth[:, i + 1] = depth.gather(1, (tree.parents[:, i : i + 1] + 1)).squeeze(1) + 1
    return depth


def ancestor_mask(tree: DraftTree) -> torch.Tensor:  # (B, N + 1, N + 1) bool
    """``mask[b, i, j]``: column j is column i itself or one of its ancestors (column 0 is the root)."""
    rows, n = tree.tokens.shape
    mask = torch.eye(n + 1, dtype=torch.bool, device=tree.tokens.device).repeat(rows, 1, 1)
    for i in range(n):  # a node sees what its parent sees, and itself
        parent_row = mask[torch.arange(rows), tree.parents[:, i] + 1]  # (B, N + 1)
        mask[:, i + 1] |= parent_row
    return mask


def walk_tree(
    tree: DraftTree,
    logits: torch.Tensor,  # (B, N + 1, V): the target's logits at [root, node_1..node_N]
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    depths: torch.Tensor | None = None,  # (B, N + 1) node_depths(tree), when known already
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact walk: ``(num_accepted (B,), next_token (B,), path (B, D + 1))``.

    At every column the target's token is drawn from its warped distribution (the argmax at T = 0; one
    independent draw per column, of which the walk reads only those on its path). From the root the walk moves
    to the first valid child holding the draw; ``num_accepted`` counts the moves, ``next_token`` is the draw at
    the last node, ``path[b, :num_accepted + 1]`` the columns walked (0 = the root; the rest of the row repeats
    its last column). D is the deepest node's depth.
    """
    rows, n = tree.tokens.shape
    if logits.shape[:2] != (rows, n + 1):
        raise ValueError(f"walk_tree: logits {tuple(logits.shape)} must be (B, N + 1, V) = ({rows}, {n + 1}, V)")
    if temperature == 0:
        check_finite(logits)
        draws = logits.argmax(dim=-1)  # (B, N + 1)
    else:
        draws = sample_tokens(warp_probs(logits, temperature, top_k, top_p), generator)  # (B, N + 1)
    # child[b, c, i]: node i (column i + 1) is a valid child of column c holding the target's draw at c.
    parent_col = tree.parents + 1  # (B, N) column of each node's parent
    cols = torch.arange(n + 1, device=logits.device)
    holds = tree.valid.unsqueeze(1) & (parent_col.unsqueeze(1) == cols.view(1, -1, 1))  # (B, N + 1, N)
    holds &= tree.tokens.unsqueeze(1) == draws.unsqueeze(2)
    depth = int((node_depths(tree) if depths is None else depths).max()) if n else 0
    current = torch.zeros(rows, dtype=torch.long, device=logits.device)  # (B,) column
    accepted = torch.zeros_like(current)
    path = [current]
    batch = torch.arange(rows, device=logits.device)
    for _ in range(depth):
        options = holds[batch, current]  # (B, N)
        moves = options.any(dim=1)  # (B,)
        if not bool(moves.any()):
            break
        current = torch.where(moves, options.long().argmax(dim=1) + 1, current)
        accepted = accepted + moves.long()
        path.append(current)
    next_token = draws.gather(1, current.unsqueeze(1)).squeeze(1)
    return accepted, next_token, torch.stack(path, dim=1)


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter the decoding loop verifies as trees (:mod:`verify.generate`): the :class:`verify.drafter.Drafter`
    protocol with ``draft_tree`` in place of ``draft``; ``num_draft_tokens`` bounds a tree's depth."""

    num_draft_tokens: int
    target_layer_ids: tuple[int, ...]
    vocab_size: int

    def draft_tree(self, anchor_ids: torch.Tensor, anchor_position_ids: torch.Tensor, *, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None,
                   generator: torch.Generator | None = None) -> DraftTree:
        """One tree per row over its anchor (B,) at its position (B,)."""
