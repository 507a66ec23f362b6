"""The ``ar_assistant`` baseline: a small causal LM distilled from the target on its regenerated answers.

Library code of ``python -m experiments.train_assistant`` (conf/train_assistant.yaml). The assistant
is a Hugging Face ``LlamaForCausalLM`` with the target's vocabulary and special ids, by default
started from the target's embeddings, first layers, final norm and LM head (:func:`build_assistant`), trained with next-token cross-entropy on the *response* tokens of the
same regenerated data the block drafters train on (``data``: :class:`drafters.training.datamodule.RegenDataModule`,
same validation split), and exported with ``save_pretrained`` plus the target's tokenizer
(:func:`export_assistant`), ready for ``verify.AssistantDrafter`` / ``drafter=ar_assistant``.

Validation (:class:`AssistantLM`) on the held-out rows, response tokens only:

* ``val/ce`` (nats/token) and ``val/acc`` (teacher-forced top-1 accuracy);
* ``val/tau_greedy``: greedy verification replayed block by block with K = ``num_draft_tokens``
  (:func:`leading_correct` then ``drafters.tau.greedy_walk``). At temperature 0 the assistant's
  k-th draft equals its teacher-forced argmax whenever drafts 1..k−1 were right, so on the target's
  greedy answers (``data=regen_greedy``) this is the online τ of ``verify.speculative_generate``
  (up to argmax ties between a cached and a full forward).
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from drafters import locks, storage
from drafters.integrity import write_assistant_record
from drafters.tau import greedy_walk
from drafters.training.datamodule import read_meta
from experiments.data.target import load_target
from experiments.pipeline import run_settings
from experiments.pipeline.paths import cache_path, portable_path
from experiments.pipeline.trainer import arithmetic, build_trainer, train_seconds

# ----------------------------------------------------------------------------- model


INIT_TEXT = {True: "initialised from the target's embeddings, first layers, final norm and LM head",
             "embeddings": "embeddings, final norm and LM head from the target, layers random",
             False: "random initialisation"}


def build_assistant(target, model: dict, init_from_target: bool | str = True):
    """A ``LlamaForCausalLM`` with the target's vocabulary and special token ids.

    ``model`` holds the architecture (hidden_size, num_hidden_layers, ...; LlamaConfig fields). With
    ``init_from_target`` every weight is copied from the target parameter of the same name (its
    embeddings, first ``num_hidden_layers`` layers, final norm and LM head), so the architecture must
    match the target's apart from the depth; ``"embeddings"`` copies all but the layers (what a block
    drafter shares with the target: embeddings, final norm, LM head), the layers stay random;
    ``False``: every weight random.
    """
    if init_from_target not in (True, False, "embeddings"):
        raise ValueError(f"init_from_target must be true, false or 'embeddings', got {init_from_target!r}")
    text = target.config.get_text_config()
    ids = {k: getattr(text, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assistant = LlamaForCausalLM(LlamaConfig(vocab_size=text.vocab_size, **ids, **model))
    if init_from_target:
        ours = {k: v for k, v in assistant.state_dict().items()
                if init_from_target is True or ".layers." not in k}
        theirs = {k: v for k, v in target.state_dict().items() if k in ours}
        wrong = sorted(k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape)
        if wrong:
            raise ValueError(f"init_from_target: the target has no weight of the assistant's shape for {wrong[:4]} "
                             f"(the model settings must match the target's except num_hidden_layers)")
        assistant.load_state_dict(theirs, strict=init_from_target is True)
    return assistant


#: The architecture settings a saved assistant must share with ``model:`` to be continued (:func:`continue_from`).
ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "tie_word_embeddings")


def continue_from(assistant, path: str | Path) -> dict:
    """Load the weights of the assistant saved at ``path`` (an export: weights and ``training.json``) into
    ``assistant``, in float32; a different architecture is refused, naming each setting. Returns what it continued
    (:func:`continued_record`)."""
    folder = Path(str(path)).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"init_from={path}: no saved assistant there (config.json); give an export folder of "
                                "experiments.train_assistant, e.g. experiments/assets/ar_assistant_smollm2")
    saved = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ours, theirs = assistant.config.to_dict(), saved.config.to_dict()
    diffs = [f"{k}: {theirs.get(k)} (saved) != {ours.get(k)} (model.{k})" for k in ARCH_KEYS if ours.get(k) != theirs.get(k)]
    if diffs:
        raise ValueError(f"init_from={path}: another architecture than model: ({'; '.join(diffs)})")
    assistant.load_state_dict(saved.state_dict())
    earlier = json.loads((folder / "training.json").read_text()) if (folder / "training.json").is_file() else {}
    return continued_record(folder.name, earlier)


def continued_record(name: str, earlier: dict) -> dict:
    """The training record's ``init`` text (what a run continued and how long that had trained) and the
    ``total_steps`` / ``total_wall_time_s`` of every run before this one (``earlier``: the continued export's
    ``training.json``; its own totals when it too was continued)."""
    steps, seconds = earlier.get("steps"), earlier.get("wall_time_s")
    return {"init": f"continued from `{name}` ({steps if steps is not None else '?'} steps, "
                    f"{seconds if seconds is not None else '?'} s; {earlier.get('init', 'its own initialisation')})",
            "total_steps": earlier.get("total_steps", steps or 0),
            "total_wall_time_s": earlier.get("total_wall_time_s", seconds or 0.0)}


def response_labels(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels of a right-padded batch (:func:`drafters.training.datamodule.collate`) and where they count.

    Returns ``labels (B, S - 1)`` (column c + 1 of ``input_ids``, predicted at column c) and
    ``mask (B, S - 1) bool``: True where that label is a response token (``prompt_len <= c + 1 < length``).
    """
    ids = batch["input_ids"]
    cols = torch.arange(1, ids.shape[1], device=ids.device)  # (S - 1,) label columns
    mask = (cols >= batch["prompt_len"].unsqueeze(1)) & (cols < batch["length"].unsqueeze(1))
    return ids[:, 1:], mask


def leading_correct(correct: Sequence[bool], limit: int) -> list[int]:
    """``lead[c]``: how many predictions in a row are right from column c on (``correct[c]``,
    ``correct[c + 1]``, ...), capped at ``limit``; one extra 0 at the end."""
    lead = [0] * (len(correct) + 1)
    for c in range(len(correct) - 1, -1, -1):
        lead[c] = min(lead[c + 1] + 1, limit) if correct[c] else 0
    return lead


class AssistantLM(L.LightningModule):
    """Next-token training of a causal LM on response tokens; validation CE, accuracy and greedy τ."""

    def __init__(self, model, optimizer, scheduler=None, num_draft_tokens: int = 15):
        super().__init__()
        self.model, self.make_optimizer, self.make_scheduler = model, optimizer, scheduler
        self.num_draft_tokens = num_draft_tokens

    def _logits(self, batch) -> torch.Tensor:  # (B, S - 1, V)
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]

    def training_step(self, batch, batch_idx):
        labels, mask = response_labels(batch)
        loss = torch.nn.functional.cross_entropy(self._logits(batch)[mask].float(), labels[mask])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val = {"nll": 0.0, "correct": 0, "count": 0, "kept": 0, "steps": 0}

    def validation_step(self, batch, batch_idx):
        labels, mask = response_labels(batch)
        logits = self._logits(batch).float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # (B, S - 1)
        correct = logits.argmax(-1) == labels  # (B, S - 1)
        self._val["nll"] += float(nll[mask].sum())
        self._val["correct"] += int(correct[mask].sum())
        self._val["count"] += int(mask.sum())
        for row, prompt_len, length in zip(correct.tolist(), batch["prompt_len"].tolist(), batch["length"].tolist()):
            _, kept = greedy_walk(leading_correct(row[: length - 1], self.num_draft_tokens), prompt_len, length)
            self._val["kept"] += sum(kept)
            self._val["steps"] += len(kept)

    def on_validation_epoch_end(self) -> None:
        v = self._val
        self.log("val/ce", v["nll"] / max(v["count"], 1), prog_bar=True)
        self.log("val/acc", v["correct"] / max(v["count"], 1))
        self.log("val/tau_greedy", v["kept"] / max(v["steps"], 1))

    def configure_optimizers(self):
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        optimizer = self.make_optimizer([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.make_scheduler(optimizer), "interval": "step"}}


# ----------------------------------------------------------------------------- export


def export_assistant(model, target_path: str, out_dir: Path, dtype: str, meta: dict) -> Path:
    """``save_pretrained`` (safetensors in ``dtype``) with the target's tokenizer, training.json, README.md and the
    record of its weights and config (:func:`drafters.integrity.write_assistant_record`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = type(model)(model.config).to(getattr(torch, dtype))
    copy.load_state_dict(model.state_dict())
    copy.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(target_path).save_pretrained(out_dir)
    (out_dir / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out_dir / "README.md").write_text(model_card(meta))
    write_assistant_record(out_dir)  # the weights' sha256 and config.json, checked when it is evaluated
    return out_dir


def model_card(meta: dict) -> str:
    """README.md of an exported assistant, from its training record."""
    val, first = meta["val"], meta.get("val_at_start") or {}

    def fmt(metrics: dict, key: str) -> str:
        return f"{metrics[key]:.3f}" if metrics.get(key) is not None else "—"

    return f"""# blockdraft AR assistant (`ar_assistant` baseline)

A small autoregressive draft model for the target `{meta['target_path_name']}`, distilled from it on
the same regenerated answers the block drafters train on. It is the `ar_assistant` row of every
report: `python -m experiments.evaluate drafter=ar_assistant` drafts K = 15 tokens per step with it
through `verify.AssistantDrafter` (K forwards per step, exact verification).

## Training

- command: `{meta['command']}`
- architecture: LlamaForCausalLM, {meta['parameters'] / 1e6:.2f}M parameters, {json.dumps(meta['model'])};
  vocabulary and tokenizer of the target ({meta['vocab_size']} tokens); {meta['init']}
- data: `{meta['data_dir']}` ({meta['train_rows']} training / {meta['val_rows']} validation rows, the
  drafters' split by id hash): {json.dumps(meta['data_generation'])}
- loss: next-token cross-entropy on the response tokens only (the prompt is context)
- steps: {meta['steps']}, batch {meta['batch_size']} sequences (≤ {meta['max_length']} tokens),
  {meta['train_response_tokens_seen']:,} response tokens seen
- optimiser: {json.dumps(meta['optimizer'])}; schedule: {json.dumps(meta['scheduler'])}
- wall time: {meta['wall_time_s'] / 60:.1f} min of training on {meta['machine']}, {meta['threads']} thread(s),
  torch {meta['torch']}{_totals_line(meta)}
- weights: {meta['export_dtype']} safetensors

## Validation (held-out rows, response tokens)

| metric | at step 0 | after training |
|---|---|---|
| cross-entropy (nats/token) | {fmt(first, 'val/ce')} | {fmt(val, 'val/ce')} |
| top-1 accuracy | {fmt(first, 'val/acc')} | {fmt(val, 'val/acc')} |
| greedy τ, K = {meta['num_draft_tokens']} (block-by-block replay) | {fmt(first, 'val/tau_greedy')} | {fmt(val, 'val/tau_greedy')} |

Step 0 is the initialisation ({meta['init']}). On greedy data (`data=regen_greedy`) the replayed τ is
what `verify.speculative_generate` measures at temperature 0 on these answers.
"""


def with_totals(meta: dict, before: dict) -> dict:
    """``before`` (:func:`continued_record`) with this run's steps and time added to its totals."""
    return {"init": before["init"], "total_steps": before["total_steps"] + meta["steps"],
            "total_wall_time_s": round(before["total_wall_time_s"] + meta["wall_time_s"], 1)}


def _totals_line(meta: dict) -> str:
    if "total_steps" not in meta:
        return ""
    return (f"\n- in all, with the runs it continued: {meta['total_steps']:,} steps, "
            f"{meta['total_wall_time_s'] / 3600:.2f} h of training")


# ----------------------------------------------------------------------------- the training run

# What a resumed assistant training must share with the run it continues (experiments.pipeline.run_settings).
# (Not the initialisation: a resume takes its weights from the checkpoint.)
RESUME_KEYS = ("target", "model", "data", "optimizer", "scheduler", "seed", "train.gradient_clip_val")


def _keep_earlier_csv(logger, step: int) -> None:
    """Lightning's CSVLogger deletes an existing metrics.csv: keep a resumed run's earlier rows beside it."""
    if isinstance(logger, L.pytorch.loggers.CSVLogger):
        current = Path(logger.log_dir) / "metrics.csv"
        if current.is_file():
            current.rename(current.with_name(f"metrics.before-step-{step}.csv"))


def train_assistant(cfg: DictConfig, overrides: Sequence[str] = ()) -> Path:
    """Train (or resume) the assistant of ``cfg`` and export it; returns the export directory.

    One process owns the run dir at a time (:mod:`drafters.locks`, as ``experiments.train``): a second
    job into it refuses, naming the owner, before anything is written.
    """
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with locks.hold(run_dir, "run folder"):
        return _train_assistant(cfg, run_dir, overrides)


def _train_assistant(cfg: DictConfig, run_dir: Path, overrides: Sequence[str]) -> Path:
    L.seed_everything(cfg.seed, workers=True)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    data_dir = Path(cfg.data.data_dir).expanduser()
    if not read_meta(data_dir).get("complete"):
        raise FileNotFoundError(f"no complete regenerated data at {data_dir}: run `python -m experiments.regenerate` "
                                "with the same target and data overrides first")
    target, tokenizer = load_target(cfg.target.path, "float32", "cpu", cfg.target.trust_remote_code)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    datamodule = hydra.utils.instantiate(cfg.data.datamodule, pad_token_id=pad)
    datamodule.setup("fit")
    model = build_assistant(target, OmegaConf.to_container(cfg.model, resolve=True), cfg.init_from_target)
    before = continue_from(model, cfg.init_from) if cfg.get("init_from") else None
    del target
    module = AssistantLM(model, hydra.utils.instantiate(cfg.optimizer),
                         hydra.utils.instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
                         num_draft_tokens=cfg.num_draft_tokens)

    last = run_dir / "checkpoints" / "last.ckpt"
    # checked before anything changes: a damaged file is named (drafters.storage.DamagedFileError)
    first_step = int(storage.read_checkpoint(last, ("global_step",))["global_step"]) if last.is_file() else None
    if first_step is not None:
        run_settings.check(run_dir, cfg, RESUME_KEYS, arithmetic(cfg))  # the same model, data and optimiser
    run_settings.write(run_dir, cfg, RESUME_KEYS, arithmetic(cfg), resumed=first_step is not None)
    logger = hydra.utils.instantiate(cfg.logger)
    if first_step is not None:
        _keep_earlier_csv(logger, first_step)
    trainer = build_trainer(cfg, logger)  # conf/trainer/ + train_assistant.yaml's trainer:, conf/callbacks/
    start_file = run_dir / "val_at_start.json"
    if first_step is None:  # a fresh run: measure the initialisation
        trainer.validate(module, datamodule=datamodule, verbose=False)
        start_file.write_text(json.dumps({k: float(v) for k, v in trainer.callback_metrics.items()}, indent=1))
    safe = {"weights_only": True} if first_step is not None and "weights_only" in \
        inspect.signature(trainer.fit).parameters else {}  # Lightning loads it the safe way, as checked above
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if first_step is not None else None, **safe)
    trainer.save_checkpoint(str(last))
    if trainer.global_step % cfg.train.val_every != 0 or trainer.global_step == (first_step or 0):
        trainer.validate(module, datamodule=datamodule, verbose=False)
    logger.save()

    meta = training_record(cfg, module, trainer, datamodule, overrides)
    meta |= with_totals(meta, before) if before else {"init": INIT_TEXT[cfg.init_from_target]}
    meta["resumed_from_step"] = first_step
    meta["val_at_start"] = storage.read_json(start_file, "validation record") if start_file.is_file() else None
    export_dir = Path(cfg.export_dir).expanduser() if cfg.export_dir else run_dir / "export"
    export_assistant(model, str(cfg.target.path), export_dir, cfg.export_dtype, meta)
    storage.write_json_atomic(run_dir / "train_summary.json", meta)  # its presence marks the training finished
    print(f"[train_assistant] {trainer.global_step} steps in {meta['wall_time_s']} s; "
          f"val {json.dumps(meta['val'])}; exported to {export_dir}", flush=True)
    return export_dir


def training_record(cfg: DictConfig, module: AssistantLM, trainer: L.Trainer, datamodule,
                    overrides: Sequence[str]) -> dict:
    """What training.json and the model card say: command, model, data, budget, time, validation."""
    def plain(node) -> dict:  # a Hydra _target_ node without its underscored keys
        return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}

    model = module.model
    return {
        "command": " ".join(["python -m experiments.train_assistant", *overrides]),
        "target_path_name": Path(str(cfg.target.path)).name,
        "target_path": cache_path(portable_path(cfg.target.path)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "num_draft_tokens": cfg.num_draft_tokens,
        "data_dir": cache_path(datamodule.data_dir),  # no machine paths in the card
        "data_generation": OmegaConf.to_container(cfg.data.generation, resolve=True),
        "train_rows": len(datamodule.train_set),
        "val_rows": len(datamodule.val_set),
        "batch_size": datamodule.batch_size,
        "max_length": datamodule.max_length,
        "steps": trainer.global_step,
        "train_response_tokens_seen": _response_tokens_seen(datamodule, trainer.global_step),
        "optimizer": plain(cfg.optimizer),
        "scheduler": plain(cfg.scheduler) if cfg.get("scheduler") else None,
        "wall_time_s": train_seconds(trainer),  # the training time, resumes added up
        "machine": f"{os.cpu_count()} CPU cores, no GPU" if not torch.cuda.is_available() else "GPU",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "export_dtype": cfg.export_dtype,
        "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
    }


def _response_tokens_seen(datamodule, steps: int) -> int:
    """Response tokens in ``steps`` training batches, from the training rows' mean response length."""
    rows = datamodule.train_set
    per_row = [len(rows[i]["input_ids"]) - rows[i]["prompt_len"] for i in range(len(rows))]
    return int(sum(per_row) / max(len(per_row), 1) * datamodule.batch_size * steps)
