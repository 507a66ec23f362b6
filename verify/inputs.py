"""The checks and defaults of :mod:`verify.generate`'s entry points: prompts left-padded and in the target's
vocabulary, the EOS ids as a tensor, the pad id of the output sequences."""

from __future__ import annotations

import torch

from verify.hf import max_positions


def eos_tensor(eos_token_id, device) -> torch.Tensor:
    if eos_token_id is None:
        ids = []
    elif isinstance(eos_token_id, int):
        ids = [eos_token_id]
    else:
        ids = [int(i) for i in eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device)


def check_inputs(target, input_ids, attention_mask, max_new_tokens, vocab_size) -> torch.Tensor:
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (B, T) tensor, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
        )
    attention_mask = attention_mask.long()
    lengths = attention_mask.sum(dim=1)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt: rows {torch.nonzero(lengths == 0).flatten().tolist()} have no tokens")
    if (attention_mask[:, -1] == 0).any() or (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError("attention_mask must be left-padded (zeros, then ones) and end in a token on every row")
    tokens = input_ids[attention_mask.bool()]
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the target's vocabulary)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions(target)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the target's "
            f"max_position_embeddings ({limit})"
        )
    return attention_mask


def resolve_pad_id(target, pad_token_id, eos: torch.Tensor) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    for config in (getattr(target, "generation_config", None), target.config):
        value = getattr(config, "pad_token_id", None) if config is not None else None
        if value is not None:
            return int(value)
    return int(eos[0]) if eos.numel() else 0
