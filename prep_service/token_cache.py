"""The tokens of long texts that chats send again and again (a system prompt every chat opens
with, the conversation so far every turn): tokenized once, then a look-up.

Tokenizing a 1,600-token system prompt is most of what a Prepare costs (3 ms of 3.5 on Gemma 3
270M, two cores); a burst of chats on one system prompt paid it once per chat, beside the
engine's own work. Kept per tenant (how fast a Prepare went must not tell one tenant what
another sent), least recently used out first, within a bound in bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

from slotwise_core.lru import SizedLRU

DEFAULT_TOKEN_CACHE_BYTES = 16 << 20
MIN_CACHED_CHARS = 512  # a shorter text tokenizes about as fast as it is looked up
ENTRY_OVERHEAD = 256  # the key's tuple, the order's node


class _Tokens(NamedTuple):
    ids: tuple[int, ...]
    num_bytes: int  # the text's (the key holds it) and the ids'


class TokenCache:
    """Thread-safe. max_bytes 0 keeps nothing."""

    def __init__(self, max_bytes: int = DEFAULT_TOKEN_CACHE_BYTES):
        self._lru: SizedLRU[tuple[str, bool, str], _Tokens] = SizedLRU(
            max_bytes, lambda t: t.num_bytes
        )

    def tokens(
        self, scope: str, text: str, add_special: bool, tokenize: Callable[[], list[int]]
    ) -> tuple[int, ...]:
        """The text's tokens: kept ones, or `tokenize()`'s (kept when the text is long)."""
        if len(text) < MIN_CACHED_CHARS or not self._lru.max_bytes:
            return tuple(tokenize())
        key = (scope, add_special, text)
        found = self._lru.get(key)
        if found is not None:
            return found.ids
        ids = tuple(tokenize())
        size = ENTRY_OVERHEAD + sys.getsizeof(text) + 8 * len(ids)  # (an id in a tuple: 8)
        self._lru.put(key, _Tokens(ids, size))
        return ids

    @property
    def hits(self) -> int:
        return self._lru.hits

    @property
    def misses(self) -> int:
        return self._lru.misses

    @property
    def num_bytes(self) -> int:
        return self._lru.num_bytes
