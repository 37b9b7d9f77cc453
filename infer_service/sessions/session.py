"""A session: one conversation's sequence, ledger and options, kept between turns; its
lifecycle state; and the view of it the edge is given (made on the engine thread)."""

from __future__ import annotations

import base64
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from infer_service.kv.ledger import ContextConfig, EvictionUnit, Ledger, Policy
from infer_service.runner.media import MediaHandle, Pixels
from infer_service.runner.runtime import SamplingConfig
from slotwise_core.descriptors import Fingerprint
from slotwise_core.keys import DEFAULT_TENANT

MAX_RECORDS = 256  # turn records a session keeps (the oldest go first)


@dataclass(frozen=True)
class SessionLimits:
    """A tenant's share of sessions and how long one lives without a turn (0: no limit)."""

    max_sessions: int = 1000  # per tenant: its least recently used one makes way for a new one
    max_bytes: int = 10 << 30  # per tenant, on disk: files and the pixels their images hold
    ttl: float = 30 * 24 * 3600.0  # seconds without a turn (OpenAI keeps stored responses 30 days)


@dataclass
class TenantSessions:
    """A tenant's sessions as this replica knows them, and how many of them ended by limit."""

    num_sessions: int = 0
    num_bytes: int = 0
    num_expired: int = 0
    num_evicted: int = 0


@dataclass(frozen=True)
class TurnRecord:
    """What one completed turn produced, kept with the session (on disk too)."""

    turn: int
    text: str
    reason: int  # FinishReason
    usage: dict[str, Any]  # Usage's fields
    note: bytes = b""
    created: float = 0.0  # time.time()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "note": base64.b64encode(self.note).decode()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TurnRecord:
        return cls(
            turn=int(d["turn"]),
            text=str(d["text"]),
            reason=int(d["reason"]),
            usage=dict(d["usage"]),
            note=base64.b64decode(d["note"]),
            created=float(d["created"]),
        )


class Lifecycle(Enum):
    """Where a session is in its life; one state per session, changed on the engine thread
    only, by the moves `SessionTable.move` allows (infer_service/sessions/table.py)."""

    STORED = "stored"  # its sequence is in no slot (its state: its ledger, and its files)
    RESIDENT = "resident"  # its sequence is in a slot, between turns
    IN_TURN = "in_turn"  # a turn runs: waiting for its swap-in read or a slot, or decoding
    RESTORING = "restoring"  # being read back from disk (RestoreSession)
    DELETING = "deleting"  # deleted; the removal of its files waits on its disk queue
    BROKEN = "broken"  # its file is unusable (the table keeps why)


@dataclass
class DiskState:
    """What persistence knows of a session's files (infer_service/sessions/persistence.py)."""

    dirty: bool = False  # the newest save asked for is not on disk yet (or failed)
    num_saves: int = 0
    num_journal_turns: int = 0  # completed turns written since the last checkpoint asked for
    num_tail_cells: int = 0  # cells those turns decoded
    last_checkpoint: float = 0.0  # time.monotonic() of the last checkpoint asked for


@dataclass
class Session:
    """What one conversation holds. Memory stays bounded by what its ledger holds: media
    handles (libmtmd's preprocessed pixels) only while it is in a slot, pixel metadata and
    RGB bytes only for media its ledger (or the turn being rolled back to) still holds, and
    RGB bytes only until they are on disk."""

    session_id: str
    context: ContextConfig
    sampling: SamplingConfig
    ledger: Ledger
    media: dict[str, MediaHandle] = field(default_factory=dict)  # media key -> native chunk
    pixels: dict[str, Pixels] = field(default_factory=dict)  # media key -> where its pixels are
    rgb: dict[str, bytes] = field(default_factory=dict)  # media_id -> pixels not on disk
    num_turns: int = 0
    num_shifts: int = 0
    state: Lifecycle = Lifecycle.STORED
    slot: int | None = None  # the slot whose sequence holds it (RESIDENT, or IN_TURN)
    # the ledger and shift count of the last completed turn while a turn runs
    rollback: tuple[list[dict[str, Any]], int] | None = None
    last_used: float = field(default_factory=time.monotonic)
    # when it was last used, in wall-clock time (its files' mtime says the same to another
    # replica or a restart: a turn touches them as it begins and writes them as it ends):
    # what its TTL and its tenant's quota count from
    touched: float = field(default_factory=time.time)
    records: deque[TurnRecord] = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))
    title: str = ""
    disk: DiskState = field(default_factory=DiskState)
    # the LoRA adapters its cells in a slot were decoded under, by file ([[digest, scale]]):
    # a turn under others decodes them all again (a checkpoint records them as `kv_lora`)
    kv_lora: list[list[Any]] = field(default_factory=list)

    def release(self) -> None:
        for h in self.media.values():
            h.close()
        self.media.clear()

    def held_keys(self) -> set[str]:
        return {seg.media_id for seg in self.ledger.segments if seg.media_id is not None}

    def prune(self) -> set[str]:
        """Forget media the ledger no longer holds (after a completed or rolled-back turn);
        returns the media ids it no longer refers to in memory."""
        held = self.held_keys()
        for key in [k for k in self.media if k not in held]:
            self.media.pop(key).close()
        before = self.media_ids()
        self.pixels = {k: p for k, p in self.pixels.items() if k in held}
        ids = self.media_ids()
        self.rgb = {m: b for m, b in self.rgb.items() if m in ids}
        return before - ids

    def media_ids(self) -> set[str]:
        return {p.media_id for p in self.pixels.values()}

    def header(
        self, fingerprint: Fingerprint, layout: dict[str, int], kv_digest: str
    ) -> dict[str, Any]:
        """What the session file says besides the KV bytes; kv_digest names the ledger those
        bytes belong to."""
        c = self.context
        return {
            "fingerprint": asdict(fingerprint),
            "layout": layout,
            "kv_digest": kv_digest,
            "kv_lora": self.kv_lora,
            "context": {
                "policy": c.policy.value,
                "keep": c.keep,
                "discard_fraction": c.discard_fraction,
                "unit": c.unit.value,
                "truncate_prompt": c.truncate_prompt,
            },
            "sampling": asdict(self.sampling),
            "ledger": self.ledger.to_json(),
            "pixels": {k: asdict(p) for k, p in self.pixels.items()},
            "num_turns": self.num_turns,
            "num_shifts": self.num_shifts,
            "records": [r.to_json() for r in self.records],
            "title": self.title,
        }

    @classmethod
    def from_header(cls, session_id: str, header: dict[str, Any], new_ledger: Any) -> Session:
        """Rebuild from a header (KeyError/TypeError/ValueError on a malformed one)."""
        c = header["context"]
        context = ContextConfig(
            policy=Policy(c["policy"]),
            keep=int(c["keep"]),
            discard_fraction=float(c["discard_fraction"]),
            unit=EvictionUnit(c["unit"]),
            truncate_prompt=bool(c["truncate_prompt"]),
        )
        ledger: Ledger = new_ledger(context)
        ledger.load_json(header["ledger"])
        return cls(
            session_id=session_id,
            context=context,
            sampling=SamplingConfig(**header["sampling"]),
            ledger=ledger,
            pixels={k: Pixels(**p) for k, p in header["pixels"].items()},
            num_turns=int(header["num_turns"]),
            num_shifts=int(header["num_shifts"]),
            records=deque(
                map(TurnRecord.from_json, header.get("records", ())), maxlen=MAX_RECORDS
            ),  # (files before turn records have none)
            title=str(header.get("title", "")),  # (nor titles)
            disk=DiskState(num_journal_turns=int(header.get("journal", 0))),
        )

    def view(self, num_records: int = 0) -> SessionView:
        """What the edge may read of it (call on the engine thread)."""
        return SessionView(
            key=self.session_id,
            title=self.title,
            num_turns=self.num_turns,
            num_cells=self.ledger.num_cells,
            next_position=self.ledger.next_pos,
            resident=self.slot is not None,
            context=self.context,
            sampling=self.sampling,
            num_shifts=self.num_shifts,
            num_media=sum(1 for seg in self.ledger.segments if seg.is_media),
            records=tuple(self.records)[-num_records:] if num_records else (),
        )


@dataclass(frozen=True)
class SessionView:
    """A session as of one moment on the engine thread: the edge never reads a live one."""

    key: str  # its id in its tenant's namespace (`scoped`)
    title: str
    num_turns: int
    num_cells: int
    next_position: int
    resident: bool
    context: ContextConfig
    sampling: SamplingConfig
    num_shifts: int
    num_media: int
    records: tuple[TurnRecord, ...] = ()


def scoped(tenant: str, session_id: str) -> str:
    """A session's key: its id in its tenant's namespace. Another tenant's session of the same
    id is another session, so no call of one tenant can reach, or learn of, another's."""
    return session_id if tenant == DEFAULT_TENANT else f"{tenant}@{session_id}"


def owner_of(key: str) -> str:
    tenant, sep, _ = key.partition("@")
    return tenant if sep else DEFAULT_TENANT


def public_id(key: str) -> str:
    return key.partition("@")[2] or key
