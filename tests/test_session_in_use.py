"""Two replicas' stores on one directory: a deletion because a session looks unused (expiry,
eviction, a sweep) goes ahead only if its files still say so when it runs, under the
session's lock: the generation the deleting replica holds, and no write or touch since the
cutoff but the deleting store's own."""

from __future__ import annotations

import os
import time
from pathlib import Path

from infer_service.sessions.store import SessionStore, Unused


def backdate(root: Path, session_id: str, when: float) -> None:
    for name in (f"{session_id}.session", f"{session_id}.turns"):
        if (root / name).exists():
            os.utime(root / name, (when, when))


def test_an_unused_deletion_keeps_what_another_replica_used_since(tmp_path: Path) -> None:
    a, b = SessionStore(tmp_path), SessionStore(tmp_path)
    cutoff = time.time() - 60  # unused: nobody wrote or touched it in the last minute

    # b's checkpoint of the same state: the generation a holds, the files written since
    g = a.save("same", {"t": 1}, b"")
    assert b.save("same", {"t": 1}, b"kv", expect=g, same_state=True) == g
    assert not a.delete("same", unused=Unused(cutoff, g))
    # the deleting store's own last write is nobody else's use, however recent
    assert b.delete("same", unused=Unused(cutoff, g))

    # b's turn begins: files last written long ago are touched, in use again
    g = a.save("old", {"t": 1}, b"")
    backdate(tmp_path, "old", time.time() - 3600)
    assert "old" in a.unused_since(cutoff)  # (the sweep's list, made before the touch)
    assert b.touch("old")
    assert "old" not in a.unused_since(cutoff)
    assert not a.delete("old", unused=Unused(cutoff))  # the sweep's (it holds no generation)
    assert not a.delete("old", unused=Unused(cutoff, g))
    # a touch before the cutoff is an old use: unused by all since
    assert a.delete("old", unused=Unused(time.time() + 60, g))
    assert not b.touch("old")  # (gone: nothing to touch)

    # a touch right after the deleting store's own write is not taken for that write
    g = a.save("quick", {"t": 1}, b"")
    assert b.touch("quick")
    assert not a.delete("quick", unused=Unused(cutoff, g))

    # a turn saved elsewhere: another generation, whatever the files' time
    g = a.save("turned", {"t": 1}, b"")
    b.append("turned", {"t": {"value": 2}}, expect=g)
    backdate(tmp_path, "turned", time.time() - 3600)
    assert not a.delete("turned", unused=Unused(time.time() + 60, g))
    assert a.load_header("turned")["t"] == 2
    # and the owner's own deletion asks nothing
    assert a.delete("turned") and a.generation("turned") is None
