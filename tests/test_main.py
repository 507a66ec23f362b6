"""experiments.main: the stage list (commands only; every stage is tested through its own entry point)."""

from __future__ import annotations

from hydra import compose, initialize_config_module

from experiments.pipeline import main_job


def test_stages_evaluate_baselines_after_trained_drafters(tmp_path, monkeypatch):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main", overrides=[f"paths.run_dir={tmp_path}", "target_choice=tiny"])
    calls = []

    def fake_stage(name, module, overrides, log):
        calls.append((name, module, overrides))
        log["stages"].append({"stage": name, "seconds": 0.0})
        if module == "experiments.report":
            (tmp_path / "report").mkdir()
            (tmp_path / "report" / "report.md").write_text("table\n")

    monkeypatch.setattr(main_job, "stage", fake_stage)
    (tmp_path / "train" / "uniform").mkdir(parents=True)  # what the training stage records
    (tmp_path / "train" / "uniform" / "train_summary.json").write_text('{"data_dir": "cache/regen/tiny/abc"}')
    log = main_job.run_main_job(cfg)
    names = [c[0] for c in calls]
    assert names == ["regenerate", "train uniform", "evaluate uniform", "train l2r_all", "evaluate l2r_all",
                     "evaluate prompt_lookup", "evaluate ar_assistant", "evaluate corpus_lookup", "report"]
    assert [s["stage"] for s in log["stages"]] == names  # a time per stage
    by_name = {c[0]: c[2] for c in calls}
    evaluate_overrides = list(cfg.evaluate_overrides)
    for baseline in ("prompt_lookup", "ar_assistant"):
        args = by_name[f"evaluate {baseline}"]
        assert f"drafter={baseline}" in args and not any(a.startswith("drafter.path=") for a in args)
        assert args[-len(evaluate_overrides) - 1:-1] == evaluate_overrides
        assert args[-1] == f"hydra.run.dir={tmp_path}/eval/{baseline}"
    assert by_name["evaluate uniform"][1] == f"drafter.path={tmp_path}/train/uniform/drafter"
    trained = [*evaluate_overrides, *cfg.trained_evaluate_overrides]
    assert by_name["evaluate uniform"][-len(trained) - 1:-1] == trained  # the trained drafters' own settings
    report_args = by_name["report"]
    assert report_args[:5] == [str(tmp_path / "eval" / n) for n in ("uniform", "l2r_all", "prompt_lookup",
                                                                   "ar_assistant", "corpus_lookup")]
    corpus = by_name["evaluate corpus_lookup"]  # its store is the drafters' data folder
    assert corpus[-len(evaluate_overrides) - 3:-len(evaluate_overrides) - 1] == [
        "drafter=corpus_lookup", "drafter.data_dir=cache/regen/tiny/abc"]


def test_a_baseline_that_needs_the_data_folder_without_training_is_refused(tmp_path, monkeypatch):
    import pytest

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("main", overrides=[f"paths.run_dir={tmp_path}", "target_choice=tiny", "losses=[]"])
    monkeypatch.setattr(main_job, "stage", lambda name, module, overrides, log: None)
    with pytest.raises(ValueError, match=r"baseline_overrides.corpus_lookup needs the drafters' data folder"):
        main_job.run_main_job(cfg)


def test_main_summary_names_the_cache_not_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    log = {"run_dir": str(tmp_path / "run"), "stages": [{"command": f"drafter.data_dir={tmp_path}/cache/regen/tiny/abc "
                                                          f"hydra.run.dir={tmp_path}/run/eval/x"}]}
    text = main_job.portable_summary(log, tmp_path / "run")
    assert str(tmp_path) not in text
    assert "drafter.data_dir=$BLOCKDRAFT_CACHE/regen/tiny/abc hydra.run.dir=eval/x" in text
