"""Grammar work off the engine thread, under a budget per call.

llama.cpp follows a grammar as a set of parse stacks; an ambiguous grammar of a few KB makes
thousands of them, and one call over a large vocabulary then takes seconds or hours. Its C++
cannot be interrupted, and a grammar's cost cannot be known before it runs. So each call runs
on a worker thread while the engine thread waits at most the budget: past it, the request
ends (GrammarTooCostly) and the worker is retired: it finishes the call, frees what the call
used, and ends; a new worker takes the next requests' calls. The engine thread never waits
longer than the budget. While an owner (a tenant) has `max_stuck_per_owner` retired calls
running, or all together `max_stuck`, its new constrained requests are refused until one
finishes (`full`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from infer_service.events import ErrorKind, Problem, ProblemError, Reason

T = TypeVar("T")


class GrammarTooCostly(ProblemError):
    """Building or following the grammar took longer than the budget (RESOURCE_EXHAUSTED,
    naming the grammar: the request asked for it)."""

    def __init__(self, budget: float):
        super().__init__(
            Problem(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"the grammar took over {budget * 1000:.0f} ms for one step: it is too "
                "ambiguous to follow over this vocabulary (simplify it, or raise "
                "--max-grammar-ms)",
                Reason.GRAMMAR_TOO_COSTLY,
                retry_after=1.0,
                field="constraint.grammar",
            )
        )


class _Worker:
    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="grammar", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            task()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def task() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

        self._tasks.put(task)
        return future

    def retire(self, then: Callable[[], None]) -> None:
        """After the call under way: `then` (its frees), and the thread ends."""
        self._tasks.put(then)
        self._tasks.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class GrammarWorker:
    def __init__(self, *, max_stuck_per_owner: int = 2, max_stuck: int = 8) -> None:
        self.max_stuck_per_owner = max_stuck_per_owner
        self.max_stuck = max_stuck
        self._worker: _Worker | None = None
        self._stuck: list[tuple[_Worker, str]] = []  # retired workers still running, by owner

    def run(
        self, fn: Callable[[], T], budget: float, abandon: Callable[[], None], *, owner: str = ""
    ) -> T:
        """fn() on the worker; GrammarTooCostly when it takes longer than budget seconds (fn
        goes on there, then `abandon` frees what it used: the caller must not touch it).
        Engine thread only."""
        if self._worker is None:
            self._worker = _Worker()
        worker = self._worker
        future = worker.submit(fn)
        try:
            return future.result(timeout=budget)
        except TimeoutError:
            worker.retire(abandon)
            self._stuck.append((worker, owner))
            self._worker = None
            raise GrammarTooCostly(budget) from None

    def full(self, owner: str) -> bool:
        """As many of this owner's abandoned calls (or of all) are still running as may:
        refuse its new grammars for now (another tenant's are not held up by them)."""
        self._stuck = [(w, o) for w, o in self._stuck if w.alive]
        mine = sum(1 for _, o in self._stuck if o == owner)
        return mine >= self.max_stuck_per_owner or len(self._stuck) >= self.max_stuck

    @property
    def num_stuck(self) -> int:
        self._stuck = [(w, o) for w, o in self._stuck if w.alive]
        return len(self._stuck)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.retire(lambda: None)
            self._worker = None
