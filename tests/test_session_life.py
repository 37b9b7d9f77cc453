"""Sessions have a life: a tenant keeps at most so many sessions and bytes on disk (its least
recently used session not in a turn makes way for a new one), and a session unused past the
TTL is deleted, in memory and on disk, whoever wrote it. Real servers on the tiny models; time
is the test's (an injected clock), so nothing here depends on the machine's speed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from test_metrics import scrape, value

from clients.client import NO_RETRY, Constraint, Message, SlotwiseClient, SlotwiseError, collect
from infer_service.__main__ import start
from infer_service.runner.runtime import RuntimeConfig
from infer_service.sessions.persistence import _SWEEP as SWEEP_QUEUE
from infer_service.sessions.session import SessionLimits, TenantSessions
from infer_service.sessions.store import SessionStore
from slotwise_core.keys import Keys
from slotwise_core.serving import Security
from slotwise_core.tiny_models import TinyPair
from support.hold import PrefillHold
from support.http_stack import Stacks, stacks_fixture
from support.loop import LoopThread
from support.media import image_bytes
from support.procs import free_port
from support.wait import wait_until

ACME, GLOBEX = "key-of-acme", "key-of-globex"
TTL = 1000.0  # seconds of the test's clock


class Clock:
    """Wall time as the test moves it."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Infer:
    def __init__(self, running: Any, prep_port: int, metrics_port: int, clock: Clock):
        self.running, self.prep_port, self.metrics_port = running, prep_port, metrics_port
        self.clock = clock
        self.sessions = running.engine.sessions

    def client(self, key: str | None = None) -> SlotwiseClient:
        return SlotwiseClient(
            f"127.0.0.1:{self.prep_port}", f"127.0.0.1:{self.running.port}", token=key,
            retry=NO_RETRY,
        )  # fmt: skip

    def on_engine(self, fn: Callable[[], Any] = lambda: None) -> Any:
        """fn on the engine thread; the engine's periodic work runs right after it."""
        return self.running.engine.call(fn).result(30)

    def usage(self, tenant: str = "default") -> TenantSessions:
        return self.on_engine(self.sessions.usage).get(tenant, TenantSessions())


@pytest.fixture
def serve(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    tmp_path: Path,
) -> Iterator[Callable[..., Infer]]:
    """serve(sessions_dir, limits, keys=False) -> an infer server on the test's clock."""
    running: list[Any] = []
    (tmp_path / "keys").write_text(f"acme {ACME}\nglobex {GLOBEX}\n")

    def serve_(sessions: Path | None, limits: SessionLimits, *, keys: bool = False) -> Infer:
        pair = tiny["mrope"]
        config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=2048, parallel=2, threads=1)
        security = Security(keys=Keys(tmp_path / "keys")) if keys else Security()
        port = free_port()
        server = loop_thread.run(start(
            config, sessions_dir=sessions, session_limits=limits, security=security,
            metrics_port=port,
        ))  # fmt: skip
        running.append(server)
        clock = Clock()
        server.engine.sessions.clock = clock
        return Infer(server, prep_servers("mrope"), port, clock)

    yield serve_
    for server in running:
        loop_thread.run(server.stop(0))


def turn(c: SlotwiseClient, session_id: str, k: int = 0) -> Any:
    prepared = c.prepare([Message.user(image_bytes(40, 32, seed=k), f"turn {k}?")])
    done = collect(c.generate(prepared, session_id=session_id, max_tokens=4, temperature=0))
    assert done.finished is not None and not done.finished.error, done.finished
    return done


def missing(c: SlotwiseClient, session_id: str) -> bool:
    try:
        c.get_session(session_id)
    except SlotwiseError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        return True
    return False


def on_disk(root: Path, key: str) -> bool:
    return (root / f"{key}.session").exists() or (root / f"{key}.turns").exists()


class HeldTurn:
    """A turn that runs until the test ends it (a grammar without an end)."""

    def __init__(self, c: SlotwiseClient, session_id: str):
        self.tokens, self.stop = 0, threading.Event()
        endless = Constraint(grammar='root ::= "a" root')
        events = c.generate("Say a", session_id=session_id, constraint=endless, max_tokens=1 << 20)

        def read() -> None:
            for event in events:
                self.tokens += len(getattr(event, "token_ids", ()))
                if self.stop.is_set():
                    break
            events.close()  # (cancels the call: the turn ends, rolled back)

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()
        wait_until(lambda: self.tokens > 0, what="the held turn's first token")

    def end(self) -> None:
        self.stop.set()
        self.thread.join(60)


# -- quotas -----------------------------------------------------------------------------------


def test_a_tenant_at_its_quota_makes_room_with_its_least_recently_used_session(
    serve: Callable[..., Infer], tmp_path: Path
) -> None:
    root = tmp_path / "sessions"
    infer = serve(root, SessionLimits(max_sessions=3), keys=True)
    with infer.client(ACME) as acme, infer.client(GLOBEX) as globex:
        for sid in ("a", "b", "c"):
            acme.create_session(sid)
            globex.create_session(sid)
            infer.clock.advance(10)
        turn(acme, "a")  # a is used again: b is now acme's least recently used
        infer.clock.advance(10)
        acme.create_session("d")
        assert missing(acme, "b")
        wait_until(lambda: not on_disk(root, "acme@b"), what="b's files deleted")
        assert sorted(s.session_id for s in acme.list_sessions()) == ["a", "c", "d"]
        assert acme.get_session("a").num_turns == 1
        # another tenant's sessions are its own quota's business
        assert sorted(s.session_id for s in globex.list_sessions()) == ["a", "b", "c"]
    for tenant, sessions, evicted in (("acme", 3, 1), ("globex", 3, 0)):
        held = infer.usage(tenant)
        assert (held.num_sessions, held.num_evicted) == (sessions, evicted)
    samples = scrape(infer.metrics_port)
    assert value(samples, "slotwise_infer_tenant_sessions", tenant="acme") == 3
    assert value(samples, "slotwise_infer_tenant_sessions_evicted_total", tenant="acme") == 1
    assert value(samples, "slotwise_infer_tenant_sessions_evicted_total", tenant="globex") == 0
    assert value(samples, "slotwise_infer_tenant_session_bytes", tenant="acme") == (
        infer.usage("acme").num_bytes
    )


def test_a_tenant_whose_sessions_are_all_in_turns_is_refused_a_new_one(
    serve: Callable[..., Infer],
) -> None:
    infer = serve(None, SessionLimits(max_sessions=1))  # (in memory: the same quota)
    with infer.client() as c:
        c.create_session("talking")
        held = HeldTurn(c, "talking")
        try:
            with pytest.raises(SlotwiseError) as refused:
                c.create_session("another")
        finally:
            held.end()
        e = refused.value
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.reason == "SESSION_QUOTA"
        assert "quota" in e.message and e.metadata["tenant_max_sessions"] == "1"
        assert c.get_session("talking").num_turns == 0  # nothing was evicted for nothing

        def created() -> bool:  # once the held turn has ended
            try:
                c.create_session("another")
            except SlotwiseError as e:
                assert e.reason == "SESSION_QUOTA", e
                return False
            return True

        wait_until(created, what="the new session, once the turn ended")
        assert missing(c, "talking")
        assert infer.usage().num_evicted == 1


def test_a_tenant_s_sessions_stay_within_its_bytes_on_disk(
    serve: Callable[..., Infer], tmp_path: Path
) -> None:
    infer = serve(tmp_path, SessionLimits(max_sessions=0, max_bytes=1 << 30))
    with infer.client() as c:
        for k, sid in enumerate(("a", "b")):
            c.create_session(sid)
            turn(c, sid, k)
            infer.clock.advance(10)
        held = infer.usage()
        store = SessionStore(tmp_path)
        files = sum((store.footprint(sid) or (0, 0.0))[0] for sid in ("a", "b"))
        assert held.num_bytes == files + 2 * 40 * 32 * 3  # the files, and each one's pixels
        # at its quota: a new session's room is made by the least recently used one
        infer.sessions.limits = SessionLimits(max_sessions=0, max_bytes=held.num_bytes)
        c.create_session("c")
        assert missing(c, "a") and not missing(c, "b")
        wait_until(lambda: not on_disk(tmp_path, "a"), what="a's files deleted")
        # a turn that takes the tenant past it: the others make way, least recently used first
        infer.clock.advance(10)
        infer.sessions.limits = SessionLimits(max_sessions=0, max_bytes=infer.usage().num_bytes)
        turn(c, "c", 2)
        wait_until(lambda: missing(c, "b"), what="b evicted after c's turn grew the tenant")
        assert c.get_session("c").num_turns == 1
        assert infer.usage().num_evicted == 2


# -- expiry -----------------------------------------------------------------------------------


def test_a_session_unused_past_its_ttl_is_gone_in_memory_and_on_disk(
    serve: Callable[..., Infer], tmp_path: Path
) -> None:
    infer = serve(tmp_path, SessionLimits(ttl=TTL))
    with infer.client() as c:
        for sid in ("kept", "idle", "quiet", "busy"):
            c.create_session(sid)
            turn(c, sid)
        infer.clock.advance(TTL - 1)
        turn(c, "kept", 1)  # a turn keeps it alive
        assert c.get_session("idle").num_turns == 1  # (reading it does not)
        held = HeldTurn(c, "busy")
        infer.clock.advance(2)
        try:
            # a call finds it gone, whether or not the periodic work came to it yet
            assert missing(c, "idle")
            with pytest.raises(SlotwiseError) as gone:
                c.delete_session("idle")
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            # one nobody asks for goes by the engine's periodic work
            infer.on_engine()
            wait_until(lambda: not on_disk(tmp_path, "quiet"), what="the quiet one deleted")
            assert not on_disk(tmp_path, "idle")
            assert "busy" in [s.session_id for s in c.list_sessions()]  # in a turn: it stays
        finally:
            held.end()
        assert sorted(s.session_id for s in c.list_sessions()) == ["busy", "kept"]
        assert c.get_session("kept").num_turns == 2
        infer.clock.advance(TTL - 1)  # its turn (ended now) counts: not gone yet
        assert not missing(c, "busy") and missing(c, "kept")
    assert infer.usage().num_expired == 3
    samples = scrape(infer.metrics_port)
    assert value(samples, "slotwise_infer_tenant_sessions_expired_total", tenant="default") == 3


def test_sessions_this_replica_never_read_expire_too(
    serve: Callable[..., Infer], tmp_path: Path
) -> None:
    a = serve(tmp_path, SessionLimits(ttl=TTL))
    b = serve(tmp_path, SessionLimits(ttl=TTL))  # another replica on the same directory
    with a.client() as ca, b.client() as cb:
        cb.create_session("elsewhere")  # a never read it
        turn(cb, "elsewhere")
        # written by a replica that is gone now: files a never read either
        store = SessionStore(tmp_path)
        store.save("orphan", {"title": "nobody's"}, b"")
        store.save("recent", {"title": "nobody's"}, b"")
        a.clock.advance(TTL + 1)
        # its files' last write is its last use: a call on a finds it gone
        assert missing(ca, "elsewhere")
        wait_until(lambda: not on_disk(tmp_path, "elsewhere"), what="its files deleted")
        assert missing(cb, "elsewhere")  # and so does the replica that held it
        # the others, by the sweep of the directory
        a.clock.advance(a.sessions.sweep_seconds)
        os.utime(tmp_path / "recent.session", (a.clock.now, a.clock.now))  # written just now
        a.on_engine()
        wait_until(lambda: not on_disk(tmp_path, "orphan"), what="the sweep")
        assert on_disk(tmp_path, "recent")
        # (counted on the engine thread once the deletion landed, after the file went)
        wait_until(lambda: a.usage().num_expired == 2, what="both expiries counted")


def test_a_restart_expires_what_went_unused_while_it_was_down(
    serve: Callable[..., Infer], tmp_path: Path, loop_thread: LoopThread
) -> None:
    first = serve(tmp_path, SessionLimits())
    with first.client() as c:
        for sid in ("old", "new"):
            c.create_session(sid)
            turn(c, sid)
    loop_thread.run(first.running.stop(0))
    long_ago = time.time() - 2 * 3600
    for name in ("old.session", "old.turns"):
        if (tmp_path / name).exists():
            os.utime(tmp_path / name, (long_ago, long_ago))
    second = serve(tmp_path, SessionLimits(ttl=3600))
    # nobody calls: the engine's first periodic work deletes it
    wait_until(lambda: not on_disk(tmp_path, "old"), what="the old session deleted")
    with second.client() as c:
        assert c.get_session("new").num_turns == 1 and missing(c, "old")


# -- a session another replica is using --------------------------------------------------------


def backdate(root: Path, key: str, when: float) -> None:
    """The session's files as if last written at `when` (nobody used it since)."""
    for name in (f"{key}.session", f"{key}.turns"):
        if (root / name).exists():
            os.utime(root / name, (when, when))


def settled(infer: Infer, session_id: str) -> None:
    """The replica's periodic work done, with what it asked of the disk: the sweep's listing,
    the deletions that follow it, and whatever is queued on the session's disk queue."""
    queues = infer.sessions.persistence.disk_queues
    infer.on_engine()
    queues.submit(SWEEP_QUEUE, lambda: None).result(30)
    infer.on_engine()
    queues.submit(session_id, lambda: None).result(30)


def finds_unused(a: Infer, ca: SlotwiseClient, how: str) -> None:
    """The replica `a` deletes session "s" as unused, if its files let it: by expiry (a holds
    it, its clock past the TTL), by eviction (a's quota of one, and a new session), or by the
    sweep of the directory (a never read it). A call (a holds it, its clock past the TTL): a
    sync finds the files touched since, so a counts the session's age from then."""
    if how == "expiry":
        a.clock.advance(20)
    elif how == "call":
        a.clock.advance(20)
        assert ca.get_session("s").num_turns == 1
    elif how == "eviction":
        ca.create_session("new")
    else:
        a.clock.advance(20)
        a.on_engine(lambda: setattr(a.sessions, "_next_sweep", a.clock.now))
    settled(a, "s")
    # an expiry or an eviction did run (a let its copy go); a call or the sweep found it used
    counted = {"expiry": (1, 0), "eviction": (0, 1)}.get(how, (0, 0))
    held = a.usage()
    assert (held.num_expired, held.num_evicted) == counted


@pytest.mark.parametrize("how", ["expiry", "eviction"])
def test_a_checkpoint_of_the_same_state_elsewhere_keeps_a_session_from_deletion(
    serve: Callable[..., Infer], tmp_path: Path, how: str
) -> None:
    """b served the session last and checkpoints it (idle, its slot wanted, a drain): the
    same state, so the same generation, the one a holds too. a finds the session unused by
    its own account, but b's checkpoint is recent: its files stay, and b goes on."""
    a = serve(tmp_path, SessionLimits(max_sessions=1 if how == "eviction" else 1000, ttl=TTL))
    b = serve(tmp_path, SessionLimits(ttl=TTL))
    b.sessions.idle_checkpoint_seconds = 1e9  # (the test says when b checkpoints)
    store = SessionStore(tmp_path)
    with a.client() as ca, b.client() as cb:
        cb.create_session("s")
        turn(cb, "s")  # in b's slot; the turn in its journal only
        a.clock.now = time.time()
        backdate(tmp_path, "s", a.clock.now - TTL + 10)  # b's last turn, long ago
        assert ca.get_session("s").num_turns == 1  # a holds the generation b wrote
        held = store.generation("s")
        b.on_engine(b.sessions.checkpoint_resident)
        wait_until(lambda: not (tmp_path / "s.turns").exists(), what="b's checkpoint")
        assert store.generation("s") == held and store.load("s").kv_state
        finds_unused(a, ca, how)
        assert on_disk(tmp_path, "s")
        done = turn(cb, "s", 1)
        assert done.finished.persistence.name == "SAVED"
        assert store.load_header("s")["num_turns"] == 2
        assert ca.get_session("s").num_turns == 2  # (a forgot its copy, and reads it again)


@pytest.mark.parametrize("how", ["expiry", "eviction", "sweep", "call"])
def test_a_session_in_a_turn_elsewhere_is_kept_however_old_its_last_write(
    serve: Callable[..., Infer], tmp_path: Path, how: str
) -> None:
    """b's turn of a session whose last write is old (nearly the TTL): the turn reads no
    file and writes only as it ends. a finds the session unused by its files' last write;
    but the turn touched them as it began: they stay, and the turn is saved."""
    a = serve(tmp_path, SessionLimits(max_sessions=1 if how == "eviction" else 1000, ttl=TTL))
    b = serve(tmp_path, SessionLimits(ttl=TTL))
    store = SessionStore(tmp_path)
    with a.client() as ca, b.client() as cb:
        cb.create_session("s")
        turn(cb, "s")
        a.clock.now = time.time()
        backdate(tmp_path, "s", a.clock.now - TTL + 10)
        if how != "sweep":
            assert ca.get_session("s").num_turns == 1  # (a holds it; reading is no use)
        outcome: list[Any] = []

        def second_turn() -> None:
            try:
                outcome.append(turn(cb, "s", 1))
            except SlotwiseError as e:
                outcome.append(e)

        with PrefillHold(b.running.engine.runtime, at=1) as hold:
            runner = threading.Thread(target=second_turn, daemon=True)
            runner.start()
            assert hold.held.wait(60), "b's turn never began"
            b.sessions.persistence.disk_queues.submit("s", lambda: None).result(30)
            finds_unused(a, ca, how)
            assert on_disk(tmp_path, "s")
        runner.join(60)
        assert outcome and not isinstance(outcome[0], Exception), outcome
        assert outcome[0].finished.persistence.name == "SAVED"
        assert store.load_header("s")["num_turns"] == 2
        assert ca.get_session("s").num_turns == 2


# -- stored Responses are sessions ------------------------------------------------------------


@pytest.fixture
def stacks(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stacks]:
    yield from stacks_fixture(loop_thread, tiny, prep_servers)


def test_stored_responses_have_the_same_life_and_go_404(stacks: Stacks, tmp_path: Path) -> None:
    stack = stacks.start("mrope", sessions_dir=tmp_path, parallel=2, ctx_size=2048)
    sessions = stack.infer.engine.sessions
    clock = Clock()
    sessions.clock, sessions.limits = clock, SessionLimits(max_sessions=2, ttl=TTL)
    client = stack.client()

    def respond(text: str) -> Any:
        clock.advance(10)
        return client.responses.create(model="m", input=text, max_output_tokens=2)

    first, second, third = respond("one"), respond("two"), respond("three")
    # the third chain's session made its room with the first's
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    clock.advance(TTL)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(third.id)
    with pytest.raises(openai.BadRequestError) as on:  # (as OpenAI says it)
        client.responses.create(
            model="m", input="again", previous_response_id=second.id, max_output_tokens=2
        )
    assert on.value.code == "previous_response_not_found"
    assert client.responses.retrieve(respond("a new chain").id)  # (room for new ones)
