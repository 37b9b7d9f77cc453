"""A session's files: a journal entry per completed turn, checkpoints of its KV state, what
another replica did to them (sync), and the collection of pixels no session needs.

Disk work runs on disk queues (infer_service/sessions/disk_queues.py): a session's in the order
it was asked for, another session's beside it, pixel collection in a queue of its own. What runs
on the engine thread here only builds headers and queues writes; the KV state a checkpoint holds
is copied out of llama.cpp by the caller, when `checkpoint_due` (or a swap-out, an idle session,
a stop) says one is worth it.

Nothing here reaches back into the session manager: a write's future says how it went (a
refusal as stale is a ProblemError with Reason.SESSION_STALE), and the manager decides what
that means for the session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from infer_service.events import (
    EngineStoppedError,
    ErrorKind,
    Problem,
    ProblemError,
    Reason,
    problem,
    storage_problem,
)
from infer_service.sessions import header_delta
from infer_service.sessions.disk_queues import DiskQueues, resolve
from infer_service.sessions.session import Session
from infer_service.sessions.store import (
    CorruptSessionError,
    Generation,
    SessionStore,
    StaleSessionError,
    Unused,
    ledger_digest,
)
from slotwise_core.descriptors import Fingerprint

log = logging.getLogger("slotwise.engine")

IO_WORKERS = 4  # sessions whose disk work runs at once
_PIXELS = ""  # the queue of pixel collection (no session has an empty id)
_SWEEP = "/"  # the queue that looks for sessions unused too long (nor has one a slash)
MAX_JOURNAL_TURNS = 128  # entries a journal holds before a checkpoint folds them in
MIN_CHECKPOINT_CELLS = 1024  # a checkpoint is due once this many cells (at least) were decoded

KvState = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Changed:
    """What a sync found: the session file as another replica left it (header None: the file
    is gone; an exception: it is unusable), or (damaged) a file this replica cannot read."""

    header: dict[str, Any] | BaseException | None
    damaged: bool = False


@dataclass(frozen=True)
class Used:
    """What a sync found: the generation this replica holds, its files written or touched
    since this replica last looked at them (another replica's turn under way, or a checkpoint
    of the same state)."""

    at: float  # when (time.time(), the files' clock)


class Persistence:
    def __init__(self, store: SessionStore | None, fingerprint: Fingerprint, layout: Any):
        self.store = store
        self._fingerprint, self._layout = fingerprint, layout
        self.disk_queues = DiskQueues(IO_WORKERS, "session-io")
        self._writes = _Writes()
        self._collecting = threading.Lock()  # (a deletion collects too, on its session's queue)
        self._counting = threading.Lock()
        self.orphans: set[str] = set()  # (engine thread) media ids a session stopped using
        # each on its session's queue only (filled before the queues start): the generation of
        # each session this replica holds (its writes must find that one on disk), the header
        # on disk; pixels waiting to be collected (pixel collection only)
        self._generations: dict[str, Generation] = {}
        self._written: dict[str, dict[str, Any]] = {}  # (what a turn's delta is from)
        self._io_orphans: set[str] = set()
        self.bytes_written = 0  # session files and journals (the queues, under _counting)
        # per session: its bytes on disk and when they were last written, as measured after
        # this replica's last read or write of them (the queues, under _counting)
        self._footprints: dict[str, tuple[int, float]] = {}

    def close(self) -> None:
        self.disk_queues.shutdown()

    # -- when a checkpoint is due (engine thread) ---------------------------------------------

    @staticmethod
    def checkpoint_due(session: Session) -> bool:
        """After a completed turn: the journal is long, or the cells decoded since the last
        checkpoint reach the session's own size (so a checkpoint's cost, about the session's
        KV bytes, is paid once per doubling)."""
        disk = session.disk
        return disk.num_journal_turns + 1 >= MAX_JOURNAL_TURNS or (
            disk.num_tail_cells >= max(MIN_CHECKPOINT_CELLS, session.ledger.num_cells)
        )

    @staticmethod
    def behind(session: Session) -> bool:
        """Its KV state has turns its last checkpoint lacks, or its last write failed."""
        return session.disk.dirty or session.disk.num_journal_turns > 0

    # -- writes -------------------------------------------------------------------------------

    def checkpoint(self, session: Session, kv_state: KvState) -> Future[None] | None:
        """Save the session with the KV state its sequence holds now."""
        disk = session.disk
        disk.last_checkpoint = time.monotonic()  # (tried again later if this fails)
        disk.num_journal_turns = disk.num_tail_cells = 0
        return self.save(session, kv_state)

    def save(self, session: Session, kv_state: KvState | None = None) -> Future[None] | None:
        """Write the session's current state: a checkpoint with kv_state, or (None) what
        changed since the header on disk, appended to its journal. None without a store.

        The write runs on the session's disk queue; after a failure the next one writes what the
        header on disk lacks again. A write queued behind a running one is merged with a newer
        one of the same session (pending writes stay bounded: one checkpoint and one header
        each). The future's callbacks run on a disk queue.
        """
        if self.store is None:
            return None
        header = session.header(self._fingerprint, self._layout, "")
        checkpoint = None
        if kv_state is not None:
            checkpoint = (header, kv_state)
        else:
            session.disk.num_journal_turns += 1
        media = {px.media_id for px in session.pixels.values() if px.media_id in session.rgb}
        future: Future[None] = Future()
        sid = session.session_id
        session.disk.dirty = True
        session.disk.num_saves += 1
        pixels = [(m, session.rgb[m]) for m in media]
        write = _Write(session, header, checkpoint, pixels, [future], int(checkpoint is not None))
        if self._writes.queue(sid, write):
            self.disk_queues.submit(sid, self._write, sid, session)
        return future

    def refuse_queued(self, session_id: str, why: Problem) -> None:
        """A queued write of the session that has not started must not land (deleted, or a
        stale copy): its waiters hear why."""
        queued = self._writes.take(session_id)
        for f in queued.futures if queued else ():
            resolve(f, error=ProblemError(why))

    def _write(self, session_id: str, session: Session) -> None:
        """On its disk queue: the newest queued state of one session, pixels first, over the
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
                self._measure(session_id, header)
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
                self._measure(session_id, write.header)
        except StaleSessionError as e:
            log.warning("session %r not saved: %s", session_id, e)
            failure = ProblemError(problem(
                ErrorKind.ABORTED, Reason.SESSION_STALE,
                f"the turn was not saved: {e}; the next turn continues from the newer state",
                found=e.found.number if e.found is not None else "none",
            ))  # fmt: skip
            for f in write.futures:
                resolve(f, error=failure)
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

    def _count(self, num_bytes: int) -> None:  # (queues write side by side)
        with self._counting:
            self.bytes_written += num_bytes

    # -- what sessions take on disk -----------------------------------------------------------

    def footprint(self, session_id: str) -> tuple[int, float] | None:
        """(Any thread) The session's bytes on disk and when they were last written
        (time.time()), as of this replica's last read or write of them (None: unknown)."""
        with self._counting:
            return self._footprints.get(session_id)

    def _measure(self, session_id: str, header: dict[str, Any] | None) -> None:
        """(Its session's disk queue) its files, and the pixels of the images it holds: each
        image once per session, even where another session holds it too."""
        assert self.store is not None
        try:
            found = self.store.footprint(session_id)
        except OSError:  # (a measure, never a write's failure: the next write measures again)
            return
        if found is None:
            self._forget_footprint(session_id)
            return
        num_bytes, written = found
        with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):  # (damaged)
            pixels = {px["media_id"]: px for px in (header or {}).get("pixels", {}).values()}
            num_bytes += sum(self._media_bytes(px) for px in pixels.values())
        with self._counting:
            self._footprints[session_id] = (num_bytes, written)

    def _media_bytes(self, px: dict[str, Any]) -> int:
        """What a medium takes on disk: an image's raw pixels; a sound's file, as it is."""
        if px.get("kind", "image") == "image":
            return 3 * int(px["width"]) * int(px["height"])
        assert self.store is not None
        return self.store.media_bytes(str(px["media_id"]))

    def _forget_footprint(self, session_id: str) -> None:
        with self._counting:
            self._footprints.pop(session_id, None)

    def touch(self, session_id: str) -> None:
        """(Engine thread) A turn takes the session: its files say so to other replicas (on
        its disk queue, so before the turn's read and write), whose expiry, eviction or sweep
        would otherwise find it unused by its files' last write and delete it under the
        turn."""
        store = self.store
        if store is None:
            return

        def touch() -> None:
            # (a mark only: a file gone meanwhile, or a failing disk, is the turn's write's
            # to report)
            with contextlib.suppress(OSError):
                store.touch(session_id)

        with contextlib.suppress(RuntimeError):  # (the disk queues are shut down: stopping)
            self.disk_queues.submit(session_id, touch)

    def unused(self, before: float) -> Future[list[str]]:
        """The sessions in the directory (every replica's) whose files were last written
        before `before` (time.time()), listed on a queue of its own."""
        assert self.store is not None
        return self.disk_queues.submit(_SWEEP, self.store.unused_since, before)

    # -- deletion and pixels ------------------------------------------------------------------

    def delete(
        self,
        session_id: str,
        in_memory: set[str],
        broken: bool,
        missing: Exception | None,
        *,
        unused_before: float | None = None,
    ) -> Future[bool]:
        """Remove the session's files, after its pending writes (on its queue), and collect
        the pixels nobody needs then; the future says whether a file was there (without one,
        it raises `missing` if given). unused_before: a deletion because the session looks
        unused (expiry, eviction, a sweep), made only if its files still say so: the
        generation this replica holds, and no write or touch since unused_before but this
        replica's own (store.Unused). It never deletes a session under another replica that
        has used it since, in a turn or with a checkpoint that kept the generation."""
        assert self.store is not None
        store, collect = self.store, self.pixel_collector(in_memory, broken)

        def delete() -> bool:
            unused = None
            if unused_before is not None:
                unused = Unused(unused_before, self._generations.get(session_id))
            # the pixels of a file this replica never read are collected too
            pixels = self._pixels_in(session_id) if session_id not in self._written else set()
            found = store.delete(session_id, unused=unused)
            if found and pixels:
                with self._collecting:
                    self._io_orphans |= pixels
            self.hold(session_id, None, None)
            self._forget_footprint(session_id)
            collect()
            if not found and missing is not None:
                raise missing
            return found

        return self.disk_queues.submit(session_id, delete)

    def _pixels_in(self, session_id: str) -> set[str]:
        assert self.store is not None
        with contextlib.suppress(Exception):  # (damaged: what it refers to is unknown)
            pixels = self.store.load_header(session_id).get("pixels", {})
            return {str(px["media_id"]) for px in pixels.values()}
        return set()

    def collect_pixels(self, in_memory: set[str], broken: bool) -> None:
        """(Engine thread) queue a collection of the orphans, if there are any."""
        if self.orphans and self.store is not None:
            self.disk_queues.submit(_PIXELS, self.pixel_collector(in_memory, broken))

    def pixel_collector(self, in_memory: set[str], broken: bool) -> Callable[[], None]:
        """(Engine thread) what a disk queue runs to delete the saved pixels no session needs
        any more: none in this replica's memory (`in_memory`, as of now) and none in any
        session file in the directory (every replica's, read when it runs, with their writes
        held off). The disk stays bounded by what sessions hold. With a broken session file
        around, whose needs are unknown, nothing is deleted."""
        store = self.store
        assert store is not None
        candidates, self.orphans = self.orphans, set()

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

    # -- reading ------------------------------------------------------------------------------

    def read_header(self, session_id: str, *, hold: bool = False) -> dict[str, Any] | BaseException:
        """A session file's header (or why it is unusable), off the engine thread: the pixels
        of every image its ledger holds must be there too (they are hashed when read).
        hold: this replica holds this generation from now on (its next write follows it)."""
        assert self.store is not None
        header = None
        try:
            header = self.store.load_header(session_id)
            held = {seg.get("media") for seg in header.get("ledger", ())} - {None}
            for key, px in dict(header.get("pixels", {})).items():
                if key in held and not self.store.has_media(px["media_id"]):
                    raise CorruptSessionError(f"pixels of media {px['media_id'][:12]} are missing")
            if hold:
                self.hold(session_id, generation_of(header), header)
        except Exception as e:  # whatever is wrong with the file, the session is reported
            return e
        finally:  # (a damaged file takes its room, and ages, too)
            self._measure(session_id, header)
        return header

    def hold(
        self, session_id: str, generation: Generation | None, header: dict[str, Any] | None
    ) -> None:
        """(Its session's disk queue) the generation this replica's next write must find."""
        if generation is None or header is None:
            self._generations.pop(session_id, None)
            self._written.pop(session_id, None)
            if self.store is not None:
                self.store.forget(session_id)
        else:
            self._generations[session_id] = generation
            self._written[session_id] = header

    def changes(self, session_id: str) -> Future[Changed | Used | None]:
        """(Any thread) What another replica sharing the directory did to the session since
        this one last read or wrote it, read on its disk queue: None when the generation on disk
        is the one this replica holds (then nothing is read but the checkpoint's first bytes,
        the journal, MAX_JOURNAL_TURNS entries at most, and the files' times), Used when its
        files were written or touched since all the same (a turn elsewhere under way, a
        checkpoint of the same state)."""
        store = self.store
        assert store is not None

        def read() -> Changed | Used | None:
            try:
                found = store.generation(session_id)
            except CorruptSessionError as e:
                return Changed(e, damaged=True)
            except OSError as e:
                raise ProblemError(storage_problem(e, "the sessions directory")) from e
            if found == self._generations.get(session_id):
                return self._used_since(session_id)
            if found is None:
                self._forget_footprint(session_id)
                return Changed(None)
            return Changed(self.read_header(session_id))

        try:
            return self.disk_queues.submit(session_id, read)
        except RuntimeError:  # the disk queues are shut down: the engine is stopping
            stopped: Future[Changed | Used | None] = Future()
            stopped.set_exception(EngineStoppedError(problem(
                ErrorKind.UNAVAILABLE, Reason.SHUTTING_DOWN, "server shutting down",
            )))  # fmt: skip
            return stopped

    def _used_since(self, session_id: str) -> Used | None:
        """(Its session's disk queue) The session's files' last write, if it is later than this
        replica last measured: the generation it holds is still there, so it was a touch (or
        a checkpoint of the same state)."""
        before = self.footprint(session_id)
        header = self._written.get(session_id)
        if before is None or header is None:
            return None
        self._measure(session_id, header)
        after = self.footprint(session_id)
        return Used(after[1]) if after is not None and after[1] > before[1] else None

    def hold_later(self, session_id: str, header: dict[str, Any] | None) -> None:
        """(Engine thread) after this replica's writes queued so far (those of a dropped copy
        are refused), hold the generation of `header` (None: none)."""
        generation = generation_of(header) if header is not None else None
        self.disk_queues.submit(session_id, self.hold, session_id, generation, header)


def generation_of(header: dict[str, Any]) -> Generation:
    return Generation(str(header.get("lineage", "")), int(header["generation"]))


_Checkpoint = tuple[dict[str, Any], KvState]  # header, KV state


@dataclass
class _Write:
    session: Session  # the copy it is of (a stale one is dropped when its write is refused)
    header: dict[str, Any]  # the newest
    checkpoint: _Checkpoint | None  # to write first (its header may be older than the newest)
    pixels: list[tuple[str, bytes]]
    futures: list[Future[None]]
    covered: int = 0  # the first futures, whose state the checkpoint holds


class _Writes:
    """Per session, the newest state waiting for its disk queue: one queued write each, so a
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
