"""Two infer servers on one sessions directory, without a proxy: each takes in what the other did
before every session call (adopts a session it never saw, replaces a stale copy, forgets a
deleted one), and a copy of a session deleted and created again is never taken for current."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.client import Message, SlotwiseClient, SlotwiseError, collect
from infer_service.__main__ import start
from infer_service.runtime import RuntimeConfig
from infer_service.session_store import SessionStore
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.media import image_bytes


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
