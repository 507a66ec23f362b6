"""DDP is correct end to end: one optimizer step of the real training code under Lightning's DDP on 2
CPU processes (gloo, ``trainer=ddp_cpu``) equals the step of one process on the same global batch,
for every loss of ``conf/loss/``.

``tests/test_losses_distributed.py`` proves the loss alone partition-invariant (a linear head,
gradients averaged by hand). Here everything is the real path: the configs composed by Hydra,
:func:`experiments.pipeline.training.build` (the target loaded from disk, the drafter, the loss, the
data module reading the cached target features), a Lightning Trainer from ``conf/trainer/ddp_cpu.yaml``
and ``DrafterLightningModule.training_step``; DDP's reducer averages the gradients.

The two ranks are started by ``torch.multiprocessing`` with the environment ``torchrun`` would set
(``LOCAL_RANK`` ...), so Lightning's ``strategy: ddp`` runs as that rank instead of re-launching the
script (which pytest cannot host), and all the losses share one process group: one start, not eight.

The batch is made so the comparison is exact: every response column is an anchor (``num_anchors``
above the longest response), so anchor sampling draws nothing, and rows have equal lengths (no
padding) but different prompt lengths, so the ranks hold different numbers of labelled slots and a
per-rank normalisation would be caught. The feature cache is float32 so cached and recomputed hidden
states agree to rounding.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir

from drafters.config import target_fingerprint
from drafters.training.datamodule import RegenDataModule, write_meta, write_shard

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CONF = Path(__file__).resolve().parents[1] / "conf"
LOSSES = sorted(p.stem for p in CONF.glob("loss/*.yaml"))
ROWS, LENGTH, BATCH = 8, 20, 8


class Recorder(L.Callback):
    """What one training step did: its rows, its loss, the drafter's gradients as the optimizer sees
    them (after DDP's all-reduce), the weights after the step."""

    def __init__(self):
        self.out = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.out["rows"] = batch["input_ids"][:, 0].tolist()  # the first token numbers the row
        self.out["features"] = "features" in batch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.out["loss"] = outputs["loss"].detach().clone()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.out["grads"] = {n: p.grad.detach().clone() for n, p in module.drafter.named_parameters()}

    def on_train_end(self, trainer, module):
        self.out["params"] = {n: p.detach().clone() for n, p in module.drafter.named_parameters()}


def compose_train(root: str, loss: str, trainer: str, *extra: str):
    overrides = [
        "target=hf", f"target.path={root}/target", f"loss={loss}", f"trainer={trainer}", "name=ddp",
        f"paths.run_dir={root}/runs/{trainer}-{loss}", f"data.data_dir={root}/data", "data.regenerate_if_missing=false",
        "data.features.dtype=float32", f"data.datamodule.batch_size={BATCH}", "data.datamodule.max_length=null",
        "data.datamodule.val_fraction=0.0", "drafter.block_size=6", "module.num_anchors=64",
        "train.max_steps=1", "train.val_every=1", "train.limit_val_batches=0", *extra,
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def one_step(root: str, loss: str, trainer: str) -> dict:
    """One optimizer step of ``experiments.train``'s module, data and Trainer config; what it recorded."""
    from drafters.training import features
    from experiments.pipeline.trainer import trainer_precision
    from experiments.pipeline.training import build

    cfg = compose_train(root, loss, trainer)
    torch.manual_seed(0)  # the same fresh drafter everywhere
    _, _, module, datamodule = build(cfg)
    read, getitem = [], features.FeatureStore.__getitem__

    def recording(store, row):
        read.append((store.meta["target_layer_ids"] == [features.HEAD], int(row)))  # (final states?, row)
        return getitem(store, row)

    recorder = Recorder()
    trainer = hydra.utils.instantiate(cfg.trainer, logger=False, callbacks=[recorder], enable_checkpointing=False,
                                      enable_progress_bar=False, precision=trainer_precision(cfg))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(features.FeatureStore, "__getitem__", recording)
        trainer.fit(module, datamodule=datamodule)
    return {**recorder.out, "feature_rows_read": read}


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.save({loss: one_step(root, loss, "ddp_cpu") for loss in LOSSES}, f"{root}/rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_run_inputs(root: Path) -> None:
    """A saved tiny target and a regenerated data dir of ``ROWS`` equal-length rows (first token = row)."""
    from test_train import save_target

    from experiments.data.target import load_target

    save_target(root / "target")
    target, tokenizer = load_target(str(root / "target"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(10, len(tokenizer) - 1, (LENGTH,), generator=g)
        ids[0] = 100 + i
        rows.append({"id": f"row{i}", "domain": "dialogue", "input_ids": ids.tolist(), "prompt_len": 2 + (3 * i) % 7})
    write_shard(rows, root / "data")
    write_meta(root / "data", {"complete": True, "target_fingerprint": target_fingerprint(target.config)})


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """``(single, ranks)``: per loss, the single-process record and the two ranks' records."""
    root = tmp_path_factory.mktemp("ddp_equivalence")
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                           "BLOCKDRAFT_RUNS": root / "runs", "BLOCKDRAFT_CACHE": root / "cache"}.items():
            env.setenv(key, str(value))
        make_run_inputs(root)
        single = {loss: one_step(str(root), loss, "cpu") for loss in LOSSES}  # also computes the feature cache
        mp.spawn(_worker, args=(_free_port(), str(root)), nprocs=2, join=True)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(2)]
    return single, ranks


def test_every_loss_config_is_covered():
    assert set(LOSSES) >= {"uniform", "decay", "focal", "chain", "decay_focal", "l2r_all", "dpace", "soft_all"}


@pytest.mark.parametrize("loss", LOSSES)
def test_ddp_step_equals_single_process_step(steps, loss):
    single, ranks = steps
    one, (r0, r1) = single[loss], (ranks[0][loss], ranks[1][loss])
    # each rank got half of the global batch, and together they got all of it, once
    assert len(r0["rows"]) == len(r1["rows"]) == BATCH // 2
    assert sorted(r0["rows"] + r1["rows"]) == sorted(one["rows"]) == [100 + i for i in range(ROWS)]
    # the loss: the mean over ranks is the whole batch's (global denominators, D-PACE's included)
    torch.testing.assert_close((r0["loss"] + r1["loss"]) / 2, one["loss"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(r0["loss"], r1["loss"])  # uneven halves: the test is not vacuous
    # the gradients after DDP's averaging, and the weights after the step, are the single process's
    assert set(one["grads"]) == set(r0["grads"])
    for name, grad in one["grads"].items():
        for rank in (r0, r1):
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{loss}: grad {name}")
            torch.testing.assert_close(rank["params"][name], one["params"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", LOSSES)
def test_cached_features_are_read_per_rank_once(steps, loss):
    single, ranks = steps
    r0, r1 = ranks[0][loss], ranks[1][loss]
    assert r0["features"] and r1["features"]
    stores = [False, True] if loss == "soft_all" else [False]  # soft labels also read the target's final states
    for head in stores:
        read0, read1 = ([row for h, row in r["feature_rows_read"] if h == head] for r in (r0, r1))
        whole = [row for h, row in single[loss]["feature_rows_read"] if h == head]
        assert len(read0) == len(set(read0)) == BATCH // 2 and not set(read0) & set(read1)
        assert sorted(read0 + read1) == sorted(whole) == list(range(ROWS))
    assert {h for h, _ in r0["feature_rows_read"]} == set(stores)


def test_world_size_must_divide_the_global_batch(tmp_path):
    class Trainer:  # what the data module reads of the Trainer
        world_size = 2

    datamodule = RegenDataModule(str(tmp_path), batch_size=3)
    datamodule.trainer = Trainer()
    with pytest.raises(ValueError, match=r"data\.datamodule\.batch_size=3 .* world size 2"):
        datamodule.per_rank(3)
    assert datamodule.per_rank(4) == 2
    datamodule.trainer = None
    assert datamodule.per_rank(3) == 3
