"""Tests for losses.AcceptanceAlignedLoss and the conf/loss configs."""

from __future__ import annotations

from pathlib import Path

import hydra.utils
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from losses import (
    AcceptanceAlignedLoss,
    chain_reward,
    chain_surrogate,
    dpace_weights,
    first_error_index,
    positional_weights,
    slot_cross_entropy,
)

CONF = Path(__file__).resolve().parents[1] / "conf" / "loss"
L2R_ALL = {"gamma": 7.0, "focal_weight": 0.3, "focal_gamma": 2.0, "chain_weight": 40.0}


def batch(N=8, K=6, V=5, seed=0, dtype=torch.float32):
    """Logits with q(y) often high (so blocks with and without errors occur), prefix masks with
    padding labels -100, one block without any valid slot, and soft labels p."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (N, K), generator=g)
    logits = torch.randn(N, K, V, generator=g, dtype=dtype)
    logits = logits.scatter_add(-1, labels.unsqueeze(-1), torch.full((N, K, 1), 1.5, dtype=dtype))
    lengths = torch.randint(1, K + 1, (N,), generator=g)
    lengths[0], lengths[1], lengths[-1] = K, K, 0
    mask = torch.arange(K)[None, :] < lengths[:, None]
    logits[1] = F.one_hot(labels[1], V).to(dtype) * 4.0  # a block with no error
    probs = torch.softmax(logits.detach() + torch.randn(N, K, V, generator=g, dtype=dtype), -1)
    return logits.requires_grad_(True), torch.where(mask, labels, -100), mask, probs


def uniform_ce(logits, labels, mask):
    return F.cross_entropy(logits[mask], labels[mask])


def test_uniform_is_masked_mean_ce():
    logits, labels, mask, _ = batch()
    loss, comps = AcceptanceAlignedLoss()(logits, labels, mask)
    ref = uniform_ce(logits, labels, mask)
    torch.testing.assert_close(loss, ref)
    assert set(comps) == {"ce", "ce_uniform"}
    torch.testing.assert_close(comps["ce_uniform"], ref.detach())
    assert not comps["ce"].requires_grad
    g_ours = torch.autograd.grad(loss, logits)[0]
    g_ref = torch.autograd.grad(ref, logits)[0]
    torch.testing.assert_close(g_ours, g_ref)
    # masks may be 0/1 integers
    torch.testing.assert_close(AcceptanceAlignedLoss()(logits, labels, mask.long())[0], ref)


@pytest.mark.parametrize("gamma, schedule", [(7.0, "exp"), (2.0, "exp"), (None, "linear")])
def test_positional_weighting(gamma, schedule):
    logits, labels, mask, _ = batch()
    loss, comps = AcceptanceAlignedLoss(gamma=gamma, schedule=schedule)(logits, labels, mask)
    w = positional_weights(6, gamma, schedule).expand(8, 6) * mask
    ce = slot_cross_entropy(logits, labels, mask)
    torch.testing.assert_close(loss, (w * ce).sum() / w.sum())
    torch.testing.assert_close(comps["ce_uniform"], uniform_ce(logits, labels, mask).detach())


@pytest.mark.parametrize("focal_norm", ["blocks", "errors"])
def test_focal_phi0_is_ce_at_first_error(focal_norm):
    logits, labels, mask, _ = batch()
    loss, comps = AcceptanceAlignedLoss(focal_weight=0.3, focal_norm=focal_norm)(logits, labels, mask)
    ce = slot_cross_entropy(logits, labels, mask)
    j = first_error_index(logits, labels, mask)
    assert j[1] == 6 and (j < 6).sum() >= 3  # block 1 has no error, several blocks have one
    total = sum(ce[n, j[n]] for n in range(8) if j[n] < 6)
    count = mask.any(-1).sum() if focal_norm == "blocks" else (j < 6).sum()
    torch.testing.assert_close(comps["focal"], (total / count).detach())
    torch.testing.assert_close(loss, comps["ce"] + 0.3 * comps["focal"])
    # a block without an error contributes no gradient through the focal term
    g = torch.autograd.grad(loss - uniform_ce(logits, labels, mask), logits)[0]
    assert g[1].abs().max() < 1e-7


def test_focal_phi2():
    logits, labels, mask, _ = batch()
    _, comps = AcceptanceAlignedLoss(focal_weight=1.0, focal_gamma=2.0)(logits, labels, mask)
    q = torch.softmax(logits.detach(), -1)
    j = first_error_index(logits, labels, mask)
    total = 0.0
    for n in range(8):
        if j[n] < 6:
            qy = q[n, j[n], labels[n, j[n]]]
            total += (1 - qy) ** 2 * -qy.log()
    torch.testing.assert_close(comps["focal"], total / mask.any(-1).sum())


def test_chain_term():
    logits, labels, mask, _ = batch()
    loss, comps = AcceptanceAlignedLoss(chain_weight=40.0)(logits, labels, mask)
    R = chain_surrogate(logits, labels, mask)
    valid_blocks = mask.any(-1)
    torch.testing.assert_close(comps["chain"], R[valid_blocks].mean().detach())
    torch.testing.assert_close(loss, uniform_ce(logits, labels, mask) - 40.0 * R[valid_blocks].mean())


def test_dpace_term_uses_detached_weights():
    logits, labels, mask, _ = batch()
    loss, comps = AcceptanceAlignedLoss(dpace=True, dpace_alpha=0.5)(logits, labels, mask)
    assert set(comps) == {"dpace", "ce_uniform"}
    w = dpace_weights(logits, labels, mask, alpha=0.5)
    ce = slot_cross_entropy(logits, labels, mask)
    ref = (w * ce).sum() / w.sum()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0])
    with pytest.raises(ValueError, match="gamma"):
        AcceptanceAlignedLoss(dpace=True, gamma=7.0)


def test_composite_is_sum_of_components_and_gradcheck():
    logits, labels, mask, _ = batch(N=5, K=4, V=4, dtype=torch.float64)
    module = AcceptanceAlignedLoss(**L2R_ALL, chunk_size=3)
    loss, comps = module(logits, labels, mask)
    assert set(comps) == {"ce", "ce_uniform", "focal", "chain"}
    torch.testing.assert_close(loss.detach(), comps["ce"] + 0.3 * comps["focal"] - 40.0 * comps["chain"])
    assert torch.autograd.gradcheck(lambda x: module(x, labels, mask)[0], (logits,))


def test_chunk_size_does_not_change_results():
    logits, labels, mask, probs = batch()
    for soft in (False, True):
        out = []
        for chunk in (1, 7, None):
            module = AcceptanceAlignedLoss(**L2R_ALL, soft=soft, chunk_size=chunk)
            loss, _ = module(logits, labels, mask, probs if soft else None)
            out.append((loss, torch.autograd.grad(loss, logits)[0]))
        for loss, grad in out[1:]:
            torch.testing.assert_close(loss, out[0][0])
            torch.testing.assert_close(grad, out[0][1])


# ---------------------------------------------------------------------------------------------------
# soft labels


def test_soft_greedy():
    logits, labels, mask, probs = batch(dtype=torch.float64)
    module = AcceptanceAlignedLoss(chain_weight=40.0, soft=True)
    loss, comps = module(logits, labels, mask, probs)
    logq = logits.log_softmax(-1)
    soft_ce = torch.where(mask, -(probs * logq).sum(-1), 0.0)
    blocks = mask.any(-1)
    # reported: the true acceptance probability p(argmax q)
    chosen = probs.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1).log()
    torch.testing.assert_close(comps["chain"], chain_reward(chosen, mask)[blocks].mean().detach())
    torch.testing.assert_close(comps["ce"], (soft_ce.sum() / mask.sum()).detach())
    torch.testing.assert_close(comps["ce_uniform"], uniform_ce(logits, labels, mask).detach())
    # optimised: the same value with the gradient of log Σ q p (straight-through in log space)
    surrogate = (logq.exp() * probs).sum(-1).log()
    log_a = chosen + surrogate - surrogate.detach()
    ref = soft_ce.sum() / mask.sum() - 40.0 * chain_reward(log_a, mask)[blocks].mean()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0])


def test_soft_sample_and_gradcheck():
    logits, labels, mask, probs = batch(N=5, K=4, V=4, dtype=torch.float64)
    module = AcceptanceAlignedLoss(**L2R_ALL, soft=True, draft_sampling="sample")
    _loss, comps = module(logits, labels, mask, probs)
    log_a = torch.minimum(probs, logits.softmax(-1)).sum(-1).log()
    torch.testing.assert_close(comps["chain"], chain_reward(log_a, mask)[mask.any(-1)].mean().detach())
    assert torch.autograd.gradcheck(lambda x: module(x, labels, mask, probs)[0], (logits,))


def test_soft_dpace_uses_acceptance():
    logits, labels, mask, probs = batch(dtype=torch.float64)
    loss, _ = AcceptanceAlignedLoss(dpace=True, soft=True)(logits, labels, mask, probs)
    from losses import dpace_weights_from_accept

    a = probs.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    w = dpace_weights_from_accept(a, mask, 0.5)
    soft_ce = torch.where(mask, -(probs * logits.log_softmax(-1)).sum(-1), 0.0)
    torch.testing.assert_close(loss, (w * soft_ce).sum() / w.sum())


def test_soft_argument_errors():
    logits, labels, mask, probs = batch()
    with pytest.raises(ValueError, match="target_probs"):
        AcceptanceAlignedLoss(soft=True)(logits, labels, mask)
    with pytest.raises(ValueError, match="soft=True"):
        AcceptanceAlignedLoss()(logits, labels, mask, probs)


# ---------------------------------------------------------------------------------------------------
# numerical safety


CONFIGS = [
    {},
    L2R_ALL,
    {"focal_weight": 0.3, "focal_gamma": 0.5, "chain_weight": 40.0, "dpace": True},
    dict(**L2R_ALL, soft=True),
    dict(**L2R_ALL, soft=True, draft_sampling="sample"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_all_masked_batch_gives_zero_loss(cfg):
    logits, labels, mask, probs = batch()
    mask = torch.zeros_like(mask)
    labels = torch.full_like(labels, -100)
    loss, comps = AcceptanceAlignedLoss(**cfg)(logits, labels, mask, probs if cfg.get("soft") else None)
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) and v.item() == 0.0 for v in comps.values())
    assert logits.grad.eq(0).all()


@pytest.mark.parametrize("cfg", CONFIGS)
def test_extreme_logits_stay_finite(cfg):
    logits, labels, mask, probs = batch()
    logits = (logits.detach() * 1e4).requires_grad_(True)  # q(y) underflows float32 at most slots
    probs = torch.softmax(logits.detach() * 3, -1)  # p with exact zeros
    loss, comps = AcceptanceAlignedLoss(**cfg)(logits, labels, mask, probs if cfg.get("soft") else None)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in comps.values())
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("cfg", CONFIGS)
def test_bf16_autocast(cfg):
    _logits, labels, mask, probs = batch(V=16)
    hidden = torch.randn(8, 6, 12, generator=torch.Generator().manual_seed(3))
    head = torch.nn.Linear(12, 16)
    module = AcceptanceAlignedLoss(**cfg)
    tp = probs if cfg.get("soft") else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = head(hidden)
        assert x.dtype == torch.bfloat16
        loss, _comps = module(x, labels, mask, tp)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # computed in float32 from the bf16 logits, and close to the all-float32 loss
    torch.testing.assert_close(loss, module(x.detach().float(), labels, mask, tp)[0])
    torch.testing.assert_close(loss, module(head(hidden), labels, mask, tp)[0], rtol=0.02, atol=0.02)
    assert all(torch.isfinite(p.grad).all() for p in head.parameters())


def test_bad_options_name_the_key():
    for kwargs, key in [
        ({"schedule": "cosine"}, "schedule"),
        ({"gamma": -1.0}, "gamma"),
        ({"focal_weight": -0.1}, "focal_weight"),
        ({"chain_weight": -1.0}, "chain_weight"),
        ({"focal_norm": "tokens"}, "focal_norm"),
        ({"draft_sampling": "beam"}, "draft_sampling"),
        ({"dpace_alpha": 2.0}, "dpace_alpha"),
        ({"chunk_size": 0}, "chunk_size"),
    ]:
        with pytest.raises(ValueError, match=key):
            AcceptanceAlignedLoss(**kwargs)


# ---------------------------------------------------------------------------------------------------
# Hydra configs


# Every key of every loss choice as `experiments.train loss=<name>` resolves it (recorded before the
# files inherited uniform.yaml); a changed default fails here.
UNIFORM = {"_target_": "losses.AcceptanceAlignedLoss", "gamma": None, "schedule": "exp", "focal_weight": 0.0,
           "focal_gamma": 2.0, "focal_norm": "blocks", "chain_weight": 0.0, "dpace": False, "dpace_alpha": 0.5,
           "soft": False, "draft_sampling": "greedy", "chunk_size": None}
EXPECTED = {
    "uniform": UNIFORM,
    "decay": {**UNIFORM, "gamma": 2.0},
    "focal": {**UNIFORM, "focal_weight": 0.3},
    "chain": {**UNIFORM, "chain_weight": 40.0},
    "decay_focal": {**UNIFORM, "gamma": 2.0, "focal_weight": 0.3},
    "l2r_all": {**UNIFORM, "gamma": 2.0, "focal_weight": 0.3, "chain_weight": 40.0},
    "dpace": {**UNIFORM, "dpace": True},
    "soft_all": {**UNIFORM, "gamma": 2.0, "focal_weight": 0.3, "chain_weight": 40.0, "soft": True},
}


def _compose(config_dir: Path, name: str, overrides: list[str] | None = None):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loss_configs_resolve_to_their_values(name):
    """Composed as a choice of the train config's loss group and on its own (its folder as the config
    folder), each file resolves to every recorded value, in uniform.yaml's key order."""
    for cfg in (_compose(CONF.parent, "train", [f"loss={name}"]).loss, _compose(CONF, name)):
        assert OmegaConf.to_container(cfg) == EXPECTED[name]
        assert list(cfg) == list(UNIFORM)


@pytest.mark.slow
def test_experiments_keep_their_loss_values():
    """Experiment files that pick a loss or override its keys still resolve to the same loss."""
    cases = [(["experiment=qwen3_gpu"], {**UNIFORM, "gamma": 7.0}),
             (["experiment=qwen3_gpu", "loss=l2r_all"], {**EXPECTED["l2r_all"], "gamma": 7.0}),  # DFlash's 7 at scale
             (["experiment=l2r_sweep_gamma"], EXPECTED["decay"]),
             (["experiment=l2r_sweep_gamma", "loss.gamma=2"], {**EXPECTED["decay"], "gamma": 2}),
             (["experiment=l2r_sweep_focal"], EXPECTED["focal"]),
             (["experiment=l2r_sweep_chain"], EXPECTED["chain"])]
    for overrides, expected in cases:
        cfg = _compose(CONF.parent, "train", overrides)
        assert OmegaConf.to_container(cfg.loss) == expected, overrides


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loss_configs_instantiate(name):
    cfg = _compose(CONF.parent, "train", [f"loss={name}"]).loss
    module = hydra.utils.instantiate(cfg)
    assert isinstance(module, AcceptanceAlignedLoss)
    for key, value in EXPECTED[name].items():
        if key != "_target_":
            assert getattr(module, key) == value, key
    logits, labels, mask, probs = batch()
    loss, comps = module(logits, labels, mask, probs if module.soft else None)
    loss.backward()
    assert torch.isfinite(loss) and "ce_uniform" in comps


def test_every_config_file_is_tested():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_saves_no_full_size_tensor_of_its_own(cfg):
    """Memory: autograd keeps only the caller's logits (and p) at full (N, K, V) size, no copies."""
    logits, labels, mask, probs = batch(V=64)
    big = logits.numel()
    saved = []

    def pack(t):
        saved.append((t.numel(), t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = AcceptanceAlignedLoss(**cfg, chunk_size=16)(logits, labels, mask,
                                                              probs if cfg.get("soft") else None)
    own = [n for n, ptr in saved if n >= big and ptr not in (logits.data_ptr(), probs.data_ptr())]
    assert own == [] and any(ptr == logits.data_ptr() for _, ptr in saved)
    loss.backward()
