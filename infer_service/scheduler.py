"""The scheduler: the bounded wait queue, which waiting job starts next, and in which slot.

The queue is touched only under the engine's condition lock (handlers put jobs in from their
threads); everything else runs on the engine thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence

from infer_service.events import ErrorKind, Problem, Reason
from infer_service.ledger import Item, Ledger
from infer_service.session_manager import SessionManager
from infer_service.slots import Job, QueueFullError, Slot
from infer_service.state_cache import StateCache, reuse_of


class Scheduler:
    def __init__(
        self,
        slots: list[Slot],
        sessions: SessionManager,
        states: StateCache,
        lock: threading.Condition,
        *,
        max_queue: int,
    ):
        self.slots = slots
        self.sessions = sessions
        self.states = states
        self.max_queue = max_queue
        self._lock = lock
        self._waiting: deque[Job] = deque()  # touched only under _lock

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def put(self, job: Job) -> None:
        """Queue a job (the caller holds the lock), or refuse it when the queue is full."""
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

    def take_expired(self, now: float) -> list[Job]:
        """The waiting jobs cancelled or past their deadline, out of the queue."""
        with self._lock:
            gone = [job for job in self._waiting if job.expired(now)]
            for job in gone:
                self._waiting.remove(job)
        return gone

    def take_all(self) -> list[Job]:
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        return waiting

    def has_startable(self) -> bool:
        """(Under the lock) a free slot and a job that may take it now."""
        free = self.num_free_slots
        return free > 0 and any(not self.sessions.waits_for_read(j, free) for j in self._waiting)

    @property
    def num_free_slots(self) -> int:
        return sum(1 for s in self.slots if s.job is None)

    def startable(self) -> Iterator[tuple[Slot, Job]]:
        """The jobs to start now, in queue order, each out of the queue with its slot (chosen
        after the previous one started)."""
        with self._lock:
            waiting = list(self._waiting)
        for job in waiting:
            slot = self.choose_slot(job)
            if slot is None or not self.sessions.ready(job, self.num_free_slots):
                continue
            with self._lock:
                self._waiting.remove(job)
            yield slot, job

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
            reuse = {s.seq: reused_cells(s.ledger, job.items) for s in unowned}
            # the most reuse; on a tie, the slot whose content is worth least
            best = max(unowned, key=lambda s: (reuse[s.seq], -s.num_cells))
            cached = self.states.best(job.items)
            if cached is not None and cached[1].num_cells > reuse[best.seq]:
                job.resume = cached[0]  # a conversation that lost its slot: put it back
                return min(unowned, key=lambda s: (reuse[s.seq], s.num_cells))
            return best
        if unowned:
            return min(unowned, key=lambda s: s.num_cells)
        idle = [s for s in free if s.owner is not None]
        return min(idle, key=lambda s: self.sessions.last_used(s.owner)) if idle else None  # type: ignore[arg-type]


def reused_cells(ledger: Ledger | None, items: Sequence[Item]) -> int:
    reuse = reuse_of(ledger, items)
    return reuse.num_cells if reuse is not None else 0
