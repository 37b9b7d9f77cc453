"""What prep learnt of an image file, by a digest of its bytes: a resent image costs a hash.

OpenAI-style clients send every image of a chat again each turn. Decoding one (and hashing its
pixels for media_id) is most of what a Prepare costs; what comes of it (size, media_id, the
file to send) is small and depends only on the file's bytes and the decode limits, so it is
kept here, least recently used first out, within a bound in bytes. Pixels are never kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from slotwise_core.images import ImageFacts
from slotwise_core.lru import SizedLRU

DEFAULT_IMAGE_CACHE_BYTES = 64 << 20
# what an entry costs besides a re-encoded file: the key, the facts, media_id, the order's node
ENTRY_OVERHEAD = 512


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int  # lookups that found nothing (the file was then decoded)
    num_entries: int
    num_bytes: int
    max_bytes: int


class ImageCache(SizedLRU[bytes, ImageFacts]):
    """Thread-safe. max_bytes 0 keeps nothing: no file is hashed, every lookup misses."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, lambda facts: ENTRY_OVERHEAD + len(facts.reencoded))

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @staticmethod
    def key(data: bytes, *, max_pixels: int, max_side: int, scope: str = "") -> bytes:
        """The file's digest with the limits that change what decoding it gives (max_side the
        pixels, max_pixels whether it is refused), within a scope (the caller's tenant: how
        fast a Prepare went must not tell one tenant what another sent)."""
        h = hashlib.sha256(f"{scope}\0{max_pixels}:{max_side}:".encode())
        h.update(data)
        return h.digest()

    def find(self, key: bytes | None) -> ImageFacts | None:
        """The facts kept for this key (None, as when the cache is off: a miss)."""
        if key is None:
            with self._lock:
                self.misses += 1
            return None
        return self.get(key)

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, len(self), self.num_bytes, self.max_bytes)
