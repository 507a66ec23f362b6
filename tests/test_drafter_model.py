"""DFlashDrafter: construction from HF targets, training/inference agreement, saving, errors."""

import pytest
import torch
from conftest import left_padded_prompts, tiny_target
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from drafters import DrafterConfig, DraftingPolicy, PolicyDrafter, factory
from drafters.checks import target_weights_sha1
from drafters.config import default_target_layer_ids
from drafters.draft_cache import DraftCache
from drafters.model import DFlashDrafter
from drafters.variants import REGISTRY
from drafters.variants.hint_lookup import HintStore
from verify.generate import speculative_generate
from verify.rejection import warp_probs

VOCAB = 96


def build_target(arch: str, vocab: int = VOCAB, layers: int = 3, seed: int = 0) -> nn.Module:
    """A tiny random target with 3 layers, GQA (llama, qwen2) and a non-default RoPE base (llama)."""
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          rope_theta=50000.0, bos_token_id=0, eos_token_id=1)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                          bos_token_id=0, eos_token_id=1)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=128,
                         bos_token_id=0, eos_token_id=1)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


ARCHS = ["llama", "qwen2", "gpt2"]


LAYERWISE = {"layerwise": {"shifted": True}}
HINTED = {**LAYERWISE, "hints": {}}
#: The core, each registered variant alone (with the variants it requires), and the combinations the
#: experiments train: every design runs the exactness tests below.
DESIGNS = {
    "dflash": {},
    **{name: {**{r: {} for r in REGISTRY[name].requires}, name: {}} for name in REGISTRY},
    "layerwise": LAYERWISE,
    "refine": {"refine": {"passes": 2}},
    "hinted": HINTED,
    "refined": {**HINTED, "refine": {"passes": 2}},
    "deep": {**HINTED, "anchor": {}},
    "frozen": {**HINTED, "anchor": {"frozen": True}},
}
#: Answers of a small hint store over the token range of :func:`_token_range` (drafters with store hints).
STORE_ROWS = [([3, 4, 5, 3, 4, 5, 1, 3, 4, 5], 2), ([4, 4, 5, 3, 5, 5, 3, 4], 2), ([5, 3, 3, 4, 5, 4, 3, 5], 3)]


def build_drafter(target, design: str, variants: dict | None = None, **kwargs) -> DFlashDrafter:
    """The drafter of ``DESIGNS[design]``. Layerwise designs read the target's hidden states 0 and 1 (2 layers),
    their layers copied from the target where it has Llama-style layers (not GPT-2); ``deep`` and ``frozen``
    have every target layer. Drafters with refinement or a hint store are in eval mode (so that training's
    forward does what drafting does). ``variants``: more variants than the design's."""
    variants = {**DESIGNS[design], **(variants or {})}
    if "layerwise" in variants:
        copy = hasattr(getattr(target, "model", None), "layers")
        layers = target.config.num_hidden_layers if "anchor" in variants else 2
        kwargs = {"num_layers": layers, "init_layers_from_target": copy, "qk_norm": not copy, **kwargs}
    drafter = factory.from_target(target, variants=variants, **kwargs)
    if "store_hints" in variants:
        drafter.hint_store = HintStore(STORE_ROWS)
    return drafter.eval() if {"refine", "store_hints"} & set(variants) else drafter


def _token_range(drafter) -> int:
    """Token ids to draw test sequences from: few with lookup hints, so that n-grams repeat."""
    return 6 if "hints" in drafter.variant_names else VOCAB


@pytest.fixture(scope="module", params=[(a, d) for d in DESIGNS for a in ARCHS],
                ids=lambda p: "-".join(p))
def target_and_drafter(request):
    arch, design = request.param
    target = build_target(arch)
    torch.manual_seed(1)
    return target, build_drafter(target, design, block_size=4)


def _run_target(target, ids):
    with torch.no_grad():
        return target(ids, output_hidden_states=True).hidden_states


# ---- construction -------------------------------------------------------------------------------


def test_default_target_layer_ids():
    assert default_target_layer_ids(1) == (1,)  # only the final state exists
    assert default_target_layer_ids(2) == (1,)
    assert default_target_layer_ids(4) == (1, 2, 3)
    assert default_target_layer_ids(6) == (1, 2, 3, 4, 5)
    ids = default_target_layer_ids(32)  # never the post-norm final state 32
    assert len(ids) == 5 and ids[0] == 1 and ids[-1] == 31 and list(ids) == sorted(set(ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_from_target_reads_sizes(arch):
    target = build_target(arch)
    drafter = factory.from_target(target, block_size=5, num_layers=2)
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.vocab_size, cfg.block_size, cfg.num_layers) == (32, 4, VOCAB, 5, 2)
    assert cfg.num_kv_heads == {"llama": 2, "qwen2": 1, "gpt2": 4}[arch]
    assert cfg.rope_theta == {"llama": 50000.0, "qwen2": 10000.0, "gpt2": 10000.0}[arch]
    assert cfg.target_layer_ids == (1, 2)  # 1..L-1 of a 3-layer target
    assert cfg.mask_token_id == VOCAB - 1
    assert cfg.target_fingerprint == {"model_type": arch, "vocab_size": VOCAB, "hidden_size": 32,
                                      "num_hidden_layers": 3, "weights_sha1": target_weights_sha1(target)}
    assert drafter.num_draft_tokens == 4 and drafter.vocab_size == VOCAB


def test_forward_train_shapes(target_and_drafter):
    target, drafter = target_and_drafter
    ids = torch.randint(0, VOCAB, (2, 12))
    states = _run_target(target, ids)
    logits = drafter.forward_train(states, ids, torch.arange(12).expand(2, 12), torch.tensor([[0, 5, 11], [2, 3, 7]]))
    assert logits.shape == (2, 3, 3, VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_mask_token_from_target_config():
    target = build_target("llama")
    target.config.mask_token_id = 7
    assert factory.from_target(target).config.mask_token_id == 7
    assert factory.from_target(target, mask_token_id=3).config.mask_token_id == 3


def test_hydra_config_builds_drafter():
    cfg = OmegaConf.load("conf/drafter/dflash.yaml")
    assert cfg.block_size == 16 and cfg.num_layers == 1 and cfg.target_layer_ids is None
    cfg.block_size = 4
    drafter = instantiate(cfg)(build_target("gpt2"))
    assert isinstance(drafter, DFlashDrafter) and drafter.num_draft_tokens == 3


# ---- training and inference agree ---------------------------------------------------------------


def _sequences(target, drafter, seed: int, rows: int, length: int = 14):
    """Random token rows (rows, length), their positions, the target's hidden states and the drafter's layers of them."""
    torch.manual_seed(seed)
    ids = torch.randint(0, _token_range(drafter), (rows, length))
    states = _run_target(target, ids)
    return ids, torch.arange(length).expand(rows, length), states, [states[i] for i in drafter.target_layer_ids]


def test_forward_train_matches_inference_per_block(target_and_drafter):
    target, drafter = target_and_drafter
    ids, pos, states, selected = _sequences(target, drafter, 2, 2)
    anchors = torch.tensor([[0, 4, 9], [3, 7, 13]])
    with torch.no_grad():
        train_logits = drafter.forward_train(states, ids, pos, anchors)
    for b in range(2):
        for a, t in enumerate(anchors[b].tolist()):
            drafter.reset(1)
            drafter.extend(ids[b : b + 1, :t], torch.ones(1, t, dtype=torch.long), pos[b : b + 1, :t],
                           [s[b : b + 1, :t] for s in selected])
            got = drafter.draft_logits(ids[b, t].view(1), pos[b, t].view(1))
            torch.testing.assert_close(got[0], train_logits[b, a], atol=2e-5, rtol=1e-4)


def test_forward_train_of_a_narrower_block_matches_drafting_it(target_and_drafter):
    """forward_train(width=W) gives slots 1..W the logits of a block of W + 1 columns, the block
    block_inputs(width=W) drafts (DraftingPolicy.own_draft_tokens; vLLM with W speculative tokens); they differ
    from the whole block's, so the width is not a no-op."""
    target, drafter = target_and_drafter
    ids, pos, states, selected = _sequences(target, drafter, 4, 1)
    anchors, width = torch.tensor([[3, 9]]), 2
    if "refine" in drafter.variants:  # several passes, which vLLM does not draft; refused, not approximated
        with pytest.raises(ValueError, match="one-pass drafters only"):
            drafter.forward_train(states, ids, pos, anchors, width=width)
        return
    with torch.no_grad():
        narrow = drafter.forward_train(states, ids, pos, anchors, width=width)
        whole = drafter.forward_train(states, ids, pos, anchors)
        for a, t in enumerate(anchors[0].tolist()):
            drafter.reset(1)
            drafter.extend(ids[:, :t], torch.ones(1, t, dtype=torch.long), pos[:, :t], [s[:, :t] for s in selected])
            got = drafter.head(drafter.block_states(drafter.block_inputs(ids[0, t].view(1), pos[0, t].view(1), width)))
            torch.testing.assert_close(got[0], narrow[0, a, :width], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(narrow[..., :width, :], whole[..., :width, :], atol=1e-3)
    with pytest.raises(ValueError, match="width=0"):
        drafter.forward_train(states, ids, pos, anchors, width=0)


def test_inference_with_holes_and_batching_matches_training(target_and_drafter):
    """Rows with different anchors share one column buffer padded with holes (masked columns)."""
    target, drafter = target_and_drafter
    torch.manual_seed(3)
    ids = torch.randint(0, _token_range(drafter), (2, 12))
    pos = torch.arange(12).expand(2, 12)
    states = _run_target(target, ids)
    selected = [states[i] for i in drafter.target_layer_ids]
    anchors = torch.tensor([[6], [10]])
    with torch.no_grad():
        train_logits = drafter.forward_train(states, ids, pos, anchors)[:, 0]  # (2, K, V)

    # Column layouts (None = hole): row 0 has left padding and rejected drafts in the middle.
    layouts = [[None, None, 0, 1, 2, None, None, 3, 4, 5, None, None], list(range(10)) + [None, None]]
    cols = len(layouts[0])
    col_ids = torch.randint(0, VOCAB, (2, cols))
    col_mask = torch.zeros(2, cols, dtype=torch.long)
    col_pos = torch.randint(0, 50, (2, cols))
    col_states = [torch.randn(2, cols, s.shape[-1]) for s in selected]
    for b, layout in enumerate(layouts):
        for c, src in enumerate(layout):
            if src is not None:
                col_ids[b, c], col_mask[b, c], col_pos[b, c] = ids[b, src], 1, pos[b, src]
                for cs, s in zip(col_states, selected):
                    cs[b, c] = s[b, src]
    drafter.reset(2)
    for lo, hi in [(0, 5), (5, 6), (6, cols)]:  # several extends, as in decoding
        drafter.extend(col_ids[:, lo:hi], col_mask[:, lo:hi], col_pos[:, lo:hi], [cs[:, lo:hi] for cs in col_states])
    got = drafter.draft_logits(ids[[0, 1], anchors[:, 0]], pos[[0, 1], anchors[:, 0]])
    torch.testing.assert_close(got, train_logits, atol=2e-5, rtol=1e-4)

    # select_rows keeps the chosen rows' caches, in order.
    drafter.select_rows(torch.tensor([1]))
    torch.testing.assert_close(drafter.draft_logits(ids[1, 10].view(1), pos[1, 10].view(1)), got[1:])


def test_forward_train_padding_and_invalid_anchors():
    target = build_target("llama")
    torch.manual_seed(4)
    drafter = factory.from_target(target, block_size=4)
    ids = torch.randint(0, VOCAB, (1, 10))
    states = _run_target(target, ids)
    with torch.no_grad():
        ref = drafter.forward_train(states, ids, torch.arange(10).view(1, 10), torch.tensor([[3, 8]]))
        # Left-pad by 3 garbage columns; positions derive from context_mask.
        pad_ids = torch.cat([torch.randint(0, VOCAB, (1, 3)), ids], 1)
        pad_states = tuple(torch.cat([torch.randn(1, 3, 32), s], 1) for s in states)
        ctx = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 10, dtype=torch.bool)], 1)
        got = drafter.forward_train(pad_states, pad_ids, None, torch.tensor([[6, 0, 11]]),
                                    anchor_mask=torch.tensor([[True, False, True]]), context_mask=ctx)
    torch.testing.assert_close(got[:, [0, 2]], ref, atol=2e-5, rtol=1e-4)
    assert torch.isfinite(got).all()  # the padding anchor sees only its own block: no NaN


def test_block_labels_brute_force():
    drafter = factory.from_target(build_target("llama"), block_size=4)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    anchors = torch.randint(0, 9, (3, 4), generator=g)
    anchor_mask = torch.rand(3, 4, generator=g) > 0.2
    valid = torch.rand(3, 9, generator=g) > 0.2
    labels, mask = drafter.block_labels(ids, anchors, anchor_mask, valid)
    assert labels.shape == mask.shape == (3, 4, 3)
    for b in range(3):
        for a in range(4):
            t = int(anchors[b, a])
            ok = bool(anchor_mask[b, a]) and bool(valid[b, t])
            for k in range(1, 4):
                ok = ok and t + k < 9 and bool(valid[b, t + k])
                assert bool(mask[b, a, k - 1]) == ok
                assert int(labels[b, a, k - 1]) == (int(ids[b, t + k]) if ok else 0)


def test_gradients_reach_drafter_only():
    target = build_target("qwen2")
    drafter = factory.from_target(target, block_size=4)
    ids = torch.randint(0, VOCAB, (2, 10))
    states = _run_target(target, ids)
    anchors = torch.tensor([[1, 5], [2, 6]])
    logits = drafter.forward_train(states, ids, torch.arange(10).expand(2, 10), anchors)
    labels, mask = drafter.block_labels(ids, anchors)
    loss = nn.functional.cross_entropy(logits[mask], labels[mask])
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert target.get_input_embeddings().weight.grad is None
    assert target.get_output_embeddings().weight.grad is None


# ---- drafting -------------------------------------------------------------------------------------


def test_draft_greedy_and_sampled():
    target = build_target("gpt2")
    torch.manual_seed(6)
    drafter = factory.from_target(target, block_size=5)
    ids = torch.randint(0, VOCAB, (2, 6))
    states = _run_target(target, ids)
    drafter.reset(2)
    drafter.extend(ids[:, :5], torch.ones(2, 5, dtype=torch.long), torch.arange(5).expand(2, 5),
                   [states[i][:, :5] for i in drafter.target_layer_ids])
    anchor, anchor_pos = ids[:, 5], torch.tensor([5, 5])
    logits = drafter.draft_logits(anchor, anchor_pos)  # (2, 4, V)

    tokens, q = drafter.draft(anchor, anchor_pos)
    assert q is None and torch.equal(tokens, logits.argmax(-1))

    g = torch.Generator().manual_seed(0)
    tokens, q = drafter.draft(anchor, anchor_pos, temperature=0.7, top_k=4, generator=g)
    assert tokens.shape == (2, 4) and q.shape == (2, 4, VOCAB) and q.dtype == torch.float32
    torch.testing.assert_close(q, warp_probs(logits, temperature=0.7, top_k=4))
    assert (q.gather(-1, tokens.unsqueeze(-1)) > 0).all()

    # Empirical frequencies of each slot's draws match q: 4000 copies of row 0 in one batch.
    n = 4000
    drafter.reset(n)
    drafter.extend(ids[:1, :5].expand(n, 5), torch.ones(n, 5, dtype=torch.long), torch.arange(5).expand(n, 5),
                   [states[i][:1, :5].expand(n, 5, -1) for i in drafter.target_layer_ids])
    g = torch.Generator().manual_seed(1)
    draws, q_many = drafter.draft(anchor[:1].expand(n), anchor_pos[:1].expand(n), temperature=0.7, top_k=4,
                                  generator=g)  # (N, 4), (N, 4, V)
    torch.testing.assert_close(q_many[0], q[0], atol=2e-5, rtol=1e-4)
    freq = nn.functional.one_hot(draws, VOCAB).float().mean(0)  # (4, V)
    assert (freq - q[0]).abs().max() < 0.03


# ---- saving, loading, and the target kept out of the drafter ------------------------------------


def test_target_weights_not_in_drafter_state(target_and_drafter):
    target, drafter = target_and_drafter
    keys = list(drafter.state_dict())
    assert not any(("embed" in k or "lm_head" in k or "wte" in k) for k in keys)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(t.data_ptr() in target_ptrs for t in drafter.state_dict().values())
    if drafter.config.num_layers < target.config.num_hidden_layers:  # a deep drafter has every layer, no embedding
        assert sum(p.numel() for p in drafter.parameters()) < sum(p.numel() for p in target.parameters())
    assert not target.get_input_embeddings().weight.requires_grad


def test_save_load_round_trip(tmp_path, target_and_drafter):
    target, drafter = target_and_drafter
    drafter.save_pretrained(tmp_path / "d")
    assert (tmp_path / "d" / "model.safetensors").is_file() and (tmp_path / "d" / "config.json").is_file()
    loaded = factory.load(tmp_path / "d", target=target)
    assert loaded.config == drafter.config
    ids = torch.randint(0, VOCAB, (2, 9))
    states = _run_target(target, ids)
    args = (states, ids, torch.arange(9).expand(2, 9), torch.tensor([[2, 6], [4, 8]]))
    with torch.no_grad():
        assert torch.equal(loaded.forward_train(*args), drafter.forward_train(*args))


@pytest.mark.parametrize(
    "other, field",
    [(lambda: build_target("llama", vocab=128), "vocab_size"),
     (lambda: build_target("llama", layers=2), "num_hidden_layers"),
     (lambda: build_target("qwen2"), "model_type")],
)
def test_mismatched_target_refused(tmp_path, other, field):
    drafter = factory.from_target(build_target("llama"), block_size=4)
    drafter.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=field):
        factory.load(tmp_path, target=other())
    with pytest.raises(ValueError, match=field):
        drafter.attach_target(other())


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        factory.load(tmp_path / "nowhere")
    drafter = factory.from_target(build_target("llama"), block_size=4)
    drafter.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        factory.load(tmp_path)


# ---- bad input ------------------------------------------------------------------------------------


class NoHiddenStates(nn.Module):
    """A causal LM wrapper whose output never carries hidden states."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, **kwargs):
        return CausalLMOutputWithPast(logits=self.inner(input_ids).logits)


def test_bad_inputs():
    target = build_target("llama")
    with pytest.raises(ValueError, match="block_size"):
        factory.from_target(target, block_size=1)
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match="mask_token_id"):
            factory.from_target(target, mask_token_id=bad)
    with pytest.raises(ValueError, match="target_layer_ids"):
        factory.from_target(target, target_layer_ids=(1, 4))
    with pytest.raises(ValueError, match="hidden_states"):
        factory.from_target(NoHiddenStates(target))
    with pytest.raises(ValueError, match="config"):
        factory.from_target(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown drafter overrides"):
        factory.from_target(target, hidden_dim=8)
    with pytest.raises(ValueError, match="hidden_size"):
        factory.from_target(target, hidden_size=64)

    drafter = factory.from_target(target, block_size=4)
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="output_hidden_states"):
        drafter.forward_train(None, ids, None, torch.tensor([[2]]))
    with pytest.raises(ValueError, match="out of range"):
        drafter.forward_train(_run_target(target, ids)[:2], ids, None, torch.tensor([[2]]))
    with pytest.raises(RuntimeError, match="reset"):
        DFlashDrafter(drafter.config).extend(ids, torch.ones_like(ids), ids, None)
    drafter.reset(1)
    with pytest.raises(ValueError, match="hidden states"):
        drafter.extend(ids, torch.ones_like(ids), ids, None)
    with pytest.raises(RuntimeError, match="attach_target"):
        DFlashDrafter(drafter.config).forward_train(_run_target(target, ids), ids, None, torch.tensor([[2]]))
    with pytest.raises(ValueError, match="unknown DrafterConfig keys"):
        DrafterConfig.from_dict({**drafter.config.to_dict(), "extra": 1})


# ---- exactness through the verifier ----------------------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("lengths", [[6], [3, 7, 5]])
def test_greedy_speculative_decoding_equals_target_greedy(family, lengths, design):
    """A random drafter changes only the speed: the output is the target's greedy output."""
    target = tiny_target(family, vocab_size=64)  # shared builder: pad 0, bos 1, eos 2
    torch.manual_seed(7)
    drafter = build_drafter(target, design, block_size=4)
    ids, mask = left_padded_prompts(lengths, 64, seed=1)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=2)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=2,
                              pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert all(0 <= n <= 3 for counts in out.accepted_counts for n in counts)


@pytest.mark.parametrize("design", ["dflash", "frozen"])
def test_narrow_drafting_keeps_greedy_identity_and_drafts_fewer_slots(design):
    """own_draft_tokens = 2 of K = 5 (a shifted block or DFlash's): the greedy output is the target's, and with no
    hint copied every step verifies 2 drafts, where the whole block verifies 5."""
    target = tiny_target("llama", vocab_size=64)
    torch.manual_seed(7)
    drafter = build_drafter(target, design, block_size=6)
    ids, mask = left_padded_prompts([3, 7, 5], 64, seed=1)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, eos_token_id=2, pad_token_id=0)
    whole = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=2)
    narrow = speculative_generate(target, PolicyDrafter(drafter, DraftingPolicy(own_draft_tokens=2)), ids,
                                  attention_mask=mask, max_new_tokens=24, eos_token_id=2)
    assert torch.equal(narrow.sequences, ref) and torch.equal(whole.sequences, ref)
    assert narrow.num_verified_slots <= 2 * narrow.num_batched_forwards < whole.num_verified_slots
    assert all(0 <= n <= 2 for counts in narrow.accepted_counts for n in counts)


def _counting(select_rows, calls: list):
    """``select_rows`` that appends the number of rows kept to ``calls``."""
    def wrapped(rows):
        calls.append(len(rows))
        return select_rows(rows)
    return wrapped


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_drafter_with_the_targets_keys_and_values_reads_the_targets_cache(family):
    """``frozen``/``layerwise`` designs (layers copied from the target): the drafter reads its context from the
    target's KV cache (no cache of its own) and drafts exactly what it drafts with its own, rows dropped as they
    finish; with one k projection changed its keys are not the target's and it keeps its own. Output: greedy."""
    target = tiny_target(family, vocab_size=64, num_layers=3, init_range=0.5)
    ids, mask = left_padded_prompts([3, 9, 5, 6], 64, seed=3)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, eos_token_id=2,
                              pad_token_id=0)
    for design in ("frozen", "layerwise"):
        torch.manual_seed(7)
        drafter = build_drafter(target, design, block_size=5)
        selected = []
        drafter.select_rows = _counting(drafter.select_rows, selected)
        runs = {}
        for share in (True, False):
            policy = PolicyDrafter(drafter, DraftingPolicy(share_target_cache=share))
            out = speculative_generate(target, policy, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=2)
            assert torch.equal(out.sequences, ref)
            assert drafter.shares_target_cache == share, (design, share)
            runs[share] = out.accepted_counts
        assert runs[True] == runs[False], design
        assert selected, "no row finished before the others: the test does not exercise select_rows"
    with torch.no_grad():
        drafter.layers[1].attn.k_proj.weight.add_(0.05)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=2)
    assert torch.equal(out.sequences, ref) and not drafter.shares_target_cache
    gpt2 = tiny_target("gpt2", vocab_size=64)  # layers not copied (not Llama-style): its keys are its own
    drafter = build_drafter(gpt2, "layerwise", block_size=4)
    speculative_generate(gpt2, drafter, ids, attention_mask=mask, max_new_tokens=8)
    assert not drafter.shares_target_cache


def test_sampled_speculative_decoding_runs_with_q():
    target = tiny_target("llama", vocab_size=64)
    drafter = factory.from_target(target, block_size=4)
    ids, mask = left_padded_prompts([4, 6], 64, seed=2)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, temperature=1.0,
                               top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert [len(t) for t in out.new_tokens] == [16, 16]
    assert 1.0 <= out.tau <= 4.0


def test_copy_target_layers_first_and_last():
    """init_layers_from_target copies the target's first layers; ``first`` picks later ones."""
    from drafters.layers import copy_target_layers

    target = build_target("llama")  # 3 decoder layers
    drafter = factory.from_target(target, block_size=4, num_layers=1, qk_norm=False,
                                                init_layers_from_target=True)
    layers = target.model.layers
    assert torch.equal(drafter.layers[0].attn.q_proj.weight, layers[0].self_attn.q_proj.weight)
    assert not torch.equal(drafter.layers[0].attn.q_proj.weight, layers[2].self_attn.q_proj.weight)
    copied = copy_target_layers(drafter, target, first=2)
    assert copied == 9  # q, k, v, o, two norms, gate, up, down
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, layers[2].mlp.down_proj.weight)
    assert torch.equal(drafter.layers[0].input_norm.weight, layers[2].input_layernorm.weight)
    with pytest.raises(ValueError, match=">= 4 decoder layers"):
        copy_target_layers(drafter, target, first=3)


def test_the_draft_cache_keeps_its_columns_as_it_grows_and_when_rows_are_selected():
    torch.manual_seed(0)
    cache = DraftCache(rows=3, num_layers=2, num_kv_heads=1, head_dim=4, like=torch.zeros(1))
    keys, ids = [], []
    for n in (5, 70, 2):  # the second append grows the buffers past their first capacity
        cache.reserve(cache.columns + n)
        kv = [(torch.randn(3, 1, n, 4), torch.randn(3, 1, n, 4)) for _ in range(2)]
        ids.append(torch.randint(0, 9, (3, n)))
        cache.append(kv, torch.rand(3, n) > 0.3, ids[-1])
        keys.append(kv[1][0])
    keys, ids = torch.cat(keys, dim=2), torch.cat(ids, dim=1)
    assert cache.columns == 77 and cache.mask_buffer.shape[1] >= 75 + 64  # grown by at least 64 columns
    assert torch.equal(cache.kv_buffers()[1][0][:, :, :77], keys) and torch.equal(cache.ids, ids)
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.rows == 2 and torch.equal(cache.kv_buffers()[1][0][:, :, :77], keys[[2, 0]])
    assert torch.equal(cache.ids, ids[[2, 0]])
    assert cache.open_block(3).shape == (2, 80) and cache.open_block(3)[:, 77:].all()  # a block sees itself
    with pytest.raises(RuntimeError, match="before the first extend"):
        cache.offer([])
