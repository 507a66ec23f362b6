"""What training data buys (issue 50): τ against the number of training answers at equal steps, and against the
training steps on all of them; ``data_scale.json``, ``data_scale.png`` and ``data_scale.md``.

The points come from a long job's run dir (:mod:`experiments.jobs.long_job`, :func:`collect`):

* ``answers``: each curve run ``curve/<loss>-rows<N|all>[-gamma<g>]`` (for ``l2r_all`` the γ of ``gamma.json``):
  its training answers (``train_summary.json``'s ``train_rows``), the suites' mean τ at T=0 (its evaluation) and
  the held-out τ (``val/tau_greedy`` on the held-out split of the training answers, at its last step);
* ``steps``: each long run ``long/<loss>``: its snapshots ``snapshots/step-<N>`` and its final drafter, with the
  suites' mean τ and the held-out τ logged at that step. These are points along one run (one cosine schedule over
  the whole budget), not runs trained to each budget.

    python -m experiments.reporting.data_scale <long job run dir> [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path

from experiments.reporting.plots import plot_data_scale
from experiments.reporting.runs import logged_metric, suites_tau

CURVE_RUN = re.compile(r"(?P<loss>.+)-rows(?P<rows>\d+|all)(?:-gamma(?P<gamma>[0-9.e+-]+))?$")
HELD_OUT = "val/tau_greedy"


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _answers_points(run_dir: Path, suites: Sequence[str], gamma: float | None) -> dict[str, list[dict]]:
    points: dict[str, list[dict]] = {}
    for run in sorted((run_dir / "curve").glob("*")):
        match, summary = CURVE_RUN.match(run.name), _read(run / "train_summary.json")
        if match is None or summary is None:
            continue
        g = match["gamma"]
        if g is not None and gamma is not None and float(g) != gamma:
            continue  # a γ candidate that was not chosen
        tau = suites_tau(run_dir / "eval" / "curve" / run.name / "drafter" / "results.json", suites)
        points.setdefault(match["loss"], []).append(
            {"train_rows": summary["train_rows"], "steps": summary["steps"], "run": f"curve/{run.name}",
             "held_out_tau": round(summary["val"][HELD_OUT], 4), "suites_tau": tau})
    return {loss: sorted(p, key=lambda q: q["train_rows"]) for loss, p in points.items()}


def _steps_points(run_dir: Path, suites: Sequence[str]) -> dict[str, list[dict]]:
    points: dict[str, list[dict]] = {}
    for run in sorted((run_dir / "long").glob("*")):
        held_out = logged_metric(run, HELD_OUT)
        drafters = {int(p.name.split("-")[1]): p for p in run.glob("snapshots/step-*") if p.is_dir()}
        summary = _read(run / "train_summary.json")
        if summary is not None:
            drafters[summary["steps"]] = run / "drafter"
            if summary.get("val", {}).get(HELD_OUT) is not None:
                held_out[summary["steps"]] = summary["val"][HELD_OUT]  # the final validation, as the run recorded it
        for step, drafter in sorted(drafters.items()):
            tau = suites_tau(run_dir / "eval" / drafter.relative_to(run_dir) / "results.json", suites)
            held = held_out.get(step, held_out.get(step - 1))  # Lightning logs the validation after N steps at N - 1
            points.setdefault(run.name, []).append(
                {"steps": step, "drafter": str(drafter.relative_to(run_dir)), "suites_tau": tau,
                 "held_out_tau": round(held, 4) if held is not None else None})
    return points


def collect(run_dir: str | Path, suites: Sequence[str]) -> dict:
    """Every point of the module doc found in a long job's ``run_dir`` (unevaluated ones have ``suites_tau``
    None)."""
    run_dir = Path(run_dir)
    gamma = (_read(run_dir / "gamma.json") or {}).get("chosen")
    return {"suites": list(suites), "temperature": 0.0, "held_out_metric": HELD_OUT,
            "answers": _answers_points(run_dir, suites, gamma), "steps": _steps_points(run_dir, suites)}


def _cell(point: dict) -> str:
    tau = point["suites_tau"]
    held = point["held_out_tau"]
    return f"{tau['mean']:.3f}" if tau else "—", f"{held:.3f}" if held is not None else "—"


def markdown(doc: dict) -> list[str]:
    lines = [(f"# What training data buys (T=0, the suites' mean τ: {', '.join(doc['suites'])}; held-out τ: "
             "teacher-forced on the held-out split of the training answers)"), ""]
    tables = (("answers", "τ against the training answers (equal steps)", {"answers": "train_rows", "steps": "steps"}),
              ("steps", "τ along the long runs (snapshots of one run each)", {"step": "steps"}))
    for key, title, columns in tables:  # columns: {header: point field}
        if doc[key]:
            head = ["loss", *columns, "suites τ", "held-out τ"]
            lines += [f"## {title}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
            lines += ["| " + " | ".join([loss, *(str(p[f]) for f in columns.values()), *_cell(p)]) + " |"
                      for loss, pts in doc[key].items() for p in pts]
            lines.append("")
    if doc.get("gamma"):
        lines += [(f"l2r_all's γ: {doc['gamma']['chosen']:g}, chosen on the held-out τ "
                  f"{doc['gamma']['held_out_tau']} at {doc['gamma']['steps']} steps."), ""]
    return lines + ["![data scale](data_scale.png)", ""]


def write(doc: dict, out: str | Path, gamma: dict | None = None, data_dir: str | Path | None = None) -> dict:
    """Write data_scale.json, .png and .md into ``out``; returns the JSON's content."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "gamma": gamma, "data_dir": str(data_dir) if data_dir is not None else None}
    (out / "data_scale.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot_data_scale(doc, out / "data_scale.png")
    lines = markdown(doc)
    (out / "data_scale.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return doc


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.reporting.data_scale",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a long job's run dir (python -m experiments.long)")
    parser.add_argument("--suites", nargs="+", default=["gsm_symbolic", "humaneval", "mtbench"])
    parser.add_argument("--out", default=None, help="default: <run dir>/data_scale")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    return write(collect(run_dir, args.suites), args.out or run_dir / "data_scale", _read(run_dir / "gamma.json"))


if __name__ == "__main__":
    main()
