"""llama.cpp's `ngram-map-k4v` drafter (common/ngram-map.cpp, `common_ngram_map` with
key_only false), token for token: the last size_n tokens are a key; the m-grams (size_m
tokens) that followed the key's earlier occurrences are its values, up to four, counted; the
key drafts when it occurred min_hits times and its most frequent value is at least twice as
frequent as the others together. Pure: no llama, no grpc.

Why not just the latest continuation (ngram-simple, drafting.py): in code and structured text
a key is often followed by several things (`return` then one of a few expressions); drafting
only where one continuation dominates keeps the misses, which cost verification, rare.

llama.cpp scans the history for the key (from a hash map of n-gram -> first index stored) and
scans it again to count each key's values; here both are dict lookups: every n-gram's start is
chained to the previous start of the same n-gram, and llama.cpp's hash map is kept with its
exact buckets (its collisions decide which occurrence a draft continues, so they are kept).

What is llama.cpp's on purpose, quirks included:
- the prompt is the history before the first `propose` but its last token (llama.cpp's begin);
  a key is first looked up in the hash map, then among the prompt's n-grams, then among the
  ones after it (each time only those not yet in the hash map: the map holds the older ones);
- a value's statistics are counted over [the key's last counted match, this match], both ends
  included: a match found again is counted again;
- the draft is what followed the match found, cut to as many tokens as the chosen value had
  accepted the last time it drafted (all size_m at first; 0 once none was: it then drafts
  nothing again in this request) - the chosen value decides the length, not the tokens;
- the key's hit count rises with each lookup that finds it, before min_hits is checked.

Where slotwise differs: a media chunk (NO_TOKEN) ends n-grams and a draft stops before it
(llama-server drafts from the text tokens only, joined across an image); each request starts
with an empty map (llama-server keeps one per slot and prunes it when the next prompt of the
slot is shorter); the history is the newest `max_tokens` tokens: past them, the older half goes
and the map starts again from the rest, as from a new prompt.
"""

from __future__ import annotations

from array import array

from infer_service.spec.config import HISTORY_TOKENS
from infer_service.spec.proposer import NO_TOKEN

LCG_FACTOR = 2654435761  # common_ngram_map_hash's multiplier
MASK64 = (1 << 64) - 1  # (the hash is kept in 64 bits: its low 32 are llama.cpp's uint32)
KEY_MAP_BUCKETS = 262144  # COMMON_NGRAM_HASH_MAP_SIZE (a power of two: the low 18 bits)
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT: where counts saturate


class _KeyStats:
    """common_ngram_map_key: how often a key was looked up and found, and its values."""

    __slots__ = ("key_idx", "num_found", "stat_idx", "value_accepted", "value_count", "value_idx")

    def __init__(self, key_idx: int, size_m: int):
        self.key_idx = key_idx  # where the key was first found
        self.stat_idx = 0  # counted up to here (inclusive)
        self.num_found = 0  # key_num
        self.value_idx = [0] * MAX_VALUES  # where the value m-gram starts (0: unused slot)
        self.value_count = [0] * MAX_VALUES  # value_num
        self.value_accepted = [size_m] * MAX_VALUES  # n_accepted: its last draft's accepted


class NgramMapK4v:
    """One request's `ngram-map-k4v` drafts from its own history."""

    name = "ngram-map-k4v"

    def __init__(
        self,
        size_n: int = 12,
        size_m: int = 48,
        min_hits: int = 1,
        *,
        max_tokens: int = HISTORY_TOKENS,
    ):
        # (arg.cpp's ranges)
        if not 1 <= size_n <= 1024 or not 1 <= size_m <= 1024 or min_hits < 1:
            raise ValueError(f"bad size_n {size_n}, size_m {size_m} or min_hits {min_hits}")
        if max_tokens < 4 * (2 * size_n + size_m):
            raise ValueError(f"max_tokens must be >= 4 * (2 * size_n + size_m), got {max_tokens}")
        self.size_n = size_n
        self.size_m = size_m
        self.min_hits = min_hits
        self.max_tokens = max_tokens
        self._top = pow(LCG_FACTOR, size_n - 1, 1 << 64)  # a window's first token's weight
        self._closed = False
        self._reset([])

    def _reset(self, tokens: list[int]) -> None:
        """An empty map over `tokens` (llama.cpp's state before begin)."""
        self._tokens: list[int] = []
        self._hash = 0  # of the last size_n tokens
        self._last_media = -1
        # per start of an n-gram: its bucket in the key map (-1: holds a media chunk), and the
        # previous start of the same n-gram (-1: none)
        self._bucket_at = array("i")
        self._previous_start = array("i")
        self._latest_start: dict[int, int] = {}  # n-gram's hash -> its latest start
        self._key_map: dict[int, int] = {}  # bucket -> the start llama.cpp's map holds there
        self._key_map_last_idx = 0
        self._size_last_begin = 0
        self._begun = False
        self._keys: dict[tuple[int, ...], _KeyStats] = {}
        self._last_draft: tuple[_KeyStats, int] | None = None
        for t in tokens:
            self._push(t)

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        if len(self._tokens) >= self.max_tokens:
            self._reset(self._tokens[len(self._tokens) // 2 :])
        self._push(token)

    def _push(self, token: int) -> None:
        """Append, and index the n-gram it ends (a rolling hash: O(1))."""
        n, tokens = self.size_n, self._tokens
        position = len(tokens)
        tokens.append(token)
        if token == NO_TOKEN:
            self._last_media = position
        if position >= n:
            self._hash -= (tokens[position - n] & MASK64) * self._top
        self._hash = (self._hash * LCG_FACTOR + token) & MASK64
        start = position - n + 1
        if start < 0:
            return
        if self._last_media >= start:
            self._bucket_at.append(-1)
            self._previous_start.append(-1)
            return
        self._bucket_at.append(self._hash % KEY_MAP_BUCKETS)
        self._previous_start.append(self._latest_start.get(self._hash, -1))
        self._latest_start[self._hash] = start

    def propose(self, limit: int) -> list[int]:
        if limit <= 0 or not self._tokens or self._closed:
            return []  # (llama-server drafts only after a token, and where a draft fits)
        if not self._begun:
            # begin with the prompt (the history but the token just sampled), on an empty map
            self._begun = True
            self._size_last_begin = max(0, len(self._tokens) - 1)
        drafted = self._draft()
        if NO_TOKEN in drafted:
            drafted = drafted[: drafted.index(NO_TOKEN)]
        return drafted[:limit]

    def _draft(self) -> list[int]:
        """common_ngram_map_draft, with `inp` the history but its last token."""
        self._last_draft = None
        n, m = self.size_n, self.size_m
        inp_len = len(self._tokens) - 1
        if inp_len < 2 * n + m:
            return []
        match = self._find_key()
        self._fill_key_map(inp_len)
        if match == 0:
            return []
        key = tuple(self._tokens[inp_len - n + 1 :])
        stats = self._keys.get(key)
        if stats is None:
            stats = self._keys[key] = _KeyStats(match, m)
        stats.num_found = min(stats.num_found + 1, MAX_VALUE_COUNT)
        if stats.num_found < self.min_hits:
            return []
        self._count_values(stats, key, match)
        chosen = _dominant_value(stats.value_count)
        if chosen is None:
            return []
        num_drafted = min(m, stats.value_accepted[chosen])
        self._last_draft = (stats, chosen)
        return self._tokens[match + n : match + n + max(0, num_drafted)]

    def _find_key(self) -> int:
        """Where an earlier occurrence of the key (the last size_n tokens) starts, searched
        as llama.cpp does (0: none)."""
        n, m = self.size_n, self.size_m
        inp_len = len(self._tokens) - 1
        key_start = inp_len - n + 1
        if self._last_media >= key_start:
            return 0
        last_start = inp_len - n - m - 1  # (its m-gram, and one more token, fit before)
        held = self._key_map.get(self._hash % KEY_MAP_BUCKETS, 0)
        if held != 0 and held < last_start and self._is_key_at(held):
            return held
        begin_last = self._size_last_begin - n - m - 1
        if begin_last > 0:  # among the prompt's n-grams not yet in the map
            found = self._latest_key_start(self._key_map_last_idx + 1, begin_last)
            if found:
                return found
        # among the ones after the prompt not yet in the map
        lowest = max(self._size_last_begin, self._key_map_last_idx) + 1
        return self._latest_key_start(lowest, last_start)

    def _is_key_at(self, start: int) -> bool:
        n = self.size_n
        return self._tokens[start : start + n] == self._tokens[len(self._tokens) - n :]

    def _latest_key_start(self, lowest: int, highest: int) -> int:
        """The latest start in [lowest, highest] of the key's n-gram (0: none)."""
        start = self._latest_start.get(self._hash, -1)
        while start >= lowest:
            if start <= highest and self._is_key_at(start):
                return start
            start = self._previous_start[start]
        return 0

    def _fill_key_map(self, inp_len: int) -> None:
        """llama.cpp's key map learns the n-grams that came since, newest first, a bucket
        keeping what it got first."""
        n, m = self.size_n, self.size_m
        begin_last = self._size_last_begin - n - m - 1
        if begin_last > 0:
            self._hold(begin_last, self._key_map_last_idx + 1)
        last_start = inp_len - n - m - 1
        self._hold(last_start, max(self._size_last_begin, self._key_map_last_idx) + 1)
        self._key_map_last_idx = max(last_start, self._key_map_last_idx)

    def _hold(self, highest: int, lowest: int) -> None:
        for start in range(highest, lowest - 1, -1):
            bucket = self._bucket_at[start]
            if bucket >= 0:
                self._key_map.setdefault(bucket, start)

    def _count_values(self, stats: _KeyStats, key: tuple[int, ...], match: int) -> None:
        """Count the values after the key's occurrences in [stats.stat_idx, match]."""
        n, m, tokens = self.size_n, self.size_m, self._tokens
        starts = []
        start = self._latest_start.get(self._hash, -1)
        while start >= stats.stat_idx:
            if start <= match and tuple(tokens[start : start + n]) == key:
                starts.append(start)
            start = self._previous_start[start]
        for start in reversed(starts):  # (in order: a new value takes the first free slot)
            value = tokens[start + n : start + n + m]
            slot = _value_slot(stats, value, tokens, start + n, m)
            if slot is not None:
                stats.value_count[slot] = min(stats.value_count[slot] + 1, MAX_VALUE_COUNT)
        stats.stat_idx = match

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        """common_ngram_map_accept: the value's next drafts are as long as this one's
        accepted part."""
        if num_drafted <= 0 or self._last_draft is None:
            return
        stats, slot = self._last_draft
        stats.value_accepted[slot] = num_accepted

    def close(self) -> None:
        """Nothing outlives the request: its memory goes now."""
        self._closed = True
        self._reset([])


def _value_slot(
    stats: _KeyStats, value: list[int], tokens: list[int], value_idx: int, size_m: int
) -> int | None:
    """The slot of the value m-gram (a free one: it is new), None when four others hold
    them all."""
    for slot in range(MAX_VALUES):
        held = stats.value_idx[slot]
        if held == 0:
            stats.value_idx[slot] = value_idx
            stats.value_count[slot] = 0
            stats.value_accepted[slot] = size_m
            return slot
        if tokens[held : held + size_m] == value:
            return slot
    return None


def _dominant_value(counts: list[int]) -> int | None:
    """The most frequent value's slot (the first of equals), unless the others together are
    more than half as frequent (None)."""
    most, chosen = 0, 0
    for slot, count in enumerate(counts):
        if count > most:
            most, chosen = count, slot
    others = sum(counts) - counts[chosen]
    if others > 0 and most < 2 * others:
        return None
    return chosen
