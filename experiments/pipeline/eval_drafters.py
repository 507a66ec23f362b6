"""The drafters ``experiments.evaluate`` can measure, built from ``conf/eval/drafter/<choice>.yaml``.

Each config names one builder here as its ``_target_``; ``experiments.evaluate`` calls it with the
loaded target (``builder(target=target, **config)``) and gets an :class:`EvalDrafter`: the drafter,
ready on the target's device and dtype, and the ``drafter`` section of results.json (``name``: the
report's row, ``kind``, ``path``, ``config``, ``num_parameters``, ``training_run``, ``description``; block
drafters also ``weights_sha256`` and ``edited_settings``).

* ``block`` (``drafter.path=<dir>``): a block drafter saved by ``experiments.train``;
* ``prompt_lookup``: n-gram lookup in each row's own tokens (:class:`verify.PromptLookupDrafter`);
* ``ar_assistant``: a small Hugging Face causal LM drafting autoregressively
  (:class:`verify.AssistantDrafter`), by default the one shipped in ``experiments/assets/ar_assistant``;
* ``corpus_lookup`` (``drafter.data_dir=<regenerated data folder>``): retrieval drafting from the n-grams of
  the target's regenerated answers (:class:`verify.CorpusLookupDrafter`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import conf
from drafters import factory
from drafters.checks import TargetMismatchError
from drafters.factory import with_variant, without_variant
from drafters.integrity import ChangedDrafterError, check_assistant_record
from drafters.model import DFlashDrafter
from drafters.policy import DraftingPolicy, PolicyDrafter
from drafters.storage import DamagedFileError, check_model_weights, file_digest
from drafters.training.datamodule import load_regenerated
from drafters.training.vocab import frequent_tokens
from drafters.tree import TreeDrafter, TreePolicy
from drafters.variants.hint_lookup import HintStore
from experiments.pipeline.recorded_answers import RECORD, load_answers
from experiments.pipeline.records import drafter_training_run
from verify import AssistantDrafter, CorpusLookupDrafter, NgramStore, PromptLookupDrafter
from verify.hf import output_vocab_size

CHOICES_DIR = Path(conf.__file__).parent / "eval" / "drafter"  # the ``drafter=<choice>`` group of experiments.evaluate


def drafter_config(choice: str) -> dict:
    """``conf/eval/drafter/<choice>.yaml``: what ``experiments.evaluate drafter=<choice>`` composes, its
    interpolations left to the config it joins (``ar_assistant``'s path reads that config's ``target.name``)."""
    path = CHOICES_DIR / f"{choice}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CHOICES_DIR.glob("*.yaml"))
        raise ValueError(f"drafter {choice!r}: no conf/eval/drafter/{choice}.yaml (choose one of {known})")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


@dataclass
class EvalDrafter:
    """A drafter to evaluate and its description for results.json."""

    drafter: object  # a verify.Drafter
    info: dict


def _target_path(target) -> str:
    return str(getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", ""))


def _existing_dir(path: str | Path, what: str, key: str = "drafter.path") -> Path:
    directory = Path(str(path)).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{key}={path}: no such directory; give {what}")
    return directory.resolve()


def block_drafter(target, path: str, name: str | None = None, confidence_threshold: float | None = None,
                  follow_hint_after: int | None = None, follow_hint_min_ngram: int = 1,
                  refine_passes: int | None = None, max_draft_tokens: int | None = None,
                  hint_data_dir: str | None = None, share_target_cache: bool = True,
                  own_draft_tokens: int | None = None, min_drafting_rows: int | None = None,
                  draft_vocab_size: int | None = None, draft_vocab_from: str | None = None,
                  allow_other_target: bool = False, allow_edited_settings: bool = False) -> EvalDrafter:
    """A block drafter saved by ``experiments.train`` (``<run dir>/drafter``), attached to ``target`` and
    drafting under the decoding policy of the other arguments (:class:`drafters.policy.DraftingPolicy`, which
    documents and checks them; all exact).

    ``name`` = None lets the report name the row by the loss of the training run that saved it.
    ``refine_passes``: the drafter's refinement passes at decoding time (the ``refine`` variant's ``passes``; 0
    drops the variant; None = as trained). ``hint_data_dir``: drafters with the ``store_hints`` variant read their
    hints from every answer of this regenerated data folder instead of the saved store (None).
    ``draft_vocab_size``, ``draft_vocab_from``: draft from a candidate vocabulary (:func:`candidate_vocab`; exact).
    ``allow_other_target``: accept a target of other weights than it was trained for (refused by default).
    ``allow_edited_settings``: accept a ``config.json`` whose settings were edited after the drafter was saved
    (refused by default); the info's ``edited_settings`` then says which, from what to what.
    """
    directory, drafter = _load_block_drafter(target, path, allow_other_target, allow_edited_settings)
    edits = factory.edited_settings(directory, drafter) or None  # before the variants of the settings below
    if refine_passes is not None:
        if refine_passes < 0:
            raise ValueError(f"drafter.refine_passes={refine_passes}: must be >= 0 or null (as trained)")
        drafter = with_variant(drafter, "refine", passes=refine_passes) if refine_passes else without_variant(drafter, "refine")
    if hint_data_dir is not None:
        _replace_hint_store(drafter, hint_data_dir, path)
    policy = DraftingPolicy(max_draft_tokens=max_draft_tokens, own_draft_tokens=own_draft_tokens,
                            confidence_threshold=confidence_threshold, follow_hint_after=follow_hint_after,
                            follow_hint_min_ngram=follow_hint_min_ngram, min_drafting_rows=min_drafting_rows,
                            share_target_cache=share_target_cache)
    vocab = None if draft_vocab_size is None else candidate_vocab(target, draft_vocab_size, draft_vocab_from, directory)
    try:
        wrapped = PolicyDrafter(drafter, policy, vocab)
    except ValueError as e:
        raise ValueError(f"{e} [drafter.path={path}]") from e
    store = getattr(drafter, "hint_store", None)
    settings = {"confidence_threshold": confidence_threshold, "follow_hint_after": follow_hint_after,
                "follow_hint_min_ngram": follow_hint_min_ngram if follow_hint_after is not None else None,
                "max_draft_tokens": max_draft_tokens, "own_draft_tokens": own_draft_tokens, "hint_data_dir": hint_data_dir,
                "min_drafting_rows": min_drafting_rows, "allow_other_target": True if allow_other_target else None,
                "allow_edited_settings": True if allow_edited_settings else None,
                "share_target_cache": None if share_target_cache else False,
                "hint_store_answers": len(store.rows) if store is not None else None,
                "draft_vocab_size": len(vocab) if vocab is not None else None,
                "draft_vocab_from": (draft_vocab_from or "the training data") if vocab is not None else None}
    config = (drafter.config.to_dict() | record_settings(drafter.variants)
              | {k: v for k, v in settings.items() if v is not None})
    return EvalDrafter(wrapped, {
        "name": name,
        "kind": "block",
        "path": str(directory),
        "config": config,
        "weights_sha256": file_digest(sorted(directory.glob("*.safetensors"))),  # results resume only for these
        "edited_settings": edits,  # {key: {"recorded", "found"}}: config.json edited after saving, accepted
        "num_parameters": sum(p.numel() for p in drafter.parameters()),
        "training_run": drafter_training_run(directory),
        "description": None,
    })


def candidate_vocab(target, size: int, source: str | None, drafter_dir: Path) -> torch.Tensor:
    """(V',) the ``size`` most frequent response tokens of ``source`` plus the target's EOS: a regenerated data
    folder or a recorded-answers folder; None: the data folder of the training run that saved ``drafter_dir``.
    The drafter then drafts from these only: its LM head multiplies V' columns instead of the whole vocabulary
    (FR-Spec's lever, :meth:`drafters.policy.PolicyDrafter.head`)."""
    if size < 1:
        raise ValueError(f"drafter.draft_vocab_size={size}: must be >= 1 or null (the whole vocabulary)")
    if source is None:
        summary = drafter_dir.parent / "train_summary.json"
        if not summary.is_file():
            raise ValueError(f"drafter.draft_vocab_size={size} needs drafter.draft_vocab_from=<a regenerated data "
                             f"folder or recorded answers>: no training run beside {drafter_dir} names its data")
        source = json.loads(summary.read_text())["data_dir"]
    folder = _existing_dir(source, "a regenerated data folder or recorded answers", "drafter.draft_vocab_from")
    if (folder / RECORD).is_file():
        responses = load_answers(folder)[1].values()
    else:
        rows = load_regenerated(folder)
        responses = (ids[p:] for ids, p in zip(rows["input_ids"], rows["prompt_len"]))
    eos = [i for i in [getattr(target.config, "eos_token_id", None)] if isinstance(i, int)]
    return frequent_tokens(responses, size, output_vocab_size(target), always=eos)


def record_settings(variants) -> dict[str, Any]:
    """The variants ({name: Variant}) as the evaluation results record them, one field per option (the records'
    format since before variants, so that results compare by field across versions)."""
    lw, an, hi, st, rf = (variants.get(n) for n in ("layerwise", "anchor", "hints", "store_hints", "refine"))
    return {"layerwise_context": lw is not None, "shifted": bool(lw and lw.shifted), "causal_anchor": an is not None,
            "frozen_anchor": bool(an and an.frozen), "lookup_hints": hi is not None,
            "lookup_max_ngram": hi.max_ngram if hi else 3, "store_hints": st is not None,
            "store_num_folds": st.num_folds if st else 4, "refine_passes": rf.passes if rf else 0}


def _load_block_drafter(target, path: str, allow_other_target: bool = False,
                        allow_edited_settings: bool = False) -> tuple[Path, DFlashDrafter]:
    """``(directory, drafter)``: the saved drafter at ``path`` attached to ``target``, on its device and dtype."""
    directory = _existing_dir(path, "a drafter saved by experiments.train (e.g. runs/train/<name>/drafter)")
    try:
        drafter = factory.load(directory, target=target, allow_other_target=allow_other_target,
                               allow_edited_settings=allow_edited_settings)
    except (DamagedFileError, TargetMismatchError, ChangedDrafterError):
        raise  # names the damaged file, both targets' signatures, or the changed file and its record
    except ValueError as e:
        raise ValueError(f"drafter.path={path} does not fit target.path={_target_path(target)}: {e}") from e
    weight = next(target.parameters())
    return directory, drafter.to(device=weight.device, dtype=weight.dtype)  # from_pretrained: eval mode


def _replace_hint_store(drafter: DFlashDrafter, data_dir: str, path: str) -> None:
    """The drafter's hint store rebuilt from every answer of a regenerated data folder."""
    store = drafter.variants.get("store_hints")
    if store is None:
        raise ValueError(f"drafter.hint_data_dir={data_dir}: {path} was not trained with store_hints (+drafter/variant=store_hints)")
    data = load_regenerated(_existing_dir(data_dir, "a regenerated data folder (experiments.regenerate prints it)",
                                          "drafter.hint_data_dir"))
    drafter.hint_store = HintStore.from_data(data, store.num_folds)


def prompt_lookup(target, num_draft_tokens: int = 15, max_ngram: int = 3, min_ngram: int = 1,
                  name: str = "prompt_lookup") -> EvalDrafter:
    """Prompt lookup decoding over each row's own tokens: no model, no training."""
    drafter = PromptLookupDrafter(output_vocab_size(target), num_draft_tokens, max_ngram, min_ngram)
    config = {"num_draft_tokens": num_draft_tokens, "max_ngram": max_ngram, "min_ngram": min_ngram}
    return EvalDrafter(drafter, {
        "name": name,
        "kind": "prompt_lookup",
        "path": None,
        "config": config,
        "num_parameters": 0,
        "training_run": None,
        "description": f"baseline: copies what followed the latest earlier {max_ngram}..{min_ngram}-gram of the "
                       f"row's own tokens, K={num_draft_tokens}; no training",
    })


def ar_assistant(target, path: str, num_draft_tokens: int = 15, name: str = "ar_assistant") -> EvalDrafter:
    """A Hugging Face causal LM with the target's vocabulary drafting K tokens autoregressively.

    Its ``training.json`` (written by ``experiments.train_assistant``), when present, goes to
    results.json as ``training_run``.
    """
    directory = _existing_dir(path, "a Hugging Face causal LM folder (e.g. experiments/assets/ar_assistant)")
    check_model_weights(directory)  # safetensors, or pickled .bin files read as tensors only
    check_assistant_record(directory)  # its weights and config.json as recorded (a shipped one must have a record)
    weight = next(target.parameters())
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=weight.dtype).to(weight.device).eval()
    model.requires_grad_(False)
    ours, theirs = output_vocab_size(model), output_vocab_size(target)
    if ours != theirs:
        raise ValueError(f"drafter.path={path} does not fit target.path={_target_path(target)}: the assistant "
                         f"outputs {ours} tokens, the target {theirs}")
    record = directory / "training.json"
    config = model.config
    return EvalDrafter(AssistantDrafter(model, num_draft_tokens), {
        "name": name,
        "kind": "ar_assistant",
        "path": str(directory),
        "config": {"num_draft_tokens": num_draft_tokens, "model_type": config.model_type,
                   "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                   "vocab_size": ours},
        "weights_sha256": file_digest(sorted(directory.glob("*.safetensors"))),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "training_run": json.loads(record.read_text()) if record.is_file() else None,
        "description": f"baseline: a {config.num_hidden_layers}-layer causal LM distilled from the target, "
                       f"drafting K={num_draft_tokens} tokens one forward at a time",
    })



def corpus_lookup(target, data_dir: str, num_draft_tokens: int = 15, max_ngram: int = 4, min_ngram: int = 1,
                  prompt_min_ngram: int | None = 2, fallback: dict | None = None,
                  name: str = "corpus_lookup") -> EvalDrafter:
    """Retrieval drafting: an :class:`verify.NgramStore` of every answer in a regenerated data folder (each
    with the last ``max_ngram - 1`` tokens of its prompt, the assistant cue), after prompt lookup where the
    row's own n-gram of at least ``prompt_min_ngram`` tokens recurs (None: the store alone). No training.
    ``fallback``: :func:`block_drafter`'s arguments (``path`` and its settings): that drafter drafts the rows
    whose last ``min_ngram`` tokens the store never saw."""
    directory = _existing_dir(data_dir, "a regenerated data folder (experiments.regenerate prints it)", "drafter.data_dir")
    data = load_regenerated(directory)
    store = NgramStore.from_answers(zip(data["input_ids"], data["prompt_len"]), max_ngram)
    block = None if fallback is None else block_drafter(target, **fallback)
    drafter = CorpusLookupDrafter(store, output_vocab_size(target), num_draft_tokens, min_ngram, prompt_min_ngram,
                                  fallback=None if block is None else block.drafter)
    config = {"num_draft_tokens": num_draft_tokens, "max_ngram": max_ngram, "min_ngram": min_ngram,
              "prompt_min_ngram": prompt_min_ngram, "answers": len(data), "store_tokens": store.num_tokens,
              "fallback": None if block is None else {"path": block.info["path"], "config": block.info["config"]}}
    first = f"prompt lookup where the row's own >= {prompt_min_ngram}-gram recurs, else " if prompt_min_ngram else ""
    last = "" if block is None else ", else the block drafter of config.fallback"
    return EvalDrafter(drafter, {
        "name": name,
        "kind": "corpus_lookup",
        "path": str(directory),
        "config": config,
        "num_parameters": 0 if block is None else block.info["num_parameters"],
        "training_run": None if block is None else block.info["training_run"],
        "description": f"{'baseline: ' if block is None else ''}{first}the most frequent continuation of the longest "
                       f"{max_ngram}..{min_ngram}-gram in {len(data)} regenerated answers{last}, "
                       f"K={num_draft_tokens}" + ("; no training" if block is None else ""),
    })


def tree_drafter(target, path: str | None = None, name: str | None = None, lookup: bool = False, budget: int = 4,
                 score_temperature: float = 1.0, chain_width: int | None = None, lookup_min_match: int = 2,
                 lookup_depth: int = 5, lookup_paths: int = 1, merge: bool = False, max_ngram: int = 3,
                 min_ngram: int = 1,
                 draft_vocab_size: int | None = None, draft_vocab_from: str | None = None,
                 allow_other_target: bool = False, allow_edited_settings: bool = False) -> EvalDrafter:
    """Trees verified in one target pass (:mod:`drafters.tree`): the block drafter at ``path`` drafting best-first
    trees of ``budget`` nodes (or its argmax chain of ``chain_width``), with ``lookup`` prompt lookup's paths in the
    rows whose last ``lookup_min_match`` tokens recur (the hybrid), or in every row beside the drafter's nodes
    (``merge``); ``path=None`` with ``lookup``: lookup's paths alone. :class:`drafters.tree.TreePolicy` documents
    and checks the settings (all exact)."""
    policy = TreePolicy(budget=budget, score_temperature=score_temperature, chain_width=chain_width,
                        lookup_min_match=lookup_min_match, lookup_depth=lookup_depth, lookup_paths=lookup_paths,
                        merge=merge)
    block = None
    if path is not None:
        _refuse_causal_lm(path)
        block = block_drafter(target, path, name, draft_vocab_size=draft_vocab_size, draft_vocab_from=draft_vocab_from,
                              allow_other_target=allow_other_target, allow_edited_settings=allow_edited_settings)
    finder = PromptLookupDrafter(output_vocab_size(target), lookup_depth, max_ngram, min_ngram) if lookup else None
    try:
        drafter = TreeDrafter(block.drafter if block is not None else None, finder, policy)
    except ValueError as e:
        raise ValueError(f"{e} [drafter.path={path}, drafter.lookup={lookup}]") from e
    lookup_settings = {"lookup": lookup, "max_ngram": max_ngram, "min_ngram": min_ngram} if lookup else {}
    info = dict(block.info) if block is not None else {
        "name": name, "path": None, "num_parameters": 0, "training_run": None, "config": {}}
    scores = f" over slot probabilities at temperature {score_temperature:g}" if score_temperature != 1 else ""
    shape = f"chain W={chain_width}" if chain_width is not None else f"best-first tree N={budget}{scores}"
    rule = ("merged with lookup's paths in every row" if merge else
            f"prompt lookup's {lookup_paths} path(s) of {lookup_depth} where the last >= {lookup_min_match} tokens recur"
            if lookup else "")
    info.update(kind="hybrid" if lookup and block is not None else "tree",
                config=info["config"] | {"tree_policy": asdict(policy)} | lookup_settings,
                description=f"{shape}{'; ' + rule if rule else ''}; verified as a tree in one target pass")
    return EvalDrafter(drafter, info)


def _refuse_causal_lm(path: str) -> None:
    """A tree or hybrid drafts from a block drafter's slot distributions: refuse an autoregressive LM's folder."""
    config = Path(str(path)).expanduser() / "config.json"
    architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    if any(str(a).endswith("ForCausalLM") for a in architectures):
        raise ValueError(f"drafter.path={path} holds a {architectures[0]}, which drafts one chain token by token; "
                         "drafter=tree and drafter=hybrid need a trained block drafter (its slot distributions give "
                         "the tree): use drafter=ar_assistant for this one")
