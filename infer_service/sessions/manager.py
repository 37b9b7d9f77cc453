"""The session manager: the sessions this replica knows, their turns and their slots.

It ties three pieces, each in a module of its own:
- the table (infer_service/sessions/table.py): every session in one lifecycle state, moved
  only as the table allows;
- swaps (infer_service/sessions/swap.py): the read before a swap-in, a session into and out
  of a slot, its media chunks while it is in one;
- persistence (infer_service/sessions/persistence.py): a journal entry per completed turn,
  checkpoints of the KV state, what other replicas did (sync), pixel collection.

Everything here runs on the engine thread; disk work goes to the disk queues and comes back as
futures, whose outcome is applied here on the engine thread again (`call`). A session owns
its slot between turns, is swapped out (least recently used) when the slots are needed, and
back in on its next turn.

Every completed turn appends what it changed to the session's journal (bytes in proportion to
the turn). The KV state is a checkpoint, copied out of llama.cpp only when one is due: when the
session leaves its slot, when the engine stops, when it has been idle for a while, and when the
cells decoded since the last one reach the session's own size (or the journal is long).
A session whose checkpoint is older than its journal loads the checkpoint and decodes only the
segments after what the two share.

Sessions have a life (`limits`): a tenant keeps at most so many sessions and bytes on disk, and
its least recently used session that is not in a turn makes way for a new one; a session
unused past the TTL is deleted, in memory and on disk (the directory's files that this replica
never read too, found by a sweep now and then). Its age counts from its last use as the
replica's `clock` (wall time) says, or from its files' last write: what a restart or another
replica sees. An expired session is gone for every call at once, whether or not the periodic
work (`periodic`) has deleted it yet.

Another replica sharing the directory may be using a session this one finds unused: a turn
touches its session's files as it begins, and a checkpoint of the same state keeps the
generation. So an expiry, an eviction or a sweep deletes a session's files only if they
still say nobody used it (store.Unused): the generation this replica holds, and no write or
touch since the cutoff but this replica's own, the cutoff never later than `in_use_seconds`
ago (another replica's turn under way, and the replicas' clocks apart).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from infer_service.events import (
    EngineStoppedError,
    ErrorKind,
    Problem,
    ProblemError,
    Reason,
    problem,
)
from infer_service.kv.ledger import ContextConfig
from infer_service.runner.executor import Executor
from infer_service.runner.job import Job
from infer_service.runner.plan import SessionEntry
from infer_service.runner.runtime import SamplingConfig
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.sessions.disk_queues import resolve
from infer_service.sessions.persistence import Changed, Persistence, Used
from infer_service.sessions.session import (
    Lifecycle,
    Session,
    SessionLimits,
    TenantSessions,
    TurnRecord,
    owner_of,
)
from infer_service.sessions.store import SessionStore
from infer_service.sessions.swap import Swapper
from infer_service.sessions.table import SessionError, SessionTable, busy, not_found
from slotwise_core.descriptors import Fingerprint

log = logging.getLogger("slotwise.engine")

IDLE_CHECKPOINT_SECONDS = 30.0  # a resident session this long without a turn is checkpointed
SWEEP_SECONDS = 3600.0  # how often the directory is looked through for unused files
# another replica's write or touch of a session this recent may be its turn still under way
IN_USE_SECONDS = 600.0
_NOT_IN_A_TURN = (Lifecycle.STORED, Lifecycle.RESIDENT, Lifecycle.BROKEN)  # may expire or go

Call = Callable[[Callable[[], Any]], Future[Any]]  # run on the engine thread (Engine.call)


class SessionManager:
    def __init__(
        self,
        executor: Executor,
        slots: list[Slot],
        store: SessionStore | None,
        stats: EngineStats,
        *,
        call: Call,
        notify: Callable[[], None],
        limits: SessionLimits = SessionLimits(),
    ):
        self.executor = executor
        self.runtime = executor.runtime
        self.slots = slots
        self._call = call
        self.table = SessionTable()
        self.persistence = Persistence(store, self.runtime.fingerprint, self.runtime.layout)
        self.stats = stats
        self.swaps = Swapper(executor, self.persistence, stats, notify)
        self.idle_checkpoint_seconds = IDLE_CHECKPOINT_SECONDS
        self.limits = limits
        self.clock: Callable[[], float] = time.time  # what a session's age is counted in
        self.sweep_seconds = SWEEP_SECONDS
        self.in_use_seconds = IN_USE_SECONDS
        self._oldest = math.inf  # no session last used before this has been looked at
        self._next_sweep = self.clock() + self.sweep_seconds
        self.expired: dict[str, int] = {}  # per tenant (metrics)
        self.evicted: dict[str, int] = {}
        if store is not None:
            for session_id in store.ids():
                self._register(session_id, self.persistence.read_header(session_id, hold=True))

    @property
    def store(self) -> SessionStore | None:
        return self.persistence.store

    @property
    def bytes_written(self) -> int:
        return self.persistence.bytes_written

    def close(self) -> None:
        self.persistence.close()

    # -- the RPCs' side (engine thread) -------------------------------------------------------

    def create(
        self, session_id: str, context: ContextConfig, sampling: SamplingConfig, title: str = ""
    ) -> tuple[Session, Future[None] | None]:
        """The new session, and its first write (await it off the engine thread)."""
        self._lapse(session_id)
        state = self.table.state(session_id)
        if state is Lifecycle.DELETING:  # its deletion must land before a new file does
            raise busy(session_id, "is being deleted; retry")
        if state is not None:
            raise SessionError(
                ErrorKind.ALREADY_EXISTS,
                f"session {session_id!r} already exists",
                Reason.SESSION_EXISTS,
            )
        self._make_room(owner_of(session_id))
        session = Session(
            session_id, context, sampling, self.executor.new_ledger(context), title=title
        )
        self._touch(session)
        self.table.add(session)
        # its first file: a checkpoint with no KV state (a journal needs one to follow)
        return session, self._watch(session, self.persistence.save(session, b""))

    def get(self, session_id: str) -> Session:
        self._lapse(session_id)
        return self.table.get(session_id)

    def rename(self, session_id: str, title: str) -> tuple[Session, Future[None] | None]:
        """A new title, appended to the journal. A failed write puts the old title back."""
        self._lapse(session_id)
        session = self.table.idle(session_id)
        self._touch(session)
        old, session.title = session.title, title
        write = self._save(session)

        def undo(done: Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                with contextlib.suppress(EngineStoppedError):
                    self._call(lambda: _untitle(session, title, old))

        if write is not None:
            write.add_done_callback(undo)
        return session, write

    def delete(self, session_id: str) -> Future[bool] | None:
        """Forget the session; returns the disk deletion (ordered after its pending writes),
        whose result says whether a file was there."""
        self._lapse(session_id)
        state = self.table.state(session_id)
        if state is Lifecycle.RESTORING:
            raise busy(session_id, "is being restored")
        if state is Lifecycle.DELETING:
            raise not_found(session_id)
        session = self.table.live(session_id)
        if session is None and self.store is None:
            raise not_found(session_id)
        if session is not None:
            self.table.idle(session_id)
        # an id nobody knew, without a file either, was never there
        return self._remove(session_id, None if state is not None else not_found(session_id))

    def _remove(
        self,
        session_id: str,
        missing: Exception | None = None,
        *,
        unused_before: float | None = None,
    ) -> Future[bool] | None:
        """Forget a session that is not in a turn and delete its files (see
        Persistence.delete for `unused_before`)."""
        session = self.table.live(session_id)
        if session is not None:
            if session.slot is not None:
                self.swap_out(self.slots[session.slot], save=False)
            session.release()
        if self.store is None:
            self.table.drop(session_id)
            return None
        self.persistence.refuse_queued(session_id, problem(
            ErrorKind.NOT_FOUND, Reason.SESSION_NOT_FOUND,
            f"session {session_id!r} was deleted before this was saved",
        ))  # fmt: skip
        if session is not None:
            self.persistence.orphans |= session.media_ids()
        self.table.mark(session_id, Lifecycle.DELETING)
        deleted = self.persistence.delete(
            session_id, self._in_memory(), bool(self.table.broken()), missing,
            unused_before=unused_before,
        )  # fmt: skip
        deleted.add_done_callback(lambda _: self._call_quietly(lambda: self._gone(session_id)))
        return deleted

    def _gone(self, session_id: str) -> None:
        """Its files are deleted: a new session of this id may be created now."""
        if self.table.state(session_id) is Lifecycle.DELETING:
            self.table.drop(session_id)

    def save(self, session_id: str) -> tuple[Session, Future[None] | None]:
        """A checkpoint of a resident session (of one that is not: what its journal lacks)."""
        self._lapse(session_id)
        session = self.table.idle(session_id)
        self._touch(session)
        if session.slot is not None:
            return session, self._checkpoint(session, self.slots[session.slot])
        return session, self._save(session)

    def restore(self, session_id: str) -> Future[Session]:
        """Forget the in-memory state and read the session back from disk. The read runs on
        its session's disk queue (after its pending writes) and the restore completes even if its
        caller has gone; the future gives the restored session."""
        self._lapse(session_id)
        session = self.table.idle(session_id)
        if self.store is None:
            raise SessionError(
                ErrorKind.FAILED_PRECONDITION,
                "sessions are not persisted (no --sessions-dir)",
                Reason.NOT_PERSISTED,
            )
        if session.slot is not None:
            self.swap_out(self.slots[session.slot], save=False)
        session.release()
        self.table.mark(session_id, Lifecycle.RESTORING)
        done: Future[Session] = Future()

        def register(header: dict[str, Any] | BaseException) -> None:  # engine thread
            try:
                self._register(session_id, header)
                resolve(done, self.table.get(session_id))
            except Exception as e:  # the restore's caller hears it, whatever it is
                resolve(done, error=e)

        def read() -> None:  # its session's disk queue
            header = self.persistence.read_header(session_id, hold=True)
            try:
                self._on_engine(lambda: register(header), done)
            except EngineStoppedError as e:
                resolve(done, error=e)

        self.persistence.disk_queues.submit(session_id, read)
        return done

    def sync(self, session_id: str) -> Future[None]:
        """(Any thread) Before a session RPC: take in what another replica sharing the
        directory did to the session since this one last read or wrote it -- a newer
        generation replaces the copy in memory (and its slot), a deleted file removes it, a
        session this replica never saw is adopted."""
        done: Future[None] = Future()
        if self.store is None:
            done.set_result(None)
            return done

        def landed(read: Future[Changed | Used | None]) -> None:  # a disk queue
            try:
                change = read.result()
                if change is None:
                    resolve(done, None)
                elif isinstance(change, Used):
                    at = change.at
                    self._on_engine(lambda: self._used_elsewhere(session_id, at, done), done)
                elif change.damaged:
                    found = change.header
                    self._on_engine(lambda: self._keep_or_report(session_id, found, done), done)
                else:
                    self._on_engine(lambda: self._resync(session_id, change.header, done), done)
            except Exception as e:  # the RPC hears it (storage, the engine stopped, ...)
                resolve(done, error=e)

        self.persistence.changes(session_id).add_done_callback(landed)
        return done

    def _resync(
        self, session_id: str, header: dict[str, Any] | BaseException | None, done: Future[None]
    ) -> None:
        """(Engine thread) The session as the directory has it now (header None: gone)."""
        try:
            state = self.table.state(session_id)
            if state in (Lifecycle.IN_TURN, Lifecycle.RESTORING, Lifecycle.DELETING):
                return  # (a turn is refused when it saves; the others read the file anyway)
            session = self.table.live(session_id)
            if session is not None:
                self._forget(session)
            else:
                self.table.drop(session_id)  # (broken, or unknown)
            held = None
            if header is not None:
                self._register(session_id, header)
                if isinstance(header, dict) and self.table.live(session_id) is not None:
                    held = header
            # after this replica's writes queued so far: those of the old copy are refused
            self.persistence.hold_later(session_id, held)
        finally:
            resolve(done, None)

    def _used_elsewhere(self, session_id: str, at: float, done: Future[None]) -> None:
        """(Engine thread) Another replica used the session at `at` (its files say so): its
        age counts from then here too."""
        session = self.table.live(session_id)
        if session is not None and at > session.touched:
            session.touched = at
        resolve(done, None)

    def _keep_or_report(self, session_id: str, error: Any, done: Future[None]) -> None:
        """A file this replica cannot read: never another replica's newer state (writes are
        atomic), so a copy in memory stays the truth and writes a good file again; without
        one, the session is reported as unreadable."""
        if self.table.live(session_id) is not None:
            log.warning("session %r: its file is damaged (%s); keeping the copy in memory",
                        session_id, error)  # fmt: skip
            resolve(done, None)
        else:
            self._resync(session_id, error, done)

    def _forget(self, session: Session) -> None:
        """Drop a copy that is stale (another replica wrote the session): never saved again
        (a write of it still queued is taken out and refused)."""
        self.persistence.refuse_queued(session.session_id, problem(
            ErrorKind.ABORTED, Reason.SESSION_STALE,
            f"session {session.session_id!r} was written by another replica meanwhile",
        ))  # fmt: skip
        if session.slot is not None:
            self.swap_out(self.slots[session.slot], save=False)
        session.release()
        self.table.drop(session.session_id)

    def _stale(self, session: Session) -> None:  # engine thread, after a refused write
        mine = self.table.live(session.session_id) is session
        if mine and session.state is not Lifecycle.IN_TURN:
            log.warning("session %r: another replica wrote it since; reloading", session.session_id)
            self._forget(session)

    def _on_engine(self, fn: Callable[[], None], done: Future[Any]) -> None:
        """Run fn on the engine thread; if the engine stops before it runs, done hears why."""

        def ran(f: Future[Any]) -> None:
            error = None if f.cancelled() else f.exception()
            if error is not None and not resolve(done, error=error):
                log.error("after its caller was answered: %r", error, exc_info=error)

        self._call(fn).add_done_callback(ran)

    def _call_quietly(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(EngineStoppedError):  # (stopping: nothing is left to tidy)
            self._call(fn)

    # -- turns (engine thread) ----------------------------------------------------------------

    def begin_turn(self, session_id: str) -> Session:
        self._lapse(session_id)
        session = self.table.idle(session_id)
        self.table.move(session, Lifecycle.IN_TURN)
        # (a session this replica has not written for long looks unused to the others)
        self.persistence.touch(session_id)
        return session

    def abort_turn(self, session_id: str) -> None:
        """A turn refused before it reached the queue: nothing changed."""
        session = self.table.live(session_id)
        if session is not None and session.state is Lifecycle.IN_TURN:
            self._between_turns(session)

    def slot_of(self, session_id: str) -> int | None:
        session = self.table.live(session_id)
        return session.slot if session is not None else None

    def last_used(self, session_id: str) -> float:
        session = self.table.live(session_id)
        return session.last_used if session is not None else 0.0

    def ready(self, job: Job, num_free_slots: int) -> bool:
        """Its session's saved state is read (off the engine thread) before its turn starts."""
        session = self.table.live(job.session_id) if job.session_id is not None else None
        kv_lora = self.runtime.lora.identity(job.lora)
        return session is None or self.swaps.ready(session, num_free_slots, kv_lora)

    def waits_for_read(self, job: Job, num_free_slots: int) -> bool:
        session = self.table.live(job.session_id) if job.session_id is not None else None
        return self.swaps.waits_for_read(session, num_free_slots)

    def enter(self, slot: Slot, job: Job) -> SessionEntry:
        """The session's turn takes slot: its ledger, the segment where the turn's prompt
        starts, and the segment from which the sequence must be decoded again (None: the
        sequence holds the whole ledger; 0: its state did not load)."""
        session = self.table.get(job.session_id or "")
        if session.state is not Lifecycle.IN_TURN:
            raise busy(session.session_id, "has no turn begun")
        # what an unfinished turn rolls back to: its last completed turn
        session.rollback = (session.ledger.to_json(), session.num_shifts)
        resident = session.slot is not None
        # (a state read from disk was checked against the turn's LoRA adapters as it was read)
        reprefill = None if resident else self.swaps.swap_in(session, slot)
        kv_lora = self.runtime.lora.identity(job.lora)
        if resident and session.kv_lora != kv_lora:
            # its cells were decoded under other LoRA adapters: reused by none, all again
            self.executor.clear(slot)
            reprefill = 0
        session.kv_lora = kv_lora
        session.media.update(job.media)
        session.pixels.update(job.pixels)
        session.rgb.update(job.rgb)
        # the session owns the native chunks and pixels now; the turn reads them through it
        job.media, job.rgb = self.swaps.media(session), {}
        return SessionEntry(session.ledger, session.ledger.generated_tail(), reprefill)

    def end_turn(
        self, job: Job, *, completed: bool, record: TurnRecord | None = None
    ) -> Future[None] | None:
        """Completed: keep its record and save the session (returns the write). Not: back to
        the last completed turn (the ledger from the rollback point; the KV state from disk,
        or re-prefilled)."""
        if job.session_id is None:
            return None
        self.swaps.forget_read(job.session_id)
        session = self.table.live(job.session_id)
        if session is None or session.state is not Lifecycle.IN_TURN:
            return None
        session.last_used = time.monotonic()
        self._touch(session)
        rollback, session.rollback = session.rollback, None
        if completed:
            if session.slot is None:  # (a bug: never rolled back in silence)
                raise SessionError(
                    ErrorKind.INTERNAL,
                    f"internal error: session {session.session_id!r} completed a turn in no slot",
                    Reason.INTERNAL,
                )
            session.num_turns += 1
            if record is not None:
                session.records.append(replace(record, turn=session.num_turns))
                u = record.usage
                session.disk.num_tail_cells += (
                    u["num_prompt_cells"] - u["num_reused_cells"] + u["num_generated_tokens"]
                )
            self._orphaned(session.prune())
            self._between_turns(session)
            if self.store is None:  # (no copy of the KV state for nothing)
                return None
            if self.persistence.checkpoint_due(session):
                return self._checkpoint(session, self.slots[session.slot])
            return self._save(session)
        if rollback is not None:
            if session.slot is not None:
                self.swap_out(self.slots[session.slot], save=False)
            session.ledger.load_json(rollback[0])
            session.num_shifts = rollback[1]
        self._orphaned(session.prune())
        self._between_turns(session)
        return None

    def _between_turns(self, session: Session) -> None:
        to = Lifecycle.RESIDENT if session.slot is not None else Lifecycle.STORED
        self.table.move(session, to)

    def on_shift(self, slot: Slot) -> None:
        session = self.table.live(slot.owner) if slot.owner is not None else None
        if session is not None:
            session.num_shifts += 1

    # -- slots --------------------------------------------------------------------------------

    def swap_out(self, slot: Slot, *, save: bool = True) -> None:
        """The slot's session leaves it, and its media handles are freed. Its journal has every
        completed turn; the KV state it leaves is checkpointed unless the last checkpoint holds
        it (a failed write is written again here too)."""
        session = self.table.live(slot.owner) if slot.owner is not None else None
        if session is None:  # (nobody's: nothing to keep)
            self.executor.clear(slot)
            slot.owner, slot.ledger = None, None
            return
        if save and self._wants_checkpoint(session):
            self._checkpoint(session, slot)
        self.swaps.vacate(session, slot)
        if session.state is Lifecycle.RESIDENT:
            self.table.move(session, Lifecycle.STORED)

    # -- writes -------------------------------------------------------------------------------

    def _wants_checkpoint(self, session: Session | None) -> bool:
        return (
            session is not None
            and self.store is not None
            and session.state is not Lifecycle.IN_TURN
            and self.persistence.behind(session)
        )

    def checkpoint_idle(self, now: float) -> float | None:
        """(Engine thread) a checkpoint of every resident session idle long enough whose journal
        has turns its checkpoint lacks; returns the seconds until the next one is due."""
        due = None
        for slot, session in self._residents():
            if not self._wants_checkpoint(session):
                continue
            # (after a checkpoint that failed, the next waits as long again)
            since = max(session.last_used, session.disk.last_checkpoint)
            wait = since + self.idle_checkpoint_seconds - now
            if wait <= 0:
                self._checkpoint(session, slot)
            else:
                due = wait if due is None else min(due, wait)
        return due

    def checkpoint_resident(self) -> None:
        """(Engine thread, as the engine stops) a checkpoint of every session in a slot whose
        journal has turns its last checkpoint lacks: the next start loads them whole."""
        for slot, session in self._residents():
            if self._wants_checkpoint(session):
                self._checkpoint(session, slot)

    def make_room(self, num_cells: int) -> None:
        """(pool) Swap idle sessions out of their slots, least recently used first, until
        `num_cells` of the pool are free for a waiting prompt (their turns resume from their
        checkpoint, or are decoded again from their record: nothing of them is lost)."""
        idle = [
            (slot, session) for slot, session in self._residents()
            if slot.job is None and session.state is not Lifecycle.IN_TURN and slot.num_cells
        ]  # fmt: skip
        for slot, _ in sorted(idle, key=lambda pair: pair[1].last_used):
            if num_cells <= 0:
                return
            num_cells -= self.executor.own_cells(slot)
            owner = slot.owner
            self.swap_out(slot)
            self.stats.num_sessions_reclaimed += 1
            self.stats.tenant(owner_of(owner or "")).num_sessions_reclaimed += 1

    def _residents(self) -> list[tuple[Slot, Session]]:
        pairs = [(s, self.table.live(s.owner)) for s in self.slots if s.owner is not None]
        return [(slot, session) for slot, session in pairs if session is not None]

    def _checkpoint(self, session: Session, slot: Slot) -> Future[None] | None:
        """Save the session with the KV state its slot holds now."""
        return self._watch(
            session, self.persistence.checkpoint(session, self.executor.state_of(slot))
        )

    def _save(self, session: Session) -> Future[None] | None:
        """Append what changed since the header on disk to the session's journal."""
        return self._watch(session, self.persistence.save(session))

    def _watch(self, session: Session, write: Future[None] | None) -> Future[None] | None:
        """What a write's outcome means for the session, applied on the engine thread: on
        disk, its pixels leave memory; refused as stale, the copy is dropped."""
        if write is None:
            return None
        number = session.disk.num_saves
        media = {px.media_id for px in session.pixels.values() if px.media_id in session.rgb}

        def landed(done: Future[None]) -> None:
            if done.cancelled():
                return
            e = done.exception()
            if e is None:
                self._call_quietly(lambda: self._saved(session, number, media))
            elif isinstance(e, ProblemError) and e.problem.reason is Reason.SESSION_STALE:
                self._call_quietly(lambda: self._stale(session))

        write.add_done_callback(landed)
        return write

    def _saved(self, session: Session, number: int, media_ids: set[str]) -> None:
        if self.table.live(session.session_id) is not session:
            return  # deleted, or replaced by a newer copy from disk
        if number == session.disk.num_saves:  # the newest save asked for is on disk
            session.disk.dirty = False
        for media_id in media_ids:
            session.rgb.pop(media_id, None)
        self._trim(owner_of(session.session_id), session.session_id)
        if self.persistence.orphans:
            self.persistence.collect_pixels(self._in_memory(), bool(self.table.broken()))

    def _orphaned(self, media_ids: set[str]) -> None:
        if self.store is not None:  # (without a store there is nothing to collect)
            self.persistence.orphans |= media_ids

    def _in_memory(self) -> set[str]:
        """Media ids some session in memory refers to (or holds pixels of)."""
        return {m for s in self.table.sessions() for m in (*s.media_ids(), *s.rgb)}

    # -- a session's life: quotas and expiry (engine thread) ------------------------------------

    def periodic(self, now: float) -> float | None:
        """The sessions' work that no request asks for (now: time.monotonic()): idle
        checkpoints and expiry; returns the seconds until more of it is due."""
        waits = [w for w in (self.checkpoint_idle(now), self.expire()) if w is not None]
        return min(waits, default=None)

    def expire(self) -> float | None:
        """Delete the sessions unused past the TTL: those this replica knows (in memory and
        on disk), and now and then the directory's files it never read (another replica's,
        say); returns the seconds until more may be due."""
        ttl = self.limits.ttl
        if ttl <= 0:
            return None
        now = self.clock()
        if now >= self._oldest + ttl:  # (else nothing is due: no scan on every call)
            self._oldest = math.inf
            for session_id in self.table.ids():
                used = self._used_at(session_id)
                if used is None:
                    continue
                if used + ttl > now:
                    self._oldest = min(self._oldest, used)
                elif self.table.state(session_id) in _NOT_IN_A_TURN:
                    self._expire(session_id, now)
                # (one in a turn is touched again as its turn ends)
        wait = self._oldest + ttl - now
        if self.store is not None:
            if now >= self._next_sweep:
                self._next_sweep = now + self.sweep_seconds
                self._sweep(self._unused_before(now))
            wait = min(wait, self._next_sweep - now)
        return max(0.0, wait) if wait < math.inf else None

    def usage(self) -> dict[str, TenantSessions]:
        """Per tenant: its sessions (in memory or on disk, as this replica knows them), their
        bytes on disk, and how many expired or were evicted here."""
        out: dict[str, TenantSessions] = {}
        for session_id in self.table.ids():
            if self.table.state(session_id) is not Lifecycle.DELETING:
                t = out.setdefault(owner_of(session_id), TenantSessions())
                t.num_sessions += 1
                t.num_bytes += self._bytes_of(session_id)
        for tenant, n in self.expired.items():
            out.setdefault(tenant, TenantSessions()).num_expired = n
        for tenant, n in self.evicted.items():
            out.setdefault(tenant, TenantSessions()).num_evicted = n
        return out

    def _touch(self, session: Session) -> None:
        session.touched = self.clock()
        self._oldest = min(self._oldest, session.touched)

    def _used_at(self, session_id: str) -> float | None:
        """When the session was last used (time.time()); None: not known here."""
        session = self.table.live(session_id)
        if session is not None:
            return session.touched
        if self.table.state(session_id) is Lifecycle.BROKEN:
            found = self.persistence.footprint(session_id)
            return found[1] if found is not None else None
        return None

    def _bytes_of(self, session_id: str) -> int:
        found = self.persistence.footprint(session_id)
        return found[0] if found is not None else 0

    def _lapse(self, session_id: str) -> None:
        """A session unused past the TTL is gone for every call, whether or not the periodic
        work has come to it yet."""
        ttl, now = self.limits.ttl, self.clock()
        used = self._used_at(session_id)
        idle = self.table.state(session_id) in _NOT_IN_A_TURN
        if ttl > 0 and used is not None and used + ttl <= now and idle:
            self._expire(session_id, now)

    def _expire(self, session_id: str, now: float) -> None:
        tenant = owner_of(session_id)
        self.expired[tenant] = self.expired.get(tenant, 0) + 1
        log.info("session %r expired: unused for longer than %.0f s", session_id, self.limits.ttl)
        self._remove(session_id, unused_before=self._unused_before(now))

    def _unused_before(self, now: float) -> float:
        """Files last written or touched before this are unused past the TTL, by whoever."""
        return now - max(self.limits.ttl, self.in_use_seconds)

    def _sweep(self, before: float) -> None:
        """Expire the directory's session files last written before `before` that this
        replica never read (listed on a disk queue; each deleted on its own)."""

        def listed(found: Future[list[str]]) -> None:  # a disk queue
            error = None if found.cancelled() else found.exception()
            if error is not None:
                log.warning("looking for unused sessions failed: %s", error)
            elif found.result():
                self._call_quietly(lambda: self._expire_unread(found.result(), before))

        self.persistence.unused(before).add_done_callback(listed)

    def _expire_unread(self, session_ids: list[str], before: float) -> None:
        unread = [sid for sid in session_ids if sid not in self.table]  # (known: see expire)
        if not unread:
            return
        in_memory, broken = self._in_memory(), bool(self.table.broken())
        for session_id in unread:
            self.table.mark(session_id, Lifecycle.DELETING)
            deleted = self.persistence.delete(
                session_id, in_memory, broken, None, unused_before=before
            )
            deleted.add_done_callback(self._unread_gone(session_id))

    def _unread_gone(self, session_id: str) -> Callable[[Future[bool]], None]:
        def gone() -> None:  # engine thread
            self._gone(session_id)
            tenant = owner_of(session_id)
            self.expired[tenant] = self.expired.get(tenant, 0) + 1
            log.info("session %r expired: its files went unused for too long", session_id)

        def landed(deleted: Future[bool]) -> None:
            if not deleted.cancelled() and deleted.exception() is None and deleted.result():
                self._call_quietly(gone)
            else:  # (kept: written since, or the disk failed; looked at again by a later sweep)
                self._call_quietly(lambda: self._gone(session_id))

        return landed

    def _make_room(self, tenant: str) -> None:
        """Before a tenant's new session: while the tenant is at its quota, its least
        recently used sessions not in a turn are deleted. If even all of those would not make
        room, none is, and the new session is refused (RESOURCE_EXHAUSTED)."""
        limits = self.limits
        if limits.max_sessions <= 0 and limits.max_bytes <= 0:
            return
        mine = self._sessions_of(tenant)
        count, used = len(mine), sum(mine.values())

        def full() -> bool:
            return 0 < limits.max_sessions <= count or 0 < limits.max_bytes <= used

        if not full():
            return
        victims = []
        for session_id in self._by_age(mine):
            victims.append(session_id)
            count, used = count - 1, used - mine[session_id]
            if not full():
                break
        else:
            raise ProblemError(self._quota_refusal(len(mine), sum(mine.values())))
        for session_id in victims:
            self._evict(session_id, "to make room for a new one")

    def _trim(self, tenant: str, keep: str) -> None:
        """After a write of `keep` landed: while the tenant's sessions take more bytes than
        its quota, its least recently used others that are not in a turn are deleted."""
        if self.limits.max_bytes <= 0:
            return
        mine = self._sessions_of(tenant)
        used = sum(mine.values())
        for session_id in self._by_age(mine):
            if used <= self.limits.max_bytes:
                break
            if session_id != keep:
                used -= mine[session_id]
                self._evict(session_id, "its tenant's sessions took more than their bytes")

    def _sessions_of(self, tenant: str) -> dict[str, int]:
        """The tenant's sessions (those being deleted aside), with their bytes on disk."""
        ids = self.table.ids_of(tenant)
        return {
            sid: self._bytes_of(sid)
            for sid in ids
            if self.table.state(sid) is not Lifecycle.DELETING
        }

    def _by_age(self, session_ids: dict[str, int]) -> list[str]:
        """Those not in a turn, least recently used first."""
        idle = [sid for sid in session_ids if self.table.state(sid) in _NOT_IN_A_TURN]
        return sorted(idle, key=lambda sid: (self._used_at(sid) or 0.0, sid))

    def _evict(self, session_id: str, why: str) -> None:
        tenant = owner_of(session_id)
        self.evicted[tenant] = self.evicted.get(tenant, 0) + 1
        log.info("session %r evicted: %s", session_id, why)
        # (this replica's own last write goes whatever its age: the store knows it for its own)
        self._remove(session_id, unused_before=self.clock() - self.in_use_seconds)

    def _quota_refusal(self, count: int, used: int) -> Problem:
        limits = self.limits
        most = [
            f"{limits.max_sessions} sessions" if limits.max_sessions > 0 else "",
            f"{limits.max_bytes >> 20} MB" if limits.max_bytes > 0 else "",
        ]
        return problem(
            ErrorKind.RESOURCE_EXHAUSTED, Reason.SESSION_QUOTA,
            f"the tenant's sessions are at its quota (at most {' and '.join(filter(None, most))};"
            f" it has {count}, {used >> 20} MB on disk) and those not in a turn cannot make "
            "room for a new one: retry when a turn has ended, or delete a session",
            num_sessions=count, num_bytes=used, tenant_max_sessions=limits.max_sessions,
            tenant_max_session_bytes=limits.max_bytes,
        )  # fmt: skip

    # -- reading sessions ---------------------------------------------------------------------

    def _register(self, session_id: str, header: dict[str, Any] | BaseException) -> None:
        try:
            self._read_in(session_id, header)
        finally:  # (damaged or not, its age counts from its files' last write)
            used = self._used_at(session_id)
            if used is not None:
                self._oldest = min(self._oldest, used)

    def _read_in(self, session_id: str, header: dict[str, Any] | BaseException) -> None:
        try:
            if isinstance(header, BaseException):
                raise header
            fp = header.get("fingerprint", {})
            if Fingerprint(**fp) != self.runtime.fingerprint:
                raise SessionError(
                    ErrorKind.FAILED_PRECONDITION,
                    f"session {session_id!r} was saved with another model ({str(fp)[:80]})",
                    Reason.SESSION_FOREIGN,
                )
            session = Session.from_header(session_id, header, self.executor.new_ledger)
            found = self.persistence.footprint(session_id)
            session.touched = found[1] if found is not None else self.clock()
            self._orphaned(session.prune())
        except SessionError as e:
            log.warning("%s", e)
            self.table.mark(session_id, Lifecycle.BROKEN, e)
            return
        except KeyError as e:
            if e.args == (session_id,):  # no file (deleted meanwhile)
                self.table.drop(session_id)
                return
            self._unreadable(session_id, e)
            return
        except Exception as e:  # CorruptSessionError, OSError, a header of the wrong shape, ...
            self._unreadable(session_id, e)
            return
        self.table.add(session)

    def _unreadable(self, session_id: str, e: BaseException) -> None:
        log.warning("session %r is unreadable: %s", session_id, e)
        self.table.mark(session_id, Lifecycle.BROKEN, SessionError(
            ErrorKind.DATA_LOSS, f"session {session_id!r} is unreadable: {e}",
            Reason.SESSION_UNREADABLE,
        ))  # fmt: skip


def _untitle(session: Session, title: str, old: str) -> None:
    if session.title == title:  # (not renamed again since)
        session.title = old
