"""llama.cpp's `ngram-cache` drafter (common/ngram-cache.cpp's common_ngram_cache_draft, as
`common_speculative_impl_ngram_cache` in common/speculative.cpp calls it), token for token:
counts of the tokens that followed each 1- to 4-gram; a draft token is the most frequent
follower of the longest n-gram whose counts are both large and lopsided enough, drafted one at
a time (each extends the n-grams the next is looked up with), at most 8. Pure: no llama, no
grpc.

Why counts rather than the latest occurrence (ngram-simple): a short n-gram is followed by
many things; a vote over all its occurrences drafts the usual one, and only when it is usual.

Two caches, as llama.cpp's: the request's own (the context cache, lax thresholds) and the
tenant's (`NgramCacheStore`: llama.cpp's dynamic cache, strict thresholds), made by the caller
and outliving requests; a request gives its context cache to it at `close`, as llama.cpp's
`lookup` example merges it into the dynamic cache at the end (llama-server only reads a dynamic
cache from --lookup-cache-dynamic's file and never updates it). The static cache, read from
--lookup-cache-static's file, is out of scope: there is none, as in llama-server without that
flag (the static counts then weigh every candidate alike).

What is llama.cpp's on purpose, quirks included:
- the context cache learns, at each `propose`, the n-grams inside the tokens that came since the
  last one (the first: the whole history); an n-gram across that boundary is never learnt;
- of two followers equally frequent (50% each, which the lax thresholds let through), the one
  first seen later drafts, as libstdc++'s unordered_map orders them (libc++ builds may differ).

Where slotwise differs: a media chunk (NO_TOKEN) ends n-grams (llama-server drops media from
the tokens it drafts from); an n-gram reaching before the history's first token is not looked
up (llama.cpp reads out of bounds there). Memory is bounded: the history kept is the newest
`max_tokens` tokens; a context cache full at `max_ngrams` starts again from the newest tokens;
a store a request's cache would overfill starts again empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from infer_service.spec.config import HISTORY_TOKENS
from infer_service.spec.proposer import NO_TOKEN

NGRAM_MIN = 1  # LLAMA_NGRAM_MIN
NGRAM_MAX = 4  # LLAMA_NGRAM_MAX
N_DRAFT = 8  # create_state_ngram_cache's n_draft (no flag sets it)
# per n-gram size 1..4: a follower drafts from at least this many samples, at this share
MIN_SAMPLES_LAX = (2, 2, 1, 1)  # draft_min_sample_size_lax (the context cache)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLES_STRICT = (4, 3, 2, 2)  # draft_min_sample_size_strict (the dynamic cache)
MIN_PERCENT_STRICT = (75, 66, 66, 66)
MAX_NGRAMS = 1 << 17  # about 170 bytes each: ~22 MiB at most a cache
COUNT_BITS = 32

# an n-gram's followers: one, packed as token << 32 | count (most n-grams have one: half the
# memory of a dict), or a dict token -> count in the order first seen
Followers = int | dict[int, int]


class NgramCounts:
    """common_ngram_cache: n-gram -> counts of the tokens that followed it, at most
    `max_ngrams` n-grams."""

    def __init__(self, max_ngrams: int = MAX_NGRAMS):
        if max_ngrams < 1:
            raise ValueError(f"max_ngrams must be >= 1, got {max_ngrams}")
        self.max_ngrams = max_ngrams
        self._followers: dict[tuple[int, ...], Followers] = {}

    def __len__(self) -> int:
        return len(self._followers)

    def clear(self) -> None:
        self._followers.clear()

    def count(self, ngram: tuple[int, ...], token: int, times: int = 1) -> bool:
        """`token` followed `ngram` `times` more times (False: a new n-gram found it full)."""
        held = self._followers.get(ngram)
        if held is None:
            if len(self._followers) >= self.max_ngrams:
                return False
            self._followers[ngram] = token << COUNT_BITS | times
        elif isinstance(held, dict):
            held[token] = held.get(token, 0) + times
        elif held >> COUNT_BITS == token and (held & _COUNT_MASK) + times <= _COUNT_MASK:
            self._followers[ngram] = held + times
        else:  # a second follower (or a count past 32 bits): a dict from now on
            followers = {held >> COUNT_BITS: held & _COUNT_MASK}
            followers[token] = followers.get(token, 0) + times
            self._followers[ngram] = followers
        return True

    def followers(self, ngram: tuple[int, ...]) -> list[tuple[int, int]] | None:
        """(token, count) in the order first seen (None: the n-gram is unknown)."""
        held = self._followers.get(ngram)
        if held is None:
            return None
        if isinstance(held, dict):
            return list(held.items())
        return [(held >> COUNT_BITS, held & _COUNT_MASK)]

    def items(self) -> Iterable[tuple[tuple[int, ...], list[tuple[int, int]]]]:
        for ngram in self._followers:
            followers = self.followers(ngram)
            assert followers is not None
            yield ngram, followers

    def learn(self, tokens: Sequence[int]) -> bool:
        """common_ngram_cache_update over `tokens` alone: each 1..4-gram in it and the token
        after it (none with a media chunk). False: it filled up (the rest was not learnt)."""
        last_media = _last_media_at(tokens)
        for size in range(NGRAM_MIN, NGRAM_MAX + 1):
            for i in range(size, len(tokens)):
                if last_media[i] >= i - size:
                    continue
                if not self.count(tuple(tokens[i - size : i]), tokens[i]):
                    return False
        return True


_COUNT_MASK = (1 << COUNT_BITS) - 1


def _last_media_at(tokens: Sequence[int]) -> list[int]:
    """Per position: the last media chunk at or before it (-1: none)."""
    out, last = [], -1
    for i, t in enumerate(tokens):
        if t == NO_TOKEN:
            last = i
        out.append(last)
    return out


class NgramCacheStore(NgramCounts):
    """One tenant's dynamic cache: what its requests' context caches counted. Not locked: it
    is used from the engine's thread only."""

    def merge(self, counts: NgramCounts) -> None:
        """common_ngram_cache_merge; a store it would overfill starts again empty (the newest
        text is the likeliest to come back)."""
        num_new = sum(1 for ngram, _ in counts.items() if self.followers(ngram) is None)
        if len(self) + num_new > self.max_ngrams:
            self.clear()
        for ngram, followers in counts.items():
            for token, times in followers:
                if not self.count(ngram, token, times):
                    break


class NgramCache:
    """One request's `ngram-cache` drafts: its context cache, then its tenant's store."""

    name = "ngram-cache"

    def __init__(
        self,
        store: NgramCacheStore | None = None,
        *,
        n_draft: int = N_DRAFT,
        max_ngrams: int = MAX_NGRAMS,
        max_tokens: int = HISTORY_TOKENS,
    ):
        if n_draft < 0 or max_tokens < 2 * NGRAM_MAX or max_ngrams < 8 * NGRAM_MAX:
            raise ValueError(f"bad n_draft {n_draft}, max_ngrams {max_ngrams} or max_tokens")
        self.store = store
        self.n_draft = n_draft
        self.max_tokens = max_tokens
        self.context = NgramCounts(max_ngrams)
        self._tokens: list[int] = []
        self._num_learnt = 0  # sinfo.cache_size: the history's tokens the context has seen
        self._closed = False

    def __len__(self) -> int:
        return len(self._tokens)  # the history kept

    def append(self, token: int) -> None:
        if len(self._tokens) >= self.max_tokens:
            dropped = len(self._tokens) // 2
            del self._tokens[:dropped]
            self._num_learnt = max(0, self._num_learnt - dropped)
        self._tokens.append(token)

    def propose(self, limit: int) -> list[int]:
        if limit <= 0 or not self._tokens or self._closed:
            return []  # (llama-server drafts only after a token, and where a draft fits)
        self._learn_new_tokens()
        return self._draft()[:limit]

    def _learn_new_tokens(self) -> None:
        """The context cache learns the tokens since the last draft, as one run."""
        if self._num_learnt >= len(self._tokens):
            return
        if not self.context.learn(self._tokens[self._num_learnt :]):
            # full: start again from the newest tokens (at most half full again)
            self.context.clear()
            self.context.learn(self._tokens[-(self.context.max_ngrams // (2 * NGRAM_MAX)) :])
        self._num_learnt = len(self._tokens)

    def _draft(self) -> list[int]:
        """common_ngram_cache_draft with `inp` the history."""
        if len(self._tokens) < 2:  # (LLAMA_NGRAM_STATIC)
            return []
        tail = self._tokens[-NGRAM_MAX:]  # then the drafts: the n-grams are its last tokens
        drafted: list[int] = []
        while len(drafted) < self.n_draft:
            ngrams = _ngrams_ending(tail)
            token = _vote(self.context, ngrams, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
            if token is None and self.store is not None:
                token = _vote(self.store, ngrams, MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT)
            if token is None:
                break
            drafted.append(token)
            tail.append(token)
        return drafted

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        """(llama.cpp's ngram-cache ignores how its drafts fared)"""

    def close(self) -> None:
        """The request's context cache, with the tokens since its last draft, goes to its
        tenant's store."""
        if self._closed:
            return
        self._closed = True
        self._learn_new_tokens()
        if self.store is not None:
            self.store.merge(self.context)
        self.context = NgramCounts(self.context.max_ngrams)
        self._tokens = []


def _ngrams_ending(tail: list[int]) -> list[tuple[int, ...] | None]:
    """Per size 1..4, the n-gram of the last tokens (None: it holds a media chunk or reaches
    before the history)."""
    out: list[tuple[int, ...] | None] = []
    for size in range(NGRAM_MIN, NGRAM_MAX + 1):
        ngram = tuple(tail[len(tail) - size :]) if size <= len(tail) else None
        out.append(None if ngram is None or NO_TOKEN in ngram else ngram)
    return out


def _vote(
    counts: NgramCounts,
    ngrams: list[tuple[int, ...] | None],
    min_samples: tuple[int, ...],
    min_percent: tuple[int, ...],
) -> int | None:
    """try_draft: the longest n-gram's most frequent follower with enough samples and share."""
    for size in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        ngram = ngrams[size - NGRAM_MIN]
        followers = counts.followers(ngram) if ngram is not None else None
        if followers is None:
            continue
        token, best = _most_frequent(followers)
        total = sum(times for _, times in followers)
        if total < min_samples[size - 1] or 100 * best < min_percent[size - 1] * total:
            continue
        return token
    return None


def _most_frequent(followers: list[tuple[int, int]]) -> tuple[int, int]:
    """The most frequent follower; among equals the one first seen last. (Equals only draft
    as two followers at 50%: libstdc++'s unordered_map iterates two the newer first, and
    llama.cpp keeps the first maximum it meets.)"""
    best_token, best = -1, 0
    for token, times in reversed(followers):
        if times > best:
            best_token, best = token, times
    return best_token, best
