"""Shared tiny-model fixtures: random Hugging Face causal LMs built from config (CPU, float32).

Use the plain functions directly (``from conftest import tiny_target, left_padded_prompts``) or
through the fixtures of the same purpose (``make_target``, ``make_prompts``).
"""

from __future__ import annotations

import os

import pytest
import torch

FAMILIES = ("llama", "gpt2", "qwen2")

# trainer.precision=auto reads the CPU's bfloat16 flags (experiments/pipeline/trainer.py): every test, and every
# job a test starts, sees a CPU without them (auto = float32), so no result depends on this machine's instruction
# set; tests/test_precision.py sets the flags it needs and skips what needs the real instructions.
os.environ["BLOCKDRAFT_CPU_FLAGS"] = ""

# Tiny models on a shared 2-core machine: intra-op threads only add contention (measured 10-50x
# slower forwards with the default thread count while other jobs run).
torch.set_num_threads(1)


def tiny_qwen3(path=None) -> torch.nn.Module:
    """A random 3-layer Qwen3 (vocabulary 40, hidden 32), in eval mode; saved to ``path`` when given."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    if path is not None:
        model.save_pretrained(path)
    return model


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


def sampled_continuations_pvalue(target, drafter, prompt: list[int], length: int, batches: int, rows: int,
                                 seed: int = 0) -> tuple[float, int]:
    """Speculative sampling at T = 1 of ``batches`` x ``rows`` continuations of ``length`` tokens after
    ``prompt``: ``(chi-square p-value against the target's exact distribution over every continuation,
    drafts accepted)``. Continuations expected fewer than 5 times are pooled into one cell."""
    import itertools

    from scipy.stats import chisquare

    from verify import speculative_generate
    from verify.rejection import warp_probs

    generator = torch.Generator().manual_seed(seed)
    samples, accepted = [], 0
    for _ in range(batches):
        out = speculative_generate(target, drafter, torch.tensor(prompt).expand(rows, -1).contiguous(),
                                   max_new_tokens=length, temperature=1.0, generator=generator)
        samples += [tuple(t) for t in out.new_tokens]
        accepted += sum(out.accept_histogram[1:])
    vocab = target.config.vocab_size
    conts = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (V^length, length)
    with torch.no_grad():
        logits = target(torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], 1)).logits
    logits = logits[:, len(prompt) - 1:-1]  # (N, length, V): the distribution of each continuation token
    probs = warp_probs(logits, 1.0).gather(-1, conts.unsqueeze(-1)).squeeze(-1).prod(-1).double()
    index = {tuple(c): i for i, c in enumerate(conts.tolist())}
    counts = torch.bincount(torch.tensor([index[t] for t in samples]), minlength=len(conts)).double()
    big = probs * len(samples) >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([probs[big], probs[~big].sum().view(1)]) * len(samples)
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue), accepted


@pytest.fixture
def make_target():
    """The :func:`tiny_target` builder."""
    return tiny_target


@pytest.fixture
def make_prompts():
    """The :func:`left_padded_prompts` builder."""
    return left_padded_prompts


def fake_vllm_env(root, script: str = "exit 0"):
    """A stand-in vLLM environment: a vllm package file and a ``bin/python`` running ``script``."""
    (root / "lib" / "python3.11" / "site-packages" / "vllm").mkdir(parents=True)
    (root / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py").write_text("")
    (root / "bin").mkdir()
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\n" + script + "\n")
    python.chmod(0o755)
    return root
