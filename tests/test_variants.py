"""The variants of the DFlash drafter (drafters.variants): composition by name, their configs (old flat
checkpoints included), what each changes, and that the DFlash export refuses them."""

import json

import pytest
import torch
from test_drafter_model import VOCAB, build_target
from torch import nn

from drafters import DFlashDrafter, factory
from drafters.factory import check_same_config
from drafters.variants import REGISTRY

# ---- the layerwise design -----------------------------------------------------------------------


def test_layerwise_context_starts_as_the_targets_own_keys_and_values():
    """Layers copied from a Llama target, each reading the input of the target layer it copies: the
    context keys/values are the target's own (its KV cache, computed by Hugging Face), layer by layer."""
    target = build_target("llama")  # 3 layers, GQA, RoPE base 50000
    drafter = factory.from_target(target, block_size=4, num_layers=2, variants={"layerwise": {"shifted": True}},
                                  init_layers_from_target=True, qk_norm=False,
                                                target_layer_ids=[1, 2])
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, use_cache=True)
        kv = drafter.context_kv([out.hidden_states[i] for i in (1, 2)], torch.arange(9).expand(2, 9))
    cache = out.past_key_values
    for i, layer in enumerate((1, 2)):  # drafter layer i copied target layer 1 + i and reads its input
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        torch.testing.assert_close(kv[i][0], keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv[i][1], values, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(kv[0][0], cache.layers[0].keys, atol=1e-3)  # not any layer's: the one it copies


@pytest.mark.slow
@pytest.mark.parametrize("num_layers, at_least", [(6, 0.7), (2, 0.4)])
def test_shifted_layerwise_drafter_starts_drafting_the_embedded_targets_next_token(num_layers, at_least):
    """Before any training, a layerwise drafter whose layers are copies of the embedded target's first
    layers already predicts the target's greedy next token at slot 1 when slots are shifted (the anchor's
    output: an early exit of the target, perturbed only by the MASK slots it also attends to), and
    almost never when slot 1 is read from the MASK position (DFlash's layout). Measured: 0.83 / 0.13
    with all 6 layers, 0.50 / 0.03 with 2, over 80 greedy tokens of three prompts."""
    from experiments.data.target import TINY_TARGET_DIR, load_target

    target, tok = load_target(str(TINY_TARGET_DIR))
    target.float()
    agreement = {}
    for shifted in (True, False):
        drafter = factory.from_target(target, block_size=16, num_layers=num_layers,
                                      variants={"layerwise": {"shifted": shifted}}, init_layers_from_target=True,
                                                    qk_norm=False)
        hits = total = 0
        for prompt in ("def add(a, b):\n", "Q: Tom has 3 apples and buys 5 more. How many apples?\nA:",
                       "Hello, how are you today?"):
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                seq = target.generate(ids, max_new_tokens=40, do_sample=False)
                anchors = torch.arange(ids.shape[1], seq.shape[1] - 1)[None]
                logits = drafter.forward_train(target(seq, output_hidden_states=True).hidden_states, seq, None,
                                               anchors)
            hits += int((logits[0, :, 0].argmax(-1) == seq[0, anchors[0] + 1]).sum())
            total += anchors.shape[1]
        agreement[shifted] = hits / total
    assert agreement[True] >= at_least and agreement[False] <= 0.3, agreement


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("causal_anchor", [True, False])
def test_untrained_drafter_with_every_target_layer_and_causal_anchor_is_the_target_at_slot_1(arch, causal_anchor):
    """Every layer copied, shifted, layerwise: with ``causal_anchor`` the anchor's output (slot 1) is the
    target's own next-token logits at the anchor, in training and at inference; without it the anchor also
    reads the block's MASK slots, which move those logits."""
    target = build_target(arch)
    drafter = factory.from_target(target, block_size=5, num_layers=3, init_layers_from_target=True, qk_norm=False,
                                  variants={"layerwise": {"shifted": True}, **({"anchor": {}} if causal_anchor else {})})
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        anchors = torch.tensor([[3, 7, 11], [0, 5, 9]])
        slot1 = drafter.forward_train(out.hidden_states, ids, None, anchors)[:, :, 0]  # (2, A, V)
        drafter.reset(2)
        drafter.extend(ids[:, :7], torch.ones(2, 7, dtype=torch.long), torch.arange(7).expand(2, 7),
                       [out.hidden_states[i][:, :7] for i in drafter.target_layer_ids])
        drafted = drafter.draft_logits(ids[:, 7], torch.full((2,), 7))[:, 0]  # (2, V)
    want = out.logits.gather(1, anchors[..., None].expand(-1, -1, out.logits.shape[-1]))  # (2, A, V)
    close = torch.allclose(slot1, want, atol=1e-4, rtol=1e-4)
    assert close == causal_anchor
    assert torch.allclose(drafted, out.logits[:, 7], atol=1e-4, rtol=1e-4) == causal_anchor


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_a_frozen_anchor_drafter_moves_slots_2_to_K_never_slot_1(arch):
    """``frozen_anchor``: after optimiser steps on every slot, slot 1 is still the target's own next-token logits
    (training forward and inference) while the other slots moved; without the flag the same steps move slot 1."""
    from drafters.training.optim import weight_decay_groups

    target = build_target(arch)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 7, 8], [0, 7, 9]])  # block 1 of each row: anchor 7, the one drafted below
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    want = out.logits.gather(1, anchors[..., None].expand(-1, -1, out.logits.shape[-1]))  # (2, A, V)
    moved = {}
    for frozen in (True, False):
        torch.manual_seed(0)
        drafter = factory.from_target(target, block_size=4, num_layers=target.config.num_hidden_layers,
                                                    init_layers_from_target=True, qk_norm=False,
                                      variants={"layerwise": {"shifted": True}, "anchor": {"frozen": frozen}})
        before = drafter.forward_train(out.hidden_states, ids, None, anchors).detach()  # (2, A, K, V)
        optimizer = torch.optim.AdamW(weight_decay_groups(drafter), lr=1e-2, weight_decay=0.1)
        labels = torch.randint(0, VOCAB, before.shape[:-1], generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            logits = drafter.forward_train(out.hidden_states, ids, None, anchors)
            loss = nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            after = drafter.forward_train(out.hidden_states, ids, None, anchors)
            drafter.reset(2)
            drafter.extend(ids[:, :7], torch.ones(2, 7, dtype=torch.long), torch.arange(7).expand(2, 7),
                           [out.hidden_states[i][:, :7] for i in drafter.target_layer_ids])
            drafted = drafter.draft_logits(ids[:, 7], torch.full((2,), 7))  # (2, K, V)
        assert torch.allclose(before[..., 0, :], want, atol=1e-4, rtol=1e-4)  # untrained: the target's own
        assert (after[..., 1:, :] - before[..., 1:, :]).abs().max() > 1e-2  # slots 2..K trained either way
        assert torch.allclose(drafted[:, 1:], after[:, 1, 1:], atol=1e-4, rtol=1e-4)  # inference = training
        moved[frozen] = (after[..., 0, :] - want).abs().max().item(), (drafted[:, 0] - out.logits[:, 7]).abs().max().item()
    assert max(moved[True]) < 1e-4 and min(moved[False]) > 1e-2, moved
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert "layers.0.mlp.up_proj.weight" in trainable and "layers.0.attn.k_proj.weight" in trainable  # unfrozen run


def test_frozen_anchor_needs_a_causal_shifted_anchor():
    target = build_target("llama")
    with pytest.raises(ValueError, match="frozen_anchor needs causal_anchor and shifted"):
        factory.from_target(target, num_layers=2, variants={"layerwise": {}, "anchor": {"frozen": True}})
    drafter = factory.from_target(target, num_layers=2,
                                  variants={"layerwise": {"shifted": True}, "anchor": {"frozen": True}})
    frozen = {n for n, p in drafter.named_parameters() if not p.requires_grad}
    assert {"norm.weight", "layers.1.input_norm.weight", "layers.1.attn.k_proj.weight", "layers.1.attn.v_proj.weight",
            "layers.1.attn.anchor_q_proj.weight", "layers.1.anchor_mlp.down_proj.weight"} <= frozen
    assert not frozen & {"layers.1.attn.q_proj.weight", "layers.1.attn.o_proj.weight", "layers.1.mlp.gate_proj.weight"}


def test_layerwise_config_errors():
    target = build_target("llama")
    with pytest.raises(ValueError, match="each of the 2 drafter layers reads one target hidden state"):
        factory.from_target(target, num_layers=2, variants={"layerwise": {}}, target_layer_ids=[1, 2, 3])
    drafter = factory.from_target(target, num_layers=2, variants={"layerwise": {"shifted": True}})
    assert drafter.target_layer_ids == (0, 1) and not hasattr(drafter, "fuse")
    assert not any("fuse" in k for k in drafter.state_dict())


# ---- composition, configs, the LM head's vocabulary subset ----------------------------------------


def test_variants_are_named_objects_of_the_one_class():
    """Variants are Variant objects the one drafter class holds, in the registry's order; unknown names, unknown
    options, missing requirements and the flat switches of older configs are named."""
    target = build_target("llama")
    drafter = factory.from_target(target, num_layers=2, variants={"layerwise": {}, "hints": {}})
    assert type(drafter) is DFlashDrafter and drafter.variant_names == ("hints", "layerwise")
    assert all(isinstance(drafter.variants[n], REGISTRY[n]) for n in ("hints", "layerwise"))
    with pytest.raises(ValueError, match=r"unknown drafter variants \['dspark'\]"):
        factory.from_target(target, variants={"dspark": {}})
    with pytest.raises(ValueError, match="store_hints needs hints"):
        factory.from_target(target, variants={"store_hints": {}})
    with pytest.raises(ValueError, match=r"variant 'hints': unknown options \['max_gram'\]"):
        factory.from_target(target, variants={"hints": {"max_gram": 2}})
    with pytest.raises(ValueError, match="unknown drafter overrides"):
        factory.from_target(target, lookup_hint=True)
    with pytest.raises(ValueError, match=r"flat switches of older configs.*lookup_hints -> variants.hints"):
        factory.from_target(target, lookup_hints=True)


def _legacy_config(drafter) -> dict:
    """The flat config.json an older blockdraft wrote for ``drafter`` (every research switch a field)."""
    from experiments.pipeline.eval_drafters import record_settings

    return drafter.config.to_dict() | record_settings(drafter.variants)


@pytest.mark.parametrize("variants", [{}, {"layerwise": {"shifted": True}, "hints": {}},
                                      {"layerwise": {"shifted": True}, "anchor": {"frozen": True},
                                       "refine": {"passes": 2}}])
def test_old_flat_checkpoints_load_into_their_variants(tmp_path, variants):
    """A drafter folder whose config.json has the old flat fields loads into the variants they name, with the
    same weights and logits; a saved folder round-trips in the new format (``variants``)."""
    target = build_target("llama")
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=4, num_layers=2, variants=variants).eval()
    drafter.save_pretrained(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert set(saved["variants"]) == set(drafter.variant_names) and "layerwise_context" not in saved
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.safetensors").write_bytes((tmp_path / "new" / "model.safetensors").read_bytes())
    (tmp_path / "old" / "config.json").write_text(json.dumps(_legacy_config(drafter)))
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        want = drafter.forward_train(states, ids, None, torch.tensor([[3, 6]]))
        for folder in ("new", "old"):
            loaded = factory.load(tmp_path / folder, target)
            assert type(loaded) is type(drafter) and loaded.variants == drafter.variants
            torch.testing.assert_close(loaded.forward_train(states, ids, None, torch.tensor([[3, 6]])), want)


def test_saved_configs_with_unknown_variants_or_fields_are_refused(tmp_path):
    target = build_target("llama")
    drafter = factory.from_target(target, block_size=4)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for bad, message in ((config | {"variants": {"dspark": {}}}, r"config.json: unknown drafter variants \['dspark'\]"),
                         ({k: v for k, v in config.items() if k != "variants"} | {"store_hints": True}, "store_hints needs hints"),
                         (config | {"extra": 1}, r"unknown DrafterConfig keys \['extra'\]")):
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            factory.load(tmp_path, target)


def test_resuming_checks_the_variants_and_reads_old_flat_checkpoints():
    """check_same_config (resuming training): an old flat drafter_config of the same drafter passes; another
    variant's options are named."""
    target = build_target("llama")
    drafter = factory.from_target(target, num_layers=2, variants={"layerwise": {"shifted": True}, "hints": {}})
    check_same_config(drafter.saved_config(), drafter.saved_config())
    check_same_config(_legacy_config(drafter), drafter.saved_config())
    other = factory.from_target(target, num_layers=2, variants={"layerwise": {}, "hints": {}})
    with pytest.raises(ValueError, match="variants: checkpoint .*'shifted': False.*now .*'shifted': True"):
        check_same_config(other.saved_config(), drafter.saved_config())


def test_with_variant_keeps_the_weights_and_checks_the_options():
    target = build_target("llama")
    drafter = factory.from_target(target, block_size=4).eval()
    refined = factory.with_variant(drafter, "refine", passes=3)
    assert refined.variant_names == ("refine",) and not refined.training and refined.target is target
    assert all(torch.equal(a, b) for a, b in zip(refined.state_dict().values(), drafter.state_dict().values()))
    assert factory.without_variant(refined, "refine").variants == {}
    with pytest.raises(ValueError, match="refine_passes must be >= 1"):
        factory.with_variant(drafter, "refine", passes=0)


@pytest.mark.parametrize("design", ["dflash", "refined"])
def test_logits_over_a_vocabulary_subset_are_the_full_logits_columns(design):
    """``vocab_ids`` (V',): forward_train and block_logits give the columns ``vocab_ids`` of the full logits, in
    train and eval mode. With refinement the subset is the whole vocabulary reordered, so that the argmax the
    next pass reads is the same token (mapped back to its id)."""
    from test_drafter_model import build_drafter

    target = build_target("qwen2")
    torch.manual_seed(3)
    drafter = build_drafter(target, design, block_size=4)
    ids = torch.randint(0, 6, (2, 12), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[2, 5, 8], [1, 4, 9]])
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))
    vocab_ids = order if design == "refined" else order[:17]
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        for mode in (drafter.train, drafter.eval):
            mode()
            full = drafter.forward_train(states, ids, None, anchors)
            subset = drafter.forward_train(states, ids, None, anchors, vocab_ids=vocab_ids)
            assert subset.shape == (*full.shape[:-1], len(vocab_ids))
            torch.testing.assert_close(subset, full[..., vocab_ids], atol=1e-5, rtol=1e-5)
        kv = drafter.context_kv(drafter.select_hidden_states(states), torch.arange(12).expand(2, 12))
        one_pass = drafter.block_logits(ids.gather(1, anchors), anchors, kv, drafter.training_mask(anchors, 12))
        logits = drafter.block_logits(ids.gather(1, anchors), anchors, kv, drafter.training_mask(anchors, 12),
                                      vocab_ids=vocab_ids)
    torch.testing.assert_close(logits, one_pass[..., vocab_ids], atol=1e-5, rtol=1e-5)


def test_composed_drafters_pickle():
    """ddp_spawn pickles the training module: the one class and its variant objects pickle as they are."""
    import pickle

    attached = factory.from_target(build_target("llama"), num_layers=2, variants={"layerwise": {}, "hints": {}})
    drafter = factory.build(attached.config, attached.variants)  # no target: the test pickles the drafter only
    clone = pickle.loads(pickle.dumps(drafter))
    assert type(clone) is DFlashDrafter
    assert clone.variants == drafter.variants
    assert all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(), drafter.state_dict().values()))


# ---- the hooks, declared on Variant ---------------------------------------------------------------

#: Methods of a variant that are its own helpers, not hooks the drafter calls.
VARIANT_HELPERS = {"hints": {"hinted_slots"}, "store_hints": {"weak_hints"}}


def test_every_variant_method_is_a_hook_declared_on_variant():
    """A variant's public methods are hooks of the Variant base class (a misspelt one would never be called)
    or its named helpers; the base class's defaults leave every hook to the core."""
    from drafters.model import Variant

    hooks = {name for name in vars(Variant) if not name.startswith("_") and callable(getattr(Variant, name))}
    assert {"new_layer", "after_init", "context_kv", "drafted_slots", "own_mask", "slot_ids", "train_logits",
            "shareable_layers", "slot_inputs", "block_passes", "source_labels", "layer_sources",
            "save_extras", "load_extras", "default_layer_ids", "check"} <= hooks
    for name, klass in REGISTRY.items():
        own = {m for m in vars(klass) if not m.startswith("_") and callable(getattr(klass, m))}
        assert own - hooks - VARIANT_HELPERS.get(name, set()) == set(), name
    attached = factory.from_target(build_target("llama"), num_layers=2)
    base = Variant()
    assert base.drafted_slots(attached) is None and base.own_mask(attached, 4, "cpu") is None
    assert base.new_layer(attached) is None and base.default_layer_ids(2, 3) is None
