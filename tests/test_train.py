"""End to end through Hydra: experiments.regenerate then experiments.train on a tiny random target.

The entry points run in this process (``main()`` with a patched ``sys.argv``; ``HYDRA_FULL_ERROR=1``
so errors surface as exceptions). Runs and caches go to a temporary folder.
"""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from omegaconf import OmegaConf

from drafters import factory
from drafters.training.datamodule import finished_ids, read_meta, shard_dirs
from experiments import regenerate, train
from experiments.data.decontamination import check_disjoint
from experiments.data.prompts import as_messages
from experiments.pipeline.regeneration import needs_regeneration

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TEXTS = [
    "Hello, how are you today? I am fine, thank you.",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Tom has 3 apples and buys 5 more. How many apples does he have? 8.",
] * 20


# Per family: config class, model class, and the sizes that differ (Qwen3: q/k norms, GQA, head_dim).
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {"num_attention_heads": 2, "num_key_value_heads": 2}),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})}


def save_target(path, hidden: int = 32, seed: int = 0, arch: str = "llama"):
    """A random Llama (or Qwen3) with a small byte-level BPE tokenizer (chat template included), saved to ``path``."""
    import transformers
    from transformers import GenerationConfig

    from experiments.data.tokenizer import train_tokenizer

    config_name, model_name, heads = ARCHS[arch]
    tok = train_tokenizer(TEXTS, vocab_size=300)
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, **heads,
        max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    config.mask_token_id = tok.mask_token_id
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_main(module, args: list[str]):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [module.__name__, *args])
        mp.setenv("HYDRA_FULL_ERROR", "1")
        module.main()


def offline_env(mp: pytest.MonkeyPatch, root, **extra) -> None:
    """A test's runs and caches under ``root``, no hub, W&B offline (plus ``extra`` variables)."""
    for key, value in {"BLOCKDRAFT_RUNS": root / "runs", "BLOCKDRAFT_CACHE": root / "cache", "HF_HUB_OFFLINE": "1",
                       "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
                       **extra}.items():
        mp.setenv(key, str(value))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, root, WANDB_DIR=root / "wandb")
        target = save_target(root / "target")
        base = ["target=hf", f"target.path={target}", "experiment=smoke"]
        run_main(regenerate, [*base, "suite=[humaneval,gsm_symbolic]", "shard_size=5"])
        data_dirs = list((root / "cache" / "regen" / "hf").iterdir())
        yield {"root": root, "target": target, "base": base, "data_dir": data_dirs[0], "num_dirs": len(data_dirs)}


# ----------------------------------------------------------------------------- regenerate


def test_regenerate_writes_a_resumable_cached_dataset(env):
    data_dir = env["data_dir"]
    assert env["num_dirs"] == 1 and len(data_dir.name) == 12  # .../regen/hf/<settings hash>
    meta = read_meta(data_dir)
    assert meta["complete"] and meta["settings"]["generation"]["max_new_tokens"] == 32
    shards = shard_dirs(data_dir)
    ids = finished_ids(data_dir)
    assert len(shards) >= 2 and len(ids) == meta["rows"] > 0
    from datasets import load_from_disk

    row = load_from_disk(str(shards[0]))[0]
    assert set(row) == {"id", "domain", "input_ids", "prompt_len"}
    assert row["domain"] in {"dialogue", "reasoning"} and len(row["input_ids"]) > row["prompt_len"] > 0

    # a killed job: the last shard never got written; the rerun regenerates only its rows
    import shutil

    first_mtime = shards[0].stat().st_mtime_ns
    lost = finished_ids(data_dir) - {i for s in shards[:-1] for i in load_from_disk(str(s))["id"]}
    shutil.rmtree(shards[-1])
    run_main(regenerate, [*env["base"], "suite=[humaneval,gsm_symbolic]", "shard_size=5"])
    assert finished_ids(data_dir) == ids and lost
    assert shards[0].stat().st_mtime_ns == first_mtime and len(shard_dirs(data_dir)) == len(shards)


def test_prompts_overlapping_a_suite_fail_loudly():
    from experiments.data.suites import load_humaneval

    prompts = [as_messages(p) for p in load_humaneval(limit=2)]
    prompts.append(("dialogue/x", "dialogue", [{"role": "user", "content": "Hello there, how are you?"}]))
    suites = OmegaConf.create({"humaneval": {"_target_": "experiments.data.suites.load_humaneval"}})
    decon = OmegaConf.create({"ngram": 13, "min_chars": 20, "exact_only_domains": ["reasoning"]})
    with pytest.raises(ValueError, match="overlap the evaluation suites"):
        check_disjoint(prompts, suites, decon)
    assert check_disjoint(prompts[2:], suites, decon) == 164


# ----------------------------------------------------------------------------- train


def read_metrics(run_dir):
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_train_end_to_end_and_resume(env):
    run_main(train, env["base"])
    run_dir = env["root"] / "runs" / "train" / "smoke-hf-uniform"
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from_step"] is None
    assert summary["data_dir"] == str(env["data_dir"]) and 1.0 <= summary["val"]["val/tau_greedy"] <= 4.0
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    from experiments.data.target import load_target

    target, _ = load_target(str(env["target"]))
    drafter = factory.load(run_dir / "drafter", target=target)
    assert drafter.config.block_size == 4
    rows = read_metrics(run_dir)
    assert any(r["val/tau_greedy"] for r in rows) and any(r["train/loss"] for r in rows)

    run_main(train, [*env["base"], "train.max_steps=9"])  # the same run, continued
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["steps"] == 9 and summary["resumed_from_step"] == 6
    steps = [int(r["step"]) for r in read_metrics(run_dir) if r["train/loss"]]
    assert min(steps) == 0 and max(steps) >= 8  # the history of both runs is kept
    with pytest.raises(FileExistsError, match="resume=false"):
        run_main(train, [*env["base"], "resume=false"])


def test_train_with_wandb_offline(env):
    run_main(train, [*env["base"], "logger=wandb", "name=wb", "train.max_steps=2", "train.val_every=2"])
    run_dir = env["root"] / "runs" / "train" / "wb"
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert json.loads((run_dir / "train_summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("override, error", [
    ("drafter.block_size=1", "block_size"),
    ("drafter.mask_token_id=100000", "mask_token_id"),
])
def test_bad_drafter_settings_are_clear_errors(env, override, error):
    with pytest.raises(Exception, match=error):
        run_main(train, [*env["base"], override, "name=bad"])


def test_empty_or_foreign_data_is_refused(env):
    empty = env["root"] / "empty"
    with pytest.raises(FileNotFoundError, match="is empty"):
        run_main(train, [*env["base"], f"data.data_dir={empty}", "name=empty", "data.regenerate_if_missing=false"])
    other = save_target(env["root"] / "other", hidden=48, seed=1)
    with pytest.raises(ValueError, match="another target"):
        run_main(train, ["target=hf", f"target.path={other}", "experiment=smoke",
                         f"data.data_dir={env['data_dir']}", "name=other"])


def test_train_regenerates_missing_data(env):
    """A fresh machine: train regenerates the data first, into the folder experiments.regenerate writes."""
    fresh = env["root"] / "fresh"
    run_main(train, [*env["base"], f"data.data_dir={fresh}", "name=fresh", "suite=[humaneval,gsm_symbolic]",
                     "train.max_steps=2", "train.val_every=2"])
    assert read_meta(fresh)["complete"]
    assert finished_ids(fresh) == finished_ids(env["data_dir"])  # same settings, same prompts
    summary = json.loads((env["root"] / "runs" / "train" / "fresh" / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["data_dir"] == str(fresh) and summary["train_rows"] > 0
    # someone's own shards (no regen.json) are never regenerated into; an interrupted regeneration is
    import shutil

    own = env["root"] / "own"
    shutil.copytree(fresh / "shards", own / "shards")
    assert not needs_regeneration(own)
    assert needs_regeneration(env["root"] / "nothing_here")
    meta = read_meta(fresh)
    (fresh / "regen.json").write_text(json.dumps({**meta, "complete": False}))
    assert needs_regeneration(fresh)


def test_train_then_evaluate(env):
    run_main(train, [*env["base"], "name=ev", "train.max_steps=2", "train.val_every=2", "evaluate.enabled=true",
                     "suite=humaneval", "suite.humaneval.limit=2", "evaluate.temperatures=[0.0]",
                     "evaluate.max_new_tokens=8", "evaluate.num_bootstrap=10", "evaluate.measure_target_only=false",
                     "evaluate.progress=false"])
    results = json.loads((env["root"] / "runs" / "train" / "ev" / "results.json").read_text())
    assert results["results"]["humaneval"]["t0"]["tau"] >= 1.0


@pytest.mark.parametrize("store_hints", [False, True])
def test_hinted_drafter_trains_and_evaluates(env, store_hints):
    """drafter=hinted (the main job's: layerwise + lookup hints) through the whole pipeline: its layers start
    as the target's, it trains, saves, reloads with its design, and drafts through the exact verifier (T=0
    output = the target's greedy). With store_hints, the store of the training rows' answers is saved beside
    it and reloaded. With store hints the run's own evaluation takes the drafter's inference settings from
    ``evaluate.drafter`` (the switch and narrow drafting, as experiment=deep_frozen sets them)."""
    name = f"lw_store{int(store_hints)}"
    inference = ["+evaluate.drafter.follow_hint_after=0", "+evaluate.drafter.own_draft_tokens=1"] if store_hints else []
    store = ["+drafter/variant=store_hints"] if store_hints else []
    run_main(train, [*env["base"], "drafter=hinted", *store, f"name={name}",
                     "train.max_steps=2", "train.val_every=2",
                     "evaluate.enabled=true", "suite=humaneval", "suite.humaneval.limit=2",
                     "evaluate.temperatures=[0.0]", "evaluate.max_new_tokens=8", "evaluate.num_bootstrap=10",
                     "evaluate.measure_target_only=true", "evaluate.progress=false", *inference])
    run_dir = env["root"] / "runs" / "train" / name
    from experiments.data.target import load_target

    target, _ = load_target(str(env["target"]))
    drafter = factory.load(run_dir / "drafter", target=target)
    cfg, variants = drafter.config, drafter.variants
    assert variants["layerwise"].shifted and (cfg.num_layers, cfg.target_layer_ids) == (2, (0, 1))
    assert variants["hints"].max_ngram == 3
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["steps"] == 2
    assert ("store_hints" in variants) == store_hints
    assert (run_dir / "drafter" / "hint_store.safetensors").is_file() == store_hints
    if store_hints:  # the training rows' answers, never the validation rows'
        assert len(drafter.hint_store.rows) == summary["train_rows"]
    results = json.loads((run_dir / "results.json").read_text())
    entry = results["results"]["humaneval"]["t0"]
    assert entry["tau"] >= 1.0 and entry["greedy_match"] == 1.0
    config = results["drafter"]["config"]
    assert (config.get("follow_hint_after"), config.get("own_draft_tokens")) == ((0, 1) if store_hints else (None, None))


def test_multirun_report_evaluates_the_baselines(env):
    """A multirun with MultirunReport(baselines=[prompt_lookup, corpus_lookup]): the baselines are evaluated once
    with the jobs' suites and settings (corpus_lookup over the jobs' data folder), and the report has their
    rows after the trained configuration's."""
    sweep = env["root"] / "multirun_baselines"
    settings = ["suite=humaneval", "suite.humaneval.limit=2", "evaluate.temperatures=[0.0]",
                "evaluate.max_new_tokens=8", "evaluate.num_bootstrap=10", "evaluate.measure_target_only=false",
                "evaluate.progress=false"]
    callback = ["+hydra.callbacks.report._target_=experiments.reporting.callback.MultirunReport",
                "+hydra.callbacks.report.num_bootstrap=10", "+hydra.callbacks.report.baselines=[prompt_lookup,corpus_lookup]"]
    run_main(train, ["-m", *env["base"], "loss=uniform", "train.max_steps=2", "train.val_every=2",
                     "evaluate.enabled=true", *settings, *callback, f"hydra.sweep.dir={sweep}"])
    baseline = json.loads((sweep / "baselines" / "prompt_lookup" / "results.json").read_text())
    trained = json.loads(next(p for p in sweep.rglob("results.json") if "baselines" not in p.parts).read_text())
    assert baseline["drafter"]["kind"] == "prompt_lookup"
    assert baseline["suites"] == trained["suites"] and baseline["settings"] == trained["settings"]
    assert baseline["results"]["humaneval"]["t0"]["num_prompts"] == 2
    report = json.loads((sweep / "report" / "report.json").read_text())
    assert [c["name"] for c in report["configurations"]] == ["uniform", "prompt_lookup", "corpus_lookup"]
    corpus = json.loads((sweep / "baselines" / "corpus_lookup" / "results.json").read_text())
    data_dir = json.loads(next(sweep.rglob("train_summary.json")).read_text())["data_dir"]
    assert corpus["drafter"]["kind"] == "corpus_lookup" and corpus["drafter"]["path"] == data_dir
