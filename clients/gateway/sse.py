"""Server-sent events: the one framing of every stream the gateway sends.

An API's module writes only its events' contents, through `data` (an unnamed event) and `event`
(a named one); `response` sends them, with a comment line while the stream is quiet (`ping`),
its end when the server is closing (`closing`), and, however it stops (its own end, a client
gone, the server closing), the API's own cleanup (generations ended, watches cancelled) run to
its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

__all__ = ["DONE", "PING_SECONDS", "data", "event", "response"]

PING_SECONDS = 15.0  # a comment line keeps proxies from closing a quiet stream
_PING = ": ping\n\n"
_COMPACT = (",", ":")
_CLEANUPS: set[asyncio.Future[None]] = set()  # (held: a cleanup outlives its response)


def data(body: object, *, compact: bool = False) -> str:
    """An unnamed event of JSON; a str goes as it is (OpenAI's `[DONE]`)."""
    if not isinstance(body, str):
        body = json.dumps(body, separators=_COMPACT if compact else None)
    return f"data: {body}\n\n"


def event(kind: str, /, **fields: Any) -> str:
    """A named event whose data names it too (`type`), as Anthropic's Messages and OpenAI's
    Responses API send theirs."""
    return f"event: {kind}\n" + data({"type": kind, **fields})


DONE = data("[DONE]")  # the end of an OpenAI stream


def response(
    frames: AsyncGenerator[str, None],
    *,
    ping: float | None = None,
    closing: asyncio.Event | None = None,
) -> StreamingResponse:
    """frames as a text/event-stream; `ping`: seconds of quiet before a comment line (None:
    none); `closing`: set when the server stops, it ends the stream (a stream that never ends by
    itself must not hold the shutdown up)."""
    return StreamingResponse(_sent(frames, ping, closing), media_type="text/event-stream")


async def _sent(
    frames: AsyncGenerator[str, None], ping: float | None, closing: asyncio.Event | None
) -> AsyncIterator[str]:
    """Each frame is awaited in a task of its own: a ping's timeout or the server closing must
    not cancel the API's stream halfway through a step."""
    pending: asyncio.Future[str] | None = None
    closed = asyncio.ensure_future(closing.wait()) if closing is not None else None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(frames))
            waits: set[asyncio.Future[Any]] = {pending} if closed is None else {pending, closed}
            done, _ = await asyncio.wait(waits, timeout=ping, return_when=asyncio.FIRST_COMPLETED)
            if closed in done:
                return
            if not done:
                yield _PING
                continue
            task, pending = pending, None
            try:
                frame = task.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if closed is not None:
            closed.cancel()
        await _stopped(frames, pending)


async def _stopped(frames: AsyncGenerator[str, None], pending: asyncio.Future[str] | None) -> None:
    """The API's stream stopped and its cleanup done, in a task of its own: a client gone cancels
    the response at every await (the server's cancel scope), which would cut the cleanup short."""

    async def stop() -> None:
        if pending is not None:
            pending.cancel()  # (the stream's own finally runs in that task)
            with contextlib.suppress(BaseException):
                await pending
        await frames.aclose()

    task = asyncio.ensure_future(stop())
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)
    await asyncio.shield(task)
