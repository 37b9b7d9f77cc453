"""The scheduler: the bounded wait queue, which waiting job starts next, and in which slot.

A request takes its place in the queue (a reservation) before its images are decoded and
checked, and is refused then if there is none: the work and memory of requests in flight are
bounded by the queue, not by how many arrive at once. The queue is touched only under the
engine's condition lock (handlers reserve and put jobs in from their threads); everything else
runs on the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, replace

from infer_service.events import (
    ErrorKind,
    Finished,
    FinishReason,
    Problem,
    ProblemError,
    QueueFullError,
    Reason,
    Rejected,
    cancelled,
)
from infer_service.kv.host_cache import HostSequenceCache, reuse_of
from infer_service.kv.ledger import Item, Ledger
from infer_service.runner.job import Job
from infer_service.runner.plan import SlotChoice, StepPlan
from infer_service.runner.slot import Slot
from infer_service.sessions.manager import SessionManager

log = logging.getLogger("slotwise.engine")


class Reservation:
    """A place in the queue, held while a request is checked: `Engine.submit` fills it with
    the job, `release` gives it back (either once, from any thread)."""

    def __init__(self, scheduler: Scheduler, tenant: str):
        self.tenant = tenant
        self._scheduler = scheduler
        self._held = True

    def release(self) -> None:
        self._scheduler.unreserve(self)

    def take(self) -> bool:
        """(Under the scheduler's lock) True once: the place is given up."""
        held, self._held = self._held, False
        return held


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold of the engine (0: no limit of its own)."""

    max_active: int = 0  # generations in slots at once (more wait in the queue)
    max_queued: int = 0  # requests waiting (more are refused: RESOURCE_EXHAUSTED)


# cells that reuse in place, or a cached sequence, must bring beyond the pool's shared prefix
# (which every slot starts with) to be worth what it costs: clearing a slot that holds a
# conversation, for a few tokens of a turn's header; loading a whole state, prefix copy and all
OVER_POOL = 32


class Scheduler:
    """The wait queue is one queue per tenant, served round robin: a tenant that queued a
    hundred requests delays another's one by about one slot's turn, not by a hundred (the
    per-tenant queue keeps its own order). `fair=False` serves one FIFO across tenants."""

    def __init__(
        self,
        slots: list[Slot],
        sessions: SessionManager,
        host_sequences: HostSequenceCache,
        lock: threading.Condition,
        *,
        max_queue: int,
        tenant_limits: TenantLimits = TenantLimits(),
        fair: bool = True,
        pooled: Callable[[Job], int] = lambda job: 0,
        own_cells: Callable[[Slot], int] = lambda slot: slot.num_cells,
    ):
        self.slots = slots
        self.sessions = sessions
        self.host_sequences = host_sequences
        self.max_queue = max_queue
        self.tenant_limits = tenant_limits
        self.fair = fair
        self.pooled = pooled
        self.own_cells = own_cells  # (what clearing the slot loses: not a shared prefix's)
        self._lock = lock
        # touched only under _lock: each tenant's waiting jobs, and the tenants in the order
        # they are served next (one that just started a job goes to the back)
        self._queues: dict[str, deque[Job]] = {}
        self._rotation: deque[str] = deque()
        self._num_waiting = 0
        self._reserved: Counter[str] = Counter()  # places held by requests being checked

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def num_waiting_of(self, tenant: str) -> int:
        """Its queued jobs and the places its requests hold while they are checked."""
        return len(self._queues.get(tenant, ())) + self._reserved[tenant]

    def reserve(self, tenant: str) -> Reservation:
        """A place in the queue for a request of tenant (the caller holds the lock), or
        QueueFullError as `put` refuses a job."""
        self._check_room(tenant)
        self._reserved[tenant] += 1
        return Reservation(self, tenant)

    def unreserve(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation.take():
                self._drop_reserved(reservation.tenant)

    def _drop_reserved(self, tenant: str) -> None:  # under _lock
        self._reserved[tenant] -= 1
        if not self._reserved[tenant]:
            del self._reserved[tenant]

    def put(self, job: Job, reservation: Reservation | None = None) -> None:
        """Queue a job (the caller holds the lock) in the place it reserved, or refuse it when
        the queue, or its tenant's share of it, is full."""
        if reservation is not None and reservation.take():
            self._drop_reserved(reservation.tenant)
        else:
            self._check_room(job.tenant)
        queue = self._queues.setdefault(job.tenant, deque())
        if not queue:
            self._rotation.append(job.tenant)
        queue.append(job)
        self._num_waiting += 1

    def _check_room(self, tenant: str) -> None:  # under _lock
        """A full queue (fair) still takes a tenant's request while that tenant holds less
        than its share of it (max_queue over the tenants waiting), so that one tenant's flood
        cannot shut the others out (so at most max_queue plus a share per tenant wait)."""
        waiting = self._num_waiting + self._reserved.total()
        if waiting >= self.max_queue and not self._below_share(tenant):
            raise _full(
                f"all {len(self.slots)} slots are busy and {waiting} requests wait "
                f"(queue limit {self.max_queue}); retry later",
                queue_limit=self.max_queue,
                slots=len(self.slots),
            )
        limit = self.tenant_limits.max_queued
        if limit and self.num_waiting_of(tenant) >= limit:
            raise _full(
                f"{limit} requests of this tenant wait already (its queue limit); retry later",
                tenant_queue_limit=limit,
            )

    def _below_share(self, tenant: str) -> bool:  # under _lock
        if not self.fair:
            return False
        tenants = len(self._queues.keys() | self._reserved.keys() | {tenant})
        return self.num_waiting_of(tenant) < max(1, self.max_queue // tenants)

    def _remove(self, job: Job) -> None:  # under _lock
        queue = self._queues[job.tenant]
        queue.remove(job)
        self._num_waiting -= 1
        if not queue:
            del self._queues[job.tenant]
            self._rotation.remove(job.tenant)

    def _order(self) -> list[Job]:  # under _lock
        """The waiting jobs in the order they should start."""
        if not self.fair:
            return sorted((j for q in self._queues.values() for j in q), key=_submitted)
        queues = [self._queues[t] for t in self._rotation]
        depth = max((len(q) for q in queues), default=0)
        return [q[i] for i in range(depth) for q in queues if i < len(q)]

    def schedule(self, now: float) -> StepPlan:
        """The step's plan: the requests that end before it (cancelled, past their deadline)
        and the waiting jobs that start in it, each with its slot (a session's turn entered
        there by the session manager)."""
        plan = StepPlan()
        if not self._num_waiting:  # (a job put in now is planned next step: it wakes the loop)
            self._overdue(plan, now)
            return plan
        for job in self._take_expired(now):
            deadline = not job.cancelled.is_set()
            why = f"{'deadline exceeded' if deadline else 'cancelled'} while queued"
            gone = Finished(FinishReason.CANCELLED, error=why, problem=cancelled(deadline, why))
            plan.dropped.append((job, gone))
        self._overdue(plan, now)
        self._choose_starts(plan)
        return plan

    def _overdue(self, plan: StepPlan, now: float) -> None:
        for slot in self.slots:
            if slot.job is not None and slot.job.expired(now):
                deadline = not slot.job.cancelled.is_set()
                why = "deadline exceeded" if deadline else "cancelled by the client"
                plan.overdue.append((slot, cancelled(deadline, why)))

    def _choose_starts(self, plan: StepPlan) -> None:
        """Round robin across tenants, each tenant's jobs in their order; each slot chosen
        after the previous job took its own."""
        taken: set[int] = set()  # slots given in this plan
        resumed: set[int] = set()  # host sequences promised in this plan
        while True:
            with self._lock:
                waiting = self._order()
            for job in waiting:
                if not self._may_run(job.tenant, plan.starts):
                    continue
                try:
                    choice = self._choose(job, taken, resumed)
                except Exception as e:  # (a bug: this job fails, the engine goes on)
                    self._drop(plan, job, e)
                    break
                if choice is None:
                    continue
                with self._lock:
                    self._remove(job)
                    if job.tenant in self._rotation:  # served: the others come first now
                        self._rotation.remove(job.tenant)
                        self._rotation.append(job.tenant)
                if job.session_id is not None:
                    try:
                        choice = replace(choice, entry=self.sessions.enter(choice.slot, job))
                    except Exception as e:
                        self._drop(plan, job, e, queued=False)
                        break
                taken.add(choice.slot.seq)
                if choice.resume is not None:
                    resumed.add(choice.resume)
                plan.starts.append(choice)
                break  # the order changed: look again
            else:
                return

    def _drop(self, plan: StepPlan, job: Job, e: Exception, *, queued: bool = True) -> None:
        """A job whose start failed leaves (told why; a bug is INTERNAL)."""
        if queued:
            with self._lock:
                self._remove(job)
        if isinstance(e, ProblemError):
            why = e.problem
        else:
            log.exception("choosing a slot for a request failed", exc_info=e)
            why = Problem(ErrorKind.INTERNAL, f"internal error: {e}")
        plan.dropped.append((job, Rejected(why)))

    def _choose(self, job: Job, taken: Set[int], resumed: Set[int]) -> SlotChoice | None:
        """Its slot, if it may start now (a session's turn: once its saved state is read)."""
        slot, resume = self.choose_slot(job, taken, resumed)
        if slot is None:
            return None
        free = self.num_free_slots - len(taken)
        if job.session_id is not None and not self.sessions.ready(job, free):
            return None
        if slot.owner is not None and slot.owner != job.session_id:
            self.sessions.swap_out(slot)  # an idle session's slot: it leaves it
        return SlotChoice(slot, job, resume=resume)

    def _take_expired(self, now: float) -> list[Job]:
        """The waiting jobs cancelled or past their deadline, out of the queue."""
        with self._lock:
            gone = [job for q in self._queues.values() for job in q if job.expired(now)]
            for job in gone:
                self._remove(job)
        return gone

    def take_all(self) -> list[Job]:
        with self._lock:
            waiting = self._order()
            self._queues.clear()
            self._rotation.clear()
            self._num_waiting = 0
        return waiting

    def has_startable(self) -> bool:
        """(Under the lock) a free slot and a job that may take it now."""
        free = self.num_free_slots
        if free == 0 or not self._num_waiting:
            return False
        return any(
            self._may_run(j.tenant)
            and (j.session_id is None or not self.sessions.waits_for_read(j, free))
            for q in self._queues.values()
            for j in q
        )

    def _may_run(self, tenant: str, starting: Sequence[SlotChoice] = ()) -> bool:
        limit = self.tenant_limits.max_active
        if not limit:
            return True
        running = sum(1 for s in self.slots if s.job and s.job.tenant == tenant)
        return running + sum(1 for c in starting if c.job.tenant == tenant) < limit

    @property
    def num_free_slots(self) -> int:
        return sum(1 for s in self.slots if s.job is None)

    def choose_slot(
        self, job: Job, taken: Set[int] = frozenset(), resumed: Set[int] = frozenset()
    ) -> tuple[Slot | None, int | None]:
        """The slot a job starts in (None: none now), and the host sequence it resumes there
        (stateless: a conversation that lost its slot, when it brings more than the slot
        holds). `taken`, `resumed`: slots and host sequences this step's plan gave to jobs
        before it."""
        free = [s for s in self.slots if s.job is None and s.seq not in taken]
        if not free:
            return None, None
        if job.session_id is not None:
            own = self.sessions.slot_of(job.session_id)
            if own is not None:
                # its own slot, never used by others while owned
                return (self.slots[own] if own not in taken else None), None
        unowned = [s for s in free if s.owner is None]
        if unowned and job.session_id is None:
            return self._stateless_slot(job, unowned, resumed)
        if unowned:
            return min(unowned, key=self.own_cells), None
        idle = [s for s in free if s.owner is not None]
        if not idle:
            return None, None
        return min(idle, key=lambda s: self.sessions.last_used(s.owner or "")), None

    def _stateless_slot(
        self, job: Job, unowned: list[Slot], resumed: Set[int]
    ) -> tuple[Slot, int | None]:
        """The unowned slot whose sequence the job reuses most (Executor.start matches it
        again), or a cached sequence worth more, put back into the slot worth least."""
        pooled = self.pooled(job)  # (the pool's shared prefix: any slot starts with it)

        def worth(slot: Slot) -> int:
            own = reused_cells(slot.ledger, job.items) if slot.reuse_key == job.reuse_key else 0
            return own if not pooled or own >= pooled + OVER_POOL else pooled

        reuse = {s.seq: worth(s) for s in unowned}
        # the most reuse; on a tie, the slot whose content is worth least
        best = max(unowned, key=lambda s: (reuse[s.seq], -self.own_cells(s)))
        cached = self.host_sequences.best(job.items, job.reuse_key, skip=resumed)
        margin = OVER_POOL if pooled else 0
        if cached is not None and cached[1].num_cells > reuse[best.seq] + margin:
            # a conversation that lost its slot: put it back
            return min(unowned, key=lambda s: (reuse[s.seq], self.own_cells(s))), cached[0]
        return best, None


def reused_cells(ledger: Ledger | None, items: Sequence[Item]) -> int:
    reuse = reuse_of(ledger, items)
    return reuse.num_cells if reuse is not None else 0


def _submitted(job: Job) -> float:
    return job.submitted


def _full(message: str, **metadata: object) -> QueueFullError:
    return QueueFullError(
        Problem(
            ErrorKind.RESOURCE_EXHAUSTED,
            message,
            Reason.QUEUE_FULL,
            tuple((k, str(v)) for k, v in metadata.items()),
            retry_after=1.0,
        )
    )
