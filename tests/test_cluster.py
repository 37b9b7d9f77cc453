"""Scale-out: 2 prep and 3 infer processes behind a real nginx (deploy/nginx's template), one
shared sessions directory, the tiny mrope pair. Sessions stick to a replica by their
x-slotwise-session header; a replica's death moves its sessions to the next one on the hash
ring, which continues them from disk; a replica never writes over a newer session file; a
SIGTERM drains a replica without losing a stream."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.client import (
    NO_RETRY,
    Completion,
    Message,
    SlotwiseClient,
    SlotwiseError,
    Started,
    collect,
)
from infer_service.sessions.store import SessionStore
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.tiny_models import TinyPair
from support.cluster import NGINX, Cluster, Proc
from support.media import image_bytes
from support.required import require_or_skip
from support.wait import wait_until


@pytest.fixture(scope="module", autouse=True)
def needs_nginx() -> None:
    if NGINX is None:
        require_or_skip("nginx", "needs nginx (.ci/run installs it)")


@pytest.fixture
def cluster(tiny: dict[str, TinyPair], tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tiny["mrope"], tmp_path / "cluster")
    try:
        yield c.start()
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()


class Conversation:
    """One session's chat, a turn at a time, as an application sends it (through nginx)."""

    def __init__(self, client: SlotwiseClient, session_id: str):
        self.client, self.session_id = client, session_id
        self.messages: list[Message] = []
        self.first = 0  # the first message a turn sends: the session holds the ones before

    def turn(self, k: int, *, max_tokens: int = 4, on_started=None) -> Completion:
        sent = [*self.messages, Message.user(image_bytes(48, 40, seed=k), f"turn {k}?")]
        prepared = self.client.prepare(sent, first_message=self.first)
        events = self.client.generate(
            prepared, session_id=self.session_id, max_tokens=max_tokens, temperature=0.0
        )

        def seen(e):
            if isinstance(e, Started) and on_started is not None:
                on_started(e)

        done = collect(events, seen)
        self.messages = [*sent, Message.assistant(done.text or ".")]
        self.first = len(self.messages) - 1
        return done


def owners(cluster: Cluster) -> dict[str, Proc]:
    """session id -> the one replica that holds it (asked directly, not through nginx)."""
    found: dict[str, Proc] = {}
    for proc in cluster.infer:
        if not proc.alive:
            continue
        for sid in cluster.sessions_on(proc):
            assert sid not in found, f"{sid} is on {found[sid].name} and on {proc.name}"
            found[sid] = proc
    return found


def spread_sessions(client: SlotwiseClient, cluster: Cluster, per_replica: int) -> list[str]:
    """Session ids that nginx's hash spreads over every replica, `per_replica` each: created
    through nginx until every replica holds its share (the hash runs over ports that change from
    run to run, so no fixed list of ids is sure to reach them all), the spare ones deleted."""
    by_replica: dict[str, list[str]] = {}
    for i in range(64 * per_replica):
        if len(by_replica) == len(cluster.infer) and all(
            len(sids) >= per_replica for sids in by_replica.values()
        ):
            break
        client.create_session(f"s{i:03d}")
        by_replica = {}
        for sid, proc in sorted(owners(cluster).items()):
            by_replica.setdefault(proc.name, []).append(sid)
    assert len(by_replica) == len(cluster.infer), f"hash used only {sorted(by_replica)}"
    chosen = [sid for sids in by_replica.values() for sid in sids[:per_replica]]
    assert len(chosen) == per_replica * len(cluster.infer), by_replica
    for sid in set(owners(cluster)) - set(chosen):
        client.delete_session(sid)
    return chosen


def test_every_session_stays_on_one_replica_and_all_replicas_serve(cluster: Cluster) -> None:
    with SlotwiseClient(cluster.prep_address, cluster.infer_address) as client:
        sessions = spread_sessions(client, cluster, per_replica=4)
        assert len(sessions) == 12
        chats = {sid: Conversation(client, sid) for sid in sessions}
        for k in range(6):
            for chat in chats.values():
                done = chat.turn(k)
                assert done.finished is not None and not done.finished.error
    held = {p.name: cluster.sessions_on(p) for p in cluster.infer}
    # every session on exactly one replica, with all its 6 turns there; every replica used
    where = {sid: name for name, ss in held.items() for sid in ss}
    assert sorted(where) == sorted(sessions)
    assert all(turns == 6 for ss in held.values() for turns in ss.values())
    assert all(held.values()), held


def test_a_killed_replica_s_sessions_continue_elsewhere_from_their_last_turn(
    cluster: Cluster,
) -> None:
    with SlotwiseClient(cluster.prep_address, cluster.infer_address, retry=NO_RETRY) as client:
        sessions = spread_sessions(client, cluster, per_replica=2)
        chats = {sid: Conversation(client, sid) for sid in sessions}
        for k in range(2):
            for chat in chats.values():
                chat.turn(k)
        victim_sid = sessions[0]
        victim = owners(cluster)[victim_sid]
        victims = [sid for sid, p in owners(cluster).items() if p is victim]

        # a long turn on the victim's session; kill -9 the replica once it has started
        started: list[Started] = []
        killed = threading.Event()

        def kill_when_started(e: Started) -> None:
            started.append(e)
            victim.signal(signal.SIGKILL)
            killed.set()

        chat = chats[victim_sid]
        before = (list(chat.messages), chat.first)
        with pytest.raises(SlotwiseError) as lost:
            chat.turn(2, max_tokens=400, on_started=kill_when_started)
        assert killed.is_set() and lost.value.code() in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED,
        ), lost.value  # fmt: skip
        victim.wait(10)

        # the application retries the turn: nginx skips the dead replica, the next one on the
        # ring continues the session from its last completed turn, with the same numbers
        chat.messages, chat.first = before
        t0 = time.monotonic()
        again: list[Started] = []
        done = chat.turn(2, max_tokens=4, on_started=again.append)
        failover = time.monotonic() - t0
        assert done.finished is not None and not done.finished.error
        assert again[0].num_prompt_cells == started[0].num_prompt_cells
        # (what the other replica decodes again of the reply, its checkpoint being older than
        # the session's last turn, is not counted as reused: it was not)
        assert again[0].num_reused_cells <= started[0].num_reused_cells
        now = owners(cluster)
        assert now[victim_sid].alive
        info = client.get_session(victim_sid)
        assert info.num_turns == 3

        # no other session lost a turn: the victim's others move too, the rest stay
        for sid, chat in chats.items():
            if sid != victim_sid:
                chat.turn(2)
        for sid in sessions:
            assert client.get_session(sid).num_turns == 3, sid
        assert set(victims) <= set(owners(cluster))
    print(f"failover: {failover * 1000:.0f} ms from the retry to the finished turn")


def test_a_returning_replica_loads_the_newer_state_and_never_writes_an_older_one(
    cluster: Cluster,
) -> None:
    with SlotwiseClient(cluster.prep_address, cluster.infer_address, retry=NO_RETRY) as client:
        sessions = spread_sessions(client, cluster, per_replica=1)
        chats = {sid: Conversation(client, sid) for sid in sessions}
        for chat in chats.values():
            chat.turn(0)
        sid = sessions[0]
        home = owners(cluster)[sid]
        home.stop()  # kill -9
        chats[sid].turn(1)  # served by the next replica on the ring: turn 2 on disk
        other = owners(cluster)[sid]
        assert other is not home
        cluster.restart(home)  # it reads the headers again at startup: turn 2
        # once nginx's fail_timeout is over, the hash sends the session home again
        wait_until(lambda: cluster.routed_to(sid) is home, what="nginx routing home again")
        done = chats[sid].turn(2)
        assert done.finished is not None and not done.finished.error
        assert client.get_session(sid).num_turns == 3
        # home served turn 3 from the newer file; other still holds turn 2 in memory
        assert cluster.sessions_on(home)[sid] == 3 and cluster.sessions_on(other)[sid] == 2
        store = SessionStore(cluster.sessions_dir)
        assert store.load_header(sid)["num_turns"] == 3

        # the other replica still holds turn 2 in memory: asked to save it, it takes in the
        # newer file first and never writes its older copy over it
        with grpc.insecure_channel(other.address) as ch:
            stub = infer_pb2_grpc.InferServiceStub(ch)
            saved = stub.SaveSession(infer_pb2.SaveSessionRequest(session_id=sid), timeout=10)
        assert saved.session.num_turns == 3
        assert store.load_header(sid)["num_turns"] == 3


def test_stateless_streams_spread_and_a_drained_replica_loses_none(cluster: Cluster) -> None:
    with SlotwiseClient(cluster.prep_address, cluster.infer_address) as client:
        prepared = [
            client.prepare([Message.user(image_bytes(40, 40, seed=i), f"stream {i}")])
            for i in range(32)
        ]
        results: list[Completion | BaseException | None] = [None] * 32

        def stream(i: int) -> None:
            try:
                results[i] = collect(client.generate(prepared[i], max_tokens=120))
            except BaseException as e:
                results[i] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        # every replica busy (least_conn spreads the 32): drain one with streams in flight
        wait_until(lambda: min(running(p) for p in cluster.infer) > 0, what="every replica busy")
        drained = cluster.infer[0]
        drained.signal(signal.SIGTERM)
        for t in threads:
            t.join(180)
        assert drained.wait(60) == 0
    errors = [r for r in results if not isinstance(r, Completion)]
    assert not errors, errors[:3]
    assert all(r.finished is not None and not r.finished.error for r in results)  # type: ignore[union-attr]
    # the signal found streams in flight there, and they finished (none of the 32 failed)
    drained_calls = re.findall(r"draining (\d+) calls in flight", drained.log.read_text())
    assert drained_calls and int(drained_calls[-1]) > 0, drained.log.read_text()[-2000:]


def running(proc: Proc) -> int:
    """Streams a replica has started or queued (asked directly)."""
    with grpc.insecure_channel(proc.address) as ch:
        r = infer_pb2_grpc.InferServiceStub(ch).GetServerInfo(
            infer_pb2.GetServerInfoRequest(), timeout=10
        )
    return r.num_active + r.num_queued


NODE = shutil.which("node")
NODE_DIR = Path(__file__).parent / "contract" / "node"


@pytest.fixture
def node() -> str:
    """node, with tests/contract/node's packages (asked for before the cluster starts)."""
    if NODE is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        require_or_skip("node", "needs node and tests/contract/node/node_modules (npm ci)")
    return NODE


def test_the_node_client_s_session_turns_stay_on_one_replica(
    node: str, cluster: Cluster, tmp_path: Path
) -> None:
    """client.js sends x-slotwise-session on CreateSession and Generate: without it, nginx
    would spread the three calls (least_conn) and the session would be on several replicas."""
    image = tmp_path / "image.png"
    image.write_bytes(image_bytes(40, 40, seed=9))
    for _ in range(3):
        done = subprocess.run(
            [node, "client.js", "--prep", cluster.prep_address, "--infer", cluster.infer_address,
             "--image", str(image), "--max-tokens", "3", "--session", "node-1"],
            cwd=NODE_DIR, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    home = owners(cluster)["node-1"]  # (owners fails if two replicas hold it)
    assert cluster.sessions_on(home)["node-1"] == 3


@pytest.mark.slow
def test_the_cluster_run_short() -> None:
    """tests/cluster.py as CI runs it: sessions through nginx while replicas are killed."""
    import cluster as cluster_run

    figures = cluster_run.run(sessions=4, replicas=3, seconds=12, kill_every=4)
    print(figures)
    assert figures["errors"] == [] and figures["turns_lost"] == 0
    assert figures["kills"] >= 1 and figures["turns_completed"] > 0 and figures["failovers"] > 0


def test_sessions_keep_their_owner_across_a_failover(tiny: dict[str, TinyPair], tmp_path: Path):
    """With a keys file on every replica, a session is its tenant's wherever it is served:
    after its replica is killed, the next one continues it for its owner, and another tenant
    finds nothing there (NOT_FOUND, as for an id that does not exist)."""
    keys = tmp_path / "keys"
    keys.write_text("acme key-of-acme\nglobex key-of-globex\n")
    c = Cluster(tiny["mrope"], tmp_path / "cluster", keys=keys, token="key-of-acme")
    try:
        c.start()
        acme = SlotwiseClient(c.prep_address, c.infer_address, token="key-of-acme",
                              retry=NO_RETRY)  # fmt: skip
        globex = SlotwiseClient(c.prep_address, c.infer_address, token="key-of-globex",
                                retry=NO_RETRY)  # fmt: skip
        with acme, globex:
            acme.create_session("owned")
            chat = Conversation(acme, "owned")
            chat.turn(0)
            home = c.routed_to("owned")
            assert "owned" in c.sessions_on(home)
            home.stop()  # kill -9
            wait_until(lambda: c.routed_to("owned") is not home, what="nginx failing over")
            assert chat.turn(1).finished is not None  # continued from disk, for its owner
            assert acme.get_session("owned").num_turns == 2
            for call in (globex.get_session, globex.delete_session):
                with pytest.raises(SlotwiseError) as hidden:
                    call("owned")
                assert hidden.value.code() == grpc.StatusCode.NOT_FOUND
            now = c.routed_to("owned")
            assert c.sessions_on(now) == {"owned": 2}  # acme's, where it is served now
            assert c.sessions_on(now, token="key-of-globex") == {}
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()
