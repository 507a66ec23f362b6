"""The reference decoding loop: draft → verify → emit, one row at a time, the target recomputed over the whole sequence.

Read this first; :func:`verify.generate.speculative_generate` is the same algorithm made fast, and the tests hold the
two to the same output (token for token at T = 0, the same distribution at T > 0). What the tuned loop adds: a batch
of rows in one forward (left padding, rejected drafts kept as masked holes, finished rows dropped), a KV cache
cropped to the accepted columns instead of recomputing, the LM head applied lazily at T = 0 and weights laid out for
the CPU (:mod:`verify.layout`), step timers, and a drafter that may read the target's own cache.
"""

from __future__ import annotations

import torch

from verify.rejection import verify_block, warp_probs
from verify.tree import DraftTree, TreeDrafter, ancestor_mask, node_depths, walk_tree


@torch.no_grad()
def reference_generate(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                       generator: torch.Generator | None = None) -> list[list[int]]:
    """Each prompt's new tokens (EOS kept), drafted by ``drafter`` (a chain or a tree drafter) and verified exactly."""
    return [_one_row(target, drafter, prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator)
            for prompt in prompts]


def _one_row(target, drafter, prompt, max_new_tokens, temperature, top_k, top_p, eos, generator) -> list[int]:
    layers = drafter.target_layer_ids
    tokens = torch.tensor([prompt])  # (1, T): committed tokens, the last one is the anchor
    drafter.reset(1)
    hidden = target(tokens[:, :-1], output_hidden_states=True).hidden_states if tokens.shape[1] > 1 else None
    _extend(drafter, tokens[:, :-1], torch.arange(tokens.shape[1] - 1), hidden, layers)
    new: list[int] = []
    while len(new) < max_new_tokens and (eos is None or not new or new[-1] != eos):
        anchor, position = tokens[:, -1], torch.tensor([tokens.shape[1] - 1])
        if isinstance(drafter, TreeDrafter):  # (1) draft a tree, or a chain as its one-child tree
            tree, q = drafter.draft_tree(anchor, position, temperature=temperature, top_k=top_k, top_p=top_p,
                                         generator=generator), None
        else:
            drafts, q = drafter.draft(anchor, position, temperature=temperature, top_k=top_k, top_p=top_p,
                                      generator=generator)
            tree = DraftTree.chain(drafts)
        n, t = tree.tokens.shape[1], tokens.shape[1]  # (2) the target over context, anchor and nodes
        seen = torch.ones(t + n, t + n, dtype=torch.bool).tril()  # causal over the context ...
        seen[t - 1 :, t - 1 :] = ancestor_mask(tree)[0]  # ... the anchor and the nodes seeing their ancestors only
        mask = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
        ids = torch.cat([tokens, tree.tokens], dim=1)
        positions = torch.cat([torch.arange(t - 1), position + node_depths(tree)[0]])[None]
        out = target(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        logits = out.logits[:, t - 1 :]  # (1, N + 1, V)
        if q is None or temperature == 0:  # (3) the walk; a sampled chain keeps the rejection rule with its q
            accepted, next_token, path = walk_tree(tree, logits, temperature, top_k, top_p, generator)
        else:
            accepted, next_token = verify_block(drafts, q, warp_probs(logits, temperature, top_k, top_p), generator)
            path = torch.arange(int(accepted) + 1)[None]
        path = path[:, : int(accepted) + 1]  # (4) emit the path's tokens and the drawn one, cut at EOS and the cap
        kept = ids[0, t - 1 + path[0]]  # [anchor, accepted nodes]
        for token in [*kept[1:].tolist(), int(next_token)]:
            if len(new) < max_new_tokens and (eos is None or not new or new[-1] != eos):
                new.append(token)
        # (5) the drafter reads the committed columns [anchor, accepted nodes] and the target's states there
        _extend(drafter, kept[None], position + torch.arange(path.shape[1]),
                tuple(h[:, t - 1 + path[0]] for h in out.hidden_states), layers)
        tokens = torch.cat([tokens, kept[1:][None], next_token.view(1, 1)], dim=1)
    return new


def _extend(drafter, ids, positions, hidden, layers) -> None:
    """Hand the drafter committed columns ``ids`` (1, n) at ``positions`` (n,) with the target's states there."""
    if ids.shape[1] == 0:
        return
    states = tuple(hidden[i] for i in layers) if layers else None
    drafter.extend(ids, torch.ones_like(ids), positions[None], states)
