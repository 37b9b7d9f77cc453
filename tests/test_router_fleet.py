"""The router's loads, unloads and waits (model_router/fleet.py) under random traffic: real
processes (a stand-in that prints `slotwise serve`'s ready line and waits: what the fleet
sees of a model's process is its start, its ready line, its signals and its end) and the real
Fleet, on an event loop of the test's own; hypothesis picks the requests, callers that leave,
unloads and crashes.

What must hold, whatever the order: a request holds a live process from its hand-over to its
release (never unloaded under it, but for the crash the test makes); no more models run than
--models-max; and once the traffic is over, nothing is left: no request in flight, no waiter,
no queue entry, every process accounted for.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_router.catalog import Catalog, ModelEntry
from model_router.child import Child, spawn
from model_router.fleet import Fleet, FleetConfig, RouterError, Status
from model_router.memory import Footprint

pytestmark = pytest.mark.timeout(600)

NAMES = ("a", "b", "c", "d")
# a model's process, as far as the fleet can tell: the ready line, then nothing until a signal
STAND_IN = (sys.executable, "-c", "import time; print('slotwise serve: prep on 127.0.0.1:1, "
            "infer on 127.0.0.1:2, HTTP API on 127.0.0.1:3 (stand-in)', flush=True); "
            "time.sleep(3600)")  # fmt: skip

# a step: (what, model index, ticks it lasts)
steps = st.lists(
    st.tuples(st.sampled_from(["use", "use", "use", "leave", "unload", "crash", "tick"]),
              st.integers(0, len(NAMES) - 1), st.integers(0, 3)),
    min_size=1, max_size=24,
)  # fmt: skip


class Traffic:
    def __init__(self, fleet: Fleet, models_max: int):
        self.fleet, self.models_max = fleet, models_max
        self.tick = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.children: list[Child] = []
        self.crashed: set[int] = set()  # pids the test killed
        self.violations: list[str] = []
        fleet.listen(self.on_event)

    def on_event(self, model: str, event: str, data: dict[str, object]) -> None:
        running = [i for i in self.fleet.instances.values()
                   if i.running or i.status is Status.LOADING]  # fmt: skip
        # (a stop under way still holds its process: the limit counts those that are not)
        active = [i for i in running if not i.stopping]
        if len(active) > self.models_max:
            self.violations.append(f"{len(active)} models running: {event} {model} {data}")

    async def use(self, name: str, ticks: int, leave: bool) -> None:
        try:
            inst = await asyncio.wait_for(self.fleet.acquire(name, True), 0.05 if leave else 60)
        except (TimeoutError, RouterError):
            return  # (a caller that left, or a model that failed: the request ends)
        child = inst.child
        try:
            for _ in range(ticks):
                await self.next_tick()
            if child is None:
                self.violations.append(f"{name}: handed over without a process")
            elif child.pid in self.crashed:
                pass  # (the test killed it: the request's answer would say so)
            elif inst.child is not child or child.process.returncode is not None:
                self.violations.append(f"{name}: its process was stopped under a request")
        finally:
            self.fleet.release(inst)

    async def next_tick(self) -> None:
        tick = self.tick
        await tick.wait()

    def advance(self) -> None:
        self.tick.set()
        self.tick = asyncio.Event()


async def _run(plan: list[tuple[str, int, int]], models_max: int) -> list[str]:
    entries = [ModelEntry(n, Path(f"/models/{n}.gguf"), stop_timeout=5) for n in NAMES]
    config = FleetConfig(models_max=models_max, wait_seconds=60, load_seconds=60)

    async def launch(entry: ModelEntry) -> Child:
        child = await spawn(entry.name, [], program=STAND_IN)
        traffic.children.append(child)
        return child

    fleet = Fleet(Catalog.of(entries), config, launch, lambda e: Footprint(1, 0, 0, 0))
    traffic = Traffic(fleet, models_max)
    for what, k, ticks in plan:
        name = NAMES[k]
        inst = fleet.instances[name]
        if what in ("use", "leave"):
            traffic.tasks.append(asyncio.ensure_future(traffic.use(name, ticks, what == "leave")))
        elif what == "unload" and inst.running and not inst.stopping:
            fleet.unload(name)
        elif what == "crash" and inst.child is not None and inst.child.process.returncode is None:
            traffic.crashed.add(inst.child.pid)
            inst.child.process.send_signal(signal.SIGKILL)
        await asyncio.sleep(0.01)  # (let the fleet act on it)
        traffic.advance()
    while not all(t.done() for t in traffic.tasks):
        traffic.advance()
        await asyncio.sleep(0.01)
    for t in traffic.tasks:
        t.result()
    await _settled(fleet)
    left = [f"{i.entry.name}: {i.in_flight} in flight" for i in fleet.instances.values()
            if i.in_flight]  # fmt: skip
    left += [f"{fleet.num_waiting} waiting"] if fleet.num_waiting else []
    left += [f"queued: {list(fleet._queue)}"] if fleet._queue else []
    running = {i.child.pid for i in fleet.instances.values() if i.child is not None}
    await fleet.close()
    for child in traffic.children:
        unaccounted = child.pid not in running and child.pid not in traffic.crashed
        if unaccounted and child.process.returncode is None:
            left.append(f"process {child.pid} of {child.name} left running")
    for child in traffic.children:
        if child.process.returncode is None:
            child.process.kill()
            await child.process.wait()
    return traffic.violations + left


async def _settled(fleet: Fleet) -> None:
    """Until no load or stop is under way (they end by themselves)."""
    for _ in range(3000):
        busy = [i for i in fleet.instances.values() if i.stopping or i.status is Status.LOADING]
        if not busy and not fleet._queue:
            return
        await asyncio.sleep(0.01)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=steps, models_max=st.integers(1, 3))
def test_the_fleet_keeps_its_promises_under_random_traffic(
    plan: list[tuple[str, int, int]], models_max: int
) -> None:
    problems = asyncio.run(_run(plan, models_max))
    assert not problems, problems


def test_a_request_waits_for_a_busy_model_rather_than_evicting_it() -> None:
    async def run() -> None:
        entries = [ModelEntry(n, Path(f"/models/{n}.gguf"), stop_timeout=5) for n in "ab"]

        async def launch(entry: ModelEntry) -> Child:
            return await spawn(entry.name, [], program=STAND_IN)

        fleet = Fleet(Catalog.of(entries), FleetConfig(models_max=1), launch,
                      lambda e: Footprint(1, 0, 0, 0))  # fmt: skip
        a = await fleet.acquire("a", True)
        b_wait = asyncio.ensure_future(fleet.acquire("b", True))
        for _ in range(50):  # (its chance to act wrongly: it never comes)
            await asyncio.sleep(0.01)
            assert not b_wait.done() and fleet.instances["b"].status is Status.UNLOADED
            assert a.child is not None and a.child.process.returncode is None
        fleet.release(a)
        b = await asyncio.wait_for(b_wait, 60)
        assert b.entry.name == "b" and fleet.instances["a"].status is Status.UNLOADED
        fleet.release(b)
        await fleet.close()

    asyncio.run(run())
