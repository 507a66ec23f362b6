"""A target's quality and its model card (``python -m experiments.target_quality``).

Two measurements (defaults: the embedded tiny target, all three suites):

* held-out loss per domain on the validation documents of the local corpora
  (``experiments.data.corpora.is_validation``), the same split the recipe held out;
* on each task suite, answers of ``max_new_tokens`` tokens at temperature 0 and 1: the share of
  repeated 4-grams (positions whose 4-gram already occurred earlier in the same answer) and the
  distinct-2 ratio (unique bigrams / bigrams), averaged over prompts. Greedy loops make accepted
  length meaningless, so these are reported side by side with the τ numbers.

Writes ``quality.json`` to the run dir; with ``write_card=true`` also to the target folder with a
regenerated ``README.md`` model card (training record from ``training.json`` + these numbers).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from experiments.data import corpora
from experiments.data.prompts import encode_prompt, left_pad
from experiments.data.suites import load_suites
from experiments.data.target import load_target
from experiments.pipeline.paths import portable_path
from verify import target_generate


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Share of n-gram positions whose n-gram already occurred earlier in ``tokens``."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def distinct_n(tokens: list[int], n: int = 2) -> float:
    """Unique n-grams / n-grams (1.0 = no n-gram repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def heldout_loss(model, tokenizer, sources, seq_len: int, max_windows: int, holdout_fraction: float) -> dict:
    """Mean next-token loss per domain on held-out documents, in windows of ``seq_len``."""
    per_domain: dict[str, list[float]] = {}
    for name in sources:
        docs = [d for d in corpora.load_source(name, **dict(sources[name] or {}))
                if corpora.is_validation(d.id, holdout_fraction)]
        ids = [t for d in docs for t in tokenizer(corpora.render_document(d, tokenizer),
                                                    add_special_tokens=False)["input_ids"]]
        windows = [ids[i : i + seq_len + 1] for i in range(0, len(ids) - seq_len, seq_len)][:max_windows]
        for w in windows:
            x = torch.tensor([w])
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item()
            per_domain.setdefault(corpora.DOMAIN_OF[name], []).append(loss)
    return {k: sum(v) / len(v) for k, v in per_domain.items()}


def answer_stats(model, tokenizer, prompts, temperature, max_new_tokens, max_prompt_tokens, batch_size, seed):
    """Repetition statistics of first-turn answers to ``prompts``."""
    gen = torch.Generator().manual_seed(seed)
    rep, dist, lengths, examples = [], [], [], []
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"answers T={temperature}", leave=False):
        batch = [encode_prompt(tokenizer, p.turns[:1], [])[-max_prompt_tokens:] for p in prompts[i : i + batch_size]]
        ids, mask = left_pad(batch, tokenizer.pad_token_id)
        out = target_generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              temperature=temperature, eos_token_id=tokenizer.eos_token_id, generator=gen)
        for toks in out.new_tokens:
            rep.append(repeated_ngram_share(toks, 4))
            dist.append(distinct_n(toks, 2))
            lengths.append(len(toks))
            if len(examples) < 2:
                examples.append(tokenizer.decode(toks))
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    return {"repeated_4gram_share": mean(rep), "distinct_2": mean(dist), "mean_answer_tokens": mean(lengths),
            "prompts": len(prompts), "examples": examples}


def write_card(target_dir: Path, quality: dict) -> None:
    """(Re)write ``README.md`` in the target folder from ``training.json`` and ``quality``."""
    train = json.loads((target_dir / "training.json").read_text()) if (target_dir / "training.json").exists() else {}
    rec = train.get("recipe", {})
    lines = [
        "# blockdraft tiny target", "",
        "A small Llama-style causal LM trained by blockdraft's own recipe on local corpora, shipped as the",
        "default target (`target=tiny`) so the toolkit runs with no model hub. It is a toy: its numbers",
        "say how the toolkit behaves, not how a real LM would.", "",
        "## Training", "",
        f"- command: `{train.get('command', '?')}`",
        f"- parameters: {train.get('parameters', 0) / 1e6:.2f}M; architecture: {json.dumps(rec.get('model', {}))}",
        (f"- vocabulary: {rec.get('vocab_size')} (byte-level BPE trained on the same corpus; chat template with "
        "`<|user|>`/`<|assistant|>` turns, `<|mask|>` reserved for drafters)"),
        (f"- steps: {train.get('steps')}, batch {rec.get('batch_size')} x {rec.get('seq_len')} tokens = "
        f"{train.get('train_tokens', 0) / 1e6:.1f}M training tokens"),
        f"- optimiser: {json.dumps(rec.get('optim', {}))}",
        f"- mixture (sampling weights): {json.dumps(rec.get('mixture', {}))}",
        f"- tokens per source (train/val): {json.dumps(train.get('tokens_per_source', {}))}",
        f"- wall time: {train.get('wall_time_s', 0) / 60:.0f} min on {train.get('machine', '2 CPU cores, no GPU')}",
        "- corpora: Python standard library sources (PSF), Debian python3.11-doc reST (PSF), Debian fortunes,",
        "  chatterbot-corpus English dialogues (BSD-3-Clause), reasoning-gym gsm_symbolic problems with worked",
        "  solutions (Apache-2.0; seeds >= 10000, disjoint from the evaluation suite's)", "",
        "## Measured quality (`python -m experiments.target_quality write_card=true`)", "",
        "Held-out loss per domain (nats/token): " + ", ".join(
            f"{k} {v:.3f}" for k, v in quality.get("heldout_loss", {}).items()), "",
        "| suite | T | prompts | repeated 4-gram share | distinct-2 | mean answer tokens |", "|---|---|---|---|---|---|",
    ]
    for suite, by_t in quality.get("answers", {}).items():
        for t, s in by_t.items():
            lines.append(f"| {suite} | {t} | {s['prompts']} | {s['repeated_4gram_share']:.3f} | {s['distinct_2']:.3f} | "
                         f"{s['mean_answer_tokens']:.1f} |")
    lines += ["", (f"First-turn answers of up to {quality.get('max_new_tokens')} tokens (the first `prompts` of each "
              "suite); a repeated share near 0 means no loops. Greedy (T=0) answers to code prompts still loop "
              "often: treat T=0 code numbers with care and read them beside T=1."), ""]
    (target_dir / "README.md").write_text("\n".join(lines))


def measure_quality(cfg: DictConfig) -> dict:
    """Held-out loss and answer repetition of ``cfg.target`` (``conf/target_quality.yaml``); writes
    quality.json to the run dir (and, with ``write_card``, quality.json and README.md to the target)."""
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_target(cfg.target.path, cfg.target.dtype)
    model.float()
    recipe = cfg.target.get("recipe")
    t0 = time.time()
    names = cfg.heldout_sources or ([k for k, w in recipe.mixture.items() if w > 0] if recipe else [])
    sources = {k: (recipe.sources.get(k) if recipe else None) for k in names}
    quality = {
        "target": portable_path(cfg.target.path),
        "max_new_tokens": cfg.max_new_tokens,
        "heldout_loss": heldout_loss(model, tokenizer, sources, cfg.seq_len, cfg.max_windows,
                                     recipe.holdout_fraction if recipe else 0.02),
        "answers": {},
    }
    suites = load_suites(cfg.suite)
    for name, prompts in suites.items():
        quality["answers"][name] = {
            str(t): answer_stats(model, tokenizer, prompts, t, cfg.max_new_tokens, cfg.max_prompt_tokens,
                                 cfg.batch_size, cfg.seed)
            for t in cfg.temperatures
        }
    quality["seconds"] = time.time() - t0
    quality["perplexity"] = {k: math.exp(v) for k, v in quality["heldout_loss"].items()}
    out = Path(cfg.paths.run_dir) / "quality.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(quality, indent=1))
    if cfg.write_card:
        target_dir = Path(cfg.target.path)
        (target_dir / "quality.json").write_text(json.dumps(quality, indent=1))
        write_card(target_dir, quality)
    print(json.dumps({k: v for k, v in quality.items() if k != "answers"}, indent=1))
    for name, by_t in quality["answers"].items():
        for t, s in by_t.items():
            print(f"{name:14s} T={t}: repeated-4gram {s['repeated_4gram_share']:.3f} distinct-2 {s['distinct_2']:.3f}")
    return quality

