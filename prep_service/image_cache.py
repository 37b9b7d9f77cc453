"""What prep learnt of an image file, by a digest of its bytes: a resent image costs a hash.

OpenAI-style clients send every image of a chat again each turn. Decoding one (and hashing its
pixels for media_id) is most of what a Prepare costs; what comes of it (size, media_id, the
file to send) is small and depends only on the file's bytes and the decode limits, so it is
kept here, least recently used first out, within a bound in bytes. Pixels are never kept.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from slotwise_core.images import ImageFacts

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


class ImageCache:
    """Thread-safe. max_bytes 0 keeps nothing: no file is hashed, every lookup misses."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, max_bytes)
        self._entries: OrderedDict[bytes, tuple[ImageFacts, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = 0
        self._misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @staticmethod
    def key(data: bytes, *, max_pixels: int, max_side: int) -> bytes:
        """The file's digest with the limits that change what decoding it gives (max_side the
        pixels, max_pixels whether it is refused)."""
        h = hashlib.sha256(f"{max_pixels}:{max_side}:".encode())
        h.update(data)
        return h.digest()

    def get(self, key: bytes | None) -> ImageFacts | None:
        """The facts kept for this key (None, as when the cache is off: a miss)."""
        with self._lock:
            if key is not None and (entry := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return entry[0]
            self._misses += 1
            return None

    def put(self, key: bytes, facts: ImageFacts) -> None:
        """Remember facts of a file that decoded (an image that failed never comes here)."""
        size = ENTRY_OVERHEAD + len(facts.reencoded)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (facts, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, len(self._entries), self._bytes, self.max_bytes
            )
