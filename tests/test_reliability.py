"""Reliability under real traffic: no client can stop the engine, no completed turn is lost
silently, memory stays bounded, reuse is exact, errors say precisely what happened.

Real prep and infer servers on loopback, real llama.cpp on the tiny pairs, a real tmpfs that
fills up (as root; skipped with the reason where `mount` is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from PIL import Image
from test_sessions import (
    GREEDY,
    OK_REASONS,
    SEEDED,
    Chat,
    Servers,
    create,
    infer_stub,
    message,
    prep_stub,
    prepare,
    session_info,
    status_of,
)

from infer_service.api.mailbox import EventRelay, Mailbox
from infer_service.events import PrefillProgress, TokenDelta
from infer_service.sessions.session import Lifecycle
from infer_service.sessions.store import SessionStore
from slotwise.v1 import infer_pb2, prep_pb2, prompt_pb2
from support.media import image_bytes
from support.rpc import Stream, channel
from support.wait import PATIENCE, wait_until

GAP = infer_pb2.SHIFT_POLICY_GAP


def reason_of(err: grpc.RpcError) -> tuple[str, dict[str, str]]:
    status = rpc_status.from_call(err)
    assert status is not None, f"no google.rpc.Status with {err.code()}: {err.details()}"
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason, dict(info.metadata)
    raise AssertionError(f"no ErrorInfo in {status}")


def health(port: int) -> int:
    with channel(port) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(r.status)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def servers(loop_thread, tiny) -> Iterator[Servers]:
    s = Servers(loop_thread, tiny)
    yield s
    s.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a disk that really fills up."""
    root = tmp_path / "tmpfs"
    root.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def fill(path: Path, leave: int) -> None:
    """Write a filler file until about `leave` bytes are free."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(0, free - leave))


# -- 1. an engine no caller can stop ----------------------------------------------------------


def test_a_thousand_session_rpcs_with_1ms_deadlines_while_a_stream_runs(
    servers: Servers, prep_servers, tmp_path: Path
) -> None:
    infer = servers.start("rope", parallel=2, ctx_size=512, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("rope"))
    for sid in ("a", "b"):
        create(stub, sid, SEEDED)
    prompt = prepare(prep, [message("user", "a long story please")])
    stream = stub.Generate(  # greedy on a random model: it never stops by itself
        infer_pb2.GenerateRequest(prompt=prompt, max_tokens=1 << 20, sampling=GREEDY), timeout=120
    )
    assert next(stream).HasField("started")
    calls = [
        lambda t: stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=t),
        lambda t: stub.GetSession(infer_pb2.GetSessionRequest(session_id="a"), timeout=t),
        lambda t: stub.SaveSession(infer_pb2.SaveSessionRequest(session_id="b"), timeout=t),
        lambda t: stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=t),
        # a turn whose deadline passes while the engine marks the session busy: unmarked
        lambda t: list(
            stub.Generate(
                infer_pb2.GenerateRequest(prompt=prompt, session_id="a", max_tokens=2), timeout=t
            )
        ),
    ]
    codes: dict[grpc.StatusCode, int] = {}
    for k in range(1000):
        try:
            calls[k % len(calls)](0.001)
            codes[grpc.StatusCode.OK] = codes.get(grpc.StatusCode.OK, 0) + 1
        except grpc.RpcError as e:
            codes[e.code()] = codes.get(e.code(), 0) + 1
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) >= 100, codes
    assert set(codes) <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.FAILED_PRECONDITION,  # a turn of "a" still running
    }, codes
    more = [next(stream) for _ in range(50)]  # it kept streaming through all of that
    assert {e.WhichOneof("event") for e in more} <= {"prefill", "delta", "shift"}
    stream.cancel()
    assert infer.engine.alive and health(infer.port) == SERVING
    # no session is left marked busy by a turn whose caller left
    wait_until(
        lambda: (
            not infer.engine.call(
                lambda: any(
                    s.state is Lifecycle.IN_TURN for s in infer.engine.sessions.table.sessions()
                )
            ).result(PATIENCE)
        ),
        what="no session marked busy",
    )
    chat = Chat(prep, stub, "a", max_tokens=3)
    assert chat.turn("and now?").finished.reason in OK_REASONS
    assert infer.engine.num_waiting == 0


def test_the_engine_dying_ends_every_stream_and_health_says_not_serving(
    servers: Servers, prep_servers
) -> None:
    infer = servers.start("rope", parallel=2, ctx_size=512)
    stub = infer_stub(infer.port)
    prompt = prepare(prep_stub(prep_servers("rope")), [message("user", "go on")])
    stream = stub.Generate(
        infer_pb2.GenerateRequest(prompt=prompt, max_tokens=100_000, sampling=SEEDED), timeout=60
    )
    assert next(stream).HasField("started")

    def boom() -> bool:
        raise RuntimeError("injected: the engine loop itself fails")

    infer.engine._has_work = boom  # the loop's own wait condition: outside any request
    with pytest.raises(grpc.RpcError) as ended:
        list(stream)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(ended.value)[0] == "ENGINE_DIED"
    wait_until(lambda: health(infer.port) == NOT_SERVING, what="health NOT_SERVING")
    assert infer.died.is_set() and not infer.engine.alive
    for call in (
        lambda: list(stub.Generate(infer_pb2.GenerateRequest(prompt=prompt), timeout=10)),
        lambda: stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10),
    ):
        e = status_of(call)
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()


def test_an_infer_process_whose_engine_dies_exits_70(tiny, prep_servers) -> None:
    """Crash-only: the process exits non-zero, so compose or Kubernetes restarts it."""
    pair = tiny["rope"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = textwrap.dedent(
        f"""
        import sys
        from infer_service import __main__ as infer_main
        from infer_service.runner import executor
        def execute(self, plan):
            raise SystemExit("injected: the engine thread dies")
        executor.Executor.execute = execute
        sys.exit(infer_main.main([
            "--model", {str(pair.model)!r}, "--mmproj", {str(pair.mmproj)!r},
            "--host", "127.0.0.1", "--port", "{port}", "--ctx-size", "512", "--threads", "1",
        ]))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:

        def serving() -> bool:
            with contextlib.suppress(grpc.RpcError):
                return health(port) == SERVING
            return False

        wait_until(serving, what="the infer process SERVING")
        prompt = prepare(prep_stub(prep_servers("rope")), [message("user", "hi")])
        e = status_of(
            lambda: list(
                infer_stub(port).Generate(infer_pb2.GenerateRequest(prompt=prompt), timeout=30)
            )
        )
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
        assert proc.wait(timeout=30) == 70
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert "the engine thread died" in err


def test_a_session_whose_image_fails_ends_alone(
    servers: Servers, prep_servers, tmp_path: Path
) -> None:
    """Damaged pixels of a session that must be re-prefilled: that turn ends with DATA_LOSS
    after its Finished; the stream beside it gets every token."""
    infer = servers.start("mrope", parallel=2, ctx_size=1024, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    create(stub, "s", SEEDED)
    chat = Chat(prep, stub, "s", max_tokens=4)
    picture = image_bytes(64, 48, seed=5)
    assert chat.turn("look ", picture, " here").finished.persistence == (
        infer_pb2.PERSISTENCE_SAVED
    )
    servers.stop(infer)
    (media,) = (tmp_path / "media").glob("*.rgb")
    damaged = bytearray(media.read_bytes())
    damaged[0] ^= 0xFF
    media.write_bytes(bytes(damaged))
    # another layout: the saved KV state does not load, the turn re-prefills from pixels
    infer = servers.start("mrope", parallel=2, ctx_size=1536, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    chat.infer = stub
    other = stub.Generate(
        infer_pb2.GenerateRequest(
            prompt=prepare(prep, [message("user", "meanwhile")]), max_tokens=200, sampling=GREEDY
        ),
        timeout=60,
    )
    assert next(other).HasField("started")
    events: list[infer_pb2.GenerateResponse] = []
    with pytest.raises(grpc.RpcError) as failed:
        prompt = chat.ask("and?")
        for event in stub.Generate(
            infer_pb2.GenerateRequest(prompt=prompt, session_id="s", max_tokens=4), timeout=60
        ):
            events.append(event)
    assert failed.value.code() == grpc.StatusCode.DATA_LOSS, failed.value.details()
    assert reason_of(failed.value)[0] == "MEDIA_FAILED"
    assert events[-1].finished.reason == infer_pb2.FINISH_REASON_ERROR  # Finished, then status
    beside = Stream(list(other))
    assert beside.finished.reason == infer_pb2.FINISH_REASON_LENGTH
    assert beside.finished.usage.num_generated_tokens == 200
    assert session_info(stub, "s").num_turns == 1  # rolled back to its last completed turn


# -- 2. sessions that never lose a completed turn silently ------------------------------------


def image_turn(chat: Chat, k: int) -> tuple[Stream | None, grpc.RpcError | None]:
    """One turn with a new image: (its stream, the status error that followed it, if any)."""
    prompt = chat.ask(f"picture {k} ", image_bytes(120, 90, seed=100 + k), " what is it?")
    events: list[infer_pb2.GenerateResponse] = []
    error = None
    try:
        for event in chat.infer.Generate(
            infer_pb2.GenerateRequest(prompt=prompt, session_id=chat.session_id, max_tokens=6),
            timeout=60,
        ):
            events.append(event)
    except grpc.RpcError as e:
        error = e
    stream = Stream(events) if events else None
    if stream is not None and stream.of("finished"):
        chat.answer(stream)
    return stream, error


def test_a_full_disk_then_freed_then_restart_loses_no_completed_turn(
    servers: Servers, prep_servers, tmpfs: Path
) -> None:
    sessions = tmpfs / "sessions"
    infer = servers.start("mrope", parallel=1, ctx_size=1024, sessions_dir=sessions)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    create(stub, "long", SEEDED)
    create(stub, "other", SEEDED)
    chat = Chat(prep, stub, "long")
    filler = tmpfs / "filler"
    fill(filler, leave=150_000)

    saved = not_saved = 0
    for k in range(40):
        stream, error = image_turn(chat, k)
        assert stream is not None and stream.finished.reason in OK_REASONS, error
        if stream.finished.persistence == infer_pb2.PERSISTENCE_SAVED:
            # (after a turn that was not: what this one wrote holds that turn too, as the
            # restart below shows)
            assert error is None
            saved += 1
            continue
        # the turn completed, the session goes on in memory, and the client is told
        assert stream.finished.persistence == infer_pb2.PERSISTENCE_NOT_SAVED
        assert "not saved" in stream.finished.error
        assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reason, meta = reason_of(error)
        assert (reason, meta["storage"], meta["errno"]) == (
            "SESSION_NOT_SAVED",
            "STORAGE_FULL",
            "ENOSPC",
        )
        not_saved += 1
        if not_saved == 3:
            break
    assert saved >= 1 and not_saved == 3
    # a swap while the disk is full: the KV file on disk is older than the ledger, so the
    # swap-in re-prefills instead of decoding over a hole
    Chat(prep, stub, "other", max_tokens=3).turn("hello")
    e = status_of(lambda: stub.SaveSession(infer_pb2.SaveSessionRequest(session_id="long")))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(e)[0] == "STORAGE_FULL"
    reprefills = infer.engine.stats.num_session_reprefills
    stream, error = image_turn(chat, 100)  # still full: not saved, but served
    assert stream is not None and stream.finished.reason in OK_REASONS and error is not None
    assert infer.engine.stats.num_session_reprefills == reprefills + 1

    filler.unlink()  # room again: the next turn writes the whole current state
    stream, error = image_turn(chat, 101)
    assert error is None and stream is not None
    assert stream.finished.persistence == infer_pb2.PERSISTENCE_SAVED
    before = session_info(stub, "long")
    assert before.num_turns == saved + not_saved + 2
    servers.stop(infer)
    assert not [p for p in sessions.rglob(".tmp-*")], "a failed write left a temporary file"

    infer = servers.start("mrope", parallel=1, ctx_size=1024, sessions_dir=sessions)
    stub = infer_stub(infer.port)
    after = session_info(stub, "long")
    for name in ("num_turns", "num_cells", "next_position", "num_shifts", "num_media"):
        assert getattr(after, name) == getattr(before, name), name
    chat.infer = stub
    stream, error = image_turn(chat, 102)
    assert error is None and stream is not None and stream.finished.reason in OK_REASONS
    assert session_info(stub, "long").num_turns == before.num_turns + 1


def test_the_store_leaves_no_temporary_files_and_checks_pixels(tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / ".tmp-abc").write_bytes(b"half a write")
    (tmp_path / "media" / ".tmp-def").write_bytes(b"half a write")
    (tmp_path / ".tmp-now").write_bytes(b"another replica's write in progress")
    hours_ago = time.time() - 7200
    for old in (tmp_path / ".tmp-abc", tmp_path / "media" / ".tmp-def"):
        os.utime(old, (hours_ago, hours_ago))
    store = SessionStore(tmp_path)
    # left by a crash: removed at startup; a fresh one may be a write of a replica sharing it
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == [".tmp-now"]
    from slotwise_core.images import media_id

    rgb = bytes(range(48)) * 2
    mid = media_id(4, 8, rgb)
    store.save_media(mid, rgb)
    assert store.load_media(mid, 4, 8) == rgb
    (tmp_path / "media" / f"{mid}.rgb").write_bytes(rgb[:-1] + b"\0")
    with pytest.raises(ValueError, match="damaged"):
        store.load_media(mid, 4, 8)
    store.save("s", {"x": 1}, memoryview(b"kv-bytes"))
    assert store.load_header("s")["x"] == 1 and store.load("s").kv_state == b"kv-bytes"


# -- 3. bounded memory ------------------------------------------------------------------------


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_150_image_turns_keep_memory_bounded(
    servers: Servers, prep_servers, tmp_path: Path
) -> None:
    # (the media caches get 32 MB: the images checked keep 8 of them, the growth they may cause)
    infer = servers.start(
        "mrope", parallel=1, ctx_size=2048, sessions_dir=tmp_path, cache_bytes=32 << 20
    )
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    create(stub, "long", GREEDY)
    chat = Chat(prep, stub, "long", max_tokens=4)
    growth_from = 0
    for k in range(150):
        if len(chat.messages) > 8:  # the client keeps its own history short
            chat.messages = chat.messages[-2:]
        prompt = chat.ask(f"{k} ", image_bytes(224, 224, seed=k), " ?")
        stream = Stream(
            list(stub.Generate(infer_pb2.GenerateRequest(prompt=prompt, session_id="long",
                                                         max_tokens=4), timeout=60))
        )  # fmt: skip
        chat.answer(stream)
        assert stream.finished.persistence == infer_pb2.PERSISTENCE_SAVED
        if k == 30:
            growth_from = rss()
    growth = rss() - growth_from
    session = infer.engine.sessions.table.get("long")
    held = infer.engine.call(session.held_keys).result(5)
    assert session_info(stub, "long").num_shifts > 10
    assert set(session.pixels) == held and set(session.media) <= held
    assert not session.rgb  # all of it is on disk

    # and the disk keeps only the pixels of the images the session still holds (the last
    # deletions run on the io thread after the last write)
    def on_disk() -> set[str]:
        return {p.stem for p in (tmp_path / "media").glob("*.rgb")}

    wanted = session.media_ids()
    wait_until(lambda: on_disk() == wanted, what=f"pixels on disk == the {len(wanted)} held")
    assert growth < 50 << 20, f"RSS grew {growth >> 20} MB over 120 image turns"


async def _mailbox_of(events: list) -> list:
    box = Mailbox(EventRelay(asyncio.get_running_loop()))
    for e in events:
        box.put(e)
    return [await box.get() for _ in range(len(box))]


def test_a_slow_readers_mailbox_merges_instead_of_growing() -> None:
    deltas = [TokenDelta((k,), "x") for k in range(10_000)]
    progress = [PrefillProgress(50, 100), PrefillProgress(100, 100)]
    got = asyncio.run(_mailbox_of([*progress, *deltas]))
    assert got == [*progress, TokenDelta(tuple(range(10_000)), "x" * 10_000)]


def test_prep_checks_the_total_pixels_from_headers_before_decoding(prep_servers) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (10, 20, 30)).save(buf, "PNG")  # 16 MP, a few KB
    big = buf.getvalue()
    request = prep_pb2.PrepareRequest(
        chat=prep_pb2.Chat(messages=[message("user", "many", *([big] * 9))])
    )
    e = status_of(lambda: prep_stub(prep_servers("mrope")).Prepare(request, timeout=30))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pixels together" in e.details()


# -- 4. exact prefix reuse --------------------------------------------------------------------


def held_tokens(infer, slot: int) -> list[int]:
    def read() -> list[int]:
        ledger = infer.engine.slots[slot].ledger
        return [t for seg in ledger.segments for t in seg.token_ids]

    return infer.engine.call(read).result(5)


@pytest.mark.parametrize("pair", ["rope", "mrope"])
def test_reuse_after_a_shift_gives_what_a_fresh_slot_gives(
    servers: Servers, prep_servers, pair: str
) -> None:
    """A request equal to what a shifted slot holds (plus a question) must not reuse cells
    that attended to the evicted text: same tokens in, same tokens out."""
    infer = servers.start(pair, parallel=1, ctx_size=256)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers(pair))
    first = prepare(prep, [message("user", "tell me everything you know about the sea")])
    keep = 4
    shifted = Stream(
        list(
            stub.Generate(
                infer_pb2.GenerateRequest(
                    prompt=first,
                    max_tokens=400,
                    sampling=GREEDY,  # never stops by itself on a random model: it shifts
                    context=infer_pb2.ContextOptions(keep=keep),
                ),
                timeout=60,
            )
        )
    )
    assert shifted.shifts, "the first request must shift"
    held = held_tokens(infer, 0)
    pinned = infer.engine.call(lambda: infer.engine.slots[0].ledger.num_pinned_cells).result(5)
    assert keep <= pinned < len(held) // 2  # keep pins whole items: the first chunk
    question = prepare(prep, [message("user", " and?")]).chunks[-1].text.token_ids
    tokens = [*held, *question]
    again = prompt_pb2.PreparedPrompt(
        fingerprint=first.fingerprint,
        chunks=[prompt_pb2.Chunk(text=prompt_pb2.TextChunk(token_ids=tokens))],
        num_cells=len(tokens),
        num_positions=len(tokens),
    )
    req = infer_pb2.GenerateRequest(prompt=again, max_tokens=24, sampling=SEEDED)
    reused = Stream(list(stub.Generate(req, timeout=60)))
    assert reused.started.num_reused_cells <= pinned  # only what was before the eviction
    servers.stop(infer)
    fresh_server = servers.start(pair, parallel=1, ctx_size=256)
    fresh = Stream(list(infer_stub(fresh_server.port).Generate(req, timeout=60)))
    assert fresh.started.num_reused_cells == 0
    assert reused.token_ids == fresh.token_ids
    # and a slot that did not shift still reuses the whole prefix, with the same result
    fresh_server = servers.start(pair, parallel=1, ctx_size=256)
    short = infer_pb2.GenerateRequest(prompt=first, max_tokens=12, sampling=SEEDED)
    once, twice = (Stream(list(infer_stub(fresh_server.port).Generate(short))) for _ in "12")
    assert (once.started.num_reused_cells, not once.shifts) == (0, True)
    assert twice.started.num_reused_cells == first.num_cells - 1
    assert twice.token_ids == once.token_ids


# -- 5. a precise contract for options --------------------------------------------------------


def test_a_turn_that_sets_only_policy_keeps_the_sessions_keep(
    servers: Servers, prep_servers
) -> None:
    infer = servers.start("mrope", parallel=1, ctx_size=512)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    stub.CreateSession(
        infer_pb2.CreateSessionRequest(
            session_id="pinned", sampling=SEEDED, context=infer_pb2.ContextOptions(keep=6)
        ),
        timeout=10,
    )
    chat = Chat(prep, stub, "pinned", max_tokens=4)
    chat.turn("system-like start", context=infer_pb2.ContextOptions(policy=GAP))
    session = infer.engine.sessions.table.get("pinned")
    pinned = infer.engine.call(lambda: session.ledger.num_pinned_cells).result(5)
    assert pinned >= 6  # the turn's policy came on top of the session's keep
    info = session_info(stub, "pinned")
    assert info.context.keep == 6 and info.context.HasField("keep")


def test_a_stalled_readers_shifts_and_deltas_fold() -> None:
    from infer_service.events import ContextShift
    from infer_service.kv.ledger import Policy

    events = []
    for k in range(1000):
        events.append(TokenDelta((k,), "x"))
        events.append(ContextShift(Policy.GAP, 2, 2, (), 10, 100 + k))
    got = asyncio.run(_mailbox_of(events))
    assert len(got) <= Mailbox.MAX_EVENTS + 1
    shifts = [e for e in got if isinstance(e, ContextShift)]
    deltas = [e for e in got if isinstance(e, TokenDelta)]
    assert sum(s.num_cells_evicted for s in shifts) == 2000  # totals survive the folding
    assert [t for d in deltas for t in d.token_ids] == list(range(1000))
    assert shifts[-1].next_position_after == 1099
