"""Long-trained drafters shipped as assets (issue 50; the long job's ``ship`` stage, :mod:`experiments.jobs.long_job`).

``<ship dir>/<name>/`` holds the drafter exactly as training saved it (``config.json``, ``model.safetensors``,
``blockdraft_record.json``: ``drafter.path=<it>`` loads it, and refuses it with another target), plus its model
card, ``card.json`` to read by program and ``README.md`` to read by eye:

* ``training``: the loss and its settings, optimizer steps, training time (``train_seconds``: every resume added
  up), threads, torch, the precision it trained in (where the run recorded it: requested, resolved, the CPU's
  bfloat16 flags), the command line's overrides and the held-out τ at the end;
* ``data``: the recorded answers it trained on, with their sha256 (``answers_sha256``, ``record_sha256``), rows and
  response tokens, and how many rows trained and were held out;
* ``tau``: τ per suite and their mean at each temperature of an evaluation of these very weights (its
  ``results.json``, whose weights hash must match), with the evaluation's commit and settings;
* ``command``: what trained it.

The paths in the overrides and the command are written as committed records write them (relative to the repository,
``$BLOCKDRAFT_CACHE/...``: :func:`experiments.pipeline.paths.portable_override`), so a card carries no machine's folders.

The ar_assistant trained beside them (:func:`ship_assistant`) is its export folder (``experiments.train_assistant``:
weights, tokenizer, ``training.json``, ``README.md``) with the data's sha256 and the commit added to both.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from drafters.integrity import check_assistant_record, read_record, record_files, write_assistant_record
from drafters.storage import file_digest
from experiments.pipeline.export import LOSS_KEYS, tau_table, trained_settings
from experiments.pipeline.paths import portable_override

CARD = "card.json"


def _read(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return json.loads(path.read_text())


def _tau(results: dict) -> dict[str, dict[str, float]]:
    """``{"T=<t>": {suite: τ, ..., "mean": τ}}`` of a results.json document (:func:`tau_table`, by temperature)."""
    by_temperature: dict[str, dict[str, float]] = {}
    for suite, row in tau_table(results).items():
        for temperature, tau in row.items():
            by_temperature.setdefault(temperature, {})[suite] = round(tau, 4)
    return {t: {**row, "mean": round(float(np.mean(list(row.values()))), 4)} for t, row in by_temperature.items()}


def _data(record: dict) -> dict:
    """What a card says of the recorded answers (``record``: their record.json; without one, ``data_dir``)."""
    keys = ("answers_sha256", "record_sha256", "rows", "response_tokens", "engine", "data_dir")
    return {k: record[k] for k in keys if k in record}


def _data_line(d: dict) -> str:
    if "answers_sha256" not in d:
        return f"- data: `{d.get('data_dir')}`, {d['train_rows']:,} training and {d['held_out_rows']:,} held-out rows"
    return (f"- data: {d['rows']:,} recorded answers ({d['response_tokens']:,} response tokens), {d['train_rows']:,} "
            f"training and {d['held_out_rows']:,} held-out rows; answers sha256 `{d['answers_sha256']}`, record "
            f"sha256 `{d['record_sha256']}`")


def continued(earlier_dir: Path, steps: int, seconds: float) -> dict:
    """``training.continued_from`` of a card: the shipped drafter in ``earlier_dir`` (its card) that a run of
    ``steps`` steps in ``seconds`` continued, and the totals of both (and of what that one continued)."""
    earlier = _read(earlier_dir / CARD)
    t = earlier["training"]
    before = t.get("continued_from") or {"total_steps": t["steps"], "total_train_seconds": t["train_seconds"]}
    return {"name": earlier["name"], "weights_sha256": earlier["drafter"]["weights_sha256"], "steps": t["steps"],
            "train_seconds": t["train_seconds"], "total_steps": before["total_steps"] + steps,
            "total_train_seconds": round(before["total_train_seconds"] + seconds, 1)}


def drafter_card(drafter_dir: Path, results: Path, data_record: dict, *, name: str, command: str,
                 continued_from: Path | None = None) -> dict:
    """The model card of the drafter in ``drafter_dir`` (saved by a training run: its parent) evaluated in
    ``results``; a results.json of other weights is refused. ``continued_from``: the shipped drafter its training
    started from (``drafter.init_from``), whose card gives the earlier steps and time."""
    run = drafter_dir.parent
    evaluation, summary = _read(results), _read(run / "train_summary.json")
    weights = file_digest(sorted(drafter_dir.glob("*.safetensors")))
    if evaluation["drafter"].get("weights_sha256") != weights:
        raise ValueError(f"{results} evaluated other weights than {drafter_dir} "
                         f"({evaluation['drafter'].get('weights_sha256')} != {weights}): evaluate this drafter")
    settings, choices = trained_settings(run)
    loss = (settings.get("loss") if settings is not None else None) or {}
    target = {k: v for k, v in evaluation["target"].items() if k != "path"}
    return {
        "name": name,
        "target": target,
        "drafter": {"parameters": summary["drafter_parameters"], "weights_sha256": weights,
                    "settings": _read(drafter_dir / "blockdraft_record.json")["settings"]},
        "training": {"loss": choices.get("loss"), "loss_settings": {k: loss[k] for k in LOSS_KEYS if k in loss},
                     "steps": summary["steps"], "train_seconds": summary["train_seconds"],
                     "threads": summary["threads"], "torch": summary["torch"],
                     **({"precision": summary["precision"]} if "precision" in summary else {}),
                     "overrides": [portable_override(o) for o in summary["overrides"]],
                     "held_out": summary["val"],
                     **({"continued_from": continued(continued_from, summary["steps"], summary["train_seconds"])}
                        if continued_from is not None else {})},
        "data": {**_data(data_record), "train_rows": summary["train_rows"], "held_out_rows": summary["val_rows"]},
        "tau": _tau(evaluation),
        "evaluation": {"commit": evaluation.get("git_commit"), "settings": evaluation["settings"],
                       "prompts": {s: e[next(iter(e))]["num_prompts"] for s, e in evaluation["results"].items()}},
        "command": portable_override(command),
    }


def _continued_line(c: dict) -> str:
    return (f"- continued from `{c['name']}` ({c['steps']:,} steps, {c['train_seconds'] / 3600:.2f} h; weights "
            f"`{c['weights_sha256']}`) with a fresh schedule: {c['total_steps']:,} steps, "
            f"{c['total_train_seconds'] / 3600:.2f} h in all")


def _precision_words(precision: dict | None) -> str:
    if not precision:
        return ""
    flags = " ".join(precision.get("cpu_bf16_flags") or []) or "no bfloat16 flags"
    return f", precision {precision['resolved']} from trainer.precision={precision['requested']}, CPU: {flags}"


def render(card: dict) -> str:
    """README.md of a shipped drafter: the card as prose and a table."""
    t, d, dr = card["training"], card["data"], card["drafter"]
    settings = ", ".join(f"{k}={v}" for k, v in t["loss_settings"].items())
    temps = list(card["tau"])
    suites = [s for s in card["tau"][temps[0]] if s != "mean"] + ["mean"] if temps else []
    lines = [
        (f"# `{card['name']}`: a blockdraft drafter for {card['target'].get('model_type')} "
        f"({card['target'].get('num_hidden_layers')} layers)"),
        "",
        (f"A {dr['settings']['num_layers']}-layer block drafter ({dr['parameters']:,} parameters, block size "
        f"{dr['settings']['block_size']}) trained with the `{t['loss']}` loss ({settings or 'default settings'})."),
        (f"Use it with `drafter.path=<this folder>`; another target is refused (the drafter records its target's "
        f"weights signature, `{dr['settings']['target_fingerprint'].get('weights_sha1', 'unknown')}`)."),
        "",
        "## Training",
        "",
        f"- command: `{card['command']}`",
        (f"- {t['steps']:,} optimizer steps in {t['train_seconds'] / 3600:.2f} h on {t['threads']} CPU threads "
        f"(torch {t['torch']}{_precision_words(t.get('precision'))}); held-out τ at the end: "
        f"{json.dumps(t['held_out'])}"),
        *([_continued_line(t["continued_from"])] if "continued_from" in t else []),
        _data_line(d),
        f"- weights sha256 (blockdraft's content hash): `{dr['weights_sha256']}`",
        "",
        f"## τ (accepted tokens per verification step, exact verification; commit {card['evaluation']['commit']})",
        "",
        "| suite | " + " | ".join(temps) + " |",
        "|---" * (len(temps) + 1) + "|",
    ]
    for suite in suites:
        lines.append(f"| {suite} | " + " | ".join(f"{card['tau'][t].get(suite, float('nan')):.3f}" for t in temps) + " |")
    prompts = ", ".join(f"{s} {n}" for s, n in card["evaluation"]["prompts"].items())
    lines += ["", f"Prompts per suite: {prompts}. Settings: `{json.dumps(card['evaluation']['settings'])}`.", ""]
    return "\n".join(lines)


def ship_drafter(drafter_dir: str | Path, results: str | Path, out: str | Path, data_record: dict, *, name: str,
                 command: str, extra: Sequence[str] = (), continued_from: Path | None = None) -> Path:
    """Copy the drafter in ``drafter_dir`` to ``out`` with its card (``card.json``, ``README.md``); returns ``out``.
    ``extra``: names of other folders already in ``out`` that are kept (e.g. a ``dflash/`` export);
    ``continued_from``: see :func:`drafter_card`."""
    drafter_dir, out = Path(drafter_dir), Path(out)
    card = drafter_card(drafter_dir, Path(results), data_record, name=name, command=command,
                        continued_from=continued_from)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file() or stale.name not in extra:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    for path in sorted(drafter_dir.iterdir()):
        shutil.copy2(path, out / path.name)
    (out / CARD).write_text(json.dumps(card, indent=1) + "\n")
    (out / "README.md").write_text(render(card))
    record_files(out, [CARD])  # the drafter's record covers every byte of its card too
    return out


def ship_assistant(export_dir: str | Path, out: str | Path, data_record: dict, commit: str | None) -> Path:
    """Copy the assistant exported in ``export_dir`` to ``out``, its card naming the data's sha256 and ``commit``."""
    export_dir, out = Path(export_dir), Path(out)
    meta = _read(export_dir / "training.json")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export_dir, out)
    if read_record(out) is None:  # an export from before assistants had records: recorded now
        write_assistant_record(out)
    check_assistant_record(out)  # the copy is the export that was recorded
    shipped = {**_data(data_record), "commit": commit}
    (out / "training.json").write_text(json.dumps({**meta, "shipped": shipped}, indent=1) + "\n")
    data = _data_line({**shipped, "train_rows": meta.get("train_rows", 0), "held_out_rows": meta.get("val_rows", 0)})
    with open(out / "README.md", "a") as f:
        f.write(f"\n## Shipped\n\nTrained at commit `{commit}`.\n\n{data}\n")
    return out
