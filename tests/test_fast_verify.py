"""The verifier's fast paths are exact: in-place KV cache, lazy LM head, drafter buffers, truncated drafts."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, sampled_continuations_pvalue, tiny_target
from transformers.cache_utils import DynamicLayer

from drafters import DraftingPolicy, PolicyDrafter, factory
from drafters.policy import confident_width
from experiments.bench.profiling import Variant, profile_decode, summarize_steps
from verify import AssistantDrafter, speculative_generate, target_generate, verify_greedy
from verify.generate import _is_plain_head
from verify.hf import new_growing_kv_cache
from verify.kv_cache import GrowingLayer
from verify.target_pass import verify_greedy_lazy


def hf_greedy(target, ids, mask, max_new_tokens, eos_token_id=None):
    with torch.no_grad():
        return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id, pad_token_id=0)


# ----------------------------------------------------------------------------- in-place KV cache


def test_growing_layer_matches_dynamic_layer():
    """Appends, crops and row selections give the keys/values DynamicLayer's concatenation gives."""
    generator = torch.Generator().manual_seed(0)
    grow, plain = GrowingLayer(reserve=3), DynamicLayer()
    batch = 4
    for step, (n, crop, select) in enumerate([(5, 0, None), (4, -2, None), (1, 0, [3, 0, 1]), (30, -7, [2, 0]),
                                              (3, -3, None), (2, 0, None)]):
        k = torch.randn(batch, 2, n, 8, generator=generator)
        v = torch.randn(batch, 2, n, 6, generator=generator)  # value width may differ from the keys'
        got, ref = grow.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), step
        grow.crop(crop)
        plain.crop(crop)
        if select is not None:
            rows = torch.tensor(select)
            grow.batch_select_indices(rows)
            plain.batch_select_indices(rows)
            batch = len(select)
        assert grow.get_seq_length() == plain.get_seq_length()
        assert torch.equal(grow.keys, plain.keys) and torch.equal(grow.values, plain.values)
        # a reader sharing the cache (a drafter) asks for room and writes scratch columns past the end
        end = grow.get_seq_length()
        grow.ensure_capacity(end + 40)
        assert grow.buffers[0].shape[-2] >= end + 40 and torch.equal(grow.keys, plain.keys)
        grow.buffers[0][..., end : end + 40, :] = float("nan")
        grow.buffers[1][..., end : end + 40, :] = float("nan")
    grow.reset()
    assert grow.get_seq_length() == 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_new_cache_appends_in_place(family):
    target = tiny_target(family, vocab_size=64, seed=1)
    cache = new_growing_kv_cache(target, reserve=8)
    assert cache.layers and all(type(layer) is GrowingLayer for layer in cache.layers)


# ----------------------------------------------------------------------------- lazy LM head


@pytest.mark.parametrize("width, first", [(0, 1), (1, 1), (5, 1), (5, 2), (5, 3), (15, 3), (15, 16)])
def test_lazy_greedy_verification_equals_verify_greedy(width, first):
    generator = torch.Generator().manual_seed(width * 17 + first)
    batch, hidden, vocab = 64, 12, 9
    head = torch.nn.Linear(hidden, vocab, bias=False)
    torch.nn.init.normal_(head.weight, generator=generator)
    final = torch.randn(batch, width + 1, hidden, generator=generator)
    greedy = head(final).argmax(-1)
    # Drafts that follow the target's argmax for a random number of slots (all of them for some rows).
    follow = torch.randint(0, width + 1, (batch, 1), generator=generator) > torch.arange(width)
    drafts = torch.where(follow, greedy[:, :width], torch.randint(0, vocab, (batch, width), generator=generator))
    with torch.no_grad():
        expected = verify_greedy(drafts, head(final))
        got = verify_greedy_lazy(drafts, final, head, first)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    if width:
        assert 0 < expected[0].float().mean() < width


class BiasedLlama(torch.nn.Module):
    """A causal LM whose logits are head(final hidden state) plus a bias (like BART's
    ``final_logits_bias``): the verifier must not apply the head itself."""

    def __new__(cls, vocab_size):
        from transformers import LlamaForCausalLM

        class Biased(LlamaForCausalLM):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                out.logits = out.logits + self.logit_bias.to(out.logits.dtype)
                return out

        base = tiny_target("llama", vocab_size=vocab_size, seed=1)
        model = Biased(base.config).eval()
        model.load_state_dict(base.state_dict())
        model.logit_bias = 3.0 * torch.randn(vocab_size, generator=torch.Generator().manual_seed(4))
        return model


def test_lazy_head_only_for_plain_logits():
    target = tiny_target("llama", vocab_size=64, seed=1)
    head = target.get_output_embeddings()
    final = torch.randn(3, 32)
    with torch.no_grad():
        assert _is_plain_head(head, head(final), final)
        assert not _is_plain_head(head, head(final) + 0.5 * torch.randn(64), final)
        assert not _is_plain_head(head, 2.0 * head(final), final)


@pytest.mark.parametrize("lazy_head", [True, False])
def test_greedy_identity_with_post_processed_logits(lazy_head):
    """Logits that are not plain head(hidden): greedy speculative decoding still equals generate."""
    import verify.generate as generate_module

    target = BiasedLlama(64)
    torch.manual_seed(7)
    drafter = factory.from_target(target, block_size=4)
    ids, mask = left_padded_prompts([6, 3, 8], 64, seed=1)
    ref = hf_greedy(target, ids, mask, 20)
    attention_mask = generate_module._check_inputs(target, ids, mask, 20, 64)
    decoded = generate_module._decode(target, drafter, ids, attention_mask, 20, 0.0, None, None,
                                      generate_module._eos_tensor(None, ids.device), None, lazy_head=lazy_head)
    assert [list(map(int, row[ids.shape[1]:])) for row in ref] == decoded.new_tokens


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_lazy_and_full_head_agree(family):
    import verify.generate as generate_module

    target = tiny_target(family, vocab_size=64, seed=1)
    drafter = AssistantDrafter(target, 4)  # accepts everything: several chunks per step
    ids, mask = left_padded_prompts([6, 3, 8], 64, seed=2)
    attention_mask = generate_module._check_inputs(target, ids, mask, 19, 64)
    eos = generate_module._eos_tensor(2, ids.device)
    runs = [generate_module._decode(target, drafter, ids, attention_mask, 19, 0.0, None, None, eos, None,
                                    lazy_head=lazy) for lazy in (True, False)]
    assert runs[0].new_tokens == runs[1].new_tokens and runs[0].accepted_counts == runs[1].accepted_counts


# ----------------------------------------------------------------------------- drafter buffers


def _prefill(target, drafter, ids, mask):
    with torch.no_grad():
        states = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    drafter.reset(ids.shape[0])
    drafter.extend(ids, mask, pos, [states[i] for i in drafter.target_layer_ids])
    return mask.sum(1)


def test_drafter_select_rows_and_buffer_growth():
    target = tiny_target("llama", vocab_size=64, seed=1)
    torch.manual_seed(3)
    drafter = factory.from_target(target, block_size=5)
    ids, mask = left_padded_prompts([9, 4, 7], 64, seed=3)
    anchors = torch.tensor([5, 6, 7])
    _prefill(target, drafter, ids, mask)
    drafter.select_rows(torch.tensor([2, 0]))
    got = drafter.draft_logits(anchors[[2, 0]], mask.sum(1)[[2, 0]])
    _prefill(target, drafter, ids[[2, 0]], mask[[2, 0]])
    torch.testing.assert_close(got, drafter.draft_logits(anchors[[2, 0]], mask.sum(1)[[2, 0]]))
    # Many one-column extends: the buffers grow past their first capacity, nothing is lost.
    long_ids, long_mask = left_padded_prompts([100], 64, seed=4)
    with torch.no_grad():
        states = target(long_ids, output_hidden_states=True).hidden_states
    drafter.reset(1)
    for c in range(100):
        drafter.extend(long_ids[:, c : c + 1], long_mask[:, c : c + 1], torch.tensor([[c]]),
                       [states[i][:, c : c + 1] for i in drafter.target_layer_ids])
    step_by_step = drafter.draft_logits(torch.tensor([5]), torch.tensor([100]))
    _prefill(target, drafter, long_ids, long_mask)
    torch.testing.assert_close(step_by_step, drafter.draft_logits(torch.tensor([5]), torch.tensor([100])))


def test_drafter_reused_outside_inference_mode():
    """Buffers made inside speculative_generate (inference mode) are replaced, not written, outside it."""
    target = tiny_target("llama", vocab_size=64, seed=1)
    drafter = factory.from_target(target, block_size=4)
    ids, mask = left_padded_prompts([5], 64, seed=5)
    speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=3)
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    drafter.extend(ids, mask, torch.arange(5).view(1, 5), [states[i] for i in drafter.target_layer_ids])
    assert torch.isfinite(drafter.draft_logits(ids[:, -1], torch.tensor([9]))).all()


# ----------------------------------------------------------------------------- confidence-truncated drafts


@pytest.mark.parametrize("threshold, expected_width", [(0.0, 11), (0.55, 8), (0.62, 1), (0.7, 0), (1.1, 0)])
def test_confident_logits_equal_truncated_full_logits(threshold, expected_width):
    target = tiny_target("llama", vocab_size=64, seed=1, init_range=0.6)
    torch.manual_seed(2)
    drafter = factory.from_target(target, block_size=12)
    ids, mask = left_padded_prompts([9, 4, 7, 6], 64, seed=6)
    pos = _prefill(target, drafter, ids, mask)
    anchors = torch.tensor([5, 6, 7, 8])
    full = drafter.draft_logits(anchors, pos)
    cut = PolicyDrafter(drafter, DraftingPolicy(confidence_threshold=threshold)) if 0 < threshold < 1 else None
    width = confident_width(full, threshold)
    for guess in (0.0, 3.0, 20.0) if cut else ():  # whatever the first chunk, the same width and logits
        cut.width_mean = guess
        got = cut.confident_logits(drafter.block_states(drafter.block_inputs(anchors, pos)))
        assert got.shape[1] == width
        torch.testing.assert_close(got, full[:, :width])
        tokens, q = cut.draft(anchors, pos)
        assert tokens.shape == (4, width) and q is None
    assert width == expected_width  # top-1 probabilities of this random drafter lie in 0.30..0.74


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("threshold", [0.03, 0.1, 1.1])
def test_truncated_drafts_keep_greedy_identity(family, threshold):
    target = tiny_target(family, vocab_size=64, seed=1)
    torch.manual_seed(7)
    drafter = PolicyDrafter(factory.from_target(target, block_size=6),
                            DraftingPolicy(confidence_threshold=min(threshold, 0.999)))
    ids, mask = left_padded_prompts([6, 3, 8], 64, seed=1)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=2)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 20, eos_token_id=2))
    if threshold > 1:  # (0.999 here: above any top-1 probability of this drafter) nothing is drafted: one per step
        assert all(c == 0 for counts in out.accepted_counts for c in counts)
        assert out.num_target_forwards == out.num_new_tokens


@pytest.mark.parametrize("width", [1, 4])
def test_max_draft_tokens_drafts_the_first_slots_and_keeps_greedy_identity(width):
    """max_draft_tokens = W: the drafts are the first W slots of the full block (tokens and q), no step
    accepts more than W, and the output is still the target's greedy output."""
    target = tiny_target("llama", vocab_size=64, seed=1)
    torch.manual_seed(7)
    drafter = factory.from_target(target, block_size=8)
    ids, mask = left_padded_prompts([6, 3, 8], 64, seed=1)
    pos = _prefill(target, drafter, ids, mask)
    anchors = torch.tensor([5, 6, 7])
    full_tokens, _ = drafter.draft(anchors, pos)
    full_q = drafter.draft(anchors, pos, temperature=1.0, generator=torch.Generator().manual_seed(0))[1]
    drafter = PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=width))
    tokens, _ = drafter.draft(anchors, pos)
    q = drafter.draft(anchors, pos, temperature=1.0, generator=torch.Generator().manual_seed(0))[1]
    assert torch.equal(tokens, full_tokens[:, :width]) and q.shape == (3, width, 64)
    torch.testing.assert_close(q, full_q[:, :width])
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=2)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 20, eos_token_id=2))
    assert max(c for counts in out.accepted_counts for c in counts) <= width
    assert width * (out.num_batched_forwards - 2) <= out.num_verified_slots <= width * out.num_batched_forwards


@pytest.mark.parametrize("width", [0, 8])
def test_max_draft_tokens_out_of_range_is_refused(width):
    target = tiny_target("llama", vocab_size=64, seed=1)
    drafter = factory.from_target(target, block_size=8)  # K = 7
    with pytest.raises(ValueError, match=rf"max_draft_tokens={width}: must be in 1..7"):
        PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=width))


class ConfidentPrefix:
    """Wraps a sampling drafter: keeps the leading drafts whose q has a top-1 probability >= threshold
    (the widest prefix over rows), the rule of ``DraftingPolicy.confidence_threshold``."""

    def __init__(self, inner, threshold):
        self.inner, self.threshold = inner, threshold
        self.num_draft_tokens, self.vocab_size = inner.num_draft_tokens, inner.vocab_size
        self.target_layer_ids = inner.target_layer_ids
        self.widths = []

    def reset(self, batch_size):
        self.inner.reset(batch_size)

    def extend(self, *args):
        self.inner.extend(*args)

    def select_rows(self, rows):
        self.inner.select_rows(rows)

    def draft(self, anchor_ids, anchor_position_ids, **sampling):
        tokens, q = self.inner.draft(anchor_ids, anchor_position_ids, **sampling)
        confident = (q.amax(-1) >= self.threshold).long().cumprod(-1).sum(-1)
        width = int(confident.max())
        self.widths.append(width)
        return tokens[:, :width], q[:, :width]


@pytest.mark.slow
def test_truncated_sampled_drafts_keep_the_target_distribution():
    """Chi-square of 3-token continuations against the target's exact distribution at T = 1, with
    drafts cut to a confident prefix (batches of 40 rows, so that the shared width varies)."""
    vocab, length, batches, rows = 8, 3, 100, 40
    target = tiny_target("llama", vocab_size=vocab, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    assistant = tiny_target("llama", vocab_size=vocab, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in assistant.parameters():
            weight.add_(0.1 * weight.std() * torch.randn(weight.shape, generator=noise))
    drafter = ConfidentPrefix(AssistantDrafter(assistant, 3), threshold=0.7)
    pvalue, accepted = sampled_continuations_pvalue(target, drafter, [5, 3, 6, 4], length, batches, rows)
    assert {0, 3} <= set(drafter.widths) and accepted > 0  # truncation and acceptance both happen
    assert pvalue > 1e-3


# ----------------------------------------------------------------------------- step profile


def test_profile_decode_partitions_each_step():
    target = tiny_target("llama", vocab_size=64, seed=1)
    drafter = factory.from_target(target, block_size=4)
    ids, mask = left_padded_prompts([6, 9], 64, seed=1)
    wall, cpu = profile_decode(target, Variant(drafter), ids, mask, max_new_tokens=12, skip=1)
    assert len(wall) == len(cpu) > 0
    for step in wall:
        assert {"draft", "target_forward", "verify", "bookkeeping", "crop", "drafter_extend"} <= set(step)
        assert "draft_states@draft" in step and step["draft_states@draft"] <= step["draft"] + 1e-6
    summary = summarize_steps(wall)
    assert {"total_ms", "draft_ms", "verify_ms", "lm_head@verify_ms"} <= set(summary)
    base_wall, _ = profile_decode(target, Variant(), ids, mask, max_new_tokens=6, skip=0)
    assert all("draft" not in s and "target_forward" in s for s in base_wall)
    # target-only decoding through the same loop is unaffected by the profile
    assert target_generate(target, ids, attention_mask=mask, max_new_tokens=6).num_new_tokens == 12
