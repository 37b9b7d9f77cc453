"""What a person is shown of the KV cache: each slot's sequence as runs of cells, and its
latest shifts with what they evicted. Pure: built from ledger segments, no llama.cpp here
(the engine passes in how a text run's first tokens read).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from infer_service.kv.ledger import Ledger, Segment

__all__ = [
    "CellKind",
    "CellRun",
    "SequenceRuns",
    "SharedPicture",
    "ShiftMark",
    "SlotPicture",
    "SlotState",
    "at_cell",
    "runs",
]

PREVIEW_TOKENS = 48  # a text run's preview reads its first tokens (at most PREVIEW_CHARS)
PREVIEW_CHARS = 48
MAX_SHIFT_MARKS = 8  # per slot


class CellKind(enum.Enum):
    TEXT = "text"
    MEDIA = "media"
    GENERATED = "generated"


class SlotState(enum.Enum):
    FREE = "free"
    IDLE = "idle"
    PREFILLING = "prefilling"
    DECODING = "decoding"


@dataclass(frozen=True)
class CellRun:
    kind: CellKind
    pinned: bool
    message_index: int
    media_id: str
    num_cells: int
    num_positions: int
    pos_start: int
    preview: str = ""


@dataclass(frozen=True)
class ShiftMark:
    id: int
    shift: Any  # the ContextShift event the turn's stream carried (events.py has the stubs)
    at_cell: int
    evicted: tuple[CellRun, ...]
    time: float
    tenant: str  # whose sequence shifted: only its owner is shown the mark
    session_id: str | None
    sequence: int  # the ledger's serial: a mark is shown with its own sequence only


@dataclass(frozen=True)
class SlotPicture:
    slot: int
    tenant: str  # whose sequence it holds ("" for nobody's)
    session_id: str  # the session's key ("" for a stateless sequence)
    state: SlotState
    num_cells: int
    next_position: int
    runs: tuple[CellRun, ...] = ()  # (after the shared prefix's cells, if any)
    shifts: tuple[ShiftMark, ...] = ()
    shared_prefix: int = -1  # (pool) the holder of the shared prefix its sequence opens with
    num_shared_cells: int = 0  # ... its first cells: that prefix's, stored once
    # (recurrent memory) the sequence's recurrent state, and the checkpoints kept of it
    num_recurrent_bytes: int = 0
    num_checkpoints: int = 0
    num_checkpoint_bytes: int = 0


@dataclass(frozen=True)
class SharedPicture:
    """(pool) A shared prefix, shown once: its cells, and the slots whose sequences open with
    it."""

    holder: int  # the sequence that keeps it
    tenant: str  # whose it is (a prefix is shared within one tenant and salt)
    num_cells: int
    slots: tuple[int, ...]
    runs: tuple[CellRun, ...]


def _kind(seg: Segment) -> CellKind:
    if seg.is_media:
        return CellKind.MEDIA
    return CellKind.GENERATED if seg.item.generated else CellKind.TEXT


class _Run:
    """A run being gathered (mutable: a reply grows its run a token at a time)."""

    __slots__ = ("cells", "key", "pos_end", "pos_start", "preview", "read_up_to", "tokens")

    def __init__(self, key: tuple[CellKind, bool, int, str], seg: Segment):
        self.key, self.cells, self.pos_start, self.pos_end = key, 0, seg.pos_start, seg.pos_start
        self.tokens: list[int] = []
        self.preview, self.read_up_to = "", 0

    def take(self, seg: Segment) -> None:
        self.cells += seg.num_cells
        self.pos_end = seg.pos_end
        if len(self.tokens) < PREVIEW_TOKENS:
            self.tokens.extend(seg.token_ids[: PREVIEW_TOKENS - len(self.tokens)])

    def shown(self, read: Callable[[Sequence[int]], str]) -> CellRun:
        if self.read_up_to != len(self.tokens):  # read once per run, until it has its words
            self.preview, self.read_up_to = _preview(read(self.tokens)), len(self.tokens)
        kind, pinned, message_index, media_id = self.key
        return CellRun(
            kind=kind,
            pinned=pinned,
            message_index=message_index,
            media_id=media_id,
            num_cells=self.cells,
            num_positions=self.pos_end - self.pos_start,
            pos_start=self.pos_start,
            preview=self.preview,
        )


def _gather(out: list[_Run], segments: Sequence[Segment]) -> None:
    """Consecutive segments of one kind, message, medium and pinning join one run (not across
    a gap in positions)."""
    for seg in segments:
        key = (_kind(seg), seg.pinned, seg.message_index, seg.media_id or "")
        last = out[-1] if out else None
        if last is None or last.key != key or last.pos_end != seg.pos_start:
            last = _Run(key, seg)
            out.append(last)
        last.take(seg)


def runs(segments: Sequence[Segment], read: Callable[[Sequence[int]], str]) -> tuple[CellRun, ...]:
    """Segments as runs (a reply is one run, not a segment per token); `read` turns a text
    run's first tokens into words."""
    out: list[_Run] = []
    _gather(out, segments)
    return tuple(r.shown(read) for r in out)


class SequenceRuns:
    """One slot's runs, kept up to date from what its ledger appended since the last look (a
    step adds a token: its run grows); any other change (a shift, another sequence) rebuilds
    them. So a look costs what changed, not the length of the sequence."""

    def __init__(self) -> None:
        self._ledger: object = None
        self._skip = 0
        self._num_segments = 0
        self._last: Segment | None = None
        self._runs: list[_Run] = []

    def of(
        self, ledger: Ledger | None, read: Callable[[Sequence[int]], str], skip: int = 0
    ) -> tuple[CellRun, ...]:
        """`skip`: leading segments not shown here (a shared prefix's, shown once)."""
        segments = ledger.segments[skip:] if ledger is not None else ()
        n = self._num_segments
        appended_only = (
            ledger is self._ledger
            and skip == self._skip
            and len(segments) >= n
            and (n == 0 or segments[n - 1] is self._last)
        )
        if not appended_only:
            self._ledger, self._skip, self._runs, n = ledger, skip, [], 0
        _gather(self._runs, segments[n:])
        self._num_segments = len(segments)
        self._last = segments[-1] if segments else None
        return tuple(r.shown(read) for r in self._runs)


def _preview(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def at_cell(segments: Sequence[Segment], evicted: Sequence[Segment]) -> int:
    """The cells in front of the first evicted segment (what stayed before the eviction).
    Positions rise along a sequence, so "in front" is "starts at a lower position" (which also
    holds when the plan evicts only the head of a segment split in two)."""
    if not evicted:
        return 0
    p0 = evicted[0].pos_start
    return sum(s.num_cells for s in segments if s.pos_start < p0)
