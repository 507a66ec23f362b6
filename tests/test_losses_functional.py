"""Tests for losses.functional: hand-computed cases, brute-force loops, gradcheck, Monte Carlo."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from losses import (
    chain_reward,
    chain_surrogate,
    dpace_weights,
    dpace_weights_from_accept,
    first_error_focal,
    first_error_index,
    positional_weights,
    slot_cross_entropy,
    slot_statistics,
)


def random_batch(N=6, K=5, V=7, seed=0, dtype=torch.float32, holes=True):
    """Random logits, labels, a mask with padding (and optionally holes), and soft labels p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, K, V, generator=g, dtype=dtype) * 2
    labels = torch.randint(0, V, (N, K), generator=g)
    lengths = torch.randint(0, K + 1, (N,), generator=g)
    mask = torch.arange(K)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(N, K, generator=g) > 0.2
    mask[0] = True  # at least one full block
    labels = torch.where(mask, labels, -100)  # padding labels must be ignored
    probs = torch.softmax(torch.randn(N, K, V, generator=g, dtype=dtype) * 2, -1)
    return logits, labels, mask, probs


def logits_with_label_probs(q_y: list[list[float]], V: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, K, V) whose softmax gives the label (token 0) probability q_y[n][k]."""
    q = torch.tensor(q_y, dtype=torch.float64)  # (N, K)
    rest = ((1 - q) / (V - 1)).unsqueeze(-1).expand(*q.shape, V - 1)
    probs = torch.cat([q.unsqueeze(-1), rest], -1)
    return probs.log(), torch.zeros(q.shape, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------
# positional weights


def test_positional_weights_values():
    torch.testing.assert_close(positional_weights(4, 2.0), torch.exp(-torch.tensor([0.0, 0.5, 1.0, 1.5])))
    torch.testing.assert_close(positional_weights(4, None, "linear"), torch.tensor([1.0, 0.75, 0.5, 0.25]))
    torch.testing.assert_close(positional_weights(4, 7.0, "linear"), torch.tensor([1.0, 0.75, 0.5, 0.25]))
    for gamma in (None, math.inf):
        torch.testing.assert_close(positional_weights(3, gamma), torch.ones(3))
    torch.testing.assert_close(positional_weights(3, 7.0, "uniform"), torch.ones(3))
    assert positional_weights(15, 7.0)[-1].item() == pytest.approx(math.exp(-2.0))


@pytest.mark.parametrize(
    "args, match", [((4, 1.0, "cosine"), "schedule"), ((4, 0.0), "gamma"), ((0, 1.0), "num_positions")]
)
def test_positional_weights_errors(args, match):
    with pytest.raises(ValueError, match=match):
        positional_weights(*args)


# ---------------------------------------------------------------------------------------------------
# per-slot statistics


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_slot_statistics_match_reference(chunk_size):
    logits, labels, mask, probs = random_batch()
    logits.requires_grad_(True)
    N, K, _V = logits.shape
    g_nll, g_soft, g_acc = torch.randn(3, N, K, generator=torch.Generator().manual_seed(1))
    for accept in ("greedy", "sample"):
        stats = slot_statistics(logits, labels, mask, probs, accept=accept, chunk_size=chunk_size,
                                with_argmax=True, with_correct=True)
        ours = torch.autograd.grad((g_nll * stats.nll + g_soft * stats.soft_ce).sum(), logits, retain_graph=True)[0]
        if accept == "sample":
            ours_acc = torch.autograd.grad((g_acc * stats.log_accept).sum(), logits)[0]

        logq = torch.log_softmax(logits, -1)
        safe = labels.clamp_min(0)
        nll = torch.where(mask, F.cross_entropy(logits.transpose(1, 2), safe, reduction="none"), 0.0)
        soft = torch.where(mask, -(probs * logq).sum(-1), 0.0)
        ref = torch.autograd.grad((g_nll * nll + g_soft * soft).sum(), logits, retain_graph=True)[0]
        torch.testing.assert_close(stats.nll, nll)
        torch.testing.assert_close(stats.soft_ce, soft)
        torch.testing.assert_close(ours, ref)
        assert torch.equal(stats.argmax, logits.argmax(-1))
        assert torch.equal(stats.correct, logits.argmax(-1) == labels.clamp_min(0))
        if accept == "greedy":
            chosen = probs.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
            torch.testing.assert_close(stats.log_accept, torch.where(mask, chosen.log(), 0.0))
        else:
            acc = torch.where(mask, torch.minimum(probs, logq.exp()).sum(-1).log(), 0.0)
            torch.testing.assert_close(stats.log_accept, acc)
            ref_acc = torch.autograd.grad((g_acc * acc).sum(), logits)[0]
            torch.testing.assert_close(ours_acc, ref_acc)


def test_greedy_accept_is_straight_through():
    """Value log p(argmax q); gradient of the surrogate log Σ_v q(v) p(v)."""
    logits, labels, mask, probs = random_batch(seed=3)
    logits.requires_grad_(True)
    g = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    stats = slot_statistics(logits, labels, mask, probs, accept="greedy")
    ours = torch.autograd.grad((g * stats.log_accept).sum(), logits)[0]
    surrogate = torch.where(mask, (torch.softmax(logits, -1) * probs).sum(-1).log(), 0.0)
    ref = torch.autograd.grad((g * surrogate).sum(), logits)[0]
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_and_correct_are_exact_under_ties(dtype):
    """argmax (first index on ties) and argmax == label, with many exact ties (small integer logits,
    bf16 rounding), near-ties and confident rows: both the fast path and the tie fallback are used."""
    g = torch.Generator().manual_seed(12)
    N, K, V = 40, 6, 9
    logits = torch.randint(-2, 3, (N, K, V), generator=g).to(dtype)  # ties everywhere
    logits[:10] += torch.randn(10, K, V, generator=g).to(dtype) * 1e-6  # near-ties
    logits[10:20] = (torch.randn(10, K, V, generator=g) * 8).to(dtype)  # mostly unique, confident maxima
    labels = torch.where(torch.rand(N, K, generator=g) < 0.6, logits.argmax(-1),
                         torch.randint(0, V, (N, K), generator=g))
    # labels at a tied maximum that is not the first one: argmax differs from the label
    tied_second = (logits == logits.amax(-1, keepdim=True)).to(torch.uint8).flip(-1).argmax(-1)
    labels[20:30] = V - 1 - tied_second[20:30]
    expected = logits.argmax(-1)
    for chunk in (5, None):
        fast = slot_statistics(logits, labels, None, with_correct=True, chunk_size=chunk)
        full = slot_statistics(logits, labels, None, with_argmax=True, with_correct=True, chunk_size=chunk)
        assert torch.equal(full.argmax, expected)
        assert torch.equal(fast.correct, expected == labels)
        assert torch.equal(full.correct, expected == labels)
    assert (expected == labels).float().mean().item() > 0.3 and (expected[20:30] != labels[20:30]).any()
    assert fast.argmax is None


def test_slot_statistics_gradcheck():
    logits, labels, mask, probs = random_batch(N=3, K=4, V=5, dtype=torch.float64)
    logits.requires_grad_(True)

    def outputs(x):
        s = slot_statistics(x, labels, mask, probs, accept="sample", chunk_size=5)
        return s.nll, s.soft_ce, s.log_accept

    assert torch.autograd.gradcheck(outputs, (logits,))


def test_slot_cross_entropy_and_bf16():
    logits, labels, mask, probs = random_batch()
    ref = slot_cross_entropy(logits, labels, mask)
    out = slot_cross_entropy(logits.bfloat16(), labels, mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, slot_cross_entropy(logits.bfloat16().float(), labels, mask))
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)
    soft = slot_cross_entropy(logits, labels, mask, target_probs=probs)
    torch.testing.assert_close(soft, torch.where(mask, -(probs * logits.log_softmax(-1)).sum(-1), 0.0))
    # bf16 logits get bf16 gradients computed in float32
    x = logits.bfloat16().requires_grad_(True)
    slot_cross_entropy(x, labels, mask).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_input_errors_name_the_argument():
    logits, labels, mask, probs = random_batch()
    with pytest.raises(ValueError, match="logits"):
        slot_statistics(logits[0], labels, mask)
    with pytest.raises(ValueError, match="labels"):
        slot_statistics(logits, labels[:, :-1], mask)
    with pytest.raises(ValueError, match="mask"):
        slot_statistics(logits, labels, mask[:-1])
    with pytest.raises(ValueError, match="target_probs"):
        slot_statistics(logits, labels, mask, probs[..., :-1])
    with pytest.raises(ValueError, match="target_probs"):
        slot_statistics(logits, labels, mask, accept="greedy")
    with pytest.raises(ValueError, match="accept"):
        slot_statistics(logits, labels, mask, probs, accept="beam")
    bad = labels.clone()
    bad[0, 0] = logits.shape[-1]
    with pytest.raises(ValueError, match="labels at unmasked slots"):
        slot_statistics(logits, bad, mask)
    with pytest.raises(TypeError, match="labels"):
        slot_statistics(logits, labels.float(), mask)


# ---------------------------------------------------------------------------------------------------
# first error


def test_first_error_index_hand():
    V, K = 3, 4
    argmax = torch.tensor([[0, 1, 2, 0], [0, 0, 0, 0], [2, 2, 2, 2], [1, 1, 1, 1], [0, 0, 0, 0]])
    logits = F.one_hot(argmax, V).double() * 5.0  # (5, 4, 3)
    labels = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [1, 2, 2, 2], [1, 0, 1, 1], [1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    # error at slot 2; no error; error at slot 0; the hole at slot 1 is skipped; no valid slot
    assert first_error_index(logits, labels, mask).tolist() == [2, K, 0, K, K]


def test_first_error_index_ties_take_the_first_index():
    logits = torch.zeros(1, 2, 3)  # all tied: argmax is token 0
    assert first_error_index(logits, torch.tensor([[0, 1]]), None).tolist() == [1]
    assert first_error_index(logits, torch.tensor([[1, 0]]), None).tolist() == [0]


def test_first_error_index_matches_loop():
    logits, labels, mask, _ = random_batch(N=40, K=6, V=2, seed=4)
    out = first_error_index(logits, labels, mask)
    pred = logits.argmax(-1)
    for n in range(40):
        expected = next((k for k in range(6) if mask[n, k] and pred[n, k] != labels[n, k]), 6)
        assert out[n].item() == expected
    assert {0, 6} <= set(out.tolist())  # both kinds of block occur


# ---------------------------------------------------------------------------------------------------
# chain surrogate


def test_chain_surrogate_hand():
    logits, labels = logits_with_label_probs([[0.5, 0.4, 0.9], [0.5, 0.4, 0.9], [0.5, 0.4, 0.9], [0.3, 0.2, 0.1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]])
    R = chain_surrogate(logits, labels, mask)
    expected = [
        (0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.9) / 3,
        (0.5 + 0.5 * 0.4) / 2,
        (0.5 + 0.5 * 0.9) / 2,  # the hole at slot 2 counts as accepted and is not counted
        0.0,
    ]
    torch.testing.assert_close(R, torch.tensor(expected, dtype=torch.float64))


def test_chain_surrogate_matches_loop():
    logits, labels, mask, _ = random_batch(N=12, K=6, V=4, seed=5)
    R = chain_surrogate(logits, labels, mask)
    q = torch.softmax(logits.double(), -1)
    for n in range(12):
        total, prefix, valid = 0.0, 1.0, 0
        for k in range(6):
            if mask[n, k]:
                prefix *= q[n, k, labels[n, k]].item()
                total += prefix
                valid += 1
        assert R[n].item() == pytest.approx(total / max(valid, 1), rel=1e-5, abs=1e-7)


def test_chain_surrogate_is_monte_carlo_accepted_fraction():
    """R = E[accepted prefix length] / K_b when slot k is accepted independently w.p. q_k(y_k)."""
    logits, labels, _, _ = random_batch(N=5, K=6, V=3, seed=6)
    labels = labels.clamp_min(0)
    logits = logits.scatter_add(-1, labels.unsqueeze(-1), torch.full((5, 6, 1), 3.0))  # q(y) mostly high
    mask = torch.arange(6)[None, :] < torch.tensor([6, 4, 1, 6, 3])[:, None]
    R = chain_surrogate(logits, labels, mask).double()
    q_y = torch.softmax(logits.double(), -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    g = torch.Generator().manual_seed(7)
    S = 100_000
    accepted = torch.rand(S, 5, 6, generator=g, dtype=torch.float64) < q_y  # (S, N, K)
    accepted |= ~mask  # padding never stops the prefix, and is not counted below
    prefix_len = (torch.cumprod(accepted.double(), -1) * mask).sum(-1)  # (S, N)
    fraction = prefix_len / mask.sum(-1)
    mean, se = fraction.mean(0), fraction.std(0) / math.sqrt(S)
    assert (R - mean).abs().le(4 * se + 1e-12).all(), (R, mean, se)
    assert (R > 0.05).all()  # the test is not vacuous


def test_chain_surrogate_gradcheck():
    logits, labels, mask, _ = random_batch(N=4, K=4, V=3, seed=8, dtype=torch.float64)
    mask[1] = False  # a block with no valid slot
    mask[2] = torch.tensor([True, False, True, True])  # a hole
    labels = labels.clamp_min(0)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: chain_surrogate(x, labels, mask, chunk_size=3), (logits,))


def test_chain_surrogate_numerically_safe():
    # q(y) ≈ e^-200 per slot: the product underflows float32 but the log-space sum does not.
    logits = torch.zeros(3, 4, 5)
    logits[..., 1:] = 200.0
    labels = torch.zeros(3, 4, dtype=torch.long)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2] = False
    logits.requires_grad_(True)
    R = chain_surrogate(logits, labels, mask)
    R.sum().backward()
    assert torch.isfinite(R).all() and R.eq(0).all()
    assert torch.isfinite(logits.grad).all() and logits.grad[2].eq(0).all()
    # log-space reward of a huge but representable block stays exact
    log_a = torch.full((1, 3), -30.0, requires_grad=True)
    r = chain_reward(log_a, torch.ones(1, 3))
    r.backward()
    assert r.item() == pytest.approx(math.exp(-30) / 3, rel=1e-5)
    assert torch.isfinite(log_a.grad).all() and log_a.grad[0, 0] > 0


# ---------------------------------------------------------------------------------------------------
# D-PACE


def test_dpace_weights_hand():
    logits, labels = logits_with_label_probs([[0.5, 0.4, 0.9], [0.5, 0.4, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    w = dpace_weights(logits.requires_grad_(True), labels, mask, alpha=0.5)
    P = [0.75, 0.75 * 0.7, 0.75 * 0.7 * 0.95]
    P_hole = [0.75, 0.75 * 0.95]
    expected = [[P[0] + P[1] + P[2], P[1] + P[2], P[2]], [P_hole[0] + P_hole[1], 0.0, P_hole[1]]]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    assert not w.requires_grad
    # alpha = 1: every factor is 1, w_i counts the valid slots from i on
    w1 = dpace_weights(logits, labels, mask, alpha=1.0)
    torch.testing.assert_close(w1, torch.tensor([[3.0, 2.0, 1.0], [2.0, 0.0, 1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(logits, labels, mask, alpha=1.5)


def test_dpace_weights_match_loop():
    logits, labels, mask, _ = random_batch(N=10, K=5, V=4, seed=9)
    alpha = 0.3
    w = dpace_weights(logits, labels, mask, alpha=alpha)
    q = torch.softmax(logits.double(), -1)
    for n in range(10):
        P, prod = [], 1.0
        for k in range(5):
            if mask[n, k]:
                prod *= (1 - alpha) * q[n, k, labels[n, k]].item() + alpha
            P.append(prod if mask[n, k] else 0.0)
        for i in range(5):
            expected = sum(P[i:]) if mask[n, i] else 0.0
            assert w[n, i].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(w, dpace_weights_from_accept(torch.exp(-slot_cross_entropy(logits, labels, mask)),
                                                            mask, alpha))


# ---------------------------------------------------------------------------------------------------
# first-error focal


def test_focal_phi0_is_ce_at_first_error():
    logits, labels, mask, _ = random_batch(N=30, K=5, V=2, seed=10)
    ce = slot_cross_entropy(logits, labels, mask)
    j = first_error_index(logits, labels, mask)
    out = first_error_focal(ce, None, j, 0.0)
    for n in range(30):
        expected = ce[n, j[n]].item() if j[n] < 5 else 0.0
        assert out[n].item() == pytest.approx(expected)
    assert (j == 5).any() and out[j == 5].eq(0).all()  # blocks without an error add nothing


def test_focal_phi2_matches_loop_and_gradcheck():
    logits, labels, mask, _ = random_batch(N=8, K=4, V=3, seed=11, dtype=torch.float64)
    logits.requires_grad_(True)

    def focal(x):
        ce = slot_cross_entropy(x, labels, mask)
        return first_error_focal(ce, -ce, first_error_index(x, labels, mask), 2.0)

    out = focal(logits)
    q = torch.softmax(logits.detach(), -1)
    j = first_error_index(logits, labels, mask)
    for n in range(8):
        if j[n] < 4:
            qy = q[n, j[n], labels[n, j[n]]].item()
            assert out[n].item() == pytest.approx((1 - qy) ** 2 * -math.log(qy))
        else:
            assert out[n].item() == 0.0
    assert torch.autograd.gradcheck(focal, (logits,))
    with pytest.raises(ValueError, match="phi"):
        first_error_focal(out[:, None], None, j, -1.0)
