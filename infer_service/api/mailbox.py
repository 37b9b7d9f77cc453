"""A stream's events on their way from the engine thread to its handler on the event loop.

A `Mailbox` is what a job carries: the engine posts a step's events to it at once (from its
thread), its handler reads them on the loop, bounded however slowly its client reads. The
loop's `EventRelay` hands every mailbox's posts to the loop in one wake-up.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Sequence

from infer_service.events import ContextShift, Event, TokenDelta


class Mailbox:
    """One stream's events on the event loop, bounded however slowly its client reads: token
    deltas that pile up merge into one; past MAX_EVENTS, runs of deltas and shifts fold into
    one shift (their totals) and one delta, so a stalled reader costs one message's worth."""

    MAX_EVENTS = 256

    def __init__(self, relay: EventRelay) -> None:
        self._relay = relay
        self._events: deque[Event] = deque()
        self._ready = asyncio.Event()

    def post(self, events: Sequence[Event]) -> None:
        """(Any thread) events for the reader, in order."""
        self._relay.send(self, events)

    def put(self, event: Event) -> None:
        """(On the loop)"""
        last = self._events[-1] if self._events else None
        if isinstance(event, TokenDelta) and isinstance(last, TokenDelta):
            self._events[-1] = last.merged(event)
        else:
            self._events.append(event)
            if len(self._events) > self.MAX_EVENTS:
                self._events = deque(_folded(self._events))
        self._ready.set()

    async def get(self) -> Event:
        while not self._events:
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()

    def __len__(self) -> int:
        return len(self._events)


def _folded(events: deque[Event]) -> list[Event]:
    out: list[Event] = []
    shift: ContextShift | None = None
    delta: TokenDelta | None = None
    for e in [*events, None]:
        if isinstance(e, TokenDelta):
            delta = delta.merged(e) if delta else e
            continue
        if isinstance(e, ContextShift):
            shift = shift.folded(e) if shift else e
            continue
        out.extend(x for x in (shift, delta) if x is not None)
        shift = delta = None
        if e is not None:
            out.append(e)
    return out


class EventRelay:
    """Events from the engine thread to the handlers' mailboxes on one event loop.

    What the engine posts while a hand-off is pending rides along with it: one loop wake-up
    (a self-pipe write) per step, whatever the streams.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Mailbox, Sequence[Event]]] = []

    def send(self, mailbox: Mailbox, events: Sequence[Event]) -> None:
        with self._lock:
            self._items.append((mailbox, events))
            if len(self._items) > 1:
                return  # a delivery is already on its way
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            with self._lock:
                self._items.clear()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for mailbox, events in items:
            for event in events:
                mailbox.put(event)
