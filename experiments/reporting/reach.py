"""How much more training a drafter needs to pass another (issue 50): τ at each width against training hours, a line
in log2(hours) per drafter and width, and the hours at which one drafter's line passes another's.

The points come from a spec (JSON) that names, for each drafter, the width chosen for it and, per training budget,
its hours and the evaluation of each width (``results.json`` folders, relative to the spec), e.g.::

    {"suites": ["humaneval", "gsm_symbolic", "mtbench"], "temperature": 0.0, "subject": "l2r_all_long",
     "drafters": {
       "l2r_all_long": {"chosen_width": 3, "budgets": [
           {"hours": 2.72, "steps": 20000, "from": "a1b1465:experiments/assets/l2r_all_long",
            "evals": {"1": "evals/l2r20_w1", "2": "evals/l2r20_w2"}}, ...]},
       "prompt_lookup": {"chosen_width": 3, "budgets": [{"hours": 0, "evals": {"3": "evals/pl_k3"}}]}}}

A drafter with one budget is a constant (prompt lookup trains nothing); two or more budgets give a least-squares
line τ = a + b·log2(hours). A budget may also carry its model card's held-out numbers (``"held_out": {"tau": 1.78,
"k": 7, "slot_accuracy": [0.56, ...]}``): the report gives their table and their gain per doubling of hours, which
the suites' shift of subject does not touch. With two budgets the line goes through both points: it is a cost
model, not a fit with an interval, and the report says so; from three on, the report adds the slope's 95% interval
and the slope of the last two budgets, and when the subject reaches each rival at those recent slopes (lower where
the gains flatten). Outputs ``reach.json``, ``reach.md`` and ``reach.png``.

    python -m experiments.reporting.reach <spec.json> [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pydantic
from scipy import stats

from experiments.reporting.plots import plot_reach
from experiments.reporting.runs import suites_tau


class HeldOut(pydantic.BaseModel, extra="forbid"):
    """What a model card says of the held-out training answers at one budget: greedy τ replayed with ``k`` drafts a
    step, and for a block drafter its teacher-forced accuracy at each slot."""

    tau: float = pydantic.Field(ge=1)
    k: int = pydantic.Field(ge=1)
    slot_accuracy: list[float] = []


class Budget(pydantic.BaseModel, extra="allow"):
    """One training budget of a drafter: its hours, the evaluation folder of each width and, optionally, its held-out
    numbers (other keys, e.g. ``steps`` and ``from``, are kept as they are)."""

    hours: float = pydantic.Field(ge=0)
    evals: dict[int, str] = pydantic.Field(min_length=1)
    held_out: HeldOut | None = None


class DrafterSpec(pydantic.BaseModel):
    chosen_width: int
    budgets: list[Budget] = pydantic.Field(min_length=1)

    @pydantic.model_validator(mode="after")
    def _hours_on_a_log_scale(self):
        if len(self.budgets) > 1 and min(b.hours for b in self.budgets) <= 0:
            raise ValueError("a drafter with several budgets needs hours > 0 in each (they lie on a log scale)")
        return self


class Spec(pydantic.BaseModel, extra="allow"):
    """The spec of the module doc."""

    suites: list[str] = pydantic.Field(min_length=1)
    temperature: float = 0.0
    subject: str
    drafters: dict[str, DrafterSpec]

    @pydantic.model_validator(mode="after")
    def _subject_is_a_drafter(self):
        if self.subject not in self.drafters:
            raise ValueError(f"subject {self.subject!r} is not one of the drafters {sorted(self.drafters)}")
        return self


def read_spec(path: Path) -> Spec:
    """The spec in ``path``; a ValueError names the file and each field that is wrong."""
    try:
        return Spec.model_validate_json(path.read_text())
    except pydantic.ValidationError as error:
        raise ValueError(f"{path}: {error}") from None


def _points(spec: Spec, root: Path) -> dict[str, dict]:
    """``{drafter: {"chosen_width", "budgets": [{hours, steps?, from?, tau: {width: {suite: τ, mean}}}]}}``."""
    out = {}
    for name, d in spec.drafters.items():
        budgets = []
        for b in d.budgets:
            taus = {}
            for width, folder in b.evals.items():
                tau = suites_tau(root / folder / "results.json", spec.suites, spec.temperature)
                if tau is None:
                    raise ValueError(f"{root / folder / 'results.json'}: no T={spec.temperature} τ for every suite "
                                     f"of {spec.suites} (drafter {name!r}, width {width})")
                taus[str(width)] = tau
            budgets.append({**b.model_dump(exclude={"evals"}), "tau": taus})
        out[name] = {"chosen_width": d.chosen_width, "budgets": sorted(budgets, key=lambda b: b["hours"])}
    return out


def _widths(points: dict[str, dict]) -> list[str]:
    """Every width any drafter was evaluated at, in order."""
    return sorted({w for d in points.values() for b in d["budgets"] for w in b["tau"]}, key=int)


def fit(points: Sequence[tuple[float, float]]) -> dict | None:
    """y = a + b·log2(hours) through ``(hours, y)`` points (least squares, ``scipy.stats.linregress``); a constant
    for one point; None for none. From three points on, also the slope's 95% interval (t with n − 2 degrees of
    freedom) and the line through the last two points (``a_last``, ``b_last``): the recent slope, which is lower
    than the fitted one where the gains flatten."""
    if not points:
        return None
    if len(points) == 1:
        return {"a": points[0][1], "b": 0.0, "budgets": 1}
    points = sorted(points)
    x = np.log2([p[0] for p in points])
    y = np.array([p[1] for p in points])
    r = stats.linregress(x, y)
    out = {"a": round(float(r.intercept), 4), "b": round(float(r.slope), 4), "budgets": len(points)}
    if len(points) >= 3:
        half = float(stats.t.ppf(0.975, len(points) - 2) * r.stderr)
        b_last = float((y[-1] - y[-2]) / (x[-1] - x[-2]))
        out |= {"b_ci95": [round(float(r.slope) - half, 4), round(float(r.slope) + half, 4)],
                "a_last": round(float(y[-1] - b_last * x[-1]), 4), "b_last": round(b_last, 4)}
    return out


def recent(ln: dict) -> dict:
    """The line through a fitted line's last two budgets where it has one (three budgets or more), else itself."""
    return {"a": ln["a_last"], "b": ln["b_last"]} if "b_last" in ln else ln


def line(budgets: Sequence[dict], width: str) -> dict | None:
    """τ's :func:`fit` over the budgets that evaluated ``width``."""
    return fit([(b["hours"], b["tau"][width]["mean"]) for b in budgets if width in b["tau"]])


def held_out_lines(points: dict[str, dict]) -> dict[str, dict]:
    """Per drafter with held-out numbers at two budgets or more, the :func:`fit` of its held-out τ and of its
    accuracy at each slot (the slots every such budget reports)."""
    out = {}
    for name, d in points.items():
        held = [(b["hours"], b["held_out"]) for b in d["budgets"] if b.get("held_out")]
        if len(held) < 2:
            continue
        slots = min(len(h["slot_accuracy"]) for _, h in held)
        out[name] = {"k": held[-1][1]["k"], "tau": fit([(t, h["tau"]) for t, h in held]),
                     "slot_accuracy": [fit([(t, h["slot_accuracy"][s]) for t, h in held]) for s in range(slots)]}
    return out


def crossing_hours(subject: dict, rival: dict) -> float | None:
    """The hours from which ``subject``'s line stays at or above ``rival``'s (both at equal hours; earlier than
    now when it is already ahead); None when it never does: the rival's line rises as fast or faster and is not
    below, or rises faster and so ends ahead whatever it is now."""
    if subject["b"] == rival["b"]:
        return 0.0 if subject["a"] >= rival["a"] else None
    if subject["b"] < rival["b"]:
        return None
    return float(2 ** ((rival["a"] - subject["a"]) / (subject["b"] - rival["b"])))


def _when(hours: float | None, now: float) -> dict:
    return {"hours": None if hours is None else round(hours, 2),
            "times_now": None if hours is None else round(hours / now, 2)}


def analyse(spec: Spec | dict, root: Path) -> dict:
    """Every drafter's points and lines; for the subject at its chosen width, the hours to reach each rival at the
    rival's chosen width and at the subject's."""
    spec = spec if isinstance(spec, Spec) else Spec.model_validate(spec)
    points = _points(spec, root)
    widths = _widths(points)
    lines = {n: {w: ln for w in widths if (ln := line(d["budgets"], w)) is not None} for n, d in points.items()}
    subject = spec.subject
    sw = str(points[subject]["chosen_width"])
    now = points[subject]["budgets"][-1]["hours"]
    reach = {}
    for rival, d in points.items():
        if rival == subject:
            continue
        row = {}
        for label, rw in (("rival_chosen_width", str(d["chosen_width"])), ("equal_width", sw)):
            if rw in lines[rival] and sw in lines[subject]:
                sub, riv = lines[subject][sw], lines[rival][rw]
                row[label] = {"rival_width": int(rw), **_when(crossing_hours(sub, riv), now)}
                if "b_last" in sub or "b_last" in riv:   # the same from the lines through the last two budgets
                    row[label]["at_recent_slopes"] = _when(crossing_hours(recent(sub), recent(riv)), now)
        reach[rival] = row
    return {"suites": spec.suites, "temperature": spec.temperature, "subject": subject,
            "subject_width": int(sw), "subject_hours_now": now, "points": points, "lines": lines, "reach": reach,
            "held_out_lines": held_out_lines(points)}


def _cell(tau: dict | None, chosen: bool) -> str:
    if tau is None:
        return ""
    return f"**{tau['mean']:.3f}**" if chosen else f"{tau['mean']:.3f}"


def markdown(doc: dict) -> list[str]:
    widths = _widths(doc["points"])
    rows = ["| drafter | hours | " + " | ".join(f"τ at {w}" for w in widths) + " |",
            "|---|---|" + "---|" * len(widths)]
    for name, d in doc["points"].items():
        for b in d["budgets"]:
            cells = [_cell(b["tau"].get(w), int(w) == d["chosen_width"]) for w in widths]
            rows.append(f"| {name} | {b['hours']:g} | " + " | ".join(cells) + " |")
    rows += ["", (f"Bold: the width chosen for each drafter. Least-squares lines τ = a + b·log2(hours) (through both "
                  f"points where a drafter has two budgets: a cost model, not a fit with an interval; from three "
                  f"budgets on, the slope's 95% interval and the slope of the last two budgets) say when "
                  f"{doc['subject']} at width {doc['subject_width']} reaches each rival (now: "
                  f"{doc['subject_hours_now']:g} h):"), ""]
    for rival, row in doc["reach"].items():
        for label, r in row.items():
            text = f"- {rival} at width {r['rival_width']} ({label.replace('_', ' ')}): {_when_text(r)}"
            if "at_recent_slopes" in r:
                text += f"; at the last two budgets' slopes: {_when_text(r['at_recent_slopes'])}"
            rows.append(text)
    rows += ["", "Gain per doubling of training hours at each trained drafter's chosen width:", ""]
    for name, d in doc["points"].items():
        ln = doc["lines"][name].get(str(d["chosen_width"]))
        if ln is not None and ln["budgets"] > 1:
            rows.append(f"- {name} at width {d['chosen_width']}: {slope_text(ln)}")
    return rows + held_out_markdown(doc)


def _when_text(r: dict) -> str:
    if r["hours"] is None:
        return "never (the rival gains at least as fast)"
    return f"{r['hours']:g} h ({r['times_now']:g}× now)" + (": ahead already" if r["times_now"] <= 1 else "")


def slope_text(ln: dict) -> str:
    """``+0.038 per doubling`` with, from three budgets on, its 95% interval and the last two budgets' slope."""
    text = f"{ln['b']:+.3f} per doubling of hours"
    if "b_last" in ln:
        lo, hi = ln["b_ci95"]
        text += f" (95% interval [{lo:+.3f}, {hi:+.3f}] over {ln['budgets']} budgets; the last two: {ln['b_last']:+.3f})"
    return text


def held_out_markdown(doc: dict) -> list[str]:
    """The held-out table and each drafter's gain per doubling of hours; nothing when no budget has held-out numbers."""
    held = [(n, b) for n, d in doc["points"].items() for b in d["budgets"] if b.get("held_out")]
    if not held:
        return []
    rows = ["", ("On the held-out training answers (the model cards' greedy τ replayed with K drafts a step, and a "
                 "block drafter's teacher-forced accuracy at each slot):"), "",
            "| drafter | hours | held-out τ | K | accuracy at each slot |", "|---|---|---|---|---|"]
    for name, b in held:
        h = b["held_out"]
        rows.append(f"| {name} | {b['hours']:g} | {h['tau']:.3f} | {h['k']} | "
                    + " / ".join(f"{a:.3f}" for a in h["slot_accuracy"]) + " |")
    rows.append("")
    for name, ln in doc.get("held_out_lines", {}).items():
        slots = ", ".join(f"{s['b']:+.3f}" for s in ln["slot_accuracy"])
        rows.append(f"- {name}: held-out τ {slope_text(ln['tau'])}"
                    + (f"; accuracy per slot {slots}" if slots else ""))
    return rows


def write(doc: dict, out: str | Path) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reach.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "reach.md").write_text("\n".join(markdown(doc)) + "\n")
    plot_reach(doc, out / "reach.png")
    return doc


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path)
    parser.add_argument("--out", type=Path, help="default: the spec's folder")
    args = parser.parse_args(argv)
    doc = write(analyse(read_spec(args.spec), args.spec.parent), args.out or args.spec.parent)
    print("\n".join(markdown(doc)))
    return doc


if __name__ == "__main__":
    main()
