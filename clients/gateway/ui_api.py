"""The web page (at /) and the small API behind it: the model's facts, the caller's sessions,
and the live picture of every slot's KV cells (WatchSlots, as server-sent events).

The page and its assets are open (they hold nothing of anyone's); every call behind them takes
the caller's key like the rest of the API, so a tenant sees only its own sessions and slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query
from fastapi import Path as InPath
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from clients.client import AsyncSlotwiseClient, ServerInfo, SessionInfo, SlotwiseError
from clients.gateway import sse
from clients.gateway.errors import call, from_slotwise
from slotwise.v1 import infer_pb2
from slotwise_core.enum_names import short_name as _name  # CELL_KIND_MEDIA -> "media"
from slotwise_core.limits import (
    DEFAULT_WATCH_MS,
    MAX_TITLE_CHARS,
    MIN_WATCH_MS,
    SESSION_ID_PATTERN,
)

__all__ = ["UI_DIR", "add_ui", "is_open_path", "view_json"]

UI_DIR = Path(__file__).with_name("ui")


def is_open_path(path: str) -> bool:
    return path == "/" or path.startswith("/ui/")


# (refused here, as infer would, before it goes into a call's metadata)
SessionId = Annotated[str, InPath(pattern=SESSION_ID_PATTERN)]


class Title(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(default="", max_length=MAX_TITLE_CHARS)


def add_ui(
    app: FastAPI,
    client: Callable[[], AsyncSlotwiseClient],
    *,
    page: bool,
    model_name: str,
    closing: asyncio.Event,
) -> None:
    """The API behind the page always; the page itself unless --no-ui. `closing` ends the KV
    streams (the server's shutdown waits for open responses: a page left open must not hold
    it up)."""
    if page:
        app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")

        @app.get("/", include_in_schema=False)
        async def index() -> FileResponse:
            return FileResponse(UI_DIR / "index.html", headers={"cache-control": "no-cache"})

    @app.get("/slotwise/info")
    async def info() -> dict[str, Any]:
        s = await call(client().server_info())
        return {
            "model": model_name,
            "num_slots": s.num_slots,
            "num_cells_per_slot": s.num_cells_per_slot,
            "uses_mrope": s.uses_mrope,
            "can_shift": s.can_shift,
            **cache_json(s),
        }

    @app.get("/slotwise/sessions")
    async def sessions() -> dict[str, Any]:
        listed = await call(client().list_sessions())
        return {"sessions": [session_json(s) for s in reversed(listed) if s.session_id]}

    @app.post("/slotwise/sessions")
    async def create(body: Title) -> dict[str, Any]:
        return session_json(await call(client().create_session(title=body.title)))

    @app.get("/slotwise/sessions/{session_id}")
    async def get(session_id: SessionId) -> dict[str, Any]:
        s = await call(client().get_session(session_id, num_records=256))
        turns = [
            {
                "turn": r.turn,
                "note": r.note.decode("utf-8", errors="replace"),
                "text": r.text,
                "finish": r.reason.value,
                "usage": {
                    "prompt_cells": r.num_prompt_cells,
                    "reused_cells": r.num_reused_cells,
                    "generated_tokens": r.num_generated_tokens,
                },
                "created": r.created,
            }
            for r in s.records
        ]
        return {**session_json(s), "turns": turns}

    @app.patch("/slotwise/sessions/{session_id}")
    async def rename(session_id: SessionId, body: Title) -> dict[str, Any]:
        return session_json(await call(client().rename_session(session_id, body.title)))

    @app.delete("/slotwise/sessions/{session_id}")
    async def delete(session_id: SessionId) -> dict[str, Any]:
        await call(client().delete_session(session_id))
        return {"id": session_id, "deleted": True}

    @app.get("/slotwise/kv")
    async def kv(
        interval_ms: int = Query(DEFAULT_WATCH_MS, ge=MIN_WATCH_MS, le=10_000),
    ) -> StreamingResponse:
        views = client().watch_slots(min_interval_ms=interval_ms)
        first = await _first(views)  # a refusal (a bad key, a server down) is an HTTP status
        return sse.response(_events(first, views), ping=sse.PING_SECONDS, closing=closing)


async def _first(views: AsyncIterator[infer_pb2.WatchSlotsResponse]) -> Any:
    try:
        return await anext(views)
    except SlotwiseError as e:
        await views.aclose()  # type: ignore[attr-defined]
        raise from_slotwise(e) from None


async def _events(
    first: infer_pb2.WatchSlotsResponse, views: AsyncIterator[infer_pb2.WatchSlotsResponse]
) -> AsyncGenerator[str, None]:
    """Each view as an event (compact: many a second, each of every slot)."""
    try:
        yield sse.data(view_json(first), compact=True)
        async for view in views:
            yield sse.data(view_json(view), compact=True)
    except SlotwiseError as e:  # the headers are out: the error goes as data
        yield sse.data(from_slotwise(e).body(), compact=True)
    finally:
        await views.aclose()  # type: ignore[attr-defined]  # (it cancels the watch's call)


def cache_json(s: ServerInfo) -> dict[str, Any]:
    """What the cells are made of: K and V types, flash attention, the bytes of one cell."""
    return {
        "cache_type_k": s.cache_type_k,
        "cache_type_v": s.cache_type_v,
        "flash_attn": s.flash_attn,
        "bytes_per_cell": s.num_bytes_per_cell,
    }


def session_json(s: SessionInfo) -> dict[str, Any]:
    return {
        "id": s.session_id,
        "title": s.title,
        "num_turns": s.num_turns,
        "num_cells": s.num_cells,
        "next_position": s.next_position,
        "resident": s.resident,
        "num_shifts": s.num_shifts,
        "num_media": s.num_media,
    }


def _run(r: infer_pb2.CellRun, *, full: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": _name(infer_pb2.CellKind, r.kind, "CELL_KIND_"),
        "message_index": r.message_index,
        "media_id": r.media_id,
        "num_cells": r.num_cells,
        "num_positions": r.num_positions,
    }
    if full:
        out.update(pinned=r.pinned, pos_start=r.pos_start, preview=r.preview)
    return out


def view_json(view: infer_pb2.WatchSlotsResponse) -> dict[str, Any]:
    """The page's shape of a WatchSlotsResponse (names, not enum numbers)."""
    return {
        "num_cells_per_slot": view.num_cells_per_slot,
        "uses_mrope": view.uses_mrope,
        "slots": [
            {
                "slot": s.slot,
                "visible": s.visible,
                "session_id": s.session_id,
                "state": _name(infer_pb2.SlotState, s.state, "SLOT_STATE_"),
                "num_cells": s.num_cells,
                "next_position": s.next_position,
                "segments": [_run(r) for r in s.runs],
                # (--kv-unified) its first cells: a shared prefix's, drawn once
                "shared_prefix": s.shared_prefix if s.HasField("shared_prefix") else None,
                "num_shared_cells": s.num_shared_cells,
                # (hybrid, recurrent memory) the state beside the cells, and its checkpoints
                "num_recurrent_bytes": s.num_recurrent_bytes,
                "num_checkpoints": s.num_checkpoints,
                "num_checkpoint_bytes": s.num_checkpoint_bytes,
                "shifts": [
                    {
                        "id": m.id,
                        "policy": _name(infer_pb2.ShiftPolicy, m.shift.policy, "SHIFT_POLICY_"),
                        "at_cell": m.at_cell,
                        "num_cells_evicted": m.shift.num_cells_evicted,
                        "num_positions_evicted": m.shift.num_positions_evicted,
                        "media_ids_evicted": list(m.shift.media_ids_evicted),
                        "num_cells_used_after": m.shift.num_cells_used_after,
                        "next_position_after": m.shift.next_position_after,
                        "time": m.time,
                        "evicted": [_run(r, full=False) for r in m.evicted],
                    }
                    for m in s.shifts
                ],
            }
            for s in view.slots
        ],
        "shared_prefixes": [
            {
                "holder": h.holder,
                "num_cells": h.num_cells,
                "slots": list(h.slots),
                "segments": [_run(r) for r in h.runs],
            }
            for h in view.shared_prefixes
        ],
    }
