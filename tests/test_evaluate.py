"""experiments.evaluate: every results.json field, multi-turn feedback, resume after a kill, the Hydra
entry point, and clear errors. Tiny random target (byte-level BPE tokenizer, vocab 300) and a
randomly initialised DFlashDrafter saved to disk and loaded by path."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from conftest import tiny_target

import experiments.evaluate as ev_cli
import experiments.pipeline.evaluation as ev
import experiments.speed as speed_cli
from drafters import DraftingPolicy, PolicyDrafter, factory
from experiments.data.suites import Prompt
from experiments.pipeline import speed
from experiments.pipeline.records import TIMING_KEYS
from experiments.pipeline.settings import DecodingSettings

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

K = 3  # block size 4
MAX_NEW = 6
BUDGET = 40  # max_prompt_tokens
CODE = ["def add(a, b):", "def mul(x, y):\n    \"\"\"Multiply x by y, then check the result: \"\"\"\n" + "    # ok\n" * 30]
CHAT = [["Hello there, how are you?", "And what is 2 + 3?"], ["Tell me a joke."]]


def _tokenizer():
    from experiments.data.tokenizer import train_tokenizer

    texts = CODE + [t for turns in CHAT for t in turns] + ["The answer is 5. Fine, thank you."]
    return train_tokenizer(texts * 10, vocab_size=300, min_frequency=1)


def _target(tok, seed=0, hidden_size=32):
    target = tiny_target(vocab_size=len(tok), max_positions=128, init_range=0.5, seed=seed, hidden_size=hidden_size)
    for config in (target.config, target.generation_config):
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
    return target


def _suites():
    return {
        "code": [Prompt(f"code/{i}", "code", [t]) for i, t in enumerate(CODE)],
        "chat": [Prompt(f"chat/{i}", "dialogue", turns) for i, turns in enumerate(CHAT)],
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A saved target + tokenizer, a saved drafter for it, jsonl suites, and a drafter for another target."""
    root = tmp_path_factory.mktemp("eval_assets")
    tok = _tokenizer()
    target = _target(tok)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    torch.manual_seed(0)
    factory.from_target(target, block_size=K + 1).save_pretrained(root / "drafter")
    factory.from_target(_target(tok, hidden_size=48), block_size=K + 1).save_pretrained(root / "other")
    (root / "code.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in CODE))
    (root / "chat.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in CHAT))
    return root


@pytest.fixture(scope="module")
def results(assets):
    """One evaluate() call without Hydra, on both suites at T=0 and T=1, recording every decoding call."""
    from experiments.data.target import load_target

    target, tok = load_target(str(assets / "target"))
    drafter = factory.load(assets / "drafter", target=target)
    calls, warm_ups = [], []

    def spy(target, drafter, input_ids, *, attention_mask, **kwargs):
        out = ev_generate(target, drafter, input_ids, attention_mask=attention_mask, **kwargs)
        prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        warm = kwargs["max_new_tokens"] == ev.WARM_UP_NEW_TOKENS != MAX_NEW  # the untimed decode before a suite
        (warm_ups if warm else calls).append((kwargs["temperature"], prompts, out.new_tokens))
        return out

    ev_generate = ev.speculative_generate
    mp = pytest.MonkeyPatch()
    mp.setattr(ev, "speculative_generate", spy)
    try:
        settings = DecodingSettings(temperatures=(0.0, 1.0), max_new_tokens=MAX_NEW, batch_size=2,
                                    max_prompt_tokens=BUDGET, num_bootstrap=200, progress=False)
        out = ev.evaluate(target, tok, drafter, _suites(), settings)
    finally:
        mp.undo()
    # one untimed warm-up decode per (suite, T) before the timed ones, of its first batch
    assert [(t, len(p)) for t, p, _ in warm_ups] == [(0.0, 2), (1.0, 2)] * 2  # code: 2 prompts; chat: 2 prompts
    return out, tok, calls


def test_evaluate_fields(results):
    out, tok, _ = results
    assert list(out) == ["code", "chat"] and all(list(v) == ["t0", "t1"] for v in out.values())
    for suite, entries in out.items():
        for key, e in entries.items():
            assert e["suite"] == suite and e["temperature"] == float(key[1:]) and e["K"] == K
            records = e["prompts"]
            assert [r["id"] for r in records] == [p.id for p in _suites()[suite]]
            new = sum(r["new_tokens"] for r in records)
            steps = sum(r["steps"] for r in records)
            assert e["new_tokens"] == new and e["target_forwards"] == steps
            assert e["tau"] == pytest.approx(new / steps)
            assert e["tau_macro"] == pytest.approx(sum(r["new_tokens"] / r["steps"] for r in records) / len(records))
            assert e["tau_ci_low"] <= e["tau"] <= e["tau_ci_high"] and 1 <= e["tau"] <= K + 1
            assert len(e["accept_hist"]) == K + 1 and sum(e["accept_hist"]) == steps
            assert len(e["position_acceptance"]) == K
            for r in records:
                assert len(r["accepted_counts"]) == r["steps"] == sum(r["steps_per_turn"])
                assert r["new_tokens"] == sum(r["new_tokens_per_turn"]) and len(r["steps_per_turn"]) == r["turns"]
                assert all(n == MAX_NEW for n in r["new_tokens_per_turn"])  # a random model never emits EOS here
            assert e["num_turns"] == sum(r["turns"] for r in records)
            assert K - 1 <= e["mean_draft_width"] <= K  # all K drafts each step, but a row's last ones cut to its budget
            assert e["spec_tokens_per_s"] > 0 and e["target_tokens_per_s"] > 0
            assert e["speedup"] == pytest.approx(e["spec_tokens_per_s"] / e["target_tokens_per_s"])
            assert e["target_new_tokens"] == e["num_turns"] * MAX_NEW
            assert e["greedy_match"] == (1.0 if key == "t0" else None)  # exactness at T=0
            assert e["by_draft_source"] == {} and all(r["draft_sources"] == [] for r in records)  # not hinted
            json.dumps(e)  # serialisable
    from experiments.data.prompts import encode_prompt

    long = sum(len(encode_prompt(tok, [t], [])) > BUDGET for t in CODE)
    assert long == 1 and out["code"]["t0"]["truncated_prompts"] == long


def test_second_turn_follows_own_answer(results):
    """Turn 2 is asked after the model's own turn-1 answer from the same speculative run."""
    from experiments.data.prompts import encode_prompt

    out, tok, calls = results
    turns = CHAT[0]
    for temperature in (0.0, 1.0):
        rounds = [(p, n) for t, ps, ns in calls if t == temperature for p, n in zip(ps, ns)]
        first = [n for p, n in rounds if p == encode_prompt(tok, turns[:1], [])[-BUDGET:]]
        assert len(first) == 1
        answer = tok.decode(first[0], skip_special_tokens=True).strip()
        second = encode_prompt(tok, turns, [answer])[-BUDGET:]
        assert answer and sum(p == second for p, _ in rounds) == 1
        record = out["chat"][ev.temperature_key(temperature)]["prompts"][0]
        assert record["id"] == "chat/0" and record["turns"] == 2
    # per (suite, T): code in 1 batch, chat turn 1 in 1 batch and turn 2 in another
    assert len(calls) == 2 * (1 + 2)


def test_logged_metric_names():
    entry = {"tau": 2.0, "tau_macro": 1.9, "speedup": None, "position_acceptance": [0.5, None]}
    metrics = ev.logged_metrics("humaneval", "t0", entry)
    assert metrics == {"eval/humaneval/tau_t0": 2.0, "eval/humaneval/tau_macro_t0": 1.9, "eval/humaneval/a1_t0": 0.5}
    assert ev.temperature_key(1.0) == "t1" and ev.temperature_key(0.7) == "t0.7"


def test_errors(results, assets):
    from experiments.data.target import load_target

    target, tok = load_target(str(assets / "target"))
    drafter = factory.load(assets / "drafter", target=target)
    with pytest.raises(ValueError, match="suite 'code' is empty"):
        ev.evaluate(target, tok, drafter, {"code": []}, DecodingSettings(progress=False))
    with pytest.raises(ValueError, match="no suites"):
        ev.evaluate(target, tok, drafter, {}, DecodingSettings(progress=False))
    with pytest.raises(ValueError, match="exceeds the target's 128 positions"):
        ev.evaluate(target, tok, drafter, _suites(), DecodingSettings(max_new_tokens=64, max_prompt_tokens=100,
                                                                      progress=False))


# ----------------------------------------------------------------------------- Hydra entry point


def _overrides(assets, run_dir, drafter="drafter"):
    chat = f"{{_target_:experiments.data.suites.load_jsonl,_convert_:all,path:'{assets / 'chat.jsonl'}'," \
           "prompt_field:turns,name:chat}"
    return [
        "target=hf", f"target.path={assets / 'target'}", f"drafter.path={assets / drafter}",
        "suite=jsonl", f"suite.jsonl.path={assets / 'code.jsonl'}", "suite.jsonl.prompt_field=turns",
        f"+suite.chat={chat}", f"max_new_tokens={MAX_NEW}", "batch_size=2", f"max_prompt_tokens={BUDGET}",
        "num_bootstrap=200", "progress=false",
    ] + ([f"paths.run_dir={run_dir}"] if run_dir is not None else [])


def _compose(overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="evaluate", overrides=overrides)


def _untimed(doc):
    return {s: {k: {f: v for f, v in e.items() if f not in TIMING_KEYS} for k, e in entries.items()}
            for s, entries in doc["results"].items()}


@pytest.fixture(scope="module")
def hydra_run(assets, tmp_path_factory):
    """``python -m experiments.evaluate ...`` run in-process through @hydra.main."""
    runs = tmp_path_factory.mktemp("runs")
    run_dir = runs / "fresh"
    argv = ["experiments.evaluate", *_overrides(assets, None), f"hydra.run.dir={run_dir}"]
    mp = pytest.MonkeyPatch()
    mp.setenv("BLOCKDRAFT_RUNS", str(runs))
    mp.setenv("HYDRA_FULL_ERROR", "1")
    mp.setattr(sys, "argv", argv)
    try:
        ev_cli.main()
    finally:
        mp.undo()
    return run_dir


def test_hydra_entry_point(hydra_run, assets):
    doc = json.loads((hydra_run / "results.json").read_text())
    assert set(doc) >= {"config", "settings", "drafter", "target", "git_commit", "machine", "results"}
    assert doc["machine"]["isa"] == torch.backends.cpu.get_cpu_capability()  # what its speeds hold for
    assert doc["config"]["drafter"]["path"] == str(assets / "drafter")
    assert doc["config"]["results_path"] == str(hydra_run / "results.json")
    assert doc["drafter"]["config"]["block_size"] == K + 1
    assert doc["drafter"]["config"]["target_fingerprint"]["hidden_size"] == 32
    assert doc["target"] == {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
                             "path": str(assets / "target")}
    assert doc["git_commit"] is None or len(doc["git_commit"]) == 40
    assert set(doc["results"]) == {"jsonl", "chat"} and all(set(v) == {"t0", "t1"} for v in doc["results"].values())
    assert [r["turns"] for r in doc["results"]["chat"]["t1"]["prompts"]] == [2, 1]
    with open(hydra_run / "logs" / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert {"eval/jsonl/tau_t0", "eval/chat/tau_t1", "eval/chat/speedup_t0", "eval/jsonl/a1_t1"} <= set(header)


def test_resume_after_kill(hydra_run, assets, tmp_path, monkeypatch):
    """Kill after the first (suite, temperature); the restart skips it and ends with the same numbers."""
    run_dir = tmp_path / "killed"
    cfg = _compose(_overrides(assets, run_dir))
    real, calls = ev.evaluate_suite, []

    def dying(*args, **kwargs):
        calls.append(kwargs["suite"])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the job dies during the second (suite, temperature)
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "evaluate_suite", dying)
    with pytest.raises(KeyboardInterrupt):
        ev.run_evaluation(cfg)
    partial = json.loads((run_dir / "results.json").read_text())
    assert {s: list(v) for s, v in partial["results"].items()} == {"jsonl": ["t0"]}

    calls.clear()
    monkeypatch.setattr(ev, "evaluate_suite", lambda *a, **kw: calls.append(kw["suite"]) or real(*a, **kw))
    doc = ev.run_evaluation(cfg)
    assert len(calls) == 3  # jsonl/t0 was skipped
    fresh = json.loads((hydra_run / "results.json").read_text())
    assert _untimed(doc) == _untimed(fresh)
    assert json.loads((run_dir / "results.json").read_text())["results"] == doc["results"]
    with open(run_dir / "logs" / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert "eval/jsonl/tau_t0" in header  # the skipped entry is logged again by the restarted logger

    from experiments import report as rp

    summary = rp.main([str(hydra_run), str(run_dir), "--out", str(tmp_path / "report"), "--names", "uniform",
                       "resumed", "--num-bootstrap", "100"])
    for key in ("t0", "t1"):
        cell = summary["table"][key]["chat"]["resumed"]  # same numbers: no gain, a degenerate paired interval
        assert cell["gain"] == 0 and cell["gain_ci_low"] == cell["gain_ci_high"] == 0
    assert (tmp_path / "report" / "tau.png").stat().st_size > 0

    calls.clear()
    ev.run_evaluation(cfg)  # everything done: nothing runs
    assert calls == []
    other = _compose(_overrides(assets, run_dir) + ["max_new_tokens=5"])
    with pytest.raises(ValueError, match="settings.max_new_tokens: 6 -> 5"):
        ev.run_evaluation(other)


def test_entry_point_errors(assets, tmp_path):
    with pytest.raises(FileNotFoundError, match="drafter.path=.*no such directory"):
        ev.run_evaluation(_compose(_overrides(assets, tmp_path / "a", drafter="missing")))
    with pytest.raises(ValueError, match="does not fit target.path=.*hidden_size: drafter was built for 48"):
        ev.run_evaluation(_compose(_overrides(assets, tmp_path / "b", drafter="other")))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(Exception, match="suite 'jsonl': no prompts"):  # the loader's error (wrapped by Hydra)
        ev.run_evaluation(_compose(_overrides(assets, tmp_path / "c") + [f"suite.jsonl.path={empty}"]))


# ----------------------------------------------------------------------------- baselines


@pytest.fixture(scope="module")
def baseline_runs(assets, tmp_path_factory):
    """``drafter=prompt_lookup`` and ``drafter=ar_assistant drafter.path=<a tiny HF LM>`` at T=0 and T=1."""
    tok = _tokenizer()
    _target(tok, seed=3).save_pretrained(assets / "assistant")
    runs = tmp_path_factory.mktemp("baselines")
    docs = {}
    from drafters.training.datamodule import write_shard

    answers = [tok(t)["input_ids"] for t in ["The answer is 5. Fine, thank you.", "def add(a, b):\n    # ok"]]
    write_shard([{"id": f"r{i}", "domain": "dialogue", "input_ids": [1, 2, *a], "prompt_len": 2}
                 for i, a in enumerate(answers)], assets / "regen")
    for choice, extra in (("prompt_lookup", []), ("ar_assistant", [f"drafter.path={assets / 'assistant'}"]),
                          ("corpus_lookup", [f"drafter.data_dir={assets / 'regen'}"])):
        overrides = [o for o in _overrides(assets, runs / choice) if not o.startswith("drafter.path=")]
        docs[choice] = ev.run_evaluation(_compose([*overrides, f"drafter={choice}", *extra]))
    return runs, docs


def test_baselines_through_the_entry_point(baseline_runs, assets):
    runs, docs = baseline_runs
    lookup, assistant = docs["prompt_lookup"], docs["ar_assistant"]
    assert lookup["drafter"]["name"] == "prompt_lookup" and lookup["drafter"]["kind"] == "prompt_lookup"
    assert lookup["drafter"]["config"] == {"num_draft_tokens": 15, "max_ngram": 3, "min_ngram": 1}
    assert assistant["drafter"]["name"] == "ar_assistant" and assistant["drafter"]["path"] == str(assets / "assistant")
    assert assistant["drafter"]["config"]["num_draft_tokens"] == 15 and assistant["drafter"]["num_parameters"] > 0
    for doc in docs.values():
        assert doc["drafter"]["description"].startswith("baseline")
        for entries in doc["results"].values():
            assert set(entries) == {"t0", "t1"}
            assert entries["t0"]["greedy_match"] == 1.0 and entries["t0"]["K"] == 15  # exact at T=0
            assert len(entries["t1"]["accept_hist"]) == 16
    assert json.loads((runs / "prompt_lookup" / "results.json").read_text())["drafter"]["name"] == "prompt_lookup"
    corpus = docs["corpus_lookup"]["drafter"]
    assert (corpus["name"], corpus["kind"], corpus["path"]) == ("corpus_lookup", "corpus_lookup", str(assets / "regen"))
    for entries in docs["corpus_lookup"]["results"].values():  # every step labelled by what drafted it
        for e in entries.values():
            assert set(e["by_draft_source"]) <= {"prompt", "store", "anchor"}
            assert sum(v["row_steps"] for v in e["by_draft_source"].values()) == e["target_forwards"]
            assert sum(v["mean_accepted"] * v["row_steps"] for v in e["by_draft_source"].values()) == pytest.approx(
                sum(sum(r["accepted_counts"]) for r in e["prompts"]))
    assert corpus["config"]["answers"] == 2 and corpus["config"]["prompt_min_ngram"] == 2


def test_report_names_baseline_rows(baseline_runs, hydra_run, tmp_path):
    from experiments import report as rp

    runs, _ = baseline_runs
    summary = rp.main([str(hydra_run), str(runs / "prompt_lookup"), str(runs / "ar_assistant"), "--out",
                       str(tmp_path / "report"), "--baseline", "fresh", "--num-bootstrap", "50"])
    names = [c["name"] for c in summary["configurations"]]
    assert names == ["fresh", "prompt_lookup", "ar_assistant"]
    assert summary["training_curves"] == {}
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| prompt_lookup |" in text and "| ar_assistant |" in text and "— baseline: copies what followed" in text
    assert set(summary["table"]["t0"]["mean"]) == set(names)


def test_baseline_errors(assets, tmp_path):
    other = tiny_target(vocab_size=64)
    other.save_pretrained(tmp_path / "small_vocab")
    base = [o for o in _overrides(assets, tmp_path / "a") if not o.startswith("drafter.path=")]
    with pytest.raises(ValueError, match="does not fit target.path=.*outputs 64 tokens, the target 300"):
        ev.run_evaluation(_compose([*base, "drafter=ar_assistant", f"drafter.path={tmp_path / 'small_vocab'}"]))
    with pytest.raises(FileNotFoundError, match="drafter.path=.*no such directory"):
        ev.run_evaluation(_compose([*base, "drafter=ar_assistant", f"drafter.path={tmp_path / 'missing'}"]))
    with pytest.raises(ValueError, match="min_ngram"):
        ev.run_evaluation(_compose([*base, "drafter=prompt_lookup", "drafter.min_ngram=4"]))
    with pytest.raises(FileNotFoundError, match="drafter.data_dir=.*no such directory; give a regenerated data folder"):
        ev.run_evaluation(_compose([*base, "drafter=corpus_lookup", f"drafter.data_dir={tmp_path / 'missing'}"]))
    with pytest.raises(TypeError, match="not an evaluation drafter"):
        ev.run_evaluation(_compose([*base, "drafter=dflash"]))  # training's drafter group: refused with a clear error


def test_block_drafter_confidence_threshold(assets):
    """drafter.confidence_threshold reaches the loaded drafter and its results.json config; bad values are named."""
    from experiments.data.target import load_target
    from experiments.pipeline.eval_drafters import block_drafter

    target, _ = load_target(str(assets / "target"))
    plain = block_drafter(target, str(assets / "drafter"))
    assert plain.drafter.policy.confidence_threshold is None and "confidence_threshold" not in plain.info["config"]
    cut = block_drafter(target, str(assets / "drafter"), confidence_threshold=0.4)
    assert cut.drafter.policy.confidence_threshold == 0.4 and cut.info["config"]["confidence_threshold"] == 0.4
    with pytest.raises(ValueError, match=r"drafter.confidence_threshold=1.5"):
        block_drafter(target, str(assets / "drafter"), confidence_threshold=1.5)
    with pytest.raises(ValueError, match=r"drafter.follow_hint_min_ngram=2 needs drafter.follow_hint_after"):
        block_drafter(target, str(assets / "drafter"), follow_hint_min_ngram=2)
    assert plain.drafter.variant_names == () and plain.info["config"]["refine_passes"] == 0
    refined = block_drafter(target, str(assets / "drafter"), refine_passes=2)
    assert refined.drafter.variants["refine"].passes == 2 and refined.info["config"]["refine_passes"] == 2
    assert block_drafter(target, str(assets / "drafter"), refine_passes=0).drafter.variant_names == ()
    with pytest.raises(ValueError, match=r"drafter.refine_passes=-1"):
        block_drafter(target, str(assets / "drafter"), refine_passes=-1)
    assert plain.drafter.policy.max_draft_tokens is None and "max_draft_tokens" not in plain.info["config"]
    short = block_drafter(target, str(assets / "drafter"), max_draft_tokens=3)
    assert short.drafter.policy.max_draft_tokens == 3 and short.info["config"]["max_draft_tokens"] == 3
    k = plain.drafter.num_draft_tokens
    with pytest.raises(ValueError, match=rf"drafter.max_draft_tokens={k + 1}: must be in 1..{k}"):
        block_drafter(target, str(assets / "drafter"), max_draft_tokens=k + 1)
    assert plain.drafter.policy.own_draft_tokens is None and "own_draft_tokens" not in plain.info["config"]
    narrow = block_drafter(target, str(assets / "drafter"), own_draft_tokens=2)
    assert narrow.drafter.policy.own_draft_tokens == 2 and narrow.info["config"]["own_draft_tokens"] == 2
    for bad in (0, k + 1):
        with pytest.raises(ValueError, match=rf"drafter.own_draft_tokens={bad}: must be in 1..{k}"):
            block_drafter(target, str(assets / "drafter"), own_draft_tokens=bad)
    assert plain.drafter.policy.min_drafting_rows is None and "min_drafting_rows" not in plain.info["config"]
    for bad in (0, 2):  # below 1, or without follow_hint_after=0
        with pytest.raises(ValueError, match=rf"drafter.min_drafting_rows={bad}: must be >= 1 and needs "
                                             r"drafter.follow_hint_after=0 \(got None\)"):
            block_drafter(target, str(assets / "drafter"), min_drafting_rows=bad)


def test_block_drafter_hint_data_dir(assets, tmp_path):
    """drafter.hint_data_dir: a store-hints drafter reads its hints from every answer of another data folder
    (recorded in results.json's config); a drafter without store hints, or a missing folder, is named."""
    from drafters.training.datamodule import write_shard
    from drafters.variants.hint_lookup import HintStore
    from experiments.data.target import load_target
    from experiments.pipeline.eval_drafters import block_drafter

    target, _ = load_target(str(assets / "target"))
    drafter = factory.from_target(target, block_size=K + 1, variants={"hints": {}, "store_hints": {}})
    drafter.hint_store = HintStore([([5, 6, 7, 8], 2)])
    drafter.save_pretrained(tmp_path / "store_drafter")
    rows = [([1, 2, 10 + i, 11 + i, 12 + i], 2) for i in range(3)]
    write_shard([{"id": f"r{i}", "domain": "code", "input_ids": ids, "prompt_len": n} for i, (ids, n) in enumerate(rows)],
                tmp_path / "regen")
    saved = block_drafter(target, str(tmp_path / "store_drafter"))
    assert saved.drafter.hint_store.rows == [([5, 6, 7, 8], 2)] and saved.info["config"]["hint_store_answers"] == 1
    bigger = block_drafter(target, str(tmp_path / "store_drafter"), hint_data_dir=str(tmp_path / "regen"))
    assert bigger.drafter.hint_store.rows == [(list(ids), n) for ids, n in rows]
    assert bigger.info["config"]["hint_store_answers"] == 3
    assert bigger.info["config"]["hint_data_dir"] == str(tmp_path / "regen")
    with pytest.raises(ValueError, match="drafter.hint_data_dir=.*not trained with store_hints"):
        block_drafter(target, str(assets / "drafter"), hint_data_dir=str(tmp_path / "regen"))
    with pytest.raises(FileNotFoundError, match="drafter.hint_data_dir=.*no such directory"):
        block_drafter(target, str(tmp_path / "store_drafter"), hint_data_dir=str(tmp_path / "missing"))


def test_suite_steps_bench_times_every_speculative_step(assets, tmp_path):
    """experiments.bench.suite_steps: the evaluation's decoding with a step clock; one clock step per verification
    step plus one prefill per batch, every verification step timed in its draft and target parts."""
    from experiments.bench import suite_steps
    from experiments.bench.profiling import StepClock
    from experiments.data.target import load_target

    target, tok = load_target(str(assets / "target"))
    drafter = factory.load(assets / "drafter", target=target).eval()
    settings = DecodingSettings(temperatures=(0.0,), max_new_tokens=MAX_NEW, batch_size=2, max_prompt_tokens=BUDGET,
                                num_bootstrap=50, progress=False)
    clock = StepClock()
    entry = ev.evaluate_suite(target, tok, drafter, _suites()["code"], suite="code", temperature=0.0,
                              settings=settings, clock=clock)
    batches = -(-len(CODE) // 2)
    assert len(clock.steps) == entry["batched_forwards"] + batches
    verification = [s for s in clock.steps if "prefill" not in s]
    assert len(verification) == entry["batched_forwards"]
    assert all({"draft", "target_forward", "verify"} <= set(s) for s in verification)
    # the laps lie inside the decodes (not the target-only runs between them): they sum to at most their wall time
    laps = sum(v for s in clock.steps for k, v in s.items() if "@" not in k)
    assert 0.5 * entry["spec_wall_time_s"] < laps <= entry["spec_wall_time_s"]
    out = tmp_path / "steps.json"
    doc = suite_steps.main([o for o in _overrides(assets, None) if not o.startswith("+suite.chat")] + ["--out", str(out)])
    summary = json.loads(out.read_text())["suites"]["jsonl"]["t0"]
    assert summary == doc["suites"]["jsonl"]["t0"] and summary["tau"] == pytest.approx(entry["tau"])
    parts = summary["ms_per_step"]
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if "@" not in k and k != "total"))
    assert parts["target_forward"] > 0 and parts["draft"] > 0 and "draft_states@draft" in parts
    assert parts["total"] * summary["batched_forwards"] <= 1e3 * summary["spec_wall_time_s"]


def test_interleave_bench_runs_each_variant_each_round(tmp_path):
    """experiments.bench.interleave: every (round, variant, suite) evaluated once, in that order, with the
    variant's own drafter settings; its τ is the plain evaluation's; the summary means each variant's rounds."""
    from experiments.bench import interleave

    out = tmp_path / "ab.json"
    doc = interleave.main(["drafter=prompt_lookup", "suite=humaneval", "suite.humaneval.limit=2", "max_new_tokens=6",
                           "num_threads=1", "progress=false", "--variants", "drafter.max_ngram=3",
                           "drafter.max_ngram=1 drafter.num_draft_tokens=2", "--rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == doc and doc["overrides"][-1] == "temperatures=[0.0]"
    long, short = (doc["summary"][v]["humaneval"] for v in doc["variants"])
    assert len(long["tau"]) == len(short["speedup"]) == 2 and long["tau"][0] == long["tau"][1]
    assert long["mean_speedup"] == pytest.approx(sum(long["speedup"]) / 2)
    assert max(short["mean_draft_width"]) <= 2 < max(long["mean_draft_width"])  # the variant's own K
    with pytest.raises(SystemExit):
        interleave.main(["--variants", "a=1", "a=1"])


def test_portable_override_writes_cache_and_runs_folders_by_their_variables(tmp_path, monkeypatch):
    """Records (benchmarks', choose_k's) name a data folder of the cache as $BLOCKDRAFT_CACHE/..., a run as $BLOCKDRAFT_RUNS/...,
    each override of a space-joined variant so, and leave other values as given."""
    from experiments.pipeline.paths import portable_override
    from experiments.pipeline.records import write_record

    cache, runs = tmp_path / "cache", tmp_path / "runs"
    (cache / "regen" / "tiny" / "abc").mkdir(parents=True)
    (runs / "train" / "x" / "drafter").mkdir(parents=True)
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(cache))
    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(runs))
    variant = f"drafter.hint_data_dir={cache}/regen/tiny/abc drafter.path={runs}/train/x/drafter drafter.min_drafting_rows=3"
    assert portable_override(variant) == ("drafter.hint_data_dir=$BLOCKDRAFT_CACHE/regen/tiny/abc "
                                          "drafter.path=$BLOCKDRAFT_RUNS/train/x/drafter drafter.min_drafting_rows=3")
    assert portable_override(f"drafter.path={tmp_path}/missing") == f"drafter.path={tmp_path}/missing"
    # a script's arguments (choose_k's --data-dir, --drafter NAME=DIR)
    doc = write_record({"config": {"data_dir": f"{cache}/regen/tiny/abc", "rows": 4, "out": None,
                                   "drafter": [f"l2r_all={runs}/train/x/drafter"]}}, tmp_path / "r.json")
    assert doc["config"] == {"data_dir": "$BLOCKDRAFT_CACHE/regen/tiny/abc", "rows": 4, "out": None,
                             "drafter": ["l2r_all=$BLOCKDRAFT_RUNS/train/x/drafter"]}
    # the record's own path (a file not yet written, choose_k's --out) under the runs' folder
    out = runs / "main" / "choose_k.json"
    assert write_record({"config": {"out": str(out)}}, out)["config"] == {"out": "$BLOCKDRAFT_RUNS/main/choose_k.json"}
    # the machine it was measured on, down to the vector ISA torch's kernels use (speed ratios differ by it)
    assert doc["machine"]["isa"] == torch.backends.cpu.get_cpu_capability() and doc["machine"]["cpu"]
    assert json.loads((tmp_path / "r.json").read_text())["machine"] == doc["machine"]


def test_training_runs_evaluate_with_the_drafters_inference_settings(tmp_path, monkeypatch):
    """``evaluate.drafter`` of a training config reaches the trained drafter's builder (not the decoding settings,
    not a baseline's evaluation); a key the block drafter does not have is refused by name."""
    from omegaconf import OmegaConf

    seen = []
    monkeypatch.setattr(ev, "run_evaluation", lambda cfg: seen.append(cfg) or {})
    cfg = OmegaConf.create({
        "paths": {"run_dir": str(tmp_path)}, "target": {"path": "t"}, "suite": {},
        "logger": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(tmp_path)},
        "evaluate": {"enabled": True, "seed": 3, "drafter": {"follow_hint_after": 0, "own_draft_tokens": 3}}})
    ev.evaluate_training_run(cfg)
    (eval_cfg,) = seen
    assert eval_cfg.drafter.path == str(tmp_path / "drafter") and eval_cfg.drafter.name is None
    assert (eval_cfg.drafter.follow_hint_after, eval_cfg.drafter.own_draft_tokens) == (0, 3)
    assert eval_cfg.seed == 3 and "enabled" not in eval_cfg
    baseline = {"_target_": "experiments.pipeline.eval_drafters.prompt_lookup_drafter"}
    ev.evaluate_like_training(cfg, baseline, tmp_path / "baseline")
    assert OmegaConf.to_container(seen[-1].drafter) == baseline
    cfg.evaluate.drafter = {"own_draft_token": 3}
    with pytest.raises(ValueError, match=r"evaluate\.drafter\.own_draft_token: not a setting .*own_draft_tokens"):
        ev.evaluate_training_run(cfg)


def test_draft_cost_bench_times_each_width_and_leaves_the_drafter_as_it_was(monkeypatch):
    """experiments.bench.draft_cost.measure: a positive median per drafter width and target width, the drafter's
    own_draft_tokens restored, its candidate vocabulary kept at every width; the prefill leaves every row's anchor
    out of the cache."""
    from experiments.bench import draft_cost
    from experiments.pipeline.timing import prefill

    tok = _tokenizer()
    target = _target(tok)
    block = factory.from_target(target, num_layers=2, block_size=K + 1,
                                variants={"layerwise": {"shifted": True}, "anchor": {"frozen": True}})
    vocab = torch.arange(0, block.vocab_size, 2)
    drafter = PolicyDrafter(block, DraftingPolicy(own_draft_tokens=2), vocab)
    timed = []  # the drafters measure() times, one per width

    class Recorded(PolicyDrafter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            timed.append(self)

    monkeypatch.setattr(draft_cost, "PolicyDrafter", Recorded)
    ms = draft_cost.measure(target, drafter, batch=2, context=12, widths=[1, 0], target_widths=[1, 3], rounds=4)
    assert set(ms) == {"draft W'=1", "draft whole block", "target 1 column", "target 3 columns"}
    assert all(v > 0 for v in ms.values()) and drafter.policy.own_draft_tokens == 2
    assert [d.policy.own_draft_tokens for d in timed] == [1, None] and all(d.draft_vocab is vocab for d in timed)
    timed.clear()  # --vocab-sizes: each width from each candidate vocabulary, interleaved
    ms = draft_cost.measure(target, drafter, batch=2, context=12, widths=[1], target_widths=[1], rounds=4,
                            vocabs={0: None, 8: vocab[:8]})
    assert set(ms) == {"draft W'=1 V'=all", "draft W'=1 V'=8", "target 1 column"}
    assert timed[0].draft_vocab is None and torch.equal(timed[1].draft_vocab, vocab[:8])
    with torch.inference_mode():
        cache, _, anchor_pos = prefill(target, drafter, 2, 12)
    assert cache.get_seq_length() == 11 and anchor_pos.tolist() == [11, 11]


def test_interleave_plot_draws_each_variant_and_refuses_wrong_names(tmp_path):
    """experiments.bench.interleave_plot: τ against speedup from an interleave record, one point per variant and
    suite; --names must name every variant, --tau-bar needs suite=number."""
    from experiments.bench import interleave_plot

    summary = {"a=1": {"humaneval": {"tau": [2.0, 2.0], "speedup": [1.1, 1.3]}},
               "a=2": {"humaneval": {"tau": [3.0, 3.0], "speedup": [0.9, 1.0]}}}
    record = tmp_path / "ab.json"
    record.write_text(json.dumps({"summary": summary}))
    pts = interleave_plot.points(summary, ["one", "two"])
    assert pts == {"one": {"humaneval": (2.0, [1.1, 1.3])}, "two": {"humaneval": (3.0, [0.9, 1.0])}}
    path = interleave_plot.main([str(record), "--tau-bar", "humaneval=2.5", "--speed-bar", "1.3"])
    assert path == tmp_path / "ab.png" and path.stat().st_size > 1000
    with pytest.raises(ValueError, match="--names has 1 names for 2 variants"):
        interleave_plot.points(summary, ["one"])
    with pytest.raises(SystemExit, match="expected suite=number"):
        interleave_plot.main([str(record), "--tau-bar", "humaneval"])


def test_the_candidate_vocabulary_comes_from_recorded_answers_or_the_training_data(tmp_path):
    """drafter.draft_vocab_size: the most frequent response tokens of draft_vocab_from (+ EOS); without a source,
    the data of the training run beside the drafter, else a message naming the key."""
    from transformers import LlamaConfig

    from experiments.data.target import asset_path
    from experiments.pipeline.eval_drafters import candidate_vocab

    target = type("Target", (), {"config": LlamaConfig(vocab_size=49152, eos_token_id=2)})()
    vocab = candidate_vocab(target, 100, asset_path("smollm2_answers"), tmp_path / "drafter")
    assert 100 <= len(vocab) <= 101 and 2 in vocab.tolist() and torch.equal(vocab, vocab.sort().values)
    with pytest.raises(ValueError, match="draft_vocab_size=100 needs drafter.draft_vocab_from=.*no training run beside"):
        candidate_vocab(target, 100, None, tmp_path / "drafter")
    with pytest.raises(ValueError, match="draft_vocab_size=0: must be >= 1"):
        candidate_vocab(target, 0, asset_path("smollm2_answers"), tmp_path / "drafter")


# ----------------------------------------------------------------------------- experiments.speed


def _speed_overrides(assets, run_dir=None):
    shared = [o for o in _overrides(assets, run_dir) if not o.startswith("drafter.path=")]
    return [*shared, "batch_size=1", "temperatures=[0.0]", "+drafter@drafters.block=block",
            f"drafters.block.path={assets / 'drafter'}", "+drafter@drafters.lookup=prompt_lookup",
            "drafters.lookup.num_draft_tokens=2"]


def test_speed_times_every_drafter_against_one_timing_of_the_target(assets, tmp_path, monkeypatch):
    """experiments.speed: each drafter's results.json as its own evaluation would write it (the same counts), each
    speedup over the same target-alone timing; a second run times nothing; the report reads the folders."""
    run_dir = tmp_path / "speed"
    monkeypatch.setattr(sys, "argv", ["experiments.speed", *_speed_overrides(assets), f"hydra.run.dir={run_dir}"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    speed_cli.main()
    docs = {n: json.loads((run_dir / n / "results.json").read_text()) for n in ("block", "lookup")}
    for suite in ("jsonl", "chat"):
        block, lookup = (docs[n]["results"][suite]["t0"] for n in ("block", "lookup"))
        assert block["target_tokens_per_s"] == lookup["target_tokens_per_s"] > 0  # one timing of the target alone
        assert block["greedy_match"] == lookup["greedy_match"] == 1.0  # exact: both wrote the target's answers
        assert lookup["speedup"] == pytest.approx(lookup["spec_tokens_per_s"] / lookup["target_tokens_per_s"])
    assert docs["block"]["config"]["drafter"]["path"] == str(assets / "drafter") and "drafters" not in docs["block"]["config"]
    assert docs["lookup"]["drafter"]["name"] == "prompt_lookup" and docs["lookup"]["drafter"]["config"]["num_draft_tokens"] == 2
    alone = ev.run_evaluation(_compose([*_overrides(assets, tmp_path / "one"), "batch_size=1", "temperatures=[0.0]"]))
    assert _untimed(alone) == _untimed(docs["block"])  # the same steps and counts as its own evaluation

    calls = []
    monkeypatch.setattr(speed, "time_suite", lambda *a, **kw: calls.append(kw["suite"]))
    speed.run_speed(_compose([*_speed_overrides(assets, run_dir)]))
    assert calls == []  # every suite was timed for both drafters

    from experiments import report as rp

    summary = rp.main([str(run_dir / "block"), str(run_dir / "lookup"), "--speed", str(run_dir / "block"),
                       str(run_dir / "lookup"), "--out", str(tmp_path / "report"), "--num-bootstrap", "100"])
    assert set(summary["speed"]) == {"block", "prompt_lookup"}


def test_speed_refuses_other_temperatures_and_no_drafters(assets, tmp_path):
    with pytest.raises(ValueError, match=r"temperature 0 only \(temperatures=\[0.0\]\), got \[0.0, 1.0\]"):
        speed.run_speed(_compose([*_speed_overrides(assets, tmp_path / "a"), "temperatures=[0.0,1.0]"]))
    no_drafters = [o for o in _speed_overrides(assets, tmp_path / "b") if "drafters." not in o]
    with pytest.raises(ValueError, match=r"drafters: none given; name each with \+drafter@drafters.<name>"):
        speed.run_speed(_compose(no_drafters))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
