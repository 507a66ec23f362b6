"""drafters.training.module: training raises τ, teacher-forced τ = online τ, resume, DDP, checkpoints, errors."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from conftest import left_padded_prompts, tiny_target
from transformers.modeling_outputs import CausalLMOutputWithPast

from drafters import factory
from drafters.tau import greedy_walk, teacher_forced_tau
from drafters.training import blocks
from drafters.training.datamodule import RegenDataModule, collate, sample_anchors, write_meta, write_shard
from drafters.training.module import DrafterLightningModule
from drafters.training.optim import warmup_cosine
from losses import AcceptanceAlignedLoss
from verify import speculative_generate, target_generate

pytestmark = pytest.mark.slow

VOCAB, NEW = 64, 24
NUM_TRAIN, NUM_EVAL = 40, 8


def make_target():
    return tiny_target("llama", vocab_size=VOCAB, hidden_size=64, init_range=0.2)


def rows_of(input_ids, attention_mask, new_tokens, prefix="r"):
    """Unpadded prompt + the target's own answer per row, in the stored format."""
    rows = []
    for b, answer in enumerate(new_tokens):
        prompt = input_ids[b][attention_mask[b].bool()].tolist()
        rows.append({"id": f"{prefix}/{b}", "domain": "code", "input_ids": prompt + answer, "prompt_len": len(prompt)})
    return rows


def make_module(target, loss=None, lr=3e-3, max_steps=40, num_anchors=16, seed=0):
    torch.manual_seed(seed)
    drafter = factory.from_target(target, block_size=4)
    return DrafterLightningModule(
        drafter, target, loss or AcceptanceAlignedLoss(),
        optimizer=functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.0),
        scheduler=functools.partial(warmup_cosine, warmup_steps=5, max_steps=max_steps),
        num_anchors=num_anchors, val_anchor_chunk=8,
    )


def make_trainer(max_steps, **kwargs):
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                "limit_val_batches": 0, "max_epochs": -1}
    defaults.update(kwargs)
    return L.Trainer(max_steps=max_steps, **defaults)


@pytest.fixture(scope="module")
def greedy_data(tmp_path_factory):
    """A tiny random target, its greedy answers to random prompts (stored), and held-out prompts."""
    target = make_target()
    ids, mask = left_padded_prompts([4 + i % 5 for i in range(NUM_TRAIN + NUM_EVAL)], VOCAB, seed=1)
    out = target_generate(target, ids, attention_mask=mask, max_new_tokens=NEW)
    data_dir = tmp_path_factory.mktemp("regen")
    write_shard(rows_of(ids[:NUM_TRAIN], mask[:NUM_TRAIN], out.new_tokens[:NUM_TRAIN]), data_dir)
    write_meta(data_dir, {"complete": True})
    return target, data_dir, ids[NUM_TRAIN:], mask[NUM_TRAIN:]


@pytest.fixture(scope="module")
def trained(greedy_data):
    """The drafter before and after 40 steps of training, with the online τ of each."""
    target, data_dir, eval_ids, eval_mask = greedy_data
    module = make_module(target, lr=1e-2)  # 40 steps of a fan-in initialised drafter

    def online_tau():
        return speculative_generate(target, module.drafter, eval_ids, attention_mask=eval_mask,
                                    max_new_tokens=NEW).tau

    before = online_tau()
    datamodule = RegenDataModule(str(data_dir), batch_size=8, val_fraction=0.1, max_val_samples=4)
    trainer = make_trainer(40, limit_val_batches=None, val_check_interval=40, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=datamodule)
    return module, before, online_tau(), trainer


# ----------------------------------------------------------------------------- pure functions


def test_greedy_walk_replays_verification():
    # prompt of 2 tokens, 8 tokens in all: anchors start at column 1, tokens to emit at columns 2..7
    lead = [9, 3, 9, 9, 9, 0, 2, 9]
    # col 1: accept 3 (cols 2-4) + 1 -> anchor 5; col 5: accept 0 -> anchor 6; col 6: 1 left, accept 1
    assert greedy_walk(lead, prompt_len=2, length=8) == ([3, 0, 1], [4, 1, 1])
    assert greedy_walk([0] * 5, prompt_len=5, length=5) == ([], [])
    assert greedy_walk([0, 0, 0, 0], prompt_len=1, length=4) == ([0, 0, 0], [1, 1, 1])


def test_warmup_cosine_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine(opt, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[9] == pytest.approx(0.55) and lrs[14] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="schedule"):
        warmup_cosine(opt, warmup_steps=1, max_steps=0)


# ----------------------------------------------------------------------------- training


def test_training_raises_online_accepted_length(trained):
    _, before, after, trainer = trained
    assert after > before + 0.08, (before, after)
    metrics = trainer.callback_metrics
    for key in ("val/loss", "val/tau_greedy", "val/tau_soft", "val/acc_slot1", "val/ce"):
        assert key in metrics
    assert 1.0 <= float(metrics["val/tau_greedy"]) <= 4.0 and 1.0 <= float(metrics["val/tau_soft"]) <= 4.0


def test_teacher_forced_tau_equals_online_tau(greedy_data, trained):
    target, _, eval_ids, eval_mask = greedy_data
    drafter = trained[0].drafter
    first = target_generate(target, eval_ids[:1], attention_mask=eval_mask[:1], max_new_tokens=NEW).new_tokens[0]
    eos = first[10]  # a token the target emits: some rows stop early at it
    out = target_generate(target, eval_ids, attention_mask=eval_mask, max_new_tokens=NEW, eos_token_id=eos)
    batch = collate(rows_of(eval_ids, eval_mask, out.new_tokens))
    offline = teacher_forced_tau(drafter, target, batch, chunk=5)
    online = speculative_generate(target, drafter, eval_ids, attention_mask=eval_mask, max_new_tokens=NEW,
                                  eos_token_id=eos)
    assert any(len(t) < NEW for t in out.new_tokens)  # the EOS path is exercised
    assert sum(map(sum, online.accepted_counts)) > 0  # drafts do get accepted
    assert offline["accepted_counts"] == online.accepted_counts
    assert offline["tau_greedy"] == pytest.approx(online.tau)


def test_choose_k_replays_a_trained_drafter_at_each_verified_width(greedy_data, trained):
    """experiments.pipeline.choose_k's τ(W) equals the online τ under drafter.max_draft_tokens=W, from the whole
    vocabulary or a candidate one, and its draft timing covers each W."""
    from drafters.policy import DraftingPolicy, PolicyDrafter
    from experiments.pipeline.choose_k import block_taus, choose_block, draft_ms, held_out_passes

    target, _, eval_ids, eval_mask = greedy_data
    drafter = trained[0].drafter.eval()
    prompts = [row[m.bool()].tolist() for row, m in zip(eval_ids, eval_mask)]
    rows = [(p + target_generate(target, torch.tensor([p]), max_new_tokens=NEW).new_tokens[0], len(p)) for p in prompts]
    passes = held_out_passes(target, rows, drafter, {})
    taus = block_taus(drafter, passes, rows, [1, 2, drafter.num_draft_tokens], {0: None})[0]
    for w, tau in taus.items():
        policy = PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=w))
        steps = sum(speculative_generate(target, policy, torch.tensor([ids[:cut]]), max_new_tokens=NEW).num_target_forwards
                    for ids, cut in rows)
        assert tau == pytest.approx(sum(len(ids) - cut for ids, cut in rows) / steps), w
    assert taus[drafter.num_draft_tokens] > taus[1] > 1.0, taus  # more is accepted when more is verified
    ms = draft_ms(target, {w: PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=w)) for w in (1, 2)}, rounds=2,
                  context=12)
    assert set(ms) == {1, 2} and all(v > 0 for v in ms.values())
    # a candidate vocabulary (drafter.draft_vocab_size): τ(W) replayed from the candidates equals the online τ
    vocab = torch.arange(1, VOCAB, 2)
    picked = choose_block(drafter, target, rows, [2], {0: None, 32: vocab}, {1: 10.0, 3: 10.0}, rounds=2)
    assert set(picked["by_vocab"]) == {0, 32} and picked["chosen_k"] == 2 and picked["chosen_vocab"] in (0, 32)
    assert picked["by_vocab"][0]["by_k"][2]["tau"] == pytest.approx(taus[2], abs=1e-4)
    policy = PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=2), vocab)
    steps = sum(speculative_generate(target, policy, torch.tensor([ids[:cut]]), max_new_tokens=NEW).num_target_forwards
                for ids, cut in rows)
    assert picked["by_vocab"][32]["by_k"][2]["tau"] == pytest.approx(sum(len(i) - c for i, c in rows) / steps, abs=1e-4)


def test_choose_k_times_each_weight_layout_on_fresh_weights_and_keeps_the_taus(greedy_data, trained, tmp_path,
                                                                             monkeypatch):
    """experiments.pipeline.choose_k --weight-layouts: the τ's are replayed once, the step costs timed under each
    layout on a freshly loaded target (packed there, never before the replay), and one layout is chosen."""
    import copy
    import json

    from experiments.pipeline import choose_k
    from verify.layout import OneDNNPackedLinear

    target, data_dir, _, _ = greedy_data
    trained[0].drafter.save_pretrained(tmp_path / "drafter")
    loaded = []
    monkeypatch.setattr(choose_k, "load_target", lambda path: loaded.append(copy.deepcopy(target)) or (loaded[-1], None))
    passes, real_passes = [], choose_k.teacher_passes
    monkeypatch.setattr(choose_k, "teacher_passes", lambda *a: passes.append(a[0]) or real_passes(*a))
    walks, real_walk = [], choose_k.tree_walk
    monkeypatch.setattr(choose_k, "tree_walk", lambda *a: walks.append(a[0].policy) or real_walk(*a))
    out = choose_k.main(["--data-dir", str(data_dir), "--target", "t", "--drafter", f"d={tmp_path / 'drafter'}",
                         "--ks", "1", "2", "--val-fraction", "0.2", "--rows", "4", "--rounds", "2",
                         "--tree", f"d={tmp_path / 'drafter'}", "--tree-budgets", "2", "3", "--hybrid-matches", "2",
                         "--hybrid-depths", "2",
                         "--weight-layouts", "row_major", "onednn_packed", "--out", str(tmp_path / "k.json")])
    assert len(loaded) == 2 and type(loaded[1].lm_head) is OneDNNPackedLinear and type(loaded[0].lm_head) is not \
        OneDNNPackedLinear  # one fresh target per layout
    assert passes == [loaded[0]]  # the chain's τ and the tree's tops from one pass, on the target as loaded
    by_layout = out["by_layout"]
    trees = [by_layout[layout]["tree"]["d"]["by_setting"] for layout in by_layout]
    assert len(walks) == len(set(trees[0]) | set(trees[1])) >= 4  # each setting walked once, whatever the layouts
    shared = set(trees[0]) & set(trees[1])  # (the hybrid's depths include prompt lookup's K, chosen per layout)
    assert {n: trees[0][n]["tau"] for n in shared} == {n: trees[1][n]["tau"] for n in shared} and "tree_n3" in shared
    assert set(by_layout) == {"row_major", "onednn_packed"} and out["chosen_layout"] in by_layout
    for name in ("prompt_lookup",):
        assert by_layout["row_major"][name]["by_k"][2]["tau"] == by_layout["onednn_packed"][name]["by_k"][2]["tau"]
    taus = [{w: r["tau"] for w, r in by_layout[layout]["block_width"]["d"]["by_k"].items()} for layout in by_layout]
    assert taus[0] == taus[1] and taus[0][2] > 1.0
    assert out["block_width"] == by_layout[out["chosen_layout"]]["block_width"]
    assert json.loads((tmp_path / "k.json").read_text())["chosen_layout"] == out["chosen_layout"]


def test_soft_loss_trains_and_validates(greedy_data):
    target, data_dir, _, _ = greedy_data
    loss = AcceptanceAlignedLoss(gamma=7.0, focal_weight=0.3, chain_weight=1.0, soft=True)
    module = make_module(target, loss=loss)
    datamodule = RegenDataModule(str(data_dir), batch_size=4, val_fraction=0.1, max_val_samples=2)
    trainer = make_trainer(1, fast_dev_run=1)
    trainer.fit(module, datamodule=datamodule)
    assert {"val/chain", "val/focal", "val/tau_soft"} <= set(trainer.callback_metrics)


# ----------------------------------------------------------------------------- resume and checkpoints


def _fit(target, data_dir, max_steps, ckpt_dir=None, resume_from=None):
    module = make_module(target, max_steps=8, num_anchors=4)
    datamodule = RegenDataModule(str(data_dir), batch_size=4, val_fraction=0.0)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0,
                                                     every_n_train_steps=2)] if ckpt_dir else []
    trainer = make_trainer(max_steps, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    return module, trainer


def test_resume_continues_at_the_right_step(greedy_data, tmp_path):
    target, _, _, _ = greedy_data
    ids, mask = left_padded_prompts([5] * 8, VOCAB, seed=3)
    data_dir = tmp_path / "data"
    write_shard(rows_of(ids, mask, [[7, 8, 9, 10, 11, 12]] * 8), data_dir)  # 8 rows, 2 steps per epoch
    write_meta(data_dir, {"complete": True})
    ckpt_dir = tmp_path / "ckpt"

    _fit(target, data_dir, 4, ckpt_dir)  # "killed" after 4 steps
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4
    assert all(k.startswith("drafter.") for k in ckpt["state_dict"])  # never the frozen target
    assert ckpt["drafter_config"]["block_size"] == 4
    assert all(int(s["step"]) == 4 for s in ckpt["optimizer_states"][0]["state"].values())

    resumed, trainer = _fit(target, data_dir, 8, ckpt_dir, resume_from=str(ckpt_dir / "last.ckpt"))
    assert trainer.global_step == 8
    state = trainer.optimizers[0].state_dict()["state"]
    assert all(int(s["step"]) == 8 for s in state.values())
    straight, _ = _fit(target, data_dir, 8)  # the same 8 steps without interruption
    for (name, a), b in zip(resumed.drafter.state_dict().items(), straight.drafter.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name

    other = tiny_target("llama", vocab_size=VOCAB + 16, hidden_size=64)
    module = make_module(other)
    with pytest.raises(ValueError, match="another target"):
        module.on_load_checkpoint(ckpt)
    module = make_module(target)
    ckpt["drafter_config"]["block_size"] = 8
    with pytest.raises(ValueError, match="block_size"):
        module.on_load_checkpoint(ckpt)


def test_ddp_spawn_two_processes(greedy_data):
    target, data_dir, _, _ = greedy_data
    module = make_module(target, num_anchors=4)
    datamodule = RegenDataModule(str(data_dir), batch_size=2, val_fraction=0.1, max_val_samples=2)
    trainer = make_trainer(2, strategy="ddp_spawn", devices=2, limit_val_batches=1, val_check_interval=2,
                           check_val_every_n_epoch=None)
    before = {k: v.clone() for k, v in module.drafter.state_dict().items()}
    trainer.fit(module, datamodule=datamodule)
    # ddp_spawn hands back rank 0's weights and metrics (not the loop state) to this process
    assert trainer.state.finished and "val/tau_greedy" in trainer.callback_metrics
    assert any(not torch.equal(before[k], v) for k, v in module.drafter.state_dict().items())


# ----------------------------------------------------------------------------- bad input


class NoHiddenStates(torch.nn.Module):
    """A causal LM wrapper that drops ``hidden_states`` from its outputs."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        return CausalLMOutputWithPast(logits=out.logits)


def test_training_steps_draw_lookup_served_anchors_less_validation_alike(monkeypatch):
    """module.lookup_anchor_weight reaches the training step's anchor draw (issue 74 item 6), not validation's."""
    target = make_target()
    module = make_module(target)
    module.lookup_anchor_weight = 0.2
    drawn = []

    def recording(*args):
        drawn.append(args[-1])
        return sample_anchors(*args)

    monkeypatch.setattr(blocks, "sample_anchors", recording)
    batch = collate([{"input_ids": [3, 4, 5, 3, 4, 6, 3, 4, 7], "prompt_len": 2}])
    states = target(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states
    module._blocks(batch, states, None, torch.Generator().manual_seed(0), weighted=True)  # a training step's
    module._blocks(batch, states, None, torch.Generator().manual_seed(0))  # a validation step's
    assert (drawn[0] < 1).nonzero()[:, 1].tolist() == [4, 7] and drawn[1] is None


def test_bad_targets_and_drafters_are_refused():
    target = make_target()
    with pytest.raises(ValueError, match="hidden_states"):
        factory.from_target(NoHiddenStates(target), block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        factory.from_target(target, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id"):
        factory.from_target(target, block_size=4, mask_token_id=VOCAB)
    drafter = factory.from_target(target, block_size=4)
    with pytest.raises(ValueError, match="different target"):
        DrafterLightningModule(drafter, make_target(), AcceptanceAlignedLoss(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="num_anchors"):
        DrafterLightningModule(drafter, target, AcceptanceAlignedLoss(), torch.optim.AdamW, num_anchors=0)
    with pytest.raises(ValueError, match="module.lookup_anchor_weight <= 1"):
        DrafterLightningModule(drafter, target, AcceptanceAlignedLoss(), torch.optim.AdamW, lookup_anchor_weight=0.0)


def test_choose_k_tree_replays_each_tree_and_hybrid_setting(greedy_data, trained):
    """experiments.pipeline.choose_k's trees: the τ of each best-first budget and hybrid setting, replayed from one
    teacher-forced pass, equals the online τ of that policy; the step cost counts the drafter only where it ran."""
    from drafters.policy import PolicyDrafter
    from drafters.tree import TreeDrafter
    from experiments.pipeline.choose_k import choose_tree, tree_settings
    from verify import PromptLookupDrafter

    target, _, eval_ids, eval_mask = greedy_data
    drafter = trained[0].drafter.eval()
    prompts = [row[m.bool()].tolist() for row, m in zip(eval_ids, eval_mask)]
    rows = [(p + target_generate(target, torch.tensor([p]), max_new_tokens=NEW).new_tokens[0], len(p)) for p in prompts]
    policies = tree_settings([2, 4], [1, 2], [3])
    target_ms = {w: 10.0 + w for w in range(1, 12)}
    picked = choose_tree(drafter, target, rows, None, policies, target_ms, rounds=2)
    assert set(picked["by_setting"]) == set(policies) and picked["chosen"]["tree"] in ("tree_n2", "tree_n4")
    for name, policy in policies.items():
        lookup = PromptLookupDrafter(drafter.vocab_size, policy.lookup_depth) if name.startswith("hybrid") else None
        online = TreeDrafter(PolicyDrafter(drafter), lookup, policy)
        steps = sum(speculative_generate(target, online, torch.tensor([ids[:cut]]), max_new_tokens=NEW).num_target_forwards
                    for ids, cut in rows)
        assert picked["by_setting"][name]["tau"] == pytest.approx(sum(len(i) - c for i, c in rows) / steps, abs=1e-4)
    assert picked["by_setting"]["tree_n4"]["tau"] >= picked["by_setting"]["tree_n2"]["tau"] > 1.0


@pytest.mark.parametrize("trees", [False, True])
def test_choose_k_times_every_width_on_the_same_context(trees):
    """choose_k's forward timing prefills once a round and crops each timed forward off again, so every width is
    timed on a cache of exactly ``context`` columns, as a step after a rejection runs."""
    from experiments.pipeline.choose_k import forward_ms

    target = make_target().eval()
    seen = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((kwargs["input_ids"].shape[1], cache.get_seq_length()))

    target.register_forward_pre_hook(record, with_kwargs=True)
    ms = forward_ms(target, [1, 3, 5], rounds=2, context=20, trees=trees)
    assert seen == [(20, 0), (1, 20), (3, 20), (5, 20)] * 2
    assert set(ms) == {1, 3, 5} and all(t > 0 for t in ms.values())
