"""A report names the configurations trained for another budget than its baseline: a gain over a drafter trained
three times shorter is not the loss's gain (the main job's long pair: l2r_all_long 60K steps, uniform_long 20K)."""

from __future__ import annotations

import json

from experiments.reporting import build_report, load_runs, render_markdown
from experiments.reporting.runs import training_budget

RESULTS = {"code": {"t0": {"suite": "code", "temperature": 0.0, "K": 3, "num_prompts": 2, "tau": 1.5,
                           "tau_ci_low": 1.4, "tau_ci_high": 1.6}}}


def _trained(root, name, steps, seconds):
    """An evaluation beside a training run that wrote train_summary.json."""
    (root / name).mkdir(parents=True)
    (root / name / "train_summary.json").write_text(json.dumps({"steps": steps, "train_seconds": seconds}))
    doc = {"results": RESULTS, "drafter": {"name": name, "path": str(root / name / "drafter")}}
    (root / name / "results.json").write_text(json.dumps(doc))


def _shipped(root, name, training):
    """An evaluation of a shipped drafter, whose card.json says how it trained."""
    drafter = root / "assets" / name
    drafter.mkdir(parents=True)
    (drafter / "card.json").write_text(json.dumps({"name": name, "training": training}))
    (root / name).mkdir()
    doc = {"results": RESULTS, "drafter": {"name": name, "path": str(drafter)}}
    (root / name / "results.json").write_text(json.dumps(doc))


def test_a_budget_comes_from_the_training_run_or_the_shipped_card_with_a_continuations_totals(tmp_path):
    _trained(tmp_path, "uniform", 700, 172.7)
    _shipped(tmp_path, "l2r_all_long", {"steps": 20000, "train_seconds": 16747.3,
                                        "continued_from": {"total_steps": 60000, "total_train_seconds": 43309.4}})
    _shipped(tmp_path, "uniform_long", {"steps": 20000, "train_seconds": 11531.0})
    (tmp_path / "prompt_lookup").mkdir()
    (tmp_path / "prompt_lookup" / "results.json").write_text(json.dumps({"results": RESULTS,
                                                                         "drafter": {"name": "prompt_lookup"}}))
    budgets = {run.name: training_budget(run) for run in load_runs([tmp_path])}
    assert budgets == {"uniform": {"steps": 700, "train_seconds": 172.7},
                       "l2r_all_long": {"steps": 60000, "train_seconds": 43309.4},
                       "uniform_long": {"steps": 20000, "train_seconds": 11531.0}, "prompt_lookup": None}


def test_the_gain_table_names_the_configurations_trained_for_another_budget(tmp_path):
    _shipped(tmp_path, "uniform_long", {"steps": 20000, "train_seconds": 11531.0})
    _shipped(tmp_path, "l2r_all_long", {"steps": 20000, "train_seconds": 16747.3,
                                        "continued_from": {"total_steps": 60000, "total_train_seconds": 43309.4}})
    report = build_report(load_runs([tmp_path / "uniform_long", tmp_path / "l2r_all_long"]), baseline="uniform_long",
                          num_bootstrap=20)
    assert [c["budget"]["steps"] for c in report["configurations"]] == [20000, 60000]
    text = render_markdown(report)
    assert "Training budgets differ from uniform_long's (20,000 steps, 3.2 h): l2r_all_long 60,000 steps, 12.0 h." \
        in text
    assert text.index("### Gain over uniform_long") < text.index("Training budgets differ")


def test_equal_or_unknown_budgets_add_no_line(tmp_path):
    _trained(tmp_path, "uniform", 700, 172.7)
    _trained(tmp_path, "l2r_all", 700, 175.6)
    (tmp_path / "prompt_lookup").mkdir()
    (tmp_path / "prompt_lookup" / "results.json").write_text(json.dumps({"results": RESULTS,
                                                                         "drafter": {"name": "prompt_lookup"}}))
    report = build_report(load_runs([tmp_path]), baseline="uniform", num_bootstrap=20)
    assert {c["name"]: c["budget"] for c in report["configurations"]}["prompt_lookup"] is None
    assert "Training budgets differ" not in render_markdown(report)
