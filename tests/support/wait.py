"""Waiting on conditions, never on the clock: a test passes on a fast machine and a slow one.

The timeouts are generous bounds for a machine that is far slower than expected, not
calibrations: nothing waits for them unless the condition never comes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PATIENCE = 60.0  # seconds before a condition that never comes fails the test


def wait_until(
    predicate: Callable[[], T], *, timeout: float = PATIENCE, what: str = "", poll: float = 0.01
) -> T:
    """Poll predicate() until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'the condition'} did not hold within {timeout:.0f} s")
        time.sleep(poll)


def idle_stats(port: int):  # -> infer_pb2.EngineStats
    """The infer server's counters once it is idle: no slot busy and nothing queued.

    GetServerInfo is a snapshot made on the engine thread between steps, so a later call sees
    at least one more engine step: equal counters then mean nothing ran on.
    """
    from support.rpc import server_info

    def idle():  # -> the snapshot, when idle
        info = server_info(port)
        return info if (info.num_active, info.num_queued) == (0, 0) else None

    return wait_until(idle, what=f"infer on port {port} going idle").stats


def assert_nothing_runs_on(port: int) -> None:
    """Wait until the server is idle, then check that a further engine step decodes nothing."""
    from support.rpc import server_info

    before = idle_stats(port)
    after = server_info(port).stats
    assert (after.num_decodes, after.num_generated_tokens) == (
        before.num_decodes,
        before.num_generated_tokens,
    ), "the engine went on decoding while idle"
