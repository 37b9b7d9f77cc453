"""The scheduler: the bounded wait queue, which waiting job starts next, and in which slot.

A request takes its place in the queue (a reservation) before its images are decoded and
checked, and is refused then if there is none: the work and memory of requests in flight are
bounded by the queue, not by how many arrive at once. The queue is touched only under the
engine's condition lock (handlers reserve and put jobs in from their threads); everything else
runs on the engine thread.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from infer_service.events import ErrorKind, Problem, QueueFullError, Reason
from infer_service.kv.host_cache import HostSequenceCache, reuse_of
from infer_service.kv.ledger import Item, Ledger
from infer_service.runner.job import Job
from infer_service.runner.slot import Slot
from infer_service.sessions.manager import SessionManager


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

    def take_expired(self, now: float) -> list[Job]:
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
            self._may_run(j.tenant) and not self.sessions.waits_for_read(j, free)
            for q in self._queues.values()
            for j in q
        )

    def _may_run(self, tenant: str) -> bool:
        limit = self.tenant_limits.max_active
        return not limit or sum(1 for s in self.slots if s.job and s.job.tenant == tenant) < limit

    @property
    def num_free_slots(self) -> int:
        return sum(1 for s in self.slots if s.job is None)

    def startable(self) -> Iterator[tuple[Slot, Job]]:
        """The jobs to start now, each out of the queue with its slot (chosen after the
        previous one started): round robin across tenants, each tenant's in its order."""
        while True:
            with self._lock:
                waiting = self._order()
            for job in waiting:
                if not self._may_run(job.tenant):
                    continue
                slot = self.choose_slot(job)
                if slot is None or not self.sessions.ready(job, self.num_free_slots):
                    continue
                with self._lock:
                    self._remove(job)
                    if job.tenant in self._rotation:  # served: the others come first now
                        self._rotation.remove(job.tenant)
                        self._rotation.append(job.tenant)
                yield slot, job
                break  # the order changed: look again
            else:
                return

    def choose_slot(self, job: Job) -> Slot | None:
        free = [s for s in self.slots if s.job is None]
        if not free:
            return None
        if job.session_id is not None:
            own = self.sessions.slot_of(job.session_id)
            if own is not None:
                return self.slots[own]  # its own slot, never used by others while owned
        unowned = [s for s in free if s.owner is None]
        if unowned and job.session_id is None:  # (Executor.start matches the chosen one again)
            job.resume = None
            pooled = self.pooled(job)  # (the pool's shared prefix: any slot starts with it)

            def worth(slot: Slot) -> int:
                own = reused_cells(slot.ledger, job.items) if slot.reuse_key == job.reuse_key else 0
                return own if not pooled or own >= pooled + OVER_POOL else pooled

            reuse = {s.seq: worth(s) for s in unowned}
            # the most reuse; on a tie, the slot whose content is worth least
            best = max(unowned, key=lambda s: (reuse[s.seq], -self.own_cells(s)))
            cached = self.host_sequences.best(job.items, job.reuse_key)
            margin = OVER_POOL if pooled else 0
            if cached is not None and cached[1].num_cells > reuse[best.seq] + margin:
                job.resume = cached[0]  # a conversation that lost its slot: put it back
                return min(unowned, key=lambda s: (reuse[s.seq], self.own_cells(s)))
            return best
        if unowned:
            return min(unowned, key=self.own_cells)
        idle = [s for s in free if s.owner is not None]
        return min(idle, key=lambda s: self.sessions.last_used(s.owner)) if idle else None  # type: ignore[arg-type]


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
