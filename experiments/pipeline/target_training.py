"""Training the embedded tiny target LM (``python -m experiments.train_target target=tiny``).

The recipe lives in ``conf/target/tiny.yaml`` under ``recipe``: corpus mixture, tokenizer,
Llama-style architecture and optimisation. Stages, each cached in the (fixed) run directory so a
killed run resumes where it stopped:

1. tokenizer: byte-level BPE on the corpus (``tokenizer/``);
2. token streams: every source rendered (chat documents through the chat template) and tokenized
   into flat ``uint16`` arrays, train and held-out validation (``tokens/``);
3. training: a Lightning module samples windows from the sources by the mixture weights, logs
   ``train/loss`` and per-domain ``val/loss_<domain>``; ``checkpoints/last.ckpt`` resumes it;
4. export: Hugging Face format (safetensors in ``export_dtype``, config, generation config,
   tokenizer with chat template) to ``export_dir``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from drafters.training.datamodule import ResumableLoader
from drafters.training.optim import warmup_cosine
from experiments.data import corpora
from experiments.data.tokenizer import train_tokenizer
from experiments.pipeline.trainer import build_trainer, keep_csv_history, merge_csv_history

# ----------------------------------------------------------------------------- data


def build_token_streams(recipe, tokenizer, out_dir: Path) -> dict:
    """Tokenize every source into ``<source>.{train,val}.npy``; returns the stream index."""
    index_path = out_dir / "index.json"
    if index_path.exists():
        return json.loads(index_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, weight in recipe.mixture.items():
        if weight <= 0:
            continue
        kwargs = dict(recipe.sources.get(name) or {})
        docs = corpora.load_source(name, **kwargs)
        split = {"train": [], "val": []}
        for doc in tqdm(docs, desc=f"tokenize {name}", mininterval=5):
            ids = tokenizer(corpora.render_document(doc, tokenizer), add_special_tokens=False)["input_ids"]
            split["val" if corpora.is_validation(doc.id, recipe.holdout_fraction) else "train"].append(ids)
        for part, seqs in split.items():
            arr = np.fromiter((t for s in seqs for t in s), dtype=np.uint16)
            np.save(out_dir / f"{name}.{part}.npy", arr)
            index.setdefault(name, {})[part] = int(arr.size)
    index_path.write_text(json.dumps(index, indent=1))
    return index


class MixtureWindows(Dataset):
    """Random windows of ``seq_len + 1`` tokens; item i picks a source by the mixture weights.

    Deterministic in (seed, i), so resuming at step s continues with fresh items (``start``).
    """

    def __init__(self, streams: dict[str, np.ndarray], weights: dict[str, float], seq_len: int, seed: int):
        self.names = [n for n in weights if n in streams and streams[n].size > seq_len + 1]
        w = np.array([weights[n] for n in self.names], dtype=np.float64)
        self.probs = w / w.sum()
        self.streams, self.seq_len, self.seed, self.start = streams, seq_len, seed, 0

    def __len__(self):
        return 1 << 40

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, self.start + i))
        name = self.names[rng.choice(len(self.names), p=self.probs)]
        stream = self.streams[name]
        off = rng.integers(0, stream.size - self.seq_len - 1)
        return torch.from_numpy(stream[off : off + self.seq_len + 1].astype(np.int64))


class HeldOut(Dataset):
    """Non-overlapping windows of each source's validation stream: (source index, tokens)."""

    def __init__(self, streams: dict[str, np.ndarray], seq_len: int, max_windows: int):
        self.items = []
        for si, (name, stream) in enumerate(streams.items()):
            n = min(max_windows, (stream.size - 1) // seq_len)
            self.items += [(si, stream[j * seq_len : j * seq_len + seq_len + 1]) for j in range(n)]
        self.names = list(streams)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        si, arr = self.items[i]
        return si, torch.from_numpy(arr.astype(np.int64))


# ----------------------------------------------------------------------------- model


class TargetLM(L.LightningModule):
    """Next-token training of a Hugging Face causal LM; logs per-domain held-out loss."""

    def __init__(self, model, optim: DictConfig, val_names: list[str], train_set: MixtureWindows):
        super().__init__()
        self.model, self.optim, self.val_names, self.train_set = model, optim, val_names, train_set
        self.val_sums = None
        self.train_seconds, self._t0 = 0.0, None  # cumulative over resumed runs

    def on_train_start(self):
        self.train_set.start = self.global_step * self.trainer.train_dataloader.batch_size
        self._t0 = time.time()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["train_seconds"] = self.train_seconds + (time.time() - self._t0 if self._t0 else 0.0)

    def on_load_checkpoint(self, checkpoint):
        self.train_seconds = checkpoint.get("train_seconds", 0.0)

    def training_step(self, batch, _):
        logits = self.model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def on_validation_epoch_start(self):
        self.val_sums = torch.zeros(len(self.val_names), 2)

    def validation_step(self, batch, _):
        src, tokens = batch
        logits = self.model(input_ids=tokens[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2).float(), tokens[:, 1:], reduction="none"
        ).mean(1)  # (B,)
        self.val_sums.index_add_(0, src.cpu(), torch.stack([nll.cpu(), torch.ones_like(nll.cpu())], 1))

    def on_validation_epoch_end(self):
        sums = self.val_sums
        for i, name in enumerate(self.val_names):
            if sums[i, 1] > 0:
                self.log(f"val/loss_{name}", sums[i, 0] / sums[i, 1])
        self.log("val/loss", sums[:, 0].sum() / sums[:, 1].sum().clamp(min=1), prog_bar=True)

    def configure_optimizers(self):
        o = self.optim
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=tuple(o.betas),
            foreach=True,
        )
        sched = warmup_cosine(opt, o.warmup_steps, o.max_steps, o.min_lr_ratio)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def build_model(recipe, tokenizer):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **OmegaConf.to_container(recipe.model),
    )
    config.mask_token_id = tokenizer.mask_token_id
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=128,
    )
    return model


def export(model, tokenizer, export_dir: Path, dtype: str, meta: dict) -> None:
    """Save in Hugging Face format (safetensors) with the tokenizer and a training record."""
    export_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(export_dir, safe_serialization=True)
    tokenizer.save_pretrained(export_dir)
    (export_dir / "training.json").write_text(json.dumps(meta, indent=1))
    model.float()


# ----------------------------------------------------------------------------- the training run


def _tokenizer(recipe, tok_dir: Path):
    """The recipe's byte-level BPE, trained on the corpus mixture once and saved to ``tok_dir``."""
    if (tok_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(tok_dir)
    texts = []
    for name, weight in recipe.mixture.items():
        if weight > 0:
            docs = corpora.load_source(name, **dict(recipe.sources.get(name) or {}))
            texts += [d.text or "\n".join(m["content"] for m in d.messages) for d in docs]
    tokenizer = train_tokenizer(texts, recipe.vocab_size)
    tokenizer.model_max_length = recipe.model.max_position_embeddings
    tokenizer.save_pretrained(tok_dir)
    return tokenizer


def _streams(index: dict, tokens_dir: Path, part: str) -> dict[str, np.ndarray]:
    """The ``part`` (train or val) token stream of every source that has one, memory-mapped."""
    return {n: np.load(tokens_dir / f"{n}.{part}.npy", mmap_mode="r") for n in index if index[n][part] > 0}


def _fit(cfg: DictConfig, module: TargetLM, train_set: MixtureWindows, val_set: HeldOut, run_dir: Path) -> L.Trainer:
    """Fit ``module`` (resuming from ``checkpoints/last.ckpt``), keeping an earlier run's CSV rows."""
    recipe = cfg.target.recipe
    logger = hydra.utils.instantiate(cfg.logger)
    last = run_dir / "checkpoints" / "last.ckpt"
    csv_dir = keep_csv_history(logger) if last.exists() else None  # a resumed run keeps its earlier rows
    trainer = build_trainer(cfg, logger)
    trainer.fit(
        module,
        # resumable: a run resumed mid-epoch goes on with the batches it had not seen (drafters.training.resume)
        train_dataloaders=ResumableLoader(train_set, batch_size=recipe.batch_size, shuffle=False),
        val_dataloaders=DataLoader(val_set, batch_size=recipe.batch_size),
        ckpt_path=str(last) if last.exists() else None,
    )
    if csv_dir is not None:
        logger.save()
        merge_csv_history(csv_dir)
    return trainer


def _training_record(cfg: DictConfig, overrides, module: TargetLM, trainer: L.Trainer, index: dict,
                     times: dict, n_params: int) -> dict:
    """training.json of the exported target: command, size, budget, data, time and validation losses."""
    recipe = cfg.target.recipe
    return {
        "command": " ".join(["python -m experiments.train_target", *(overrides or [])]),
        "parameters": n_params,
        "steps": trainer.global_step,
        "train_tokens": trainer.global_step * recipe.batch_size * recipe.seq_len,
        "tokens_per_source": index,
        "mixture": OmegaConf.to_container(recipe.mixture),
        "recipe": OmegaConf.to_container(recipe),
        "stage_seconds_this_run": times,
        "wall_time_s": module.train_seconds + (time.time() - module._t0 if module._t0 else 0.0),
        "machine": f"{os.cpu_count()} CPU cores, no GPU" if not torch.cuda.is_available() else "GPU",
        "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def train_target(cfg: DictConfig, overrides: list[str] | None = None) -> Path:
    """Train (or resume) the target of ``cfg.target.recipe`` and export it; returns the export directory."""
    recipe = cfg.target.recipe
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(recipe.seed, workers=True)
    torch.set_num_threads(cfg.num_threads or torch.get_num_threads())
    times = {}
    t = time.time()
    tokenizer = _tokenizer(recipe, run_dir / "tokenizer")
    times["tokenizer_s"] = time.time() - t
    t = time.time()
    index = build_token_streams(recipe, tokenizer, run_dir / "tokens")
    train_streams, val_streams = _streams(index, run_dir / "tokens", "train"), _streams(index, run_dir / "tokens", "val")
    times["tokenize_s"] = time.time() - t
    print(f"[train_target] tokens per source: {json.dumps(index)}", flush=True)

    train_set = MixtureWindows(train_streams, dict(recipe.mixture), recipe.seq_len, recipe.seed)
    val_set = HeldOut(val_streams, recipe.seq_len, recipe.val_windows_per_source)
    model = build_model(recipe, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train_target] model: {n_params / 1e6:.2f}M parameters", flush=True)
    if recipe.compile:
        model.compile()
    module = TargetLM(model, recipe.optim, val_set.names, train_set)
    t = time.time()
    trainer = _fit(cfg, module, train_set, val_set, run_dir)
    times["train_s"] = time.time() - t
    meta = _training_record(cfg, overrides, module, trainer, index, times, n_params)
    export_dir = Path(cfg.export_dir) if cfg.export_dir else run_dir / "export"
    export(model, tokenizer, export_dir, recipe.export_dtype, meta)
    print(f"[train_target] exported to {export_dir}; stage times {times}", flush=True)
    return export_dir
