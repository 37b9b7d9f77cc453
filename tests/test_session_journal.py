"""A session turn writes what it added (a journal entry), the KV state is a checkpoint made
when one is due, and a session whose checkpoint is older than its journal comes back with
every completed turn: its checkpoint loaded, only the segments after what the two share
decoded again, and the cells llama.cpp then holds exactly the ledger's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oracle import KvProbe, segment_cells

from clients.client import Constraint, Message, SlotwiseClient, collect
from infer_service.__main__ import start
from infer_service.runner.runtime import RuntimeConfig
from infer_service.sessions.store import (
    MAX_JOURNAL_ENTRIES,
    Generation,
    SessionStore,
    StaleSessionError,
)
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.media import image_bytes
from support.wait import wait_until

# -- the store ------------------------------------------------------------------------------------


def test_the_journal_follows_its_checkpoint_and_survives_a_torn_append(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    g1 = store.save("s", {"a": 1, "records": []}, b"kv")
    g2, n = store.append("s", {"a": {"value": 2}}, expect=g1)
    g3, _ = store.append("s", {"records": {"records": {"drop": 0, "add": ["r"]}}}, expect=g2)
    assert n < 200 and store.generation("s") == g3 == Generation(g1.lineage, 3)
    saved = store.load("s")
    assert (saved.header["a"], saved.header["records"], saved.header["journal"]) == (2, ["r"], 2)
    assert saved.kv_state == b"kv" and saved.kv_ledger == []
    with pytest.raises(StaleSessionError):  # a replica holding an older generation
        store.append("s", {"a": {"value": 9}}, expect=g2)

    # a crash mid-append: the torn entry is not the session's, and the next append cuts it off
    journal = tmp_path / "s.turns"
    whole = journal.read_bytes()
    with open(journal, "ab") as f:
        f.write(whole[: len(whole) // 3])
    assert store.generation("s") == g3 and store.load_header("s")["a"] == 2
    g4, _ = store.append("s", {"a": {"value": 4}}, expect=g3)
    assert store.load_header("s")["a"] == 4 and store.generation("s") == g4

    # a checkpoint folds the journal in; entries an older checkpoint left (a crash between the
    # rename and the removal) are skipped
    stale = journal.read_bytes()
    g5 = store.save("s", {"a": 5, "records": ["r"]}, b"kv5", expect=g4)
    assert not journal.exists() and g5.number == 5
    journal.write_bytes(stale)
    assert store.generation("s") == g5 and store.load_header("s")["a"] == 5
    g6, _ = store.append("s", {"a": {"value": 6}}, expect=g5)
    assert store.load_header("s")["a"] == 6 and g6.number == 6
    assert store.delete("s") and not journal.exists() and store.generation("s") is None


# -- a server -------------------------------------------------------------------------------------


@pytest.fixture
def serve(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Callable[..., Any]]:
    running: list[Any] = []

    def serve_(sessions: Path, **config: Any) -> Any:
        pair = tiny["mrope"]
        config = {"ctx_size": 2048, "parallel": 2, "threads": 1, **config}
        server = loop_thread.run(start(RuntimeConfig(pair.model, pair.mmproj, **config),
                                       sessions_dir=sessions))  # fmt: skip
        running.append(server)
        return server

    yield serve_
    for server in running:
        loop_thread.run(server.stop(0))


def turn(client: SlotwiseClient, k: int, **options: Any) -> Any:
    prepared = client.prepare([Message.user(image_bytes(40, 32, seed=k), f"turn {k}, please?")])
    done = collect(client.generate(prepared, session_id="chat", max_tokens=6, temperature=0,
                                   **options))  # fmt: skip
    assert done.finished is not None and not done.finished.error, done.finished
    return done


def clients(prep_port: int, *servers: Any) -> list[SlotwiseClient]:
    return [SlotwiseClient(f"127.0.0.1:{prep_port}", f"127.0.0.1:{s.port}") for s in servers]


def test_a_turn_writes_what_it_added_and_a_session_between_checkpoints_comes_back_exact(
    serve: Callable[..., Any], prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    a = serve(live)
    (ca,) = clients(prep_servers("mrope"), a)
    ca.create_session("chat")
    for k in range(2):
        turn(ca, k)
    ca.save_session("chat")  # a checkpoint: the KV state of two turns
    checkpoint = (live / "chat.session").stat().st_size
    sizes = []
    for k in range(2, 6):  # turns the journal alone holds
        before = a.engine.sessions.bytes_written
        turn(ca, k)
        sizes.append(a.engine.sessions.bytes_written - before)
    assert (live / "chat.session").stat().st_size == checkpoint
    # each turn costs its own bytes (its image's pixels aside), not the conversation's
    assert max(sizes) < checkpoint // 4 and max(sizes) < 2 * min(sizes), sizes

    # what a kill -9 now leaves: the files as they are (every write is fsynced)
    shutil.copytree(live, crashed)
    b = serve(crashed)
    (cb,) = clients(prep_servers("mrope"), b)
    was, now = ca.get_session("chat", num_records=4), cb.get_session("chat", num_records=4)
    assert (now.num_turns, now.num_cells, now.next_position) == (
        6, was.num_cells, was.next_position
    )  # fmt: skip
    assert [r.text for r in now.records] == [r.text for r in was.records]

    # the next turn: the checkpoint loads, the 4 journaled turns are decoded again, nothing
    # else; the same reply as on the replica that never stopped
    ra, rb = turn(ca, 6), turn(cb, 6)
    assert rb.token_ids == ra.token_ids
    stats = b.engine.stats
    assert stats.num_session_reprefills == 1
    assert 0 < stats.num_session_reprefill_cells < now.num_cells - 20

    # the cells llama.cpp holds are the ledger's, position and token
    def cells() -> tuple[Any, Any, Any]:
        (slot,) = [s for s in b.engine.slots if s.owner == "chat"]
        free = next(s.seq for s in b.engine.slots if s.seq != slot.seq)
        probe = KvProbe(b.engine.runtime, free)
        # calibrated on the free sequence (the layout is the same); its header names the seq
        probe.seq, probe.header = slot.seq, probe.header[:4] + slot.seq.to_bytes(4, "little")
        want = [segment_cells(seg, b.engine.runtime.uses_mrope) for seg in slot.ledger.segments]
        return (
            probe.cells(),
            np.concatenate([w[0] for w in want]),
            np.concatenate([w[1] for w in want]),
        )

    (got_pos, got_tok), want_pos, want_tok = b.engine.call(cells).result(30)
    assert got_tok is not None
    got, want = np.lexsort((got_tok, got_pos)), np.lexsort((want_tok, want_pos))
    assert np.array_equal(got_pos[got], want_pos[want])
    assert np.array_equal(got_tok[got], want_tok[want])
    for c in (ca, cb):
        c.close()


def test_a_clean_stop_checkpoints_and_the_next_start_decodes_nothing_again(
    serve: Callable[..., Any], prep_servers: Callable[[str], int], tmp_path: Path, loop_thread
) -> None:
    a = serve(tmp_path)
    (ca,) = clients(prep_servers("mrope"), a)
    ca.create_session("chat")
    for k in range(3):
        turn(ca, k)
    assert (tmp_path / "chat.turns").exists()
    ca.close()
    loop_thread.run(a.stop(5))
    assert not (tmp_path / "chat.turns").exists()  # folded into the checkpoint as it stopped
    b = serve(tmp_path)
    (cb,) = clients(prep_servers("mrope"), b)
    assert cb.get_session("chat").num_turns == 3
    turn(cb, 3)
    assert b.engine.stats.num_session_reprefills == 0
    cb.close()


def test_a_session_idle_in_its_slot_is_checkpointed(
    serve: Callable[..., Any], prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    a = serve(tmp_path)
    a.engine.sessions.idle_checkpoint_seconds = 0.5
    (ca,) = clients(prep_servers("mrope"), a)
    ca.create_session("chat")
    turn(ca, 0)
    # nothing else happens: the engine wakes by itself when the checkpoint is due
    wait_until(lambda: not (tmp_path / "chat.turns").exists(), what="the idle checkpoint")
    assert SessionStore(tmp_path).load("chat").kv_state
    ca.close()


def test_a_swap_in_whose_pixels_are_on_a_slow_disk_does_not_stall_another_stream(
    serve: Callable[..., Any], prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    live, copy = tmp_path / "live", tmp_path / "copy"
    a = serve(live)
    (ca,) = clients(prep_servers("mrope"), a)
    ca.create_session("chat")
    turn(ca, 0)  # its image is in the journal only: a swap-in reads its pixels
    shutil.copytree(live, copy)
    b = serve(copy)
    (cb,) = clients(prep_servers("mrope"), b)
    store = b.engine.sessions.store
    reading, release = threading.Event(), threading.Event()
    load_media = store.load_media

    def slow_load_media(*args: Any) -> bytes:  # a disk that answers when the test says so
        reading.set()
        release.wait(60)
        return load_media(*args)

    store.load_media = slow_load_media
    seen = [0]
    stop = threading.Event()

    def other() -> None:
        endless = Constraint(grammar='root ::= "a" root')  # no end: runs until it is stopped
        for event in cb.generate("Say a", constraint=endless, max_tokens=1 << 20):
            seen[0] += len(getattr(event, "token_ids", ()))
            if stop.is_set():
                break

    reader = threading.Thread(target=other, daemon=True)
    reader.start()
    wait_until(lambda: seen[0] > 0, what="the other stream's first token")
    turned: list[Any] = []
    session_turn = threading.Thread(target=lambda: turned.append(turn(cb, 1)), daemon=True)
    session_turn.start()
    assert reading.wait(60), "the swap-in never read the pixels"
    before = seen[0]
    wait_until(lambda: seen[0] >= before + 8, what="the other stream's tokens during the read")
    assert not turned  # the turn waits for its read; the engine does not
    release.set()
    session_turn.join(60)
    assert turned and turned[0].finished is not None
    stop.set()
    reader.join(60)
    for c in (ca, cb):
        c.close()


def test_entries_of_another_lineage_are_cut_off_by_the_next_append(tmp_path: Path) -> None:
    """A journal left by a session deleted mid-way (its checkpoint gone first), then a new
    session of that id whose first checkpoint crashed before removing it: the new session's
    appends go where it reads them."""
    store = SessionStore(tmp_path)
    old = store.save("s", {"t": "old", "records": []}, b"")
    for k in range(3):
        old, _ = store.append("s", {"t": {"value": f"old {k}"}}, expect=old)
    orphan = (tmp_path / "s.turns").read_bytes()
    (tmp_path / "s.session").unlink()
    new = store.save("s", {"t": "new", "records": []}, b"")
    (tmp_path / "s.turns").write_bytes(orphan)  # (what the crash left)
    assert store.load_header("s")["t"] == "new" and store.generation("s") == new
    g, _ = store.append("s", {"t": {"value": "new 1"}}, expect=new)
    assert store.generation("s") == g and store.load_header("s")["t"] == "new 1"
    g, _ = store.append("s", {"t": {"value": "new 2"}}, expect=g)
    assert store.load_header("s")["t"] == "new 2" and g.number == 3


def slow_fsync(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[threading.Event, threading.Event]:
    """A disk whose fsync of the file `name` waits until the test says so (`release`), once
    `writing` says it began: where a real slow write stalls, inside the store's locked write."""
    writing, release = threading.Event(), threading.Event()
    fsync = os.fsync

    def held_fsync(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name == name:
            writing.set()
            release.wait(60)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", held_fsync)
    return writing, release


def test_a_slow_write_holds_up_no_other_session_and_keeps_its_locks_from_other_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SessionStore(tmp_path)
    held = {sid: store.save(sid, {"t": sid}, b"") for sid in ("slow", "quick")}
    writing, release = slow_fsync(monkeypatch, "slow.turns")

    def append(sid: str, done: list[Any]) -> threading.Thread:
        def write() -> None:
            done.append(store.append(sid, {"t": {"value": "1"}}, expect=held[sid]))

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        return thread

    slow: list[Any] = []
    quick: list[Any] = []
    stripe = tmp_path / ".locks" / f"{zlib.crc32(b'slow') % 256}.lock"
    try:
        append("slow", slow)
        assert writing.wait(30), "the slow write never reached its fsync"
        append("quick", quick).join(30)
        assert quick, "another session's write waited for the slow one"
        # the quick write let its locks go; the slow one's still hold for other processes
        assert not other_process_locks(stripe) and not other_process_locks(stripe, "pixels.lock")
    finally:
        release.set()
    wait_until(lambda: bool(slow), what="the slow write")
    assert store.load_header("slow")["t"] == "1" and store.load_header("quick")["t"] == "1"
    assert other_process_locks(stripe) and other_process_locks(stripe, "pixels.lock")


def other_process_locks(lock: Path, name: str = "") -> bool:
    """Whether another process can take the lock file (`name` beside `lock`) exclusive now."""
    path = lock.with_name(name) if name else lock
    probe = (
        "import fcntl, os, sys; "
        "fcntl.lockf(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    )
    probed = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True)
    return probed.returncode == 0


def test_one_session_s_slow_write_holds_up_no_other_session(
    serve: Callable[..., Any],
    prep_servers: Callable[[str], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = serve(tmp_path)
    prep = prep_servers("mrope")
    (c,) = clients(prep, a)
    for sid in ("slow", "quick"):
        c.create_session(sid)
    # a disk whose fsync of the slow session's journal answers when the test says so: the
    # stall sits where a real one does, inside the store's locked write
    writing, release = slow_fsync(monkeypatch, "slow.turns")

    def session_turn(sid: str, k: int) -> Any:
        prepared = c.prepare([Message.user(image_bytes(40, 32, seed=k), f"turn {k}?")])
        return collect(c.generate(prepared, session_id=sid, max_tokens=4, temperature=0))

    slow: list[Any] = []
    quick: list[Any] = []
    thread = threading.Thread(target=lambda: slow.append(session_turn("slow", 0)), daemon=True)
    other = threading.Thread(target=lambda: quick.append(session_turn("quick", 1)), daemon=True)
    try:
        thread.start()
        assert writing.wait(60), "the slow session's turn never wrote"
        # its write waits; another session's sync, turn and write do not
        assert c.get_session("quick").num_turns == 0
        other.start()
        other.join(30)
        assert quick, "the quick session's turn waited for the slow one's write"
        assert quick[0].finished is not None and quick[0].finished.persistence.name == "SAVED"
        assert c.get_session("quick").num_turns == 1 and not slow
    finally:
        release.set()
    thread.join(60)
    assert slow and slow[0].finished.persistence.name == "SAVED"
    assert SessionStore(tmp_path).load_header("slow")["num_turns"] == 1
    c.close()


def test_a_journal_that_never_meets_a_checkpoint_stays_bounded(tmp_path: Path) -> None:
    """Renames of a session not in a slot append entries and never make a KV checkpoint: the
    store folds a long journal into its checkpoint itself, the state and its KV bytes kept."""
    store = SessionStore(tmp_path)
    ledger = [{"pos": 0, "tokens": [1, 2]}]
    g = store.save("s", {"title": "t0", "ledger": ledger, "kv_digest": "d"}, b"kv")
    for k in range(1, 3 * MAX_JOURNAL_ENTRIES):
        g, _ = store.append("s", {"title": {"value": f"t{k}"}}, expect=g)
        assert store.load_header("s").get("journal", 0) < MAX_JOURNAL_ENTRIES
    saved = store.load("s")
    assert saved.header["title"] == f"t{3 * MAX_JOURNAL_ENTRIES - 1}" and store.generation("s") == g
    assert saved.kv_state == b"kv" and saved.kv_ledger == ledger  # (the ledger is still theirs)
    # a fold after the ledger changed keeps no KV bytes that are not its ledger's
    g, _ = store.append("s", {"ledger": {"value": [*ledger, {"pos": 2, "tokens": [3]}]}}, expect=g)
    for k in range(MAX_JOURNAL_ENTRIES):
        g, _ = store.append("s", {"title": {"value": f"u{k}"}}, expect=g)
    saved = store.load("s")
    assert saved.kv_state == b"" and saved.header["kv_digest"] == ""
    assert (
        len(saved.header["ledger"]) == 2 and saved.header["title"] == f"u{MAX_JOURNAL_ENTRIES - 1}"
    )
