"""Resumable streams (llama-server's, by `X-Conversation-Id`): a streamed answer whose request
named a conversation is kept as it comes, so that a caller that left (a page reloaded) reads it
again from any byte with `GET /v1/stream?conv_id=ID&from=N`, and `DELETE /v1/stream?conv_id=ID`
stops it (its generation too) and forgets it.

The generation goes on without its caller: once its model is chosen it is read to the end
whether anyone reads it or not. Each kept answer holds its last STREAM_MAX_BYTES (a reader from
before them is told the offset is lost); at most MAX_SESSIONS are kept, a finished one for
TTL_SECONDS. All on the router's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StreamSession", "Streams"]

STREAM_MAX_BYTES = 4 << 20  # llama-server's (a session holds up to a quarter more)
TTL_SECONDS = 300.0  # a finished stream kept this long (llama-server's)
MAX_SESSIONS = 64  # kept at once: beyond, the oldest finished goes, or a new one is refused


@dataclass(eq=False)
class StreamSession:
    conv_id: str
    model: str
    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0  # bytes let go from the front (the cap)
    done: bool = False
    started_at: float = field(default_factory=time.time)
    completed_at: float | None = None
    producer: asyncio.Task[None] | None = None
    _more: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def total(self) -> int:
        return self.dropped + len(self.data)

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > STREAM_MAX_BYTES + STREAM_MAX_BYTES // 4:  # (cut in blocks: a cut
            cut = len(self.data) - STREAM_MAX_BYTES  # moves what stays, not per chunk)
            del self.data[:cut]
            self.dropped += cut
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.done, self.completed_at = True, time.time()
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """Its bytes from `offset` on, as they come, until it is done (or evicted)."""
        while True:
            if offset < self.dropped:
                return  # (let go while this reader was away: it ends here)
            if offset < self.total:
                chunk = bytes(self.data[offset - self.dropped :])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await self._more.wait()


class Streams:
    def __init__(self) -> None:
        self.sessions: dict[str, StreamSession] = {}
        self.parked: dict[str, asyncio.Task[Any]] = {}  # conv -> its request's wait for a model

    def get(self, conv_id: str) -> StreamSession | None:
        self._expire()
        return self.sessions.get(conv_id)

    def open(self, conv_id: str, model: str) -> StreamSession | None:
        """A new session for the conversation (its previous one stopped); None when
        MAX_SESSIONS are live."""
        self.stop(conv_id)
        self._expire()
        if len(self.sessions) >= MAX_SESSIONS:
            finished = [s for s in self.sessions.values() if s.done]
            if not finished:
                return None
            oldest = min(finished, key=lambda s: s.completed_at or 0.0)
            del self.sessions[oldest.conv_id]
        session = StreamSession(conv_id, model)
        self.sessions[conv_id] = session
        return session

    def stop(self, conv_id: str) -> None:
        """DELETE: its generation stopped (or its wait for a model), its bytes let go."""
        session = self.sessions.pop(conv_id, None)
        if session is not None:
            if session.producer is not None:
                session.producer.cancel()
            session.finish()
        parked = self.parked.pop(conv_id, None)
        if parked is not None:
            parked.cancel()

    def lookup(self, ids: list[str]) -> list[dict[str, object]]:
        """POST /v1/streams/lookup: only the sessions asked for (an id, or `id::model`)."""
        self._expire()
        found = []
        for s in self.sessions.values():
            if any(s.conv_id == i or s.conv_id.startswith(f"{i}::") for i in ids):
                found.append({"conversation_id": s.conv_id, "is_done": s.done,
                              "total_bytes": s.total, "started_at": int(s.started_at),
                              "completed_at": int(s.completed_at or 0)})  # fmt: skip
        return found

    def _expire(self) -> None:
        now = time.time()
        for conv_id, s in list(self.sessions.items()):
            if s.done and s.completed_at is not None and now - s.completed_at > TTL_SECONDS:
                del self.sessions[conv_id]
