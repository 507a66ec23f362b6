"""The drafter protocol: what a drafter receives at each speculative step and what it returns.

Layout shared by the verifier and every drafter (one batch of B rows):

* The verifier keeps a *column* buffer of length C for all rows. Column c of row b holds a token
  that is either committed (``attention_mask[b, c] == 1``) or a hole (``0``: left padding, or a
  draft that this row rejected while another row accepted it). Holes are never removed; they are
  masked. ``position_ids`` count committed tokens only (``cumsum(mask) - 1``), so a row's
  positions are exactly those it would have without batching.
* The *anchor* of a row is its last committed token, which the target has not processed yet.
  It is never in the column buffer: it is handed to :meth:`Drafter.draft`.

One speculative step:

1. ``draft(anchor_ids, anchor_position_ids, ...)`` returns K draft tokens per row and, for sampled
   drafts, the proposal distributions q they were drawn from (``None`` means deterministic drafts,
   i.e. q is one-hot at the returned token).
2. The target runs ``[anchor, d_1..d_K]`` in one forward pass and the verifier accepts a prefix.
3. ``extend(input_ids, attention_mask, position_ids, hidden_states)`` appends the new columns
   ``[anchor, d_1..d_n]`` (n = the largest accepted count over rows; rows that accepted fewer have
   holes there) together with the target's hidden states at those columns, for the layers listed
   in ``target_layer_ids`` (indices into Hugging Face's ``output_hidden_states`` tuple, 0 being the
   embeddings). The first call after :meth:`reset` carries the prompt without its anchor.

A drafter may be stateful (caches), so the verifier calls ``reset`` before a new batch and
``select_rows`` when it drops finished rows from the batch.

Optionally, ``bind_target_cache(cache)`` is offered the target's KV cache after ``reset`` and before the first
``extend``: a drafter whose context keys/values are the target's may read them there instead of keeping its
own (:mod:`drafters.shared_cache`). The verifier crops that cache to the committed columns and selects its rows
before it calls ``extend`` and ``select_rows``; a drafter may write scratch columns past its end.

Optionally, ``draft_sources()`` returns, per row of the last ``draft``, a label of what drafted it (e.g.
``hint`` for a copied lookup hint, ``drafter`` for the model's own tokens; None: unlabelled). The verifier
records them beside the accepted counts (:func:`verify.metrics.accepted_by_source`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from verify.hf import cache_argument, max_positions, new_kv_cache, output_vocab_size
from verify.rejection import sample_tokens, warp_probs


@runtime_checkable
class Drafter(Protocol):
    """A drafter that the verifier in :mod:`verify.generate` can drive."""

    #: K, the number of tokens drafted per step (the block size minus one for block drafters).
    num_draft_tokens: int
    #: Indices into the target's ``hidden_states`` tuple that ``extend`` must receive; empty if none.
    target_layer_ids: tuple[int, ...]
    #: Vocabulary size of the drafter's output distribution; must equal the target's.
    vocab_size: int

    def reset(self, batch_size: int) -> None:
        """Forget every cached column; a new batch of ``batch_size`` rows starts."""

    def extend(
        self,
        input_ids: torch.Tensor,  # (B, n) long
        attention_mask: torch.Tensor,  # (B, n) long, 1 = committed, 0 = hole
        position_ids: torch.Tensor,  # (B, n) long
        hidden_states: tuple[torch.Tensor, ...] | None,  # len(target_layer_ids) x (B, n, H)
    ) -> None:
        """Append n committed-or-hole columns to the drafter's context."""

    def draft(
        self,
        anchor_ids: torch.Tensor,  # (B,) long
        anchor_position_ids: torch.Tensor,  # (B,) long
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Propose K tokens per row: ``(tokens (B, K) long, q (B, K, V) float32 or None)``.

        When q is returned, ``tokens[:, k]`` must have been drawn from ``q[:, k]`` (given the
        drafts before it); the verifier's exactness relies on it.

        A drafter may return fewer drafts, (B, W) and (B, W, V) with W <= K, the same W for every
        row: only those are verified. Exactness then needs only that the decision to include slot k
        does not look at the token drawn for slot k or later (e.g. a width chosen from the proposal
        distributions of a block drafter, whose slots are drawn independently).
        """

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows listed in ``rows`` (B',) long, in that order."""


class AssistantDrafter:
    """Any Hugging Face causal LM used as an autoregressive drafter (K forwards per step).

    It keeps its own KV cache in the verifier's column layout (see the module docstring). ``draft``
    runs the pending columns plus the anchor in one forward, then feeds d_1..d_{K-1} one at a time,
    caching them as if committed. ``extend`` keeps the cached columns the verifier committed (with
    the verifier's mask, which turns a row's rejected drafts into holes), crops the others and
    queues the columns not computed yet (d_K when all K were accepted, or the prompt after
    ``reset``); they run together with the next anchor. At temperature 0, or with
    ``deterministic=True``, drafts are greedy and q is None; otherwise d_k is sampled from the warped
    distribution q_k, which is returned.
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, num_draft_tokens: int, deterministic: bool = False):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.num_draft_tokens = int(num_draft_tokens)
        self.deterministic = deterministic
        self.vocab_size = output_vocab_size(model)
        self._max_position = max_positions(model)
        self._cache_key = cache_argument(model)  # the keyword under which model.forward takes the cache
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        device = next(self.model.parameters()).device
        self._cache = new_kv_cache(self.model)
        self._mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, C) cached columns
        self._pending_ids = self._mask.clone()  # (B, P) committed-or-hole columns not run yet
        self._pending_mask = self._mask.clone()  # (B, P)
        self._pending_pos = self._mask.clone()  # (B, P)
        self._num_fed = 0  # trailing cached columns [anchor, d_1, ...] written by draft(), unconfirmed

    def extend(self, input_ids, attention_mask, position_ids, hidden_states=None) -> None:
        keep = min(self._num_fed, input_ids.shape[1])
        if self._num_fed > keep:
            self._cache.crop(keep - self._num_fed)
        confirmed = self._mask[:, : self._mask.shape[1] - self._num_fed]
        self._mask = torch.cat([confirmed, attention_mask[:, :keep]], dim=1)
        self._pending_ids = torch.cat([self._pending_ids, input_ids[:, keep:]], dim=1)
        self._pending_mask = torch.cat([self._pending_mask, attention_mask[:, keep:]], dim=1)
        self._pending_pos = torch.cat([self._pending_pos, position_ids[:, keep:]], dim=1)
        self._num_fed = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self._cache.batch_select_indices(rows)
        self._mask = self._mask[rows]
        self._pending_ids = self._pending_ids[rows]
        self._pending_mask = self._pending_mask[rows]
        self._pending_pos = self._pending_pos[rows]

    def _forward(self, input_ids, positions, new_mask) -> torch.Tensor:  # (B, n) x3 -> (B, V)
        """Run n new columns through the assistant, appending them to its cache and mask."""
        if self._max_position is not None:
            positions = positions.clamp(max=self._max_position - 1)  # only slots past the cap get here
        self._mask = torch.cat([self._mask, new_mask], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=self._mask,
            position_ids=positions.clamp_min(0),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_key: self._cache},
        )
        return out.logits[:, -1]

    def draft(self, anchor_ids, anchor_position_ids, *, temperature=0.0, top_k=None, top_p=None, generator=None):
        greedy = temperature == 0 or self.deterministic
        ones = torch.ones_like(anchor_ids).unsqueeze(1)  # (B, 1)
        logits = self._forward(
            torch.cat([self._pending_ids, anchor_ids.unsqueeze(1)], dim=1),
            torch.cat([self._pending_pos, anchor_position_ids.unsqueeze(1)], dim=1),
            torch.cat([self._pending_mask, ones], dim=1),
        )
        self._pending_ids = self._pending_mask = self._pending_pos = self._pending_ids[:, :0]
        self._num_fed = 1
        tokens, probs = [], []
        for k in range(1, self.num_draft_tokens + 1):
            if greedy:
                token = logits.argmax(dim=-1)  # (B,)
            else:
                q_k = warp_probs(logits, temperature, top_k, top_p)  # (B, V)
                token = sample_tokens(q_k, generator)
                probs.append(q_k)
            tokens.append(token)
            if k < self.num_draft_tokens:
                logits = self._forward(token.unsqueeze(1), (anchor_position_ids + k).unsqueeze(1), ones)
                self._num_fed += 1
        return torch.stack(tokens, dim=1), (None if greedy else torch.stack(probs, dim=1))


class PromptLookupDrafter:
    """Prompt lookup decoding: copy what followed the latest earlier occurrence of the row's last n-gram.

    No model and no training (transformers' ``prompt_lookup_num_tokens``). Per row, ``seq`` is the
    row's committed tokens (holes are not tokens) followed by the anchor. For n = ``max_ngram`` down
    to ``min_ngram``, the latest occurrence of ``seq[-n:]`` that ends before the last token is
    looked up (:func:`lookup_start`); the first n that has one wins, and the drafts are the K tokens
    that followed it. Where fewer than K tokens follow, the copy goes on into its own drafts, i.e.
    the repeat continues with the same period (:func:`copy_tokens`); where no n-gram recurs, the
    drafts repeat the anchor (a copy with period 1). Drafts are deterministic (q is None) at every
    temperature.
    """

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.vocab_size = int(vocab_size)
        self.num_draft_tokens = int(num_draft_tokens)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self._tokens = [torch.zeros(0, dtype=torch.long) for _ in range(batch_size)]  # committed, per row (CPU)

    def extend(self, input_ids, attention_mask, position_ids=None, hidden_states=None) -> None:
        ids, keep = input_ids.long().cpu(), attention_mask.cpu().bool()
        self._tokens = [torch.cat([old, row[m]]) for old, row, m in zip(self._tokens, ids, keep)]

    def select_rows(self, rows: torch.Tensor) -> None:
        self._tokens = [self._tokens[i] for i in rows.tolist()]

    def draft(self, anchor_ids, anchor_position_ids=None, **sampling):
        drafts = []
        for history, anchor in zip(self._tokens, anchor_ids.cpu()):
            seq = torch.cat([history, anchor.view(1)])
            drafts.append(copy_tokens(seq, lookup_start(seq, self.max_ngram, self.min_ngram), self.num_draft_tokens))
        return torch.stack(drafts).to(anchor_ids.device), None


class NgramStore:
    """The most frequent next token after every n-gram (n = 1..``max_ngram``) of a corpus of token sequences.

    A datastore as retrieval drafting (REST) uses one: built once from text the target wrote (its regenerated
    answers), no training. Ties go to the token seen first.
    """

    def __init__(self, sequences: Iterable[Sequence[int]], max_ngram: int = 4):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = int(max_ngram)
        counts: list[dict[tuple[int, ...], Counter]] = [defaultdict(Counter) for _ in range(self.max_ngram)]
        self.num_tokens = 0
        for seq in sequences:
            seq = [int(t) for t in seq]
            self.num_tokens += len(seq)
            for i in range(1, len(seq)):
                for n in range(1, min(self.max_ngram, i) + 1):
                    counts[n - 1][tuple(seq[i - n : i])][seq[i]] += 1
        self._next = [{key: c.most_common(1)[0][0] for key, c in table.items()} for table in counts]

    @classmethod
    def from_answers(cls, rows: Iterable[tuple[Sequence[int], int]], max_ngram: int = 4) -> NgramStore:
        """The store of regenerated rows ``(input_ids, prompt_len)``: each answer with the last ``max_ngram - 1``
        tokens of its prompt (the assistant cue), so the answer's first tokens are stored after that cue too."""
        return cls((ids[max(0, prompt_len - max_ngram + 1):] for ids, prompt_len in rows), max_ngram)

    def suffix_length(self, seq: Sequence[int], min_ngram: int = 1) -> int:
        """The length n (``max_ngram`` down to ``min_ngram``) of the longest suffix of ``seq`` the store holds a
        next token for: what :meth:`continuation`'s first token rests on; 0 where none is held."""
        for n in range(min(self.max_ngram, len(seq)), min_ngram - 1, -1):
            if tuple(seq[-n:]) in self._next[n - 1]:
                return n
        return 0

    def continuation(self, seq: Sequence[int], k: int, min_ngram: int = 1) -> list[int]:
        """Up to ``k`` tokens after ``seq``, one at a time: the next token of the longest suffix of (at most
        ``max_ngram``, at least ``min_ngram`` tokens) that the store holds; stops where none is held."""
        context, out = list(seq[-self.max_ngram :]), []
        for _ in range(k):
            for n in range(min(self.max_ngram, len(context)), min_ngram - 1, -1):
                token = self._next[n - 1].get(tuple(context[-n:]))
                if token is not None:
                    break
            else:
                return out
            out.append(token)
            context = context[1:] + [token] if len(context) == self.max_ngram else context + [token]
        return out


class CorpusLookupDrafter(PromptLookupDrafter):
    """Retrieval drafting: continue each row as an :class:`NgramStore` of the target's own answers does.

    No model and no training. Per row (committed tokens and anchor, as in :class:`PromptLookupDrafter`):
    with ``prompt_min_ngram`` set, where the row's own last 3..``prompt_min_ngram`` tokens recur in it,
    the prompt-lookup copy; elsewhere the store's continuation (:meth:`NgramStore.continuation` with
    ``min_ngram``), completed to K by repeating its last token where the store runs out, or, with a
    ``fallback`` drafter (e.g. a trained block drafter; it sees every column), that drafter's block where
    the store holds no n-gram of at least ``min_ngram`` tokens of the row. Which rule drafts a row depends
    on its tokens only, so the verification stays exact. Deterministic (q is None) without a fallback.
    """

    def __init__(self, store: NgramStore, vocab_size: int, num_draft_tokens: int, min_ngram: int = 1,
                 prompt_min_ngram: int | None = 2, fallback: Drafter | None = None):
        self.fallback = None  # set below; PromptLookupDrafter.__init__ resets
        super().__init__(vocab_size, num_draft_tokens, max_ngram=3, min_ngram=prompt_min_ngram or 1)
        if not 1 <= min_ngram <= store.max_ngram:
            raise ValueError(f"min_ngram must be in 1..{store.max_ngram} (the store's max_ngram), got {min_ngram}")
        if fallback is not None and (fallback.num_draft_tokens, fallback.vocab_size) != (num_draft_tokens, vocab_size):
            raise ValueError(f"the fallback drafter drafts K={fallback.num_draft_tokens} of V={fallback.vocab_size}; "
                             f"this one K={num_draft_tokens} of V={vocab_size}")
        self.store, self.corpus_min_ngram, self.prompt_min_ngram = store, int(min_ngram), prompt_min_ngram
        self.fallback = fallback
        self.target_layer_ids = () if fallback is None else tuple(fallback.target_layer_ids)

    def reset(self, batch_size: int) -> None:
        super().reset(batch_size)
        if self.fallback is not None:
            self.fallback.reset(batch_size)

    def extend(self, input_ids, attention_mask, position_ids=None, hidden_states=None) -> None:
        super().extend(input_ids, attention_mask, position_ids, hidden_states)
        if self.fallback is not None:
            self.fallback.extend(input_ids, attention_mask, position_ids, hidden_states)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        if self.fallback is not None:
            self.fallback.select_rows(rows)

    def _retrieved(self, history: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor | None:
        """(K,) drafts of one row from its own tokens or the store; None where the fallback drafts it."""
        k, seq = self.num_draft_tokens, torch.cat([history, anchor.view(1)])
        start = lookup_start(seq, self.max_ngram, self.min_ngram) if self.prompt_min_ngram else seq.numel() - 1
        if start != seq.numel() - 1:  # the row's own n-gram recurs: copy what followed it
            self._sources.append("prompt")
            return copy_tokens(seq, start, k)
        tokens = self.store.continuation(seq.tolist(), k, self.corpus_min_ngram)
        self._sources.append("store" if tokens else ("fallback" if self.fallback is not None else "anchor"))
        if not tokens and self.fallback is not None:
            return None
        tokens = tokens or [int(anchor)]
        return torch.tensor(tokens + tokens[-1:] * (k - len(tokens)))

    def draft(self, anchor_ids, anchor_position_ids=None, **sampling):
        self._sources = []  # filled by _retrieved, one label per row
        rows = [self._retrieved(h, a) for h, a in zip(self._tokens, anchor_ids.cpu())]
        own = [i for i, r in enumerate(rows) if r is None]  # rows the fallback drafts
        if not own:
            return torch.stack(rows).to(anchor_ids.device), None
        tokens, q = self.fallback.draft(anchor_ids, anchor_position_ids, **sampling)  # (B, K), (B, K, V) or None
        if tokens.shape[1] != self.num_draft_tokens:
            raise ValueError(f"the fallback drafter returned {tokens.shape[1]} drafts per row, not K="
                             f"{self.num_draft_tokens} (a confidence threshold or max_draft_tokens narrows it)")
        retrieved = [i for i, r in enumerate(rows) if r is not None]
        if retrieved:
            index = torch.tensor(retrieved, device=tokens.device)
            tokens = tokens.clone()
            tokens[index] = torch.stack([rows[i] for i in retrieved]).to(tokens.device)
            if q is not None:  # a retrieved row's q is the point mass on its drafts
                q = q.clone()
                q[index] = torch.nn.functional.one_hot(tokens[index], q.shape[-1]).to(q.dtype)
        return tokens, q

    def draft_sources(self) -> list[str]:
        """Per row of the last draft: ``prompt`` (the row's own n-gram recurred), ``store`` (the store's
        continuation), ``fallback`` (the fallback drafter) or ``anchor`` (nothing held: the anchor repeated)."""
        return list(self._sources)


def lookup_start(seq: torch.Tensor, max_ngram: int, min_ngram: int = 1) -> int:
    """Where the copy starts in ``seq`` (L,): just after the latest occurrence of ``seq[-n:]`` that ends
    before the last token, for the largest n in ``max_ngram..min_ngram`` that has one; L - 1 (the last
    token itself) when none does."""
    length = seq.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # (L - n, n): window i is seq[i:i + n], ending before the last token
        hits = (windows == seq[-n:]).all(dim=1).nonzero()
        if hits.numel():
            return int(hits[-1]) + n
    return length - 1


def copy_tokens(seq: torch.Tensor, start: int, k: int) -> torch.Tensor:
    """``k`` tokens copied from ``seq[start:]`` (L,), continuing into the copy itself past the end
    (the pattern repeats with period L - start). Returns (k,) long."""
    period = seq[start:]
    return period.repeat(-(-k // period.numel()))[:k]


def truncated_copy(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A copy of a Hugging Face causal LM keeping only its first ``num_layers`` decoder layers.

    Embeddings, final norm and LM head are copied too, so the copy is a cheap early-exit assistant
    that agrees with the full model more often than an unrelated model would.
    """
    import copy

    config = copy.deepcopy(model.config)
    total = config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total} (the model's layer count), got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    weight = next(model.parameters())
    small = type(model)(config).to(device=weight.device, dtype=weight.dtype)
    missing, _ = small.load_state_dict(model.state_dict(), strict=False)
    if missing:
        raise ValueError(f"truncated copy could not be filled from the model; missing weights: {missing[:5]}")
    return small.eval()
