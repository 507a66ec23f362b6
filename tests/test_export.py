"""experiments.export: a trained drafter's run dir -> DFlash checkpoint + model card (Hydra, in process)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from conftest import tiny_qwen3
from omegaconf import OmegaConf

from drafters import factory
from experiments import export
from experiments.pipeline.export import export_for_serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore:target_layer_ids .* the target's last hidden state"),
]


def fake_run(root, target_dir, with_results: bool = True):
    """A training run dir as experiments.train leaves it (only what the card reads)."""
    run_dir = root / "train" / "tiny-dflash-l2r_all-s0"
    target = tiny_qwen3(target_dir)
    factory.from_target(target, block_size=8, num_layers=2).save_pretrained(run_dir / "drafter")
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({
        "name": "tiny-dflash-l2r_all-s0",
        "target": {"name": "tiny", "path": str(target_dir)},
        "data": {"generation": {"prompts": {"sources": ["code_chat", "reasoning"]}, "temperature": 1.0,
                                "max_new_tokens": 128}},
        "loss": {"_target_": "losses.AcceptanceAlignedLoss", "gamma": 7.0, "focal_weight": 0.3, "chain_weight": 40.0},
    }), run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"loss": "l2r_all"}}}}),
                   run_dir / ".hydra" / "hydra.yaml")
    (run_dir / "train_summary.json").write_text(json.dumps({"steps": 400, "train_rows": 836}))
    if with_results:
        results = {"target": {"path": str(target_dir)}, "results": {
            "humaneval": {"t0": {"tau": 1.5432}, "t1": {"tau": 1.2711}}, "gsm_symbolic": {"t0": {"tau": 1.2961}}}}
        (run_dir / "results.json").write_text(json.dumps(results))
    return run_dir, target


def run_main(args, runs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["experiments.export", *args])
        mp.setenv("HYDRA_FULL_ERROR", "1")
        mp.setenv("BLOCKDRAFT_RUNS", str(runs))
        export.main()


def test_export_writes_dflash_layout_and_card(tmp_path):
    run_dir, target = fake_run(tmp_path / "runs", tmp_path / "target")
    out = tmp_path / "served"
    run_main([f"drafter.path={run_dir / 'drafter'}", f"out={out}", "dtype=bfloat16"], tmp_path / "runs")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_hidden_layers"] == 2
    assert config["max_position_embeddings"] == 512 and config["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    for text in ("l2r_all", "836 training sequences", "code_chat, reasoning", "| humaneval | 1.543 | 1.271 |",
                 "| gsm_symbolic | 1.296 | — |", str(tmp_path / "target"),
                 f"""--speculative-config '{{"method": "dflash", "model": "{out.resolve()}", "num_speculative_tokens": 7}}'""",
                 f"--speculative-algorithm DFLASH --speculative-draft-model-path {out.resolve()}", "need a GPU",
                 "Exported by blockdraft from `$BLOCKDRAFT_RUNS/"):  # no machine's folders where a name exists
        assert text in card, text
    loaded = factory.load(out, target)  # bf16 weights, loaded back as float32
    assert loaded.config.block_size == 8 and loaded.fuse.weight.dtype == torch.float32


def test_a_shipped_drafter_is_described_by_its_own_card(tmp_path, monkeypatch):
    run_dir, _ = fake_run(tmp_path / "runs", tmp_path / "target", with_results=False)
    shipped = tmp_path / "assets" / "l2r_all_long"
    shutil.copytree(run_dir / "drafter", shipped)  # its run folder is not beside it: only its card.json tells
    (shipped / "card.json").write_text(json.dumps({
        "training": {"loss": "l2r_all", "loss_settings": {"gamma": 1.0, "chain_weight": 40.0}, "steps": 20000,
                     "continued_from": {"total_steps": 40000}},
        "data": {"rows": 10887, "response_tokens": 2015720, "train_rows": 10315, "answers_sha256": "0d28"},
        "tau": {"T=0": {"humaneval": 1.6993, "mean": 1.7}, "T=1": {"humaneval": 1.4106, "mean": 1.4}}}))
    out = tmp_path / "o"  # the target named on the command line as committed records name it, $VARS and all
    monkeypatch.setenv("TARGETS_HOME", str(tmp_path))
    run_main([f"drafter.path={shipped}", f"out={out}", "target_path=$TARGETS_HOME/target"], tmp_path / "runs")
    card = (out / "README.md").read_text()
    for text in ("`l2r_all` (blockdraft AcceptanceAlignedLoss: gamma=1.0, chain_weight=40.0)",
                 "10,315 training sequences of 10,887 answers", "2,015,720 response tokens", "trained 40,000 steps",
                 "| humaneval | 1.699 | 1.411 |", f"(its model card `{shipped / 'card.json'}`)"):
        assert text in card, text
    assert "unknown" not in card and "| mean |" not in card
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 512  # the named target's


def test_card_without_results_and_bad_arguments(tmp_path):
    run_dir, _ = fake_run(tmp_path / "runs", tmp_path / "target", with_results=False)
    out = export_for_serving(OmegaConf.create({"drafter": {"path": str(run_dir / "drafter")}, "out": str(tmp_path / "o"),
                                               "target_path": "Org/Model", "dtype": None,
                                               "max_position_embeddings": None}))
    card = (out / "README.md").read_text()
    assert "τ: not measured" in card and "vllm serve Org/Model" in card
    with pytest.raises(ValueError, match="dtype='int8'"):
        export_for_serving(OmegaConf.create({"drafter": {"path": str(run_dir / "drafter")}, "out": str(tmp_path / "o"),
                                     "target_path": None, "dtype": "int8", "max_position_embeddings": None}))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        export_for_serving(OmegaConf.create({"drafter": {"path": str(tmp_path / "nowhere")}, "out": str(tmp_path / "o"),
                                     "target_path": None, "dtype": None, "max_position_embeddings": None}))


def test_export_imports_no_other_entry_point():
    import ast

    with open(export.__file__) as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    entry_points = {f"experiments.{m}" for m in ("train", "evaluate", "regenerate", "report", "main",
                                                 "train_target", "target_quality", "bench.verify")}
    assert not imported & entry_points, imported & entry_points
