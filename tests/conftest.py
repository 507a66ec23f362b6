"""Shared tiny-model fixtures: random Hugging Face causal LMs built from config (CPU, float32).

Use the plain functions directly (``from conftest import tiny_target, left_padded_prompts``) or
through the fixtures of the same purpose (``make_target``, ``make_prompts``).
"""

from __future__ import annotations

import pytest
import torch

FAMILIES = ("llama", "gpt2", "qwen2")

# Tiny models on a shared 2-core machine: intra-op threads only add contention (measured 10-50x
# slower forwards with the default thread count while other jobs run).
torch.set_num_threads(1)


def tiny_target(
    family: str = "llama",
    vocab_size: int = 64,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    init_range: float = 0.2,
    max_positions: int = 128,
) -> torch.nn.Module:
    """A random causal LM of the given family ("llama", "gpt2" or "qwen2"), in eval mode.

    Special ids: pad 0, bos 1, eos 2 (set in the config; nothing forces the model to emit them).
    ``init_range`` is the weights' init std: larger gives peakier next-token distributions (and
    clean argmax margins for greedy tests).
    """
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
            max_position_embeddings=max_positions, initializer_range=init_range, **ids,
        )
        model_class = LlamaForCausalLM
    elif family == "qwen2":
        config = Qwen2Config(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
            max_position_embeddings=max_positions, initializer_range=init_range, **ids,
        )
        model_class = Qwen2ForCausalLM
    elif family == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
            n_positions=max_positions, initializer_range=init_range, **ids,
        )
        model_class = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    torch.manual_seed(seed)
    return model_class(config).to(torch.float32).eval()


def left_padded_prompts(
    lengths: list[int], vocab_size: int, seed: int = 0, pad_id: int = 0, low: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded: ``(input_ids (B, T), attention_mask (B, T))``.

    Tokens are drawn from ``[low, vocab_size)`` so they avoid the special ids 0-2.
    """
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(low, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


@pytest.fixture
def make_target():
    """The :func:`tiny_target` builder."""
    return tiny_target


@pytest.fixture
def make_prompts():
    """The :func:`left_padded_prompts` builder."""
    return left_padded_prompts
