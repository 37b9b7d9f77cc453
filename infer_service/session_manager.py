"""The session manager: sessions in memory and on disk, their slots, swap-out and swap-in.

Everything here runs on the engine thread, except what it hands to its io lanes: session
writes, the reads before a swap-in, deletions and the collection of pixels no session needs.
A session's disk work runs in the order it was asked for; another session's runs beside it
(infer_service/io_lanes.py). A session owns its slot between turns, and is swapped out
(least recently used) when the slots are needed, and swapped back in from disk on its next
turn.

Every completed turn appends what it changed to the session's journal (bytes in proportion to
the turn). The KV state is a checkpoint, copied out of llama.cpp only when one is due: when the
session leaves its slot, when the engine stops, when it has been idle for a while, and when the
cells decoded since the last one reach the session's own size (or MAX_JOURNAL_TURNS entries).
A session whose checkpoint is older than its journal loads the checkpoint and decodes only the
segments after what the two share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from infer_service import header_delta
from infer_service.events import ErrorKind, Problem, ProblemError, Reason, problem, storage_problem
from infer_service.executor import Executor
from infer_service.io_lanes import Lanes
from infer_service.ledger import ContextConfig, Ledger
from infer_service.media import MediaHandle, media_handle
from infer_service.runtime import SamplingConfig
from infer_service.session_store import (
    CorruptSessionError,
    Generation,
    SessionStore,
    StaleSessionError,
    ledger_digest,
)
from infer_service.sessions import Pixels, Session, TurnRecord
from infer_service.slots import EngineStats, EngineStoppedError, Job, SessionError, Slot, resolve
from slotwise_core.descriptors import Fingerprint
from slotwise_core.native import Bitmap

log = logging.getLogger("slotwise.engine")

IO_WORKERS = 4  # sessions whose disk work runs at once
_PIXELS = ""  # the lane of pixel collection (no session has an empty id)
MAX_JOURNAL_TURNS = 128  # entries a journal holds before a checkpoint folds them in
MIN_CHECKPOINT_CELLS = 1024  # a checkpoint is due once this many cells (at least) were decoded
IDLE_CHECKPOINT_SECONDS = 30.0  # a resident session this long without a turn is checkpointed

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
    ):
        self.executor = executor
        self.rt = executor.rt
        self.slots = slots
        self.store = store
        self.stats = stats
        self._call = call
        self._notify = notify
        self.by_id: dict[str, Session] = {}
        self.broken: dict[str, SessionError] = {}
        # disk work, per session in order (writes, reads before a swap-in, deletions), other
        # sessions' beside it; the collection of pixels has a lane of its own
        self._io = Lanes(IO_WORKERS, "session-io")
        self._collecting = threading.Lock()  # (a deletion collects too, on its session's lane)
        self._counting = threading.Lock()
        self._writes = _Writes()
        self._prefetch: dict[str, Future[_Prefetched]] = {}  # session id -> its swap-in read
        self._restoring: set[str] = set()
        self._deleting: set[str] = set()  # deletions queued on their lanes
        self._orphans: set[str] = set()  # media ids a session stopped referring to
        # each on its session's lane only (filled before the lanes start): the generation of
        # each session this replica holds (its writes must find that one on disk), the header
        # on disk; pixels waiting to be collected (pixel collection only)
        self._generations: dict[str, Generation] = {}
        self._written: dict[str, dict[str, Any]] = {}  # (what a turn's delta is from)
        self._io_orphans: set[str] = set()
        self.bytes_written = 0  # session files and journals (the lanes, under _counting)
        self.idle_checkpoint_seconds = IDLE_CHECKPOINT_SECONDS
        if store is not None:
            for session_id in store.ids():
                self._register(session_id, self._read_header(session_id, hold=True))

    def close(self) -> None:
        self._io.shutdown()

    # -- the RPCs' side (engine thread) -------------------------------------------------------

    def create(
        self, session_id: str, context: ContextConfig, sampling: SamplingConfig, title: str = ""
    ) -> tuple[Session, Future[None] | None]:
        """The new session, and its first write (await it off the engine thread)."""
        if session_id in self._deleting:  # its deletion must land before a new file does
            raise _error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.SESSION_BUSY,
                f"session {session_id!r} is being deleted; retry",
            )
        if session_id in self.by_id or session_id in self.broken or session_id in self._restoring:
            raise _error(
                ErrorKind.ALREADY_EXISTS,
                Reason.SESSION_EXISTS,
                f"session {session_id!r} already exists",
            )
        session = Session(
            session_id, context, sampling, self.executor.new_ledger(context), title=title
        )
        self.by_id[session_id] = session
        return session, self._save(session, b"")

    def rename(self, session_id: str, title: str) -> tuple[Session, Future[None] | None]:
        """A new title, appended to the journal. A failed write puts the old title back."""
        session = self.idle(session_id)
        old, session.title = session.title, title
        write = self._save(session, None)

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
        was_broken = self.broken.pop(session_id, None) is not None
        session = self.by_id.get(session_id)
        if session is None and self.store is None:
            raise self._not_found(session_id)
        if session_id in self._restoring:
            raise _error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.SESSION_BUSY,
                f"session {session_id!r} is being restored",
            )
        if session is not None:
            self.idle(session_id)
            if session.slot is not None:
                self.swap_out(self.slots[session.slot], save=False)
            del self.by_id[session_id]
            session.release()
        if self.store is None:
            return None
        store = self.store
        queued = self._writes.take(session_id)  # a write not started yet: it must not land
        for f in queued.futures if queued else ():
            resolve(f, error=ProblemError(problem(
                ErrorKind.NOT_FOUND, Reason.SESSION_NOT_FOUND,
                f"session {session_id!r} was deleted before this was saved",
            )))  # fmt: skip
        if session is not None:
            self._orphans |= session.media_ids()
        collect = self._pixel_collector()

        def delete() -> bool:
            found = store.delete(session_id)
            self._hold(session_id, None, None)
            collect()
            if not (found or was_broken or session is not None):
                raise self._not_found(session_id)
            return found

        self._deleting.add(session_id)
        deleted = self._io.submit(session_id, delete)

        def done(_: Future[bool]) -> None:  # a new session of this id may be created now
            with contextlib.suppress(EngineStoppedError):
                self._call(lambda: self._deleting.discard(session_id))

        deleted.add_done_callback(done)
        return deleted

    def save(self, session_id: str) -> tuple[Session, Future[None] | None]:
        """A checkpoint of a resident session (of one that is not: what its journal lacks)."""
        session = self.idle(session_id)
        if session.slot is not None:
            return session, self._checkpoint(session, self.slots[session.slot])
        return session, self._save(session, None)

    def restore(self, session_id: str) -> Future[Session]:
        """Forget the in-memory state and read the session back from disk. The read runs on
        its session's io lane (after its pending writes) and the restore completes even if its
        caller has gone; the future gives the restored session."""
        session = self.idle(session_id)
        if self.store is None:
            raise _error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.NOT_PERSISTED,
                "sessions are not persisted (no --sessions-dir)",
            )
        if session.slot is not None:
            self.swap_out(self.slots[session.slot], save=False)
        session.release()
        del self.by_id[session_id]
        self._restoring.add(session_id)
        done: Future[Session] = Future()

        def register(header: dict[str, Any] | BaseException) -> None:  # engine thread
            self._restoring.discard(session_id)
            try:
                self._register(session_id, header)
                resolve(done, self.get(session_id))
            except Exception as e:  # the restore's caller hears it, whatever it is
                resolve(done, error=e)

        def read() -> None:  # its session's io lane
            header = self._read_header(session_id, hold=True)
            try:
                self._on_engine(lambda: register(header), done)
            except EngineStoppedError as e:
                resolve(done, error=e)

        self._io.submit(session_id, read)
        return done

    def get(self, session_id: str) -> Session:
        if session_id in self.broken:
            raise self.broken[session_id]
        session = self.by_id.get(session_id)
        if session is None:
            raise self._not_found(session_id)
        return session

    def idle(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.busy:
            raise _error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.SESSION_BUSY,
                f"session {session_id!r} has a turn running",
            )
        return session

    def begin_turn(self, session_id: str) -> Session:
        session = self.idle(session_id)
        session.busy = True
        return session

    def abort_turn(self, session_id: str) -> None:
        """A turn refused before it reached the queue: nothing changed."""
        if session_id in self.by_id:
            self.by_id[session_id].busy = False

    def sync(self, session_id: str) -> Future[None]:
        """(Any thread) Before a session RPC: take in what another replica sharing the
        directory did to the session since this one last read or wrote it -- a newer
        generation replaces the copy in memory (and its slot), a deleted file removes it, a
        session this replica never saw is adopted. Nothing is read but the checkpoint's first
        bytes and the journal (MAX_JOURNAL_TURNS entries at most) when the session is the
        generation this replica holds."""
        done: Future[None] = Future()
        store = self.store
        if store is None:
            done.set_result(None)
            return done

        def read() -> None:  # its session's io lane
            try:
                try:
                    found = store.generation(session_id)
                except CorruptSessionError as e:
                    # never another replica's newer state (writes are atomic): a copy in memory
                    # stays the truth and writes a good file again; none is DATA_LOSS
                    damaged: BaseException = e
                    self._on_engine(lambda: self._keep_or_report(session_id, damaged, done), done)
                    return
                if found == self._generations.get(session_id):
                    resolve(done, None)
                    return
                header = self._read_header(session_id) if found is not None else None
                self._on_engine(lambda: self._resync(session_id, header, done), done)
            except OSError as e:
                resolve(done, error=ProblemError(storage_problem(e, "the sessions directory")))
            except Exception as e:  # the RPC hears it (the engine stopped, ...)
                resolve(done, error=e)

        try:
            self._io.submit(session_id, read)
        except RuntimeError:  # the io lanes are shut down: the engine is stopping
            resolve(done, error=EngineStoppedError(problem(
                ErrorKind.UNAVAILABLE, Reason.SHUTTING_DOWN, "server shutting down",
            )))  # fmt: skip
        return done

    def _resync(
        self, session_id: str, header: dict[str, Any] | BaseException | None, done: Future[None]
    ) -> None:
        """(Engine thread) The session as the directory has it now (header None: gone)."""
        try:
            session = self.by_id.get(session_id)
            if session is not None and session.busy:  # its turn is refused when it saves
                return
            if session is not None:
                self._forget(session)
            self.broken.pop(session_id, None)
            generation = None
            if header is not None:
                self._register(session_id, header)
                if isinstance(header, dict) and session_id in self.by_id:
                    generation = _generation_of(header)
            # after this replica's writes queued so far: those of the old copy are refused
            held = header if isinstance(header, dict) and generation is not None else None
            self._io.submit(session_id, self._hold, session_id, generation, held)
        finally:
            resolve(done, None)

    def _on_engine(self, fn: Callable[[], None], done: Future[Any]) -> None:
        """Run fn on the engine thread; if the engine stops before it runs, done hears why."""
        ran = self._call(fn)
        ran.add_done_callback(
            lambda f: (
                resolve(done, error=f.exception()) if not f.cancelled() and f.exception() else None
            )
        )

    def _keep_or_report(self, session_id: str, error: BaseException, done: Future[None]) -> None:
        if session_id in self.by_id:
            log.warning("session %r: its file is damaged (%s); keeping the copy in memory",
                        session_id, error)  # fmt: skip
            resolve(done, None)
        else:
            self._resync(session_id, error, done)

    def _hold(
        self, session_id: str, generation: Generation | None, header: dict[str, Any] | None
    ) -> None:  # its session's io lane
        if generation is None or header is None:
            self._generations.pop(session_id, None)
            self._written.pop(session_id, None)
        else:
            self._generations[session_id] = generation
            self._written[session_id] = header

    def _forget(self, session: Session) -> None:
        """Drop a copy that is stale (another replica wrote the session): never saved again
        (a write of it still queued is taken out and refused)."""
        queued = self._writes.take(session.session_id)
        for f in queued.futures if queued else ():
            resolve(f, error=ProblemError(problem(
                ErrorKind.ABORTED, Reason.SESSION_STALE,
                f"session {session.session_id!r} was written by another replica meanwhile",
            )))  # fmt: skip
        if session.slot is not None:
            self.swap_out(self.slots[session.slot], save=False)
        session.release()
        del self.by_id[session.session_id]

    def _stale(self, session: Session) -> None:  # engine thread, after a refused write
        if self.by_id.get(session.session_id) is session and not session.busy:
            log.warning("session %r: another replica wrote it since; reloading", session.session_id)
            self._forget(session)

    def _not_found(self, session_id: str) -> SessionError:
        return _error(ErrorKind.NOT_FOUND, Reason.SESSION_NOT_FOUND, f"no session {session_id!r}")

    # -- turns (engine thread) ----------------------------------------------------------------

    def slot_of(self, session_id: str) -> int | None:
        session = self.by_id.get(session_id)
        return session.slot if session is not None else None

    def last_used(self, session_id: str) -> float:
        return self.by_id[session_id].last_used

    def ready(self, job: Job, num_free_slots: int) -> bool:
        """A session that is not in a slot has its saved state read off the engine thread
        first; until then its turn waits (and the engine wakes when the read is done)."""
        if not self._needs_read(job):
            return True
        session = self.by_id[job.session_id]  # type: ignore[index]
        prefetch = self._prefetch.get(session.session_id)
        if prefetch is None:
            if self._reads_in_flight() >= num_free_slots:
                return False  # a state read per free slot at most: each holds a KV state
            prefetch = self._io.submit(session.session_id, self._read_for_swap_in,
                                       session.session_id,
                                       session.ledger.to_json(), dict(session.pixels),
                                       dict(session.rgb))  # fmt: skip
            self._prefetch[session.session_id] = prefetch
            prefetch.add_done_callback(lambda _: self._notify())
        return prefetch.done()

    def waits_for_read(self, job: Job, num_free_slots: int) -> bool:
        """Its session's state is being read, or must wait for a read to end before its own
        starts (the end of a read wakes the engine)."""
        read = self._prefetch.get(job.session_id or "")
        if read is not None:
            return not read.done()
        return self._needs_read(job) and self._reads_in_flight() >= num_free_slots

    def _needs_read(self, job: Job) -> bool:
        if job.session_id is None or self.store is None:
            return False
        session = self.by_id.get(job.session_id)
        return session is not None and session.slot is None and bool(session.ledger.segments)

    def _reads_in_flight(self) -> int:
        return sum(1 for f in self._prefetch.values() if not f.done())

    def enter(self, slot: Slot, job: Job) -> tuple[Ledger, int, int | None]:
        """The session's turn takes slot: its ledger, the segment where the turn's prompt
        starts, and the segment from which the sequence must be decoded again (None: the
        sequence holds the whole ledger; 0: its state did not load)."""
        assert job.session_id is not None
        session = self.get(job.session_id)
        # what an unfinished turn rolls back to: its last completed turn
        session.snapshot = (session.ledger.to_json(), session.num_shifts)
        reprefill = self._swap_in(session, slot) if session.slot is None else None
        session.media.update(job.media)
        session.pixels.update(job.pixels)
        session.rgb.update(job.rgb)
        # the session owns the native chunks and pixels now; the turn reads them through it
        job.media, job.rgb = _SessionMedia(self, session), {}
        return session.ledger, session.ledger.generated_tail(), reprefill

    def end_turn(
        self, job: Job, *, completed: bool, record: TurnRecord | None = None
    ) -> Future[None] | None:
        """Completed: keep its record and save the session (returns the write). Not: back to
        the last completed turn (the ledger from the snapshot; the KV state from disk, or
        re-prefilled)."""
        self._prefetch.pop(job.session_id or "", None)
        if job.session_id is None or job.session_id not in self.by_id:
            return None
        session = self.by_id[job.session_id]
        session.busy = False
        session.last_used = time.monotonic()
        snapshot, session.snapshot = session.snapshot, None
        if completed:
            session.num_turns += 1
            if record is not None:
                session.records.append(replace(record, turn=session.num_turns))
                u = record.usage
                session.num_tail_cells += (
                    u["num_prompt_cells"] - u["num_reused_cells"] + u["num_generated_tokens"]
                )
            self._orphans |= session.prune()
            if self.store is None:  # (no copy of the KV state for nothing)
                return None
            assert session.slot is not None
            due = session.num_journal_turns + 1 >= MAX_JOURNAL_TURNS or (
                session.num_tail_cells >= max(MIN_CHECKPOINT_CELLS, session.ledger.num_cells)
            )
            if due:
                return self._checkpoint(session, self.slots[session.slot])
            return self._save(session, None)
        if snapshot is not None:
            if session.slot is not None:
                self.swap_out(self.slots[session.slot], save=False)
            session.ledger.load_json(snapshot[0])
            session.num_shifts = snapshot[1]
        self._orphans |= session.prune()
        return None

    def on_shift(self, slot: Slot) -> None:
        if slot.owner is not None:
            self.by_id[slot.owner].num_shifts += 1

    def media_of(self, session: Session, key: str) -> MediaHandle:
        """A session's native media chunk (made from the pixels when needed: a session swapped
        in from its KV state has none, and the io side makes those a re-prefill needs)."""
        handle = session.media.get(key)
        if handle is None:
            px = session.pixels[key]
            rgb = session.rgb.get(px.media_id)
            if rgb is None:
                assert self.store is not None
                rgb = self.store.load_media(px.media_id, px.width, px.height)
            handle = session.media[key] = self._media_handle(key, px, rgb)
        return handle

    def _media_handle(self, key: str, px: Pixels, rgb: bytes) -> MediaHandle:
        assert self.rt.mtmd is not None
        return media_handle(self.rt.mtmd, key, Bitmap(px.width, px.height, rgb, px.media_id))

    # -- slots --------------------------------------------------------------------------------

    def swap_out(self, slot: Slot, *, save: bool = True) -> None:
        """The slot's session leaves it, and its media handles are freed. Its journal has every
        completed turn; the KV state it leaves is checkpointed unless the last checkpoint holds
        it (a failed write is written again here too)."""
        assert slot.owner is not None
        session = self.by_id[slot.owner]
        if save and self.store is not None and self._wants_checkpoint(session):
            self._checkpoint(session, slot)
        session.slot = None
        session.release()
        self.executor.clear(slot)
        slot.owner, slot.ledger = None, None

    def _swap_in(self, session: Session, slot: Slot) -> int | None:
        """Put a session's KV state into slot; returns the segment from which its ledger must
        be decoded again (None: the state holds all of it; 0: no saved state, another context
        layout, or a state that does not load)."""
        if slot.ledger is not None and slot.owner is None:
            self.executor.stash(slot)
            slot.ledger = None
        self.executor.clear(slot)
        session.slot, slot.owner, slot.reuse_key = slot.seq, session.session_id, None
        self.stats.num_session_restores += 1
        if not session.ledger.segments:
            return None
        prefetch = self._prefetch.pop(session.session_id, None)
        if prefetch is None or prefetch.exception() is not None:
            return 0
        got = prefetch.result()
        start = got.start if got.kv_state and self.executor.load_state(slot, got.kv_state) else 0
        for key, handle in got.media.items():  # made on the io lane, from the pixels
            if key in session.pixels and key not in session.media:
                session.media[key] = handle
            else:
                handle.close()
        if start == len(session.ledger.segments) and got.exact:
            return None
        return start  # (media the io side did not prepare come from disk when decoded)

    def _read_for_swap_in(
        self,
        session_id: str,
        ledger: list[dict[str, Any]],
        pixels: dict[str, Pixels],
        in_memory: dict[str, bytes],
    ) -> _Prefetched:
        """On its io lane: the checkpoint's KV state if it was made in this context's layout,
        with how many of the ledger's segments it holds, and the media chunks of those it lacks
        made from their pixels (libmtmd's tokenize is thread-safe on a shared context)."""
        assert self.store is not None
        kv_state, start = b"", 0
        try:
            saved = self.store.load(session_id)
        except (KeyError, CorruptSessionError, OSError) as e:
            log.warning("session %r: saved state unusable (%s); re-prefilling", session_id, e)
        else:
            header = saved.header
            if (
                saved.kv_state
                and header.get("layout") == self.rt.layout
                and header.get("kv_digest") == ledger_digest(saved.kv_ledger)
            ):
                kv_state, start = saved.kv_state, _shared_segments(saved.kv_ledger, ledger)
            elif saved.kv_state:
                log.info("session %r: KV state on disk is not usable: re-prefilling", session_id)
        media: dict[str, MediaHandle] = {}
        for seg in ledger[start:]:
            key = seg["media"]
            px = pixels.get(key) if key is not None else None
            if px is None or key in media:
                continue
            rgb = in_memory.get(px.media_id)
            # what fails here is tried again as the turn decodes it, and reported to that turn
            with contextlib.suppress(Exception):
                if rgb is None:
                    rgb = self.store.load_media(px.media_id, px.width, px.height)
                media[key] = self._media_handle(key, px, rgb)
        exact = start == len(saved.kv_ledger) if kv_state else False
        return _Prefetched(kv_state if start else b"", media, start, exact)

    # -- writes -------------------------------------------------------------------------------

    def _checkpoint(self, session: Session, slot: Slot) -> Future[None] | None:
        """Save the session with the KV state its slot holds now."""
        session.last_checkpoint = time.monotonic()  # (tried again later if this fails)
        state = self.executor.state_of(slot)
        session.num_journal_turns = session.num_tail_cells = 0
        return self._save(session, state)

    @staticmethod
    def _wants_checkpoint(session: Session | None) -> bool:
        """Its KV state has turns its last checkpoint lacks, or its last write failed."""
        return (
            session is not None
            and not session.busy
            and (session.dirty or session.num_journal_turns > 0)
        )

    def checkpoint_idle(self, now: float) -> float | None:
        """(Engine thread) a checkpoint of every resident session idle long enough whose journal
        has turns its checkpoint lacks; returns the seconds until the next one is due."""
        due = None
        for slot in self.slots:
            session = self.by_id.get(slot.owner) if slot.owner is not None else None
            if session is None or not self._wants_checkpoint(session):
                continue
            # (after a checkpoint that failed, the next waits as long again)
            since = max(session.last_used, session.last_checkpoint)
            wait = since + self.idle_checkpoint_seconds - now
            if wait <= 0:
                self._checkpoint(session, slot)
            else:
                due = wait if due is None else min(due, wait)
        return due

    def checkpoint_resident(self) -> None:
        """(Engine thread, as the engine stops) a checkpoint of every session in a slot whose
        journal has turns its last checkpoint lacks: the next start loads them whole."""
        for slot in self.slots:
            session = self.by_id.get(slot.owner) if slot.owner is not None else None
            if self._wants_checkpoint(session):
                assert session is not None
                self._checkpoint(session, slot)

    def _save(
        self, session: Session, kv_state: bytes | bytearray | memoryview | None
    ) -> Future[None] | None:
        """Write the session's current state: a checkpoint with kv_state, or (None) what
        changed since the header on disk, appended to its journal.

        The write runs on the session's io lane; after a failure the next one writes what the
        header on disk lacks again. A write queued behind a running one is merged with a newer
        one of the same session (pending writes stay bounded: one checkpoint and one header
        each).
        """
        if self.store is None:
            return None
        header = session.header(self.rt.fingerprint, self.rt.layout, "")
        checkpoint = None
        if kv_state is not None:
            checkpoint = (header, kv_state)
        else:
            session.num_journal_turns += 1
        media = {px.media_id for px in session.pixels.values() if px.media_id in session.rgb}
        future: Future[None] = Future()
        sid = session.session_id
        session.dirty = True
        session.num_saves += 1
        number = session.num_saves
        pixels = [(m, session.rgb[m]) for m in media]
        write = _Write(session, header, checkpoint, pixels, [future], int(checkpoint is not None))
        if self._writes.queue(sid, write):
            self._io.submit(sid, self._write, sid, session)

        def saved(done: Future[None]) -> None:  # back on the engine thread: drop what is on disk
            if not done.cancelled() and done.exception() is None:
                with contextlib.suppress(EngineStoppedError):
                    self._call(lambda: self._saved(session, number, media))

        future.add_done_callback(saved)
        return future

    def _write(self, session_id: str, session: Session) -> None:
        """On its io lane: the newest queued state of one session, pixels first, over the
        generation this replica holds and no other."""
        assert self.store is not None
        write = self._writes.take(session_id, session)
        if write is None:
            return
        store = self.store
        try:
            pixels = write.pixels
            if write.checkpoint is not None:
                header, kv_state = write.checkpoint
                header["kv_digest"] = ledger_digest(header["ledger"])  # (here, off the engine)
                # a checkpoint of what is on disk already (idle, swap-out, drain) takes no new
                # generation: a replica the session has moved to goes on writing after it
                on_disk = self._written.get(session_id)
                same = on_disk is not None and not header_delta.diff(on_disk, header)
                self._generations[session_id] = store.save(
                    session_id, header, kv_state, expect=self._generations.get(session_id),
                    pixels=pixels, same_state=same,
                )  # fmt: skip
                self._written[session_id] = header
                self._count(len(kv_state) + len(json.dumps(header)))
                pixels = []
                for f in write.futures[: write.covered]:  # on disk, whatever follows
                    resolve(f, None)
                del write.futures[: write.covered]
            base = self._written.get(session_id)
            if base is not write.header and (
                base is None or (delta := header_delta.diff(base, write.header))
            ):
                try:
                    if base is None:
                        raise CorruptSessionError("no header held")
                    self._generations[session_id], n = store.append(
                        session_id, delta, expect=self._generations[session_id], pixels=pixels
                    )
                except CorruptSessionError:  # a checkpoint without KV bytes replaces it
                    header = {**write.header, "kv_digest": ""}
                    self._generations[session_id] = store.save(
                        session_id, header, b"", expect=self._generations.get(session_id),
                        pixels=pixels,
                    )  # fmt: skip
                    n = len(json.dumps(header))
                self._written[session_id] = write.header
                self._count(n)
        except StaleSessionError as e:
            log.warning("session %r not saved: %s", session_id, e)
            failure = ProblemError(problem(
                ErrorKind.ABORTED, Reason.SESSION_STALE,
                f"the turn was not saved: {e}; the next turn continues from the newer state",
                found=e.found.number if e.found is not None else "none",
            ))  # fmt: skip
            for f in write.futures:
                resolve(f, error=failure)
            with contextlib.suppress(EngineStoppedError):
                self._call(lambda: self._stale(write.session))
        except Exception as e:  # every waiter hears it: a full disk, or anything else
            log.warning("session %r not saved: %s", session_id, e)
            failure = ProblemError(
                storage_problem(e, "the turn was not saved")
                if isinstance(e, OSError)
                else Problem(ErrorKind.INTERNAL, f"the turn was not saved: {e!r}", Reason.INTERNAL)
            )
            for f in write.futures:
                resolve(f, error=failure)
        else:
            for f in write.futures:
                resolve(f, None)

    def _count(self, num_bytes: int) -> None:  # (lanes write side by side)
        with self._counting:
            self.bytes_written += num_bytes

    def _saved(self, session: Session, number: int, media_ids: set[str]) -> None:
        if self.by_id.get(session.session_id) is not session:
            return  # deleted, or replaced by a newer copy from disk
        if number == session.num_saves:  # the newest save asked for is on disk
            session.dirty = False
        for media_id in media_ids:
            session.rgb.pop(media_id, None)
        if self._orphans:
            self._io.submit(_PIXELS, self._pixel_collector())

    def _pixel_collector(self) -> Callable[[], None]:
        """(Engine thread) what an io lane runs to delete the saved pixels no session needs
        any more: none in this replica's memory (snapshot now) and none in any session file in
        the directory (every replica's, read when it runs, with their writes held off). The
        disk stays bounded by what sessions hold. With a broken session file around, whose
        needs are unknown, nothing is deleted."""
        store = self.store
        assert store is not None
        candidates, self._orphans = self._orphans, set()
        in_memory = {m for s in self.by_id.values() for m in (*s.media_ids(), *s.rgb)}
        broken = bool(self.broken)

        def collect() -> None:
            with self._collecting:
                self._io_orphans |= candidates
                if broken:
                    return
                with store.collecting_pixels() as on_disk:  # every replica's files, no writes
                    if on_disk is None:  # a file whose needs are unknown: nothing goes
                        return
                    gone = self._io_orphans - in_memory - on_disk
                    for media_id in gone:
                        store.delete_media(media_id)
                self._io_orphans -= gone

        return collect

    # -- reading sessions ---------------------------------------------------------------------

    def _read_header(
        self, session_id: str, *, hold: bool = False
    ) -> dict[str, Any] | BaseException:
        """A session file's header (or why it is unusable), off the engine thread: the pixels
        of every image its ledger holds must be there too (they are hashed when read).
        hold: this replica holds this generation from now on (its next write follows it)."""
        assert self.store is not None
        try:
            header = self.store.load_header(session_id)
            held = {seg.get("media") for seg in header.get("ledger", ())} - {None}
            for key, px in dict(header.get("pixels", {})).items():
                if key in held and not self.store.has_media(px["media_id"]):
                    raise CorruptSessionError(f"pixels of media {px['media_id'][:12]} are missing")
            if hold:
                self._hold(session_id, _generation_of(header), header)
        except Exception as e:  # whatever is wrong with the file, the session is reported
            return e
        return header

    def _register(self, session_id: str, header: dict[str, Any] | BaseException) -> None:
        try:
            if isinstance(header, BaseException):
                raise header
            fp = header.get("fingerprint", {})
            if Fingerprint(**fp) != self.rt.fingerprint:
                raise _error(
                    ErrorKind.FAILED_PRECONDITION,
                    Reason.SESSION_FOREIGN,
                    f"session {session_id!r} was saved with another model ({str(fp)[:80]})",
                )
            session = Session.from_header(session_id, header, self.executor.new_ledger)
            self._orphans |= session.prune()
        except SessionError as e:
            log.warning("%s", e)
            self.broken[session_id] = e
            return
        except KeyError as e:
            if e.args == (session_id,):  # no file (deleted meanwhile)
                return
            self._unreadable(session_id, e)
            return
        except Exception as e:  # CorruptSessionError, OSError, a header of the wrong shape, ...
            self._unreadable(session_id, e)
            return
        self.by_id[session_id] = session

    def _unreadable(self, session_id: str, e: BaseException) -> None:
        log.warning("session %r is unreadable: %s", session_id, e)
        self.broken[session_id] = _error(
            ErrorKind.DATA_LOSS,
            Reason.SESSION_UNREADABLE,
            f"session {session_id!r} is unreadable: {e}",
        )


def _generation_of(header: dict[str, Any]) -> Generation:
    return Generation(str(header.get("lineage", "")), int(header["generation"]))


def _error(kind: ErrorKind, reason: Reason, message: str) -> SessionError:
    return SessionError(kind, message, reason)


class _SessionMedia(Mapping[str, MediaHandle]):
    """A session turn's media chunks: its session's, made when first asked for."""

    def __init__(self, manager: SessionManager, session: Session):
        self._manager, self._session = manager, session

    def __getitem__(self, key: str) -> MediaHandle:
        return self._manager.media_of(self._session, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._session.pixels)

    def __len__(self) -> int:
        return len(self._session.pixels)


def _shared_segments(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """How many first segments two ledgers (as JSON) have alike."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Prefetched:
    """What a swap-in needs, read on its io lane: a checkpoint's KV state and how many of the
    ledger's segments it holds, and the media chunks of those it lacks."""

    kv_state: bytes
    media: dict[str, MediaHandle]  # media key -> its chunk
    start: int = 0
    exact: bool = False  # the state holds those segments and nothing else


_Checkpoint = tuple[dict[str, Any], bytes | bytearray | memoryview]  # header, KV state


@dataclass
class _Write:
    session: Session  # the copy it is of (a stale one is dropped when its write is refused)
    header: dict[str, Any]  # the newest
    checkpoint: _Checkpoint | None  # to write first (its header may be older than the newest)
    pixels: list[tuple[str, bytes]]
    futures: list[Future[None]]
    covered: int = 0  # the first futures, whose state the checkpoint holds


class _Writes:
    """Per session, the newest state waiting for its io lane: one queued write each, so a
    slow or full disk holds at most one pending state per session, not one per turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: dict[str, _Write] = {}

    def queue(self, session_id: str, write: _Write) -> bool:
        """True when a write must be scheduled (none was queued for this session)."""
        with self._lock:
            old = self._queued.get(session_id)
            if old is None:
                self._queued[session_id] = write
                return True
            if old.session is not write.session:  # (a dropped copy's: never merged into this)
                stale = ProblemError(problem(
                    ErrorKind.ABORTED, Reason.SESSION_STALE,
                    f"session {session_id!r} was replaced by a newer copy before this was saved",
                ))  # fmt: skip
                for f in old.futures:
                    resolve(f, error=stale)
                self._queued[session_id] = write
                return True  # (the old copy's write task finds nothing of its own)
            if write.checkpoint is None:  # the queued checkpoint is still written, then this
                write.checkpoint, write.covered = old.checkpoint, old.covered
            else:  # the newer checkpoint holds every state queued before it
                write.covered += len(old.futures)
            write.pixels[:0] = old.pixels
            write.futures[:0] = old.futures
            self._queued[session_id] = write
            return False

    def take(self, session_id: str, session: Session | None = None) -> _Write | None:
        """The queued write (of that copy only, when given)."""
        with self._lock:
            write = self._queued.get(session_id)
            if write is None or (session is not None and write.session is not session):
                return None
            return self._queued.pop(session_id)


def _untitle(session: Session, title: str, old: str) -> None:
    if session.title == title:  # (not renamed again since)
        session.title = old
