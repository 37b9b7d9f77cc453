"""The pool (--kv-unified) is fair across tenants: one tenant's idle session or long pinned
generation cannot keep another tenant's prompt out. Real servers on loopback, two tenants from
one keys file, a 1,024-cell pool of 4 slots, each slot free to grow to the whole pool."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.client import NO_RETRY, Message, SlotwiseClient, collect
from slotwise_core.keys import Keys
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.wait import wait_until

ALICE, BOB = "key-of-alice", "key-of-bob"


@pytest.fixture
def pool(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], tmp_path: Path
) -> Iterator[Callable[[str], SlotwiseClient]]:
    """client(key): prep and infer (the pool) on one keys file."""
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep
    from slotwise_core.serving import Security

    (tmp_path / "keys").write_text(f"alice {ALICE}\nbob {BOB}\n")
    security = Security(keys=Keys(tmp_path / "keys"))
    pair = tiny["rope"]
    config = RuntimeConfig(
        pair.model, pair.mmproj, ctx_size=1024, parallel=4, kv_unified=True, threads=1
    )
    prep = loop_thread.run(start_prep(pair.model, pair.mmproj, threads=1, security=security))
    infer = loop_thread.run(start_infer(config, security=security))
    clients: list[SlotwiseClient] = []

    def client(key: str) -> SlotwiseClient:
        c = SlotwiseClient(f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}", token=key,
                           retry=NO_RETRY)  # fmt: skip
        clients.append(c)
        return c

    yield client
    for c in clients:
        c.close()
    loop_thread.run(infer.stop(0))
    loop_thread.run(prep.stop(0))


def words(n: int, seed: int = 0) -> str:
    return " ".join(f"w{(i * 7 + seed) % 97}" for i in range(n))


def test_an_idle_session_makes_way_for_another_tenant(pool: Callable[[str], Any]) -> None:
    alice, bob = pool(ALICE), pool(BOB)
    session = alice.create_session(keep=8)
    first = collect(
        alice.generate(
            alice.prepare([Message.user(words(255))]), session_id=session.session_id,
            max_tokens=4,
        )
    )  # fmt: skip
    assert first.usage.num_prompt_cells > 900  # (of the pool's 1,024 cells), then idle
    reply = collect(bob.generate(bob.prepare([Message.user(words(100, 1))]), max_tokens=4))
    assert reply.finished.reason.value in ("stop", "length"), reply.finished
    assert bob.server_info().stats.num_pool_waits > 0  # (it waited while the session left)
    assert alice.server_info().stats.num_sessions_reclaimed == 1
    # and the session lost nothing: its next turn continues it
    again = collect(
        alice.generate(
            alice.prepare([Message.user("and then?")]), session_id=session.session_id,
            max_tokens=4,
        )
    )  # fmt: skip
    assert alice.get_session(session.session_id).num_turns == 2 and again.text is not None


def test_a_long_pinned_generation_is_put_aside_for_another_tenant(
    pool: Callable[[str], Any],
) -> None:
    alice, bob = pool(ALICE), pool(BOB)
    prompt = alice.prepare([Message.user(words(230))])  # ~850 cells, all pinned
    options = {"max_tokens": 1500, "temperature": 0, "keep": prompt.num_cells, "ignore_eos": True}
    alone = collect(alice.generate(prompt, **options))
    assert len(alone.token_ids) == 1500

    seen: list[int] = []
    done = threading.Event()
    result: dict[str, Any] = {}

    def generate() -> None:
        try:
            out = []
            for event in alice.generate(prompt, **options):
                ids = getattr(event, "token_ids", None)
                if ids:
                    out.extend(ids)
                    seen.append(len(out))
            result["tokens"] = out
        finally:
            done.set()

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        wait_until(lambda: seen and seen[-1] >= 200, what="alice generating past the pool")
        reply = collect(bob.generate(bob.prepare([Message.user(words(60, 2))]), max_tokens=4))
        assert not done.is_set()  # bob was served while alice's generation went on
        assert reply.finished.reason.value in ("stop", "length"), reply.finished
    finally:
        thread.join()
    # put aside in host memory and back: the same tokens as alone
    assert result["tokens"] == list(alone.token_ids)
    assert alice.server_info().stats.num_preemptions > 0  # (counted as the tenant's own)


def test_a_generation_put_aside_for_a_session_goes_on_when_the_session_idles(
    pool: Callable[[str], Any],
) -> None:
    """The put-aside generation waits only for the session's turn: once the session idles,
    it is swapped out and the generation goes on, to the same tokens as alone."""
    alice, bob = pool(ALICE), pool(BOB)
    prompt = alice.prepare([Message.user(words(185))])  # ~740 cells, all pinned
    options = {"max_tokens": 250, "temperature": 0, "keep": prompt.num_cells, "ignore_eos": True}
    alone = collect(alice.generate(prompt, **options))
    seen: list[int] = []
    result: dict[str, Any] = {}

    def generate() -> None:
        out: list[int] = []
        for event in alice.generate(prompt, **options):
            out.extend(getattr(event, "token_ids", None) or ())
            seen.append(len(out))
        result["tokens"] = out

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        wait_until(lambda: seen and seen[-1] >= 20, what="alice generating")
        session = bob.create_session(keep=8)
        turn = collect(
            bob.generate(
                bob.prepare([Message.user(words(120, 1))]), session_id=session.session_id,
                max_tokens=4,
            )
        )  # fmt: skip
        assert turn.finished.reason.value in ("stop", "length"), turn.finished
    finally:
        thread.join()  # (it ends: the idle session makes way)
    assert result["tokens"] == list(alone.token_ids)
    assert alice.server_info().stats.num_preemptions > 0
    assert bob.server_info().stats.num_sessions_reclaimed == 1
