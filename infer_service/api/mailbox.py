"""A stream's events on its way from the engine thread to its handler on the event loop.

`EventRelay` hands a batch of events to the loop in one wake-up; `Mailbox` holds one stream's
events there, bounded however slowly its client reads.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from infer_service.events import ContextShift, Event, TokenDelta


class Mailbox:
    """One stream's events on the event loop, bounded however slowly its client reads: token
    deltas that pile up merge into one; past MAX_EVENTS, runs of deltas and shifts fold into
    one shift (their totals) and one delta, so a stalled reader costs one message's worth."""

    MAX_EVENTS = 256

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self._ready = asyncio.Event()

    def put(self, event: Event) -> None:
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

    What the engine emits while a hand-off is pending rides along with it: one loop wake-up
    (a self-pipe write) per batch of events instead of one per token and stream.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Mailbox, Event]] = []

    def send(self, mailbox: Mailbox, event: Event) -> None:
        with self._lock:
            self._items.append((mailbox, event))
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
        for mailbox, event in items:
            mailbox.put(event)
