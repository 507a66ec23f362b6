"""The embedded target: corpora, tokenizer, the training recipe (runs and resumes), the shipped model."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from experiments.data import corpora
from experiments.data.target import TINY_TARGET_DIR, load_target
from experiments.data.tokenizer import train_tokenizer
from experiments.pipeline.target_quality import distinct_n, repeated_ngram_share

pytestmark = pytest.mark.slow

CONF = Path(__file__).resolve().parents[1] / "conf"


#: Sources read from Debian packages (the target's corpora; the tests and the drafters do not need them).
APT_SOURCES = {"docs": corpora.DOCS_DIR, "fortunes": corpora.FORTUNES_DIR}
MISSING_APT = {name for name, path in APT_SOURCES.items() if not (path.is_dir() and any(path.iterdir()))}


@pytest.fixture(scope="module")
def small_docs():
    docs = []
    for name in ["code_raw", "code_chat", "docs", "fortunes", "dialogue"]:
        if name not in MISSING_APT:
            docs += corpora.load_source(name)[:40]
    docs += corpora.load_source("reasoning", num_problems=40)
    docs += list(itertools.islice(corpora.sharegpt(), 40))
    return docs


@pytest.fixture(scope="module")
def tokenizer(small_docs):
    return train_tokenizer([d.text or "\n".join(m["content"] for m in d.messages) for d in small_docs], 600)


def test_every_source_loads_real_documents(small_docs):
    """Every source yields documents, except a Debian-package source whose package is not installed,
    which fails with the package to install (retraining the target needs them; nothing else does)."""
    by_source = {d.source for d in small_docs}
    assert by_source == set(corpora.SOURCES) - MISSING_APT
    for name in MISSING_APT:
        package = corpora.APT_PACKAGES[APT_SOURCES[name]]
        with pytest.raises(FileNotFoundError, match=f"apt-get install -y {package}"):
            corpora.load_source(name)
    assert len({d.id for d in small_docs}) == len(small_docs)


def test_tokenizer_round_trips_every_domain_and_renders_chat(tokenizer, small_docs):
    for doc in small_docs[::7]:
        text = corpora.render_document(doc, tokenizer)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text, doc.id
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert chat == "<|bos|><|user|>2+2?<|eos|><|assistant|>4<|eos|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.endswith("<|assistant|>")
    assert tokenizer.mask_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_validation_split_is_stable_and_small():
    ids = [f"doc/{i}" for i in range(5000)]
    held = [i for i in ids if corpora.is_validation(i, 0.02)]
    assert held == [i for i in ids if corpora.is_validation(i, 0.02)]
    assert 50 < len(held) < 150


def test_training_prompts_are_disjoint_from_the_suites():
    from experiments.data.decontamination import assert_disjoint
    from experiments.data.suites import load_gsm_symbolic, load_humaneval

    prompts = corpora.training_prompts(per_source=200)
    texts = {d: [p["messages"][-1]["content"] for p in prompts if p["domain"] == d] for d in ("code", "reasoning")}
    assert_disjoint(texts["code"], {"humaneval": load_humaneval()})
    assert_disjoint(texts["reasoning"], {"gsm_symbolic": load_gsm_symbolic()}, ngram=None)


def test_training_prompts_per_source_mapping_gives_each_source_its_count():
    from collections import Counter

    from omegaconf import OmegaConf

    counts = OmegaConf.create({"code_chat": 5, "reasoning": 4, "dialogue": 9})  # as Hydra hands it over
    prompts = corpora.training_prompts(per_source=counts)
    assert Counter(p["domain"] for p in prompts) == {"code": 5, "reasoning": 4, "dialogue": 9}
    with pytest.raises(KeyError, match="not for source 'reasoning'"):
        corpora.training_prompts(per_source={"code_chat": 5, "dialogue": 9})


def test_repetition_metrics_by_hand():
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 / 5)
    assert repeated_ngram_share([1, 2, 3], 4) == 0.0
    assert distinct_n([1, 1, 1, 1], 2) == pytest.approx(1 / 3)
    assert distinct_n([1, 2, 3, 4], 2) == 1.0


def _recipe_cfg(tmp_path, max_steps):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name="train_target",
            overrides=[
                f"paths.run_dir={tmp_path}/run",
                f"export_dir={tmp_path}/export",
                "target.recipe.mixture={code_raw: 0, code_chat: 0, docs: 0, fortunes: 0, dialogue: 1.0, reasoning: 0}",
                "target.recipe.vocab_size=300",
                "target.recipe.seq_len=32",
                "target.recipe.batch_size=4",
                "target.recipe.val_every=3",
                "target.recipe.checkpoint_every=2",
                "target.recipe.val_windows_per_source=2",
                "target.recipe.compile=false",
                "target.recipe.model.hidden_size=32",
                "target.recipe.model.intermediate_size=64",
                "target.recipe.model.num_hidden_layers=1",
                "target.recipe.model.num_attention_heads=2",
                "target.recipe.model.num_key_value_heads=2",
                "target.recipe.model.max_position_embeddings=64",
                "target.recipe.optim.warmup_steps=2",
                f"target.recipe.optim.max_steps={max_steps}",
                "trainer.enable_progress_bar=false",
            ],
        )


def test_recipe_trains_exports_and_resumes(tmp_path):
    from experiments.pipeline.target_training import train_target as run

    export = run(_recipe_cfg(tmp_path, 4))
    first = json.loads((export / "training.json").read_text())
    assert first["steps"] == 4 and (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    export = run(_recipe_cfg(tmp_path, 6))  # resumes from last.ckpt, does not start over
    second = json.loads((export / "training.json").read_text())
    assert second["steps"] == 6
    # the resumed run's CSV log keeps the first run's rows (Lightning would start the file over)
    (log,) = (tmp_path / "run").rglob("metrics.csv")
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    val_steps = sorted(int(r["step"]) for r in rows if r.get("val/loss"))
    assert val_steps[0] < 4 <= val_steps[-1], val_steps
    assert not list(log.parent.glob("metrics.part-*.csv"))
    model, tok = load_target(str(export))
    assert model.config.num_hidden_layers == 1 and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5 or tok.eos_token_id in out[0].tolist()


def test_shipped_target_loads_offline_matches_its_card_and_generates():
    model, tok = load_target(str(TINY_TARGET_DIR))
    card = json.loads((TINY_TARGET_DIR / "training.json").read_text())
    recipe_model = card["recipe"]["model"]
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads"):
        assert getattr(model.config, key) == recipe_model[key], key
    assert sum(p.numel() for p in model.parameters()) == card["parameters"]
    assert model.config.mask_token_id == tok.mask_token_id
    assert (TINY_TARGET_DIR / "README.md").exists() and (TINY_TARGET_DIR / "quality.json").exists()
    size = sum(f.stat().st_size for f in TINY_TARGET_DIR.iterdir())
    assert size < 25 * 2**20
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
