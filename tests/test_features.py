"""drafters.training.features: the cached target features equal the target's hidden states, resume after a
kill, refuse other settings, and a training step on them equals one that runs the target; the cached final
states rebuild the target's logits, so soft labels need no target forward either."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_target
from test_module import make_module

from drafters.training.blocks import select_blocks
from drafters.training.datamodule import RegenDataModule, collate, ensure_features, write_meta, write_shard
from drafters.training.features import (
    HEAD,
    FeatureStore,
    compute_features,
    features_dir,
    features_key,
)
from losses import AcceptanceAlignedLoss

VOCAB = 64
LAYERS = (1, 2)


def make_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        rows.append({"id": f"r/{i}", "domain": "code", "input_ids": ids, "prompt_len": 3})
    return rows


def reference(target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=VOCAB, hidden_size=64, init_range=0.2)


@pytest.mark.parametrize("rows_per_part", [2, 7])
def test_cached_rows_equal_the_targets_hidden_states(target, tmp_path, rows_per_part):
    """Rows are batched by length within a part (7: one part, batches of 3 rows out of their order) and
    written back in their own order."""
    rows = [r["input_ids"] for r in make_rows(7)]
    assert sorted(map(len, rows)) != list(map(len, rows))
    root = compute_features(target, rows, tmp_path / "f", target_layer_ids=LAYERS, dtype="float32",
                            batch_size=3, rows_per_part=rows_per_part, progress=False)
    store = FeatureStore(root)
    assert len(store) == 7 and len(list(root.glob("part-*.offsets.npy"))) == -(-7 // rows_per_part)
    for i, ids in enumerate(rows):  # batched with right padding, read back from the parts
        torch.testing.assert_close(store[i], reference(target, ids), atol=1e-5, rtol=1e-4)


def test_float16_cache_and_max_length(target, tmp_path):
    rows = [r["input_ids"] for r in make_rows(3)]
    store = FeatureStore(compute_features(target, rows, tmp_path / "f", target_layer_ids=LAYERS,
                                          max_length=5, progress=False))
    assert store[0].shape == (5, 2 * 64) and store[0].dtype == torch.float32
    torch.testing.assert_close(store[1], reference(target, rows[1][:5]), atol=2e-2, rtol=1e-2)


def test_killed_computation_resumes_to_the_same_cache(target, tmp_path):
    rows = [r["input_ids"] for r in make_rows(6)]
    whole = compute_features(target, rows, tmp_path / "a", target_layer_ids=LAYERS, rows_per_part=2,
                             progress=False)
    partial = compute_features(target, rows, tmp_path / "b", target_layer_ids=LAYERS, rows_per_part=2,
                               progress=False)
    for name in ("part-00002.npy", "part-00002.offsets.npy"):  # as if killed before the last part
        (partial / name).unlink()
    meta = json.loads((partial / "meta.json").read_text())
    (partial / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(FileNotFoundError, match="incomplete"):
        FeatureStore(partial)
    compute_features(target, rows, partial, target_layer_ids=LAYERS, rows_per_part=2, progress=False)
    a, b = FeatureStore(whole), FeatureStore(partial)
    assert all(torch.equal(a[i], b[i]) for i in range(6))


def test_a_damaged_part_of_a_complete_cache_is_named_and_computed_again_alone(target, tmp_path, capsys):
    rows = [r["input_ids"] for r in make_rows(6)]
    root = compute_features(target, rows, tmp_path / "f", target_layer_ids=LAYERS, rows_per_part=2, progress=False)
    whole = FeatureStore(root)
    expected = [whole[i] for i in range(6)]
    kept = {p.name: p.stat().st_mtime_ns for p in root.glob("part-0000[02]*")}
    middle = root / "part-00001.npy"
    middle.write_bytes(middle.read_bytes()[:200])  # cut short, as by a full disk or an interrupted copy
    with pytest.raises(ValueError, match="part-00001.npy cannot be read .*run the training again"):
        FeatureStore(root)
    compute_features(target, rows, root, target_layer_ids=LAYERS, rows_per_part=2, progress=False)
    assert "part-00001.npy is damaged: computing its rows again" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in root.glob("part-0000[02]*")} == kept  # the others untouched
    redone = FeatureStore(root)
    assert all(torch.equal(redone[i], expected[i]) for i in range(6))


def test_other_settings_are_refused(target, tmp_path):
    rows = [r["input_ids"] for r in make_rows(2)]
    root = compute_features(target, rows, tmp_path / "f", target_layer_ids=LAYERS, progress=False)
    with pytest.raises(ValueError, match="other settings.*target_layer_ids"):
        compute_features(target, rows, root, target_layer_ids=(1,), progress=False)
    (root / "part-00000.npy").write_bytes((root / "part-00000.npy").read_bytes()[:200])
    with pytest.raises(ValueError, match="part-00000.npy"):
        FeatureStore(root)


def test_training_step_on_cached_features_equals_a_target_forward(target, tmp_path):
    """Same loss and same drafter gradients, whether the context comes from the cache or the target."""
    data_dir = tmp_path / "regen"
    write_shard(make_rows(8), data_dir)
    write_meta(data_dir, {"complete": True})
    module = make_module(target)
    layers = module.drafter.target_layer_ids
    root = ensure_features(target, data_dir, layers, dtype="float32", max_length=16, progress=False)
    assert root == features_dir(data_dir, layers, "float32", 16)
    dm = RegenDataModule(str(data_dir), batch_size=4, max_length=16, val_fraction=0.0, features_dir=str(root))
    dm.setup("fit")
    batch = collate([dm.train_set[i] for i in range(4)])
    assert batch["features"].shape[:2] == batch["input_ids"].shape

    def step(b):
        module.drafter.zero_grad()
        states, logits = module.context_states(b, full_logits=False)
        out = select_blocks(module.drafter, b, states, logits, module.num_anchors, torch.Generator().manual_seed(0))
        loss, _ = module.loss(*out)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.drafter.parameters()]

    cached_loss, cached_grads = step(batch)
    plain = {k: v for k, v in batch.items() if k != "features"}
    live_loss, live_grads = step(plain)
    torch.testing.assert_close(cached_loss, live_loss, atol=1e-5, rtol=1e-5)
    for a, b in zip(cached_grads, live_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_head_state_cache_rebuilds_the_targets_logits(target, tmp_path):
    """The HEAD cache holds what the LM head reads: the head turns every cached column into the target's logits."""
    rows = [r["input_ids"] for r in make_rows(5)]
    store = FeatureStore(compute_features(target, rows, tmp_path / "h", target_layer_ids=(HEAD,), dtype="float32",
                                          batch_size=2, progress=False))
    assert store.meta["target_layer_ids"] == [HEAD] and features_key((HEAD,), "float32", None).startswith("layers-head")
    head = target.get_output_embeddings()
    for i, ids in enumerate(rows):
        with torch.no_grad():
            want = target(input_ids=torch.tensor([ids])).logits[0]
            got = head(store[i])
        assert store[i].shape == (len(ids), 64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_target_whose_logits_are_not_its_heads_output_is_refused(target, tmp_path):
    """A soft-capped target (logits changed after the head) cannot have its logits rebuilt: named, not cached."""
    capped = copy.deepcopy(target)
    forward = capped.forward

    def soft_capped(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = 5 * torch.tanh(out.logits / 5)
        return out

    capped.forward = soft_capped
    with pytest.raises(ValueError, match="not its LM head's output"):
        compute_features(capped, [r["input_ids"] for r in make_rows(2)], tmp_path / "h", target_layer_ids=(HEAD,),
                         progress=False)


@pytest.mark.parametrize("candidates", [None, 24])
def test_soft_labels_from_cached_head_states_equal_a_target_forward(target, tmp_path, candidates):
    """A soft-label step (l2r_all on the target's p) on cached features and final states gives the loss and
    gradients of one that runs the target: over the whole vocabulary, and over a candidate vocabulary's columns
    (candidates + drawn negatives, the target's p renormalised there like the drafter's q)."""
    data_dir = tmp_path / "regen"
    write_shard(make_rows(8), data_dir)
    write_meta(data_dir, {"complete": True})
    module = make_module(target, loss=AcceptanceAlignedLoss(gamma=2.0, focal_weight=0.3, chain_weight=1.0, soft=True))
    if candidates:
        module.train_vocab_negatives = 8
        module.set_train_vocab(torch.arange(candidates))
    caches = {key: ensure_features(target, data_dir, layers, dtype="float32", max_length=16, progress=False)
              for key, layers in (("features_dir", module.drafter.target_layer_ids), ("head_states_dir", (HEAD,)))}
    dm = RegenDataModule(str(data_dir), batch_size=4, max_length=16, val_fraction=0.0, **caches)
    dm.setup("fit")
    batch = collate([dm.train_set[i] for i in range(4)])
    assert batch["head_states"].shape == (*batch["input_ids"].shape, 64)

    def step(b):
        module.drafter.zero_grad()
        states, logits = module.context_states(b, full_logits=True)
        out = module._blocks(b, states, logits, torch.Generator().manual_seed(0), module.train_vocab)
        width = out[0].shape[-1]
        assert out[3].shape[-1] == width == (VOCAB if candidates is None else candidates + 8)
        loss, _ = module.loss(*out)
        loss.backward()
        return logits, loss.detach(), [p.grad.clone() for p in module.drafter.parameters()]

    no_logits, cached_loss, cached_grads = step(batch)
    assert no_logits is None  # the target did not run
    live = {k: v for k, v in batch.items() if k not in ("features", "head_states")}
    live_logits, live_loss, live_grads = step(live)
    assert live_logits is not None
    torch.testing.assert_close(cached_loss, live_loss, atol=1e-5, rtol=1e-4)
    for a, b in zip(cached_grads, live_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
