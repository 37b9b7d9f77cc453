"""What a person is shown of the KV cache: each slot's sequence as runs of cells, and its
latest shifts with what they evicted. Pure: built from ledger segments, no llama.cpp here
(the engine passes in how a text run's first tokens read).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infer_service.ledger import Segment

__all__ = ["CellKind", "CellRun", "ShiftMark", "SlotPicture", "SlotState", "at_cell", "runs"]

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


@dataclass(frozen=True)
class SlotPicture:
    slot: int
    tenant: str  # whose sequence it holds ("" for nobody's)
    session_id: str  # the session's key ("" for a stateless sequence)
    state: SlotState
    num_cells: int
    next_position: int
    runs: tuple[CellRun, ...] = ()
    shifts: tuple[ShiftMark, ...] = ()


def _kind(seg: Segment) -> CellKind:
    if seg.is_media:
        return CellKind.MEDIA
    return CellKind.GENERATED if seg.item.generated else CellKind.TEXT


def runs(segments: Sequence[Segment], read: Callable[[Sequence[int]], str]) -> tuple[CellRun, ...]:
    """Consecutive segments of one kind, message, medium and pinning, as one run each (a reply
    is one run, not a segment per token); `read` turns a text run's first tokens into words."""
    out: list[CellRun] = []
    tokens: list[list[int]] = []
    for seg in segments:
        kind, media_id = _kind(seg), seg.media_id or ""
        last = out[-1] if out else None
        if (
            last is not None
            and (last.kind, last.pinned, last.message_index, last.media_id)
            == (kind, seg.pinned, seg.message_index, media_id)
            and seg.pos_start == last.pos_start + last.num_positions  # not across a gap
        ):
            out[-1] = replace(
                last,
                num_cells=last.num_cells + seg.num_cells,
                num_positions=seg.pos_end - last.pos_start,
            )
            tokens[-1].extend(seg.token_ids[: PREVIEW_TOKENS - len(tokens[-1])])
            continue
        out.append(
            CellRun(
                kind=kind,
                pinned=seg.pinned,
                message_index=seg.message_index,
                media_id=media_id,
                num_cells=seg.num_cells,
                num_positions=seg.num_positions,
                pos_start=seg.pos_start,
            )
        )
        tokens.append(list(seg.token_ids[:PREVIEW_TOKENS]))
    return tuple(
        replace(run, preview=_preview(read(ids))) if ids else run
        for run, ids in zip(out, tokens, strict=True)
    )


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
