"""llama.cpp's `ngram-mod` drafter (common/ngram-mod.cpp, `common_speculative_impl_ngram_mod`
in common/speculative.cpp), token for token: a fixed table maps the hash of every n_match
tokens seen to the token that followed them; a draft chains lookups from the sequence's last
n_match tokens until one finds nothing. Pure: no llama, no grpc.

Why a shared table: what an agent re-emits (a file it read, a tool result, the answer of the
last turn) was usually seen in an earlier request, not in this one. llama-server keeps one
table for all its slots; slotwise keeps one per tenant (`NgramModPool`, made by the caller and
outliving requests), so no request drafts from another tenant's text. The table is an array of
int32 of a fixed length: its memory never grows, and a collision simply overwrites (a wrong
draft costs a verification, never a wrong output).

What is llama.cpp's on purpose, quirks included:
- `begin` (here at a request's first `propose`, or at `close` if it never proposed) adds the
  prompt's n-grams, then empties the table if more than a quarter of its entries are used;
- each draft first adds the n-grams that came since, but only in chunks of more than 32 tokens
  (the newest tokens reach the table late), and never the one ending at the last token;
- a draft shorter than n_min is dropped, unless it reached n_max;
- five drafts in a row of which under a quarter was accepted empty the table, and the request
  re-adds its whole history at its next draft. The fraction is over the draft's length before
  the caller's `limit` cut it, as llama.cpp counts it: a caller that asks for far fewer than
  n_min tokens keeps the fraction low and the table is emptied often.

Where slotwise differs: a media chunk (NO_TOKEN) in the history ends n-grams (llama-server
drops media from the tokens it drafts from, so its n-grams join the text around an image);
`n_low` starts at 0 with each request (llama-server keeps it per slot, across requests).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

from infer_service.spec.config import HISTORY_TOKENS
from infer_service.spec.proposer import NO_TOKEN

EMPTY = -1  # what a lookup that finds nothing gives (common_ngram_mod::EMPTY)
MULTIPLIER = 6364136223846793005  # common_ngram_mod::idx's
MASK64 = (1 << 64) - 1  # idx computes in size_t
DEFAULT_ENTRIES = 4 * 1024 * 1024  # the table llama.cpp allocates (16 MiB of int32)
MAX_OCCUPANCY = 0.25  # begin(): a table used beyond this is emptied (f_thold)
CHUNK_TOKENS = 32  # a draft adds new n-grams once more than this many came since
LOW_ACCEPTANCE = 0.25  # a draft accepted below this fraction counts as low
MAX_LOW_STREAK = 5  # this many low drafts in a row empty the table


@dataclass(frozen=True)
class NgramModConfig:
    """llama.cpp's `common_params_speculative_ngram_mod` defaults (common/common.h), which
    `--spec-default` sets too."""

    n_match: int = 24  # --spec-ngram-mod-n-match: the n-gram looked up
    n_min: int = 48  # --spec-ngram-mod-n-min: shorter drafts are dropped
    n_max: int = 64  # --spec-ngram-mod-n-max: the longest draft

    def __post_init__(self) -> None:
        # (arg.cpp's ranges)
        if not 1 <= self.n_match <= 1024:
            raise ValueError(f"n_match must be in [1, 1024], got {self.n_match}")
        if not 0 <= self.n_min <= 1024 or not 0 <= self.n_max <= 1024:
            raise ValueError(
                f"n_min and n_max must be in [0, 1024], got {self.n_min}, {self.n_max}"
            )


class NgramModPool:
    """One tenant's table: hash of n_match tokens -> the token that followed them last.
    Not locked: it is used from the engine's thread only."""

    def __init__(self, n_match: int = 24, num_entries: int = DEFAULT_ENTRIES):
        if n_match < 1 or num_entries < 1:
            raise ValueError(f"n_match and num_entries must be >= 1, got {n_match}, {num_entries}")
        self.n_match = n_match
        self._entries = _empty_table(num_entries)
        self._top = pow(MULTIPLIER, n_match - 1, 1 << 64)  # a window's first token's weight
        self.num_used = 0
        self.hits = 0  # proposals, over all its requests, that returned drafts
        self.num_resets = 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._entries.nbytes

    @property
    def occupancy(self) -> float:
        return self.num_used / len(self._entries)

    def reset(self) -> None:
        self._entries = _empty_table(len(self._entries))
        self.num_used = 0
        self.num_resets += 1

    def reset_if_crowded(self) -> bool:
        """llama.cpp's rule at a request's begin: past a quarter used, start afresh (a crowded
        table mostly answers with collisions)."""
        if self.occupancy <= MAX_OCCUPANCY:
            return False
        self.reset()
        return True

    def entry_of(self, tokens: Sequence[int]) -> int:
        """The entry of the n-gram `tokens` (common_ngram_mod::idx)."""
        return window_hash(tokens, 0, self.n_match) % len(self._entries)

    def add_range(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Add, for each i in [start, stop), tokens[i : i + n] -> tokens[i + n] (none that
        holds a media chunk). A rolling hash: O(1) an n-gram."""
        n = self.n_match
        if start >= stop:
            return
        top = self._top
        h = window_hash(tokens, start, n)
        last_media = _last_media(tokens, start, start + n)
        for i in range(start, stop):
            if i > start:  # slide the window one token to the right
                h = ((h - (tokens[i - 1] & MASK64) * top) * MULTIPLIER + tokens[i + n - 1]) & MASK64
            if tokens[i + n] == NO_TOKEN:
                last_media = i + n
            if last_media < i:
                self._store(h % len(self._entries), tokens[i + n])

    def _store(self, slot: int, token: int) -> None:
        if self._entries[slot] == 0:
            self.num_used += 1
        self._entries[slot] = token + 1

    def chain(self, seed: Sequence[int], num_lookups: int) -> list[int]:
        """Up to `num_lookups` tokens, each looked up after the n tokens before it (the last n
        of `seed`, then the tokens found), until a lookup finds nothing."""
        n = self.n_match
        window = list(seed[len(seed) - n :])
        top = self._top
        h = window_hash(window, 0, n)
        found: list[int] = []
        for _ in range(num_lookups):
            token = self._entries[h % len(self._entries)] - 1
            if token == EMPTY:
                break
            found.append(token)
            window.append(token)
            h = ((h - (window[-n - 1] & MASK64) * top) * MULTIPLIER + token) & MASK64
        return found


def _empty_table(num_entries: int) -> memoryview:
    """int32 entries holding token + 1, 0 when unused, in anonymous memory: the kernel gives
    zeroed pages as they are first written, so a new or emptied table costs microseconds
    (filling 16 MiB from Python takes tens of ms, on the engine's thread)."""
    return memoryview(mmap.mmap(-1, 4 * num_entries)).cast("i")


def window_hash(tokens: Sequence[int], start: int, n: int) -> int:
    """common_ngram_mod::idx before its modulo: res = res * K + token over n tokens, in 64
    bits (a negative token counts as its two's complement, as in C++)."""
    h = 0
    for t in tokens[start : start + n]:
        h = (h * MULTIPLIER + t) & MASK64
    return h


def _last_media(tokens: Sequence[int], start: int, stop: int) -> int:
    """The position of the last media chunk in tokens[start:stop] (start - 1: none)."""
    for i in range(stop - 1, start - 1, -1):
        if tokens[i] == NO_TOKEN:
            return i
    return start - 1


class NgramMod:
    """One request's `ngram-mod` drafts from its tenant's pool (llama.cpp's begin/draft/accept
    per sequence). The history kept is the newest HISTORY_TOKENS tokens."""

    name = "ngram-mod"

    def __init__(
        self,
        pool: NgramModPool,
        config: NgramModConfig = NgramModConfig(),
        *,
        max_tokens: int = HISTORY_TOKENS,
    ):
        if config.n_match != pool.n_match:
            raise ValueError(f"n_match {config.n_match} is not the pool's {pool.n_match}")
        if max_tokens < 4 * (config.n_match + 1):
            raise ValueError(f"max_tokens must be >= 4 * (n_match + 1), got {max_tokens}")
        self.pool = pool
        self.config = config
        self.max_tokens = max_tokens
        self.hits = 0  # this request's proposals that returned drafts
        self._tokens: list[int] = []
        self._begun = False
        self._closed = False
        self._next_add = 0  # sinfo.i_last: where the n-grams not yet in the pool start
        self._num_drafted_last = 0  # sinfo.n_draft_last: the last draft before `limit`
        self._num_low = 0  # sinfo.n_low: drafts in a row accepted below a quarter

    def __len__(self) -> int:
        return len(self._tokens)  # the history kept

    def append(self, token: int) -> None:
        if len(self._tokens) >= self.max_tokens:
            self._drop_older_half()
        self._tokens.append(token)

    def _drop_older_half(self) -> None:
        dropped = len(self._tokens) // 2
        del self._tokens[:dropped]
        self._next_add = max(0, self._next_add - dropped)

    def propose(self, limit: int) -> list[int]:
        if limit <= 0 or not self._tokens or self._closed:
            return []  # (llama-server drafts only after a token, and where a draft fits)
        if not self._begun:
            self._begin()
        drafted = self._draft()
        self._num_drafted_last = len(drafted)
        drafted = drafted[:limit]
        if drafted:
            self.hits += 1
            self.pool.hits += 1
        return drafted

    def _begin(self) -> None:
        """llama.cpp's begin with the prompt: every token but the one just sampled."""
        self._begun = True
        self._next_add = 0
        self._num_drafted_last = 0
        n = self.pool.n_match
        prompt_len = len(self._tokens) - 1
        if prompt_len < n:
            return
        self.pool.add_range(self._tokens, 0, prompt_len - n)
        self._next_add = prompt_len - n
        self.pool.reset_if_crowded()

    def _draft(self) -> list[int]:
        """llama.cpp's draft_one, with `prompt` the history but its last token."""
        n, config = self.pool.n_match, self.config
        prompt_len = len(self._tokens) - 1
        if prompt_len < n:
            return []
        if self._next_add + CHUNK_TOKENS < prompt_len:
            self.pool.add_range(self._tokens, self._next_add, prompt_len - n)
            self._next_add = prompt_len - n
        if NO_TOKEN in self._tokens[-n:]:
            return []
        # (all n_max lookups even past `limit`: the low-acceptance count is over them all)
        found = self.pool.chain(self._tokens, config.n_max)
        if len(found) < min(config.n_min, config.n_max):
            return []
        return found

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        """llama.cpp's accept: a streak of low acceptance empties the pool. The fraction is
        of what was verified (llama.cpp's: of what it drafted, before the caller cut it):
        slotwise's slots verify as many drafts as pay their way, often fewer than n_max, and
        a draft accepted whole must not count as low (five of those would empty the
        tenant's pool)."""
        if num_drafted <= 0 or self._num_drafted_last <= 0:
            return
        if num_accepted / num_drafted >= LOW_ACCEPTANCE:
            self._num_low = 0
            return
        self._num_low += 1
        if self._num_low >= MAX_LOW_STREAK:
            self.pool.reset()
            self._num_low = 0
            self._next_add = 0

    def close(self) -> None:
        """llama-server begins with every request it generates for: one that never proposed
        still gives its prompt's n-grams to the pool (its later tokens, as llama.cpp's, only
        through drafts)."""
        if not self._begun and not self._closed:
            self._begin()
        self._closed = True
        self._tokens = []
