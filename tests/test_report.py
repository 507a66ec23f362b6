"""experiments.report on two hand-made results.json files: discovery and naming, the gain table
(checked against hand-computed values), paired bootstrap intervals, CI-overlap marks, the PNGs,
training curves, --names / --baseline, errors, and offline W&B logging."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from experiments import report as report_cli
from experiments import reporting as rp
from experiments.pipeline.records import training_run_info
from experiments.reporting.plots import has_gain as plot_has_gain
from verify.metrics import bootstrap_ci

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

K = 3
SUITES = {"code": 20, "chat": 12}  # prompts per suite
TEMPS = {"t0": 0.0, "t1": 1.0}


def _entry(suite, key, new, steps, hist, acc):
    low, high = bootstrap_ci(new, steps, n_boot=500, seed=1)
    return {
        "suite": suite, "temperature": TEMPS[key], "K": K, "num_prompts": len(new),
        "tau": sum(new) / sum(steps), "tau_macro": float(np.mean(np.divide(new, steps))),
        "tau_ci_low": low, "tau_ci_high": high, "accept_hist": hist, "position_acceptance": acc,
        "new_tokens": int(sum(new)), "target_forwards": int(sum(steps)),
        "spec_tokens_per_s": 100.0 * sum(new) / sum(steps), "target_tokens_per_s": 100.0,
        "speedup": sum(new) / sum(steps),
        "prompts": [{"id": f"{suite}/{i}", "turns": 1, "new_tokens": int(n), "steps": int(s)}
                    for i, (n, s) in enumerate(zip(new, steps))],
    }


def _docs(seed=0):
    """uniform and chain results. On code, chain keeps exactly 1.5x uniform's tokens per prompt with the same
    steps, so every paired resample gives the ratio 1.5; on chat the two are independent draws."""
    rng = np.random.default_rng(seed)
    uniform, chain = {}, {}
    for suite, n in SUITES.items():
        uniform[suite], chain[suite] = {}, {}
        for key in TEMPS:
            steps = rng.integers(10, 30, n)
            new_u = 2 * (steps + rng.integers(0, steps))  # even, so that 1.5x is an integer
            new_u = np.minimum(new_u, steps * (K + 1))
            new_u -= new_u % 2
            new_c = 3 * new_u // 2 if suite == "code" else steps + rng.integers(0, 2 * steps)
            uniform[suite][key] = _entry(suite, key, new_u.tolist(), steps.tolist(), [5, 4, 3, 2], [0.6, 0.5, 0.4])
            chain[suite][key] = _entry(suite, key, new_c.tolist(), steps.tolist(), [2, 3, 4, 5], [0.8, 0.7, 0.6])
    return ({"results": uniform, "drafter": {"path": "/nowhere/drafter"}, "git_commit": None},
            {"results": chain, "drafter": {"path": "/nowhere/drafter"}, "git_commit": None})


@pytest.fixture
def multirun(tmp_path):
    """A multirun dir: 0_loss=uniform (named by .hydra/hydra.yaml) and 1_loss=chain (by train_summary.json,
    with a CSV training log)."""
    uniform, chain = _docs()
    root = tmp_path / "multirun"
    a, b = root / "0_loss=uniform", root / "1_loss=chain"
    (a / ".hydra").mkdir(parents=True)
    (a / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      loss: uniform\n      target: tiny\n")
    (a / "results.json").write_text(json.dumps(uniform))
    (b / "logs").mkdir(parents=True)
    (b / "train_summary.json").write_text(json.dumps({"name": "tiny-dflash-chain-s0", "overrides": ["loss=chain"]}))
    (b / "logs" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/tau_greedy\n0,0,,1.10\n0,10,5.0,\n0,100,,1.45\n0,200,,1.62\n")
    (b / "results.json").write_text(json.dumps(chain))
    return root, uniform, chain


def _gain(c, u):
    return c["tau"] / u["tau"] - 1.0


def test_report_end_to_end(multirun, tmp_path):
    root, uniform, chain = multirun
    out = tmp_path / "out"
    report = report_cli.main([str(root), "--out", str(out), "--num-bootstrap", "300"])
    for name in ("report.md", "report.json", "tau.png", "gain.png", "position_acceptance.png", "accept_hist.png",
                 "training_curves.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    saved = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in saved["configurations"]] == ["uniform", "chain"]
    assert saved["baseline"] == "uniform" and saved["suites"] == ["code", "chat"]
    md = (out / "report.md").read_text()
    for key in TEMPS:
        table = saved["table"][key]
        assert list(table) == ["code", "chat", "mean"]
        for suite, num_prompts in SUITES.items():
            u, c = uniform["results"][suite][key], chain["results"][suite][key]
            cell = table[suite]["chain"]
            assert cell["gain"] == pytest.approx(_gain(c, u), abs=1e-12)
            assert (table[suite]["uniform"]["tau"], cell["tau"]) == (u["tau"], c["tau"])
            assert f"{100 * _gain(c, u):+.1f}%" in md
            assert f"{u['tau']:.3f} [{u['tau_ci_low']:.3f}, {u['tau_ci_high']:.3f}]" in md
            overlap = not (c["tau_ci_low"] > u["tau_ci_high"] or c["tau_ci_high"] < u["tau_ci_low"])
            assert cell["ci_overlap"] is overlap and cell["paired_prompts"] == num_prompts
            assert "gain" not in table[suite]["uniform"]
        # code: chain = 1.5 x uniform prompt by prompt -> a paired interval of exactly +50%
        code = table["code"]["chain"]
        assert code["gain"] == pytest.approx(0.5)
        assert code["gain_ci_low"] == pytest.approx(0.5) and code["gain_ci_high"] == pytest.approx(0.5)
        assert "+50.0% [+50.0%, +50.0%]" in md
        chat = table["chat"]["chain"]
        assert chat["gain_ci_low"] < chat["gain"] < chat["gain_ci_high"]
        mean_u = np.mean([uniform["results"][s][key]["tau"] for s in SUITES])
        mean_c = np.mean([chain["results"][s][key]["tau"] for s in SUITES])
        assert table["mean"]["uniform"]["tau"] == pytest.approx(mean_u)
        assert table["mean"]["chain"]["gain"] == pytest.approx(mean_c / mean_u - 1)
        assert table["mean"]["uniform"]["ci_low"] < mean_u < table["mean"]["uniform"]["ci_high"]
    assert saved["training_curves"]["chain"] == {"steps": [0, 100, 200], "val/tau_greedy": [1.10, 1.45, 1.62]}
    assert "uniform" not in saved["training_curves"]
    assert "## Temperature 0" in md and "## Temperature 1" in md and "### Gain over uniform" in md
    assert "![tau](tau.png)" in md and "![training_curves](training_curves.png)" in md
    assert rp.OVERLAP_MARK in md or not any(saved["table"][k][s]["chain"]["ci_overlap"] for k in TEMPS for s in SUITES)
    assert report["table"] == saved["table"]


def test_overlap_mark_and_no_records(tmp_path):
    """Without per-prompt records the gain has no interval; overlapping τ intervals are marked."""
    uniform, chain = _docs()
    for doc in (uniform, chain):
        for entries in doc["results"].values():
            for e in entries.values():
                e.pop("prompts")
    chat_u = uniform["results"]["chat"]["t0"]
    chain["results"]["chat"]["t0"].update(tau=chat_u["tau"] * 1.01, tau_ci_low=chat_u["tau_ci_low"],
                                          tau_ci_high=chat_u["tau_ci_high"])
    (tmp_path / "u.json").write_text(json.dumps(uniform))
    (tmp_path / "c.json").write_text(json.dumps(chain))
    runs = rp.load_runs([tmp_path / "u.json", tmp_path / "c.json"], names=["uniform", "chain"])
    report = rp.write_report(runs, tmp_path / "out")
    cell = report["table"]["t0"]["chat"]["chain"]
    assert cell["gain_ci_low"] is None and cell["ci_overlap"] is True
    assert report["table"]["t0"]["mean"]["chain"]["ci_low"] is None
    assert f"{100 * cell['gain']:+.1f}%{rp.OVERLAP_MARK}" in (tmp_path / "out" / "report.md").read_text()
    assert not (tmp_path / "out" / "training_curves.png").exists()


def test_names_baseline_and_errors(multirun, tmp_path, capsys):
    root, _, _ = multirun
    report = report_cli.main([str(root), "--out", str(tmp_path / "a"), "--names", "A", "B", "--num-bootstrap", "50"])
    assert report["baseline"] is None and "no configuration named 'uniform'" in capsys.readouterr().out
    assert "### Gain" not in (tmp_path / "a" / "report.md").read_text()
    assert not (tmp_path / "a" / "gain.png").exists()
    report = report_cli.main([str(root), "--out", str(tmp_path / "b"), "--names", "A", "B", "--baseline", "B",
                      "--num-bootstrap", "50"])
    assert report["table"]["t0"]["code"]["A"]["gain"] == pytest.approx(1 / 1.5 - 1)
    with pytest.raises(ValueError, match="--names gives 1 names for 2 results files"):
        report_cli.main([str(root), "--out", str(tmp_path / "c"), "--names", "A"])
    with pytest.raises(ValueError, match="baseline configuration 'nope'"):
        report_cli.main([str(root), "--out", str(tmp_path / "c"), "--baseline", "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no results.json found"):
        report_cli.main([str(tmp_path / "empty"), "--out", str(tmp_path / "c")])
    (tmp_path / "bad.json").write_text(json.dumps({"tau": 1}))
    with pytest.raises(TypeError, match="not an experiments.evaluate results.json"):
        report_cli.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "c")])


def test_names_from_training_run_and_duplicates(tmp_path):
    """Evaluation run dirs elsewhere: the name comes from the drafter's training run; repeats get the seed."""
    uniform, _ = _docs()
    for seed in (0, 1):
        train = tmp_path / f"train/s{seed}"
        (train / ".hydra").mkdir(parents=True)
        (train / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      loss: decay\n")
        (train / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nname: x\n")
        (train / "drafter").mkdir()
        doc = dict(uniform, drafter={"path": str(train / "drafter")})
        (tmp_path / f"eval{seed}").mkdir()
        (tmp_path / f"eval{seed}" / "results.json").write_text(json.dumps(doc))
    runs = rp.load_runs([tmp_path / "eval0", tmp_path / "eval1"])
    assert [r.name for r in runs] == ["decay-s0", "decay-s1"]
    assert training_run_info(tmp_path / "train/s1")["seed"] == 1


def test_named_drafters_trained_with_several_seeds_are_seeds_of_one_configuration(tmp_path):
    """``drafter.name=chain_w10`` on each seed's evaluation: the name and the training run's seed label the runs
    (``chain_w10-s1``), one configuration over seeds; a named baseline (no training run) keeps its name alone."""
    uniform, _ = _docs()
    for seed in (0, 1):
        doc = dict(uniform, drafter={"path": "/nowhere/drafter", "name": "chain_w10",
                                     "training_run": {"loss": "chain", "seed": seed}})
        (tmp_path / f"eval{seed}").mkdir()
        (tmp_path / f"eval{seed}" / "results.json").write_text(json.dumps(doc))
    (tmp_path / "lookup").mkdir()
    (tmp_path / "lookup" / "results.json").write_text(json.dumps(dict(uniform, drafter={"name": "prompt_lookup"})))
    runs = rp.load_runs([tmp_path / "eval0", tmp_path / "eval1", tmp_path / "lookup"])
    assert [(r.name, r.config, r.seed) for r in runs] == [("chain_w10-s0", "chain_w10", 0),
                                                         ("chain_w10-s1", "chain_w10", 1), ("prompt_lookup", "prompt_lookup", None)]


def test_runs_sharing_loss_and_seed_keep_their_own_rows(tmp_path):
    """Three drafter designs trained with loss=decay, seed 0 into one sweep dir (the bug: two were labelled
    alike and merged, one vanished): each is named by its directory and keeps its own numbers; names given
    twice are numbered 1, 2, 3."""
    taus = {"decay-s0": 1.5, "layerwise-decay-s0": 2.0, "hinted-decay-s0": 2.5}
    for folder, tau in taus.items():
        d = tmp_path / "sweep" / folder
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      loss: decay\n")
        (d / ".hydra" / "config.yaml").write_text("seed: 0\nname: x\n")
        doc, _ = _docs()
        doc["results"]["code"]["t0"]["tau"] = tau
        (d / "results.json").write_text(json.dumps(doc))
    runs = rp.load_runs([tmp_path / "sweep"])
    named = {r.name: r.results["code"]["t0"]["tau"] for r in runs}
    assert named == {f"decay ({folder})": tau for folder, tau in taus.items()}
    assert all(r.seed is None and r.config == r.name for r in runs)  # nothing to aggregate over seeds
    given = rp.load_runs([tmp_path / "sweep"], names=["a", "a", "a"])
    assert [r.name for r in given] == ["a #1", "a #2", "a #3"]


def test_wandb_offline(multirun, tmp_path):
    root, _, _ = multirun
    report = report_cli.main([str(root), "--out", str(tmp_path / "w"), "--num-bootstrap", "50", "--wandb"])
    assert list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert report["wandb_dir"].startswith(str(tmp_path / "w"))


def test_seeds_aggregated(tmp_path):
    """Two seeds of uniform and chain (named by .hydra/): per-seed gains pair each seed with uniform's run of
    the same seed, the across-seeds tables give mean ± SD, and the plots show one bar per configuration."""
    docs = {seed: _docs(seed) for seed in (0, 1)}
    for seed, (uniform, chain) in docs.items():
        for loss, doc in (("uniform", uniform), ("chain", chain)):
            d = tmp_path / "sweep" / f"{loss}-s{seed}"
            (d / ".hydra").mkdir(parents=True)
            (d / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      loss: {loss}\n")
            (d / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nname: x\n")
            (d / "logs").mkdir()
            (d / "logs" / "metrics.csv").write_text(
                f"step,val/tau_greedy\n0,1.0\n100,{1.2 + seed / 10 + (loss == 'chain') / 10}\n")
            (d / "results.json").write_text(json.dumps(doc))
    untrained = _docs(5)[0] | {"drafter": {"name": "prompt_lookup", "kind": "prompt_lookup"}}  # one evaluation
    (tmp_path / "sweep" / "baselines" / "prompt_lookup").mkdir(parents=True)
    (tmp_path / "sweep" / "baselines" / "prompt_lookup" / "results.json").write_text(json.dumps(untrained))
    out = tmp_path / "out"
    report = report_cli.main([str(tmp_path / "sweep"), "--out", str(out), "--num-bootstrap", "100",
                              "--order", "chain", "prompt_lookup"])
    names = [c["name"] for c in report["configurations"]]
    assert names == ["uniform-s0", "uniform-s1", "chain-s0", "chain-s1", "prompt_lookup"]  # seeds in order
    assert {c["name"]: (c["config"], c["seed"]) for c in report["configurations"]}["chain-s1"] == ("chain", 1)
    seeds = report["across_seeds"]
    for key in TEMPS:
        for suite in SUITES:
            u = [docs[s][0]["results"][suite][key]["tau"] for s in (0, 1)]
            c = [docs[s][1]["results"][suite][key]["tau"] for s in (0, 1)]
            # every run's gain is against uniform of its own seed
            for s in (0, 1):
                cell = report["table"][key][suite][f"chain-s{s}"]
                assert cell["baseline_run"] == f"uniform-s{s}"
                assert cell["gain"] == pytest.approx(c[s] / u[s] - 1)
            agg = seeds[key][suite]["chain"]
            assert agg["seeds"] == [0, 1] and agg["taus"] == c
            assert agg["tau_mean"] == pytest.approx(np.mean(c)) and agg["tau_sd"] == pytest.approx(np.std(c, ddof=1))
            assert agg["gain_mean"] == pytest.approx(np.mean([c[s] / u[s] - 1 for s in (0, 1)]))
            assert agg["gains_positive"] == sum(c[s] > u[s] for s in (0, 1))
            assert "gains" not in seeds[key][suite]["uniform"]
        assert seeds[key]["code"]["chain"]["gains"] == pytest.approx([0.5, 0.5])
    md = (out / "report.md").read_text()
    assert "# Across seeds" in md and "# Per run" in md
    lookup = untrained["results"]["code"]["t0"]["tau"]
    assert seeds["t0"]["code"]["prompt_lookup"]["taus"] == [lookup] and "gains" not in seeds["t0"]["code"]["prompt_lookup"]
    across = md[md.index("# Across seeds"): md.index("# Per run")]
    assert f"| prompt_lookup | {lookup:.3f} (1 run) |" in across and "| prompt_lookup | — |" not in across  # no gain
    # the seed-mean gain's interval resamples prompts for each seed against uniform of the same seed: on code
    # every resample gives 1.5x, on chat an interval around the mean of per-seed gains
    assert "+50.0% [+50.0, +50.0] (+50.0, +50.0; 2/2 > 0)" in md
    for key in TEMPS:
        for suite in ("chat", rp.MEAN):
            agg = seeds[key][suite]["chain"]
            assert agg["gain_ci_low"] < agg["gain_mean"] < agg["gain_ci_high"]
        assert "gain_ci_low" not in seeds[key]["chat"]["uniform"]
    agg = seeds["t0"]["chat"]["chain"]
    assert f"{agg['tau_mean']:.3f} ± {agg['tau_sd']:.3f}" in md
    for name in ("tau.png", "gain.png", "position_acceptance.png", "accept_hist.png", "training_curves.png"):
        assert (out / name).stat().st_size > 0
    view = rp.seed_view(report)
    assert [c["name"] for c in view["configurations"]] == ["uniform", "chain", "prompt_lookup"]
    assert plot_has_gain(view, "chain", True) and not plot_has_gain(view, "prompt_lookup", True)  # no empty bars
    cell = view["table"]["t1"]["code"]["chain"]
    assert (cell["ci_low"], cell["ci_high"]) == (min(cell["taus"]), max(cell["taus"]))
    assert view["curves"]["t0"]["code"]["chain"]["accept_hist"] == [4, 6, 8, 10]  # summed over the 2 seeds
    curves = {n: (s, v) for n, c in report["training_curves"].items() for s, v in [(c["steps"], c["val/tau_greedy"])]}
    mean = rp.mean_curves(curves, {n: n.rsplit("-s", 1)[0] for n in curves})
    assert mean["chain"] == ([0, 100], [1.0, pytest.approx(1.35)])


def test_single_seed_has_no_seed_section(multirun, tmp_path):
    report = report_cli.main([str(multirun[0]), "--out", str(tmp_path / "o"), "--num-bootstrap", "20"])
    assert report["across_seeds"] is None
    assert "Across seeds" not in (tmp_path / "o" / "report.md").read_text()


def test_order_runs():
    runs = [rp.Run(n, Path(n), {"results": {}}, config=c, seed=sd)
            for n, c, sd in [("b-s1", "b", 1), ("a", "a", None), ("u-s1", "u", 1), ("b-s0", "b", 0), ("u-s0", "u", 0),
                             ("c", "c", None)]]
    assert [r.name for r in rp.order_runs(runs, ["c", "b"], "u")] == ["u-s0", "u-s1", "c", "b-s0", "b-s1", "a"]
    assert [r.name for r in rp.order_runs(runs)] == ["b-s0", "b-s1", "a", "u-s0", "u-s1", "c"]


def test_multirun_report_checks_its_baselines_at_the_start():
    from experiments.reporting.callback import MultirunReport

    with pytest.raises(ValueError, match=r"drafter 'prompt_lokup': no conf/eval/drafter/prompt_lokup.yaml "
                                         r"\(choose one of \['ar_assistant', 'block', 'corpus_lookup', 'hybrid', 'prompt_lookup', 'tree'\]\)"):
        MultirunReport(baselines=["prompt_lookup", "prompt_lokup"])
    assert MultirunReport(baselines=["prompt_lookup"]).baselines == ["prompt_lookup"]


def test_committed_paths_carry_no_machine_folder(tmp_path, monkeypatch):
    """A report's training-run record names the target, its data and its run relative to the repository,
    the blockdraft cache ($BLOCKDRAFT_CACHE/...) and the runs' folder, never as this machine's absolute paths."""
    from experiments.pipeline.paths import REPO, cache_path, portable_path
    from experiments.reporting.write import make_paths_portable

    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    target = REPO / "experiments" / "assets" / "tiny_target"
    data = tmp_path / "cache" / "regen" / "tiny" / "abc"
    runs = tmp_path / "runs"
    data.mkdir(parents=True)
    (data / "regen.json").write_text("{}")  # a regenerated data folder
    report = {"configurations": [
        {"results_path": str(runs / "a" / "results.json"), "drafter_path": None,
         "training_run": {"target_path": str(target), "data_dir": str(data), "run_dir": str(runs / "a")}},
        {"results_path": str(runs / "b" / "results.json"), "drafter_path": str(runs / "b" / "drafter"),
         "training_run": None},
        {"results_path": str(runs / "c" / "results.json"), "drafter_path": str(data), "training_run": None}]}
    assert make_paths_portable(report) == runs  # corpus_lookup's data folder (its drafter_path) is no run
    first, second, third = report["configurations"]
    assert third["drafter_path"] == "$BLOCKDRAFT_CACHE/regen/tiny/abc"
    assert first["training_run"] == {"target_path": "experiments/assets/tiny_target",
                                     "data_dir": "$BLOCKDRAFT_CACHE/regen/tiny/abc", "run_dir": "a"}
    assert (first["results_path"], second["drafter_path"]) == ("a/results.json", "b/drafter")
    assert portable_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")  # outside every folder: as given
    assert cache_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    from experiments.pipeline.paths import runs_path

    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(runs))
    assert runs_path(runs / "multirun" / "x" / "drafter") == "$BLOCKDRAFT_RUNS/multirun/x/drafter"
    assert runs_path(target) == "experiments/assets/tiny_target"  # inside the repository: relative to it
    assert runs_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")


def test_draft_sources_reported_per_drafter_and_label(tmp_path):
    """A run whose results carry by_draft_source (a hinted drafter's labels) gets them in report.json and a
    table in report.md; a run without them gets no row there."""
    uniform, chain = _docs()
    sources = {"drafter": {"row_steps": 30, "share": 0.25, "mean_accepted": 0.4, "zero_accepted": 0.7},
               "hint:store": {"row_steps": 90, "share": 0.75, "mean_accepted": 2.5, "zero_accepted": 0.3}}
    chain["results"]["code"]["t0"]["by_draft_source"] = sources
    (tmp_path / "u.json").write_text(json.dumps(uniform))
    (tmp_path / "c.json").write_text(json.dumps(chain))
    runs = rp.load_runs([tmp_path / "u.json", tmp_path / "c.json"], names=["uniform", "chain"])
    report = rp.write_report(runs, tmp_path / "out")
    assert report["draft_sources"] == {"t0": {"code": {"chain": sources}}}
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| chain | `hint:store` | 75% · 2.50 |" in text and "| chain | `drafter` | 25% · 0.40 |" in text
    assert "| uniform | `" not in text
    assert text.count("Where the accepted drafts come from") == 1  # t0 only


def test_paper_section_puts_the_papers_figures_beside_ours(multirun, tmp_path):
    from experiments.reporting.paper import PAPER_TAU

    root = multirun[0]
    report = report_cli.main([str(root), "--out", str(tmp_path / "o"), "--num-bootstrap", "50", "--paper"])
    md = (tmp_path / "o" / "report.md").read_text()
    assert "## Beside the paper (T=0, mean over suites)" in md and "## Beside the paper (T=1" in md
    t1 = md[md.index("## Beside the paper (T=1"):]
    assert "repeated unchanged" in t1 and "repeated unchanged" not in md[:md.index("## Beside the paper (T=1")]
    cell = report["table"]["t0"]["mean"]["chain"]
    paper_gain = 100 * (PAPER_TAU["chain"] / PAPER_TAU["uniform"] - 1)
    assert (f"| chain | {PAPER_TAU['chain']} | {paper_gain:+.1f}% | {cell['tau']:.3f} | {100 * cell['gain']:+.1f}% ["
            in md)
    assert f"| l2r_all | {PAPER_TAU['l2r_all']} | +43.9% | — | — |" in md  # in the paper, not run here
    from experiments.reporting.paper import paper_lines

    assert paper_lines({"configurations": [], "table": {"t1": {}}}, "t1") == []  # nothing of the paper's: no table
    assert report["paper_tau"] == PAPER_TAU


def test_budget_curve_averages_seeds_and_pairs_gains_by_budget(tmp_path):
    from experiments.reporting import budget

    def run(loss, seed, steps, scale):
        doc = _docs(seed)[0]
        for entries in doc["results"].values():
            for e in entries.values():
                e["tau"] *= scale
        d = tmp_path / "runs" / f"{loss}-s{seed}-x{steps}"
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      loss: {loss}\n")
        (d / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nname: x\n")
        (d / "train_summary.json").write_text(json.dumps({"steps": steps}))
        (d / "results.json").write_text(json.dumps(doc))
        return np.mean([doc["results"][s]["t0"]["tau"] for s in SUITES])

    u1, u2 = run("uniform", 0, 100, 1.0), run("uniform", 0, 200, 1.1)
    c1 = [run("chain", s, 100, 1.2) for s in (0, 1)]
    out = tmp_path / "out"
    doc = budget.main([str(tmp_path / "runs"), "--out", str(out)])
    assert doc["points"]["uniform"] == {"100": [pytest.approx(u1)], "200": [pytest.approx(u2)]}
    assert doc["points"]["chain"]["100"] == pytest.approx(c1)
    md = (out / "budget.md").read_text()
    assert f"| chain | {np.mean(c1):.3f} ({100 * (np.mean(c1) / u1 - 1):+.1f}%), 2 seeds | — |" in md
    assert f"| uniform | {u1:.3f} | {u2:.3f} |" in md
    assert (out / "budget.png").stat().st_size > 0
    seed0 = budget.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out0"), "--seeds", "0"])
    assert seed0["points"]["chain"] == {"100": [pytest.approx(c1[0])]} and seed0["seeds"] == [0]
    assert "seed 0)" in (tmp_path / "out0" / "budget.md").read_text()
    with pytest.raises(SystemExit, match="no evaluated trained drafter"):
        budget.main([str(_only_untrained(tmp_path)), "--out", str(out)])


def _only_untrained(tmp_path):
    d = tmp_path / "untrained"
    d.mkdir()
    (d / "results.json").write_text(json.dumps(_docs(3)[0] | {"drafter": {"name": "prompt_lookup"}}))
    return d


def test_a_configuration_evaluated_at_t0_only_leaves_the_other_temperatures_mean(tmp_path):
    """A baseline evaluated at T=0 only (the main job's prompt_lookup) is in the T=0 table and absent at T=1,
    where the other configurations' mean over suites and its paired gain are still computed."""
    uniform, chain = _docs()
    lookup = json.loads(json.dumps(chain))
    for entries in lookup["results"].values():
        entries.pop("t1")
    for name, doc in (("uniform", uniform), ("chain", chain), ("lookup", lookup)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    runs = rp.load_runs([tmp_path / f"{n}.json" for n in ("uniform", "chain", "lookup")],
                        names=["uniform", "chain", "lookup"])
    report = rp.write_report(runs, tmp_path / "out")
    assert set(report["table"]["t0"]["mean"]) == {"uniform", "chain", "lookup"}
    assert set(report["table"]["t1"]["mean"]) == {"uniform", "chain"}
    mean_t1 = report["table"]["t1"]["mean"]["chain"]
    expected = np.mean([chain["results"][s]["t1"]["tau"] for s in SUITES])
    assert mean_t1["tau"] == pytest.approx(expected)
    assert mean_t1["gain_ci_low"] is not None and mean_t1["gain_ci_low"] <= mean_t1["gain"] <= mean_t1["gain_ci_high"]
    md = (tmp_path / "out" / "report.md").read_text()
    start = md.index("## Temperature 1")
    t1 = md[start:md.index("\n## ", start)]  # to the next section (the plots)
    assert "| lookup |" in md[:start] and "| lookup |" not in t1
    assert "### Speed (speculative / target-only" in t1


def test_speed_tables_say_what_was_timed():
    """A temperature whose evaluations timed the target alone shows speedups; one that did not shows the
    speculative tokens/s under its own title; one with no speeds at all shows no speed table."""
    from experiments.reporting.tables import _speed_section

    timed = {"code": {"a": {"spec_tokens_per_s": 20.0, "target_tokens_per_s": 10.0, "speedup": 2.0}}}
    untimed = {"code": {"a": {"spec_tokens_per_s": 20.0, "target_tokens_per_s": None, "speedup": None}}}
    none = {"code": {"a": {"spec_tokens_per_s": None, "speedup": None}}}
    assert "= speedup" in _speed_section(timed, ["code"], ["a"])[1]
    assert "2.00×" in _speed_section(timed, ["code"], ["a"])[-1]
    lines = _speed_section(untimed, ["code"], ["a"])
    assert "target alone not timed" in lines[1] and "| a | 20 tok/s |" in lines
    assert _speed_section(none, ["code"], ["a"]) == []


def test_one_command_rewrites_every_ablation_report_from_the_runs_that_exist(tmp_path):
    """experiments.ablation_report: the ablation (seeds, paper table), the seed-0 budget curve and a loss sweep beside
    the ablation's own runs of that loss, from a runs folder laid out as the queue leaves it; parts without runs
    are skipped."""
    from experiments import ablation_report

    runs = tmp_path / "runs" / "multirun"

    def run(folder, loss, seed, steps, doc, name=None, gamma=2.0):
        d = runs / folder
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      loss: {loss}\n")
        (d / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nname: x\nloss:\n  gamma: {gamma}\n")
        (d / "train_summary.json").write_text(json.dumps({"steps": steps}))
        if name:
            doc = doc | {"drafter": {"name": name, "training_run": {"loss": loss, "seed": seed}}}
        (d / "results.json").write_text(json.dumps(doc))

    for seed in (0, 1):
        uniform, decay = _docs(seed)
        run(f"l2r_ablation/uniform-s{seed}", "uniform", seed, 700, uniform)
        run(f"l2r_ablation/decay-s{seed}", "decay", seed, 700, decay)
        run(f"l2r_sweep_gamma/gamma7-s{seed}", "decay", seed, 700, _docs(seed + 10)[1], name="gamma7", gamma=7)
    run("l2r_budget/uniform-x2-s0", "uniform", 0, 1400, _docs(7)[0])
    (runs / "l2r_sweep_gamma" / "gamma0.5-s0" / "checkpoints").mkdir(parents=True)  # still training: left out
    under_way = _docs(2)[1] | {"suites": {s: "hash" for s in SUITES}}
    under_way["results"].popitem()  # its last suite not evaluated yet
    run("l2r_ablation/decay-s2", "decay", 2, 700, under_way)
    at_t1 = _docs(1)[1] | {"suites": {s: "hash" for s in SUITES}}
    at_t1["results"]["chat"].pop("t1")  # its T=1 pass under way: its T=0 is reported, its T=1 not
    (runs / "l2r_ablation/decay-s1/results.json").write_text(json.dumps(at_t1))
    out = tmp_path / "results"
    lookup = tmp_path / "main" / "eval" / "prompt_lookup"
    lookup.mkdir(parents=True)
    (lookup / "results.json").write_text(json.dumps(_docs(5)[0] | {"drafter": {"name": "prompt_lookup"}}))
    written = ablation_report.main(["--runs", str(tmp_path / "runs"), "--out", str(out), "--baselines", str(lookup)])
    assert written == ["ablation_smollm2", "budget_smollm2", "sweep_gamma_smollm2"]
    assert ablation_report.complete(runs / "l2r_ablation/decay-s1/results.json")
    assert not ablation_report.complete(runs / "l2r_ablation/decay-s2/results.json")  # left out below
    ablation = json.loads((out / "ablation_smollm2" / "report.json").read_text())
    assert [c["name"] for c in ablation["configurations"]] == ["uniform-s0", "uniform-s1", "decay-s0", "decay-s1",
                                                               "prompt_lookup"]
    assert "gain_ci_low" in ablation["across_seeds"]["t0"][rp.MEAN]["decay"]
    assert ablation["across_seeds"]["t0"][rp.MEAN]["decay"]["seeds"] == [0, 1]
    assert ablation["across_seeds"]["t1"][rp.MEAN]["decay"]["seeds"] == [0]
    assert "Beside the paper" in (out / "ablation_smollm2" / "report.md").read_text()
    curve = json.loads((out / "budget_smollm2" / "budget.json").read_text())
    assert curve["seeds"] == [0] and set(curve["points"]["uniform"]) == {"700", "1400"}
    assert set(curve["points"]) == {"uniform"}  # the losses trained at another budget too
    sweep = json.loads((out / "sweep_gamma_smollm2" / "report.json").read_text())
    assert {(c["config"], c["seed"]) for c in sweep["configurations"]} == \
        {(c, s) for c in ("uniform", "decay", "gamma7") for s in (0, 1)}
    assert sweep["table"]["t0"]["code"]["gamma7-s1"]["baseline_run"] == "uniform-s1"
    curve = json.loads((out / "sweep_gamma_smollm2" / "curve.json").read_text())

    def mean_tau(doc):
        return np.mean([doc["results"][s]["t0"]["tau"] for s in SUITES])

    assert curve["key"] == "loss.gamma" and list(curve["points"]) == ["2", "7"]  # the ablation's decay is gamma 2
    assert curve["points"]["2"] == pytest.approx([mean_tau(_docs(s)[1]) for s in (0, 1)])
    assert curve["points"]["7"] == pytest.approx([mean_tau(_docs(s + 10)[1]) for s in (0, 1)])
    assert curve["uniform"] == pytest.approx([mean_tau(_docs(s)[0]) for s in (0, 1)])
    gain = 100 * (np.mean(curve["points"]["7"]) / np.mean(curve["uniform"]) - 1)
    assert f"| 7 | {np.mean(curve['points']['7']):.3f} |" in (out / "sweep_gamma_smollm2" / "curve.md").read_text()
    assert f"| {gain:+.1f}% |" in (out / "sweep_gamma_smollm2" / "curve.md").read_text()
    assert (out / "sweep_gamma_smollm2" / "curve.png").stat().st_size > 0
    assert not (out / "sweep_focal_smollm2").exists()
    queued = runs.parent / "baselines" / "prompt_lookup"  # where the queue evaluates the baselines: the default
    queued.mkdir(parents=True)
    (queued / "results.json").write_text((lookup / "results.json").read_text())
    ablation_report.main(["--runs", str(tmp_path / "runs"), "--out", str(out)])
    names = [c["name"] for c in json.loads((out / "ablation_smollm2" / "report.json").read_text())["configurations"]]
    assert names[-1] == "prompt_lookup"
    with pytest.raises(SystemExit, match="no evaluated run"):
        ablation_report.main(["--runs", str(tmp_path / "empty"), "--out", str(out)])


def _seeded_run(config, seed, rate, suites=("code", "chat"), prompts=16):
    """A run whose prompts keep ``rate`` new tokens a step on average, drawn per prompt (seeded by config and seed)."""
    rng = np.random.default_rng([seed, len(config), int(1000 * rate)])
    results = {}
    for suite in suites:
        steps = rng.integers(10, 30, prompts)
        new = np.maximum(steps, np.round(steps * rate * rng.uniform(0.8, 1.2, prompts))).astype(int)
        results[suite] = {"t0": {"tau": float(new.sum() / steps.sum()), "num_prompts": prompts, "prompts": [
            {"id": f"{suite}/{i}", "new_tokens": int(n), "steps": int(st)} for i, (n, st) in enumerate(zip(new, steps))]}}
    return rp.Run(f"{config}-s{seed}", Path(f"/nowhere/{config}-s{seed}/results.json"), {"results": results},
                  config=config, seed=seed)


def test_composition_puts_each_composites_gain_beside_the_sum_of_its_terms_with_an_interval():
    """build_report(composites=...): per temperature each composite's gain (the mean of its seeds' paired gains)
    beside the sum of its terms' gains, their ratio and its interval from one bootstrap for every run; a composite
    whose terms were not all run has none; the markdown puts the paper's ratio beside."""
    from experiments.reporting.paper import COMPOSITES, PAPER_TAU, composition_lines, composition_of

    rates = {"uniform": 1.4, "decay": 1.5, "focal": 1.47, "chain": 1.49, "l2r_all": 1.52}
    runs = [_seeded_run(c, s, r) for c, r in rates.items() for s in (0, 1)]
    report = rp.build_report(runs, num_bootstrap=400, composites=COMPOSITES)
    cell = report["composition"]["t0"]["l2r_all"]
    gain = {c: np.mean(report["across_seeds"]["t0"][rp.MEAN][c]["gains"]) for c in rates if c != "uniform"}
    assert cell["gain"] == pytest.approx(gain["l2r_all"]) and cell["seeds"] == [0, 1]
    assert cell["sum"] == pytest.approx(gain["decay"] + gain["focal"] + gain["chain"])
    assert cell["ratio"] == pytest.approx(cell["gain"] / cell["sum"])
    assert cell["ratio_ci_low"] < cell["ratio"] < cell["ratio_ci_high"]
    assert "decay_focal" not in report["composition"]["t0"]  # its run is missing
    paper = [PAPER_TAU[c] / PAPER_TAU["uniform"] - 1 for c in ("l2r_all", "decay", "focal", "chain")]
    row = (f"| l2r_all = decay + focal + chain | 2 | {100 * cell['gain']:+.1f}% | {100 * cell['sum']:+.1f}% | "
           f"{cell['ratio']:.2f} [{cell['ratio_ci_low']:.2f}, {cell['ratio_ci_high']:.2f}] | {100 * paper[0]:+.1f}% | "
           f"{100 * sum(paper[1:]):+.1f}% | {paper[0] / sum(paper[1:]):.2f} |")
    assert row in composition_lines(report, "t0")
    assert "composition" not in rp.build_report(runs, num_bootstrap=50)
    # a term trained at seed 0 only: every gain of the ratio is taken over seed 0 alone, here and from report.json
    partial = rp.build_report([r for r in runs if (r.config, r.seed) != ("chain", 1)], num_bootstrap=200,
                              composites=COMPOSITES)
    cell = partial["composition"]["t0"]["l2r_all"]
    seed0 = {r.config: partial["table"]["t0"][rp.MEAN][r.name].get("gain") for r in runs if r.seed == 0}
    assert cell["seeds"] == [0] and cell["gain"] == pytest.approx(seed0["l2r_all"])
    assert cell["sum"] == pytest.approx(seed0["decay"] + seed0["focal"] + seed0["chain"])
    fallback = composition_of({**partial, "composition": None}, "l2r_all", ("decay", "focal", "chain"))
    assert fallback["ratio"] == pytest.approx(cell["ratio"]) and fallback["ratio_ci_low"] is None
    assert composition_lines({"configurations": [], "table": {}}, "t0") == []


def test_composition_resamples_every_run_with_the_same_prompts():
    """A composite whose runs are copies of its one term's has the ratio 1 in every resample (the prompts drawn
    once for all runs), so its interval is [1, 1]; terms that lose make the ratio undefined, shown as —, and terms
    whose sum's interval holds 0 leave the ratio without an interval."""
    from experiments.reporting.paper import composition_lines

    runs = [_seeded_run(c, s, r) for c, r in {"uniform": 1.4, "decay": 1.55}.items() for s in (0, 1)]
    twins = [rp.Run(r.name.replace("decay", "twin"), r.path, r.doc, config="twin", seed=r.seed)
             for r in runs if r.config == "decay"]
    cell = rp.build_report(runs + twins, num_bootstrap=300, composites={"twin": ("decay",)})["composition"]["t0"]["twin"]
    assert cell["ratio"] == pytest.approx(1.0)
    assert (cell["ratio_ci_low"], cell["ratio_ci_high"]) == (pytest.approx(1.0), pytest.approx(1.0))
    worse = [_seeded_run(c, s, r) for c, r in {"uniform": 1.5, "decay": 1.3, "chain": 1.6}.items() for s in (0,)]
    report = rp.build_report(worse, num_bootstrap=50, composites={"chain": ("decay",)})
    assert report["composition"]["t0"]["chain"]["ratio"] is None
    assert any(line.startswith("| chain = decay | 1 |") and "| — |" in line for line in composition_lines(report, "t0"))
    near_zero = [_seeded_run(c, 0, r) for c, r in {"uniform": 1.4, "decay": 1.42, "chain": 1.6}.items()]
    cell = rp.build_report(near_zero, num_bootstrap=200, composites={"chain": ("decay",)})["composition"]["t0"]["chain"]
    assert cell["sum_ci_low"] < 0 < cell["sum"] < cell["sum_ci_high"] and cell["ratio"] > 0  # decay's gain: noise
    assert cell["ratio_ci_low"] is None and cell["ratio_ci_high"] is None  # a ratio to about 0: no interval given
    assert (f"{cell['ratio']:.2f} (the sum's interval [{100 * cell['sum_ci_low']:+.1f}%, "
            f"{100 * cell['sum_ci_high']:+.1f}%] holds 0)") in "".join(
        composition_lines({"composition": {"t0": {"chain": cell}}}, "t0"))


def _long_evaluation(folder, run, sub, name, loss, seed, doc, drafter=None):
    """``<folder>/<run>/<sub>/results.json``: ``doc`` as the queue's evaluation of the drafter ``name``."""
    d = folder / run / sub
    d.mkdir(parents=True)
    drafter = drafter or {"name": name, "training_run": {"loss": loss, "seed": seed}}
    (d / "results.json").write_text(json.dumps(doc | {"drafter": drafter}))


def _long_trained(folder, run, seed, taus=None):
    """``<folder>/<run>`` as a finished training of ``seed`` (with held-out τ ``taus`` logged every 1000 steps)."""
    (folder / run / ".hydra").mkdir(parents=True, exist_ok=True)
    (folder / run / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nname: {run}\n")
    (folder / run / "train_summary.json").write_text(json.dumps({"name": run, "steps": 10}))
    if taus:
        (folder / run / "logs").mkdir()
        (folder / run / "logs" / "metrics.csv").write_text(
            "step,val/tau_greedy\n" + "".join(f"{1000 * (i + 1)},{t}\n" for i, t in enumerate(taus)))


def test_the_long_reports_say_whether_the_terms_compose_as_a_chain_a_tree_and_beside_the_short_budget(tmp_path):
    """ablation_report --long with every single term and l2r_all: each report's composition (the tree's over its
    _tree rows, with the paper's ratio beside), and beside.md's ratio per budget: with its interval where the report
    kept the prompts, the seed-mean ratio alone from the 700-step report.json."""
    from experiments import ablation_report

    folder = tmp_path / "runs" / "multirun" / "ablation_long"
    rates = {"uniform": 1.4, "decay": 1.5, "focal": 1.47, "chain": 1.49, "l2r_all": 1.52}
    for loss, rate in rates.items():
        doc = {"results": _seeded_run(loss, 0, rate).results}
        _long_evaluation(folder, f"{loss}-s0", "eval", loss, loss, 0, doc)
        _long_evaluation(folder, f"{loss}-s0", "eval_tree", f"{loss}_tree", loss, 0, doc)
        _long_trained(folder, f"{loss}-s0", 0)
    short = rp.build_report([_seeded_run(c, s, r) for c, r in rates.items() for s in (0, 1)], num_bootstrap=50)
    (tmp_path / "short.json").write_text(json.dumps(short))
    out = tmp_path / "results"
    ablation_report.main(["--runs", str(tmp_path / "runs"), "--out", str(out), "--long", "--short",
                          str(tmp_path / "short.json")])
    chain = json.loads((out / "ablation_long" / "report.json").read_text())["composition"]["t0"]["l2r_all"]
    tree = json.loads((out / "ablation_long_tree" / "report.json").read_text())["composition"]["t0"]["l2r_all_tree"]
    assert chain["ratio"] == pytest.approx(tree["ratio"]) and tree["terms"].keys() == {"decay_tree", "focal_tree", "chain_tree"}
    paper = "+43.9% | +46.7% | 0.94 |"
    assert "| l2r_all_tree = decay_tree + focal_tree + chain_tree | 1 |" in (out / "ablation_long_tree" / "report.md").read_text()
    assert paper in (out / "ablation_long_tree" / "report.md").read_text()
    short_ratio = np.mean(short["across_seeds"]["t0"][rp.MEAN]["l2r_all"]["gains"]) / sum(
        np.mean(short["across_seeds"]["t0"][rp.MEAN][c]["gains"]) for c in ("decay", "focal", "chain"))
    row = next(line for line in (out / "ablation_long" / "beside.md").read_text().splitlines()
               if line.startswith("| l2r_all / (decay + focal + chain) |"))
    assert row.split(" | ")[1:3] == [f"{short_ratio:.2f} (2 seeds)",
                                     f"{chain['ratio']:.2f} [{chain['ratio_ci_low']:.2f}, {chain['ratio_ci_high']:.2f}]"]
    assert row.endswith("| 0.94 |")


def test_the_long_ablation_reports_chain_tree_snapshots_and_precision_apart(tmp_path):
    """experiments.ablation_report --long: the queue's ablation_long runs, each evaluated as a chain (eval), a tree
    (eval_tree) and at its 5K snapshot (eval_5k: the record names no training run, found from the snapshot's folder),
    give one report per kind with its own baseline row; the bfloat16 quality check's runs (precision-*) make their own
    report and verdict from the seeds trained and evaluated in both precisions; a run whose seed has no uniform run
    evaluated is left out, and a part without its baseline is skipped."""
    from experiments import ablation_report
    from experiments.reporting.paper import gain_of

    folder = tmp_path / "runs" / "multirun" / "ablation_long"
    evaluation, trained = functools.partial(_long_evaluation, folder), functools.partial(_long_trained, folder)

    for seed in (0, 1):
        uniform, decay = _docs(seed)
        for loss, doc in (("uniform", uniform), ("decay", decay)):
            evaluation(f"{loss}-s{seed}", "eval", loss, loss, seed, doc)
            evaluation(f"{loss}-s{seed}", "eval_tree", f"{loss}_tree", loss, seed, doc)
            snapshot = folder / f"{loss}-s{seed}" / "snapshots" / "step-5000"
            evaluation(f"{loss}-s{seed}", "eval_5k", loss, loss, seed, doc,
                       {"name": loss, "path": str(snapshot), "training_run": None})
            snapshot.mkdir(parents=True)
            trained(f"{loss}-s{seed}", seed)
        evaluation(f"precision-32-s{seed}", "eval", "l2r_all_32", "l2r_all", seed, uniform)
        evaluation(f"precision-bf16-mixed-s{seed}", "eval", "l2r_all_bf16-mixed", "l2r_all", seed, decay)
        trained(f"precision-32-s{seed}", seed, (1.2, 1.50 + 0.02 * seed))
        trained(f"precision-bf16-mixed-s{seed}", seed, (1.2, 1.51 - 0.02 * seed))
    evaluation("decay-s2", "eval", "decay", "decay", 2, _docs(2)[1])  # uniform-s2 not trained: no gain to pair yet
    trained("decay-s2", 2)
    evaluation("precision-32-s2", "eval", "l2r_all_32", "l2r_all", 2, _docs(2)[0])  # its bfloat16 twin not trained
    trained("precision-32-s2", 2, (1.2, 1.9))
    trained("precision-bf16-mixed-s2", 2, (1.2,))  # training: no train_summary.json
    (folder / "precision-bf16-mixed-s2" / "train_summary.json").unlink()
    out = tmp_path / "results"
    written = ablation_report.main(["--runs", str(tmp_path / "runs"), "--out", str(out), "--long"])
    assert written == ["ablation_long", "ablation_long_tree", "ablation_long_5k", "ablation_long_precision"]
    chain = json.loads((out / "ablation_long" / "report.json").read_text())
    assert {c["config"] for c in chain["configurations"]} == {"uniform", "decay"}
    text = (out / "ablation_long" / "report.md").read_text()  # timed evaluations, but timed beside trainings
    assert "Speeds are not shown: the queue evaluates" in text and "tok/s" not in text
    assert sorted(c["seed"] for c in chain["configurations"]) == [0, 0, 1, 1]  # not decay-s2
    tree = json.loads((out / "ablation_long_tree" / "report.json").read_text())
    assert [c["config"] for c in tree["configurations"]][:2] == ["uniform_tree", "uniform_tree"]
    assert tree["across_seeds"]["t0"][rp.MEAN]["decay_tree"]["seeds"] == [0, 1]
    snapshots = json.loads((out / "ablation_long_5k" / "report.json").read_text())
    assert snapshots["across_seeds"]["t0"][rp.MEAN]["decay"]["seeds"] == [0, 1]
    precision = json.loads((out / "ablation_long_precision" / "report.json").read_text())
    assert {c["config"] for c in precision["configurations"]} == {"l2r_all_32", "l2r_all_bf16-mixed"}
    assert sorted(c["seed"] for c in precision["configurations"]) == [0, 0, 1, 1]  # not seed 2: one precision only
    assert "l2r_all_bf16-mixed" in precision["across_seeds"]["t0"][rp.MEAN]
    quality = json.loads((out / "ablation_long_precision" / "quality.json").read_text())
    code = quality["suites"]["code"]  # the decay doc keeps 1.5x the uniform one's tokens on code, seed by seed
    assert code["gain"] == pytest.approx(0.5) and code["ci_low"] > 0 and not code["within"]
    assert quality["suites"][rp.MEAN]["seeds"] == 2 and quality["within_on_mean"] == quality["suites"][rp.MEAN]["within"]
    held = quality["held_out"]
    assert held["final"] == {"float32-s0": 1.5, "float32-s1": 1.52, "bfloat16-s0": 1.51, "bfloat16-s1": 1.49}
    assert held["gap_by_seed"] == {"0": 0.01, "1": -0.03} and held["baseline_seed_spread"] == 0.02
    assert (out / "ablation_long_precision" / "held_out.png").is_file()
    for seed in (0, 1):  # uniform's tree evaluations gone: that part is skipped, the others still written
        shutil.rmtree(folder / f"uniform-s{seed}" / "eval_tree")
    short = out / "ablation_long" / "report.json"  # standing in for the 700-step ablation's
    again = ablation_report.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "again"), "--long",
                                  "--short", str(short)])
    assert again == ["ablation_long", "ablation_long_5k", "ablation_long_precision"]
    beside = (tmp_path / "again" / "ablation_long" / "beside.md").read_text()
    decay = gain_of(chain, "decay")
    cell = f"{100 * decay['gain']:+.1f}% [{100 * decay['ci_low']:+.1f}, {100 * decay['ci_high']:+.1f}] (2 seeds)"
    assert f"| decay | {cell} | {cell} | {cell} | +8.7% |" in beside  # 700 steps, long, 5K (no tree report here)
    assert "| focal |" not in beside and "(T=1, mean over suites)" in beside
    assert "![beside](beside.png)" in beside and (tmp_path / "again" / "ablation_long" / "beside.png").stat().st_size


def test_slots_past_what_a_step_drafts_have_no_acceptance_rate():
    """a_k past a chain's W, a tree's deepest path (N) or a hybrid's lookup depth is left out (None), not read as
    every step that got there rejecting; a record that does not say keeps every slot of its K."""
    from experiments.reporting.runs import Run
    from experiments.reporting.stats import build_report

    def run(name, drafter):
        doc = _docs()[1] | {"drafter": {"path": "/nowhere/drafter"} | drafter}
        for entries in doc["results"].values():
            for entry in entries.values():
                entry["position_acceptance"] = [0.5, 0.4, 0.0]
        return Run(name, Path(f"/nowhere/{name}/results.json"), doc)

    runs = [run("chain", {"config": {"max_draft_tokens": 2}}), run("all_k", {"config": {}}),
            run("tree", {"config": {"tree_policy": {"budget": 1, "chain_width": None, "lookup_depth": 5}}}),
            run("hybrid", {"config": {"tree_policy": {"budget": 1, "chain_width": None, "lookup_depth": 2},
                                      "lookup": True}})]
    assert [r.drafted_width() for r in runs] == [2, None, 1, 2]
    curves = build_report(runs, baseline=None, num_bootstrap=10)["curves"]["t0"]["code"]
    assert {name: c["position_acceptance"] for name, c in curves.items()} == {
        "chain": [0.5, 0.4, None], "all_k": [0.5, 0.4, 0.0], "tree": [0.5, None, None], "hybrid": [0.5, 0.4, None]}


def test_where_drafts_are_kept_sums_each_configurations_histograms_over_suites():
    """reach_lines: the share of steps keeping at least k drafts, k up to the deepest any step kept, and each slot's
    acceptance among the steps that reached it, from the accept histograms summed over suites (of unequal lengths);
    a configuration without one has no row; none at all: no section."""
    from experiments.reporting.tables import reach_lines

    curves = {"code": {"a": {"accept_hist": [6, 3, 1]}, "b": {"accept_hist": [2, 2, 0, 0]}, "d": {"accept_hist": [7]}},
              "chat": {"a": {"accept_hist": [10]}, "b": {"accept_hist": [4, 1, 1, 0]}, "c": {"accept_hist": None}}}
    report = {"temperatures": {"t0": 0.0}, "curves": {"t0": curves},
              "configurations": [{"name": n} for n in ("a", "b", "c", "d")]}
    lines = reach_lines(report)
    assert lines[1] == "### Steps keeping at least k drafts (T=0, summed over suites)"
    assert lines[3:8] == ["| configuration | k ≥ 1 | k ≥ 2 |", "|---|---|---|",
                          "| a | 20.0% | 5.0% |",  # 20 steps: 4 kept >= 1, 1 kept 2
                          "| b | 40.0% | 10.0% |",  # 10 steps: 4 kept >= 1, 1 kept 2
                          "| d | 0.0% | 0.0% |"]
    assert lines[9].startswith("### Acceptance at slot k among the steps that reached it (T=0")
    assert lines[13:] == ["| configuration | a_1 | a_2 |", "|---|---|---|",
                          "| a | 20.0% (20) | 25.0% (4) |",  # slot 2: 1 of the 4 steps that kept slot 1
                          "| b | 40.0% (10) | 25.0% (4) |",
                          "| d | 0.0% (7) | — |"]  # no step reached slot 2
    assert reach_lines({**report, "curves": {"t0": {"code": {"a": {"accept_hist": [5, 0]}}}}}) == []


def test_where_drafts_are_kept_names_the_deepest_step_past_six_columns():
    from experiments.reporting.tables import reach_lines

    report = {"temperatures": {"t0": 0.0}, "curves": {"t0": {"code": {"a": {"accept_hist": [5] + [1] * 10}}}},
              "configurations": [{"name": "a"}]}
    lines = reach_lines(report)
    header, _, row = lines[3:6]
    assert header == "| configuration | k ≥ 1 | k ≥ 2 | k ≥ 3 | k ≥ 4 | k ≥ 5 | k ≥ 6 | k ≥ 10 |"
    assert row == "| a | 66.7% | 60.0% | 53.3% | 46.7% | 40.0% | 33.3% | 6.7% |"  # 15 steps; 1 kept 10
    assert lines[-3] == "| configuration | a_1 | a_2 | a_3 | a_4 | a_5 | a_6 |"  # no deepest column here
    assert lines[-1] == "| a | 66.7% (15) | 90.0% (10) | 88.9% (9) | 87.5% (8) | 85.7% (7) | 83.3% (6) |"
