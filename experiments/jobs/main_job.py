"""The main job (``python -m experiments.main``, the README's first command): every stage in turn.

By default (``conf/main_sharegpt.yaml`` over ``conf/main.yaml``) it shows the method at its own regime,
SmolLM2-135M-Instruct as the target, with the drafters trained for hours and shipped beside a short-budget pair:

1. ``experiments.regenerate experiment=<train_experiment>`` — the drafters' data (for SmolLM2: the recorded answers,
   installed after a regenerated batch matched them token for token);
2. ``experiments.train`` — one drafter per loss in ``losses`` (the uniform baseline and ``l2r_all``), same data,
   budget and seed; then ``experiments.train_assistant`` — the ``ar_assistant`` baseline on the same answers (or a
   shipped one, ``assistant.path``). Block drafters trained elsewhere (``shipped``: report row -> folder, e.g. the
   long job's, ``conf/main_sharegpt.yaml``) join the evaluations; a missing one is named before any stage runs;
3. ``experiments.evaluate`` — every drafter and baseline on the suites at T=0 (replayed from the target's greedy
   answers, :mod:`experiments.pipeline.replay`) and T=1 (decoded, batch 8; ``evaluate_overrides``), then the
   drafters of ``speed_drafters`` at batch 1, T=0, against one timing of the target alone, interleaved in one process
   (``experiments.speed``, ``speed_overrides``), each baseline at the K and each block drafter verifying the W (and
   candidate vocabulary) chosen on held-out training answers (``experiments.pipeline.choose_k``);
4. ``experiments.serve_check`` — with ``serve_check``, one block drafter served by vLLM for CPU beside the target
   alone, its acceptance checked against blockdraft's (skipped, with the reason in the log, without a vLLM
   environment: ``bash experiments/serving/install_vllm.sh``);
5. ``experiments.report`` — the tables (τ, paired gains over ``uniform``, speed at batch 1) and the plots; then
   each of ``extra_reports`` over its rows, with gains over its first (e.g. ``l2r_all_long`` over ``uniform_long``).

Each stage runs as its own entry point (a subprocess, its own Hydra run dir under this job's run
dir), so every stage can also be rerun by hand with the command printed here. Stages that already
finished are skipped by the stages themselves (regeneration shards, ``last.ckpt``, results.json),
so a killed main job resumes when started again with ``hydra.run.dir=<its run dir>``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from drafters.storage import file_digest, write_json_atomic
from experiments.data.suites import cache_dir
from experiments.pipeline.paths import REPO
from experiments.pipeline.records import machine, matmul_gflops
from experiments.serving.engine import ServingError, vllm_python

SUMMARY = "main_summary.json"


def stage(name: str, module: str, overrides: list[str], log: dict) -> None:
    """Run ``python -m <module> <overrides>``; print and record its wall time in ``log`` (and in the file
    ``log["summary"]`` names in ``log["run_dir"]``, where it names one)."""
    cmd = [sys.executable, "-m", module, *overrides]
    print(f"\n=== [{name}] {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
    t = time.time()
    proc = subprocess.run(cmd, check=False)
    seconds = time.time() - t
    log["stages"].append({"stage": name, "command": " ".join(cmd[1:]), "seconds": round(seconds, 1)})
    print(f"=== [{name}] done in {seconds / 60:.1f} min", flush=True)
    if log.get("summary"):  # rewritten after every stage: a stopped job leaves the times of the stages it ran
        save_summary(log)
    if proc.returncode != 0:
        raise SystemExit(f"stage {name!r} failed with exit code {proc.returncode}: {' '.join(cmd[1:])}")


def stage_once(name: str, module: str, overrides: list[str], log: dict, done: Path,
               models: Sequence[str | Path] = ()) -> None:
    """:func:`stage`, unless ``done`` (the file whose presence marks it finished) was written by a stage with these
    same arguments and ``models`` (folders: their safetensors' content hash) (``<done>.args.json``, written once the
    stage succeeds): a resumed job keeps its result, and runs it again where its arguments changed (a new grid,
    drafter or setting), a model was trained further or replaced, or it was cut before finishing."""
    record = done.with_name(done.name + ".args.json")
    inputs = {"args": overrides,
              "models": {str(m): file_digest(sorted(Path(m).glob("*.safetensors"))) for m in models}}
    if done.is_file() and record.is_file() and json.loads(record.read_text()) == inputs:
        return
    if done.is_file():
        print(f"\n=== [{name}] run again: {done} was not written by this stage with these arguments and models",
              flush=True)
    record.unlink(missing_ok=True)
    stage(name, module, overrides, log)
    write_json_atomic(record, inputs)


def save_summary(log: dict) -> None:
    """Write ``log`` (:func:`portable_summary`) to the file ``log["summary"]`` names in ``log["run_dir"]``."""
    run_dir = Path(log["run_dir"])
    write_json_atomic(run_dir / log["summary"], json.loads(portable_summary(log, run_dir)))


def portable_summary(log: dict, run_dir: Path) -> str:
    """main_summary.json's text with paths relative to the repository or to the job's run dir (``.``), and
    regenerated data as ``$BLOCKDRAFT_CACHE/...``."""
    text = json.dumps(log, indent=1)
    for folder in (run_dir, REPO):  # the run dir first: it may lie inside the repository
        quoted = json.dumps(str(folder))[1:-1]
        text = text.replace(quoted + "/", "").replace(f'"{quoted}"', '"."')
    return text.replace(json.dumps(str(cache_dir().expanduser().resolve()))[1:-1] + "/", "$BLOCKDRAFT_CACHE/")


def trained_data_dir(run_dir: Path, losses) -> str | None:
    """The regenerated data folder the main job's drafters trained on (their train_summary.json), if any."""
    for loss in losses:
        summary = run_dir / "train" / loss / "train_summary.json"
        if summary.is_file():
            return json.loads(summary.read_text())["data_dir"]
    return None


def baseline_overrides(overrides, baseline: str, fill: dict[str, str | None]) -> list[str]:
    """``baseline_overrides.<baseline>`` with ``{data_dir}`` / ``{assistant_dir}`` filled in; a clear error where
    one is unknown."""
    out = []
    for o in overrides:
        for key, value in fill.items():
            if "{" + key + "}" in o:
                if value is None:
                    raise ValueError(f"baseline_overrides.{baseline} needs {{{key}}}, which this job did not make "
                                     f"({_MADE_BY[key]}), or drop {baseline} from baselines")
                o = o.replace("{" + key + "}", str(value))
        out.append(o)
    return out


LAYOUT = "<layout>"  # the key of _choose_k's overrides for every evaluation's weight layout (no drafter has brackets)
_MADE_BY = {"data_dir": "the drafters' data folder, known from a trained loss's train_summary.json: train at "
                        "least one loss",
            "assistant_dir": "the assistant of `assistant:`; set assistant.config_name or assistant.path"}


def assistant_dir(cfg: DictConfig, run_dir: Path) -> str | None:
    """The ar_assistant's folder: trained by this job (``assistant.config_name``), else shipped (``assistant.path``)."""
    spec = cfg.get("assistant")
    if not spec:
        return None
    if spec.get("config_name"):
        return str(run_dir / "assistant" / "export")
    if spec.get("path") and not (Path(str(spec.path)) / "config.json").is_file():
        raise FileNotFoundError(f"assistant.path={spec.path} holds no model: ship one (python -m experiments.long) or "
                                "set assistant.config_name to train one in this job")
    return spec.get("path")


def shipped_drafters(cfg: DictConfig) -> dict[str, Path]:
    """``shipped``: the block drafters trained elsewhere, by report row; a missing folder is named up front."""
    shipped = {name: Path(str(path)) for name, path in (cfg.get("shipped") or {}).items()}
    for name, path in shipped.items():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"shipped.{name}={path} holds no drafter: ship it (python -m experiments.long, then "
                                    f"copy <its run dir>/assets/{name} there) or drop {name} from shipped")
    return shipped


def _train_stages(cfg: DictConfig, run_dir: Path, science: list[str], log: dict) -> dict[str, list[str]]:
    """Data, one drafter per loss, the assistant; returns each trained drafter's evaluation arguments."""
    stage("data", "experiments.regenerate", [*science, *cfg.data_overrides, f"hydra.run.dir={run_dir}/data"], log)
    drafters = {}
    for loss in cfg.losses:
        train_dir = run_dir / "train" / loss
        stage(f"train {loss}", "experiments.train", [*science, f"loss={loss}", f"seed={cfg.seed}",
                                                     *cfg.train_overrides, f"hydra.run.dir={train_dir}"], log)
        drafters[loss] = [f"drafter.path={train_dir}/drafter", *cfg.trained_evaluate_overrides]
    if cfg.get("assistant") and cfg.assistant.get("config_name") and "ar_assistant" in cfg.baselines:
        stage("train ar_assistant", "experiments.train_assistant",
              ["--config-name", cfg.assistant.config_name, *cfg.common_overrides, *cfg.assistant.overrides,
               f"hydra.run.dir={run_dir}/assistant"], log)
    return drafters


def _choose_k(cfg: DictConfig, run_dir: Path, fill: dict, blocks: dict[str, Path], log: dict) -> dict[str, list[str]]:
    """With ``choose_k``: each of prompt_lookup and ar_assistant's best K, and each timed block drafter's best W (and
    candidate vocabulary, ``choose_k.draft_vocab_sizes``) on the held-out training answers
    (``experiments.pipeline.choose_k``, ``<run dir>/choose_k.json``), as evaluation overrides by drafter, and the
    weight layout chosen among ``choose_k.weight_layouts`` as every evaluation's (key :data:`LAYOUT`): the speed
    stage's, and the τ evaluations' since they decode the same products, in larger batches; ``{}`` without."""
    wanted = [b for b in ("prompt_lookup", "ar_assistant") if b in cfg.baselines]
    spec = cfg.get("choose_k")
    if not spec or not wanted:
        return {}
    if fill["data_dir"] is None:
        raise ValueError(f"choose_k needs {_MADE_BY['data_dir']}")
    out, vocab_from = run_dir / "choose_k.json", spec.get("draft_vocab_from") or fill["data_dir"]
    args = ["--data-dir", fill["data_dir"], "--target", str(spec.target_path), "--out", str(out),
            "--ks", *map(str, spec.ks), "--draft-vocab-sizes", *map(str, spec.get("draft_vocab_sizes") or [0]),
            "--draft-vocab-from", str(vocab_from), *(["--weight-layouts", *spec.weight_layouts]
                                                     if spec.get("weight_layouts") else [])]
    if "ar_assistant" in wanted and fill["assistant_dir"] is not None:
        args += ["--assistant", fill["assistant_dir"]]
    for name in _timed(cfg, blocks):
        args += ["--drafter", f"{name}={blocks[name]}"]
    for name in spec.get("trees") or []:
        args += ["--tree", f"{name}={blocks[name]}"]
    if spec.get("trees") and spec.get("tree_vocab_size"):
        args += ["--tree-vocab-size", str(spec.tree_vocab_size)]
    for key in ("tree_budgets", "hybrid_matches", "hybrid_depths"):  # the tree grid (choose_k's defaults where unset)
        if spec.get("trees") and spec.get(key):
            args += [f"--{key.replace('_', '-')}", *map(str, spec[key])]
    models = [*([fill["assistant_dir"]] if "--assistant" in args else []),
              *dict.fromkeys(blocks[n] for n in [*_timed(cfg, blocks), *(spec.get("trees") or [])])]
    stage_once("choose K", "experiments.pipeline.choose_k", args, log, out, models)  # a resumed job keeps its K
    chosen = json.loads(out.read_text())
    overrides = {b: [f"drafter.num_draft_tokens={int(chosen[b]['chosen_k'])}"] for b in wanted if b in chosen}
    for name, c in chosen.get("block_width", {}).items():
        vocab = int(c.get("chosen_vocab") or 0)  # 0: the whole vocabulary
        overrides[name] = [f"drafter.max_draft_tokens={int(c['chosen_k'])}", *(
            [f"drafter.draft_vocab_size={vocab}", f"drafter.draft_vocab_from={vocab_from}"] if vocab else [])]
    if "chosen_layout" in chosen:
        overrides[LAYOUT] = [f"weight_layout={chosen['chosen_layout']}"]
    for name, c in chosen.get("tree", {}).items():
        for kind, setting in c["chosen"].items():
            picked = c["by_setting"][setting]
            keys = ("budget",) if kind == "tree" else ("budget", "lookup_min_match", "lookup_depth")
            overrides[f"{kind}:{name}"] = [f"drafter.{key}={picked[key]}" for key in keys]
    return overrides


def tree_rows(cfg: DictConfig, blocks: dict[str, Path], chosen: dict[str, list[str]],
              data_dir: str | None = None) -> dict[str, list[str]]:
    """``trees``: each report row's evaluation arguments: its ``drafter`` choice (``tree`` or ``hybrid``), the block
    drafter it drafts with (``of``), the settings chosen held out for ``settings_of`` (default ``of``; so two drafters
    can be compared at the same N), the trees' candidate vocabulary, ``tree_overrides``, and the row's own
    ``overrides`` (e.g. a fixed ``drafter.budget``), which win over the chosen settings. The candidates come from
    ``choose_k.draft_vocab_from``, else ``data_dir`` (the trained drafters' data, as :func:`_choose_k` counts them)."""
    rows, spec = {}, cfg.get("choose_k") or {}
    source = spec.get("draft_vocab_from") or data_dir
    if cfg.get("trees") and spec.get("tree_vocab_size") and source is None:
        raise ValueError(f"choose_k.tree_vocab_size={spec.tree_vocab_size} needs choose_k.draft_vocab_from or drafters "
                         "trained here (their data): the candidates are that data's most frequent tokens")
    for name, row in (cfg.get("trees") or {}).items():
        if row.of not in blocks:
            raise ValueError(f"trees.{name}.of={row.of} is none of this job's block drafters {sorted(blocks)}")
        vocab = ([f"drafter.draft_vocab_size={spec.tree_vocab_size}",
                  f"drafter.draft_vocab_from={source}"]
                 if spec.get("tree_vocab_size") else [])
        settings = chosen.get(f"{row.drafter}:{row.get('settings_of') or row.of}", [])
        rows[name] = [f"drafter={row.drafter}", f"drafter.path={blocks[row.of]}", f"drafter.name={name}", *vocab,
                      *settings, *cfg.get("tree_overrides", []), *row.get("overrides", [])]
    return rows


def _timed(cfg: DictConfig, names) -> list[str]:
    """The drafters among ``names`` timed at batch 1 (``speed_drafters``; null: all)."""
    return [n for n in names if cfg.get("speed_drafters") is None or n in cfg.speed_drafters]


def speed_arguments(name: str, args: list[str]) -> list[str]:
    """One drafter's part of the speed stage's command (``experiments.speed``): its ``drafter`` choice and keys
    (an evaluation's ``drafter=<choice>`` / ``drafter.<key>=...``; no choice: a block drafter) under
    ``drafters.<name>``. Its other evaluation overrides are not its own: ``speed_overrides`` set the decoding."""
    choice = next((a.split("=", 1)[1] for a in args if a.startswith("drafter=")), "block")
    keys = [f"drafters.{name}.{a[len('drafter.'):]}" for a in args if a.startswith("drafter.")]
    return [f"+drafter@drafters.{name}={choice}", *keys]


def _evaluate(cfg: DictConfig, run_dir: Path, drafters: dict[str, list[str]], blocks: dict,
              chosen: dict[str, list[str]], log: dict) -> list[str]:
    """τ of every drafter (``eval/<name>``), then the speed at batch 1 of the timed ones against one timing of the
    target alone (``experiments.speed`` into ``speed/<name>``), all with the weight layout chosen (``chosen[LAYOUT]``);
    returns the timed ones."""
    evaluate, layout = [f"target={cfg.eval_target}", *cfg.common_overrides], chosen.get(LAYOUT, [])
    for name, args in drafters.items():
        stage(f"eval {name}", "experiments.evaluate",
              [*evaluate, *args, *layout, *cfg.evaluate_overrides, f"hydra.run.dir={run_dir / 'eval' / name}"], log)
    if cfg.get("speed_overrides") is None:
        return []
    timed = _timed(cfg, drafters)
    if timed:
        each = [a for n in timed for a in speed_arguments(n, [*drafters[n], *(chosen.get(n, []) if n in blocks else [])])]
        stage("speed", "experiments.speed", [*evaluate, *each, *layout, *cfg.speed_overrides,
                                             f"hydra.run.dir={run_dir / 'speed'}"], log)
    return timed


def served_drafter(cfg: DictConfig, blocks: dict[str, Path]) -> str | None:
    """``serve_check.drafter`` (checked to be one of the job's block drafters), or None without ``serve_check``."""
    spec = cfg.get("serve_check")
    if not spec:
        return None
    if spec.drafter not in blocks:
        raise ValueError(f"serve_check.drafter={spec.drafter} is none of this job's block drafters {sorted(blocks)}")
    return spec.drafter


def _serve_check(cfg: DictConfig, run_dir: Path, served: str | None, blocks: dict[str, Path], log: dict) -> None:
    """``served`` by vLLM beside the target alone (``experiments.serve_check`` into ``serve/<served>/``), with the
    speculative tokens W chosen for it (``choose_k.json``), where a vLLM environment exists; without one the stage
    is skipped and the log says why."""
    if served is None:
        return
    name, out = f"serve {served}", run_dir / "serve" / served
    try:
        vllm_python()
    except ServingError as e:
        print(f"\n=== [{name}] skipped: {e}", flush=True)
        log["stages"].append({"stage": name, "skipped": str(e), "seconds": 0.0})
        return
    chosen = run_dir / "choose_k.json"  # vLLM verifies the W chosen for the drafter on held-out answers, if any
    width = json.loads(chosen.read_text()).get("block_width", {}).get(served) if chosen.is_file() else None
    served_width = [f"num_speculative_tokens={int(width['chosen_k'])}"] if width else []
    stage_once(name, "experiments.serve_check", [f"target={cfg.eval_target}", f"drafter.path={blocks[served]}",
                                                 *cfg.common_overrides, *served_width, *cfg.serve_check.overrides,
                                                 f"hydra.run.dir={out}"], log, out / "serve_check.json", [blocks[served]])


def _reports(cfg: DictConfig, run_dir: Path, drafters: dict, timed: list[str], log: dict) -> Path:
    """``report/`` (every drafter, gains over ``uniform``, speeds), then each of ``extra_reports`` (its rows, gains
    over its first); returns ``report/``."""
    speed = ["--speed", *(str(run_dir / "speed" / n) for n in timed)] if timed else []
    stage("report", "experiments.report", [*(str(run_dir / "eval" / n) for n in drafters), *speed,
                                           "--out", str(run_dir / "report")], log)
    for name, rows in (cfg.get("extra_reports") or {}).items():
        stage(f"report {name}", "experiments.report", [*(str(run_dir / "eval" / n) for n in rows),
                                                        "--baseline", rows[0], "--out", str(run_dir / name)], log)
    return run_dir / "report"


def earlier_launches(run_dir: Path) -> list[dict]:
    """The stage times of this run folder's earlier launches (a job stopped and resumed), from its summary."""
    path = run_dir / SUMMARY
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())
    return [*earlier.get("earlier_launches", []), {k: earlier.get(k) for k in ("stages", "total_seconds", "machine")}]


def run_main_job(cfg: DictConfig) -> dict:
    """Data, training, the assistant, τ and speed evaluations of every drafter (trained here, shipped, baselines),
    the reports (``conf/main.yaml``); returns the stage log written to ``<run dir>/main_summary.json``."""
    t0 = time.time()  # before the config resolves: resolving it may convert the target (experiments.data.smollm2)
    run_dir = Path(cfg.paths.run_dir).resolve()
    science = [f"experiment={cfg.train_experiment}", "launch=run", *cfg.common_overrides]  # one run each, no sweep
    log = {"run_dir": str(run_dir), "summary": SUMMARY, "stages": [], "earlier_launches": earlier_launches(run_dir),
           "config": OmegaConf.to_container(cfg, resolve=True),
           "machine": {**machine(), "matmul_gflops_start": round(matmul_gflops(), 1)}}
    print(f"[main] run folder {run_dir}; after a stop, the same command with hydra.run.dir={run_dir} resumes it",
          flush=True)
    shipped, assistant = shipped_drafters(cfg), assistant_dir(cfg, run_dir)  # what is missing is named first
    blocks = {loss: run_dir / "train" / loss / "drafter" for loss in cfg.losses} | shipped  # a W each
    served = served_drafter(cfg, blocks)
    drafters = _train_stages(cfg, run_dir, science, log)
    fill = {"data_dir": trained_data_dir(run_dir, cfg.losses), "assistant_dir": assistant}
    chosen = _choose_k(cfg, run_dir, fill, blocks, log)
    for name, path in shipped.items():
        drafters[name] = [f"drafter.path={path}", f"drafter.name={name}", *cfg.shipped_overrides]
    drafters |= tree_rows(cfg, blocks, chosen, fill["data_dir"])
    for baseline in cfg.baselines:
        extra = baseline_overrides(cfg.baseline_overrides.get(baseline, []), baseline, fill)
        drafters[baseline] = [f"drafter={baseline}", *extra, *chosen.get(baseline, [])]
    timed = _evaluate(cfg, run_dir, drafters, blocks, chosen, log)
    _serve_check(cfg, run_dir, served, blocks, log)
    report_dir = _reports(cfg, run_dir, drafters, timed, log)
    log["total_seconds"] = round(time.time() - t0, 1)
    log["machine"]["matmul_gflops_end"] = round(matmul_gflops(), 1)
    save_summary(log)
    print("\n" + (report_dir / "report.md").read_text(), flush=True)
    if served and (run_dir / "serve" / served / "serve_check.md").is_file():
        print((run_dir / "serve" / served / "serve_check.md").read_text(), flush=True)
    print("stage times:")
    for s in log["stages"]:
        print(f"  {s['stage']:<24s} {s['seconds'] / 60:6.1f} min")
    print(f"  {'total':<24s} {log['total_seconds'] / 60:6.1f} min   (plots and tables in {report_dir})")
    if log["earlier_launches"]:
        print(f"  (this launch; {len(log['earlier_launches'])} earlier: {SUMMARY}'s earlier_launches)")
    rates = log["machine"]
    print(f"  on {rates['cpu']} ({rates['isa']}, {rates['threads']} threads): float32 matmul "
          f"{rates['matmul_gflops_start']:.0f} GFLOP/s at the start, {rates['matmul_gflops_end']:.0f} at the end")
    return log
