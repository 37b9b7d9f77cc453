"""A map bounded in bytes, least recently used out first, thread-safe (stdlib only).

The caches of projector outputs, of checked images (infer) and of what prep learnt of image
files are this one map with their own measure of an entry's bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    def __init__(self, max_bytes: int, size_of: Callable[[V], int]):
        self.max_bytes = max(0, max_bytes)
        self._size_of = size_of
        self._lock = threading.Lock()
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V) -> None:
        """Keep value (one larger than the whole bound is not kept); the least recently used
        go to make room. What goes is only forgotten here: whoever holds it keeps it."""
        size = self._size_of(value)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._items[key] = (value, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                _, (_, freed) = self._items.popitem(last=False)
                self.num_bytes -= freed

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items
