"""The ledger: the exact per-sequence account of what sits in the KV cache, and eviction plans.

One ``Ledger`` per sequence. Before every ``llama_decode`` the engine asks ``ensure(num_cells,
num_positions)`` and gets a plan (``Fits``, ``Shift``, ``Gap``, ``Reprefill`` or ``CannotFit``),
carries it out with llama.cpp calls, reports it with ``apply(plan)``, decodes, and reports the
decode with ``append(item)``. The ledger never talks to llama.cpp and imports only the stdlib.

Cells and positions are separate axes: a text token uses 1 cell and 1 position; a media chunk
uses ``num_cells`` cells and advances the position by ``num_positions`` (M-RoPE: far fewer).

Choices worth knowing:

- Pinning (``keep``): an appended item is pinned when it starts inside the first ``keep`` cells,
  so the boundary is rounded up to whole items, and a media group that starts pinned stays
  pinned to its end. Pinned segments are always a prefix.
- A media group is a run of consecutive segments sharing a ``group`` id (so ids may be reused by
  later prompts). ``ensure(..., group=g)`` says the next item belongs to group ``g``: a run of
  ``g`` at the end of the sequence is still being built and is not evicted.
- Discard amount: ``max(needed, ceil(discard_fraction * evictable))`` cells, rounded up to whole
  units, oldest unpinned units first.
- GAP keeps positions, except that when an eviction removes the newest segments, ``next_pos``
  falls back to the end of the newest kept segment (llama.cpp requires ``Y = X + 1`` for models
  without M-RoPE). Under GAP (and AUTO without shift) a request whose positions would pass
  ``n_ctx_train`` gets a ``Reprefill`` even when its cells fit; if nothing must be evicted it
  evicts nothing and only renumbers the positions from 0.
- SHIFT on a ledger with ``can_shift=False`` resolves like AUTO does there (GAP, then REPREFILL).
- ``admit`` returns (does not raise) ``CannotFit``.
- Recurrent memory (``recurrent=True``: Qwen3.5, LFM2, Mamba; a state per sequence beside the
  attention cells, which llama.cpp cannot cut back): a sequence can be cut back only to a
  *checkpoint* (``mark``: the recurrent state saved at a segment boundary), to nothing, or not at
  all. ``cut_point`` lowers a reuse point to the last checkpoint at or before it, and evictions
  resolve to ``REPREFILL`` from the checkpoint at the end of the pinned segments (``Reprefill.
  num_prefix``): what is kept then equals a fresh prefill of it, the recurrent state included.
"""

from __future__ import annotations

import bisect
import copy
import enum
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

# how much evicted history a sequence remembers for `continuation`, in atoms per cell of capacity
MAX_HISTORY_FACTOR = 8
_SERIALS = itertools.count(1)

__all__ = [
    "Admission",
    "CannotFit",
    "ContextConfig",
    "EvictionUnit",
    "Fits",
    "Gap",
    "Item",
    "Ledger",
    "Plan",
    "Policy",
    "Reprefill",
    "Segment",
    "Shift",
    "atoms",
    "num_pinned",
]


class Policy(enum.Enum):
    AUTO = "auto"
    SHIFT = "shift"
    GAP = "gap"
    REPREFILL = "reprefill"
    STOP = "stop"


class EvictionUnit(enum.Enum):
    TOKEN = "token"
    MESSAGE = "message"


@dataclass(frozen=True)
class ContextConfig:
    """How a request wants its sequence managed when the cache is full."""

    policy: Policy = Policy.AUTO
    keep: int = 0
    discard_fraction: float = 0.5
    unit: EvictionUnit = EvictionUnit.TOKEN
    truncate_prompt: bool = False


@dataclass(frozen=True)
class Item:
    """What the engine puts in the cache: one prompt chunk, or generated tokens."""

    num_cells: int
    num_positions: int
    message_index: int
    token_ids: tuple[int, ...] = ()
    media_id: str | None = None
    group: int | None = None
    generated: bool = False  # sampled by the model, not part of a prompt
    # generated inside a reasoning model's thought (runner/reasoning.py): the tokens of one
    # thought are one eviction unit, whatever the unit
    thought: bool = False

    def __post_init__(self) -> None:
        if self.message_index < 0:
            raise ValueError(f"message_index must be >= 0, got {self.message_index}")
        if self.media_id is None:
            if not self.num_cells == self.num_positions == len(self.token_ids) > 0:
                raise ValueError(
                    "a text item needs num_cells == num_positions == len(token_ids) > 0, got "
                    f"{self.num_cells}, {self.num_positions}, {len(self.token_ids)}"
                )
        elif self.token_ids or self.num_cells < 1 or self.num_positions < 1:
            raise ValueError("a media item needs no token_ids, num_cells >= 1, num_positions >= 1")

    @classmethod
    def text(
        cls, token_ids: Sequence[int], message_index: int, *, group: int | None = None
    ) -> Item:
        ids = tuple(token_ids)
        return cls(len(ids), len(ids), message_index, ids, None, group)

    @classmethod
    def media(
        cls,
        media_id: str,
        num_cells: int,
        num_positions: int,
        message_index: int,
        *,
        group: int | None = None,
    ) -> Item:
        return cls(num_cells, num_positions, message_index, (), media_id, group)

    @property
    def is_media(self) -> bool:
        return self.media_id is not None


@dataclass(frozen=True)
class Segment:
    """An item as it sits in the cache, from position ``pos_start``."""

    item: Item
    pos_start: int
    pinned: bool

    @property
    def num_cells(self) -> int:
        return self.item.num_cells

    @property
    def num_positions(self) -> int:
        return self.item.num_positions

    @property
    def pos_end(self) -> int:
        return self.pos_start + self.item.num_positions

    @property
    def message_index(self) -> int:
        return self.item.message_index

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.item.token_ids

    @property
    def media_id(self) -> str | None:
        return self.item.media_id

    @property
    def group(self) -> int | None:
        return self.item.group

    @property
    def is_media(self) -> bool:
        return self.item.is_media


class _Evicts:
    """Totals over ``evicted`` (exactly what leaves the cache)."""

    evicted: tuple[Segment, ...]

    @property
    def num_cells_evicted(self) -> int:
        return sum(s.num_cells for s in self.evicted)

    @property
    def num_positions_evicted(self) -> int:
        return sum(s.num_positions for s in self.evicted)

    @property
    def media_ids_evicted(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.media_id for s in self.evicted if s.media_id is not None))


@dataclass(frozen=True)
class Fits:
    """Nothing to do."""


@dataclass(frozen=True)
class Shift(_Evicts):
    """``seq_rm(p0, p1)``, then ``seq_add(p1, -1, -delta)``: later positions move back."""

    p0: int
    p1: int
    evicted: tuple[Segment, ...]

    @property
    def delta(self) -> int:
        return self.p1 - self.p0


@dataclass(frozen=True)
class Gap(_Evicts):
    """``seq_rm(p0, p1)`` only; kept positions do not move."""

    p0: int
    p1: int
    evicted: tuple[Segment, ...]


@dataclass(frozen=True)
class Reprefill(_Evicts):
    """Clear the sequence, then decode ``kept`` again from position 0, in order. With
    ``num_prefix`` (recurrent memory): the first ``num_prefix`` segments stay (the checkpoint
    after them is restored and the cells after them removed); the rest of ``kept`` is decoded."""

    kept: tuple[Item, ...]
    evicted: tuple[Segment, ...]
    num_prefix: int = 0


@dataclass(frozen=True)
class CannotFit:
    num_cells_needed: int
    num_capacity_cells: int
    num_pinned_cells: int

    @property
    def message(self) -> str:
        return (
            f"needs {self.num_cells_needed} KV cells; the sequence holds "
            f"{self.num_capacity_cells}, {self.num_pinned_cells} of them pinned"
        )


Plan = Fits | Shift | Gap | Reprefill | CannotFit


@dataclass(frozen=True)
class Admission:
    """A prompt admitted: decode ``kept`` in order; ``dropped`` were truncated away."""

    kept: tuple[Item, ...]
    dropped: tuple[Item, ...] = ()

    @property
    def num_cells_dropped(self) -> int:
        return sum(i.num_cells for i in self.dropped)

    @property
    def num_positions_dropped(self) -> int:
        return sum(i.num_positions for i in self.dropped)

    @property
    def media_ids_dropped(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i.media_id for i in self.dropped if i.media_id is not None))


def text_like(item: Item, token_ids: tuple[int, ...]) -> Item:
    """Part of a text item: same message, group and origin, fewer tokens."""
    n = len(token_ids)
    return replace(item, num_cells=n, num_positions=n, token_ids=token_ids)


def _split(seg: Segment, num_head: int) -> tuple[Segment, Segment]:
    """Split an ungrouped text segment after ``num_head`` tokens."""
    ids = seg.token_ids
    head = Segment(text_like(seg.item, ids[:num_head]), seg.pos_start, seg.pinned)
    tail = Segment(text_like(seg.item, ids[num_head:]), seg.pos_start + num_head, seg.pinned)
    return head, tail


def _closed(seq: Sequence[Segment | Item], i: int, offset: int) -> bool:
    """A cut before element i (offset tokens into it) splits no media group."""
    if offset:
        return seq[i].group is None
    if i == 0 or i >= len(seq):
        return True
    group = seq[i - 1].group
    return group is None or seq[i].group != group


def atoms(seq: Sequence[Segment | Item]) -> tuple[object, ...]:
    """What a run of items puts in the cache, atom by atom (a token id, or a media id): two
    runs with the same atoms from position 0 hold the same KV."""
    return tuple(
        itertools.chain.from_iterable(
            (x.media_id,) if x.media_id is not None else x.token_ids for x in seq
        )
    )


def common_atoms(a: Sequence[Segment | Item], b: Sequence[Segment | Item]) -> int:
    """How many leading atoms two runs share: runs of text compared whole (a burst of chats
    on one 1,600-token system prompt compared it atom by atom, a millisecond a slot, for
    every slot a request might take)."""
    n = i = j = oi = oj = 0
    while i < len(a) and j < len(b):
        x, y = a[i], b[j]
        if x.media_id is not None or y.media_id is not None:
            if x.media_id != y.media_id or oi or oj:
                return n
            n, i, j = n + 1, i + 1, j + 1
            continue
        xt, yt = x.token_ids, y.token_ids
        k = min(len(xt) - oi, len(yt) - oj)
        whole = oi == oj == 0 and len(xt) == len(yt)
        if not (xt == yt if whole else xt[oi : oi + k] == yt[oj : oj + k]):
            m = 0
            while xt[oi + m] == yt[oj + m]:
                m += 1
            return n + m
        n, oi, oj = n + k, oi + k, oj + k
        if oi == len(xt):
            i, oi = i + 1, 0
        if oj == len(yt):
            j, oj = j + 1, 0
    return n


def _atom_index(seq: Sequence[Segment | Item]) -> Callable[[int], tuple[int, int]]:
    """(index, token offset) of atom k, looked up by bisection."""
    starts = list(
        itertools.accumulate(
            (1 if x.media_id is not None else len(x.token_ids) for x in seq), initial=0
        )
    )

    def at(k: int) -> tuple[int, int]:
        i = bisect.bisect_right(starts, k) - 1
        return (i, k - starts[i]) if i < len(seq) else (len(seq), 0)

    return at


def num_pinned(items: Sequence[Item], keep: int) -> int:
    """How many of ``items``, appended to an empty ledger that keeps ``keep`` cells, are pinned
    (the ledger's own rule: those that start inside ``keep``, and the rest of a pinned group)."""
    num_cells, last = 0, None
    for i, item in enumerate(items):
        pinned = num_cells < keep or (
            last is not None and item.group is not None and item.group == last.group
        )
        if not pinned:
            return i
        num_cells += item.num_cells
        last = item
    return len(items)


def _num_atoms(seq: Sequence[Segment | Item]) -> int:
    return sum(1 if x.media_id is not None else len(x.token_ids) for x in seq)


def _match(
    held: Sequence[Segment | Item], closed: Sequence[Segment | Item], items: Sequence[Item]
) -> tuple[int, int, list[Item]]:
    """The longest prefix of ``items`` that ``held`` starts with, cut where neither side
    splits a media group (``closed``: ``held`` and what follows it) and leaving at least one
    token of ``items``: (elements of held kept, tokens kept of the next, items left)."""
    n = common_atoms(held, items)
    num_held = _num_atoms(held)
    held_at, items_at = _atom_index(held), _atom_index(items)
    for k in range(min(n, _num_atoms(items) - 1), 0, -1):
        si, so = held_at(k) if k < num_held else (len(held), 0)
        ii, io = items_at(k)
        if _closed(closed, si, so) and _closed(items, ii, io):
            rest = list(items[ii:])
            if io:
                rest[0] = text_like(rest[0], rest[0].token_ids[io:])
            return si, so, rest
    return 0, 0, list(items)


def _thought(seg: Segment) -> bool:
    return seg.item.thought


def _units(segments: Sequence[Segment], unit: EvictionUnit) -> list[list[Segment]]:
    """Group segments into eviction units: media groups, a thought's tokens (a run of thought
    segments of one message), and whole messages in MESSAGE mode (a thought apart from the
    rest of its message: a reply's thoughts can leave before its answer)."""
    units: list[list[Segment]] = []
    for i, seg in enumerate(segments):
        prev = segments[i - 1] if i else None
        same = prev is not None and seg.message_index == prev.message_index
        joined = prev is not None and (
            (seg.group is not None and seg.group == prev.group)
            or (same and _thought(seg) and _thought(prev))
            or (unit is EvictionUnit.MESSAGE and same and _thought(seg) == _thought(prev))
        )
        if joined:
            units[-1].append(seg)
        else:
            units.append([seg])
    return units


def _choose(
    candidates: Sequence[Segment], num_target: int, unit: EvictionUnit
) -> tuple[list[Segment], list[Segment]]:
    """Oldest units first until ``num_target`` cells are freed: returns (evicted, rest)."""
    evicted: list[Segment] = []
    num_freed = 0
    for segs in _units(candidates, unit):
        num_short = num_target - num_freed
        if num_short <= 0:
            break
        seg = segs[0]
        plain = not seg.is_media and seg.group is None and not _thought(seg)
        splittable = unit is EvictionUnit.TOKEN and plain
        if splittable and seg.num_cells > num_short:
            head, tail = _split(seg, num_short)
            return [*evicted, head], [tail, *candidates[len(evicted) + 1 :]]
        evicted.extend(segs)
        num_freed += sum(s.num_cells for s in segs)
    return evicted, list(candidates[len(evicted) :])


class Ledger:
    """The segments of one sequence's KV cache, and the plans that make room in it."""

    def __init__(
        self,
        capacity: int,
        *,
        can_shift: bool,
        n_ctx_train: int,
        policy: Policy = Policy.AUTO,
        keep: int = 0,
        discard_fraction: float = 0.5,
        unit: EvictionUnit = EvictionUnit.TOKEN,
        recurrent: bool = False,
        max_marks: int = 32,
    ) -> None:
        if capacity < 1 or n_ctx_train < 1 or keep < 0:
            raise ValueError("capacity and n_ctx_train must be >= 1, keep >= 0")
        if not 0.0 <= discard_fraction <= 1.0:
            raise ValueError(f"discard_fraction must be in [0, 1], got {discard_fraction}")
        self.capacity = capacity
        self.can_shift = can_shift
        self.n_ctx_train = n_ctx_train
        self.policy = policy
        self.keep = keep
        self.discard_fraction = discard_fraction
        self.unit = unit
        self.recurrent = recurrent  # a state that cannot be cut back sits beside the cells
        self.max_marks = max(0, max_marks)  # (0: none kept)
        # (recurrent) segment count -> the recurrent state after those segments, opaque here
        self._marks: dict[int, bytes] = {}
        self._segments: list[Segment] = []
        # leading segments whose KV equals a fresh prefill of them: nothing before them was
        # evicted since they were decoded (an eviction moves or gaps what follows it)
        self._num_exact = 0
        # what evictions took, oldest first: it sat between the pinned segments and the rest,
        # so pinned + evicted + rest is everything the sequence ever held, in order
        self._evicted: list[Item] = []
        self._num_evicted_atoms = 0
        self._history_complete = True
        self.serial = next(_SERIALS)  # which sequence this is (a copy is another)
        self._recount()

    def _recount(self) -> None:
        self._num_cells = sum(s.num_cells for s in self._segments)
        self._num_positions = sum(s.num_positions for s in self._segments)
        pinned = [s for s in self._segments if s.pinned]
        self._num_pinned_segments = len(pinned)
        self._num_pinned_cells = sum(s.num_cells for s in pinned)

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(self._segments)

    @property
    def num_cells(self) -> int:
        return self._num_cells

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def num_pinned_segments(self) -> int:
        return self._num_pinned_segments

    @property
    def num_history_atoms(self) -> int:
        """Tokens and media chunks remembered of what evictions took."""
        return self._num_evicted_atoms

    @property
    def num_exact_segments(self) -> int:
        """How many leading segments hold exactly what a fresh prefill of them would."""
        return self._num_exact

    @property
    def num_free_cells(self) -> int:
        return self.capacity - self._num_cells

    @property
    def num_pinned_cells(self) -> int:
        return self._num_pinned_cells

    @property
    def next_pos(self) -> int:
        return self._segments[-1].pos_end if self._segments else 0

    def effective_policy(self, num_positions: int = 1) -> Policy:
        """The policy that applies now: AUTO resolved, SHIFT without shift support resolved."""
        if self.policy in (Policy.STOP, Policy.REPREFILL):
            return self.policy
        if self.recurrent:  # evicted cells leave, but the state has seen them: not exact
            return Policy.REPREFILL
        if self.policy in (Policy.AUTO, Policy.SHIFT) and self.can_shift:
            return Policy.SHIFT
        if self.next_pos + num_positions <= self.n_ctx_train:
            return Policy.GAP
        return Policy.REPREFILL

    def _pins(self, last: Segment | None, num_cells_before: int, item: Item) -> bool:
        if num_cells_before < self.keep:
            return True
        return (
            last is not None and last.pinned and item.group is not None and item.group == last.group
        )

    def ensure(
        self, num_cells: int, num_positions: int | None = None, *, group: int | None = None
    ) -> Plan:
        """A plan that leaves room for ``num_cells`` more cells and ``num_positions`` positions.

        ``group``: the media group of the item about to be decoded (its open run is kept).
        """
        if num_positions is None:
            num_positions = num_cells
        if num_cells < 0 or num_positions < 0:
            raise ValueError(f"counts must be >= 0, got {num_cells}, {num_positions}")
        policy = self.effective_policy(num_positions)
        num_needed = self._num_cells + num_cells - self.capacity
        if num_needed <= 0:
            if policy is Policy.REPREFILL and self.next_pos > self._num_positions:
                return Reprefill(kept=tuple(s.item for s in self._segments), evicted=())
            return Fits()
        if policy is Policy.STOP:
            return self._cannot_fit(self._num_cells + num_cells)
        start, end = self._num_pinned_segments, len(self._segments)
        while group is not None and end > start and self._segments[end - 1].group == group:
            end -= 1  # the open run of the group being decoded stays
        candidates = self._segments[start:end]
        num_evictable = sum(s.num_cells for s in candidates)
        if num_evictable < num_needed:
            return self._cannot_fit(self._num_cells - num_evictable + num_cells)
        num_target = max(num_needed, math.ceil(self.discard_fraction * num_evictable))
        chosen, rest = _choose(candidates, num_target, self.unit)
        evicted = tuple(chosen)
        if policy is Policy.SHIFT:
            return Shift(p0=evicted[0].pos_start, p1=evicted[-1].pos_end, evicted=evicted)
        if policy is Policy.GAP:
            return Gap(p0=evicted[0].pos_start, p1=evicted[-1].pos_end, evicted=evicted)
        kept = [*self._segments[:start], *rest, *self._segments[end:]]
        num_prefix = start if start in self._marks else 0
        return Reprefill(kept=tuple(s.item for s in kept), evicted=evicted, num_prefix=num_prefix)

    def _cannot_fit(self, num_cells_needed: int) -> CannotFit:
        return CannotFit(num_cells_needed, self.capacity, self._num_pinned_cells)

    def apply(self, plan: Plan) -> None:
        """The engine carried out ``plan``; Reprefill empties the ledger (re-append ``kept``)."""
        if isinstance(plan, Fits):
            return
        if isinstance(plan, CannotFit):
            raise ValueError("a CannotFit plan has nothing to apply")
        self._remember(plan.evicted)
        if isinstance(plan, Reprefill):
            if plan.num_prefix and plan.num_prefix not in self._marks:
                raise ValueError("the plan keeps a prefix the ledger has no checkpoint for")
            del self._segments[plan.num_prefix :]
            self._num_exact = min(self._num_exact, plan.num_prefix)
            self._drop_marks_after(plan.num_prefix)
            self._recount()
            return
        start = stop = self._num_pinned_segments
        tail: list[Segment] = []
        for k, seg in enumerate(plan.evicted):
            if stop >= len(self._segments):
                raise ValueError("the plan evicts segments the ledger does not hold")
            cur = self._segments[stop]
            stop += 1
            if seg == cur:
                continue
            is_head = (
                k == len(plan.evicted) - 1
                and not cur.is_media
                and cur.group is None
                and seg.num_cells < cur.num_cells
                and _split(cur, seg.num_cells)[0] == seg
            )
            if not is_head:
                raise ValueError("the plan does not match the ledger (stale plan?)")
            tail = [_split(cur, seg.num_cells)[1]]
        rest = tail + self._segments[stop:]
        if isinstance(plan, Shift):
            rest = [replace(s, pos_start=s.pos_start - plan.delta) for s in rest]
        self._segments[start:] = rest
        self._num_exact = min(self._num_exact, start)
        self._drop_marks_after(start)
        self._recount()

    def append(self, item: Item) -> Segment:
        """The engine decoded ``item`` at ``next_pos``."""
        if self._num_cells + item.num_cells > self.capacity:
            raise ValueError(
                f"{item.num_cells} cells do not fit: {self.num_free_cells} free (call ensure first)"
            )
        last = self._segments[-1] if self._segments else None
        seg = Segment(item, self.next_pos, self._pins(last, self._num_cells, item))
        if self._num_exact == len(self._segments):
            self._num_exact += 1
        self._segments.append(seg)
        self._num_cells += item.num_cells
        self._num_positions += item.num_positions
        if seg.pinned:
            self._num_pinned_segments += 1
            self._num_pinned_cells += item.num_cells
        return seg

    def admit(self, items: Sequence[Item], *, truncate: bool) -> Admission | CannotFit:
        """Admit a prompt to be appended after what the ledger holds, with room for 1 token more.

        Cells already held count as staying under STOP; under other policies only the pinned
        ones do (ensure evicts the rest during prefill). Truncation drops just enough of the
        oldest unpinned units of ``items``, never the newest unit: if even that is too much,
        the answer is CannotFit, naming the cells the whole prompt needs.
        """
        scratch: list[Segment] = []
        last = self._segments[-1] if self._segments else None
        num_cells = self._num_cells
        for item in items:
            last = Segment(item, 0, self._pins(last, num_cells, item))
            scratch.append(last)
            num_cells += item.num_cells
        num_staying = self._num_cells if self.policy is Policy.STOP else self._num_pinned_cells
        pinned = [s for s in scratch if s.pinned]
        candidates = scratch[len(pinned) :]
        num_pinned = self._num_pinned_cells + sum(s.num_cells for s in pinned)
        num_total = num_staying + sum(i.num_cells for i in items) + 1
        if num_total <= self.capacity:
            return Admission(kept=tuple(items))
        if truncate:
            dropped, rest = _choose(candidates, num_total - self.capacity, self.unit)
            if rest:
                kept = tuple(s.item for s in pinned + rest)
                return Admission(kept=kept, dropped=tuple(s.item for s in dropped))
        return CannotFit(num_total, self.capacity, num_pinned)

    def clear(self) -> None:
        self._segments.clear()
        self._num_exact = 0
        self._marks.clear()
        self._forget_history()
        self._recount()

    # -- checkpoints of a recurrent state ------------------------------------------------------

    def mark(self, state: bytes) -> None:
        """The recurrent state after every segment held now (saved by the engine). Past
        ``max_marks`` the one nearest the start goes, except the one after the pinned segments
        (what every eviction restores)."""
        if not self.max_marks or not self._segments:
            return
        self._marks[len(self._segments)] = state
        while len(self._marks) > self.max_marks:
            pinned = self._num_pinned_segments
            del self._marks[min(k for k in self._marks if k != pinned or len(self._marks) == 1)]

    @property
    def marks(self) -> Mapping[int, bytes]:
        """Segment count -> the checkpoint there (read-only)."""
        return MappingProxyType(self._marks)

    def num_cells_since_mark(self) -> int:
        """Cells held after the last checkpoint (all of them when there is none)."""
        last = max(self._marks, default=0)
        return sum(s.num_cells for s in self._segments[last:])

    def pos_at(self, num_segments: int, num_tokens: int = 0) -> int:
        """The position after the first segments (and num_tokens of the next)."""
        if num_tokens:
            return self._segments[num_segments].pos_start + num_tokens
        return self._segments[num_segments - 1].pos_end if num_segments else 0

    @property
    def num_mark_bytes(self) -> int:
        return sum(len(state) for state in self._marks.values())

    def keep_newest_marks(self, n: int) -> None:
        """Keep the checkpoint after the pinned segments and the n newest (a sequence kept
        out of its slot holds only what its next turn is likely to cut back to)."""
        newest = sorted(self._marks, reverse=True)[:n]
        for k in [k for k in self._marks if k not in newest and k != self._num_pinned_segments]:
            del self._marks[k]

    def _drop_marks_after(self, num_segments: int) -> None:
        for k in [k for k in self._marks if k > num_segments]:
            del self._marks[k]

    def cut_point(
        self, num_segments: int, num_tokens: int = 0, *, held: int | None = None
    ) -> int | None:
        """Where the sequence can be cut back to keep the first ``num_segments`` (and
        ``num_tokens`` of the next): None, there itself (attention memory, or the end of what
        it holds: ``held`` segments, by default all); else, on recurrent memory, the segment
        count of the last checkpoint at or before it that ends a media group, or 0."""
        end = len(self._segments) if held is None else held
        if not self.recurrent or (num_segments, num_tokens) == (end, 0):
            return None
        for k in sorted(self._marks, reverse=True):
            if k <= num_segments and _closed(self._segments, k, 0):
                return k
        return 0

    def redo(self, start: int, num_segments: int, num_tokens: int = 0) -> list[Item]:
        """The items of segments ``start`` to ``num_segments`` (and ``num_tokens`` of the
        next): what a cut back to ``start`` must decode again to hold them."""
        out = [s.item for s in self._segments[start:num_segments]]
        if num_tokens:
            seg = self._segments[num_segments]
            out.append(text_like(seg.item, seg.token_ids[:num_tokens]))
        return out

    def _remember(self, evicted: Sequence[Segment]) -> None:
        if not self._history_complete:
            return
        self._evicted.extend(s.item for s in evicted)
        self._num_evicted_atoms += sum(1 if s.is_media else s.num_cells for s in evicted)
        if self._num_evicted_atoms > MAX_HISTORY_FACTOR * self.capacity:
            self._forget_history()
            self._history_complete = False  # too long to match: exact reuse only, from now on

    def begin_history(self, dropped: Sequence[Item]) -> None:
        """A prompt truncated right after what is pinned (the ledger holds its pinned
        segments only): what the truncation dropped is history, as if evicted."""
        if len(self._segments) != self._num_pinned_segments:
            raise ValueError("the dropped units must follow the pinned segments")
        self._forget_history()
        if dropped:
            self._remember([Segment(i, 0, False) for i in dropped])

    def _forget_history(self) -> None:
        self._evicted.clear()
        self._num_evicted_atoms = 0
        self._history_complete = True

    def adopt(self, segments: Sequence[Segment]) -> None:
        """An empty ledger takes segments another sequence decoded from position 0 (a shared
        prefix, given to this sequence by a copy of its cells): pinned, exact, no history."""
        if self._segments:
            raise ValueError("only an empty ledger adopts segments")
        if segments and segments[0].pos_start != 0:
            raise ValueError("adopted segments start at position 0")
        num_cells = sum(s.num_cells for s in segments)
        if num_cells > self.capacity:
            raise ValueError(f"{num_cells} adopted cells do not fit in {self.capacity}")
        self._segments = [replace(s, pinned=True) for s in segments]
        self._num_exact = len(self._segments)
        self._marks.clear()
        self._forget_history()
        self._recount()

    def clone(self) -> Ledger:
        """An independent copy (segments and history), for a cache of sequence states."""
        other = copy.copy(self)
        other._segments = list(self._segments)
        other._evicted = list(self._evicted)
        other._marks = dict(self._marks)
        other.serial = next(_SERIALS)
        return other

    # -- reuse across requests (prefix cache, sessions) ----------------------------------------

    def reconfigure(
        self,
        *,
        policy: Policy,
        keep: int,
        discard_fraction: float,
        unit: EvictionUnit,
    ) -> None:
        """New options for the segments already held (a new request in the same sequence).

        Pins are recomputed only when ``keep`` changes: after evictions, a later run of a reused
        group id can sit right after a pinned run, and recomputing would pin it as well.
        """
        same_keep = keep == self.keep
        self.policy, self.keep, self.discard_fraction, self.unit = (
            policy, keep, discard_fraction, unit,
        )  # fmt: skip
        if same_keep:
            return
        self._forget_history()  # it sat after the old pins: where it sits now is not known
        held, self._segments = self._segments, []
        num_cells = 0  # counted as we go: a recount per segment would be quadratic
        for seg in held:
            last = self._segments[-1] if self._segments else None
            self._segments.append(replace(seg, pinned=self._pins(last, num_cells, seg.item)))
            num_cells += seg.num_cells
        self._recount()

    def common_prefix(
        self, items: Sequence[Item], start: int = 0, *, exact: bool = False
    ) -> tuple[int, int, list[Item]]:
        """How much of ``items`` the cache already holds, from segment ``start`` on.

        Returns (segments kept, tokens kept of the next segment, items still to decode). Text is
        compared token by token, media by media_id; a media group is reused whole or not at
        all, and at least one token is left to decode (the next logits come from it).
        ``exact``: match only segments that equal a fresh prefill (``num_exact_segments``), so
        that what the reused cells attended to is exactly the prefix itself.
        """
        end = self._num_exact if exact else len(self._segments)
        si, so, rest = _match(self._segments[start:end], self._segments[start:], items)
        return start + si, so, rest

    def continuation(self, items: Sequence[Item]) -> tuple[int, int, list[Item]] | None:
        """``common_prefix`` for a request that continues what this sequence held, evictions
        and all: ``items`` equal everything the sequence ever held (its evicted units back in
        place) up to its trailing generated tokens, then go on. None for any other request.

        A client that resends a whole conversation every turn is recognised by this, and only
        its new part is decoded after what the sequence holds now (shifted), exactly as a
        session turn would. Deliberate: unrelated requests follow the exact rule.
        """
        if not self._evicted:
            return None
        pinned = self._num_pinned_segments
        logical: list[Segment | Item] = [
            *self._segments[:pinned],
            *self._evicted,
            *self._segments[pinned:],
        ]
        li, lo, rest = _match(logical, logical, items)
        si = li - len(self._evicted)
        if si < max(pinned, self.generated_tail()):
            return None  # it differs before the end of what was decoded: not a continuation
        return si, lo, rest

    def generated_tail(self) -> int:
        """Index of the first segment of the trailing run of generated tokens."""
        i = len(self._segments)
        while i > 0 and self._segments[i - 1].item.generated:
            i -= 1
        return i

    def truncate(self, num_segments: int, num_tokens: int = 0) -> int:
        """Keep the first segments (and num_tokens of the next); returns the position to
        ``seq_rm`` from (everything at or after it leaves the cache)."""
        kept = self._segments[:num_segments]
        if num_tokens:
            seg = self._segments[num_segments]
            if seg.is_media or seg.group is not None or num_tokens >= seg.num_cells:
                raise ValueError("only ungrouped text can be cut inside")
            kept.append(replace(seg, item=text_like(seg.item, seg.token_ids[:num_tokens])))
        if num_segments < self._num_pinned_segments:
            self._forget_history()  # the evicted units sat after the cut
        self._segments = kept
        self._num_exact = min(self._num_exact, len(kept))
        self._drop_marks_after(num_segments)
        self._recount()
        return self.next_pos

    def to_json(self) -> list[dict[str, object]]:
        return [
            {
                "pos": s.pos_start,
                "cells": s.num_cells,
                "positions": s.num_positions,
                "message": s.message_index,
                "tokens": list(s.token_ids),
                "media": s.media_id,
                "group": s.group,
                "generated": s.item.generated,
                "pinned": s.pinned,
                **({"thought": True} if s.item.thought else {}),
            }
            for s in self._segments
        ]

    def load_json(self, data: Sequence[dict[str, Any]]) -> None:
        """Segments saved by to_json, pinned as saved (recomputed from this ledger's keep for
        data without pins). On malformed data (KeyError, TypeError, ValueError) the ledger is
        left as it was."""
        segments: list[Segment] = []
        num_cells = 0  # counted as we go: a recount per segment would be quadratic
        for d in data:
            item = Item(
                int(d["cells"]), int(d["positions"]), int(d["message"]), tuple(d["tokens"]),
                d["media"], d["group"], bool(d.get("generated")), bool(d.get("thought")),
            )  # fmt: skip
            last = segments[-1] if segments else None
            pinned = d.get("pinned")
            if pinned is None:
                pinned = self._pins(last, num_cells, item)
            elif not isinstance(pinned, bool) or (pinned and last is not None and not last.pinned):
                raise ValueError("saved pins must be booleans on a prefix of the segments")
            if last is not None and int(d["pos"]) < last.pos_end:
                raise ValueError("saved segments overlap")
            segments.append(Segment(item, int(d["pos"]), pinned))
            num_cells += item.num_cells
        if num_cells > self.capacity:
            raise ValueError(f"saved segments hold {num_cells} cells, over {self.capacity}")
        self._segments = segments
        self._num_exact = 0  # what a saved sequence attended to is not known
        self._marks.clear()
        self._forget_history()
        self._recount()
