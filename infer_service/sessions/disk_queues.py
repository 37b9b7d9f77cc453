"""Disk work in per-key order, different keys side by side (stdlib only).

A session's writes, reads and deletion must happen in the order they were asked for; another
session's must not wait behind them. Each key gets a queue: its work runs one item at a time,
in order, on a shared pool of threads. A key with nothing queued holds no thread and no memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


def run_unless_cancelled(future: Future[T], fn: Callable[[], T]) -> None:
    """Run fn for future's waiter, unless the waiter gave up first (cancelled it)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)


def resolve(future: Future[T], result: T | None = None, error: BaseException | None = None) -> bool:
    """Settle a future whose waiter may have given up on it (cancelled), or that is settled
    already: that is no error. Returns whether this call settled it."""
    if future.done():
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
    return True


class DiskQueues:
    """A queue of disk work per key, drained in order on a shared pool of threads."""

    def __init__(self, workers: int, name: str = "io"):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued: dict[str, deque[tuple[Callable[[], Any], Future[Any]]]] = {}

    def submit(self, key: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run fn(*args) after everything submitted for key before it (RuntimeError once
        shut down, as ThreadPoolExecutor)."""
        future: Future[T] = Future()
        with self._lock:
            queue = self._queued.get(key)
            idle = queue is None
            if queue is None:
                queue = self._queued[key] = deque()
            queue.append((partial(fn, *args), future))
            if idle:
                try:
                    self._pool.submit(self._drain, key)
                except RuntimeError:  # shut down: nothing of this key may run now
                    del self._queued[key]
                    raise
        return future

    def _drain(self, key: str) -> None:
        while True:
            with self._lock:
                queue = self._queued[key]
                if not queue:
                    del self._queued[key]  # (the next submit for key starts a new drain)
                    return
                fn, future = queue.popleft()
            run_unless_cancelled(future, fn)

    def shutdown(self) -> None:
        """Wait for what was submitted (every queue drains), then stop the threads."""
        self._pool.shutdown(wait=True)
