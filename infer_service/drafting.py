"""Drafts without a second model: the tokens that followed the sequence's last n tokens the
last time they occurred in it (prompt lookup, llama.cpp's `ngram-simple` and `ngram-map-k`),
and how many of them a slot verifies each step. Pure: no llama, no grpc.

Edit this file, fix this JSON, answer quoting this document, call a tool with the arguments
just read: most of such a reply is already in the context, and a draft of it costs one
position per token in a batch the step decodes anyway. Each drafted token is checked against
the target's own sample at its position, so the output is what it would have been; a miss
costs the cells of the drafts after it, which the ledger gives back.

`NgramIndex` keeps, per n-gram of the history, where it last ended (and, for `ngram-map-k`,
how often it occurred): a lookup is a dict access, not a scan. The history is bounded: past
`max_tokens` its older half goes and the index is rebuilt (amortised over as many appends).

`DraftLength` adapts how many drafts a slot asks for to how many of its recent drafts were
accepted: a slot whose drafts keep missing drafts less, one whose drafts land drafts more, so
free text (where a lookup rarely matches, and a match is rarely right) stays as fast as
without drafts.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NO_TOKEN = -1  # in the history: a media chunk, which no n-gram spans
HISTORY_TOKENS = 1 << 16  # a request's history for lookups (its newest tokens)


class SpecType(enum.Enum):
    NONE = "none"
    NGRAM_SIMPLE = "ngram-simple"  # the latest earlier occurrence of the last n tokens
    NGRAM_MAP_K = "ngram-map-k"  # the same, once the n-gram occurred min_hits times


@dataclass(frozen=True)
class SpecConfig:
    """How a request drafts (llama-server's names and defaults where they mean the same)."""

    type: SpecType = SpecType.NONE
    n_max: int = 16  # drafts per step at most
    n_min: int = 0  # fewer than this: draft none
    p_min: float = 0.0  # (a draft model's confidence floor; n-gram drafts have none)
    size_n: int = 12  # the n-gram looked up (--spec-ngram-size-n)
    size_m: int = 48  # the longest continuation drafted from one match (--spec-ngram-size-m)
    min_hits: int = 1  # ngram-map-k: occurrences of the n-gram before it drafts

    @property
    def enabled(self) -> bool:
        return self.type is not SpecType.NONE and self.n_max > 0


class NgramIndex:
    """The history of one sequence's tokens, and where each n-gram of it last ended."""

    def __init__(self, size_n: int, *, max_tokens: int = 1 << 16):
        if size_n < 1 or max_tokens < 2 * size_n:
            raise ValueError(f"size_n must be >= 1 and max_tokens >= 2 * size_n, got {size_n}")
        self.size_n = size_n
        self.max_tokens = max_tokens
        self._tokens: list[int] = []
        # hash of an n-gram -> (where it last ended, where it ended before that, how often)
        self._ends: dict[int, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        if len(self._tokens) >= self.max_tokens:
            self._rebuild(self._tokens[len(self._tokens) // 2 :])
        self._tokens.append(token)
        self._index(len(self._tokens) - 1)

    def _index(self, end: int) -> None:
        key = self._key(end)
        if key is not None:
            latest, _, hits = self._ends.get(key, (-1, -1, 0))
            self._ends[key] = (end, latest, hits + 1)

    def _key(self, end: int) -> int | None:
        start = end - self.size_n + 1
        if start < 0:
            return None
        gram = tuple(self._tokens[start : end + 1])
        return None if NO_TOKEN in gram else hash(gram)

    def _rebuild(self, tokens: list[int]) -> None:
        self._tokens, self._ends = [], {}
        for t in tokens:
            self._tokens.append(t)
            self._index(len(self._tokens) - 1)

    def draft(self, limit: int, *, min_hits: int = 1) -> list[int]:
        """What followed the last n tokens the last time they occurred before now, at most
        `limit` tokens (none across a media chunk)."""
        end = len(self._tokens) - 1
        key = self._key(end)
        if key is None or limit <= 0:
            return []
        found = self._previous(key, end, min_hits)
        if found is None:
            return []
        out = []
        for t in self._tokens[found + 1 : found + 1 + limit]:
            if t == NO_TOKEN:
                break
            out.append(t)
        return out

    def _previous(self, key: int, end: int, min_hits: int) -> int | None:
        """The end of the n-gram's occurrence before the one at `end` (checked token by
        token: two n-grams may share a hash)."""
        latest, before, hits = self._ends.get(key, (-1, -1, 0))
        found = before if latest == end else latest
        if found < 0 or hits - 1 < min_hits:  # (the occurrence at `end` is one of the hits)
            return None
        n = self.size_n
        if self._tokens[found - n + 1 : found + 1] != self._tokens[end - n + 1 : end + 1]:
            return None
        return found


class DraftLength:
    """How many drafts a slot asks for next: doubled after a step whose drafts were all
    accepted, halved after one that missed at the first; after misses in a row the slot
    pauses drafting for as many steps as it missed (at most `max_pause`), so free text costs
    next to nothing."""

    def __init__(self, n_max: int, *, start: int = 4, max_pause: int = 16):
        self.n_max = n_max
        self.k = min(start, n_max)
        self.max_pause = max_pause
        self._misses = 0
        self._pause = 0

    def limit(self) -> int:
        """The drafts to ask for this step (0: draft none)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.k

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        if num_accepted == num_drafted:
            self.k = min(self.n_max, max(1, 2 * self.k))
            self._misses = 0
        elif num_accepted == 0:
            self.k = max(1, self.k // 2)
            self._misses += 1
            self._pause = min(self.max_pause, self._misses)
        else:
            self.k = max(1, min(self.n_max, num_accepted + 1))
            self._misses = 0


class Speculation:
    """One request's drafting: the sequence's tokens so far (indexed), and its draft length."""

    def __init__(self, config: SpecConfig, history: Iterable[int]):
        self.config = config
        self.index = NgramIndex(config.size_n, max_tokens=max(HISTORY_TOKENS, 4 * config.size_n))
        self.index.extend(history)
        self.length = DraftLength(config.n_max)

    def drafts(self, room: int) -> tuple[int, ...]:
        """The drafts to verify after the sequence's last token, at most `room` of them."""
        k = min(self.length.limit(), room, self.config.size_m)
        if k < max(1, self.config.n_min):
            return ()
        min_hits = self.config.min_hits if self.config.type is SpecType.NGRAM_MAP_K else 1
        found = self.index.draft(k, min_hits=min_hits)
        return tuple(found) if len(found) >= self.config.n_min else ()

    def took(self, token: int) -> None:
        """A token the target sampled: the history's newest."""
        self.index.append(token)

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        self.length.update(num_drafted, num_accepted)
