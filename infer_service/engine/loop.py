"""The engine: one thread that owns llama.cpp, and its loop. Each step is three calls:

    plan = scheduler.schedule(now)      # who ends, who starts, in which slot (values)
    outcome = executor.execute(plan)    # the llama.cpp calls; what happened (values)
    outputs.process(outcome)            # text, stops, endings, sessions' turns, events

- the scheduler (infer_service/engine/scheduler.py): the wait queue, which job starts, and
  in which slot (a session's turn entered there by the session manager);
- the executor (infer_service/runner/executor.py): every llama.cpp call for a slot;
- the output processor (infer_service/engine/outputs.py): the only code that walks a step's
  outcome, and the only one that tells callers (each job's mailbox, once a step);
- the session manager (infer_service/sessions/manager.py): sessions, their saves and swaps.

Handlers talk to the engine through its client (infer_service/engine/client.py): `submit`,
`call`, and the job's mailbox; they never touch llama.cpp, and none of their code runs on the
engine thread. A finished request leaves its sequence in the slot: the next request that shares
a prefix (chunk identity: token ids, media ids) decodes only the rest.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from infer_service.engine.outputs import OutputProcessor, post_best_effort
from infer_service.engine.scheduler import Reservation, Scheduler, TenantLimits
from infer_service.events import (
    EngineStoppedError,
    ErrorKind,
    Finished,
    FinishReason,
    Problem,
    Reason,
    Rejected,
)
from infer_service.kv.host_cache import ReuseKey
from infer_service.kv.ledger import Segment
from infer_service.kv.pool import PoolFigures
from infer_service.kv.view import SharedPicture, SlotPicture, SlotState, runs
from infer_service.runner.draft_model import DraftModel
from infer_service.runner.executor import Executor
from infer_service.runner.job import Job
from infer_service.runner.plan import StepPlan
from infer_service.runner.runtime import Runtime
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.sessions.disk_queues import run_unless_cancelled
from infer_service.sessions.manager import SessionManager
from infer_service.sessions.session import SessionLimits, owner_of
from infer_service.sessions.store import SessionStore

__all__ = ["Engine", "EngineSnapshot"]

log = logging.getLogger("slotwise.engine")
T = TypeVar("T")

_CHECKPOINT_WAIT = 30.0  # seconds a stopping engine waits for its sessions' checkpoints
_WAITING_POLL = 0.05  # seconds: how often a waiting request's deadline is looked at


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters as of one moment between steps (made on the engine thread)."""

    cells: tuple[int, ...]  # per slot
    waiting: int
    active: int
    cache_hits: int
    cache_misses: int
    stats: EngineStats
    session_bytes_written: int  # session checkpoints and journals
    pool: PoolFigures | None  # (kv_unified) everyone's: for the operator (metrics)
    pool_by_tenant: dict[str, PoolFigures]  # ... each tenant's own part: for its callers


class Engine:
    def __init__(
        self,
        runtime: Runtime,
        *,
        max_queue: int = 64,
        cache_bytes: int = 1 << 30,
        store: SessionStore | None = None,
        host_sequence_bytes: int = 256 << 20,
        tenant_limits: TenantLimits = TenantLimits(),
        fair: bool = True,
        draft_model: DraftModel | None = None,
        session_limits: SessionLimits = SessionLimits(),
        on_death: Callable[[BaseException], None] = lambda error: None,
        spec_cache_bytes: int = 256 << 20,
    ):
        self.runtime = runtime
        self.slots = [Slot(seq) for seq in range(runtime.num_slots)]
        self.stats = EngineStats()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.died: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, name="llama-engine", daemon=True)
        self.executor = Executor(
            runtime,
            self.stats,
            cache_bytes=cache_bytes,
            host_sequence_bytes=host_sequence_bytes,
            notify=self._notify,
            draft_model=draft_model,
            slots=self.slots,
            spec_cache_bytes=spec_cache_bytes,
        )
        self.sessions = SessionManager(
            self.executor, self.slots, store, self.stats, call=self.call,
            notify=self._notify, limits=session_limits,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.slots, self.sessions, self.executor.host_sequences, self._wake,
            max_queue=max_queue, tenant_limits=tenant_limits, fair=fair,
            pooled=self.executor.pooled_cells, own_cells=self.executor.own_cells,
        )  # fmt: skip
        self.outputs = OutputProcessor(self.executor, self.sessions, self.stats, runtime)
        self.cache = self.executor.cache
        self.host_sequences = self.executor.host_sequences
        self._on_death = on_death  # (the process is told: it stops serving)
        self._plan: StepPlan | None = None  # the step's, while the executor carries it out

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self.alive and self._thread.is_alive():  # the next start loads sessions whole
            with contextlib.suppress(Exception):
                self.call(self.sessions.checkpoint_resident).result(_CHECKPOINT_WAIT)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        self.outputs.close()
        self.executor.close()
        self.sessions.close()

    @property
    def alive(self) -> bool:
        return self.died is None and not self._stopping

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_active(self) -> int:
        return sum(1 for s in self.slots if s.job)

    def snapshot(self) -> EngineSnapshot:
        """Call on the engine thread (`call(engine.snapshot)`): readers off it would see a
        step half done."""
        return EngineSnapshot(
            cells=tuple(s.num_cells for s in self.slots),
            waiting=self.num_waiting,
            active=self.num_active,
            cache_hits=self.cache.hits,
            cache_misses=self.cache.misses,
            stats=replace(
                self.stats,
                shifts_by_policy=dict(self.stats.shifts_by_policy),
                drafts_by_type={k: list(v) for k, v in self.stats.drafts_by_type.items()},
                by_tenant={t: replace(v) for t, v in self.stats.by_tenant.items()},
                time_to_first_token=self.stats.time_to_first_token.copy(),
            ),
            session_bytes_written=self.sessions.bytes_written,
            pool=self.executor.pool_figures(),
            pool_by_tenant=self._pool_by_tenant(),
        )

    def _tenant_of(self, slot: Slot) -> str:
        """Whose the slot's sequence is ("" for nobody's)."""
        if slot.job is not None:
            return slot.job.tenant
        return owner_of(slot.owner) if slot.owner else (slot.reuse_key or ("",))[0]

    def _pool_by_tenant(self) -> dict[str, PoolFigures]:
        """(pool) Each tenant's own part of the pool: its sequences' cells, its prefixes."""
        pool = self.executor.pool
        if pool is None:
            return {}
        cells: dict[str, list[tuple[int, int]]] = {}
        for slot in self.slots:
            if slot.ledger is not None:
                cells.setdefault(self._tenant_of(slot), []).append((slot.seq, slot.num_cells))
        for h in pool.holders:
            cells.setdefault(_owner(h.key[0]), [])
        return {
            t: pool.figures(held, whose=lambda key, t=t: _owner(key) == t)  # type: ignore[misc]
            for t, held in cells.items()
        }

    def slot_pictures(self) -> list[SlotPicture]:
        """Every slot's cells as runs, and its sequence's latest shifts (on the engine thread,
        like `snapshot`); whose each slot is, for the caller to show only its own. A slot
        that opens with a shared prefix shows the cells after it (`shared_pictures` shows the
        prefix, once)."""
        out = []
        pool = self.executor.pool
        for slot in self.slots:
            job, ledger = slot.job, slot.ledger
            tenant = self._tenant_of(slot)
            if job is not None:
                session = job.session_id
                state = SlotState.PREFILLING if slot.prefilling else SlotState.DECODING
            else:
                session = slot.owner
                state = SlotState.IDLE if ledger and ledger.num_cells else SlotState.FREE
            holder = pool.holder_of(slot.seq) if pool is not None else None
            shared = pool.shared_cells(slot.seq) if pool is not None else 0
            skip = self._shared_segments(slot)
            out.append(
                SlotPicture(
                    slot=slot.seq,
                    tenant=tenant,
                    session_id=session or "",
                    state=state,
                    num_cells=slot.num_cells,
                    next_position=ledger.next_pos if ledger else 0,
                    runs=slot.runs.of(ledger, self.executor.read, skip),
                    shifts=tuple(
                        m
                        for m in slot.shifts
                        if ledger is not None
                        and (m.sequence, m.tenant, m.session_id) == (ledger.serial, tenant, session)
                    ),
                    shared_prefix=holder.seq if holder is not None and skip else -1,
                    num_shared_cells=shared if skip else 0,
                    num_recurrent_bytes=self.runtime.checkpoint_bytes if slot.num_cells else 0,
                    num_checkpoints=len(ledger.marks) if ledger else 0,
                    num_checkpoint_bytes=ledger.num_mark_bytes if ledger else 0,
                )
            )
        return out

    def _shared_segments(self, slot: Slot) -> int:
        """(pool) The slot's leading segments that are its shared prefix's cells, exactly (0:
        none, or a share cut mid-segment)."""
        pool, ledger = self.executor.pool, slot.ledger
        shared = pool.shared_cells(slot.seq) if pool is not None else 0
        return _segments_covering(ledger.segments, shared) if ledger is not None and shared else 0

    def shared_pictures(self) -> list[SharedPicture]:
        """(pool) Each shared prefix the pool keeps, once (on the engine thread)."""
        pool = self.executor.pool
        out = []
        for h in pool.holders if pool is not None else ():
            shown = runs(h.segments, self.executor.read)
            # (the slots whose pictures leave the prefix out: a share cut mid-segment shows
            # in its slot whole)
            users = tuple(sorted(s for s in h.users if self._shared_segments(self.slots[s])))
            out.append(SharedPicture(h.seq, _owner(h.key[0]), h.num_cells, users, shown))
        return out

    def reserve(self, tenant: str) -> Reservation:
        """A place in the queue for a request about to be checked (QueueFullError: none)."""
        with self._wake:
            self._check_alive()
            return self.scheduler.reserve(tenant)

    def submit(self, job: Job, reservation: Reservation | None = None) -> None:
        with self._wake:
            self._check_alive()
            self.scheduler.put(job, reservation)
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

    # -- the loop -----------------------------------------------------------------------------

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
            self._finish_everything(gone)
            self._on_death(e)

    def _finish_everything(self, why: Problem) -> None:
        """Every active, queued and pending caller gets `why`; nothing waits forever."""
        self.outputs.drain()  # (what they were told so far goes first)
        plan, self._plan = self._plan, None
        for job, event in plan.dropped if plan is not None else ():
            post_best_effort(job, [event])
        for choice in plan.starts if plan is not None else ():
            if choice.slot.job is not choice.job:  # (out of the queue, not yet in its slot)
                post_best_effort(choice.job, [Rejected(why)])
        for slot in self.slots:
            if slot.job:
                job, slot.job = slot.job, None
                post_best_effort(
                    job, [Finished(FinishReason.CANCELLED, error=why.message, problem=why)]
                )
        waiting = self.scheduler.take_all()
        with self._wake:
            calls, self._calls = list(self._calls), deque()
        for job in waiting:
            post_best_effort(job, [Rejected(why)])
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStoppedError(why))

    def _run(self) -> None:
        # when the sessions' periodic work is due (monotonic): at once, for those read from disk
        idle_at: float | None = time.monotonic()
        while True:
            with self._wake:
                while not (self._stopping or self._calls or self._has_work()):
                    if self.executor.encoding or any(s.job for s in self.slots):
                        # a request waiting (for its image, for room in the pool) may be
                        # cancelled or pass its deadline, which wakes nobody
                        self._wake.wait(_WAITING_POLL)
                        break
                    if idle_at is not None:
                        self._wake.wait(max(0.0, idle_at - time.monotonic()))
                        break
                    self._wake.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:  # (one whose caller went away is skipped, never run late)
                run_unless_cancelled(future, fn)
            ended = self._step()
            now = time.monotonic()
            # looked at again when a turn (or a session call) may have made one idle, or one
            # is due: not on every token's step
            if calls or ended or (idle_at is not None and now >= idle_at):
                try:  # (a failure here is no request's: it is tried again later)
                    wait = self.sessions.periodic(now)
                except Exception:
                    log.exception("the sessions' periodic work failed")
                    wait = None
                idle_at = None if wait is None else now + wait
        self._finish_everything(
            Problem(ErrorKind.UNAVAILABLE, "server shutting down", Reason.SHUTTING_DOWN)
        )

    def _step(self) -> bool:
        """One step, in three calls (a wake-up for calls or the sessions' periodic work alone
        decodes nothing); whether it finished a request."""
        plan = self._plan = self.scheduler.schedule(time.monotonic())
        busy = self.executor.encoding or any(s.job for s in self.slots)
        if not (busy or plan.starts or plan.overdue or plan.dropped):
            return False
        try:
            outcome = self.executor.execute(plan)
        except Exception as e:  # a bug: the active requests fail, the engine goes on
            log.exception("engine step failed")
            outcome = self.executor.fail_all(e, plan)
        self._plan = None  # (its jobs are in the outcome, or in their slots)
        try:
            return self.outputs.process(outcome)
        except Exception:  # a bug: what it had not told is lost, the engine goes on
            log.exception("telling what a step did failed")
            return True

    def _has_work(self) -> bool:
        runnable = any(
            s.job
            and not self.executor.waits_for_encode(s)
            and (s.preempted is None or self.executor.can_resume(s))
            for s in self.slots
        )
        return runnable or self.scheduler.has_startable()


def _segments_covering(segments: Sequence[Segment], num_cells: int) -> int:
    """How many leading segments hold exactly `num_cells` cells (0: no such boundary)."""
    n = 0
    for k, seg in enumerate(segments):
        if n == num_cells:
            return k
        n += seg.num_cells
    return len(segments) if n == num_cells else 0


def _owner(key: object) -> str:
    """The tenant of a shared prefix's key (the executor keys prefixes by `Job.reuse_key`)."""
    whose: ReuseKey = key  # type: ignore[assignment]
    return whose[0]
