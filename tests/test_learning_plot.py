"""experiments.bench.learning_plot: reads collections and single bench outputs, plots both panels."""

import json
import sys

import pytest

from experiments.bench import learning_plot


def test_curves_from_collection_and_bench_output(tmp_path, monkeypatch):
    collection = tmp_path / "curves.json"
    collection.write_text(json.dumps({"runs": {"ar": {"what": "x", "curve": [
        {"step": 0, "tau": 1.0, "acc1": 0.1}, {"step": 100, "tau": 2.5, "acc1": 0.6}]}}}))
    single = tmp_path / "block.json"
    single.write_text(json.dumps({"settings": {}, "curve": [
        {"step": 0, "tau": 1.0, "acc_slot": [0.0, 0.0]}, {"step": 200, "tau": 1.5, "acc_slot": [0.4, 0.2]}]}))
    curves = learning_plot.load_curves([collection, single])
    assert sorted(curves) == ["ar", "block"]
    assert learning_plot.series(curves["block"], "acc1") == ([0, 200], [0.0, 0.4])
    assert learning_plot.series(curves["ar"], "tau") == ([0, 100], [1.0, 2.5])
    monkeypatch.setattr(sys, "argv", ["x", str(collection), str(single), "--runs", "block", "ar",
                                      "--out", str(tmp_path / "plots")])
    learning_plot.main()
    for name in ("learning_tau.png", "learning_acc1.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    monkeypatch.setattr(sys, "argv", ["x", str(collection), "--runs", "nope"])
    with pytest.raises(SystemExit, match="nope"):
        learning_plot.main()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        learning_plot.load_curves([bad])
