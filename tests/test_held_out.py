"""experiments.reporting.held_out: runs' held-out validations side by side, from their CSV loggers' metrics.csv."""

import json

import pytest

from experiments.reporting import held_out

HEADER = "epoch,step,train/loss,val/acc_slot1,val/tau_greedy\n"


def _run(tmp_path, name, rows):
    run = tmp_path / name
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "metrics.csv").write_text(HEADER + "".join(rows))  # as Lightning's CSV logger writes it
    return run


def test_collect_keeps_validation_rows_in_step_order(tmp_path):
    run = _run(tmp_path, "a", ["0,500,3.2,0.55,1.70\n", "0,0,,0.58,1.82\n", "0,250,3.1,,\n"])
    doc = held_out.collect(held_out.parse_runs([f"lr3e-4={run}"]))
    assert [p["step"] for p in doc["lr3e-4"]["points"]] == [0, 500]  # the training-only row is left out
    assert doc["lr3e-4"]["points"][1] == {"step": 500, "val/acc_slot1": 0.55, "val/tau_greedy": 1.7}


def test_table_gives_each_change_from_the_first_validation(tmp_path):
    a = _run(tmp_path, "a", ["0,0,,0.58,1.823\n", "0,1000,,0.5,1.70\n"])
    b = _run(tmp_path, "b", ["0,0,,0.58,1.823\n", "0,500,,0.57,1.80\n"])
    text = held_out.table(held_out.collect(held_out.parse_runs([f"hi={a}", f"lo={b}"])))
    assert "| hi | 1.823 |  | 1.700 (-0.123) |" in text
    assert "| lo | 1.823 | 1.800 (-0.023) |  |" in text


def test_write_makes_json_markdown_and_plot(tmp_path):
    run = _run(tmp_path, "a", ["0,0,,0.58,1.82\n", "0,250,,0.57,1.79\n"])
    held_out.main([f"x={run}", "--out", str(tmp_path / "out"), "--title", "t"])
    doc = json.loads((tmp_path / "out" / "held_out.json").read_text())
    assert doc["runs"]["x"]["points"][-1]["val/tau_greedy"] == 1.79
    assert (tmp_path / "out" / "held_out.png").stat().st_size > 0
    assert "1.790 (-0.030)" in (tmp_path / "out" / "held_out.md").read_text()


def test_a_run_outside_the_repository_is_named_without_this_machines_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("BLOCKDRAFT_RUNS", raising=False)
    run = _run(tmp_path / "state" / "dip", "lr3e-4", ["0,0,,0.58,1.82\n"])
    held_out.main([f"x={run}", "--out", str(tmp_path / "out")])
    doc = json.loads((tmp_path / "out" / "held_out.json").read_text())
    assert doc["runs"]["x"]["run_dir"] == ".../state/dip/lr3e-4"
    assert str(tmp_path) not in (tmp_path / "out" / "held_out.json").read_text()


def test_a_run_under_the_runs_folder_is_named_by_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(tmp_path / "runs"))
    run = _run(tmp_path / "runs" / "dip", "lr1e-4", ["0,0,,0.58,1.82\n"])
    doc = held_out.collect(held_out.parse_runs([f"x={run}"]))
    assert doc["x"]["run_dir"] == "$BLOCKDRAFT_RUNS/dip/lr1e-4"


@pytest.mark.parametrize("spec, error", [("noequals", "NAME=RUN_DIR"), ("x=", "NAME=RUN_DIR"),
                                         ("x={missing}", "no metrics.csv")])
def test_bad_arguments_are_refused_by_name(tmp_path, spec, error):
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        held_out.parse_runs([spec.format(missing=tmp_path / "nothing")])


def test_a_name_given_twice_is_refused(tmp_path):
    run = _run(tmp_path, "a", ["0,0,,0.58,1.82\n"])
    with pytest.raises(ValueError, match="given twice"):
        held_out.parse_runs([f"x={run}", f"x={run}"])
