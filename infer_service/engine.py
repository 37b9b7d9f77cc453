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

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from infer_service.events import (
    ContextShift,
    ErrorKind,
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    Rejected,
    Started,
    TokenDelta,
    Usage,
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
from infer_service.session_store import CorruptSessionError, SessionStore
from infer_service.sessions import Pixels, Session
from infer_service.text_stream import TextStream
from prep_service.descriptors import Fingerprint, MediaChunk, PreparedPrompt
from prep_service.native import Bitmap

log = logging.getLogger("slotwise.engine")
T = TypeVar("T")


class QueueFullError(RuntimeError):
    pass


class SessionError(RuntimeError):
    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
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
    cancelled: threading.Event = field(default_factory=threading.Event)

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
    ):
        self.rt = runtime
        self.slots = [_Slot(seq) for seq in range(runtime.num_slots)]
        self.max_queue = max_queue
        self.cache = EmbeddingCache(cache_bytes)
        self.stats = EngineStats()
        self.store = store
        self.sessions: dict[str, Session] = {}
        self.broken_sessions: dict[str, SessionError] = {}
        self._waiting: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llama-engine", daemon=True)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-writer")
        self._saves: dict[str, Future[None]] = {}
        self.on_first_token: Callable[[float], None] = lambda seconds: None  # TTFT
        if store is not None:
            for session_id in store.ids():
                self._load_session(session_id)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()
        self._writer.shutdown(wait=True)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return sum(1 for s in self.slots if s.job)

    def submit(self, job: Job) -> None:
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"all {len(self.slots)} slots are busy and {len(self._waiting)} requests "
                    f"wait (queue limit {self.max_queue}); retry later"
                )
            self._waiting.append(job)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the engine thread between steps (it may touch slots and sessions)."""
        future: Future[T] = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return future

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

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._calls or self._has_work()):
                    self._wake.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
            try:
                self._admit_waiting()
                self._step()
            except Exception as e:  # a bug: fail the active jobs, keep serving
                log.exception("engine step failed")
                for slot in self.slots:
                    if slot.job:
                        self._finish(slot, FinishReason.ERROR, error=f"internal error: {e}")
        for slot in self.slots:
            if slot.job:
                self._finish(slot, FinishReason.CANCELLED, error="server shutting down")
        for job in self._waiting:
            job.emit(Finished(FinishReason.CANCELLED, error="server shutting down"))
            job.release()

    def _has_work(self) -> bool:
        return bool(self.num_active) or (bool(self._waiting) and self._free_slot_exists())

    def _free_slot_exists(self) -> bool:
        return any(s.job is None for s in self.slots)

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        for job in list(self._waiting):
            if job.cancelled.is_set() or (job.deadline is not None and now > job.deadline):
                self._waiting.remove(job)
                self._end_session_turn(job, completed=False)
                why = "cancelled" if job.cancelled.is_set() else "deadline exceeded"
                job.emit(Finished(FinishReason.CANCELLED, error=f"{why} while queued"))
                job.release()
        for job in list(self._waiting):
            slot = self._choose_slot(job)
            if slot is None:
                continue
            self._waiting.remove(job)
            try:
                self._start(slot, job)
            except SessionError as e:
                self._reject(job, e.kind, str(e))
            except Exception as e:  # a bug: the request fails, the engine goes on
                log.exception("starting a request failed")
                slot.job = None
                self._reject(job, ErrorKind.INTERNAL, f"internal error: {e}")

    def _choose_slot(self, job: Job) -> _Slot | None:
        free = [s for s in self.slots if s.job is None]
        if not free:
            return None
        if job.session_id is not None:
            session = self.sessions.get(job.session_id)
            if session is not None and session.slot is not None:
                return self.slots[session.slot]  # its own slot, never used by others while owned
        unowned = [s for s in free if s.owner is None]
        if len(unowned) > 1 and job.session_id is None:  # (_start matches the chosen one again)
            return max(unowned, key=lambda s: _reusable_cells(s.ledger, job.items))
        if unowned:
            return min(unowned, key=lambda s: s.ledger.num_cells if s.ledger else 0)
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
            job.media = {}  # the session owns the native chunks now
            ledger = session.ledger
            start = ledger.generated_tail()
        else:
            if slot.ledger is None:
                slot.ledger = self.new_ledger(job.context)
            ledger = slot.ledger
            start = 0
        ctx = job.context
        ledger.reconfigure(
            policy=ctx.policy, keep=ctx.keep, discard_fraction=ctx.discard_fraction, unit=ctx.unit
        )
        num_before = sum(seg.num_cells for seg in ledger.segments[:start])
        si, so, rest = ledger.common_prefix(job.items, start)
        cut = ledger.truncate(si, so)
        num_reused = ledger.num_cells - num_before
        # a reused M-RoPE image holds more cells than positions: count its positions
        num_reused_positions = sum(seg.num_positions for seg in ledger.segments[start:])
        admission = ledger.admit(rest, truncate=ctx.truncate_prompt)
        error = None
        if isinstance(admission, CannotFit):
            error = SessionError(ErrorKind.RESOURCE_EXHAUSTED, admission.message)
        elif admission.kept and admission.kept[-1].media_id:
            error = SessionError(
                ErrorKind.INVALID_ARGUMENT, "the prompt ends with media: add text after it"
            )
        restore: list[Item] = []
        if reprefill and error is not None:
            self._swap_out(slot)  # its ledger stays: the next turn re-prefills it
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

    def _reject(self, job: Job, kind: ErrorKind, message: str) -> None:
        self._end_session_turn(job, completed=False)
        job.emit(Rejected(kind, message))
        job.release()

    def _media(self, slot: _Slot, key: str) -> MediaHandle:
        assert slot.job is not None
        if slot.owner is not None:
            return self.sessions[slot.owner].media[key]
        return slot.job.media[key]

    # -- sessions (engine thread only) ------------------------------------------------------

    def create_session(
        self, session_id: str, context: ContextConfig, sampling: SamplingConfig
    ) -> Session:
        if session_id in self.sessions or session_id in self.broken_sessions:
            raise SessionError(ErrorKind.ALREADY_EXISTS, f"session {session_id!r} already exists")
        session = Session(session_id, context, sampling, self.new_ledger(context))
        self.sessions[session_id] = session
        self._save(session, b"")
        return session

    def delete_session(self, session_id: str) -> None:
        self.broken_sessions.pop(session_id, None)
        session = self.sessions.get(session_id)
        if session is None:
            if self.store is None or not self.store.delete(session_id):
                raise SessionError(ErrorKind.NOT_FOUND, f"no session {session_id!r}")
            return
        self._idle_session(session_id)
        if session.slot is not None:
            self._swap_out(self.slots[session.slot])
        del self.sessions[session_id]
        session.release()
        if self.store is not None:
            self._flush(session_id)
            self.store.delete(session_id)
            self._forget_media(session)

    def _forget_media(self, session: Session) -> None:
        """Delete saved pixels no other session refers to (a broken one might: keep them then)."""
        assert self.store is not None
        if self.broken_sessions:
            return
        used = {px.media_id for s in self.sessions.values() for px in s.pixels.values()}
        for media_id in {px.media_id for px in session.pixels.values()} - used:
            self.store.delete_media(media_id)

    def save_session(self, session_id: str) -> Session:
        session = self._idle_session(session_id)
        self._save(session, self.rt.state_get(session.slot) if session.slot is not None else None)
        self._flush(session_id)
        return session

    def restore_session(self, session_id: str) -> Session:
        """Forget the in-memory state and read the session back from disk."""
        session = self._idle_session(session_id)
        if self.store is None:
            raise SessionError(
                ErrorKind.FAILED_PRECONDITION, "sessions are not persisted (no --sessions-dir)"
            )
        self._flush(session_id)
        if session.slot is not None:
            self._swap_out(self.slots[session.slot])
        session.release()
        del self.sessions[session_id]
        self._load_session(session_id)
        return self._session(session_id)

    def _session(self, session_id: str) -> Session:
        if session_id in self.broken_sessions:
            raise self.broken_sessions[session_id]
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(ErrorKind.NOT_FOUND, f"no session {session_id!r}")
        return session

    def _idle_session(self, session_id: str) -> Session:
        session = self._session(session_id)
        if session.busy:
            raise SessionError(
                ErrorKind.FAILED_PRECONDITION, f"session {session_id!r} has a turn running"
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
        if job.session_id is None or job.session_id not in self.sessions:
            return None
        session = self.sessions[job.session_id]
        session.busy = False
        session.last_used = time.monotonic()
        snapshot, session.snapshot = session.snapshot, None
        if completed:
            session.num_turns += 1
            assert session.slot is not None
            return self._save(session, self.rt.state_get(session.slot))
        if snapshot is not None:
            if session.slot is not None:
                self._swap_out(self.slots[session.slot])
            session.ledger.load_json(snapshot[0])
            session.num_shifts = snapshot[1]
        return None

    def _save(self, session: Session, kv_state: bytes | None) -> Future[None] | None:
        if self.store is None:
            return None
        header = session.header(self.rt.fingerprint, self.rt.layout)
        store, sid = self.store, session.session_id
        previous = self._saves.get(sid)

        def write() -> None:
            if previous is not None:
                previous.result()
            state = kv_state
            if state is None:  # keep the KV bytes already on disk
                try:
                    state = store.load(sid).kv_state
                except (KeyError, CorruptSessionError):
                    state = b""
            store.save(sid, header, state)

        self._saves[sid] = future = self._writer.submit(write)
        return future

    def _flush(self, session_id: str) -> None:
        future = self._saves.pop(session_id, None)
        if future is not None:
            future.result()

    def _load_session(self, session_id: str) -> None:
        """Register a saved session; its KV state is read when it next gets a slot."""
        assert self.store is not None
        try:
            saved = self.store.load(session_id)
            fp = saved.header.get("fingerprint", {})
            if Fingerprint(**fp) != self.rt.fingerprint:
                raise SessionError(
                    ErrorKind.FAILED_PRECONDITION,
                    f"session {session_id!r} was saved with another model ({str(fp)[:80]})",
                )
            session = Session.from_header(session_id, saved.header, self.new_ledger)
            held = {seg.media_id for seg in session.ledger.segments if seg.is_media}
            for key, px in session.pixels.items():
                if key in held:
                    session.media[key] = self._media_handle(key, px)
        except SessionError as e:
            log.warning("%s", e)
            self.broken_sessions[session_id] = e
            return
        except (CorruptSessionError, KeyError, TypeError, ValueError) as e:
            log.warning("session %r is unreadable: %s", session_id, e)
            self.broken_sessions[session_id] = SessionError(
                ErrorKind.DATA_LOSS, f"session {session_id!r} is unreadable: {e}"
            )
            return
        self.sessions[session_id] = session

    def _media_handle(self, key: str, px: Pixels) -> MediaHandle:
        """A native chunk to encode, from the saved pixels."""
        assert self.store is not None and self.rt.mtmd is not None
        rgb = self.store.load_media(px.media_id)
        return media_handle(self.rt.mtmd, key, Bitmap(px.width, px.height, rgb, px.media_id))

    def _swap_out(self, slot: _Slot) -> None:
        """The slot's session leaves it; it was saved when its last turn completed."""
        assert slot.owner is not None
        session = self.sessions[slot.owner]
        session.slot = None
        self.rt.seq_clear(slot.seq)
        slot.owner, slot.ledger = None, None

    def _swap_in(self, session: Session, slot: _Slot) -> bool:
        """Put a session's KV state into slot; False when it must be re-prefilled from its
        ledger instead (no saved state, another context layout, or a state that does not load).
        """
        self.rt.seq_clear(slot.seq)
        if slot.ledger is not None and slot.owner is None:
            slot.ledger = None
        session.slot, slot.owner = slot.seq, session.session_id
        self.stats.num_session_restores += 1
        if not session.ledger.segments:
            return True
        state = b""
        if self.store is not None:
            self._flush(session.session_id)
            try:
                saved = self.store.load(session.session_id)
            except (KeyError, CorruptSessionError) as e:  # removed or damaged since it loaded
                log.warning(
                    "session %r: saved state unusable (%s); re-prefilling", session.session_id, e
                )
            else:
                if saved.header.get("layout") == self.rt.layout:
                    state = saved.kv_state
        return bool(state) and self.rt.state_set(slot.seq, state)

    def _step(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            job = slot.job
            if job and job.cancelled.is_set():
                self._finish(slot, FinishReason.CANCELLED, error="cancelled by the client")
            elif job and job.deadline is not None and now > job.deadline:
                self._finish(slot, FinishReason.CANCELLED, error="deadline exceeded")
        for slot in self.slots:
            if slot.job and slot.pending and slot.pending[0].media_id:
                self._decode_media(slot)
        self._decode_text()

    # -- media ------------------------------------------------------------------------------

    def _decode_media(self, slot: _Slot) -> None:
        item = slot.pending[0]
        if not self._make_room(slot, item.num_cells, item.num_positions, item.group):
            return
        if not slot.pending or slot.pending[0] is not item:
            return  # a reprefill put other items first
        assert slot.job and slot.ledger and item.media_id
        handle = self._media(slot, item.media_id)
        embd = self.cache.get(item.media_id)
        if embd is None:
            embd = self.rt.encode_media(handle.chunk)
            self.cache.put(item.media_id, embd)
        pos = slot.ledger.next_pos
        end = self.rt.decode_media(handle.chunk, embd, pos, slot.seq)
        if end - pos != item.num_positions:
            raise RuntimeError(
                f"media advanced {end - pos} positions, ledger expected {item.num_positions}"
            )
        self.stats.num_media_decodes += 1
        slot.ledger.append(item)
        slot.pending.popleft()
        self._progress(slot, item.num_cells)

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
                self._finish(slot, FinishReason.ERROR, error=f"llama_decode failed (rc={rc})")
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
                self._finish(slot, FinishReason.ERROR, error=plan.message)
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
        self, slot: _Slot, reason: FinishReason, *, error: str = "", stop_string: str = ""
    ) -> None:
        job = slot.job
        assert job is not None
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
        finished = Finished(reason, slot.usage, stop_string=stop_string, error=error)
        if saved is None:
            job.emit(finished)
            return

        def report(write: Future[None]) -> None:  # a finished turn is on disk when it says so
            e = write.exception()
            job.emit(replace(finished, error=f"the turn was not saved: {e}") if e else finished)

        saved.add_done_callback(report)


def _reusable_cells(ledger: Ledger | None, items: Sequence[Item]) -> int:
    if ledger is None:
        return 0
    si, so, _ = ledger.common_prefix(items)
    return sum(seg.num_cells for seg in ledger.segments[:si]) + so


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


def _policy_of(plan: Plan) -> Policy:
    if isinstance(plan, Shift):
        return Policy.SHIFT
    if isinstance(plan, Gap):
        return Policy.GAP
    return Policy.REPREFILL
