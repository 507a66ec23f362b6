"""Partition invariance: a batch split unevenly over 2 gloo processes gives the same loss (mean over
ranks) and, after DDP-style gradient averaging, the same parameter gradients as the whole batch on one
process. Gradients are averaged with an explicit all-reduce (what DDP's reducer does); constructing
DistributedDataParallel itself costs ~5 s here, too slow for a unit test."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from losses import AcceptanceAlignedLoss

pytestmark = pytest.mark.slow

N, K, V, H = 8, 5, 11, 6
SPLIT = 3  # rank 0 gets blocks [0, 3), rank 1 gets [3, 8): uneven, with different mask counts
CONFIGS = {
    "uniform": {},
    "l2r_all": {"gamma": 7.0, "focal_weight": 0.3, "focal_gamma": 2.0, "chain_weight": 40.0},
    "focal_errors": {"focal_weight": 1.0, "focal_norm": "errors"},
    "dpace": {"dpace": True, "chain_weight": 5.0},
    "soft_all": {"gamma": 7.0, "focal_weight": 0.3, "focal_gamma": 2.0, "chain_weight": 40.0, "soft": True},
}


def make_problem():
    """A tiny linear head over fixed features, so that DDP has parameters to average."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(N, K, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    lengths = torch.tensor([5, 2, 0, 5, 4, 1, 5, 3])  # rank 0 holds an all-padding block
    mask = torch.arange(K)[None, :] < lengths[:, None]
    probs = torch.softmax(torch.randn(N, K, V, generator=g, dtype=torch.float64) * 2, -1)
    torch.manual_seed(1)
    head = nn.Linear(H, V).double()
    with torch.no_grad():  # blocks 0 and 4 are drafted right: they have no first error
        labels[[0, 4]] = head(features[[0, 4]]).argmax(-1)
    return features, torch.where(mask, labels, -100), mask, probs, head


def run(head, features, labels, mask, probs):
    """(loss, components, parameter gradients averaged over ranks like DDP) for every config."""
    out = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, cfg in CONFIGS.items():
        head.zero_grad()
        module = AcceptanceAlignedLoss(**cfg)
        loss, comps = module(head(features), labels, mask, probs if cfg.get("soft") else None)
        loss.backward()
        grads = [p.grad.detach().clone() for p in head.parameters()]
        if world > 1:
            for g in grads:
                dist.all_reduce(g)
                g /= world
        out[name] = (loss.detach(), {k: v.clone() for k, v in comps.items()}, grads)
    return out


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        features, labels, mask, probs, head = make_problem()
        part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, N)
        result = run(head, features[part], labels[part], mask[part], probs[part])
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=2, join=True)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]
    features, labels, mask, probs, head = make_problem()
    return run(head, features, labels, mask, probs), ranks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_partition_invariance(results, name):
    single, ranks = results
    loss, comps, grads = single[name]
    # After averaging, every rank holds the single-process gradient.
    for r in range(2):
        for g_rank, g_single in zip(ranks[r][name][2], grads):
            torch.testing.assert_close(g_rank, g_single)
    # The mean over ranks of the loss and of every component is the single-process value.
    torch.testing.assert_close((ranks[0][name][0] + ranks[1][name][0]) / 2, loss)
    for key, value in comps.items():
        torch.testing.assert_close((ranks[0][name][1][key] + ranks[1][name][1][key]) / 2, value)
    # The split is uneven, so per-rank normalisation would differ: the test is not vacuous.
    assert not torch.allclose(ranks[0][name][0], ranks[1][name][0])


def test_problem_has_blocks_with_and_without_errors():
    features, labels, mask, _probs, head = make_problem()
    from losses import first_error_index

    j = first_error_index(head(features), labels, mask)
    assert (j == K).sum() >= 2 and (j < K).sum() >= 2
