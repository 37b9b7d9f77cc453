"""The engine as the servicer sees it: one narrow client for the event loop.

The servicer never reads the engine's state itself. Every read is made on the engine thread
between steps and handed back as a value (a snapshot, a session's view, the slots'
pictures); a session call first takes in what another replica sharing the directory did
(sync), and the disk work it starts is awaited here, off the engine thread. Disk work goes
on when its caller leaves: only the waiting for it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from infer_service.engine.loop import Engine, EngineSnapshot
from infer_service.engine.scheduler import Reservation
from infer_service.events import EngineStoppedError
from infer_service.kv.ledger import ContextConfig
from infer_service.kv.view import SharedPicture, SlotPicture
from infer_service.runner.job import Job
from infer_service.runner.runtime import SamplingConfig
from infer_service.sessions.session import Session, SessionView, owner_of

T = TypeVar("T")


class EngineClient:
    def __init__(self, engine: Engine):
        self._engine = engine
        self._sessions = engine.sessions

    def reserve(self, tenant: str) -> Reservation:
        """A place in the queue, taken before a request's images are decoded and checked
        (ProblemError: the queue is full, or the engine stopped)."""
        return self._engine.reserve(tenant)

    def submit(self, job: Job, reservation: Reservation | None = None) -> None:
        """Queue a job, in its reserved place (ProblemError: no place, the engine stopped)."""
        self._engine.submit(job, reservation)

    async def snapshot(self) -> EngineSnapshot:
        return await self._on_engine(self._engine.snapshot)

    async def slot_pictures(self) -> tuple[list[SlotPicture], list[SharedPicture]]:
        """The slots and the pool's shared prefixes, as of one moment."""
        engine = self._engine
        return await self._on_engine(lambda: (engine.slot_pictures(), engine.shared_pictures()))

    # -- session turns ------------------------------------------------------------------------

    async def begin_turn(self, key: str) -> SessionView:
        """The session's turn is this caller's until `end_turn_later` or the job's end; if the
        caller goes away while the engine begins it, it is ended again."""
        await _await_disk_work(self._sessions.sync(key))
        future = self._engine.call(lambda: self._sessions.begin_turn(key).view())
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel():  # it ran, or runs: undo once it is done

                def undo(done: Future[SessionView]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        self.end_turn_later(key)

                future.add_done_callback(undo)
            raise

    def end_turn_later(self, key: str) -> None:
        """A turn refused before it reached the queue (never awaited: it must happen even if
        the caller goes)."""
        with contextlib.suppress(EngineStoppedError):  # (gone: nothing to undo)
            self._engine.call(lambda: self._sessions.abort_turn(key))

    # -- session calls ------------------------------------------------------------------------

    async def create(
        self, key: str, context: ContextConfig, sampling: SamplingConfig, title: str
    ) -> SessionView:
        return await self._change_and_write(
            key, lambda: self._sessions.create(key, context, sampling, title)
        )

    async def get(self, key: str, num_records: int = 0) -> SessionView:
        await _await_disk_work(self._sessions.sync(key))
        return await self._on_engine(lambda: self._sessions.get(key).view(num_records))

    async def rename(self, key: str, title: str) -> SessionView:
        return await self._change_and_write(key, lambda: self._sessions.rename(key, title))

    async def save(self, key: str) -> SessionView:
        return await self._change_and_write(key, lambda: self._sessions.save(key))

    async def restore(self, key: str) -> SessionView:
        await _await_disk_work(self._sessions.sync(key))
        reading = await self._on_engine(lambda: self._sessions.restore(key))
        restored: Session = await _await_disk_work(reading)
        return await self._on_engine(restored.view)

    async def delete(self, key: str) -> None:
        await _await_disk_work(self._sessions.sync(key))
        deleted = await self._on_engine(lambda: self._sessions.delete(key))
        if deleted is not None:
            await _await_disk_work(deleted)

    async def sessions_of(self, tenant: str) -> tuple[list[SessionView], dict[str, str]]:
        """A tenant's sessions, and its broken ones with why."""

        def mine() -> tuple[list[SessionView], dict[str, str]]:
            self._sessions.expire()  # (none unused past its TTL is listed)
            table = self._sessions.table
            views = [s.view() for s in table.sessions() if owner_of(s.session_id) == tenant]
            broken = {k: str(e) for k, e in table.broken().items() if owner_of(k) == tenant}
            return views, broken

        return await self._on_engine(mine)

    async def _change_and_write(
        self, key: str, fn: Callable[[], tuple[Session, Future[None] | None]]
    ) -> SessionView:
        """fn on the engine thread (after a sync), its write awaited, the session's view."""
        await _await_disk_work(self._sessions.sync(key))

        def call() -> tuple[SessionView, Future[None] | None]:
            session, write = fn()
            return session.view(), write

        view, write = await self._on_engine(call)
        if write is not None:
            await _await_disk_work(write)
        return view

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._engine.call(fn))


async def _await_disk_work(future: Future[T]) -> T:
    """Wait for disk work that goes on if this caller leaves (its outcome is then dropped)."""
    waited = asyncio.wrap_future(future)
    waited.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved either way
    return await asyncio.shield(waited)
