"""The lookup drafters, no model and no training: prompt lookup (:class:`PromptLookupDrafter`, the row's own
n-grams), and retrieval from an n-gram store of the target's answers (:class:`NgramStore`,
:class:`CorpusLookupDrafter`). Both follow the :class:`verify.drafter.Drafter` protocol; :mod:`verify.drafter`
re-exports these names.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verify.drafter import Drafter


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

    def sequences(self, anchor_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per row, its committed tokens followed by its anchor (L,) long, on the CPU: what the lookup reads."""
        return [torch.cat([history, anchor.view(1)]) for history, anchor in zip(self._tokens, anchor_ids.cpu())]

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


def recurring_suffixes(ids: Sequence[int], min_ngram: int) -> list[bool]:
    """Per column a of ``ids`` (L,): whether the ``min_ngram`` tokens ending at a occur earlier, ending before a:
    where a hybrid (:class:`drafters.tree.TreeDrafter`, ``lookup_min_match``) drafts by lookup from an anchor at a
    (:func:`lookup_paths` finds an n >= ``min_ngram``, for ``min_ngram`` up to its ``max_ngram``, 3 in the hybrid).
    Columns before the n-gram fits are False."""
    if min_ngram < 1:
        raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
    ids, seen, out = [int(t) for t in ids], set(), []
    for a in range(len(ids)):
        gram = tuple(ids[a - min_ngram + 1:a + 1]) if a >= min_ngram - 1 else None
        out.append(gram in seen)  # seen: the n-grams ending before a
        if gram is not None:
            seen.add(gram)
    return out


def copy_tokens(seq: torch.Tensor, start: int, k: int) -> torch.Tensor:
    """``k`` tokens copied from ``seq[start:]`` (L,), continuing into the copy itself past the end
    (the pattern repeats with period L - start). Returns (k,) long."""
    period = seq[start:]
    return period.repeat(-(-k // period.numel()))[:k]


def lookup_paths(seq: torch.Tensor, max_ngram: int, min_ngram: int, depth: int,
                 max_paths: int = 1) -> tuple[int, list[list[int]]]:
    """``(n, paths)``: the length n of the longest suffix n-gram of ``seq`` (L,) in ``max_ngram..min_ngram`` that
    occurs earlier (0: none does), and up to ``max_paths`` distinct continuations of ``depth`` tokens of its
    occurrences, the latest first (each as :func:`copy_tokens` continues it). With n = 0 the one path repeats the
    last token, as :class:`PromptLookupDrafter` drafts."""
    length = seq.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # (L - n, n)
        hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten().flip(0)  # latest first
        if hits.numel():
            paths: list[list[int]] = []
            for start in (hits + n).tolist():
                path = copy_tokens(seq, start, depth).tolist()
                if path not in paths:
                    paths.append(path)
                    if len(paths) == max_paths:
                        break
            return n, paths
    return 0, [copy_tokens(seq, length - 1, depth).tolist()]
