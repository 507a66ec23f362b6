"""blockdraft's acceptance on the token sequences an engine produced, counted two ways.

Both replay greedy verification with the drafter's drafts at every column of a (prompt, output)
sequence (:func:`drafters.tau.anchor_acceptance`: a draft slot is accepted while it equals the
target's greedy token on the true context):

* **blockdraft's steps** (:func:`drafters.tau.greedy_walk`): the first verification is anchored at the
  prompt's last token (``verify.speculative_generate`` prefills the prompt without it), so the first
  new token already comes out of a speculative step;
* **the engine's steps**: vLLM prefills the whole prompt, samples the first new token from it without
  a draft, and drafts from then on, so its first block is anchored at the first new token. Its
  counters (drafts = steps, accepted tokens, accepted per position) are compared with this walk.

A step with n accepted drafts keeps n + 1 tokens; position k (1-based) is accepted in a step when
n >= k. Where the target's own greedy token differs from the engine's output (numerical divergence
between the stacks), ``mismatches`` counts the columns (the ``lookahead`` tokens are the target's own
greedy tokens and count only where a cached and an uncached forward disagree).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drafters.tau import anchor_acceptance, greedy_walk
from verify.generate import target_generate


def engine_walk(lead: Sequence[int], first_anchor: int, length: int) -> list[int]:
    """Accepted drafts per step of an engine that anchors its first block at column ``first_anchor`` and stops
    once the sequence has ``length`` tokens. Unlike :func:`drafters.tau.greedy_walk` the last step's count is
    not cut at ``length`` (vLLM counts drafts accepted past ``max_tokens`` or EOS before it cuts the output);
    ``lead`` of a sequence that ends at ``length`` cuts it all the same."""
    accepted, anchor = [], first_anchor
    while anchor < length - 1:
        accepted.append(int(lead[anchor]))
        anchor += accepted[-1] + 1
    return accepted


def position_counts(accepted: Sequence[int], num_slots: int) -> list[int]:
    """Steps whose accepted count reaches each position 1..K: ``[#(n >= 1), ..., #(n >= K)]``."""
    return [sum(1 for n in accepted if n >= k) for k in range(1, num_slots + 1)]


def summary(accepted: Sequence[int], num_slots: int) -> dict:
    """Counts of a walk: steps (drafts), accepted drafts, per-position accepted counts, acceptance
    length (1 + accepted / steps: tokens per verification step) and per-position acceptance rates."""
    steps, total = len(accepted), int(sum(accepted))
    per_pos = position_counts(accepted, num_slots)
    return {"num_drafts": steps, "num_accepted_tokens": total, "accepted_per_pos": per_pos,
            "acceptance_length": 1 + total / steps if steps else None,
            "position_acceptance": [c / steps if steps else None for c in per_pos]}


@torch.no_grad()
def sequence_leads(drafter, target, prompt: Sequence[int], output: Sequence[int],
                   width: int | None = None) -> tuple[list[int], int]:
    """Per column of ``prompt + output``, the accepted drafts of the block (of ``width`` + 1 columns, None: the
    drafter's) anchored there; and the number of output tokens that are not the target's greedy token on their
    context."""
    if not prompt or not output:
        raise ValueError(f"sequence_leads needs a non-empty prompt and output, got {len(prompt)} and {len(output)} tokens")
    device = drafter.weight_ref.device
    ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    prompt_len = torch.tensor([len(prompt)], device=device)
    length = torch.tensor([ids.shape[1]], device=device)
    lead, _, _ = anchor_acceptance(drafter, out.hidden_states, out.logits, ids, mask, prompt_len, length,
                                   width=width)
    greedy = out.logits[0, len(prompt) - 1:-1].argmax(-1)
    return lead[0].tolist(), int((greedy != ids[0, len(prompt):]).sum())


def sequence_acceptance(drafter, target, prompts: Sequence[Sequence[int]],
                        outputs: Sequence[Sequence[int]], lookahead: int = 0, width: int | None = None) -> dict:
    """blockdraft's and the engine's step counts (see the module doc) pooled over sequences.

    ``width``: the drafts are blocks of width + 1 columns, as an engine serving width speculative tokens drafts
    them (None: the drafter's whole block). ``lookahead``: tokens of the target's greedy continuation (EOS ignored)
    appended to each sequence before its blocks are verified. vLLM counts the drafts a step accepts before it cuts the output at ``max_tokens`` or
    EOS, so its last step's count needs the tokens past the cut; the serving check passes K. blockdraft's own
    walk cuts at the output's end and does not depend on it."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    ours, engine, mismatches, kept = [], [], 0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        longer = list(output)
        if lookahead:
            ids = torch.tensor([list(prompt) + longer], device=drafter.weight_ref.device)
            longer += target_generate(target, ids, max_new_tokens=lookahead).new_tokens[0]
        lead, bad = sequence_leads(drafter, target, prompt, longer, width)
        mismatches += bad
        length = len(prompt) + len(output)
        accepted, step_kept = greedy_walk(lead, len(prompt), length)
        ours += accepted
        kept += sum(step_kept)
        engine += engine_walk(lead, len(prompt), length)
    k = drafter.num_draft_tokens if width is None else width
    blockdraft = summary(ours, k)
    blockdraft["tau"] = kept / len(ours) if ours else None
    return {"blockdraft": blockdraft, "engine_steps": summary(engine, k), "mismatches": mismatches,
            "engine_steps_accepted": engine}
