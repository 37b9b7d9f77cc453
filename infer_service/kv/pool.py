"""One pool of KV cells for every sequence (llama.cpp's unified cache), and the table of the
prefixes sequences share in it.

With ``kv_unified`` a cell may belong to several sequences: ``llama_memory_seq_cp`` gives a
sequence a prefix's cells without decoding them again (it only adds the sequence's id to the
cells). A pinned prefix (a system prompt and its images) is decoded once, copied into a
*holder* sequence of its own, and from there into every conversation that opens with it.

The pool counts each cell once: the holders' cells, then each sequence's cells less those it
shares with its holder. A sequence shares a leading run of its holder's cells; a cut that keeps
fewer keeps fewer shared. Shared cells are pinned in the sharing ledger, so no shift moves them
(a shift moves a cell for every sequence that has it) and no eviction plan names them.

A holder nobody shares stays cached, least recently used first, until the pool needs its cells
or its sequence id. Pure Python: the executor makes the llama.cpp calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from infer_service.kv.ledger import Segment

PrefixKey = tuple[Hashable, tuple[object, ...]]  # (whose: tenant and salt, the prefix's atoms)


@dataclass(frozen=True)
class Share:
    """A request's pinned prefix, which sequences may share: its key, its items, its cells."""

    key: PrefixKey
    num_items: int
    num_cells: int


@dataclass(eq=False)
class Holder:
    """A sequence that keeps a shared prefix's cells, and the segments they hold."""

    seq: int
    key: PrefixKey
    segments: tuple[Segment, ...]
    users: set[int] = field(default_factory=set)  # sequences sharing it now
    last_used: int = 0

    @property
    def num_cells(self) -> int:
        return sum(s.num_cells for s in self.segments)

    @property
    def next_pos(self) -> int:
        return self.segments[-1].pos_end if self.segments else 0


@dataclass(frozen=True)
class PoolFigures:
    """The pool as metrics and GetServerInfo show it."""

    num_cells: int
    num_used: int  # each cell once
    num_held: int  # the holders' cells: shared prefixes, stored once
    num_holders: int
    num_holders_in_use: int  # shared by a sequence now


class Pool:
    """The cells of the unified cache: who holds which prefix, and how many cells are used."""

    def __init__(self, num_cells: int, holder_seqs: Iterable[int]):
        if num_cells < 1:
            raise ValueError(f"a pool needs cells, got {num_cells}")
        self.num_cells = num_cells
        self._free_seqs = sorted(holder_seqs, reverse=True)
        self._holders: dict[PrefixKey, Holder] = {}
        self._shares: dict[int, tuple[Holder, int]] = {}  # seq -> (its holder, cells shared)
        self._clock = itertools.count(1)

    # -- reading ------------------------------------------------------------------------------

    @property
    def holders(self) -> tuple[Holder, ...]:
        return tuple(self._holders.values())

    @property
    def num_held_cells(self) -> int:
        return sum(h.num_cells for h in self._holders.values())

    def holder_of(self, seq: int) -> Holder | None:
        share = self._shares.get(seq)
        return share[0] if share else None

    def shared_cells(self, seq: int) -> int:
        """The leading cells of the sequence that are its holder's."""
        share = self._shares.get(seq)
        return share[1] if share else 0

    def num_used(self, cells: Iterable[tuple[int, int]]) -> int:
        """Cells in use, each counted once, given (sequence, cells it holds) of every sequence
        that is not a holder."""
        return self.num_held_cells + self._own(cells)

    def _own(self, cells: Iterable[tuple[int, int]]) -> int:
        """The cells of those sequences that are not their holders'."""
        return sum(n - self.shared_cells(seq) for seq, n in cells)

    def figures(
        self, cells: Iterable[tuple[int, int]], whose: Callable[[Hashable], bool] | None = None
    ) -> PoolFigures:
        """``cells`` as for `num_used`. `whose`: only the holders whose prefix's owner (its
        key's first part) it takes, and ``cells`` should then be that owner's sequences only;
        the pool's size is everyone's."""
        held = [h for h in self._holders.values() if whose is None or whose(h.key[0])]
        num_held = sum(h.num_cells for h in held)
        in_use = sum(1 for h in held if h.users)
        return PoolFigures(self.num_cells, num_held + self._own(cells), num_held, len(held), in_use)

    def get(self, key: PrefixKey) -> Holder | None:
        """The holder of the prefix, if one is kept (a look: not a use)."""
        return self._holders.get(key)

    def find(self, key: PrefixKey) -> Holder | None:
        """The holder of the prefix, if one is kept (it counts as used now)."""
        holder = self._holders.get(key)
        if holder is not None:
            holder.last_used = next(self._clock)
        return holder

    def idle(self) -> list[Holder]:
        """The holders nobody shares, least recently used first (the pool may take them)."""
        return sorted((h for h in self._holders.values() if not h.users), key=_last_used)

    # -- changes ------------------------------------------------------------------------------

    def hold(
        self, key: PrefixKey, segments: Sequence[Segment]
    ) -> tuple[Holder | None, Holder | None]:
        """A new holder for the prefix: (the holder, the idle one whose sequence it takes,
        whose cells must be removed first), or (None, None) when every holder is in use."""
        if key in self._holders or not segments:
            raise ValueError("a prefix is held once, and holds something")
        dropped = None
        if not self._free_seqs:
            idle = self.idle()
            if not idle:
                return None, None
            dropped = idle[0]
            self.drop(dropped)
        holder = Holder(self._free_seqs.pop(), key, tuple(segments), last_used=next(self._clock))
        self._holders[key] = holder
        return holder, dropped

    def drop(self, holder: Holder) -> None:
        """An idle holder leaves (its cells are removed by the caller)."""
        if holder.users:
            raise ValueError(f"holder {holder.seq} is shared by {sorted(holder.users)}")
        del self._holders[holder.key]
        self._free_seqs.append(holder.seq)

    def share(self, seq: int, holder: Holder, num_cells: int | None = None) -> None:
        """The sequence now has the holder's first cells (all of them by default)."""
        n = holder.num_cells if num_cells is None else num_cells
        if not 0 < n <= holder.num_cells or self._holders.get(holder.key) is not holder:
            raise ValueError(f"cannot share {n} cells of holder {holder.seq}")
        self.unshare(seq)
        self._shares[seq] = (holder, n)
        holder.users.add(seq)
        holder.last_used = next(self._clock)

    def cut(self, seq: int, num_cells: int) -> None:
        """The sequence keeps only its first ``num_cells`` cells."""
        share = self._shares.get(seq)
        if share is None or num_cells >= share[1]:
            return
        if num_cells <= 0:
            self.unshare(seq)
        else:
            self._shares[seq] = (share[0], num_cells)

    def unshare(self, seq: int) -> None:
        """The sequence was cleared (or loaded from a saved state: its cells are its own)."""
        share = self._shares.pop(seq, None)
        if share is not None:
            share[0].users.discard(seq)


def _last_used(holder: Holder) -> int:
    return holder.last_used
