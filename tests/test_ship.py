"""experiments.pipeline.ship: a long-trained drafter copied as an asset with its model card (data and its sha256,
steps, training time, commit, τ per suite), loadable by ``drafter.path=``; an evaluation of other weights refused;
the DFlash export's card reading τ from a given evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen3
from omegaconf import OmegaConf
from safetensors.torch import save_file

from drafters import factory
from drafters.storage import file_digest
from experiments.pipeline.export import export_for_serving
from experiments.pipeline.paths import REPO
from experiments.pipeline.ship import ship_assistant, ship_drafter

pytestmark = pytest.mark.filterwarnings("ignore:target_layer_ids .* the target's last hidden state")

RECORD = {"answers_sha256": "a" * 64, "record_sha256": "b" * 64, "rows": 10887, "response_tokens": 2015720,
          "engine": {"name": "vllm", "version": "0.32.0"}}
SUITES = {"humaneval": (1.8123, 1.4567), "gsm_symbolic": (2.0, 1.5), "mtbench": (1.7, 1.3)}


def _long_run(tmp_path):
    """A long run as experiments.train leaves it (what the card reads) and an evaluation of its drafter."""
    target = tiny_qwen3(tmp_path / "target")
    run = tmp_path / "run" / "long" / "l2r_all"
    factory.from_target(target, block_size=8, num_layers=1).save_pretrained(run / "drafter")
    (run / "run_settings.json").write_text(json.dumps(
        {"choices": {"loss": "l2r_all"}, "settings": {"loss.gamma": 2.0, "loss.chain_weight": 40.0, "seed": 0}}))
    (run / "train_summary.json").write_text(json.dumps(
        {"steps": 20000, "train_seconds": 9000.0, "threads": 2, "torch": "2.13.0+cpu", "train_rows": 10343,
         "val_rows": 544, "drafter_parameters": 12345, "overrides": ["loss=l2r_all", "loss.gamma=2.0"],
         "val": {"val/tau_greedy": 2.1}}))
    evaluation = tmp_path / "run" / "eval" / "long" / "l2r_all" / "drafter" / "results.json"
    evaluation.parent.mkdir(parents=True)
    evaluation.write_text(json.dumps({
        "git_commit": "c" * 40, "settings": {"batch_size": 8, "replay_greedy": True},
        "target": {"model_type": "qwen3", "num_hidden_layers": 3, "path": str(tmp_path / "target")},
        "drafter": {"weights_sha256": file_digest(sorted((run / "drafter").glob("*.safetensors")))},
        "results": {s: {"t0": {"tau": t0, "num_prompts": 16}, "t1": {"tau": t1, "num_prompts": 16}}
                    for s, (t0, t1) in SUITES.items()}}))
    return run, evaluation, target


def test_a_shipped_drafter_loads_and_its_card_says_how_it_was_made(tmp_path):
    run, evaluation, target = _long_run(tmp_path)
    out = tmp_path / "assets" / "l2r_all_long"
    (out / "dflash").mkdir(parents=True)  # an export kept across a re-ship; a stale file is not
    (out / "stale.safetensors").write_text("old")
    ship_drafter(run / "drafter", evaluation, out, RECORD, name="l2r_all_long",
                 command="python -m experiments.train experiment=smollm2_long loss=l2r_all loss.gamma=2.0",
                 extra=("dflash",))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "blockdraft_record.json", "card.json",
                                                     "config.json", "dflash", "model.safetensors"]
    drafter = factory.load(out, target)  # checked against the record and the target it was trained for
    assert drafter.config.block_size == 8
    card = json.loads((out / "card.json").read_text())
    assert card["training"] | {"overrides": None} == {
        "loss": "l2r_all", "loss_settings": {"gamma": 2.0, "chain_weight": 40.0}, "steps": 20000,
        "train_seconds": 9000.0, "threads": 2, "torch": "2.13.0+cpu", "overrides": None,
        "held_out": {"val/tau_greedy": 2.1}}
    assert card["data"]["answers_sha256"] == "a" * 64 and card["data"]["train_rows"] == 10343
    assert card["tau"]["T=0"] == {"humaneval": 1.8123, "gsm_symbolic": 2.0, "mtbench": 1.7, "mean": 1.8374}
    assert card["tau"]["T=1"]["mean"] == pytest.approx((1.4567 + 1.5 + 1.3) / 3, abs=1e-4)
    assert card["evaluation"]["commit"] == "c" * 40 and "path" not in card["target"]
    readme = (out / "README.md").read_text()
    for text in ("# `l2r_all_long`", "20,000 optimizer steps in 2.50 h", "gamma=2.0", "| humaneval | 1.812 | 1.457 |",
                 "| mean | 1.837 | 1.419 |", "a" * 64, "loss.gamma=2.0`", "c" * 40):
        assert text in readme, text


def test_a_continued_drafters_card_adds_up_the_earlier_training(tmp_path):
    run, evaluation, _ = _long_run(tmp_path)
    earlier = ship_drafter(run / "drafter", evaluation, tmp_path / "v1" / "l2r_all_long", RECORD, name="l2r_all_long",
                           command="first")  # 20,000 steps in 9,000 s
    out = ship_drafter(run / "drafter", evaluation, tmp_path / "v2" / "l2r_all_long", RECORD, name="l2r_all_long",
                       command="second", continued_from=earlier)
    card = json.loads((out / "card.json").read_text())
    first = json.loads((earlier / "card.json").read_text())
    assert card["training"]["continued_from"] == {
        "name": "l2r_all_long", "weights_sha256": first["drafter"]["weights_sha256"], "steps": 20000,
        "train_seconds": 9000.0, "total_steps": 40000, "total_train_seconds": 18000.0}
    assert "continued from `l2r_all_long` (20,000 steps, 2.50 h" in (out / "README.md").read_text()
    assert "40,000 steps, 5.00 h in all" in (out / "README.md").read_text()
    third = ship_drafter(run / "drafter", evaluation, tmp_path / "v3" / "l2r_all_long", RECORD, name="l2r_all_long",
                         command="third", continued_from=out)
    assert json.loads((third / "card.json").read_text())["training"]["continued_from"]["total_steps"] == 60000


def test_a_cards_command_and_overrides_name_no_machine_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "cache" / "regen" / "smollm2" / "abc"
    data.mkdir(parents=True)
    run, evaluation, _ = _long_run(tmp_path)
    earlier = REPO / "experiments" / "assets" / "l2r_all_long"  # the shipped drafter a continuation starts from
    summary = json.loads((run / "train_summary.json").read_text())
    summary["overrides"] += [f"drafter.init_from={earlier}", f"data.data_dir={data}"]
    (run / "train_summary.json").write_text(json.dumps(summary))
    out = ship_drafter(run / "drafter", evaluation, tmp_path / "out", RECORD, name="l2r_all_long",
                       command=f"python -m experiments.train loss=l2r_all drafter.init_from={earlier}")
    card = json.loads((out / "card.json").read_text())
    assert card["training"]["overrides"] == ["loss=l2r_all", "loss.gamma=2.0",
                                             "drafter.init_from=experiments/assets/l2r_all_long",
                                             "data.data_dir=$BLOCKDRAFT_CACHE/regen/smollm2/abc"]
    assert card["command"] == "python -m experiments.train loss=l2r_all drafter.init_from=experiments/assets/l2r_all_long"
    assert str(REPO) not in (out / "README.md").read_text() and str(tmp_path) not in (out / "card.json").read_text()


def test_an_evaluation_of_other_weights_is_refused(tmp_path):
    run, evaluation, _ = _long_run(tmp_path)
    doc = json.loads(evaluation.read_text())
    doc["drafter"]["weights_sha256"] = "0" * 64
    evaluation.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="evaluated other weights than .*evaluate this drafter"):
        ship_drafter(run / "drafter", evaluation, tmp_path / "out", RECORD, name="x", command="c")
    assert not (tmp_path / "out").exists()


def test_the_dflash_exports_card_reads_tau_from_the_given_evaluation(tmp_path):
    run, evaluation, _ = _long_run(tmp_path)
    cfg = {"drafter": {"path": str(run / "drafter")}, "out": str(tmp_path / "dflash"), "target_path": None,
           "dtype": None, "max_position_embeddings": None}
    card = (export_for_serving(OmegaConf.create({**cfg, "results": str(evaluation)})) / "README.md").read_text()
    assert "| humaneval | 1.812 | 1.457 |" in card
    with pytest.raises(FileNotFoundError, match="results=.*nowhere.json: no such file"):
        export_for_serving(OmegaConf.create({**cfg, "results": str(tmp_path / "nowhere.json")}))


def test_the_shipped_assistant_names_its_data_and_commit(tmp_path):
    export = tmp_path / "assistant" / "export"
    export.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(export / "model.safetensors"))
    (export / "config.json").write_text(json.dumps({"model_type": "llama", "transformers_version": "5.18.0"}))
    (export / "training.json").write_text(json.dumps({"steps": 4000}))
    (export / "README.md").write_text("# assistant\n")
    out = tmp_path / "assets" / "ar_assistant_smollm2"
    (out / "old").mkdir(parents=True)  # an earlier ship is replaced whole
    ship_assistant(export, out, RECORD, "d" * 40)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "blockdraft_record.json", "config.json",
                                                      "model.safetensors", "training.json"]
    record = json.loads((out / "blockdraft_record.json").read_text())  # an export without a record: recorded now
    assert record["settings"] == {"model_type": "llama"} and list(record["weights_sha256"]) == ["model.safetensors"]
    meta = json.loads((out / "training.json").read_text())
    assert meta["steps"] == 4000 and meta["shipped"] == {
        **RECORD, "commit": "d" * 40}
    readme = (out / "README.md").read_text()
    assert "10,887 recorded answers" in readme and "d" * 40 in readme and "a" * 64 in readme


SHIPPED = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "experiments" / "assets").glob("*/card.json"))


def test_the_long_pair_is_shipped():
    assert {p.name for p in SHIPPED} >= {"uniform_long", "l2r_all_long"}  # the rows of the main job's report


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_a_committed_drafter_loads_with_this_code_and_is_the_one_its_card_describes(folder):
    card = json.loads((folder / "card.json").read_text())
    drafter = factory.load(folder)  # its weights and settings checked against blockdraft_record.json
    assert file_digest(sorted(folder.glob("*.safetensors"))) == card["drafter"]["weights_sha256"]
    settings = card["drafter"]["settings"]
    assert (drafter.config.block_size, drafter.config.num_layers) == (settings["block_size"], settings["num_layers"])
    assert card["training"]["steps"] > 0 and set(card["tau"]["T=0"]) >= {"humaneval", "gsm_symbolic", "mtbench", "mean"}
