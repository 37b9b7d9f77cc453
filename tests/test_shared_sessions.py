"""Two infer servers on one sessions directory, without a proxy: each takes in what the other did
before every session call (adopts a session it never saw, replaces a stale copy, forgets a
deleted one), and a copy of a session deleted and created again is never taken for current."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.client import Message, SlotwiseClient, SlotwiseError, collect
from infer_service.__main__ import start
from infer_service.runner.runtime import RuntimeConfig
from infer_service.sessions.store import SessionStore, StaleSessionError
from slotwise_core.tiny_models import TinyPair
from support.cluster import Proc
from support.hold import PrefillHold
from support.loop import LoopThread
from support.media import image_bytes
from support.procs import free_port
from support.wait import wait_until


@pytest.fixture
def replicas(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    tmp_path: Path,
) -> Iterator[tuple[SlotwiseClient, SlotwiseClient]]:
    pair = tiny["mrope"]
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=2048, parallel=2, threads=1)
    servers = [loop_thread.run(start(config, sessions_dir=tmp_path)) for _ in range(2)]
    prep = f"127.0.0.1:{prep_servers('mrope')}"
    clients = [SlotwiseClient(prep, f"127.0.0.1:{s.port}") for s in servers]
    try:
        yield clients[0], clients[1]
    finally:
        for c in clients:
            c.close()
        for s in servers:
            loop_thread.run(s.stop(0))


def turn(client: SlotwiseClient, session_id: str, k: int) -> Any:
    prepared = client.prepare([Message.user(image_bytes(40, 32, seed=k), f"turn {k}?")])
    done = collect(client.generate(prepared, session_id=session_id, max_tokens=3))
    assert done.finished is not None and not done.finished.error, done.finished
    return done


def test_a_session_moves_between_replicas_and_each_continues_the_newest(replicas, tmp_path):
    a, b = replicas
    a.create_session("moving")
    turn(a, "moving", 0)
    turn(b, "moving", 1)  # b never saw it: adopted from the directory
    assert b.get_session("moving").num_turns == 2
    turn(a, "moving", 2)  # a's copy (1 turn) is stale: replaced before the turn
    assert a.get_session("moving").num_turns == 3
    assert SessionStore(tmp_path).load_header("moving")["num_turns"] == 3
    # b's copy is stale now: asked for the session, it reads the newer file
    assert b.get_session("moving").num_turns == 3


def test_a_deleted_session_is_gone_on_the_other_replica(replicas) -> None:
    a, b = replicas
    a.create_session("gone")
    turn(a, "gone", 0)
    assert b.get_session("gone").num_turns == 1
    b.delete_session("gone")
    with pytest.raises(SlotwiseError) as e:
        turn(a, "gone", 1)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_session_created_again_is_never_mistaken_for_the_old_copy(replicas, tmp_path) -> None:
    """a holds the old session after 2 saves; b deletes it, creates it again and saves it
    twice: the same generation number on disk, another lineage. a must read the new one."""
    a, b = replicas
    a.create_session("again")
    turn(a, "again", 0)  # create + 1 turn: 2 saves on a
    b.delete_session("again")
    b.create_session("again", keep=5)
    turn(b, "again", 1)
    store = SessionStore(tmp_path)
    assert store.load_header("again")["generation"] == 2
    info = a.get_session("again")
    assert (info.num_turns, info.keep) == (1, 5)  # b's session, not a's old copy
    turn(a, "again", 2)
    assert store.load_header("again")["num_turns"] == 2
    assert store.load_header("again")["context"]["keep"] == 5


def test_two_processes_racing_on_one_session_never_lose_a_saved_turn(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    tmp_path: Path,
) -> None:
    """One replica in this process, the other in its own: POSIX locks exclude only between
    processes. Both run turns of one session at once; every save takes the session's lock and
    writes only over the generation it holds, so each turn is either saved (and counted in the
    file) or refused as stale, never written over another replica's turn."""
    pair = tiny["mrope"]
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=2048, parallel=2, threads=1)
    here = loop_thread.run(start(config, sessions_dir=tmp_path))
    port = free_port()
    there = Proc(
        "infer-b",
        [sys.executable, "-m", "infer_service", "--model", str(pair.model), "--mmproj",
         str(pair.mmproj), "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
         "--ctx-size", "2048", "--parallel", "2", "--sessions-dir", str(tmp_path)],
        port,
        tmp_path.parent / f"{tmp_path.name}-infer-b.log",
    )  # fmt: skip
    there.start()
    prep = f"127.0.0.1:{prep_servers('mrope')}"
    clients = [SlotwiseClient(prep, f"127.0.0.1:{here.port}"), SlotwiseClient(prep, there.address)]
    outcomes: list[str] = []
    try:
        there.wait_serving()
        clients[0].create_session("race")
        turn(clients[0], "race", 0)  # create + 1 turn: generation 2

        def turns(client: SlotwiseClient, k0: int) -> None:
            for k in range(k0, k0 + 8):
                prepared = client.prepare([Message.user(image_bytes(40, 32, seed=k), f"{k}?")])
                try:
                    done = collect(client.generate(prepared, session_id="race", max_tokens=3))
                    assert done.finished is not None and not done.finished.error
                    outcomes.append("saved")
                except SlotwiseError as e:
                    outcomes.append(e.metadata.get("storage", e.reason))

        racers = [threading.Thread(target=turns, args=(c, 100 * i)) for i, c in enumerate(clients)]
        for t in racers:
            t.start()
        for t in racers:
            t.join(120)
        assert len(outcomes) == 16 and set(outcomes) <= {"saved", "SESSION_STALE"}, outcomes
        header = SessionStore(tmp_path).load_header("race")
        saved = outcomes.count("saved")
        assert (header["num_turns"], header["generation"]) == (1 + saved, 2 + saved), outcomes
        assert clients[1].get_session("race").num_turns == 1 + saved
    finally:
        for c in clients:
            c.close()
        there.stop()
        loop_thread.run(here.stop(0))


def test_a_stale_writer_is_refused_by_the_store(tmp_path: Path) -> None:
    """Two replicas' stores on one directory: the one holding an older generation cannot
    write, and the file stays the newer one."""
    a, b = SessionStore(tmp_path), SessionStore(tmp_path)
    g1 = a.save("s", {"num_turns": 1}, b"kv1", expect=None)
    assert b.generation("s") == g1 and g1.number == 1
    g2 = b.save("s", {"num_turns": 2}, b"kv2", expect=g1)  # b took the session over
    with pytest.raises(StaleSessionError) as stale:
        a.save("s", {"num_turns": 1}, b"kv1-again", expect=g1)
    assert (stale.value.expected, stale.value.found) == (g1, g2)
    header = a.load_header("s")
    assert a.load("s").kv_state == b"kv2" and (header["generation"], header["lineage"]) == g2[::-1]
    with pytest.raises(StaleSessionError):  # holds a file that is not there (deleted elsewhere)
        a.save("new", {}, b"", expect=g2)
    # deleted and created again, twice saved: the same number, another lineage
    b.delete("s")
    with pytest.raises(StaleSessionError):
        a.save("s", {}, b"", expect=g2)
    again = b.save("s", {"num_turns": 1}, b"new", expect=None)
    again = b.save("s", {"num_turns": 2}, b"new", expect=again)
    assert again.number == g2.number and again != g2
    with pytest.raises(StaleSessionError, match="created again"):
        a.save("s", {"num_turns": 2}, b"old", expect=g2)
    assert a.load("s").kv_state == b"new"


def test_a_checkpoint_by_the_replica_a_session_left_does_not_refuse_the_next_turn(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    tmp_path: Path,
) -> None:
    """b served the session last and still holds it (its KV not checkpointed yet); the next
    turn runs on a; b checkpoints meanwhile (idle, or its slot is wanted): that checkpoint
    adds KV bytes to the state on disk, no turn, so a's turn is saved after it."""
    pair = tiny["mrope"]
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=2048, parallel=2, threads=1)
    a_srv, b_srv = (loop_thread.run(start(config, sessions_dir=tmp_path)) for _ in range(2))
    prep = f"127.0.0.1:{prep_servers('mrope')}"
    a, b = (SlotwiseClient(prep, f"127.0.0.1:{s.port}") for s in (a_srv, b_srv))
    store = SessionStore(tmp_path)
    try:
        a.create_session("s")
        turn(a, "s", 0)
        turn(b, "s", 1)  # b holds it now, in a slot, its turn in the journal only
        held = store.generation("s")
        done: list[Any] = []
        with PrefillHold(a_srv.engine.runtime, at=1) as hold:
            runner = threading.Thread(target=lambda: done.append(turn(a, "s", 2)), daemon=True)
            runner.start()
            assert hold.held.wait(60)  # a's turn is under way (a took in b's turn first)
            b_srv.engine.call(b_srv.engine.sessions.checkpoint_resident).result(60)
            wait_until(lambda: store.load("s").kv_state, what="b's checkpoint on disk")
            assert store.generation("s") == held  # the state on disk is the same
        runner.join(60)
        assert done and done[0].finished.persistence.name == "SAVED"
        assert store.load_header("s")["num_turns"] == 3
    finally:
        for c in (a, b):
            c.close()
        for s in (a_srv, b_srv):
            loop_thread.run(s.stop(0))
