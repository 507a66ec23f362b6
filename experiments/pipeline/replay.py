"""τ at temperature 0 replayed from the target's greedy answers, without speculative decoding.

At T=0 the verifier's output is the target's greedy output, and a step keeps the drafts up to the first one that
differs from it, plus one token. A drafter's accepted counts therefore follow from the greedy answers alone
(:func:`drafters.tau.greedy_walk`), given ``lead[a]``: how many of the drafts proposed at anchor column a equal
the answer's next tokens. Per kind of drafter (:func:`leads`):

* block drafter: every anchor of a batch from one teacher-forced target pass (:func:`drafters.tau.anchor_acceptance`);
* autoregressive assistant: its k-th draft is its own teacher-forced argmax whenever drafts 1..k-1 were right,
  the only case a step counts (:func:`experiments.pipeline.assistant.leading_correct`);
* prompt lookup: :class:`verify.PromptLookupDrafter`'s rule on the tokens up to the anchor, computed only at
  the anchors the walk visits.

:func:`replay_suite` turns a suite's greedy answers into the results entry that
:func:`experiments.pipeline.evaluation.evaluate_suite` writes at T=0 (no speeds). The answers are decoded once
per target, suite and decoding settings by target-only decoding, in the batches an evaluation uses, and cached
under ``$BLOCKDRAFT_CACHE/greedy/`` (:func:`greedy_answers`), and the target's teacher-forced passes over them
beside them (:func:`teacher_passes`), so an ablation's every drafter costs a drafter pass instead of a decoding
run. A cached file is sealed when written (its sha256 beside it,
:func:`drafters.storage.write_sealed_json`) and checked when read: an edited or truncated one is named, with both
hashes, and decoded again. The numbers equal the online verifier's (tests/test_replay.py) up to the
target's own float differences between batch shapes, which can flip a near-tied greedy token.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from drafters.checks import target_weights_sha1
from drafters.policy import DraftingPolicy, PolicyDrafter
from drafters.storage import (
    DamagedFileError,
    check_seal,
    read_sealed_json,
    seal_path,
    write_seal,
    write_sealed_json,
)
from drafters.tau import anchor_acceptance, anchor_top, greedy_walk
from drafters.training.blocks import run_target
from drafters.training.datamodule import collate
from drafters.tree import TreeDrafter, accepted_depth
from experiments.data.hashing import settings_hash
from experiments.data.prompts import left_pad
from experiments.data.suites import Prompt, cache_dir
from experiments.data.target import eos_token_ids
from experiments.pipeline.assistant import leading_correct
from experiments.pipeline.records import cpu_model
from experiments.pipeline.suite_batches import start_decoding, suite_result, turn_batches
from verify import AssistantDrafter, PromptLookupDrafter
from verify.generate import target_generate
from verify.lookup import copy_tokens, lookup_start

#: Answers of one turn: the token ids the target saw and wrote, and where its answer starts.
Turn = tuple[list[int], int]
#: The target's teacher-forced pass over a batch of turns (:func:`teacher_passes`): the right-padded batch, the
#: hidden states of the drafter's target layers (B, S, L*H) and the answer tokens that differ from its argmax.
Pass = tuple[dict, torch.Tensor, int]


class _LookupLeads:
    """``lead[a]`` of prompt lookup over one sequence, computed when the walk asks for it."""

    def __init__(self, ids: Sequence[int], k: int, max_ngram: int, min_ngram: int):
        self.ids, self.k, self.max_ngram, self.min_ngram = list(ids), k, max_ngram, min_ngram

    def __getitem__(self, a: int) -> int:
        seq = torch.tensor(self.ids[: a + 1])
        draft = copy_tokens(seq, lookup_start(seq, self.max_ngram, self.min_ngram), self.k).tolist()
        lead = 0
        while lead < len(draft) and a + 1 + lead < len(self.ids) and draft[lead] == self.ids[a + 1 + lead]:
            lead += 1
        return lead


def lookup_leads(ids: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> _LookupLeads:
    """Prompt lookup's ``lead[a]`` at every column a of ``ids`` (lazy: a walk visits few anchors)."""
    return _LookupLeads(ids, k, max_ngram, min_ngram)


@torch.no_grad()
def lookup_replay(prompt: list[int], response: list[int], num_draft_tokens: int, max_ngram: int, min_ngram: int) -> int:
    """Speculative steps prompt lookup (:class:`verify.PromptLookupDrafter`'s rule) needs to emit ``response`` after
    ``prompt`` under greedy verification (:mod:`experiments.pipeline.choose_k`)."""
    ids = list(prompt) + list(response)
    return len(greedy_walk(lookup_leads(ids, num_draft_tokens, max_ngram, min_ngram), len(prompt), len(ids))[0])


@torch.no_grad()
def assistant_correct(model: torch.nn.Module, ids: Sequence[int]) -> list[bool]:
    """Per column c of ``ids``: whether an autoregressive assistant's teacher-forced argmax there is ``ids[c + 1]``
    (one forward; every K's leads follow from it, :func:`assistant_leads`)."""
    x = torch.tensor([list(ids)], device=next(model.parameters()).device)
    return (model(input_ids=x).logits[0, :-1].argmax(-1) == x[0, 1:]).tolist()


def assistant_leads(model: torch.nn.Module, ids: Sequence[int], k: int) -> list[int]:
    """An autoregressive assistant's ``lead[a]`` at every column of ``ids``: its greedy drafts from column a
    equal its teacher-forced argmax as long as they are right."""
    return leading_correct(assistant_correct(model, ids), k)


def block_leads(drafter, target, turns: Sequence[Turn], batch_size: int = 4,
                vocab: torch.Tensor | None = None, cache: Path | None = None) -> tuple[list[list[int]], int]:
    """A block drafter's ``lead[a]`` on every turn (one teacher-forced target pass per batch of turns,
    :func:`teacher_passes`), drafting from the candidate ids ``vocab`` (V',) if given, and the number of answer tokens
    that differ from the target's argmax in that pass (its float noise; 0 normally)."""
    passes = teacher_passes(target, turns, drafter.target_layer_ids, batch_size, cache)
    leads, mismatches = block_leads_by_vocab(drafter, passes, [vocab])
    return leads[0], mismatches


@torch.no_grad()
def block_leads_by_vocab(drafter, passes: Iterable[Pass],
                         vocabs: Sequence[torch.Tensor | None]) -> tuple[list[list[list[int]]], int]:
    """:func:`block_leads` for each of ``vocabs`` (candidate ids (V',) or None: the whole vocabulary) from the same
    target passes (:func:`teacher_passes`): ``leads[i]`` drafts from ``vocabs[i]``."""
    leads, mismatches = [[] for _ in vocabs], 0
    for batch, states, wrong in passes:
        ids, length = batch["input_ids"], batch["length"]
        ref = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # (B, S): the answer's token after column c
        for rows, vocab in zip(leads, vocabs):
            lead, _, _ = anchor_acceptance(drafter, states, None, ids, batch["attention_mask"], batch["prompt_len"],
                                           length, ref=ref, vocab=None if vocab is None else vocab.to(ids.device))
            rows += [row[: n] for row, n in zip(lead.tolist(), length.tolist())]
        mismatches += wrong
    return leads, mismatches


def teacher_passes(target, turns: Sequence[Turn], layer_ids: Sequence[int], batch_size: int = 4,
                   cache: Path | None = None) -> Iterator[Pass]:
    """Per batch of ``batch_size`` turns: the right-padded batch (:func:`drafters.training.datamodule.collate`),
    the target's hidden states of ``layer_ids`` in its teacher-forced pass over it ((B, S, L*H), the drafter's
    cached-features layout) and the answer tokens that differ from its argmax there.

    With ``cache`` (the greedy answers' file), the passes are kept beside it, sealed, one file per layer ids: every
    drafter replayed on the same answers (a job's chains, trees and hybrids) then skips the target's passes. The file
    is keyed by the answers' own key (target, weights, layout, prompts, settings), the layers, the batch size, torch
    and the CPU, since those decide the floats; a damaged one is named and computed again."""
    path = None if cache is None else cache.with_name(
        f"{cache.stem}.states-{settings_hash(list(layer_ids), batch_size, torch.__version__, cpu_model())}.pt")
    device = next(target.parameters()).device
    batches = [{k: v.to(device) for k, v in collate([{"input_ids": ids, "prompt_len": cut}
                                                     for ids, cut in turns[start: start + batch_size]]).items()}
               for start in range(0, len(turns), batch_size)]
    stored = _stored_passes(path, batches)
    if stored is not None:
        yield from ((batch, states.to(device), wrong) for batch, (states, wrong) in zip(batches, stored))
        return
    fresh = []
    for batch in batches:
        out = run_target(target, batch)
        states = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)  # (B, S, L*H)
        wrong = _argmax_mismatches(out.logits, batch)
        if path is not None:
            fresh.append((states.cpu(), wrong))
        yield batch, states, wrong
    if path is not None:
        seal_path(path).unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(fresh, tmp)
        os.replace(tmp, path)
        write_seal(path)


def _stored_passes(path: Path | None, batches: list[dict]) -> list[tuple[torch.Tensor, int]] | None:
    """The passes :func:`teacher_passes` kept in ``path``, if sealed and of these batches' shapes; else None (after a
    one-line warning naming the file and why, unless there is none)."""
    if path is None or not path.is_file():
        return None
    try:
        check_seal(path, "cached target passes")
        stored = torch.load(path, weights_only=True)
        shapes = [tuple(b["input_ids"].shape) for b in batches]
        if [tuple(states.shape[:2]) for states, _ in stored] != shapes:
            raise DamagedFileError(f"cached target passes {path} are not of these batches {shapes}")
        return stored
    except (DamagedFileError, RuntimeError, ValueError, TypeError) as e:
        warnings.warn(f"{e}; running the target again", stacklevel=3)
        return None


class TreeLeads:
    """``lead[a]`` of a :class:`drafters.tree.TreeDrafter` over one sequence: the depth of the longest root path of
    the tree drafted at anchor column a that equals the answer's next tokens, computed when the walk asks for it
    (the drafter's part from its per-slot top tokens at every anchor, ``top``: (S, W, n) values and ids). After each
    lookup, ``source`` and ``nodes`` say what drafted that anchor's tree and how many nodes it has."""

    def __init__(self, drafter: TreeDrafter, ids: Sequence[int], top: tuple[torch.Tensor, torch.Tensor] | None):
        self.drafter, self.ids, self.top = drafter, list(ids), top

    def __getitem__(self, a: int) -> int:
        lookup = self.drafter.lookup_for(torch.tensor(self.ids[: a + 1]))
        top = None
        if self.drafter.needs_pass(lookup):
            top = (self.top[0][a].tolist(), self.top[1][a].tolist())
        tokens, parents, self.source = self.drafter.policy.row_tree(lookup, top)
        self.nodes = len(tokens)
        return accepted_depth(tokens, parents, self.ids[a + 1 : a + 1 + self.drafter.num_draft_tokens])


@torch.no_grad()
def tree_tops(block, vocab: torch.Tensor | None, passes: Iterable[Pass], k: int, slots: int,
              temperature: float = 1.0) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Per turn, a block drafter's top ``k`` log-probabilities (at ``temperature``) and tokens of its first
    ``slots`` slots at every anchor ((S, slots, k) each; :func:`drafters.tau.anchor_top`), from the target's
    teacher-forced passes over the turns (:func:`teacher_passes`); and the target's argmax mismatches on the answers
    in those passes."""
    tops, mismatches = [], 0
    for batch, states, wrong in passes:
        values, ids = anchor_top(block, states, batch["input_ids"], batch["attention_mask"], batch["prompt_len"],
                                 batch["length"], k, slots, None if vocab is None else vocab.to(states.device),
                                 temperature)
        tops += list(zip(values, ids))
        mismatches += wrong
    return tops, mismatches


def tree_leads(drafter: TreeDrafter, target, turns: Sequence[Turn],
               cache: Path | None = None) -> tuple[list[TreeLeads], int]:
    """A tree drafter's ``lead`` per turn (:class:`TreeLeads`) and the target's argmax mismatches (block part only)."""
    if drafter.block is None:
        return [TreeLeads(drafter, ids, None) for ids, _ in turns], 0
    block = drafter.block.drafter
    passes = teacher_passes(target, turns, block.target_layer_ids, cache=cache)
    policy = drafter.policy
    tops, mismatches = tree_tops(block, drafter.block.draft_vocab, passes, policy.budget,
                                 policy.drafter_width(drafter.block.num_draft_tokens), policy.score_temperature)
    return [TreeLeads(drafter, ids, top) for (ids, _), top in zip(turns, tops)], mismatches


def _argmax_mismatches(logits: torch.Tensor, batch: dict) -> int:
    """Answer tokens of ``batch`` that differ from the target's argmax in its teacher-forced pass (float noise)."""
    ids, length = batch["input_ids"], batch["length"]
    ref = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # (B, S): the answer's token after column c
    columns = torch.arange(ids.shape[1], device=ids.device)
    answer = (columns >= batch["prompt_len"].unsqueeze(1) - 1) & (columns < length.unsqueeze(1) - 1)
    return int(((logits.argmax(-1) != ref) & answer).sum())


def _block_width(drafter: PolicyDrafter) -> int:
    """The verified width of a block drafter whose policy the replay can follow (max_draft_tokens only)."""
    policy, plain = drafter.policy, DraftingPolicy(max_draft_tokens=drafter.policy.max_draft_tokens,
                                                   share_target_cache=drafter.policy.share_target_cache)
    if policy != plain or getattr(drafter.drafter, "variants", {}).get("hints") is not None:
        raise ValueError("replay_greedy: only a block drafter without hints and with no decoding policy other than "
                         f"drafter.max_draft_tokens can be replayed (got {policy}); set replay_greedy=false")
    return drafter.num_draft_tokens if policy.max_draft_tokens is None else policy.max_draft_tokens


def leads(drafter, target, turns: Sequence[Turn], cache: Path | None = None) -> tuple[list[Sequence[int]], int]:
    """``lead`` per turn for any drafter :mod:`experiments.pipeline.eval_drafters` builds, capped at the
    width it verifies; and the target's argmax mismatches on the answers (block drafters only; else 0). ``cache``:
    the answers' file, beside which the target's passes are kept (:func:`teacher_passes`)."""
    if isinstance(drafter, TreeDrafter):
        return tree_leads(drafter, target, turns, cache)
    if isinstance(drafter, PolicyDrafter):
        width = _block_width(drafter)
        rows, mismatches = block_leads(drafter.drafter, target, turns, vocab=drafter.draft_vocab, cache=cache)
        return [[min(n, width) for n in row] for row in rows], mismatches
    if isinstance(drafter, AssistantDrafter):
        return [assistant_leads(drafter.model, ids, drafter.num_draft_tokens) for ids, _ in turns], 0
    if isinstance(drafter, PromptLookupDrafter):
        return [lookup_leads(ids, drafter.num_draft_tokens, drafter.max_ngram, drafter.min_ngram)
                for ids, _ in turns], 0
    raise ValueError(f"replay_greedy: a {type(drafter).__name__} cannot be replayed (block drafters, "
                     "ar_assistant and prompt_lookup can); set replay_greedy=false")


def _answers_path(target, tokenizer, prompts: Sequence[Prompt], suite: str, settings) -> Path:
    """Where the greedy answers of these prompts under these settings are cached (a hash of all that decides them)."""
    key = settings_hash(target_weights_sha1(target), str(next(target.parameters()).dtype), suite,
                        [[p.id, list(p.turns)] for p in prompts], settings.max_new_tokens, settings.max_prompt_tokens,
                        settings.batch_size, settings.use_chat_template, eos_token_ids(target, tokenizer),
                        # a layout's float rounding can flip a near-tied token (row_major: the key it always had)
                        *([settings.weight_layout] if settings.weight_layout != "row_major" else []))
    return cache_dir() / "greedy" / f"{suite}-{key}.json"


@torch.no_grad()
def greedy_answers(target, tokenizer, prompts: Sequence[Prompt], *, suite: str,
                   settings, path: Path | None = None) -> tuple[list[list[Turn]], int]:
    """Per prompt, per turn: the target's greedy answer as ``(ids, answer start)``, decoded target-only in the
    batches and order an evaluation uses (later turns after the model's own answers), cached on disk (``path``,
    default :func:`_answers_path`); and how many turns' prompts lost their first tokens to ``max_prompt_tokens``."""
    path = path or _answers_path(target, tokenizer, prompts, suite, settings)
    if path.is_file():
        cached = _cached_answers(path, prompts)
        if cached is not None:
            return cached
    run = start_decoding(target, tokenizer, suite, 0.0, settings)
    texts: list[list[str]] = [[] for _ in prompts]
    answers: list[list[Turn]] = [[] for _ in prompts]
    for _, chunk, rows in turn_batches(target, tokenizer, prompts, texts, run, settings, f"{suite} greedy answers"):
        input_ids, mask = left_pad(rows, run.kwargs["pad_token_id"], run.device)
        out = target_generate(target, input_ids, attention_mask=mask, generator=run.gen_target, **run.kwargs)
        for i, row, new in zip(chunk, rows, out.new_tokens):
            answers[i].append((list(row) + list(new), len(row)))
            texts[i].append(tokenizer.decode(new, skip_special_tokens=True).strip())
    write_sealed_json(path, {"suite": suite, "prompt_ids": [p.id for p in prompts], "truncated": run.truncated,
                             "answers": answers})
    return answers, run.truncated


def _cached_answers(path: Path, prompts: Sequence[Prompt]) -> tuple[list[list[Turn]], int] | None:
    """The greedy answers cached in ``path``, checked against their seal and the prompts; None (after a one-line
    warning naming the file and why) when they cannot be trusted, so that they are decoded again."""
    try:
        cached = read_sealed_json(path, "cached greedy answers")
        if cached["prompt_ids"] != [p.id for p in prompts] or len(cached["answers"]) != len(prompts):
            raise DamagedFileError(f"cached greedy answers {path} are not those of these {len(prompts)} prompts")
        answers = [[(list(ids), int(cut)) for ids, cut in turns] for turns in cached["answers"]]
        return answers, int(cached["truncated"])
    except (DamagedFileError, KeyError, TypeError, ValueError) as e:
        reason = str(e) if isinstance(e, DamagedFileError) else f"cached greedy answers {path} lack {e}"
        warnings.warn(f"{reason}; decoding them again", stacklevel=3)
        return None


def replay_suite(target, tokenizer, drafter, prompts: Sequence[Prompt], *, suite: str, temperature: float,
                 settings, clock=None) -> dict:
    """The T=0 results entry of ``drafter`` on one suite, replayed from the target's greedy answers: the fields
    of :func:`experiments.pipeline.evaluation.evaluate_suite` with the speeds None, plus ``replayed`` and
    ``replay_argmax_mismatches`` (answer tokens the replay's target pass would not have chosen; see :func:`leads`)."""
    if temperature != 0:
        raise ValueError(f"replay_greedy replays temperature 0 only, got {temperature}")
    path = _answers_path(target, tokenizer, prompts, suite, settings)
    answers, truncated = greedy_answers(target, tokenizer, prompts, suite=suite, settings=settings, path=path)
    flat = [turn for turns in answers for turn in turns]
    lead_rows, mismatches = leads(drafter, target, flat, cache=path)
    per_turn = []
    for (ids, cut), lead in zip(flat, lead_rows, strict=True):
        accepted, kept = greedy_walk(lead, cut, len(ids))
        assert sum(kept) == len(ids) - cut, "a replayed turn keeps every answer token"
        per_turn.append({"new_tokens": len(ids) - cut, "steps": len(accepted), "accepted_counts": accepted,
                         "draft_sources": []})
    records = iter(per_turn)
    turns = [[next(records) for _ in p_turns] for p_turns in answers]
    run = start_decoding(target, tokenizer, suite, temperature, settings)
    entry = suite_result(suite, temperature, prompts, turns, run, drafter.num_draft_tokens, settings,
                         measure_target_only=False)
    for key in ("batched_forwards", "mean_draft_width", "spec_wall_time_s", "spec_tokens_per_s"):
        entry[key] = None  # no decoding ran
    entry["truncated_prompts"] = truncated
    return {**entry, "replayed": True, "replay_argmax_mismatches": mismatches}
