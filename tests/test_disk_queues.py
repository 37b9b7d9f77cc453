"""DiskQueues (infer_service/sessions/disk_queues.py): a key's work in order, other keys'
beside it."""

from __future__ import annotations

import threading

import pytest

from infer_service.sessions.disk_queues import DiskQueues


def test_a_key_s_work_runs_in_order_and_another_key_does_not_wait_behind_it() -> None:
    queues = DiskQueues(2)
    gate = threading.Event()
    done: list[tuple[str, int]] = []
    first = queues.submit("a", gate.wait, 60)
    queued = [queues.submit("a", done.append, ("a", k)) for k in range(50)]
    queues.submit("b", done.append, ("b", 0)).result(60)  # while a's first item waits
    assert done == [("b", 0)] and not first.done()
    gate.set()
    for f in queued:
        f.result(60)
    assert [k for key, k in done if key == "a"] == list(range(50))
    failed = queues.submit("a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(60)
    assert queues.submit("a", lambda: "after").result(60) == "after"  # a failure stops nothing
    queues.shutdown()
    with pytest.raises(RuntimeError):
        queues.submit("c", print)
