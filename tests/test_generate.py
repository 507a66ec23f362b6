"""speculative_generate / target_generate: greedy identity with HF generate, exact sampling, errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import left_padded_prompts, tiny_target
from scipy.stats import chisquare

import verify.generate as generate_module
from verify import AssistantDrafter, speculative_generate, target_generate, truncated_copy, warp_probs
from verify.rejection import sample_tokens
from verify.rejection import verify_block as correct_verify_block

# ----------------------------------------------------------------------------- helpers


def hf_greedy(target, input_ids, attention_mask, max_new_tokens, eos_token_id=None):
    """Reference greedy decoding by ``target.generate``: (sequences, new token lists, min argmax margin)."""
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos_token_id  # None must really mean "no EOS"
    try:
        out = target.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    finally:
        target.generation_config.eos_token_id = saved
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    new_tokens = []
    for row in out.sequences[:, input_ids.shape[1] :].tolist():
        stop = next((i for i, tok in enumerate(row) if tok in eos), len(row) - 1)
        new_tokens.append(row[: stop + 1])
    # Smallest top-1/top-2 logit gap over every (row, step) the row was still running: a near tie
    # could flip between the one-token and the block forward, which would not be a verifier bug.
    top2 = torch.stack(out.logits, dim=1).topk(2, dim=-1).values  # (B, steps, 2)
    gaps = top2[..., 0] - top2[..., 1]
    margin = min(float(gaps[b, : len(toks)].min()) for b, toks in enumerate(new_tokens))
    return out.sequences, new_tokens, margin


class HiddenStateDrafter:
    """A deterministic test drafter whose drafts are a function of the target hidden states it got.

    It records every column handed to ``extend`` (following ``select_rows``), so a test can check
    the hidden-state plumbing against a fresh forward pass. Drafts: copy the anchor when a random
    projection of the last committed hidden state is positive (random tiny models loop, so copies
    are often accepted), else the argmax of a random linear map of that hidden state.
    """

    def __init__(self, hidden_size, vocab_size, num_draft_tokens, target_layer_ids, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.num_draft_tokens = num_draft_tokens
        self.target_layer_ids = tuple(target_layer_ids)
        self.vocab_size = vocab_size
        self.maps = torch.randn(len(target_layer_ids), hidden_size, num_draft_tokens, vocab_size, generator=generator)
        self.gate = torch.randn(hidden_size, generator=generator)

    def reset(self, batch_size):
        self.rows = list(range(batch_size))
        self.archive = {}
        self.ids = torch.zeros(batch_size, 0, dtype=torch.long)
        self.mask = self.ids.clone()
        self.pos = self.ids.clone()
        self.hidden = None

    def extend(self, input_ids, attention_mask, position_ids, hidden_states):
        assert len(hidden_states) == len(self.target_layer_ids)
        for h in hidden_states:
            assert h.shape[:2] == input_ids.shape
        self.ids = torch.cat([self.ids, input_ids], 1)
        self.mask = torch.cat([self.mask, attention_mask], 1)
        self.pos = torch.cat([self.pos, position_ids], 1)
        if self.hidden is None:
            self.hidden = [h.clone() for h in hidden_states]
        else:
            self.hidden = [torch.cat([old, new], 1) for old, new in zip(self.hidden, hidden_states)]

    def select_rows(self, rows):
        for i, row in enumerate(self.rows):
            if i not in rows.tolist():
                self.archive[row] = self._row(i)
        self.rows = [self.rows[i] for i in rows.tolist()]
        self.ids, self.mask, self.pos = self.ids[rows], self.mask[rows], self.pos[rows]
        self.hidden = [h[rows] for h in self.hidden]

    def _row(self, i):
        return self.ids[i], self.mask[i], self.pos[i], [h[i] for h in self.hidden]

    def columns(self):
        """Every row's received columns: {row: (ids, mask, pos, hidden list)}."""
        return {**self.archive, **{row: self._row(i) for i, row in enumerate(self.rows)}}

    def draft(self, anchor_ids, anchor_position_ids, **sampling):
        # The anchor's position is the number of committed columns received so far.
        assert torch.equal(anchor_position_ids, self.mask.sum(1))
        batch, width = self.ids.shape
        last = (self.mask * torch.arange(width)).argmax(1) if width else torch.zeros(batch, dtype=torch.long)
        scores = torch.zeros(batch, self.num_draft_tokens, self.vocab_size)
        summary = torch.zeros(batch, self.gate.shape[0])
        for layer, h in enumerate(self.hidden):
            h_last = h[torch.arange(batch), last] if width else torch.zeros(batch, h.shape[-1])  # (B, H)
            scores += torch.einsum("bh,hkv->bkv", h_last, self.maps[layer])
            summary += h_last
        copy = (summary @ self.gate > 0).unsqueeze(1)  # (B, 1)
        drafts = torch.where(copy, anchor_ids.unsqueeze(1), scores.argmax(-1))
        return drafts, None


def make_drafter(kind, target, family, K):
    if kind == "truncated":
        return AssistantDrafter(truncated_copy(target, 1), K)
    if kind == "self":
        return AssistantDrafter(target, K)
    if kind == "other":
        other = {"llama": "gpt2", "gpt2": "qwen2", "qwen2": "llama"}[family]
        return AssistantDrafter(tiny_target(other, target.config.vocab_size, seed=7), K)
    if kind == "hidden":
        layers = target.config.num_hidden_layers
        return HiddenStateDrafter(target.config.hidden_size, target.config.vocab_size, K, (1, layers))
    raise ValueError(kind)


def check_greedy(target, drafter, lengths, max_new_tokens, eos_token_id=None, seed=0):
    input_ids, attention_mask = left_padded_prompts(lengths, target.config.vocab_size, seed=seed)
    ref_seq, ref_new, margin = hf_greedy(target, input_ids, attention_mask, max_new_tokens, eos_token_id)
    assert margin > 1e-4, f"near-tie in the reference (margin {margin}); pick another seed"
    out = speculative_generate(
        target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
    )
    assert out.new_tokens == ref_new
    assert torch.equal(out.sequences, ref_seq)
    # Statistics count kept tokens only.
    assert out.num_new_tokens == sum(map(len, ref_new))
    for counts, new in zip(out.accepted_counts, out.new_tokens):
        assert sum(counts) + len(counts) >= len(new) >= sum(counts)
    assert out.target_forwards_per_row == [len(c) for c in out.accepted_counts]
    assert out.tau == pytest.approx(out.num_new_tokens / out.num_target_forwards)
    return out, input_ids, attention_mask


# ----------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("lengths", [[6], [5, 2, 9]])
def test_greedy_matches_hf_generate(family, K, lengths):
    target = tiny_target(family, vocab_size=64, seed=1)
    out, _, _ = check_greedy(target, make_drafter("truncated", target, family, K), lengths, max_new_tokens=20)
    assert len(out.accept_histogram) == K + 1


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("kind", ["self", "other"])
def test_greedy_with_perfect_and_unrelated_drafters(family, kind):
    target = tiny_target(family, vocab_size=64, seed=1)
    out, _, _ = check_greedy(target, make_drafter(kind, target, family, 4), [5, 2, 9], max_new_tokens=21)
    if kind == "self":  # every draft accepted: blocks of K + 1 = 5, the cap truncating the last one
        assert out.accepted_counts == [[4, 4, 4, 4, 1]] * 3
        assert out.accept_histogram == [0, 3, 0, 0, 12]
        assert out.tau == pytest.approx(21 / 5)


def test_greedy_through_verify_block(monkeypatch):
    """The temperature-0 fast path (verify_greedy) and verify_block on one-hot p agree end to end."""
    target = tiny_target("qwen2", vocab_size=64, seed=1)
    input_ids, attention_mask = left_padded_prompts([5, 2, 9], 64)
    kwargs = {"attention_mask": attention_mask, "max_new_tokens": 19, "eos_token_id": 2}
    fast = speculative_generate(target, make_drafter("truncated", target, "qwen2", 3), input_ids, **kwargs)

    def via_verify_block(draft_tokens, target_logits):
        return generate_module.verify_block(draft_tokens, None, warp_probs(target_logits, 0.0))

    monkeypatch.setattr(generate_module, "verify_greedy", via_verify_block)
    slow = speculative_generate(target, make_drafter("truncated", target, "qwen2", 3), input_ids, **kwargs)
    assert slow.new_tokens == fast.new_tokens and slow.accepted_counts == fast.accepted_counts


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_token_prompts(family):
    """Prompts that are only an anchor: no prefill, the drafter starts from an empty context."""
    target = tiny_target(family, vocab_size=64, seed=1)
    check_greedy(target, make_drafter("truncated", target, family, 3), [1, 1], max_new_tokens=12)
    check_greedy(target, make_drafter("hidden", target, family, 3), [1], max_new_tokens=12)


def test_sliding_window_target_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0)
    target = Qwen2ForCausalLM(config).eval()
    input_ids, _ = left_padded_prompts([4], 64)
    with pytest.raises(ValueError, match="sliding-window"):
        target_generate(target, input_ids, max_new_tokens=3)


def test_target_generate_matches_hf_generate():
    target = tiny_target("llama", vocab_size=64, seed=1)
    input_ids, attention_mask = left_padded_prompts([5, 2, 9], 64)
    ref_seq, ref_new, _ = hf_greedy(target, input_ids, attention_mask, 17)
    out = target_generate(target, input_ids, attention_mask=attention_mask, max_new_tokens=17)
    assert out.new_tokens == ref_new and torch.equal(out.sequences, ref_seq)
    assert out.num_target_forwards == 3 * 17 and out.num_new_tokens == 3 * 17


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_eos_inside_a_block(family):
    target = tiny_target(family, vocab_size=64, seed=1)
    K = 4
    input_ids, attention_mask = left_padded_prompts([6], 64, seed=1)
    _, (free_run,), _ = hf_greedy(target, input_ids, attention_mask, 30)
    # EOS := the first token whose first occurrence is at index >= 5 and not at a block end.
    position = next(i for i, tok in enumerate(free_run) if i >= 5 and i % (K + 1) != K and tok not in free_run[:i])
    eos = free_run[position]
    unused = next(tok for tok in range(3, 64) if tok not in free_run)
    out, _, _ = check_greedy(target, AssistantDrafter(target, K), [6], 30, eos_token_id=[unused, eos], seed=1)
    assert out.new_tokens[0] == free_run[: position + 1]
    full_blocks, rest = divmod(position + 1, K + 1)
    assert out.accepted_counts[0] == [K] * full_blocks + [rest]
    assert out.tau == pytest.approx((position + 1) / (full_blocks + 1))
    # Batched: rows hit EOS at different steps and leave the batch; the others continue.
    check_greedy(target, make_drafter("truncated", target, family, K), [6, 3, 8], 30, eos_token_id=eos)


def test_cap_inside_a_block():
    target = tiny_target("llama", vocab_size=64, seed=1)
    out, _, _ = check_greedy(target, AssistantDrafter(target, 4), [6, 4], max_new_tokens=13)
    assert out.accepted_counts == [[4, 4, 3]] * 2
    assert out.accept_histogram == [0, 0, 0, 2, 4]
    assert out.position_acceptance == [1.0, 1.0, 1.0, pytest.approx(4 / 6)]
    assert out.tau == pytest.approx(13 / 3)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("K", [1, 4])
def test_hidden_state_drafter(family, K):
    target = tiny_target(family, vocab_size=64, seed=1)
    drafter = make_drafter("hidden", target, family, K)
    lengths = [5, 1, 9]
    out, input_ids, attention_mask = check_greedy(target, drafter, lengths, max_new_tokens=24, eos_token_id=2)
    assert sum(out.accept_histogram[1:]) > 0, "the test drafter should get some drafts accepted"
    # Every committed column the drafter received carries the target's hidden states at that position.
    for row, (ids, mask, pos, hidden) in drafter.columns().items():
        prompt = input_ids[row][attention_mask[row] == 1].tolist()
        full = prompt + out.new_tokens[row]
        committed = mask == 1
        m = int(committed.sum())
        assert len(prompt) - 1 <= m < len(full)
        assert ids[committed].tolist() == full[:m]
        assert pos[committed].tolist() == list(range(m))
        if m == 0:
            continue
        with torch.no_grad():
            ref = target(torch.tensor([full[:m]]), output_hidden_states=True).hidden_states
        for layer, h in zip(drafter.target_layer_ids, hidden):
            torch.testing.assert_close(h[committed], ref[layer][0], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- sampling exactness

VOCAB = 8
LENGTH = 3
PROMPTS = ([5, 3, 6, 4], [7, 3])  # rows alternate between them (left padding in the batch)
ROWS_PER_PROMPT = 4000


def exact_distribution(target, prompt, temperature, top_k, top_p, eos_token_id=None):
    """{continuation: probability} for the next LENGTH tokens (cut after EOS), by enumeration."""
    conts = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))  # (V^L, L)
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, len(prompt) - 1 : -1]  # (V^L, L, V)
    probs = warp_probs(logits, temperature, top_k, top_p)
    seq_probs = probs.gather(-1, conts.unsqueeze(-1)).squeeze(-1).prod(-1).double()  # (V^L,)
    dist: dict[tuple, float] = {}
    for cont, prob in zip(conts.tolist(), seq_probs.tolist()):
        if eos_token_id is not None and eos_token_id in cont:
            cont = cont[: cont.index(eos_token_id) + 1]
        dist[tuple(cont)] = dist.get(tuple(cont), 0.0) + prob
    return dist


def chi_square_pvalue(samples: list[tuple], dist: dict[tuple, float]) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled. Impossible samples fail."""
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    impossible = [s for s in counts if dist.get(s, 0.0) == 0.0]
    assert not impossible, f"sampled continuations of probability 0: {impossible[:5]}"
    n = len(samples)
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cont, prob in dist.items():
        if prob * n >= 5:
            observed.append(counts.get(cont, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(cont, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    expected = [e * n / sum(expected) for e in expected]
    return float(chisquare(observed, expected).pvalue)


def sample_pvalues(drafter_kind, temperature, top_k, top_p, K, eos_token_id=None, seed=0):
    target = tiny_target("llama", vocab_size=VOCAB, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    # The assistant is the target with 10% weight noise: q resembles p but differs, so rejections,
    # partial and full accepts all occur often.
    assistant = tiny_target("llama", vocab_size=VOCAB, seed=11, hidden_size=16, num_layers=1, init_range=0.6)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in assistant.parameters():
            weight.add_(0.1 * weight.std() * torch.randn(weight.shape, generator=noise))
    drafter = AssistantDrafter(assistant, K, deterministic=drafter_kind == "deterministic")
    input_ids, attention_mask = left_padded_prompts([len(p) for p in PROMPTS] * ROWS_PER_PROMPT, VOCAB)
    for row in range(len(PROMPTS)):
        input_ids[row :: len(PROMPTS), -len(PROMPTS[row]) :] = torch.tensor(PROMPTS[row])
    out = speculative_generate(
        target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=LENGTH,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
        generator=torch.Generator().manual_seed(seed),
    )
    # All three outcomes must occur: a rejection, a partial accept and a full accept.
    assert out.accept_histogram[0] > 0 and out.accept_histogram[1] > 0 and out.accept_histogram[K] > 0
    pvalues = []
    for row, prompt in enumerate(PROMPTS):
        samples = [tuple(t) for t in out.new_tokens[row :: len(PROMPTS)]]
        pvalues.append(chi_square_pvalue(samples, exact_distribution(target, prompt, temperature, top_k, top_p,
                                                                     eos_token_id)))
    return pvalues


@pytest.mark.parametrize("drafter_kind", ["sampled", "deterministic"])
@pytest.mark.parametrize(
    "temperature, top_k, top_p, K, eos",
    [(1.0, None, None, 2, None), (0.7, 6, 0.9, 3, 4)],
)
def test_sampling_matches_target_distribution(drafter_kind, temperature, top_k, top_p, K, eos):
    pvalues = sample_pvalues(drafter_kind, temperature, top_k, top_p, K, eos)
    assert min(pvalues) > 1e-3, pvalues


def _wrong_no_residual(draft_tokens, draft_probs, target_probs, generator=None):
    """Broken verifier: after a rejection, sample from p instead of the residual max(0, p - q)."""
    num_accepted, _ = correct_verify_block(draft_tokens, draft_probs, target_probs, generator)
    p_next = target_probs[torch.arange(len(num_accepted)), num_accepted]
    return num_accepted, sample_tokens(p_next, generator)


def _wrong_ignore_q(draft_tokens, draft_probs, target_probs, generator=None):
    """Broken verifier: accept d_k with probability p(d_k), ignoring q; else sample from p."""
    return correct_verify_block(draft_tokens, torch.ones_like(draft_probs), target_probs, generator)


@pytest.mark.parametrize(
    "wrong_rule, drafter_kind",
    [(_wrong_no_residual, "sampled"), (_wrong_no_residual, "deterministic"), (_wrong_ignore_q, "sampled")],
)
def test_wrong_rule_is_detected(monkeypatch, wrong_rule, drafter_kind):
    """Sanity check of the statistic: the same test rejects a deliberately wrong verifier."""
    monkeypatch.setattr(generate_module, "verify_block", wrong_rule)
    pvalues = sample_pvalues(drafter_kind, 1.0, None, None, 2)
    assert max(pvalues) < 1e-6, pvalues


# ----------------------------------------------------------------------------- errors


class _FakeDrafter:
    target_layer_ids = ()

    def __init__(self, vocab_size, num_draft_tokens):
        self.vocab_size, self.num_draft_tokens = vocab_size, num_draft_tokens


def test_errors():
    target = tiny_target("llama", vocab_size=64, seed=1, max_positions=32)
    input_ids, attention_mask = left_padded_prompts([5, 3], 64)
    drafter = AssistantDrafter(truncated_copy(target, 1), 2)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        speculative_generate(target, AssistantDrafter(tiny_target("llama", vocab_size=32), 2), input_ids,
                             max_new_tokens=4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        AssistantDrafter(target, 0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, _FakeDrafter(64, 0), input_ids, max_new_tokens=4)
    empty = attention_mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_generate(target, drafter, input_ids, attention_mask=empty, max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty"):
        speculative_generate(target, drafter, input_ids[:, :0], max_new_tokens=4)
    with pytest.raises(ValueError, match="left-padded"):
        speculative_generate(target, drafter, input_ids, attention_mask=attention_mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        speculative_generate(target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=28)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        target_generate(target, input_ids, attention_mask=attention_mask, max_new_tokens=28)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, drafter, input_ids, attention_mask=attention_mask, max_new_tokens=0)
    # The largest allowed length works, for learned positions (GPT-2) too.
    gpt2 = tiny_target("gpt2", vocab_size=64, seed=1, max_positions=32)
    out = speculative_generate(gpt2, AssistantDrafter(gpt2, 8), input_ids, attention_mask=attention_mask,
                               max_new_tokens=27)
    assert [len(t) for t in out.new_tokens] == [27, 27]
    broken = tiny_target("llama", vocab_size=64, seed=1)
    with torch.no_grad():
        broken.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        speculative_generate(broken, AssistantDrafter(truncated_copy(target, 1), 2), input_ids,
                             attention_mask=attention_mask, max_new_tokens=4)
