"""experiments.main: the stage list (commands only; every stage is tested through its own entry point)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import fake_vllm_env
from hydra import compose, initialize_config_module

from experiments.jobs import main_job


def _run_with_fake_stages(cfg, tmp_path, monkeypatch) -> tuple[list, dict]:
    calls = []

    def fake_stage(name, module, overrides, log):
        calls.append((name, module, overrides))
        log["stages"].append({"stage": name, "seconds": 0.0})
        if module == "experiments.pipeline.choose_k":
            (tmp_path / "choose_k.json").write_text('{"prompt_lookup": {"chosen_k": 5}, "ar_assistant": {"chosen_k": 3}, '
                                                   '"block_width": {"l2r_all": {"chosen_k": 2}, '
                                                   '"l2r_all_long": {"chosen_k": 2, "chosen_vocab": 8192}}, '
                                                   '"tree": {"l2r_all_long": {"chosen": {"tree": "tree_n6", '
                                                   '"hybrid": "hybrid_n4_m2"}, "by_setting": {"tree_n6": {"budget": 6}, '
                                                   '"hybrid_n4_m2": {"budget": 4, "lookup_min_match": 2, '
                                                   '"lookup_depth": 5}}}}, '
                                                   '"chosen_layout": "onednn_packed"}')
        if module == "experiments.report":
            out = Path(overrides[-1])
            out.mkdir(exist_ok=True)
            (out / "report.md").write_text("table\n")

    monkeypatch.setattr(main_job, "stage", fake_stage)
    (tmp_path / "train" / "uniform").mkdir(parents=True, exist_ok=True)  # what the training stage records
    (tmp_path / "train" / "uniform" / "train_summary.json").write_text('{"data_dir": "cache/regen/x/abc"}')
    return calls, main_job.run_main_job(cfg)


CHOICES = {"prompt_lookup": "prompt_lookup", "ar_assistant": "ar_assistant", "hybrid": "hybrid",
           "l2r_all_long_tree": "tree"}  # a timed drafter's conf/eval/drafter choice (default: block)


def _check_evaluations(cfg, by_name: dict, drafters: list[str], timed: list[str], tmp_path) -> None:
    """Each τ evaluation and the speed stage: the target first, its run dir last, the job's overrides just before
    it; the timed drafters each under drafters.<name>, the baselines at their chosen K; the report over every
    drafter, then the timed ones."""
    for name, overrides in ((f"eval {d}", cfg.evaluate_overrides) for d in drafters):
        args = by_name[name]
        assert args[0] == "target=smollm2" and args[-1] == f"hydra.run.dir={tmp_path}/eval/{name[5:]}"
        assert args[-len(overrides) - 1:-1] == list(overrides)
    speed = by_name["speed"]
    assert speed[0] == "target=smollm2" and speed[-1] == f"hydra.run.dir={tmp_path}/speed"
    assert speed[-len(cfg.speed_overrides) - 1:-1] == list(cfg.speed_overrides)
    assert [a for a in speed if a.startswith("+drafter@")] == [
        f"+drafter@drafters.{d}={CHOICES.get(d, 'block')}" for d in timed]
    assert not any(a.startswith(("drafter=", "drafter.", "temperatures=")) for a in speed[:-len(cfg.speed_overrides) - 1])
    assert "batch_size=1" in cfg.speed_overrides and "temperatures=[0.0]" in cfg.speed_overrides
    assert "replay_greedy=true" in cfg.evaluate_overrides  # T=0 replayed; T=1 decoded
    assert "drafters.prompt_lookup.num_draft_tokens=5" in speed  # the K chosen on held-out answers
    assert "drafter.num_draft_tokens=3" in by_name["eval ar_assistant"]
    report, n = by_name["report"], len(drafters)
    assert report[:n] == [str(tmp_path / "eval" / d) for d in drafters]
    assert report[n:] == ["--speed", *(str(tmp_path / "speed" / d) for d in timed), "--out", str(tmp_path / "report")]


def test_the_main_job_names_its_experiment_and_measures_speed_at_batch_1(tmp_path, monkeypatch):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main", overrides=[f"paths.run_dir={tmp_path}"])
    calls, log = _run_with_fake_stages(cfg, tmp_path, monkeypatch)
    names = [c[0] for c in calls]
    drafters, timed = ["uniform", "l2r_all", "prompt_lookup", "ar_assistant"], list(cfg.speed_drafters)
    assert "uniform" not in timed and "l2r_all" in timed
    assert names == ["data", "train uniform", "train l2r_all", "train ar_assistant", "choose K",
                     *(f"eval {d}" for d in drafters), "speed", "report"]
    assert [s["stage"] for s in log["stages"]] == names  # a time per stage
    assert log["machine"]["matmul_gflops_start"] > 0 and log["machine"]["matmul_gflops_end"] > 0  # the yardstick
    by_name = {c[0]: c[2] for c in calls}
    assert by_name["data"][0] == by_name["train l2r_all"][0] == "experiment=smollm2"
    assert by_name["train ar_assistant"][:2] == ["--config-name", "train_assistant_smollm2"]
    assert f"drafter.path={tmp_path}/assistant/export" in by_name["eval ar_assistant"]
    assert by_name["choose K"][:2] == ["--data-dir", "cache/regen/x/abc"]
    assert by_name["choose K"][by_name["choose K"].index("--draft-vocab-sizes") + 1:][:3] == [
        "0", "--draft-vocab-from", "cache/regen/x/abc"]  # the whole vocabulary only, counted in the drafters' data
    assert by_name["choose K"][-4:] == ["--assistant", f"{tmp_path}/assistant/export",
                                        "--drafter", f"l2r_all={tmp_path}/train/l2r_all/drafter"]
    assert f"drafters.l2r_all.path={tmp_path}/train/l2r_all/drafter" in by_name["speed"]
    assert "drafters.l2r_all.max_draft_tokens=2" in by_name["speed"]  # its best W at batch 1, chosen held out
    assert not any("max_draft_tokens" in a for a in by_name["eval l2r_all"])  # τ: the whole block
    assert not any("draft_vocab" in a for a in by_name["speed"])  # chose the whole vocabulary
    _check_evaluations(cfg, by_name, drafters, timed, tmp_path)


def _shipped(tmp_path) -> list[str]:
    """Overrides pointing conf/main.yaml's shipped drafters and assistant at stand-in folders."""
    for name in ("uniform_long", "l2r_all_long", "ar_assistant_smollm2"):
        (tmp_path / "assets" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "assets" / name / "config.json").write_text("{}")
    return [f"shipped.uniform_long={tmp_path}/assets/uniform_long", f"shipped.l2r_all_long={tmp_path}/assets/l2r_all_long",
            f"assistant.path={tmp_path}/assets/ar_assistant_smollm2"]


def test_the_sharegpt_main_job_evaluates_the_shipped_drafters_beside_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_VLLM_ENV", str(fake_vllm_env(tmp_path / "venv-vllm")))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main_sharegpt", overrides=[f"paths.run_dir={tmp_path}", *_shipped(tmp_path)])
    calls, log = _run_with_fake_stages(cfg, tmp_path, monkeypatch)
    names = [c[0] for c in calls]
    drafters = ["uniform", "l2r_all", "uniform_long", "l2r_all_long", "l2r_all_long_tree", "uniform_long_tree",
                "hybrid", "l2r_all_long_tree_n8", "prompt_lookup", "ar_assistant"]
    timed = list(cfg.speed_drafters)
    assert timed == ["l2r_all_long", "l2r_all_long_tree", "hybrid", "prompt_lookup", "ar_assistant"]
    assert names == ["data", "train uniform", "train l2r_all", "choose K",  # the assistant is shipped, not trained
                     *(f"eval {d}" for d in drafters), "speed", "serve l2r_all_long",
                     "report", "report report_long", "report report_tree"]
    assert [s["stage"] for s in log["stages"]] == names  # a time per stage
    by_name = {c[0]: c[2] for c in calls}
    assert by_name["serve l2r_all_long"][:2] == ["target=smollm2", f"drafter.path={tmp_path}/assets/l2r_all_long"]
    assert by_name["serve l2r_all_long"][-1] == f"hydra.run.dir={tmp_path}/serve/l2r_all_long"
    assert "speculators=[target,drafter]" in by_name["serve l2r_all_long"]
    assert "num_speculative_tokens=2" in by_name["serve l2r_all_long"]  # vLLM verifies the W chosen held out
    assert by_name["data"][0] == by_name["train l2r_all"][0] == "experiment=smollm2_sharegpt"
    assets = tmp_path / "assets"
    assert f"drafter.path={assets}/ar_assistant_smollm2" in by_name["eval ar_assistant"]
    assert by_name["choose K"][:2] == ["--data-dir", "cache/regen/x/abc"]
    assert by_name["choose K"][-20:] == ["--assistant", f"{assets}/ar_assistant_smollm2",
                                         "--drafter", f"l2r_all_long={assets}/l2r_all_long",
                                         "--tree", f"l2r_all_long={assets}/l2r_all_long", "--tree-vocab-size", "4096",
                                         "--tree-budgets", "3", "4", "6", "8", "--hybrid-matches", "2", "3",
                                         "--hybrid-depths", "7", "10", "15"]  # the tree grid as configured
    assert by_name["choose K"][by_name["choose K"].index("--weight-layouts") + 1:][:2] == ["onednn_packed", "--assistant"]
    # trees and the hybrid: the settings chosen held out for l2r_all_long, uniform_long's tree at the same N
    assert by_name["eval l2r_all_long_tree"][1:5] == ["drafter=tree", f"drafter.path={assets}/l2r_all_long",
                                                     "drafter.name=l2r_all_long_tree", "drafter.draft_vocab_size=4096"]
    assert {"drafter.budget=6"} <= set(by_name["eval uniform_long_tree"]) and f"drafter.path={assets}/uniform_long" in \
        by_name["eval uniform_long_tree"]
    assert {"drafter=hybrid", "drafter.budget=4", "drafter.lookup_min_match=2", "drafter.lookup_depth=5"} <= set(
        by_name["eval hybrid"])
    assert {"+drafter@drafters.hybrid=hybrid", "drafters.hybrid.budget=4", "drafters.l2r_all_long_tree.budget=6"} <= set(
        by_name["speed"])
    assert not any(a.startswith("temperatures") for a in by_name["eval hybrid"])  # T=0 and T=1
    wide = by_name["eval l2r_all_long_tree_n8"]  # its own budget after the chosen one: the later override wins
    assert wide.index("drafter.budget=8") > wide.index("drafter.budget=6") and "temperatures=[0.0]" in wide
    assert by_name["eval l2r_all_long"][:4] == ["target=smollm2", f"drafter.path={assets}/l2r_all_long",
                                                "drafter.name=l2r_all_long", "temperatures=[0.0]"]
    assert "drafters.l2r_all_long.max_draft_tokens=2" in by_name["speed"]  # its best W at batch 1, chosen held out
    answers = str(Path("experiments/assets/sharegpt_answers").resolve())
    assert by_name["choose K"][by_name["choose K"].index("--draft-vocab-sizes") + 1:][:3] == [
        "4096", "--draft-vocab-from", answers]
    for name in ("speed", *(f"eval {d}" for d in drafters)):  # the layout choose_k chose: every evaluation's
        assert "weight_layout=onednn_packed" in by_name[name], name
    assert not any("weight_layout" in a for a in by_name["train l2r_all"])  # training keeps its gradients' layout
    assert {"drafters.l2r_all_long.draft_vocab_size=8192",
            f"drafters.l2r_all_long.draft_vocab_from={answers}"} <= set(by_name["speed"])
    assert not any("max_draft_tokens" in a or "draft_vocab" in a for a in by_name["eval l2r_all_long"])  # τ: all
    assert not any(a.startswith("temperatures") for a in by_name["eval l2r_all"])  # trained here: T=0 and T=1
    _check_evaluations(cfg, by_name, drafters, timed, tmp_path)
    assert by_name["report report_long"] == [str(tmp_path / "eval" / "uniform_long"), str(tmp_path / "eval" / "l2r_all_long"),
                                             "--baseline", "uniform_long", "--out", str(tmp_path / "report_long")]


def test_without_a_vllm_environment_the_serve_check_is_skipped_and_the_log_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_VLLM_ENV", str(tmp_path / "no-vllm"))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main_sharegpt", overrides=[f"paths.run_dir={tmp_path}", *_shipped(tmp_path)])
    calls, log = _run_with_fake_stages(cfg, tmp_path, monkeypatch)
    assert not any(c[1] == "experiments.serve_check" for c in calls)
    skipped = [s for s in log["stages"] if s["stage"] == "serve l2r_all_long"]
    assert len(skipped) == 1 and "no vLLM environment" in skipped[0]["skipped"]
    assert "install_vllm.sh" in skipped[0]["skipped"]


def test_a_resumed_job_keeps_choose_k_only_where_its_arguments_are_the_same(tmp_path, monkeypatch):
    """choose_k.json is kept by a resumed job where the stage wrote it with the same arguments and models; with a new
    grid, a drafter's weights changed at the same path, or where the stage did not finish (no choose_k.json.args.json
    beside it), K is chosen again."""
    monkeypatch.setenv("BLOCKDRAFT_VLLM_ENV", str(tmp_path / "no-vllm"))

    def choices(*overrides):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose("main_sharegpt", overrides=[f"paths.run_dir={tmp_path}", *_shipped(tmp_path), *overrides])
        calls, _ = _run_with_fake_stages(cfg, tmp_path, monkeypatch)
        return [name for name, _, _ in calls].count("choose K")

    assert (choices(), choices()) == (1, 0)
    assert (choices("choose_k.ks=[1,2]"), choices("choose_k.ks=[1,2]")) == (1, 0)
    (tmp_path / "choose_k.json.args.json").unlink()  # as a stage cut after writing choose_k.json leaves it
    assert choices("choose_k.ks=[1,2]") == 1
    (tmp_path / "assets" / "l2r_all_long" / "model.safetensors").write_bytes(b"trained further")  # same path
    assert (choices("choose_k.ks=[1,2]"), choices("choose_k.ks=[1,2]")) == (1, 0)


def test_a_serve_check_of_a_drafter_the_job_does_not_have_is_refused_before_any_stage(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setenv("BLOCKDRAFT_VLLM_ENV", str(fake_vllm_env(tmp_path / "venv-vllm")))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main_sharegpt", overrides=[f"paths.run_dir={tmp_path}", *_shipped(tmp_path),
                                                  "serve_check.drafter=l2r_long"])
    monkeypatch.setattr(main_job, "stage", lambda *a: pytest.fail("no stage may run"))
    with pytest.raises(ValueError, match="serve_check.drafter=l2r_long is none of this job's block drafters"):
        main_job.run_main_job(cfg)


def test_a_missing_shipped_drafter_or_assistant_is_named_before_any_stage(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setattr(main_job, "stage", lambda *a: pytest.fail("no stage may run"))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        shipped = _shipped(tmp_path)
        for missing, match in ((f"shipped.l2r_all_long={tmp_path}/nowhere", "shipped.l2r_all_long=.*nowhere holds no drafter"),
                               (f"assistant.path={tmp_path}/nowhere", "assistant.path=.*nowhere holds no model")):
            cfg = compose("main_sharegpt", overrides=[f"paths.run_dir={tmp_path}", *shipped, missing])
            with pytest.raises(FileNotFoundError, match=match):
                main_job.run_main_job(cfg)


def test_the_tiny_regimes_main_job_keeps_its_baselines_and_drafting_settings(tmp_path, monkeypatch):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main_tiny", overrides=[f"paths.run_dir={tmp_path}"])
    calls, _ = _run_with_fake_stages(cfg, tmp_path, monkeypatch)
    by_name = {c[0]: c[2] for c in calls}
    assert "train ar_assistant" not in by_name and "speed" not in by_name
    assert by_name["eval ar_assistant"] == ["target=tiny", "drafter=ar_assistant", *cfg.evaluate_overrides,
                                            f"hydra.run.dir={tmp_path}/eval/ar_assistant"]
    trained = [*cfg.trained_evaluate_overrides, *cfg.evaluate_overrides]
    assert by_name["eval uniform"][2:-1] == trained
    assert by_name["eval corpus_lookup"][1:3] == ["drafter=corpus_lookup", "drafter.data_dir=cache/regen/x/abc"]


def test_a_baseline_that_needs_the_data_folder_without_training_is_refused(tmp_path, monkeypatch):
    import pytest

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main_tiny", overrides=[f"paths.run_dir={tmp_path}", "losses=[]"])
    monkeypatch.setattr(main_job, "stage", lambda name, module, overrides, log: None)
    with pytest.raises(ValueError, match=r"baseline_overrides.corpus_lookup needs \{data_dir\}"):
        main_job.run_main_job(cfg)


def test_a_stopped_job_leaves_its_stage_times_and_a_resumed_one_keeps_them(tmp_path):
    """Each stage rewrites main_summary.json (no total_seconds until the job ends); a resumed launch reads the earlier
    launches' stage times from it into its own earlier_launches."""
    import json

    log = {"run_dir": str(tmp_path), "summary": main_job.SUMMARY, "stages": []}
    main_job.stage("zen", "this", [], log)  # any module that exits 0
    saved = json.loads((tmp_path / main_job.SUMMARY).read_text())
    assert [s["stage"] for s in saved["stages"]] == ["zen"] and "total_seconds" not in saved
    assert main_job.earlier_launches(tmp_path) == [{"stages": saved["stages"], "total_seconds": None, "machine": None}]
    (tmp_path / main_job.SUMMARY).write_text(json.dumps({**saved, "earlier_launches": [{"stages": []}]}))
    assert len(main_job.earlier_launches(tmp_path)) == 2
    assert main_job.earlier_launches(tmp_path / "new") == []


def test_main_summary_names_the_cache_not_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    log = {"run_dir": str(tmp_path / "run"), "stages": [{"command": f"drafter.data_dir={tmp_path}/cache/regen/tiny/abc "
                                                          f"hydra.run.dir={tmp_path}/run/eval/x"}]}
    text = main_job.portable_summary(log, tmp_path / "run")
    assert str(tmp_path) not in text
    assert "drafter.data_dir=$BLOCKDRAFT_CACHE/regen/tiny/abc hydra.run.dir=eval/x" in text


def test_the_readme_main_job_is_the_sharegpt_one_and_its_shipped_drafters_are_committed(tmp_path):
    """``python -m experiments.main`` composes conf/main_sharegpt.yaml; the drafters and the assistant it reads are
    in experiments/assets (a clone runs it as it is)."""
    printed = subprocess.run([sys.executable, "-m", "experiments.main", "--cfg", "job"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert "train_experiment: smollm2_sharegpt" in printed and "l2r_all_long: ${asset:l2r_all_long}" in printed
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main_sharegpt", overrides=[f"paths.run_dir={tmp_path}"])
    assert set(main_job.shipped_drafters(cfg)) == {"uniform_long", "l2r_all_long"}
    assert Path(main_job.assistant_dir(cfg, tmp_path)).name == "ar_assistant_smollm2"
