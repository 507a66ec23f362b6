"""The starting point of a draft timing: a target's KV cache over random tokens, handed to the drafter as
:func:`verify.speculative_generate` hands it over (the main job's :mod:`.choose_k`; ``experiments.bench.draft_cost``)."""

from __future__ import annotations

import torch

from verify.hf import cache_argument, new_growing_kv_cache


def prefill(target, drafter, batch: int, context: int, seed: int = 0):
    """The target's cache over ``context`` random tokens per row, handed to the drafter; the rows' anchors and their
    positions."""
    vocab = target.get_output_embeddings().out_features
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed)).to(target.device)
    mask = torch.ones_like(ids[:, :-1])
    positions = torch.arange(context - 1, device=ids.device).expand(batch, -1)
    cache = new_growing_kv_cache(target, 64)
    out = target(input_ids=ids[:, :-1], attention_mask=mask, position_ids=positions, use_cache=True,
                 output_hidden_states=True, logits_to_keep=1, **{cache_argument(target): cache})
    drafter.reset(batch)
    drafter.bind_target_cache(cache)
    drafter.extend(ids[:, :-1], mask, positions, [out.hidden_states[i] for i in drafter.target_layer_ids])
    return cache, ids[:, -1], torch.full((batch,), context - 1, device=ids.device)
