"""The engine: one thread that owns llama.cpp, every slot's ledger, and the step loop.

A step carries out each slot's ledger plan, decodes at most one media chunk per slot, then puts
every slot's next text (one generated token, or up to batch_size prompt tokens) into ONE
llama_decode, and samples every slot whose logits came out of it. Handlers talk to the engine
through `submit`, `call` and the job's `emit` callback; they never touch llama.cpp.

A finished request leaves its sequence in the slot: the next request that shares a prefix
(chunk identity: token ids, media ids) decodes only the rest. A session owns its slot between
turns, is saved after every completed turn, and is swapped out (least recently used) when the
slots are needed and swapped back in, from disk, on its next turn.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
from llama_cpp import mtmd_cpp

from infer_service.events import (
    ContextShift,
    ErrorKind,
    Event,
    Finished,
    FinishReason,
    Persistence,
    PrefillProgress,
    Problem,
    ProblemError,
    Reason,
    Rejected,
    Started,
    TokenDelta,
    Usage,
    problem,
    storage_problem,
)
from infer_service.ledger import (
    CannotFit,
    ContextConfig,
    Fits,
    Gap,
    Item,
    Ledger,
    Plan,
    Policy,
    Reprefill,
    Shift,
)
from infer_service.media import MediaHandle, media_handle, media_key
from infer_service.runtime import EmbeddingCache, Runtime, SamplingConfig
from infer_service.session_store import CorruptSessionError, SessionStore, ledger_digest
from infer_service.sessions import Pixels, Session
from infer_service.state_cache import StateCache, reuse_of
from infer_service.text_stream import TextStream
from slotwise_core import native
from slotwise_core.descriptors import Fingerprint, MediaChunk, PreparedPrompt
from slotwise_core.native import Bitmap

log = logging.getLogger("slotwise.engine")
T = TypeVar("T")


class QueueFullError(ProblemError):
    pass


class SessionError(ProblemError):
    def __init__(self, kind: ErrorKind, message: str, reason: Reason = Reason.INTERNAL):
        super().__init__(Problem(kind, message, reason))


class EngineStoppedError(ProblemError):
    """The engine thread is gone (stopped, or died): nothing more will run."""


def _session_error(kind: ErrorKind, reason: Reason, message: str) -> SessionError:
    return SessionError(kind, message, reason)


@dataclass(eq=False)  # a job is itself: the wait queue removes this one, not an equal one
class Job:
    items: list[Item]
    media: dict[str, MediaHandle]
    emit: Callable[[Event], None]
    sampling: SamplingConfig = SamplingConfig()
    context: ContextConfig = ContextConfig()
    max_tokens: int = 256
    stop: Sequence[str] = ()
    deadline: float | None = None  # time.monotonic()
    session_id: str | None = None
    stream_tokens: int = 1  # tokens per TokenDelta
    pixels: dict[str, Pixels] = field(default_factory=dict)
    rgb: dict[str, bytes] = field(default_factory=dict)  # media_id -> pixels (session turns)
    cancelled: threading.Event = field(default_factory=threading.Event)
    resume: int | None = None  # a StateCache entry to continue (chosen with the slot)

    def cancel(self) -> None:
        self.cancelled.set()

    def release(self) -> None:
        for h in self.media.values():
            h.close()


def prompt_items(prompt: PreparedPrompt) -> tuple[list[Item], dict[str, Pixels]]:
    """Descriptor chunks -> ledger items (media keyed per slice of an image), and where the
    pixels of each media key come from."""
    items = []
    pixels: dict[str, Pixels] = {}
    slices: dict[int, int] = {}
    for c in prompt.chunks:
        group = c.media_group or None
        if isinstance(c, MediaChunk):
            k = slices.get(c.media_group, 0)
            slices[c.media_group] = k + 1
            key = media_key(c.media_id, k)
            pixels[key] = Pixels(c.width, c.height, c.media_id)
            items.append(
                Item(c.num_cells, c.num_positions, c.message_index, media_id=key, group=group)
            )
        else:
            n = len(c.token_ids)
            items.append(Item(n, n, c.message_index, token_ids=c.token_ids, group=group))
    return items, pixels


@dataclass
class _Slot:
    seq: int
    job: Job | None = None
    ledger: Ledger | None = None  # what the sequence holds, also between requests
    owner: str | None = None  # session id whose sequence this is
    pending: deque[Item] = field(default_factory=deque)
    sampler: int = 0
    text: TextStream = field(default_factory=TextStream)
    unsent: TokenDelta | None = None  # tokens held for the next TokenDelta (stream_tokens > 1)
    piece: _MediaPiece | None = None  # a media chunk being decoded, a piece per step
    usage: Usage = field(default_factory=Usage)
    num_prefill_total: int = 0
    num_prefill_done: int = 0
    prefilling: bool = True
    reply_index: int = 0  # message index of generated tokens
    t_start: float = 0.0


@dataclass
class EngineStats:
    num_decodes: int = 0
    num_multi_seq_decodes: int = 0
    num_media_decodes: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0
    num_session_restores: int = 0
    num_session_reprefills: int = 0
    num_evicted_cells: int = 0
    shifts_by_policy: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(
        self,
        runtime: Runtime,
        *,
        max_queue: int = 64,
        cache_bytes: int = 1 << 30,
        store: SessionStore | None = None,
        state_cache_bytes: int = 256 << 20,
    ):
        self.rt = runtime
        self.slots = [_Slot(seq) for seq in range(runtime.num_slots)]
        self.max_queue = max_queue
        self.cache = EmbeddingCache(cache_bytes)
        self.states = StateCache(state_cache_bytes)  # stateless conversations that lost a slot
        self.stats = EngineStats()
        self.store = store
        self.sessions: dict[str, Session] = {}
        self.broken_sessions: dict[str, SessionError] = {}
        self._waiting: deque[Job] = deque()  # touched only under _wake
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.died: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, name="llama-engine", daemon=True)
        # disk work, in order: session writes, reads before a swap-in, deletions
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-io")
        # the projector runs here, beside llama_decode: the other slots keep decoding while
        # an image is encoded (libmtmd's encode and llama.cpp's decode share no state: the
        # embeddings are copied out of the mtmd context before the engine sees them)
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="media-encode")
        self._encoding: dict[str, Future[np.ndarray]] = {}  # media key -> its encode
        self._encoded: dict[str, np.ndarray] = {}  # finished, until their slot decodes them
        self._writes = _Writes()
        self._prefetch: dict[str, Future[_Prefetched]] = {}  # session id -> its swap-in read
        self._restoring: set[str] = set()
        self._deleting: set[str] = set()  # deletions queued on the io thread
        self._orphans: set[str] = set()  # media ids a session stopped referring to
        # io thread only (filled before it starts): the media each session's file on disk
        # refers to, as of its last write that landed, and pixels waiting to be collected
        self._disk_media: dict[str, set[str]] = {}
        self._io_orphans: set[str] = set()
        self.on_first_token: Callable[[float], None] = lambda seconds: None  # TTFT
        self.on_death: Callable[[BaseException], None] = lambda error: None
        if store is not None:
            for session_id in store.ids():
                self._load_session(session_id)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        self._encoder.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True)

    @property
    def alive(self) -> bool:
        return self.died is None and not self._stopping

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return sum(1 for s in self.slots if s.job)

    def submit(self, job: Job) -> None:
        with self._wake:
            self._check_alive()
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    Problem(
                        ErrorKind.RESOURCE_EXHAUSTED,
                        f"all {len(self.slots)} slots are busy and {len(self._waiting)} requests "
                        f"wait (queue limit {self.max_queue}); retry later",
                        Reason.QUEUE_FULL,
                        (("queue_limit", str(self.max_queue)), ("slots", str(len(self.slots)))),
                        retry_after=1.0,
                    )
                )
            self._waiting.append(job)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the engine thread between steps (it may touch slots and sessions).

        A caller that gives up cancels the future: fn is then skipped, never run late.
        """
        future: Future[T] = Future()
        with self._wake:
            self._check_alive()
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def _check_alive(self) -> None:
        if self.died is not None or self._stopping:
            why = "died" if self.died is not None else "is shutting down"
            raise EngineStoppedError(
                Problem(
                    ErrorKind.UNAVAILABLE,
                    f"the engine {why}; retry on another replica or after the restart",
                    Reason.ENGINE_DIED if self.died is not None else Reason.SHUTTING_DOWN,
                )
            )

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def new_ledger(self, ctx: ContextConfig) -> Ledger:
        return Ledger(
            self.rt.num_cells_per_slot,
            can_shift=self.rt.can_shift,
            n_ctx_train=self.rt.n_ctx_train,
            policy=ctx.policy,
            keep=ctx.keep,
            discard_fraction=ctx.discard_fraction,
            unit=ctx.unit,
        )

    # -- the loop ---------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Crash-only: if the loop ever dies, every caller hears it and the process is told
        (on_death), instead of a thread that is gone while health says SERVING."""
        try:
            self._run()
        except BaseException as e:
            with self._wake:
                self.died = e
            log.critical("the engine thread died", exc_info=e)
            gone = Problem(ErrorKind.UNAVAILABLE, f"the engine died: {e!r}", Reason.ENGINE_DIED)
            self._end_everything(gone)
            self.on_death(e)

    def _end_everything(self, why: Problem) -> None:
        """Every active, queued and pending caller gets `why`; nothing waits forever."""
        for slot in self.slots:
            if slot.job:
                job, slot.job = slot.job, None
                _safely(job.emit, Finished(FinishReason.CANCELLED, error=why.message, problem=why))
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
            calls, self._calls = list(self._calls), deque()
        for job in waiting:
            _safely(job.emit, Rejected(why))
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStoppedError(why))

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._calls or self._has_work()):
                    if self._encoding:  # a slot waiting for its image may be cancelled
                        self._wake.wait(_ENCODE_POLL)
                        break
                    self._wake.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                if not future.set_running_or_notify_cancel():
                    continue  # its caller went away (deadline, cancel): nobody wants it now
                try:
                    result = fn()
                except BaseException as e:
                    future.set_exception(e)
                else:
                    future.set_result(result)
            try:
                self._admit_waiting()
                self._step()
            except Exception as e:  # a bug: fail the active jobs, keep serving
                log.exception("engine step failed")
                for slot in self.slots:
                    if slot.job:
                        self._finish(slot, FinishReason.ERROR, error=f"internal error: {e}")
        self._end_everything(
            Problem(ErrorKind.UNAVAILABLE, "server shutting down", Reason.SHUTTING_DOWN)
        )

    def _has_work(self) -> bool:
        runnable = any(s.job and not self._waits_for_encode(s) for s in self.slots)
        return runnable or (
            self._free_slot_exists() and any(not self._waits_for_read(j) for j in self._waiting)
        )

    def _waits_for_read(self, job: Job) -> bool:
        """Its session's state is being read, or must wait for a read to end before its own
        starts (the end of a read wakes the engine)."""
        read = self._prefetch.get(job.session_id or "")
        if read is not None:
            return not read.done()
        return self._needs_read(job) and self._reads_in_flight() >= self._num_free_slots()

    def _needs_read(self, job: Job) -> bool:
        if job.session_id is None or self.store is None:
            return False
        session = self.sessions.get(job.session_id)
        return session is not None and session.slot is None and bool(session.ledger.segments)

    def _reads_in_flight(self) -> int:
        return sum(1 for f in self._prefetch.values() if not f.done())

    def _num_free_slots(self) -> int:
        return sum(1 for s in self.slots if s.job is None)

    def _waits_for_encode(self, slot: _Slot) -> bool:
        front = slot.pending[0] if slot.pending else None
        encode = self._encoding.get(front.media_id or "") if front is not None else None
        return encode is not None and not encode.done()

    def _free_slot_exists(self) -> bool:
        return any(s.job is None for s in self.slots)

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        with self._wake:
            gone = [
                job
                for job in self._waiting
                if job.cancelled.is_set() or (job.deadline is not None and now > job.deadline)
            ]
            for job in gone:
                self._waiting.remove(job)
            waiting = list(self._waiting)
        for job in gone:
            self._end_session_turn(job, completed=False)
            deadline = not job.cancelled.is_set()
            why = "deadline exceeded" if deadline else "cancelled"
            job.emit(
                Finished(
                    FinishReason.CANCELLED,
                    error=f"{why} while queued",
                    problem=_cancelled(deadline, f"{why} while queued"),
                )
            )
            job.release()
        for job in waiting:
            slot = self._choose_slot(job)
            if slot is None or not self._ready_to_start(job):
                continue
            with self._wake:
                self._waiting.remove(job)
            try:
                self._start(slot, job)
            except ProblemError as e:
                slot.job = None
                self._reject(job, e.problem)
            except Exception as e:  # a bug: the request fails, the engine goes on
                log.exception("starting a request failed")
                slot.job = None
                self._reject(job, Problem(ErrorKind.INTERNAL, f"internal error: {e}"))

    def _ready_to_start(self, job: Job) -> bool:
        """A session that is not in a slot has its saved state read off the engine thread
        first; until then its turn waits (and the engine wakes when the read is done)."""
        if not self._needs_read(job):
            return True
        session = self.sessions[job.session_id]  # type: ignore[index]
        prefetch = self._prefetch.get(session.session_id)
        if prefetch is None:
            if self._reads_in_flight() >= self._num_free_slots():
                return False  # a state read per free slot at most: each holds a KV state
            prefetch = self._io.submit(self._read_for_swap_in, session.session_id,
                                       ledger_digest(session.ledger.to_json()),
                                       dict(session.pixels), dict(session.rgb))  # fmt: skip
            self._prefetch[session.session_id] = prefetch
            prefetch.add_done_callback(lambda _: self._notify())
        return prefetch.done()

    def _choose_slot(self, job: Job) -> _Slot | None:
        free = [s for s in self.slots if s.job is None]
        if not free:
            return None
        if job.session_id is not None:
            session = self.sessions.get(job.session_id)
            if session is not None and session.slot is not None:
                return self.slots[session.slot]  # its own slot, never used by others while owned
        unowned = [s for s in free if s.owner is None]
        if unowned and job.session_id is None:  # (_start matches the chosen one again)
            job.resume = None
            reuse = {s.seq: _reused_cells(s.ledger, job.items) for s in unowned}
            # the most reuse; on a tie, the slot whose content is worth least
            best = max(unowned, key=lambda s: (reuse[s.seq], -_cells(s)))
            cached = self.states.best(job.items)
            if cached is not None and cached[1].num_cells > reuse[best.seq]:
                job.resume = cached[0]  # a conversation that lost its slot: put it back
                return min(unowned, key=lambda s: (reuse[s.seq], _cells(s)))
            return best
        if unowned:
            return min(unowned, key=_cells)
        idle = [s for s in free if s.owner is not None]
        return min(idle, key=lambda s: self.sessions[s.owner].last_used) if idle else None  # type: ignore[index]

    def _start(self, slot: _Slot, job: Job) -> None:
        if slot.owner is not None and slot.owner != job.session_id:
            self._swap_out(slot)
        reprefill = False  # the session's KV state did not load: decode its ledger again
        if job.session_id is not None:
            session = self._session(job.session_id)
            # what an unfinished turn rolls back to: its last completed turn
            session.snapshot = (session.ledger.to_json(), session.num_shifts)
            if session.slot is None:
                reprefill = not self._swap_in(session, slot)
            session.media.update(job.media)
            session.pixels.update(job.pixels)
            session.rgb.update(job.rgb)
            job.media, job.rgb = {}, {}  # the session owns the native chunks and pixels now
            ledger = session.ledger
            start = ledger.generated_tail()
        else:
            if job.resume is not None:
                self._resume(slot, job.resume)
            if slot.ledger is None:
                slot.ledger = self.new_ledger(job.context)
            ledger = slot.ledger
            start = 0
        ctx = job.context
        ledger.reconfigure(
            policy=ctx.policy, keep=ctx.keep, discard_fraction=ctx.discard_fraction, unit=ctx.unit
        )
        num_before = sum(seg.num_cells for seg in ledger.segments[:start])
        continued = False
        if job.session_id is not None:  # a session continues what it holds
            si, so, rest = ledger.common_prefix(job.items, start)
        else:
            # a resent conversation continues its sequence (shifted); any other request reuses
            # only what equals a fresh prefill of its prefix: same tokens in, same tokens out
            reuse = reuse_of(ledger, job.items)
            assert reuse is not None
            si, so, rest, continued = (
                reuse.num_segments,
                reuse.num_tokens,
                reuse.rest,
                reuse.continued,
            )
            if ledger.num_cells - reuse.num_cells >= _WORTH_KEEPING and job.resume is None:
                self._displace(slot)  # what the cut drops may be resumed later
        cut = ledger.truncate(si, so)
        num_reused = ledger.num_cells - num_before
        # a reused M-RoPE image holds more cells than positions: count its positions
        num_reused_positions = sum(seg.num_positions for seg in ledger.segments[start:])
        admission = ledger.admit(rest, truncate=ctx.truncate_prompt)
        error: ProblemError | None = None
        if isinstance(admission, CannotFit):
            error = ProblemError(too_long(admission))
        elif admission.kept and admission.kept[-1].media_id:
            error = SessionError(
                ErrorKind.INVALID_ARGUMENT,
                "the prompt ends with media: add text after it",
                Reason.BAD_REQUEST,
            )
        restore: list[Item] = []
        if reprefill and error is not None:
            # its sequence is empty (the state did not load): nothing of it may be written
            self._swap_out(slot, save=False)  # its ledger stays: the next turn re-prefills it
        elif reprefill:
            # what the session keeps (the reused reply included) is decoded again from 0
            restore = [seg.item for seg in ledger.segments]
            ledger.clear()
            self.stats.num_session_reprefills += 1
        else:
            self.rt.seq_rm(slot.seq, cut, -1)
        if error is not None:
            raise error
        assert not isinstance(admission, CannotFit)
        kept = admission.kept
        if (
            job.session_id is None
            and admission.dropped
            and not continued
            and len(ledger.segments) == ledger.num_pinned_segments
        ):
            ledger.begin_history(admission.dropped)  # truncated now: continued next turn
        slot.job = job
        slot.ledger = ledger
        slot.pending = deque([*restore, *kept])
        slot.sampler = self.rt.sampler(job.sampling)
        slot.text = TextStream(job.stop)
        slot.num_prefill_total = sum(i.num_cells for i in slot.pending)
        slot.num_prefill_done = 0
        slot.prefilling = True
        slot.reply_index = max((i.message_index for i in kept), default=0)
        slot.usage = Usage(
            num_prompt_cells=num_reused + sum(i.num_cells for i in kept),
            num_prompt_positions=num_reused_positions + sum(i.num_positions for i in kept),
            num_reused_cells=num_reused,
        )
        slot.t_start = time.perf_counter()
        dropped = admission.dropped
        job.emit(
            Started(
                slot=slot.seq,
                num_prompt_cells=slot.usage.num_prompt_cells,
                num_prompt_positions=slot.usage.num_prompt_positions,
                num_capacity_cells=self.rt.num_cells_per_slot,
                num_truncated_cells=sum(i.num_cells for i in dropped),
                num_truncated_chunks=len(dropped),
                truncated_media_ids=tuple(i.media_id for i in dropped if i.media_id),
                num_reused_cells=num_reused,
            )
        )

    def _reject(self, job: Job, why: Problem) -> None:
        self._end_session_turn(job, completed=False)
        job.emit(Rejected(why))
        job.release()

    def _media(self, slot: _Slot, key: str) -> MediaHandle:
        assert slot.job is not None
        if slot.owner is None:
            return slot.job.media[key]
        session = self.sessions[slot.owner]
        handle = session.media.get(key)
        if handle is None:  # swapped in from its KV state: handles are made when needed
            px = session.pixels[key]
            rgb = session.rgb.get(px.media_id)
            if rgb is None:
                assert self.store is not None
                rgb = self.store.load_media(px.media_id, px.width, px.height)
            handle = session.media[key] = self._media_handle(key, px, rgb)
        return handle

    # -- sessions (engine thread only) ------------------------------------------------------

    def create_session(
        self, session_id: str, context: ContextConfig, sampling: SamplingConfig
    ) -> tuple[Session, Future[None] | None]:
        """The new session, and its first write (await it off the engine thread)."""
        if session_id in self._deleting:  # its deletion must land before a new file does
            raise _session_error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.SESSION_BUSY,
                f"session {session_id!r} is being deleted; retry",
            )
        if (
            session_id in self.sessions
            or session_id in self.broken_sessions
            or (session_id in self._restoring)
        ):
            raise _session_error(
                ErrorKind.ALREADY_EXISTS,
                Reason.SESSION_EXISTS,
                f"session {session_id!r} already exists",
            )
        session = Session(session_id, context, sampling, self.new_ledger(context))
        self.sessions[session_id] = session
        return session, self._save(session, b"")

    def delete_session(self, session_id: str) -> Future[bool] | None:
        """Forget the session; returns the disk deletion (ordered after its pending writes),
        whose result says whether a file was there."""
        was_broken = self.broken_sessions.pop(session_id, None) is not None
        session = self.sessions.get(session_id)
        if session is None and self.store is None:
            raise self._not_found(session_id)
        if session_id in self._restoring:
            raise _session_error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.SESSION_BUSY,
                f"session {session_id!r} is being restored",
            )
        if session is not None:
            self._idle_session(session_id)
            if session.slot is not None:
                self._swap_out(self.slots[session.slot], save=False)
            del self.sessions[session_id]
            session.release()
        if self.store is None:
            return None
        store = self.store
        queued = self._writes.take(session_id)  # a write not started yet: it must not land
        for f in queued.futures if queued else ():
            _resolve(f, error=ProblemError(problem(
                ErrorKind.NOT_FOUND, Reason.SESSION_NOT_FOUND,
                f"session {session_id!r} was deleted before this was saved",
            )))  # fmt: skip
        if session is not None:
            self._orphans |= session.media_ids()
        collect = self._pixel_collector()

        def delete() -> bool:
            found = store.delete(session_id)
            self._io_orphans |= self._disk_media.pop(session_id, set())
            collect()
            if not (found or was_broken or session is not None):
                raise self._not_found(session_id)
            return found

        self._deleting.add(session_id)
        deleted = self._io.submit(delete)

        def done(_: Future[bool]) -> None:  # a new session of this id may be created now
            with contextlib.suppress(EngineStoppedError):
                self.call(lambda: self._deleting.discard(session_id))

        deleted.add_done_callback(done)
        return deleted

    def save_session(self, session_id: str) -> tuple[Session, Future[None] | None]:
        session = self._idle_session(session_id)
        state = self.rt.state_get(session.slot) if session.slot is not None else None
        return session, self._save(session, state)

    def restore_session(self, session_id: str) -> Future[Session]:
        """Forget the in-memory state and read the session back from disk. The read runs on
        the io thread (after pending writes) and the restore completes even if its caller has
        gone; the future gives the restored session."""
        session = self._idle_session(session_id)
        if self.store is None:
            raise _session_error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.NOT_PERSISTED,
                "sessions are not persisted (no --sessions-dir)",
            )
        if session.slot is not None:
            self._swap_out(self.slots[session.slot], save=False)
        session.release()
        del self.sessions[session_id]
        self._restoring.add(session_id)
        done: Future[Session] = Future()

        def register(header: dict[str, Any] | BaseException) -> None:  # engine thread
            self._restoring.discard(session_id)
            try:
                self._register(session_id, header)
                _resolve(done, self._session(session_id))
            except Exception as e:  # the restore's caller hears it, whatever it is
                _resolve(done, error=e)

        def read() -> None:  # io thread
            header = self._read_header(session_id)
            try:
                self.call(lambda: register(header))
            except EngineStoppedError as e:
                _resolve(done, error=e)

        self._io.submit(read)
        return done

    def _not_found(self, session_id: str) -> SessionError:
        return _session_error(
            ErrorKind.NOT_FOUND, Reason.SESSION_NOT_FOUND, f"no session {session_id!r}"
        )

    def _session(self, session_id: str) -> Session:
        if session_id in self.broken_sessions:
            raise self.broken_sessions[session_id]
        session = self.sessions.get(session_id)
        if session is None:
            raise self._not_found(session_id)
        return session

    def _idle_session(self, session_id: str) -> Session:
        session = self._session(session_id)
        if session.busy:
            raise _session_error(
                ErrorKind.FAILED_PRECONDITION,
                Reason.SESSION_BUSY,
                f"session {session_id!r} has a turn running",
            )
        return session

    def get_session(self, session_id: str) -> Session:
        return self._session(session_id)

    def abort_turn(self, session_id: str) -> None:
        """A turn refused before it reached the queue: nothing changed."""
        if session_id in self.sessions:
            self.sessions[session_id].busy = False

    def begin_turn(self, session_id: str) -> Session:
        session = self._idle_session(session_id)
        session.busy = True
        return session

    def _end_session_turn(self, job: Job, *, completed: bool) -> Future[None] | None:
        """Completed: save the session (returns the write). Not: back to the last completed
        turn (the ledger from the snapshot; the KV state from disk, or re-prefilled)."""
        self._prefetch.pop(job.session_id or "", None)
        if job.session_id is None or job.session_id not in self.sessions:
            return None
        session = self.sessions[job.session_id]
        session.busy = False
        session.last_used = time.monotonic()
        snapshot, session.snapshot = session.snapshot, None
        if completed:
            session.num_turns += 1
            self._orphans |= session.prune()
            assert session.slot is not None
            return self._save(session, self.rt.state_get(session.slot))
        if snapshot is not None:
            if session.slot is not None:
                self._swap_out(self.slots[session.slot], save=False)
            session.ledger.load_json(snapshot[0])
            session.num_shifts = snapshot[1]
        self._orphans |= session.prune()
        return None

    def _save(
        self, session: Session, kv_state: bytes | bytearray | memoryview | None
    ) -> Future[None] | None:
        """Write the session's whole current state (KV state None: keep the KV bytes on disk).

        The write runs on the io thread and depends on no earlier write: after a failure the
        next save writes everything again. A save queued behind a running one is replaced by a
        newer one of the same session (pending saves stay bounded).
        """
        if self.store is None:
            return None
        header = session.header(self.rt.fingerprint, self.rt.layout, "")
        kv_digest = ledger_digest(header["ledger"]) if kv_state is not None else ""
        media = {px.media_id for px in session.pixels.values() if px.media_id in session.rgb}
        future: Future[None] = Future()
        sid = session.session_id
        session.dirty = True
        session.num_saves += 1
        number = session.num_saves
        write = _Write(header, kv_state, kv_digest, [(m, session.rgb[m]) for m in media], [future])
        if self._writes.queue(sid, write):
            self._io.submit(self._write, sid)

        def saved(done: Future[None]) -> None:  # back on the engine thread: drop what is on disk
            if not done.cancelled() and done.exception() is None:
                with contextlib.suppress(EngineStoppedError):
                    self.call(lambda: self._saved(sid, number, media))

        future.add_done_callback(saved)
        return future

    def _write(self, session_id: str) -> None:
        """On the io thread: the newest queued state of one session, pixels first."""
        assert self.store is not None
        write = self._writes.take(session_id)
        if write is None:
            return
        try:
            for media_id, rgb in write.pixels:
                self.store.save_media(media_id, rgb)
            header = write.header
            state, header["kv_digest"] = write.kv_state, write.kv_digest
            if state is None:  # the KV bytes on disk stay, with their ledger's digest and layout
                try:
                    saved = self.store.load(session_id)
                    state = saved.kv_state
                    header["kv_digest"] = saved.header.get("kv_digest", "")
                    header["layout"] = saved.header.get("layout")
                except (KeyError, CorruptSessionError):
                    state, header["kv_digest"] = b"", ""
            self.store.save(session_id, header, state)
        except Exception as e:  # every waiter hears it: a full disk, or anything else
            log.warning("session %r not saved: %s", session_id, e)
            failure = ProblemError(
                storage_problem(e, "the turn was not saved")
                if isinstance(e, OSError)
                else Problem(ErrorKind.INTERNAL, f"the turn was not saved: {e!r}", Reason.INTERNAL)
            )
            for f in write.futures:
                _resolve(f, error=failure)
        else:
            self._disk_media[session_id] = {px["media_id"] for px in header["pixels"].values()}
            for f in write.futures:
                _resolve(f, None)

    def _saved(self, session_id: str, number: int, media_ids: set[str]) -> None:
        session = self.sessions.get(session_id)
        if session is None:
            return
        if number == session.num_saves:  # the newest save asked for is on disk
            session.dirty = False
        for media_id in media_ids:
            session.rgb.pop(media_id, None)
        if self._orphans:
            self._io.submit(self._pixel_collector())

    def _pixel_collector(self) -> Callable[[], None]:
        """(Engine thread) what the io thread runs to delete the saved pixels no session needs
        any more: none in memory (snapshot now) and none in a file on disk (as of the last
        write that landed, known on the io thread when it runs). The disk stays bounded by
        what sessions hold. With a broken session file around, whose needs are unknown,
        nothing is deleted."""
        store = self.store
        assert store is not None
        candidates, self._orphans = self._orphans, set()
        in_memory = {m for s in self.sessions.values() for m in (*s.media_ids(), *s.rgb)}
        broken = bool(self.broken_sessions)

        def collect() -> None:
            self._io_orphans |= candidates
            if broken:
                return
            on_disk = set().union(*self._disk_media.values())
            gone = self._io_orphans - in_memory - on_disk
            self._io_orphans -= gone
            for media_id in gone:
                store.delete_media(media_id)

        return collect

    def _load_session(self, session_id: str) -> None:
        """Register a saved session from its header; its KV state is read on its next turn."""
        self._register(session_id, self._read_header(session_id))

    def _read_header(self, session_id: str) -> dict[str, Any] | BaseException:
        """A session file's header (or why it is unusable), off the engine thread: the pixels
        of every image its ledger holds must be there too (they are hashed when read)."""
        assert self.store is not None
        try:
            header = self.store.load_header(session_id)
            held = {seg.get("media") for seg in header.get("ledger", ())} - {None}
            for key, px in dict(header.get("pixels", {})).items():
                if key in held and not self.store.has_media(px["media_id"]):
                    raise CorruptSessionError(f"pixels of media {px['media_id'][:12]} are missing")
            self._disk_media[session_id] = {px["media_id"] for px in header["pixels"].values()}
        except Exception as e:  # whatever is wrong with the file, the session is reported
            return e
        return header

    def _register(self, session_id: str, header: dict[str, Any] | BaseException) -> None:
        try:
            if isinstance(header, BaseException):
                raise header
            fp = header.get("fingerprint", {})
            if Fingerprint(**fp) != self.rt.fingerprint:
                raise _session_error(
                    ErrorKind.FAILED_PRECONDITION,
                    Reason.SESSION_FOREIGN,
                    f"session {session_id!r} was saved with another model ({str(fp)[:80]})",
                )
            session = Session.from_header(session_id, header, self.new_ledger)
            self._orphans |= session.prune()
        except SessionError as e:
            log.warning("%s", e)
            self.broken_sessions[session_id] = e
            return
        except KeyError as e:
            if e.args == (session_id,):  # no file (deleted meanwhile)
                return
            self._unreadable(session_id, e)
            return
        except Exception as e:  # CorruptSessionError, OSError, a header of the wrong shape, ...
            self._unreadable(session_id, e)
            return
        self.sessions[session_id] = session

    def _unreadable(self, session_id: str, e: BaseException) -> None:
        log.warning("session %r is unreadable: %s", session_id, e)
        self.broken_sessions[session_id] = _session_error(
            ErrorKind.DATA_LOSS,
            Reason.SESSION_UNREADABLE,
            f"session {session_id!r} is unreadable: {e}",
        )

    def _media_handle(self, key: str, px: Pixels, rgb: bytes) -> MediaHandle:
        """A native chunk to encode, from the pixels."""
        assert self.rt.mtmd is not None
        return media_handle(self.rt.mtmd, key, Bitmap(px.width, px.height, rgb, px.media_id))

    def _swap_out(self, slot: _Slot, *, save: bool = True) -> None:
        """The slot's session leaves it, and its media handles are freed. It was saved when its
        last turn completed; if that save failed, this is the chance to write it again."""
        assert slot.owner is not None
        session = self.sessions[slot.owner]
        if save and session.dirty and self.store is not None:
            self._save(session, self.rt.state_get(slot.seq))
        session.slot = None
        session.release()
        self.rt.seq_clear(slot.seq)
        slot.owner, slot.ledger = None, None

    def _read_for_swap_in(
        self, session_id: str, digest: str, pixels: dict[str, Pixels], rgb: dict[str, bytes]
    ) -> _Prefetched:
        """On the io thread: the KV state if it belongs to the session's ledger (digest) and
        this context's layout; otherwise the pixels its re-prefill needs."""
        assert self.store is not None
        try:
            saved = self.store.load(session_id)
        except (KeyError, CorruptSessionError, OSError) as e:
            log.warning("session %r: saved state unusable (%s); re-prefilling", session_id, e)
        else:
            header = saved.header
            if header.get("layout") == self.rt.layout and header.get("kv_digest") == digest:
                return _Prefetched(saved.kv_state, {})
            if saved.kv_state:
                log.info(
                    "session %r: KV state on disk is not its ledger's: re-prefilling", session_id
                )
        loaded: dict[str, bytes] = {}
        for px in pixels.values():
            if px.media_id not in rgb and px.media_id not in loaded:
                with contextlib.suppress(CorruptSessionError, OSError):  # the turn says so later
                    loaded[px.media_id] = self.store.load_media(px.media_id, px.width, px.height)
        return _Prefetched(b"", loaded)

    def _swap_in(self, session: Session, slot: _Slot) -> bool:
        """Put a session's KV state into slot; False when it must be re-prefilled from its
        ledger instead (no saved state, another context layout or ledger, or a state that does
        not load)."""
        if slot.ledger is not None and slot.owner is None:
            self._displace(slot)
            slot.ledger = None
        self.rt.seq_clear(slot.seq)
        session.slot, slot.owner = slot.seq, session.session_id
        self.stats.num_session_restores += 1
        if not session.ledger.segments:
            return True
        prefetch = self._prefetch.pop(session.session_id, None)
        if prefetch is None or prefetch.exception() is not None:
            return False
        got = prefetch.result()
        if got.kv_state and self.rt.state_set(slot.seq, got.kv_state):
            return True
        for key, px in session.pixels.items():  # a re-prefill encodes them: handles now
            rgb = got.rgb.get(px.media_id) or session.rgb.get(px.media_id)
            if rgb is not None and key not in session.media:
                session.media[key] = self._media_handle(key, px, rgb)
        return False

    # -- stateless conversations that lose their slot -----------------------------------------

    def _displace(self, slot: _Slot) -> None:
        """Keep a stateless sequence that is about to be overwritten in the host cache."""
        ledger = slot.ledger
        if ledger is None or ledger.num_cells < _WORTH_KEEPING or not self.states.max_bytes:
            return
        self.states.put(ledger.clone(), self.rt.state_get(slot.seq))

    def _resume(self, slot: _Slot, key: int) -> None:
        """Put a cached sequence into slot (what the slot held goes to the cache: after the
        take, so that its put cannot evict the entry being taken)."""
        ledger, state = self.states.take(key)
        self._displace(slot)
        self.rt.seq_clear(slot.seq)
        slot.ledger = ledger if self.rt.state_set(slot.seq, bytes(state)) else None

    def _step(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            job = slot.job
            if job and job.cancelled.is_set():
                why = "cancelled by the client"
                self._finish(
                    slot, FinishReason.CANCELLED, error=why, problem=_cancelled(False, why)
                )
            elif job and job.deadline is not None and now > job.deadline:
                why = "deadline exceeded"
                self._finish(slot, FinishReason.CANCELLED, error=why, problem=_cancelled(True, why))
        broken = self._collect_encodes()
        for slot in self.slots:
            if slot.job and slot.pending and slot.pending[0].media_id:
                try:
                    if slot.pending[0].media_id in broken:
                        raise broken[slot.pending[0].media_id]
                    self._decode_media(slot)
                except Exception as e:  # this request's image: it ends alone (its sequence
                    # is cleared, or rolled back to its last completed turn)
                    log.warning("slot %d: media failed: %s", slot.seq, e)
                    lost = isinstance(e, CorruptSessionError)
                    failed = Problem(
                        ErrorKind.DATA_LOSS if lost else ErrorKind.INTERNAL,
                        f"the image could not be decoded: {e}",
                        Reason.MEDIA_FAILED,
                    )
                    self._finish(slot, FinishReason.ERROR, error=failed.message, problem=failed)
        self._decode_text()
        if self._encoding or self._encoded:  # (nothing to look at on a plain text step)
            self._forget_unwanted_media()

    def _forget_unwanted_media(self) -> None:
        """An encode no active request waits for any more (cancelled, deadline) and that has
        not started is dropped: stale work must not hold up the live requests behind it.
        Finished embeddings no slot is about to decode leave `_encoded` (they stay cached)."""
        wanted = {i.media_id for s in self.slots if s.job for i in s.pending if i.media_id}
        for key in [k for k in self._encoding if k not in wanted]:
            if self._encoding[key].cancel():
                del self._encoding[key]
        fronts = {s.pending[0].media_id for s in self.slots if s.job and s.pending}
        for key in [k for k in self._encoded if k not in fronts]:
            del self._encoded[key]

    # -- media ------------------------------------------------------------------------------

    def _collect_encodes(self) -> dict[str, BaseException]:
        """Take the finished encodes: embeddings to decode, or the errors of those that
        failed (their requests end alone)."""
        failed: dict[str, BaseException] = {}
        for key, future in [(k, f) for k, f in self._encoding.items() if f.done()]:
            del self._encoding[key]
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                failed[key] = error
            else:
                self._encoded[key] = embd = future.result()
                self.cache.put(key, embd)
        return failed

    def _embeddings(self, slot: _Slot, key: str) -> np.ndarray | None:
        """The projector's output for key, or None while it is being encoded (started here
        on the encode worker, with its own copy of the chunk: the request may end first)."""
        embd = self._encoded.get(key)
        if embd is not None or key in self._encoding:
            return embd
        embd = self.cache.get(key)
        if embd is not None:
            return embd
        copy = MediaHandle(mtmd_cpp.mtmd_input_chunk_copy(self._media(slot, key).chunk), key)

        def encode() -> np.ndarray:
            try:
                return self.rt.encode_media(copy.chunk)
            finally:
                copy.close()

        self._encoding[key] = future = self._encoder.submit(encode)
        future.add_done_callback(lambda _: copy.close())  # also when cancelled before it ran
        future.add_done_callback(lambda _: self._notify())
        return None

    def _decode_media(self, slot: _Slot) -> None:
        """One piece (at most a batch) of the slot's media chunk per step, so the other slots'
        steps go on between the pieces. Room for the whole chunk is made, and the chunk
        entered in the ledger, before its first piece; a non-causal chunk goes whole."""
        if slot.piece is None and not self._begin_media(slot):
            return
        piece = slot.piece
        assert piece is not None
        item, offset = piece.item, piece.offset
        n = item.num_cells - offset
        if not (self.rt.mtmd and self.rt.mtmd.non_causal):
            n = min(n, self.rt.batch_size)
        rc = self.rt.decode_embeddings(piece.embd, piece.positions, offset, n, slot.seq)
        if rc != 0:
            raise native.NativeError(f"llama_decode of media failed (rc={rc})")
        piece.offset += n
        self._progress(slot, n)
        if piece.offset == item.num_cells:
            slot.piece = None
            slot.pending.popleft()
            self.stats.num_media_decodes += 1

    def _begin_media(self, slot: _Slot) -> bool:
        item = slot.pending[0]
        assert item.media_id
        embd = self._embeddings(slot, item.media_id)
        if embd is None:
            return False  # encoding: this slot waits, the others go on
        if not self._make_room(slot, item.num_cells, item.num_positions, item.group):
            return False
        if not slot.pending or slot.pending[0] is not item:
            return False  # a reprefill put other items first
        assert slot.job and slot.ledger
        handle = self._media(slot, item.media_id)
        if embd.size != item.num_cells * self.rt.n_embd:  # never read past the embeddings
            raise native.NativeError(
                f"media {item.media_id[:12]}: {embd.size // self.rt.n_embd} embeddings for "
                f"{item.num_cells} cells"
            )
        positions = self.rt.media_positions(handle.chunk, slot.ledger.next_pos)
        slot.ledger.append(item)  # the whole chunk: a failure or cancel before the last piece
        slot.piece = _MediaPiece(item, embd, positions)  # removes it again (_drop_piece)
        return True

    def _drop_piece(self, slot: _Slot) -> None:
        """A media chunk decoded in part leaves the ledger and the cache (its cells are not a
        prefix anyone may reuse)."""
        piece, slot.piece = slot.piece, None
        if piece is None or slot.ledger is None:
            return
        segments = slot.ledger.segments
        if segments and segments[-1].item is piece.item:  # (nothing follows it mid-chunk)
            cut = slot.ledger.truncate(len(segments) - 1)
            self.rt.seq_rm(slot.seq, cut, -1)

    # -- text -------------------------------------------------------------------------------

    def _decode_text(self) -> None:
        batch = self.rt.batch
        batch.clear()
        budget = self.rt.batch_size
        taken: list[tuple[_Slot, Item, int | None]] = []
        # short work first: a generating slot's one token always gets in, prefill fills the rest
        ready = sorted(
            (s for s in self.slots if s.job and s.pending and not s.pending[0].media_id),
            key=lambda s: s.pending[0].num_cells,
        )
        for slot in ready:
            if budget == 0:
                break
            n = _text_take_size(slot.pending, budget, self.rt.batch_size)
            if n == 0:
                continue
            head = slot.pending[0]
            if not self._make_room(slot, n, n, head.group):
                continue  # finished, or a reprefill put other items first
            item = _take_text(slot.pending, n)
            assert slot.ledger is not None
            last = not slot.pending
            end = batch.add(item.token_ids, slot.ledger.next_pos, slot.seq, logits_last=last)
            taken.append((slot, item, end if last else None))
            budget -= n
        if not taken:
            return
        t0 = time.perf_counter()
        rc = self.rt.decode()
        self.stats.num_decodes += 1
        if len({slot.seq for slot, _, _ in taken}) > 1:
            self.stats.num_multi_seq_decodes += 1
        if rc != 0:
            log.error("llama_decode returned %d for a batch the ledgers admitted", rc)
            self._decode_alone(taken)  # a failed decode changes nothing: find the culprit
            return
        elapsed = time.perf_counter() - t0
        for slot, item, logits_at in taken:
            assert slot.ledger is not None
            slot.ledger.append(item)
            if slot.prefilling:
                self._progress(slot, item.num_cells)
            else:
                slot.usage.decode_seconds += elapsed
            if logits_at is not None:
                self._sample(slot, logits_at)

    def _decode_alone(self, taken: list[tuple[_Slot, Item, int | None]]) -> None:
        """Decode each sequence of a failed batch on its own: only those that fail again end."""
        batch = self.rt.batch
        for slot, item, logits_at in taken:
            assert slot.ledger is not None
            batch.clear()
            end = batch.add(item.token_ids, slot.ledger.next_pos, slot.seq, logits_last=True)
            rc = self.rt.decode()
            self.stats.num_decodes += 1
            if rc != 0:
                why = Problem(
                    ErrorKind.INTERNAL, f"llama_decode failed (rc={rc})", Reason.DECODE_FAILED
                )
                self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)
                continue
            slot.ledger.append(item)
            self._progress(slot, item.num_cells)
            if logits_at is not None:
                self._sample(slot, end)  # before the next decode wipes these logits

    def _sample(self, slot: _Slot, index: int) -> None:
        job = slot.job
        assert job is not None
        if slot.prefilling:
            slot.prefilling = False
            slot.usage.prefill_seconds = time.perf_counter() - slot.t_start
            self.on_first_token(slot.usage.prefill_seconds)
        token = self.rt.sample(slot.sampler, index)
        if self.rt.is_eog(token):
            self._finish(slot, FinishReason.STOP)
            return
        slot.usage.num_generated_tokens += 1
        self.stats.num_generated_tokens += 1
        delta = TokenDelta((token,), slot.text.push(self.rt.piece(token)))
        slot.unsent = slot.unsent.merged(delta) if slot.unsent else delta
        if slot.text.stopped_by is not None:
            self._finish(slot, FinishReason.STOP, stop_string=slot.text.stopped_by)
            return
        if slot.usage.num_generated_tokens >= job.max_tokens:
            self._finish(slot, FinishReason.LENGTH)
            return
        n = len(slot.unsent.token_ids)
        if n >= job.stream_tokens or slot.usage.num_generated_tokens == 1:
            self._send_delta(slot)
        slot.pending.append(Item(1, 1, slot.reply_index, token_ids=(token,), generated=True))

    def _send_delta(self, slot: _Slot, tail: str = "") -> None:
        delta, slot.unsent = slot.unsent, None
        if tail:
            delta = delta.merged(TokenDelta((), tail)) if delta else TokenDelta((), tail)
        if delta is not None and slot.job is not None:
            slot.job.emit(delta)

    # -- the ledger's plans -----------------------------------------------------------------

    def _make_room(
        self, slot: _Slot, num_cells: int, num_positions: int, group: int | None
    ) -> bool:
        """Carry out the ledger's plan for the next decode; False when the slot cannot go on."""
        ledger = slot.ledger
        assert ledger is not None and slot.job is not None
        plan: Plan = ledger.ensure(num_cells, num_positions, group=group)
        if isinstance(plan, Fits):
            return True
        if isinstance(plan, CannotFit):
            if slot.prefilling:
                why = too_long(plan)
                self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)
            else:
                self._finish(slot, FinishReason.LENGTH)
            return False
        if isinstance(plan, Shift):
            self.rt.seq_rm(slot.seq, plan.p0, plan.p1)
            self.rt.seq_add(slot.seq, plan.p1, -plan.delta)
        elif isinstance(plan, Gap):
            self.rt.seq_rm(slot.seq, plan.p0, plan.p1)
        elif isinstance(plan, Reprefill):
            self.rt.seq_clear(slot.seq)
        ledger.apply(plan)
        if isinstance(plan, Reprefill):
            slot.pending.extendleft(reversed(plan.kept))
        slot.usage.num_shifts += 1
        slot.usage.num_evicted_cells += plan.num_cells_evicted
        if slot.owner is not None:
            self.sessions[slot.owner].num_shifts += 1
        self.stats.num_shifts += 1
        self._send_delta(slot)  # the tokens before the shift go before it
        self.stats.num_evicted_cells += plan.num_cells_evicted
        used = _policy_of(plan).value
        self.stats.shifts_by_policy[used] = self.stats.shifts_by_policy.get(used, 0) + 1
        if isinstance(plan, Reprefill):  # the ledger is empty until the kept items are decoded
            used_after = sum(i.num_cells for i in plan.kept)
            next_pos_after = sum(i.num_positions for i in plan.kept)
        else:
            used_after, next_pos_after = ledger.num_cells, ledger.next_pos
        slot.job.emit(
            ContextShift(
                policy=_policy_of(plan),
                num_cells_evicted=plan.num_cells_evicted,
                num_positions_evicted=plan.num_positions_evicted,
                media_ids_evicted=tuple(plan.media_ids_evicted),
                num_cells_used_after=used_after,
                next_position_after=next_pos_after,
            )
        )
        return not isinstance(plan, Reprefill)

    def _progress(self, slot: _Slot, num_cells: int) -> None:
        if not slot.prefilling or slot.job is None:
            return
        slot.num_prefill_done += num_cells
        slot.job.emit(PrefillProgress(slot.num_prefill_done, slot.num_prefill_total))

    def _finish(
        self,
        slot: _Slot,
        reason: FinishReason,
        *,
        error: str = "",
        stop_string: str = "",
        problem: Problem | None = None,
    ) -> None:
        job = slot.job
        assert job is not None
        self._drop_piece(slot)
        if reason is FinishReason.ERROR and problem is None:
            problem = Problem(ErrorKind.INTERNAL, error or "internal error")
        if slot.prefilling:
            slot.usage.prefill_seconds = time.perf_counter() - slot.t_start
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)
        self._send_delta(slot, slot.text.flush() if completed else "")
        self.rt.free_sampler(slot.sampler)
        slot.sampler = 0
        slot.job = None
        slot.pending.clear()
        if reason is FinishReason.ERROR and job.session_id is None:
            self.rt.seq_clear(slot.seq)
            slot.ledger = None
        # otherwise the sequence stays: the next request with the same prefix reuses it
        job.release()
        saved = self._end_session_turn(job, completed=completed)
        # the slot is free before the client hears about it: its next request finds it so
        finished = Finished(
            reason, slot.usage, stop_string=stop_string, error=error, problem=problem
        )
        if saved is None:
            if completed and job.session_id is not None:
                finished = replace(finished, persistence=Persistence.MEMORY)
            job.emit(finished)
            return

        def report(write: Future[None]) -> None:  # a finished turn is on disk when it says so
            e = CancelledError() if write.cancelled() else write.exception()
            if e is None:
                job.emit(replace(finished, persistence=Persistence.SAVED))
                return
            why = (
                e.problem
                if isinstance(e, ProblemError)
                else storage_problem(
                    e if isinstance(e, OSError) else OSError(str(e)), "the turn was not saved"
                )
            )
            why = replace(why, reason=Reason.SESSION_NOT_SAVED, metadata=(
                *why.metadata, ("session_id", job.session_id or ""),
                ("storage", why.reason.value),
            ))  # fmt: skip
            job.emit(
                replace(
                    finished,
                    persistence=Persistence.NOT_SAVED,
                    error=f"{why.message} (the session goes on in memory)",
                    problem=why,
                )
            )

        saved.add_done_callback(report)


_WORTH_KEEPING = 32  # cells: a displaced sequence smaller than this is not worth a cache entry


def _reused_cells(ledger: Ledger | None, items: Sequence[Item]) -> int:
    reuse = reuse_of(ledger, items)
    return reuse.num_cells if reuse is not None else 0


def _cells(slot: _Slot) -> int:
    return slot.ledger.num_cells if slot.ledger else 0


def _text_take_size(pending: deque[Item], budget: int, batch_size: int) -> int:
    """How many tokens of the front text items go into this batch.

    Grouped (wrapper) text goes whole unless it is larger than a whole batch; ungrouped text of
    one message joins the next items of the same message and origin (a re-prefill after a long
    reply would otherwise cost a llama_decode per generated token).
    """
    first = pending[0]
    if first.num_cells > budget:
        return 0 if first.group is not None and first.num_cells <= batch_size else budget
    n = first.num_cells
    if first.group is not None:
        return n
    for item in itertools.islice(pending, 1, None):
        if not _joins(first, item) or n == budget:
            break
        n += min(item.num_cells, budget - n)
    return n


def _joins(first: Item, item: Item) -> bool:
    return (
        item.media_id is None
        and item.group is None
        and (item.message_index, item.generated) == (first.message_index, first.generated)
    )


def _take_text(pending: deque[Item], n: int) -> Item:
    """Pop n tokens from the front text items (as _text_take_size counted them) as one item."""
    first = pending[0]
    if n == first.num_cells:  # the common case: one generated token, or one whole chunk
        return pending.popleft()
    tokens: list[int] = []
    while len(tokens) < n:
        item = pending[0]
        k = min(item.num_cells, n - len(tokens))
        tokens.extend(item.token_ids[:k])
        if k == item.num_cells:
            pending.popleft()
        else:
            rest = item.token_ids[k:]
            pending[0] = replace(item, num_cells=len(rest), num_positions=len(rest), token_ids=rest)
    return replace(first, num_cells=n, num_positions=n, token_ids=tuple(tokens))


_ENCODE_POLL = 0.05  # seconds: how often a slot waiting for its image checks its deadline


def too_long(plan: CannotFit) -> Problem:
    """A prompt that can never fit: INVALID_ARGUMENT, not the transient RESOURCE_EXHAUSTED."""
    return problem(
        ErrorKind.INVALID_ARGUMENT,
        Reason.PROMPT_TOO_LONG,
        plan.message,
        cells_needed=plan.num_cells_needed,
        capacity=plan.num_capacity_cells,
        pinned_cells=plan.num_pinned_cells,
    )


def _cancelled(deadline: bool, why: str) -> Problem:
    if deadline:
        return Problem(ErrorKind.DEADLINE_EXCEEDED, why, Reason.DEADLINE_EXCEEDED)
    return Problem(ErrorKind.CANCELLED, why, Reason.CANCELLED)


def _resolve(
    future: Future[T], result: T | None = None, error: BaseException | None = None
) -> None:
    """Settle a future whose waiter may have given up on it (cancelled): that is no error."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _safely(emit: Callable[[Event], None], event: Event) -> None:
    """Tell a caller that may already be gone (its loop closed): that must not stop us."""
    try:
        emit(event)
    except Exception:
        log.debug("a caller could not be told %r", event, exc_info=True)


@dataclass
class _MediaPiece:
    item: Item
    embd: np.ndarray
    positions: np.ndarray
    offset: int = 0  # embeddings decoded so far


@dataclass
class _Prefetched:
    """What a swap-in needs, read on the io thread: a usable KV state, or pixels to
    re-prefill with."""

    kv_state: bytes
    rgb: dict[str, bytes]


@dataclass
class _Write:
    header: dict[str, Any]
    kv_state: bytes | bytearray | memoryview | None
    kv_digest: str
    pixels: list[tuple[str, bytes]]
    futures: list[Future[None]]


class _Writes:
    """Per session, the newest state waiting for the io thread: one queued write each, so a
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
            if write.kv_state is None:  # keeps the KV bytes: those of the queued write
                write.kv_state, write.kv_digest = old.kv_state, old.kv_digest
            write.pixels[:0] = old.pixels
            write.futures[:0] = old.futures
            self._queued[session_id] = write
            return False

    def take(self, session_id: str) -> _Write | None:
        with self._lock:
            return self._queued.pop(session_id, None)


def _policy_of(plan: Plan) -> Policy:
    if isinstance(plan, Shift):
        return Policy.SHIFT
    if isinstance(plan, Gap):
        return Policy.GAP
    return Policy.REPREFILL
