"""The loaded models and the requests waiting for one: which model loads, which is unloaded for
it, and when.

A model with a request in flight is never unloaded: at the limit (`--models-max`, or the memory
budget) the least recently used model *with nothing in flight* makes room; when every loaded
model is busy, the request for another waits, first come first served, one entry per model
however many requests want it (one load, one eviction). A request that leaves while it waits
takes its place in the queue with it. All on the router's event loop: a model's state changes
only there, so no lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from model_router.catalog import Catalog, ModelEntry
from model_router.child import Child, LoadFailed
from model_router.memory import Footprint, fmt_bytes

log = logging.getLogger("slotwise.router")

# llama-server's test aid (its router tests rely on it): a load and each proxied request take
# 2 s more, so that a model is seen busy; never set outside tests
FAKE_TIMING = bool(os.environ.get("LLAMA_SERVER_DEBUG_FAKE_TIMING"))
FAKE_SECONDS = 2.0


class Status(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"


class RouterError(Exception):
    """A request the router answers itself: `status` its HTTP status."""

    def __init__(self, status: int, message: str, retry_after: float | None = None,
                 type: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.retry_after, self.type = status, message, retry_after, type


@dataclass
class Instance:
    entry: ModelEntry
    status: Status = Status.UNLOADED
    child: Child | None = None
    in_flight: int = 0
    last_used: float = 0.0
    failure: LoadFailed | None = None  # the last load or run that failed, until one succeeds
    loading: _Want | None = None  # while loading: the requests it is loaded for
    stopping: bool = False  # an unload under way (its memory is still held)
    estimate: Footprint | None = None
    held_bytes: int = 0  # what it holds, measured once loaded (else the estimate)
    watcher: asyncio.Task[None] | None = None
    removed: bool = False  # gone from the folder or preset (listed until its process is)

    @property
    def running(self) -> bool:
        return self.child is not None


@dataclass
class _Want:
    """A model wanted and not loaded: its waiting requests (and an explicit load's)."""

    name: str
    waiters: set[asyncio.Future[Instance]] = field(default_factory=set)
    explicit: bool = False  # POST /models/load: wanted whoever waits


@dataclass(frozen=True)
class FleetConfig:
    models_max: int = 4  # loaded (and loading) at once; 0: no limit
    memory_budget: int | None = None  # bytes for all loaded models; None: no check
    queue_max: int = 64  # requests waiting for a model; beyond: 503 with Retry-After
    tenant_queue_max: int = 16  # of them, one tenant's (a keys file's)
    wait_seconds: float = 600.0  # longest a request waits for its model (503 beyond)
    sleep_idle_seconds: float | None = None  # unload a model idle this long (status sleeping)
    load_seconds: float = 600.0  # a model not ready this long after its process started: failed


Launch = Callable[[ModelEntry], Awaitable[Child]]
Listener = Callable[[str, str, dict[str, object]], None]


class Fleet:
    def __init__(self, catalog: Catalog, config: FleetConfig, launch: Launch,
                 estimate: Callable[[ModelEntry], Footprint]):  # fmt: skip
        self.catalog, self.config = catalog, config
        self._launch, self._estimate = launch, estimate
        self.instances = {e.name: Instance(e) for e in catalog.entries}
        self._queue: dict[str, _Want] = {}  # in arrival order
        self._listeners: set[Listener] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle_task: asyncio.Task[None] | None = None
        self.num_waiting = 0
        self._waiting_by_tenant: dict[str, int] = {}

    # -- what callers see

    def resolve(self, name: str) -> Instance:
        entry = self.catalog.find(name)
        if entry is None or entry.name not in self.instances:
            known = ", ".join(sorted(self.instances)) or "none"
            raise RouterError(404, f"model {name!r} not found; the models here: {known}")
        return self.instances[entry.name]

    def listen(self, listener: Listener) -> Callable[[], None]:
        self._listeners.add(listener)
        return lambda: self._listeners.discard(listener)

    def _event(self, name: str, event: str, data: dict[str, object]) -> None:
        for listener in list(self._listeners):
            listener(name, event, data)

    def _set(self, inst: Instance, status: Status, **data: object) -> None:
        inst.status = status
        self._event(inst.entry.name, "model_status", {"status": status.value, **data})

    async def acquire(
        self, name: str, autoload: bool, touch: bool = True, tenant: str | None = None
    ) -> Instance:
        """The model, loaded (loading it first where autoload), with one more request counted
        in flight on it until `release`. touch=False: a look that does not count as use (the
        model's idle time goes on). tenant: whose request (a keys file's), for its share of
        the queue."""
        inst = self.resolve(name)
        if inst.status is Status.LOADED and not inst.stopping:
            inst.in_flight += 1
            if touch:
                inst.last_used = time.monotonic()
            return inst
        if not autoload and inst.status is not Status.LOADING:
            raise RouterError(400, f"model {inst.entry.name!r} is not loaded (autoload is off)")
        if inst.entry.problem:
            raise RouterError(503, inst.entry.problem, type="unavailable_error")
        return await self._wait_for(inst, tenant)

    def _refuse_if_queue_full(self, tenant: str | None) -> None:
        """At most queue_max requests wait, and at most tenant_queue_max of one tenant's (one
        tenant's flood of requests for models not loaded cannot fill the queue for others)."""
        if self.num_waiting >= self.config.queue_max:
            raise RouterError(503, f"{self.num_waiting} requests already wait for a model",
                              retry_after=5, type="unavailable_error")  # fmt: skip
        mine = self._waiting_by_tenant.get(tenant, 0) if tenant is not None else 0
        if tenant is not None and mine >= self.config.tenant_queue_max:
            raise RouterError(503, f"tenant {tenant!r} already has {mine} requests waiting for a "
                              "model (--models-queue-per-tenant)", retry_after=5,
                              type="unavailable_error")  # fmt: skip

    def release(self, inst: Instance, touch: bool = True) -> None:
        inst.in_flight -= 1
        if touch:
            inst.last_used = time.monotonic()
        self._pump()

    async def _wait_for(self, inst: Instance, tenant: str | None = None) -> Instance:
        """Until the model is loaded and handed to this request (counted in flight as it is
        handed over: nothing can unload it between its load and the request)."""
        want = inst.loading  # (a load under way: this request joins it)
        if want is None:
            self._refuse_if_never_fits(inst.entry)
        self._refuse_if_queue_full(tenant)
        if want is None:
            want = self._queue.setdefault(inst.entry.name, _Want(inst.entry.name))
        waiter: asyncio.Future[Instance] = asyncio.get_running_loop().create_future()
        want.waiters.add(waiter)
        self.num_waiting += 1
        if tenant is not None:
            self._waiting_by_tenant[tenant] = self._waiting_by_tenant.get(tenant, 0) + 1
        try:
            self._pump()
            return await _within(waiter, time.monotonic() + self.config.wait_seconds, inst)
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # handed over as the caller left
            raise
        finally:
            self.num_waiting -= 1
            if tenant is not None:
                left = self._waiting_by_tenant.pop(tenant) - 1
                if left:
                    self._waiting_by_tenant[tenant] = left
            want.waiters.discard(waiter)
            if not want.waiters and not want.explicit and self._queue.get(want.name) is want:
                del self._queue[want.name]  # nobody waits: its place goes
                self._pump()

    def load(self, name: str) -> None:
        """POST /models/load: queued as a request would be, without one waiting."""
        inst = self.resolve(name)
        if inst.entry.problem:
            raise RouterError(400, inst.entry.problem)
        self._refuse_if_never_fits(inst.entry)
        if inst.running or inst.status is Status.LOADING:
            raise RouterError(400, f"model {inst.entry.name!r} is already running")
        self._queue.setdefault(inst.entry.name, _Want(inst.entry.name)).explicit = True
        self._pump()

    def unload(self, name: str, status: Status = Status.UNLOADED) -> None:
        """Stop its process, after the requests in flight (they finish first)."""
        inst = self.resolve(name)
        if not inst.running or inst.stopping:
            raise RouterError(400, f"model {inst.entry.name!r} is not running")
        self._begin_stop(inst, status)

    # -- the queue

    def _pump(self) -> None:
        """Serve the queue's first entry if it can be: load it where there is room, else make
        room by unloading the least recently used idle model; else it waits (so does every
        entry behind it: first come, first served)."""
        while self._queue:
            want = next(iter(self._queue.values()))
            inst = self.instances.get(want.name)
            if inst is None or inst.removed:
                self._queue.pop(want.name)
                continue
            if inst.stopping:
                return  # it loads again once it is gone
            if inst.status is Status.LOADED:
                self._hand_over(inst, self._queue.pop(want.name))
                continue
            if self._has_room(inst):
                self._queue.pop(want.name)
                self._start_load(inst, want)
                continue
            if any(i.stopping and i.in_flight == 0 for i in self.instances.values()):
                return  # room is on its way: decide again when it is made
            victim = self._victim(inst)
            if victim is not None:
                log.info("unloading %s (idle longest) for %s", victim.entry.name, want.name)
                self._begin_stop(victim, Status.UNLOADED)
            return

    def _has_room(self, inst: Instance) -> bool:
        running = [i for i in self.instances.values() if i.running or i.status is Status.LOADING]
        if self.config.models_max and len(running) >= self.config.models_max:
            return False
        if self.config.memory_budget is None:
            return True
        held = sum(i.held_bytes for i in running)
        return held + self.footprint(inst.entry).total <= self.config.memory_budget

    def _victim(self, wanted: Instance) -> Instance | None:
        idle = [
            i for i in self.instances.values()
            if i.status is Status.LOADED and not i.stopping and i.in_flight == 0
            and i is not wanted and i.entry.name not in self._queue
        ]  # fmt: skip
        return min(idle, key=lambda i: i.last_used, default=None)

    def _hand_over(self, inst: Instance, want: _Want) -> None:
        inst.last_used = time.monotonic()
        for w in want.waiters:
            if not w.done():
                inst.in_flight += 1
                w.set_result(inst)

    def footprint(self, entry: ModelEntry) -> Footprint:
        inst = self.instances[entry.name]
        if inst.estimate is None:
            inst.estimate = self._estimate(entry)
        return inst.estimate

    def _refuse_if_never_fits(self, entry: ModelEntry) -> None:
        budget = self.config.memory_budget
        if budget is None:
            return
        need = self.footprint(entry)
        if need.total > budget:
            raise RouterError(
                507, f"model {entry.name!r} needs about {need.describe()}, more than the "
                f"memory budget of {fmt_bytes(budget)} (--models-memory) holds",
                type="insufficient_storage",
            )  # fmt: skip

    # -- loads and unloads

    def _start_load(self, inst: Instance, want: _Want) -> None:
        inst.loading, inst.failure = want, None
        inst.held_bytes = self.footprint(inst.entry).total
        self._set(inst, Status.LOADING)
        self._spawn(self._load(inst, want))

    async def _load(self, inst: Instance, want: _Want) -> None:
        t0 = time.monotonic()
        try:
            if FAKE_TIMING:
                await asyncio.sleep(FAKE_SECONDS)
            child = await asyncio.wait_for(self._launch(inst.entry), self.config.load_seconds)
        except TimeoutError:
            said = (
                f"not ready {self.config.load_seconds:g} s after it started (--models-load-seconds)"
            )
            inst.failure, inst.held_bytes = LoadFailed(said, None), 0
            self._set(inst, Status.UNLOADED, failed=True, reason=said)
        except LoadFailed as e:
            log.warning("%s failed to load (exit %s): %s", inst.entry.name, e.exit_code, e.reason)
            inst.failure, inst.held_bytes = e, 0
            self._set(inst, Status.UNLOADED, failed=True, exit_code=e.exit_code, reason=e.reason)
        except Exception as e:  # (spawning itself failed: no python, no memory for a process)
            inst.failure, inst.held_bytes = LoadFailed(f"{type(e).__name__}: {e}", None), 0
            self._set(inst, Status.UNLOADED, failed=True, reason=str(e))
        else:
            inst.child = child
            inst.held_bytes = max(child.resident_bytes() or 0, inst.held_bytes)
            inst.last_used = time.monotonic()
            inst.watcher = asyncio.ensure_future(self._watch(inst, child))
            self._set(inst, Status.LOADED, seconds=round(time.monotonic() - t0, 3))
            if inst.removed:
                self._begin_stop(inst, Status.UNLOADED)
        finally:
            inst.loading = None
            if inst.removed and not inst.running:
                self.instances.pop(inst.entry.name, None)
            if inst.status is Status.LOADED:
                self._hand_over(inst, want)
            else:
                for w in want.waiters:
                    if not w.done():
                        w.set_exception(_unavailable(inst))
            self._pump()

    async def _watch(self, inst: Instance, child: Child) -> None:
        """Its process ended by itself (an abort, a kill): the model is unloaded, failed."""
        code = await child.process.wait()
        if inst.child is not child or inst.stopping:
            return
        for r in child.readers:
            await r
        reason = child.reason()
        log.warning("%s: its process ended (exit %s): %s", inst.entry.name, code, reason)
        inst.child, inst.failure, inst.held_bytes = None, LoadFailed(reason, code), 0
        self._set(inst, Status.UNLOADED, failed=True, exit_code=code, reason=reason)
        self._pump()

    def _begin_stop(self, inst: Instance, status: Status) -> None:
        inst.stopping = True  # (now: the next decision counts its room as coming)
        self._spawn(self._stop(inst, status))

    async def _stop(self, inst: Instance, status: Status) -> None:
        child = inst.child
        assert child is not None
        try:
            while inst.in_flight:  # (an explicit unload waits for them; eviction never starts)
                await asyncio.sleep(0.05)
            await child.stop(inst.entry.stop_timeout)
        finally:
            inst.child, inst.stopping, inst.held_bytes = None, False, 0
            self._set(inst, status)
            if inst.removed:  # (gone from a reload)
                self.instances.pop(inst.entry.name, None)
            self._pump()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reload(self, catalog: Catalog) -> None:
        """GET /models?reload=1: the folder and preset read again. A model gone from them or
        changed is unloaded if it runs (after its requests in flight); one added is listed."""
        self.catalog = catalog
        now = {e.name: e for e in catalog.entries}
        for name, inst in list(self.instances.items()):
            if now.get(name) == inst.entry:
                inst.entry = now[name]
                continue
            if name in now:  # changed: its process, if any, goes; the next load is the new one
                inst.entry, inst.estimate = now[name], None
            else:
                inst.removed = True
                want = self._queue.pop(name, None)
                for w in want.waiters if want else ():
                    if not w.done():
                        w.set_exception(RouterError(404, f"model {name!r} was removed"))
            if inst.running and not inst.stopping:
                self._begin_stop(inst, Status.UNLOADED)
            elif inst.removed and inst.status is not Status.LOADING and not inst.running:
                del self.instances[name]
        for name, entry in now.items():
            self.instances.setdefault(name, Instance(entry))
        self._event("*", "models_reload", {})

    # -- idle and lifetime

    def start(self) -> None:
        self._spawn(self._estimate_all())
        for inst in self.instances.values():
            if inst.entry.load_on_startup and not inst.entry.problem:
                self.load(inst.entry.name)
        if self.config.sleep_idle_seconds is not None:
            self._idle_task = asyncio.ensure_future(
                self._sleep_idle(self.config.sleep_idle_seconds)
            )

    async def _estimate_all(self) -> None:
        """Each model's footprint read from its headers, off the event loop (a large file on a
        slow disk takes a while); one asked for before its turn is read then, on the loop."""
        for inst in list(self.instances.values()):
            entry = inst.entry
            if inst.estimate is None and entry.model is not None:
                estimate = await asyncio.to_thread(self._estimate, entry)
                if inst.entry is entry and inst.estimate is None:  # (not replaced meanwhile)
                    inst.estimate = estimate

    async def _sleep_idle(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(min(1.0, seconds / 4))
            now = time.monotonic()
            for inst in self.instances.values():
                idle = inst.status is Status.LOADED and not inst.stopping and inst.in_flight == 0
                if idle and now - inst.last_used >= seconds and inst.entry.name not in self._queue:
                    log.info("%s: idle %.0fs, sleeping", inst.entry.name, now - inst.last_used)
                    self._begin_stop(inst, Status.SLEEPING)

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        for want in self._queue.values():
            for w in want.waiters:
                if not w.done():
                    w.set_exception(RouterError(503, "the router is stopping", retry_after=1,
                                                type="unavailable_error"))  # fmt: skip
        self._queue.clear()
        await asyncio.gather(*(i.child.stop(i.entry.stop_timeout)
                               for i in self.instances.values() if i.child))  # fmt: skip
        for task in list(self._tasks):
            task.cancel()


async def _within(fut: Awaitable[Instance], deadline: float, inst: Instance) -> Instance:
    try:
        return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        said = f"model {inst.entry.name!r} was not ready in time: every loaded model was busy"
        raise RouterError(503, said, retry_after=5, type="unavailable_error") from None


def _unavailable(inst: Instance) -> RouterError:
    f = inst.failure or LoadFailed("its load was cancelled (the router is stopping)", None)
    code = f" (exit code {f.exit_code})" if f.exit_code is not None else ""
    return RouterError(503, f"model {inst.entry.name!r} failed to load{code}: {f.reason}",
                       type="unavailable_error")  # fmt: skip
