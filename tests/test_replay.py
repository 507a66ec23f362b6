"""experiments.pipeline.replay: T=0 accepted counts replayed from the target's greedy answers equal the online
verifier's, prompt by prompt and step by step, for every drafter kind it replays (block drafter, with a narrowed
width or a candidate vocabulary too, ar_assistant, prompt_lookup), multi-turn prompts included; the answers are cached; what it cannot replay is refused."""

from __future__ import annotations

import pytest
import torch
from test_evaluate import _suites, _target, _tokenizer

import experiments.pipeline.evaluation as ev
from drafters import DraftingPolicy, PolicyDrafter, factory
from drafters.tree import TreeDrafter, TreePolicy
from experiments.pipeline import replay
from experiments.pipeline.choose_k import assistant_taus
from experiments.pipeline.settings import DecodingSettings
from verify import AssistantDrafter, PromptLookupDrafter
from verify.drafter import truncated_copy


@pytest.fixture(scope="module")
def setup():
    tok = _tokenizer()
    target = _target(tok).eval()
    torch.manual_seed(0)
    block = factory.from_target(target, block_size=5).eval()
    drafters = {
        "block": PolicyDrafter(block),
        "block_w2": PolicyDrafter(block, DraftingPolicy(max_draft_tokens=2)),
        "lookup": PromptLookupDrafter(len(tok), 4),
        "assistant": AssistantDrafter(truncated_copy(target, 1).eval(), 3),
        "tree": TreeDrafter(PolicyDrafter(block), None, TreePolicy(budget=6)),
        "tree_flat": TreeDrafter(PolicyDrafter(block), None, TreePolicy(budget=6, score_temperature=4.0)),
        "tree_chain": TreeDrafter(PolicyDrafter(block), None, TreePolicy(chain_width=3)),
        "hybrid": TreeDrafter(PolicyDrafter(block), PromptLookupDrafter(len(tok), 4),
                              TreePolicy(budget=3, lookup_min_match=1, lookup_depth=4, lookup_paths=2)),
        "merged": TreeDrafter(PolicyDrafter(block), PromptLookupDrafter(len(tok), 4),
                              TreePolicy(budget=3, lookup_depth=4, merge=True)),
        "lookup_tree": TreeDrafter(None, PromptLookupDrafter(len(tok), 4), TreePolicy(lookup_paths=3, lookup_depth=4)),
    }
    return tok, target, drafters


def _settings(**kw):
    return DecodingSettings(temperatures=(0.0,), max_new_tokens=24, batch_size=1, max_prompt_tokens=40,
                            num_bootstrap=50, progress=False, measure_target_only=False, **kw)


@pytest.mark.parametrize("name", ["block", "block_w2", "lookup", "assistant", "tree", "tree_flat", "tree_chain",
                                  "hybrid", "merged", "lookup_tree"])
def test_replayed_counts_equal_the_online_verifier(setup, name, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    accepted = 0
    for suite, prompts in _suites().items():  # "chat" holds a two-turn prompt
        online = ev.evaluate_suite(target, tok, drafters[name], prompts, suite=suite, temperature=0.0,
                                   settings=_settings())
        replayed = replay.replay_suite(target, tok, drafters[name], prompts, suite=suite, temperature=0.0,
                                       settings=_settings(replay_greedy=True))
        for ours, theirs in zip(replayed["prompts"], online["prompts"], strict=True):
            for key in ("id", "new_tokens", "steps", "new_tokens_per_turn", "accepted_counts"):
                assert ours[key] == theirs[key], (suite, key)
        assert replayed["tau"] == pytest.approx(online["tau"]) and replayed["replayed"]
        assert replayed["position_acceptance"] == pytest.approx(online["position_acceptance"])
        assert replayed["replay_argmax_mismatches"] == 0 and replayed["speedup"] is None
        accepted += sum(sum(p["accepted_counts"]) for p in replayed["prompts"])
    assert accepted > 0  # drafts do get accepted: the equality is not between empty walks


def test_replay_drafts_from_the_candidate_vocabulary(setup, tmp_path, monkeypatch):
    """A block drafter with a candidate vocabulary (drafter.draft_vocab_size) replays to the online counts, which
    differ from the whole vocabulary's: the candidates leave out every token the whole vocabulary's drafts get
    accepted for."""
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    prompts = [p for suite in _suites().values() for p in suite]
    block = drafters["block"].drafter
    turns = [t for answer in replay.greedy_answers(target, tok, prompts, suite="all", settings=_settings())[0]
             for t in answer]
    leads, _ = replay.block_leads(block, target, turns)
    accepted = {ids[a + i] for lead, (ids, _) in zip(leads, turns) for a, n in enumerate(lead) for i in range(1, n + 1)}
    assert accepted
    vocab = torch.tensor(sorted(set(range(block.vocab_size)) - accepted))
    counts = {}
    for name, candidates in (("whole", None), ("candidates", vocab)):
        drafter = PolicyDrafter(block, DraftingPolicy(), candidates)
        online = ev.evaluate_suite(target, tok, drafter, prompts, suite="all", temperature=0.0, settings=_settings())
        replayed = replay.replay_suite(target, tok, drafter, prompts, suite="all", temperature=0.0,
                                       settings=_settings(replay_greedy=True))
        counts[name] = [p["accepted_counts"] for p in online["prompts"]]
        assert [p["accepted_counts"] for p in replayed["prompts"]] == counts[name], name
        tree = TreeDrafter(drafter, None, TreePolicy(budget=3))  # its top candidates as a tree: the same both ways
        online = ev.evaluate_suite(target, tok, tree, prompts, suite="all", temperature=0.0, settings=_settings())
        replayed = replay.replay_suite(target, tok, tree, prompts, suite="all", temperature=0.0,
                                       settings=_settings(replay_greedy=True))
        assert [p["accepted_counts"] for p in replayed["prompts"]] == [p["accepted_counts"] for p in online["prompts"]]
    assert counts["whole"] != counts["candidates"]


def test_greedy_answers_are_cached_and_evaluate_dispatches_t0(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    prompts = _suites()["chat"]
    first, _ = replay.greedy_answers(target, tok, prompts, suite="chat", settings=_settings())
    assert [len(turns) for turns in first] == [len(p.turns) for p in prompts]
    assert len(list((tmp_path / "greedy").glob("chat-*.json"))) == 1
    monkeypatch.setattr(replay, "target_generate", None)  # a second call must not decode
    assert replay.greedy_answers(target, tok, prompts, suite="chat", settings=_settings())[0] == first
    out = ev.evaluate(target, tok, drafters["lookup"], {"chat": prompts}, _settings(replay_greedy=True))
    assert out["chat"]["t0"]["replayed"]


def test_target_passes_are_kept_beside_the_answers(setup, tmp_path, monkeypatch):
    """The target's teacher-forced passes over the greedy answers are kept beside them: a chain and a tree replayed
    on the same answers read them back without a target forward and count what a fresh pass counts; a damaged file
    is named and the target runs again."""
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    prompts, settings = _suites()["chat"], _settings(replay_greedy=True)

    def counts(name):
        out = replay.replay_suite(target, tok, drafters[name], prompts, suite="chat", temperature=0.0, settings=settings)
        return [p["accepted_counts"] for p in out["prompts"]]

    fresh = {name: counts(name) for name in ("block", "tree")}
    [kept] = (tmp_path / "greedy").glob("chat-*.states-*.pt")
    real = replay.run_target
    monkeypatch.setattr(replay, "run_target", None)  # every pass must come from the file
    assert {name: counts(name) for name in ("block", "tree")} == fresh
    kept.write_bytes(kept.read_bytes()[:-100])
    monkeypatch.setattr(replay, "run_target", real)
    with pytest.warns(UserWarning, match=r"cached target passes .*states.*running the target again"):
        assert counts("tree") == fresh["tree"]
    assert counts("block") == fresh["block"]  # written again, sealed


def test_greedy_answers_are_cached_per_weight_layout(setup, tmp_path, monkeypatch):
    """A layout's float rounding can flip a near-tied greedy token, so another layout's answers are decoded anew;
    row_major keeps the key it had before layouts existed (caches made then stay valid)."""
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, _ = setup
    prompts = _suites()["chat"]
    paths = {layout: replay._answers_path(target, tok, prompts, "chat", _settings(weight_layout=layout))
             for layout in ("row_major", "onednn_packed")}
    assert paths["row_major"] != paths["onednn_packed"]
    assert paths["row_major"] == replay._answers_path(target, tok, prompts, "chat", _settings())
    assert paths["row_major"].name == "chat-" + replay.settings_hash(
        replay.target_weights_sha1(target), str(next(target.parameters()).dtype), "chat",
        [[p.id, list(p.turns)] for p in prompts], 24, 40, 1, _settings().use_chat_template,
        replay.eos_token_ids(target, tok)) + ".json"


def test_what_cannot_be_replayed_is_refused(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    turns = [([1, 2, 3, 4, 5], 2)]
    confident = PolicyDrafter(drafters["block"].drafter, DraftingPolicy(confidence_threshold=0.5))
    with pytest.raises(ValueError, match="confidence_threshold=0.5.*replay_greedy=false"):
        replay.leads(confident, target, turns)
    with pytest.raises(ValueError, match="a object cannot be replayed"):
        replay.leads(object(), target, turns)
    with pytest.raises(ValueError, match="temperature 0 only"):
        replay.replay_suite(target, tok, drafters["lookup"], _suites()["chat"], suite="chat", temperature=1.0,
                            settings=_settings(replay_greedy=True))



def test_choose_k_assistant_taus_equal_the_online_verifier(setup, tmp_path, monkeypatch):
    """experiments.pipeline.choose_k scores the assistant at every K from one teacher-forced forward per row; each
    K's τ equals the online verifier's with an AssistantDrafter drafting K tokens a step."""
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    model, ks = drafters["assistant"].model, [1, 2, 4]
    for suite, prompts in _suites().items():
        turns, _ = replay.greedy_answers(target, tok, prompts, suite=suite, settings=_settings(replay_greedy=True))
        taus = assistant_taus(model, [turn for per_prompt in turns for turn in per_prompt], ks)
        for k in ks:
            online = ev.evaluate_suite(target, tok, AssistantDrafter(model, k), prompts, suite=suite,
                                       temperature=0.0, settings=_settings())
            assert taus[k] == pytest.approx(online["tau"]), (suite, k)
        assert taus[4] > 1.0  # drafts get accepted


def test_tree_and_hybrid_rows_are_built_from_a_saved_drafter(setup, tmp_path, monkeypatch):
    """conf/eval/drafter/tree.yaml and hybrid.yaml's builder: a saved block drafter drafting trees, with prompt lookup
    for the hybrid; its results.json description names the policy; a policy without a drafter is refused."""
    from experiments.pipeline.eval_drafters import tree_drafter

    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    tok, target, drafters = setup
    drafters["block"].drafter.save_pretrained(tmp_path / "drafter")
    hybrid = tree_drafter(target, str(tmp_path / "drafter"), name="hybrid", lookup=True, budget=3)
    assert isinstance(hybrid.drafter, TreeDrafter) and hybrid.drafter.lookup is not None
    assert hybrid.info["kind"] == "hybrid" and hybrid.info["config"]["tree_policy"]["budget"] == 3
    assert "best-first tree N=3" in hybrid.info["description"]
    prompts = [p for suite in _suites().values() for p in suite]
    online = ev.evaluate_suite(target, tok, hybrid.drafter, prompts, suite="all", temperature=0.0, settings=_settings())
    assert online["tau"] >= 1.0
    tree = tree_drafter(target, str(tmp_path / "drafter"), budget=2)
    assert tree.info["kind"] == "tree" and tree.drafter.lookup is None
    with pytest.raises(ValueError, match="needs a drafter"):
        tree_drafter(target, None, lookup=False)
    target.save_pretrained(tmp_path / "causal_lm")  # an autoregressive model cannot draft trees
    with pytest.raises(ValueError, match="drafts one chain token by token; drafter=tree and drafter=hybrid need a"):
        tree_drafter(target, str(tmp_path / "causal_lm"), lookup=True)
