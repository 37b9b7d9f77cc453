"""The engine: one thread that owns llama.cpp, every slot's ledger, and the step loop.

A step carries out each slot's ledger plan, decodes at most one media chunk per slot, then puts
every slot's next text (one generated token, or up to batch_size prompt tokens) into ONE
llama_decode, and samples every slot whose logits came out of it. Handlers talk to the engine
through `submit` and the job's `emit` callback; they never touch llama.cpp.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from infer_service.events import (
    ContextShift,
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    Started,
    TokenDelta,
    Usage,
)
from infer_service.ledger import (
    Admission,
    CannotFit,
    EvictionUnit,
    Fits,
    Gap,
    Item,
    Ledger,
    Plan,
    Policy,
    Reprefill,
    Shift,
)
from infer_service.media import MediaHandle, media_key
from infer_service.runtime import EmbeddingCache, Runtime, SamplingConfig
from infer_service.text_stream import TextStream
from prep_service.descriptors import MediaChunk, PreparedPrompt

log = logging.getLogger("slotwise.engine")


class QueueFullError(RuntimeError):
    pass


@dataclass(frozen=True)
class ContextConfig:
    policy: Policy = Policy.AUTO
    keep: int = 0
    discard_fraction: float = 0.5
    unit: EvictionUnit = EvictionUnit.TOKEN
    truncate_prompt: bool = False


@dataclass
class Job:
    admission: Admission
    media: dict[str, MediaHandle]
    emit: Callable[[Event], None]
    sampling: SamplingConfig = SamplingConfig()
    context: ContextConfig = ContextConfig()
    max_tokens: int = 256
    stop: Sequence[str] = ()
    deadline: float | None = None  # time.monotonic()
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def release(self) -> None:
        for h in self.media.values():
            h.close()


def prompt_items(prompt: PreparedPrompt) -> list[Item]:
    """Descriptor chunks -> ledger items (media keyed per slice of an image)."""
    items = []
    slices: dict[int, int] = {}
    for c in prompt.chunks:
        group = c.media_group or None
        if isinstance(c, MediaChunk):
            k = slices.get(c.media_group, 0)
            slices[c.media_group] = k + 1
            key = media_key(c.media_id, k)
            items.append(Item(c.num_cells, c.num_positions, c.message_index, media_id=key, group=group))
        else:
            n = len(c.token_ids)
            items.append(Item(n, n, c.message_index, token_ids=c.token_ids, group=group))
    return items


def new_ledger(capacity: int, runtime_can_shift: bool, n_ctx_train: int, ctx: ContextConfig) -> Ledger:
    return Ledger(
        capacity,
        can_shift=runtime_can_shift,
        n_ctx_train=n_ctx_train,
        policy=ctx.policy,
        keep=ctx.keep,
        discard_fraction=ctx.discard_fraction,
        unit=ctx.unit,
    )


@dataclass
class _Slot:
    seq: int
    job: Job | None = None
    ledger: Ledger | None = None
    pending: deque[Item] = field(default_factory=deque)
    sampler: int = 0
    text: TextStream = field(default_factory=TextStream)
    usage: Usage = field(default_factory=Usage)
    num_prefill_total: int = 0
    num_prefill_done: int = 0
    prefilling: bool = True
    reply_index: int = 0  # message index of generated tokens
    t_start: float = 0.0
    t_first: float = 0.0


@dataclass
class EngineStats:
    num_decodes: int = 0
    num_multi_seq_decodes: int = 0
    num_media_decodes: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0


class Engine:
    def __init__(self, runtime: Runtime, *, max_queue: int = 64, cache_bytes: int = 1 << 30):
        self.rt = runtime
        self.slots = [_Slot(seq) for seq in range(runtime.num_slots)]
        self.max_queue = max_queue
        self.cache = EmbeddingCache(cache_bytes)
        self.stats = EngineStats()
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llama-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

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

    def new_ledger(self, ctx: ContextConfig) -> Ledger:
        return new_ledger(self.rt.num_cells_per_slot, self.rt.can_shift, self.rt.n_ctx_train, ctx)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self.num_active:
                    self._wake.wait()
                if self._stopping:
                    break
                self._admit_waiting()
            try:
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

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        for job in list(self._waiting):
            if job.cancelled.is_set() or (job.deadline is not None and now > job.deadline):
                self._waiting.remove(job)
                job.emit(Finished(FinishReason.CANCELLED, error="cancelled while queued"))
                job.release()
        for slot in self.slots:
            if slot.job is None and self._waiting:
                self._start(slot, self._waiting.popleft())

    def _start(self, slot: _Slot, job: Job) -> None:
        kept = job.admission.kept
        slot.job = job
        slot.ledger = self.new_ledger(job.context)
        slot.pending = deque(kept)
        slot.sampler = self.rt.sampler(job.sampling)
        slot.text = TextStream(job.stop)
        slot.num_prefill_total = sum(i.num_cells for i in kept)
        slot.num_prefill_done = 0
        slot.prefilling = True
        slot.reply_index = max((i.message_index for i in kept), default=0)
        slot.usage = Usage(
            num_prompt_cells=slot.num_prefill_total,
            num_prompt_positions=sum(i.num_positions for i in kept),
        )
        slot.t_start = time.perf_counter()
        dropped = job.admission.dropped
        job.emit(
            Started(
                slot=slot.seq,
                num_prompt_cells=slot.usage.num_prompt_cells,
                num_prompt_positions=slot.usage.num_prompt_positions,
                num_capacity_cells=self.rt.num_cells_per_slot,
                num_truncated_cells=sum(i.num_cells for i in dropped),
                num_truncated_chunks=len(dropped),
                truncated_media_ids=tuple(i.media_id for i in dropped if i.media_id),
            )
        )

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
        handle = slot.job.media[item.media_id]
        embd = self.cache.get(item.media_id)
        if embd is None:
            embd = self.rt.encode_media(handle.chunk)
            self.cache.put(item.media_id, embd)
        pos = slot.ledger.next_pos
        end = self.rt.decode_media(handle.chunk, embd, pos, slot.seq)
        if end - pos != item.num_positions:
            raise RuntimeError(f"media advanced {end - pos} positions, ledger expected {item.num_positions}")
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
            n = _text_take_size(slot.pending[0], budget)
            if n == 0:
                continue
            head = slot.pending[0]
            if not self._make_room(slot, n, n, head.group):
                continue  # finished, or a reprefill put other items first
            item = _take_text(slot.pending, n)
            assert slot.ledger is not None
            last = not slot.pending
            index = batch.add(item.token_ids, slot.ledger.next_pos, slot.seq, logits_last=last)
            taken.append((slot, item, index if last else None))
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
            for slot, _, _ in taken:
                self._finish(slot, FinishReason.ERROR, error=f"llama_decode failed (rc={rc})")
            return
        elapsed = time.perf_counter() - t0
        for slot, item, index in taken:
            assert slot.ledger is not None
            slot.ledger.append(item)
            if slot.prefilling:
                self._progress(slot, item.num_cells)
            else:
                slot.usage.decode_seconds += elapsed
            if index is not None:
                self._sample(slot, index)

    def _sample(self, slot: _Slot, index: int) -> None:
        job = slot.job
        assert job is not None
        if slot.prefilling:
            slot.prefilling = False
            slot.usage.prefill_seconds = time.perf_counter() - slot.t_start
        token = self.rt.sample(slot.sampler, index)
        if self.rt.is_eog(token):
            self._finish(slot, FinishReason.STOP)
            return
        slot.usage.num_generated_tokens += 1
        self.stats.num_generated_tokens += 1
        text = slot.text.push(self.rt.piece(token))
        if slot.text.stopped_by is not None:
            job.emit(TokenDelta((token,), text))
            self._finish(slot, FinishReason.STOP, stop_string=slot.text.stopped_by)
            return
        if slot.usage.num_generated_tokens >= job.max_tokens:
            job.emit(TokenDelta((token,), text + slot.text.flush()))
            self._finish(slot, FinishReason.LENGTH)
            return
        job.emit(TokenDelta((token,), text))
        slot.pending.append(Item(1, 1, slot.reply_index, token_ids=(token,)))

    # -- the ledger's plans -----------------------------------------------------------------

    def _make_room(self, slot: _Slot, num_cells: int, num_positions: int, group: int | None) -> bool:
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
        self.stats.num_shifts += 1
        slot.job.emit(
            ContextShift(
                policy=_policy_of(plan),
                num_cells_evicted=plan.num_cells_evicted,
                num_positions_evicted=plan.num_positions_evicted,
                media_ids_evicted=tuple(plan.media_ids_evicted),
                num_cells_used_after=ledger.num_cells,
                next_position_after=ledger.next_pos,
            )
        )
        return not isinstance(plan, Reprefill)

    def _progress(self, slot: _Slot, num_cells: int) -> None:
        if not slot.prefilling or slot.job is None:
            return
        slot.num_prefill_done += num_cells
        slot.job.emit(PrefillProgress(slot.num_prefill_done, slot.num_prefill_total))

    def _finish(self, slot: _Slot, reason: FinishReason, *, error: str = "", stop_string: str = "") -> None:
        job = slot.job
        assert job is not None
        if slot.prefilling:
            slot.usage.prefill_seconds = time.perf_counter() - slot.t_start
        rest = slot.text.flush() if reason in (FinishReason.STOP, FinishReason.LENGTH) else ""
        self.rt.seq_clear(slot.seq)
        self.rt.free_sampler(slot.sampler)
        slot.sampler = 0
        slot.job = None
        slot.ledger = None
        slot.pending.clear()
        job.release()
        # the slot is free before the client hears about it: its next request finds it so
        if rest:
            job.emit(TokenDelta((), rest))
        job.emit(Finished(reason, slot.usage, stop_string=stop_string, error=error))


def _text_take_size(item: Item, budget: int) -> int:
    """How many tokens of the front text item fit this batch; grouped (wrapper) text goes whole."""
    if item.num_cells <= budget:
        return item.num_cells
    return 0 if item.group is not None else budget


def _take_text(pending: deque[Item], n: int) -> Item:
    item = pending[0]
    if n == item.num_cells:
        return pending.popleft()
    rest = item.token_ids[n:]
    pending[0] = Item(len(rest), len(rest), item.message_index, token_ids=rest)
    return Item(n, n, item.message_index, token_ids=item.token_ids[:n])


def _policy_of(plan: Plan) -> Policy:
    if isinstance(plan, Shift):
        return Policy.SHIFT
    if isinstance(plan, Gap):
        return Policy.GAP
    return Policy.REPREFILL
