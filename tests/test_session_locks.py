"""The session store's locks between the threads of several processes: a process whose
threads wait for locks at once is never taken for one side of a deadlock (Linux checks for
deadlocks per process, and one process's waiting thread would make another's wait look like
a cycle), and a thread's lock holds against the others' of its own process too."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_session_journal import other_process_locks

from infer_service.sessions import store as session_store
from infer_service.sessions.store import Generation, SessionStore
from support.wait import wait_until

linux = pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks (Linux)")

# another replica's write of session "s": its stripe, then the pixels' lock (shared)
_WRITER = """
import sys
from pathlib import Path
from infer_service.sessions import store as session_store
if sys.argv[2] == "lockf":
    session_store._OFD_LOCKS = False
session_store.SessionStore(Path(sys.argv[1])).save("s", {"t": "there"}, b"")
"""


@pytest.fixture(params=["ofd", "lockf"])
def locks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Open file description locks (Linux), and POSIX record locks where there are none."""
    if request.param == "lockf":
        monkeypatch.setattr(session_store, "_OFD_LOCKS", False)
    elif not hasattr(fcntl, "F_OFD_SETLKW"):
        pytest.skip("no open file description locks here (Linux)")
    yield request.param


def waiters(lock: Path) -> int:
    """The lock requests /proc/locks shows waiting for the lock file."""
    inode = f":{lock.stat().st_ino} "
    return sum(" -> " in f" {line} " and inode in line for line in open("/proc/locks"))


def stripe(root: Path, session_id: str) -> Path:
    return root / ".locks" / f"{zlib.crc32(session_id.encode()) % 256}.lock"


@linux
def test_threads_of_two_processes_waiting_at_once_are_no_deadlock(
    tmp_path: Path, locks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Here pixel collection holds the pixels' lock; another process writes session "s": it
    holds its stripe and waits for the pixels. A thread here writes a session of the same
    stripe: it waits for the stripe. Per process, that is this process waiting for the other
    and the other for this one, a cycle, but no thread's wait is: once collection ends, both
    writes go through."""
    store = SessionStore(tmp_path)
    collecting, collected = threading.Event(), threading.Event()
    deadlocks = [0]  # the kernel's EDEADLK answers here (POSIX record locks)
    lockf = fcntl.lockf

    def counted_lockf(fd: int, cmd: int, *args: Any) -> Any:
        try:
            return lockf(fd, cmd, *args)
        except OSError as e:
            deadlocks[0] += e.errno == errno.EDEADLK
            raise

    monkeypatch.setattr(fcntl, "lockf", counted_lockf)

    def collect() -> None:
        with store.collecting_pixels():
            collecting.set()
            collected.wait(60)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    assert collecting.wait(30)
    pixels = tmp_path / ".locks" / "pixels.lock"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), locks],
        cwd=Path(__file__).parent.parent, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    neighbour = "n191"  # (another session of the stripe of "s")
    assert stripe(tmp_path, neighbour) == stripe(tmp_path, "s")
    written: list[Any] = []
    try:
        wait_until(lambda: waiters(pixels) == 1, what="the other process waiting for the pixels")
        assert stripe(tmp_path, "s").exists()  # (it holds the stripe: it waits past it)

        def write() -> None:
            try:
                written.append(store.save(neighbour, {"t": "here"}, b""))
            except OSError as e:  # EDEADLK: the kernel took the two processes for a cycle
                written.append(e)

        threading.Thread(target=write, daemon=True).start()
        wait_until(
            lambda: bool(written) or waiters(stripe(tmp_path, "s")) > 0 or deadlocks[0] > 0,
            what="the write here waiting for the stripe",
        )
    finally:
        collected.set()
    collector.join(30)
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    wait_until(lambda: bool(written), what="the write here")
    assert [type(w) for w in written] == [Generation], written
    # (record locks: the kernel did say EDEADLK here, and it was waited out)
    assert (deadlocks[0] > 0) == (locks == "lockf")
    assert store.load_header("s")["t"] == "there" and store.load_header(neighbour)["t"] == "here"


def test_a_thread_s_lock_holds_against_this_process_s_other_threads(
    tmp_path: Path, locks: str
) -> None:
    """Two threads of one process taking one session's lock take turns; a descriptor of the
    lock file that another part of this process opens and closes drops nobody's lock."""
    store = SessionStore(tmp_path)
    lock = stripe(tmp_path, "s")
    holding, release = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        with store._session_lock("s"):
            order.append("first")
            holding.set()
            release.wait(60)
            order.append("first done")

    def wait() -> None:
        with store._session_lock("s"):
            order.append("second")

    first = threading.Thread(target=hold, daemon=True)
    first.start()
    assert holding.wait(30)
    second = threading.Thread(target=wait, daemon=True)
    second.start()
    try:
        second.join(0.3)
        assert order == ["first"]  # the second thread waits
        if locks == "ofd":  # (POSIX record locks are the process's: any close drops them)
            os.close(os.open(lock, os.O_RDWR))
        assert not other_process_locks(lock)  # still held, for other processes too
        assert order == ["first"]
    finally:
        release.set()
    first.join(30)
    second.join(30)
    assert order == ["first", "first done", "second"]
    assert other_process_locks(lock)  # and let go
