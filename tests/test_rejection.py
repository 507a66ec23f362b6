"""warp_probs, sample_tokens and verify_block on synthetic distributions."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from verify import sample_tokens, verify_block, verify_greedy, warp_probs


def random_probs(*shape, seed=0, sharpness=2.0):
    generator = torch.Generator().manual_seed(seed)
    return (sharpness * torch.randn(*shape, generator=generator)).softmax(-1)


def gof_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of sampled ``tokens`` against the distribution ``probs`` (V,)."""
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support].double() * len(tokens)
    return float(chisquare(observed[support], expected * observed.sum() / expected.sum()).pvalue)


# ----------------------------------------------------------------------------- warp_probs


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, None, None), (1.3, 5, None),
                                                       (0.8, None, 0.6), (0.9, 7, 0.8), (1.0, 50, 0.95)])
def test_warp_probs_matches_hf_logits_processors(temperature, top_k, top_p):
    logits = 3 * torch.randn(6, 20, generator=torch.Generator().manual_seed(0))
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    probs = warp_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, scores.softmax(-1))
    if top_k is not None:
        assert ((probs > 0).sum(-1) <= top_k).all()


def test_warp_probs_greedy_and_shapes():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = warp_probs(logits, temperature=0.0, top_k=3, top_p=0.5)
    assert probs.shape == (2, 3, 11) and probs.dtype == torch.float32
    assert torch.equal(probs.argmax(-1), logits.float().argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(2, 3))
    assert ((probs == 0) | (probs == 1)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_warp_probs_rejects_non_finite_logits(bad):
    logits = torch.zeros(2, 5)
    logits[1, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        warp_probs(logits)


@pytest.mark.parametrize("kwargs, match", [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"),
                                           ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_warp_probs_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        warp_probs(torch.zeros(3, 4), **kwargs)


# ----------------------------------------------------------------------------- sample_tokens


def test_sample_tokens_distribution_and_zero_weights():
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 6.0])  # unnormalised on purpose
    tokens = sample_tokens(weights.expand(40000, -1), torch.Generator().manual_seed(0))
    assert gof_pvalue(tokens, weights / weights.sum()) > 1e-3
    one_hot = torch.nn.functional.one_hot(torch.tensor([4, 0, 2]), 5).float()
    assert sample_tokens(one_hot).tolist() == [4, 0, 2]


# ----------------------------------------------------------------------------- verify_block


def test_q_equal_p_accepts_everything():
    B, K, V = 500, 4, 10
    p = random_probs(B, K + 1, V, seed=1)
    generator = torch.Generator().manual_seed(0)
    drafts = sample_tokens(p[:, :K], generator)  # (B, K) drawn from q = p
    num_accepted, bonus = verify_block(drafts, p[:, :K].clone(), p, generator)
    assert (num_accepted == K).all() and bonus.shape == (B,)
    # Deterministic drafts that the target itself would choose (p one-hot at the draft): all accepted.
    greedy = torch.nn.functional.one_hot(drafts, V).float()
    p_greedy = torch.cat([greedy, p[:, K:]], dim=1)
    num_accepted, _ = verify_block(drafts, None, p_greedy, generator)
    assert (num_accepted == K).all()


def test_disjoint_supports_accept_nothing():
    B, K, V = 400, 3, 8
    q = torch.zeros(B, K, V)
    q[..., :4] = random_probs(B, K, 4, seed=2)  # q lives on tokens 0..3
    p = torch.zeros(B, K + 1, V)
    p[..., 4:] = random_probs(B, K + 1, 4, seed=3)  # p lives on tokens 4..7
    generator = torch.Generator().manual_seed(0)
    drafts = sample_tokens(q, generator)
    num_accepted, correction = verify_block(drafts, q, p, generator)
    assert (num_accepted == 0).all()
    assert (correction >= 4).all()
    num_accepted, correction = verify_block(drafts, None, p, generator)  # deterministic drafts too
    assert (num_accepted == 0).all() and (correction >= 4).all()


@pytest.mark.parametrize("deterministic", [False, True])
def test_first_emitted_token_is_distributed_as_p0(deterministic):
    """For arbitrary p and q, the first emitted token (d_1 if accepted, else the correction) ~ p_0."""
    B, K, V = 60000, 2, 6
    p0 = torch.tensor([0.05, 0.30, 0.0, 0.15, 0.40, 0.10])
    q1 = torch.tensor([0.40, 0.05, 0.25, 0.10, 0.10, 0.10])
    generator = torch.Generator().manual_seed(0)
    p = torch.cat([p0.expand(B, 1, V), random_probs(B, K, V, seed=4)], dim=1)  # (B, K + 1, V)
    q = torch.cat([q1.expand(B, 1, V), random_probs(B, K - 1, V, seed=5)], dim=1)
    drafts = sample_tokens(q, generator)
    if deterministic:  # the same drafts, declared deterministic: q is one-hot at each row's draft
        q = None
    num_accepted, next_token = verify_block(drafts, q, p, generator)
    first = torch.where(num_accepted > 0, drafts[:, 0], next_token)
    assert 0 < (num_accepted > 0).float().mean() < 1
    assert gof_pvalue(first, p0) > 1e-3
    # The wrong rule "after a rejection, sample from p" is caught by the same statistic.
    wrong = torch.where(num_accepted > 0, drafts[:, 0], sample_tokens(p[:, 0], generator))
    assert gof_pvalue(wrong, p0) < 1e-6


def test_second_token_given_first_accepted():
    """Conditioned on d_1 accepted, the second emitted token ~ p_1 (left-to-right exactness)."""
    B = 80000
    p = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2], [0.5, 0.1, 0.0, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.1, 0.6, 0.1, 0.1]])
    generator = torch.Generator().manual_seed(0)
    drafts = sample_tokens(q.expand(B, -1, -1), generator)
    num_accepted, next_token = verify_block(drafts, q.expand(B, -1, -1), p.expand(B, -1, -1), generator)
    assert (num_accepted >= 1).all()  # q_1 = p_0
    second = torch.where(num_accepted > 1, drafts[:, 1], next_token)
    assert gof_pvalue(second, p[1]) > 1e-3


def test_residual_zero_falls_back_to_p_and_k0_samples_p0():
    # Greedy target (p_0 one-hot at 2), deterministic draft 3: rejected, the residual is p_0 itself.
    p = torch.nn.functional.one_hot(torch.tensor([[2, 1]]), 4).float()  # (1, 2, 4)
    num_accepted, token = verify_block(torch.tensor([[3]]), None, p)
    assert num_accepted.tolist() == [0] and token.tolist() == [2]
    # q_1 = p_0 exactly, so the residual max(0, p_0 - q_1) is all zero: the token comes from p_0.
    # (The draft has probability 0 under both, which forces the rejection.)
    p0 = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    num_accepted, token = verify_block(torch.tensor([[3]]), p0[:, :1].clone(), p0)
    assert num_accepted.tolist() == [0] and token.item() in (0, 1)
    # K = 0: plain sampling from p_0.
    probs = torch.tensor([0.1, 0.6, 0.3])
    num_accepted, token = verify_block(torch.zeros(30000, 0, dtype=torch.long), None,
                                       probs.expand(30000, 1, 3), torch.Generator().manual_seed(0))
    assert (num_accepted == 0).all() and gof_pvalue(token, probs) > 1e-3


def test_rows_are_independent_and_greedy_is_deterministic():
    """Batched rows get their own counts; temperature 0 (one-hot p) needs no randomness."""
    V = 7
    targets = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [6, 2, 3, 4]])  # greedy tokens per slot
    p = torch.nn.functional.one_hot(targets, V).float()  # (3, 4, V)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    for seed in range(3):
        num_accepted, token = verify_block(drafts, None, p, torch.Generator().manual_seed(seed))
        assert num_accepted.tolist() == [3, 1, 0]
        assert token.tolist() == [4, 5, 6]


def test_verify_block_shape_errors():
    p = random_probs(2, 3, 5)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        verify_block(torch.zeros(2, dtype=torch.long), None, p)
    with pytest.raises(ValueError, match="torch.long"):
        verify_block(torch.zeros(2, 2), None, p)
    with pytest.raises(ValueError, match="target_probs"):
        verify_block(torch.zeros(2, 3, dtype=torch.long), None, p)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_block(torch.zeros(2, 2, dtype=torch.long), random_probs(2, 2, 4), p)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        verify_block(torch.full((2, 2), 5, dtype=torch.long), None, p)


def test_verify_greedy_equals_verify_block_at_temperature_zero():
    B, K, V = 300, 4, 6
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(B, K + 1, V, generator=generator)
    greedy = logits.argmax(-1)
    # Drafts that follow the target's argmax for a random number of slots, then deviate.
    drafts = torch.randint(0, V, (B, K), generator=generator)
    follow = torch.rand(B, K, generator=generator) < 0.7
    drafts = torch.where(follow, greedy[:, :K], drafts)
    expected = verify_block(drafts, None, warp_probs(logits, 0.0), generator)
    q = random_probs(B, K, V, seed=9)  # any q gives the same result when p is one-hot
    assert all(torch.equal(a, b) for a, b in zip(verify_greedy(drafts, logits), expected))
    assert all(torch.equal(a, b) for a, b in zip(verify_block(drafts, q, warp_probs(logits, 0.0)), expected))
    assert 0 < expected[0].float().mean() < K
    bad = logits.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        verify_greedy(drafts, bad)
