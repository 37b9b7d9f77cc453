"""A step's plan, as the scheduler hands it to the executor: values, not calls.

The scheduler (infer_service/engine/scheduler.py) decides; the executor carries the plan out and
says what happened (`StepOutcome`); the output processor tells each request
(infer_service/engine/outputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from infer_service.events import Event, Problem
from infer_service.kv.ledger import Ledger
from infer_service.runner.job import Job
from infer_service.runner.slot import Slot


class SessionEntry(NamedTuple):
    """What a session's turn continues in its slot (the session manager's `enter`)."""

    ledger: Ledger
    start: int  # the segment where the turn's prompt starts (those before are the session's)
    reprefill: int | None  # the segment from which the sequence is decoded again (None: none)


@dataclass(frozen=True)
class SlotChoice:
    """A waiting job and the slot it starts in, with what it continues there."""

    slot: Slot
    job: Job
    resume: int | None = None  # (stateless) a host sequence to put back in the slot first
    entry: SessionEntry | None = None  # (a session's turn) its session's ledger, entered


@dataclass
class StepPlan:
    starts: list[SlotChoice] = field(default_factory=list)
    overdue: list[tuple[Slot, Problem]] = field(default_factory=list)  # running: cancelled, late
    # jobs that leave without a slot (cancelled or late in the queue; a session's turn that
    # could not enter its slot), each with its one event
    dropped: list[tuple[Job, Event]] = field(default_factory=list)
