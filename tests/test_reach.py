"""experiments.reporting.reach: lines in log2(hours), the hours one drafter's line passes another's, the report."""

import json

import pytest

from experiments.pipeline.records import temperature_key
from experiments.reporting import reach

SUITES = ["a", "b"]


def _eval(root, name, taus):
    folder = root / name
    folder.mkdir(parents=True)
    results = {s: {temperature_key(0.0): {"tau": t}} for s, t in zip(SUITES, taus)}
    (folder / "results.json").write_text(json.dumps({"results": results}))
    return name


def _spec(tmp_path):
    # subject: mean τ 1.5 at 2 h and 1.6 at 8 h (+0.05 per doubling); lookup: 1.7 at any hours;
    # rival: 1.55 at 2 h and 1.75 at 8 h (+0.1 per doubling)
    return {"suites": SUITES, "subject": "drafter", "drafters": {
        "drafter": {"chosen_width": 2, "budgets": [
            {"hours": 8, "evals": {"2": _eval(tmp_path, "d8", [1.5, 1.7])}},
            {"hours": 2, "evals": {"2": _eval(tmp_path, "d2", [1.4, 1.6])}}]},
        "lookup": {"chosen_width": 2, "budgets": [{"hours": 0, "evals": {"2": _eval(tmp_path, "l", [1.6, 1.8])}}]},
        "rival": {"chosen_width": 2, "budgets": [
            {"hours": 2, "evals": {"2": _eval(tmp_path, "r2", [1.5, 1.6])}},
            {"hours": 8, "evals": {"2": _eval(tmp_path, "r8", [1.7, 1.8])}}]}}}


def test_the_subject_reaches_a_constant_where_its_line_does_and_never_a_rival_that_rises_faster(tmp_path):
    doc = reach.analyse(_spec(tmp_path), tmp_path)
    assert doc["lines"]["drafter"]["2"] == pytest.approx({"a": 1.45, "b": 0.05, "budgets": 2})
    assert doc["lines"]["lookup"]["2"] == {"a": 1.7, "b": 0.0, "budgets": 1}
    assert doc["subject_hours_now"] == 8
    # 1.45 + 0.05 * log2(h) = 1.7  ->  h = 2 ** 5 = 32 h, 4x now
    assert doc["reach"]["lookup"]["rival_chosen_width"] == {"rival_width": 2, "hours": 32.0, "times_now": 4.0}
    assert doc["reach"]["rival"]["equal_width"]["hours"] is None
    assert "never (the rival gains at least as fast)" in "\n".join(reach.markdown(doc))


def test_a_drafter_already_ahead_is_said_to_be(tmp_path):
    spec = _spec(tmp_path)
    spec["subject"] = "rival"  # 1.45 + 0.1 log2(h) passes the lookup's 1.7 at 2 ** 2.5 h, before its 8 h
    doc = reach.analyse(spec, tmp_path)
    assert doc["reach"]["lookup"]["equal_width"]["hours"] == pytest.approx(2 ** 2.5, abs=0.01)
    assert doc["reach"]["drafter"]["equal_width"]["hours"] == pytest.approx(1.0)  # both lines read 1.45 at 1 h
    assert "ahead already" in "\n".join(reach.markdown(doc))


def test_crossing_hours_of_parallel_lines():
    assert reach.crossing_hours({"a": 1.0, "b": 0.1}, {"a": 0.9, "b": 0.1}) == 0.0
    assert reach.crossing_hours({"a": 1.0, "b": 0.1}, {"a": 1.1, "b": 0.1}) is None


def test_an_evaluation_missing_a_suite_is_named(tmp_path):
    spec = _spec(tmp_path)
    spec["suites"] = [*SUITES, "c"]
    with pytest.raises(ValueError, match=r"d8/results.json.*'drafter', width 2"):
        reach.analyse(spec, tmp_path)


def test_main_writes_the_json_the_table_and_the_plot(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(tmp_path)))
    reach.main([str(spec), "--out", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "reach.json").read_text())["reach"]["lookup"]
    assert "| drafter | 8 | **1.600** |" in (tmp_path / "out" / "reach.md").read_text()
    assert (tmp_path / "out" / "reach.png").stat().st_size > 0


def test_held_out_numbers_get_their_table_and_their_gain_per_doubling(tmp_path):
    spec = _spec(tmp_path)
    hours_8, hours_2 = spec["drafters"]["drafter"]["budgets"]
    hours_2["held_out"] = {"tau": 1.7, "k": 7, "slot_accuracy": [0.5, 0.2]}
    hours_8["held_out"] = {"tau": 1.8, "k": 7, "slot_accuracy": [0.6, 0.2, 0.1]}  # 2 doublings later
    spec["drafters"]["rival"]["budgets"][0]["held_out"] = {"tau": 1.9, "k": 7}  # one budget: no line
    doc = reach.analyse(spec, tmp_path)
    lines = doc["held_out_lines"]
    assert list(lines) == ["drafter"]
    assert lines["drafter"]["tau"]["b"] == pytest.approx(0.05)
    assert [s["b"] for s in lines["drafter"]["slot_accuracy"]] == pytest.approx([0.05, 0.0])  # slots both report
    text = "\n".join(reach.markdown(doc))
    assert "| drafter | 8 | 1.800 | 7 | 0.600 / 0.200 / 0.100 |" in text
    assert "| rival | 2 | 1.900 | 7 |  |" in text
    assert "- drafter: held-out τ +0.050 per doubling of hours; accuracy per slot +0.050, +0.000" in text


def test_without_held_out_numbers_the_report_has_no_held_out_part(tmp_path):
    doc = reach.analyse(_spec(tmp_path), tmp_path)
    assert doc["held_out_lines"] == {} and "held-out" not in "\n".join(reach.markdown(doc))


@pytest.mark.parametrize("change, message", [
    (lambda s: s["drafters"]["drafter"]["budgets"][0].update(held_out={"tau": 0.5, "k": 7}),
     r"drafters\.drafter\.budgets\.0\.held_out\.tau"),
    (lambda s: s["drafters"]["drafter"]["budgets"][0].update(held_out={"tau": 1.5, "k": 7, "slots": [0.1]}),
     r"held_out\.slots"),
    (lambda s: s.update(subject="nobody"), "subject 'nobody' is not one of the drafters"),
    (lambda s: s["drafters"]["rival"]["budgets"][0].update(hours=0), "needs hours > 0 in each"),
    (lambda s: s["drafters"]["lookup"].pop("chosen_width"), r"drafters\.lookup\.chosen_width"),
])
def test_a_wrong_spec_is_refused_naming_the_file_and_the_field(tmp_path, change, message):
    spec = _spec(tmp_path)
    change(spec)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=message) as refused:
        reach.main([str(path)])
    assert str(path) in str(refused.value)


def test_three_budgets_give_the_slope_an_interval_and_the_recent_slope():
    # +0.1 per doubling from 1 h to 2 h, then +0.02 per doubling from 2 h to 8 h: the gains flatten
    ln = reach.fit([(8, 1.74), (1, 1.6), (2, 1.7)])   # any order
    x, y = [0, 1, 3], [1.6, 1.7, 1.74]
    mx, my = sum(x) / 3, sum(y) / 3
    b = sum((a - mx) * (c - my) for a, c in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    assert ln["b"] == pytest.approx(b, abs=1e-4) and ln["budgets"] == 3
    assert ln["b_last"] == pytest.approx(0.02) and ln["a_last"] == pytest.approx(1.68)
    lo, hi = ln["b_ci95"]
    assert lo < b < hi and hi - lo > 0.1   # one degree of freedom: a wide interval
    assert reach.fit([(1, 1.0), (2, 1.1), (4, 1.2)])["b_ci95"] == pytest.approx([0.1, 0.1])  # on a line: no spread
    assert "b_last" not in reach.fit([(1, 1.0), (2, 1.1)])


def test_with_three_budgets_the_report_says_when_at_the_recent_slopes(tmp_path):
    spec = _spec(tmp_path)   # the subject: 1.5 at 2 h, 1.6 at 8 h; now a third budget, 1.62 at 32 h
    spec["drafters"]["drafter"]["budgets"].append({"hours": 32, "evals": {"2": _eval(tmp_path, "d32", [1.52, 1.72])}})
    doc = reach.analyse(spec, tmp_path)
    ln = doc["lines"]["drafter"]["2"]
    assert ln["b_last"] == pytest.approx(0.01)   # +0.02 over two doublings
    lookup = doc["reach"]["lookup"]["rival_chosen_width"]
    # recent line through (32 h, 1.62) at +0.01 a doubling reaches 1.7 eight doublings later: 32 * 2 ** 8 h
    assert lookup["at_recent_slopes"]["hours"] == pytest.approx(32 * 2 ** 8)
    assert lookup["hours"] < lookup["at_recent_slopes"]["hours"]   # the fitted line is steeper than the recent one
    assert "rival_chosen_width" in doc["reach"]["rival"] and "at_recent_slopes" in doc["reach"]["rival"]["equal_width"]
    text = "\n".join(reach.markdown(doc))
    assert f"at the last two budgets' slopes: {32 * 2 ** 8:g} h (256× now)" in text
    assert "- drafter at width 2: +" in text and "the last two: +0.010" in text
