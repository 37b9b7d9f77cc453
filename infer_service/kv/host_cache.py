"""Sequences that lost their slot, kept in host memory so that their conversation resumes
without a re-prefill: each entry is a ledger (with its evicted history) and the KV state of
its sequence, least recently used out first, bounded in bytes.

Pure Python: the engine takes the state out of llama.cpp and puts it back.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence, Set
from dataclasses import dataclass

from infer_service.kv.ledger import Item, Ledger


@dataclass(frozen=True)
class Reuse:
    """How much of a request a ledger already holds, and what is left to decode."""

    num_segments: int
    num_tokens: int  # of the next segment
    rest: list[Item]
    num_cells: int  # reused
    continued: bool  # by the continuation rule (else the exact one)


def reuse_of(ledger: Ledger | None, items: Sequence[Item]) -> Reuse | None:
    """The better of the continuation and the exact-prefix rule for a stateless request."""
    if ledger is None:
        return None
    found = ledger.continuation(items)
    continued = found is not None
    if found is None:
        found = ledger.common_prefix(items, exact=True)
    si, so, rest = found
    k = ledger.cut_point(si, so)
    if k is not None:  # (recurrent memory: from the checkpoint before it, decoded again)
        si, so, rest = k, 0, [*ledger.redo(k, si, so), *rest]
    cells = sum(seg.num_cells for seg in ledger.segments[:si]) + so
    return Reuse(si, so, rest, cells, continued)


# (adapter id, scale) of each LoRA adapter a sequence's cells were decoded under, by id, of
# scales other than 0 (none: ())
LoraSet = tuple[tuple[int, float], ...]
# (tenant, cache salt, LoRA adapters): KV is reused only under the same key
ReuseKey = tuple[str, str, LoraSet]


@dataclass
class _Entry:
    ledger: Ledger
    state: bytes | bytearray | memoryview
    reuse_key: ReuseKey

    @property
    def num_bytes(self) -> int:
        """The KV bytes, the ledger's checkpoints, and what its token ids cost in Python
        (about 8 per atom)."""
        ledger = self.ledger
        return (
            len(self.state)
            + ledger.num_mark_bytes
            + 8 * (ledger.num_cells + ledger.num_history_atoms)
        )


class HostSequenceCache:
    """Sequences that lost their slot, kept in host RAM: a ledger and its KV state each."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._keys = itertools.count()
        self.hits = 0
        self.stored = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def put(
        self, ledger: Ledger, state: bytes | bytearray | memoryview, reuse_key: ReuseKey
    ) -> None:
        entry = _Entry(ledger, state, reuse_key)
        if entry.num_bytes > self.max_bytes:
            return
        self._entries[next(self._keys)] = entry
        self.num_bytes += entry.num_bytes
        self.stored += 1
        while self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.num_bytes

    def best(
        self, items: Sequence[Item], reuse_key: ReuseKey, skip: Set[int] = frozenset()
    ) -> tuple[int, Reuse] | None:
        """The entry of this reuse key that holds the most of items (continuing it, or by
        exact prefix); `skip`: entries promised to others already."""
        found: tuple[int, Reuse] | None = None
        for key, entry in self._entries.items():
            if entry.reuse_key != reuse_key or key in skip:
                continue
            reuse = reuse_of(entry.ledger, items)
            if (
                reuse is not None
                and reuse.num_cells
                and (found is None or reuse.num_cells > found[1].num_cells)
            ):
                found = (key, reuse)
        return found

    def take(self, key: int) -> tuple[Ledger, bytes | bytearray | memoryview]:
        entry = self._entries.pop(key)
        self.num_bytes -= entry.num_bytes
        self.hits += 1
        return entry.ledger, entry.state
