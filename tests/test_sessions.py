"""Sessions and prefix reuse, end to end: real prep and infer servers on loopback, real llama.cpp
on the tiny pairs, no mocks.

A client runs a conversation the way a chat UI would: every turn it prepares the whole chat and
sends only the chunks from the previous assistant reply on (``first_message``), so that the
reply, as the chat template renders it, can be reused from the tokens the model generated.
"""

from __future__ import annotations

import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from infer_service.sessions.store import SessionStore
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.media import image_bytes
from support.rpc import Stream
from support.wait import wait_until

GREEDY = infer_pb2.SamplingParams(temperature=0.0)
# Greedy decoding of a random-weight model repeats one token, which would hide a wrong KV
# state; seeded sampling is just as deterministic and depends on every logit.
SEEDED = infer_pb2.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
OK_REASONS = (infer_pb2.FINISH_REASON_STOP, infer_pb2.FINISH_REASON_LENGTH)
MAX_MESSAGE = 256 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


# -- clients -------------------------------------------------------------------------------------


def infer_stub(port: int) -> infer_pb2_grpc.InferServiceStub:
    return infer_pb2_grpc.InferServiceStub(
        grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    )


def prep_stub(port: int) -> prep_pb2_grpc.PrepServiceStub:
    return prep_pb2_grpc.PrepServiceStub(
        grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    )


def message(role: str, *parts: str | bytes) -> prep_pb2.Message:
    return prep_pb2.Message(
        role=role,
        parts=[
            prep_pb2.Part(text=p)
            if isinstance(p, str)
            else prep_pb2.Part(image=prep_pb2.Image(data=p))
            for p in parts
        ],
    )


def prepare(
    prep: prep_pb2_grpc.PrepServiceStub, messages: list[prep_pb2.Message], first: int = 0
) -> prompt_pb2.PreparedPrompt:
    request = prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=messages), first_message=first)
    return prep.Prepare(request, timeout=30).prompt


def decoded_generated(stream: Stream) -> int:
    """Generated tokens that went into the cache: the last sampled one does not when the turn
    ends by max_tokens (an end-of-generation token is never counted)."""
    usage = stream.finished.usage
    length = stream.finished.reason == infer_pb2.FINISH_REASON_LENGTH
    return usage.num_generated_tokens - (1 if length else 0)


def generate(stub: infer_pb2_grpc.InferServiceStub, **fields: Any) -> Stream:
    return Stream(list(stub.Generate(infer_pb2.GenerateRequest(**fields), timeout=120)))


def status_of(call: Callable[[], Any]) -> grpc.RpcError:
    try:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded; an error status was expected")


def session_info(stub: infer_pb2_grpc.InferServiceStub, session_id: str) -> infer_pb2.SessionInfo:
    return stub.GetSession(infer_pb2.GetSessionRequest(session_id=session_id), timeout=10).session


def create(
    stub: infer_pb2_grpc.InferServiceStub,
    session_id: str,
    sampling: infer_pb2.SamplingParams = GREEDY,
) -> infer_pb2.SessionInfo:
    request = infer_pb2.CreateSessionRequest(session_id=session_id, sampling=sampling)
    return stub.CreateSession(request, timeout=10).session


@dataclass
class Chat:
    """One conversation, run turn by turn as a session."""

    prep: prep_pb2_grpc.PrepServiceStub
    infer: infer_pb2_grpc.InferServiceStub
    session_id: str
    max_tokens: int = 10
    messages: list[prep_pb2.Message] = field(default_factory=list)
    prompts: list[prompt_pb2.PreparedPrompt] = field(default_factory=list)

    def ask(self, *parts: str | bytes) -> prompt_pb2.PreparedPrompt:
        """Add a user message; returns this turn's chunks (from the previous reply on)."""
        first = len(self.messages) - 1 if self.messages else 0
        self.messages.append(message("user", *parts))
        prompt = prepare(self.prep, self.messages, first)
        self.prompts.append(prompt)
        return prompt

    def answer(self, stream: Stream) -> None:
        self.messages.append(message("assistant", stream.text))

    def turn(self, *parts: str | bytes, **fields: Any) -> Stream:
        prompt = self.ask(*parts)
        fields.setdefault("max_tokens", self.max_tokens)
        stream = generate(self.infer, prompt=prompt, session_id=self.session_id, **fields)
        self.answer(stream)
        return stream


def atoms_of_prompt(prompt: prompt_pb2.PreparedPrompt) -> list[object]:
    out: list[object] = []
    for c in prompt.chunks:
        if c.WhichOneof("kind") == "media":
            out.append(c.media.media_id)
        else:
            out.extend(c.text.token_ids)
    return out


def held_atoms(engine: Any, session_id: str) -> tuple[list[object], list[int]]:
    """What the session's ledger holds: (atoms before the trailing generated tokens, those
    tokens), read on the engine thread. Media keys are "<media_id>" or "<media_id>:<slice>"."""

    def read() -> tuple[list[object], list[int]]:
        ledger = engine.sessions.table.get(session_id).ledger
        tail = ledger.generated_tail()
        prompt: list[object] = []
        for seg in ledger.segments[:tail]:
            if seg.media_id is not None:
                prompt.append(seg.media_id.partition(":")[0])
            else:
                prompt.extend(seg.token_ids)
        return prompt, [t for seg in ledger.segments[tail:] for t in seg.token_ids]

    return engine.call(read).result(10)


def saved_turns(path: Path) -> int | None:
    """num_turns in a session file's header (None while it is missing or being replaced)."""
    try:
        return int(SessionStore(path.parent).load_header(path.stem)["num_turns"])
    except (OSError, ValueError, KeyError):
        return None


def wait_saved(path: Path, num_turns: int) -> None:
    """Saving runs after a turn's Finished event, off the engine thread: wait for it."""
    wait_until(
        lambda: saved_turns(path) == num_turns, what=f"{path.name} recording {num_turns} turns"
    )


# -- servers -------------------------------------------------------------------------------------


class Servers:
    """In-process infer servers that a test may stop and start again on the same directory."""

    def __init__(self, loop_thread: LoopThread, tiny: dict[str, TinyPair]):
        self.loop_thread = loop_thread
        self.tiny = tiny
        self.running: list[Any] = []

    def start(
        self, name: str, *, sessions_dir: Path | None = None, cache_bytes: int = 1 << 30,
        **config: Any,
    ) -> Any:  # fmt: skip
        from infer_service.__main__ import start
        from infer_service.runner.runtime import RuntimeConfig

        pair = self.tiny[name]
        config.setdefault("threads", 1)
        config.setdefault("ctx_size", 1024)
        runtime = RuntimeConfig(pair.model, pair.mmproj, **config)
        running = self.loop_thread.run(
            start(runtime, sessions_dir=sessions_dir, cache_bytes=cache_bytes)
        )
        self.running.append(running)
        return running

    def stop(self, running: Any) -> None:
        self.running.remove(running)
        self.loop_thread.run(running.stop(0))

    def close(self) -> None:
        for r in list(self.running):
            self.stop(r)


@pytest.fixture
def servers(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Servers]:
    s = Servers(loop_thread, tiny)
    yield s
    s.close()


def image(seed: int, width: int = 64, height: int = 48) -> bytes:
    return image_bytes(width, height, seed=seed)


# -- 1. long conversations with images ------------------------------------------------------------


@pytest.mark.parametrize(("pair", "parallel"), [("mrope", 2), ("rope", 1)])
def test_thirty_turns_with_an_image_each_shift_and_never_fail(
    pair: str, parallel: int, servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    infer = servers.start(pair, parallel=parallel, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    info = stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)
    capacity = info.num_cells_per_slot
    create(stub, "long")
    chat = Chat(prep_stub(prep_servers(pair)), stub, "long", max_tokens=24)
    num_shifts = 0
    for t in range(30):
        stream = chat.turn(f"turn {t}: what is in ", image(t, 96, 64), " now?")
        assert stream.finished.reason in OK_REASONS, (t, stream.finished.error)
        assert stream.started.num_capacity_cells == capacity
        for shift in stream.shifts:
            assert shift.num_cells_used_after <= capacity
            assert shift.num_cells_evicted > 0
            if info.can_shift:
                assert shift.policy == infer_pb2.SHIFT_POLICY_SHIFT
            else:
                assert shift.policy in (
                    infer_pb2.SHIFT_POLICY_GAP,
                    infer_pb2.SHIFT_POLICY_REPREFILL,
                )
        num_shifts += len(stream.shifts)
        assert stream.finished.usage.num_shifts == len(stream.shifts)
        s = session_info(stub, "long")
        assert s.num_turns == t + 1
        assert 0 < s.num_cells <= capacity
        assert s.num_media >= 1  # the image just sent is always held
        assert s.resident
    assert num_shifts > 0, "30 turns with images must overflow the slot"
    s = session_info(stub, "long")
    assert (s.num_turns, s.num_shifts) == (30, num_shifts)
    assert info.uses_mrope == (pair == "mrope")


# -- 2. prefix reuse ----------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_a_session_turn_reuses_the_generated_reply_and_decodes_only_the_rest(
    pair: str, servers: Servers, prep_servers: Callable[[str], int]
) -> None:
    infer = servers.start(pair, parallel=1)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers(pair))
    create(stub, "s")
    chat = Chat(prep, stub, "s", max_tokens=12)
    previous: Stream | None = None
    cells_before = 0
    for t in range(3):
        prompt = chat.ask(f"question {t} about ", image(t), " please")
        stream = generate(stub, prompt=prompt, session_id="s", max_tokens=12)
        chat.answer(stream)
        assert stream.finished.reason in OK_REASONS
        reused = stream.started.num_reused_cells
        # greedy: the reply comes back exactly as generated, so all of it that was decoded is
        # reused (the last sampled token of a max_tokens turn never was)
        assert reused == (decoded_generated(previous) if previous else 0)
        if previous:
            assert reused > 0
        assert stream.finished.usage.num_reused_cells == reused
        assert stream.started.num_prompt_cells == prompt.num_cells
        assert stream.finished.usage.num_prompt_cells == prompt.num_cells
        prefill = stream.of("prefill")
        assert prefill and {p.num_cells_total for p in prefill} == {prompt.num_cells - reused}
        assert prefill[-1].num_cells_done == prompt.num_cells - reused
        # the session holds what it held before, plus this turn (less what it reused), plus
        # what it generated and decoded
        s = session_info(stub, "s")
        expected = cells_before + prompt.num_cells - reused + decoded_generated(stream)
        assert s.num_cells == expected
        cells_before = s.num_cells
        # and it is exactly the chat a client would send whole, then the reply so far
        whole = prepare(prep, chat.messages[:-1])
        held, gen = held_atoms(infer.engine, "s")
        assert held == atoms_of_prompt(whole)
        assert gen == stream.token_ids[: decoded_generated(stream)]
        previous = stream


def expected_plain_reuse(prompt: prompt_pb2.PreparedPrompt) -> int:
    """The same prompt again: everything but the last text token, never inside a media group
    (a prompt that ends with a group, e.g. <|vision_end|>, decodes the whole group again)."""
    chunks = list(prompt.chunks)
    last = chunks[-1]
    if last.media_group == 0:
        return prompt.num_cells - 1
    first = len(chunks) - 1
    while first > 0 and chunks[first - 1].media_group == last.media_group:
        first -= 1
    return sum(
        c.media.num_cells if c.WhichOneof("kind") == "media" else len(c.text.token_ids)
        for c in chunks[:first]
    )


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_a_repeated_prompt_decodes_only_its_last_token(
    pair: str, servers: Servers, prep_servers: Callable[[str], int]
) -> None:
    infer = servers.start(pair, parallel=1)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers(pair))
    system = message("system", "You are a careful assistant who describes pictures.")
    prompt = prepare(prep, [system, message("user", "what is in ", image(3), " here?")])
    first = generate(stub, prompt=prompt, sampling=SEEDED, max_tokens=8)
    assert first.started.num_reused_cells == 0
    second = generate(stub, prompt=prompt, sampling=SEEDED, max_tokens=8)
    assert second.started.num_reused_cells == expected_plain_reuse(prompt) == prompt.num_cells - 1
    assert second.finished.usage.num_reused_cells == prompt.num_cells - 1
    assert second.finished.usage.num_prompt_cells == prompt.num_cells
    assert [p.num_cells_total for p in second.of("prefill")] == [1]
    assert second.token_ids == first.token_ids  # the reused cache is the one a fresh run builds

    # a prompt that shares only the system message (and the tokens that open the next one)
    other = prepare(prep, [system, message("user", "zebra crossing, no picture")])
    sys_cells = sum(len(c.text.token_ids) for c in prompt.chunks if c.message_index == 0)
    assert sys_cells == sum(len(c.text.token_ids) for c in other.chunks if c.message_index == 0)
    a = [t for c in prompt.chunks if c.message_index == 1 for t in c.text.token_ids]
    b = [t for c in other.chunks if c.message_index == 1 for t in c.text.token_ids]
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), 0)
    third = generate(stub, prompt=other, sampling=SEEDED, max_tokens=8)
    assert third.started.num_reused_cells == sys_cells + common
    assert third.finished.usage.num_reused_cells == sys_cells + common
    assert [p.num_cells_total for p in third.of("prefill")][
        -1
    ] == other.num_cells - sys_cells - common


def test_a_prompt_ending_in_a_media_group_decodes_that_group_again(
    servers: Servers, prep_servers: Callable[[str], int]
) -> None:
    """mrope wraps an image in <|vision_start|> … <|vision_end|>: a raw prompt can end with the
    group; its last token is inside it, so the whole group is decoded again."""
    infer = servers.start("mrope", parallel=1)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    marker = prep.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info.media_marker
    raw = prep_pb2.RawPrompt(
        text=f"look: {marker}", images=[prep_pb2.Image(data=image(9))], add_special=True
    )
    prompt = prep.Prepare(prep_pb2.PrepareRequest(raw=raw), timeout=30).prompt
    assert prompt.chunks[-1].media_group != 0
    generate(stub, prompt=prompt, sampling=GREEDY, max_tokens=4)
    again = generate(stub, prompt=prompt, sampling=GREEDY, max_tokens=4)
    group_cells = sum(
        c.media.num_cells if c.WhichOneof("kind") == "media" else len(c.text.token_ids)
        for c in prompt.chunks
        if c.media_group == prompt.chunks[-1].media_group
    )
    assert again.started.num_reused_cells == expected_plain_reuse(prompt)
    assert again.started.num_reused_cells == prompt.num_cells - group_cells


# -- 3. persistence across a crash and a restart ---------------------------------------------------


class InferProcess:
    """python -m infer_service in a child process."""

    def __init__(self, pair: TinyPair, sessions_dir: Path, log: Path):
        self.log = log
        for _ in range(3):  # a free port may be taken before the child binds it: try another
            if self._start(pair, sessions_dir):
                return
        raise AssertionError(f"infer_service did not start:\n{log.read_text()}")

    def _start(self, pair: TinyPair, sessions_dir: Path) -> bool:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [
            sys.executable, "-m", "infer_service", "--model", str(pair.model),
            "--mmproj", str(pair.mmproj), "--ctx-size", "1024", "--parallel", "1",
            "--threads", "1", "--host", "127.0.0.1", "--port", str(self.port),
            "--sessions-dir", str(sessions_dir), "--log-level", "warning",
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self.stub = infer_stub(self.port)
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                self.stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=2)
                return self.proc.poll() is None
            except grpc.RpcError:
                time.sleep(0.1)
        self.proc.kill()
        self.proc.wait(30)
        return False

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(30)


def test_sessions_survive_sigkill_mid_turn_and_a_clean_restart(
    tiny: dict[str, TinyPair], prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    pair = tiny["mrope"]
    sessions_dir = tmp_path / "sessions"
    prep = prep_stub(prep_servers("mrope"))
    server = InferProcess(pair, sessions_dir, tmp_path / "infer.log")
    try:
        create(server.stub, "kept", SEEDED)
        chat = Chat(prep, server.stub, "kept", max_tokens=8)
        replies = []
        for t in range(3):
            done = chat.turn(f"turn {t} ", image(20 + t), " ok", turn_note=f"note {t}".encode())
            assert done.finished.reason in OK_REASONS
            replies.append((done.text, done.finished.usage.num_generated_tokens))
            if t == 1:  # a checkpoint of two turns; the third is in the journal only
                server.stub.SaveSession(infer_pb2.SaveSessionRequest(session_id="kept"), timeout=10)
        after3 = session_info(server.stub, "kept")
        assert after3.num_turns == 3
        wait_saved(sessions_dir / "kept.session", 3)  # by itself: no SaveSession call

        # a 4th turn that would run for a long time (greedy: the tiny model repeats one token
        # and never ends it, where sampling soon picks the end token); kill the process once
        # tokens flow
        prompt4 = chat.ask("and now a very long story about ", image(30), " please")
        request4 = infer_pb2.GenerateRequest(
            prompt=prompt4, session_id="kept", max_tokens=1 << 20, sampling=GREEDY
        )
        events = server.stub.Generate(request4, timeout=60)
        seen: list[int] = []
        for event in events:
            if event.WhichOneof("event") == "delta":
                seen.extend(event.delta.token_ids)
                if len(seen) >= 3:
                    break
        assert len(seen) >= 3, "the 4th turn ended before it could be killed"
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        with pytest.raises(grpc.RpcError):
            list(events)

        # the last completed turn is what comes back
        server = InferProcess(pair, sessions_dir, tmp_path / "infer.log")
        s = session_info(server.stub, "kept")
        assert (s.num_turns, s.num_cells, s.next_position) == (
            3, after3.num_cells, after3.next_position,
        )  # fmt: skip
        assert not s.resident
        # each completed turn's record came back with it: what it generated, and its note
        got = server.stub.GetSession(
            infer_pb2.GetSessionRequest(session_id="kept", num_records=2), timeout=10
        ).session.records
        assert [(r.turn, r.note, r.text, r.usage.num_generated_tokens) for r in got] == [
            (t + 1, f"note {t}".encode(), *replies[t]) for t in (1, 2)
        ]
        assert all(r.reason in OK_REASONS and r.created > 0 for r in got)
        again = generate(
            server.stub, prompt=prompt4, session_id="kept", max_tokens=8, sampling=GREEDY
        )
        assert again.finished.reason in OK_REASONS
        # the KV state came back from disk: the turn starts the way the killed one did
        n = min(len(seen), len(again.token_ids))  # deltas that piled up arrive merged
        assert n >= 3 and again.token_ids[:n] == seen[:n]
        chat.answer(again)
        after4 = session_info(server.stub, "kept")
        assert after4.num_turns == 4

        # a clean stop (SIGTERM) keeps everything too, in a checkpoint
        assert server.stop(signal.SIGTERM) == 0
        assert not (sessions_dir / "kept.turns").exists()
        server = InferProcess(pair, sessions_dir, tmp_path / "infer.log")
        chat.infer = server.stub
        listed = server.stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10).sessions
        assert [x.session_id for x in listed] == ["kept"]
        s = session_info(server.stub, "kept")
        assert (s.num_turns, s.num_cells, s.next_position) == (
            4, after4.num_cells, after4.next_position,
        )  # fmt: skip
        assert chat.turn("one more ", image(31), " thanks").finished.reason in OK_REASONS
        assert session_info(server.stub, "kept").num_turns == 5
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)


# -- 4. more sessions than slots ---------------------------------------------------------------

SCRIPTS = {
    sid: [(f"{sid} turn {t}: describe ", image(40 + 7 * k + t), " briefly") for t in range(3)]
    for k, sid in enumerate(["a", "b", "c"])
}


def run_round_robin(
    stub: infer_pb2_grpc.InferServiceStub,
    prep: prep_pb2_grpc.PrepServiceStub,
    ids: list[str],
    capacity: int,
) -> dict[str, list[tuple[list[int], infer_pb2.SessionInfo]]]:
    chats = {}
    for sid in ids:
        create(stub, sid, SEEDED)
        chats[sid] = Chat(prep, stub, sid, max_tokens=10)
    results: dict[str, list[tuple[list[int], infer_pb2.SessionInfo]]] = {sid: [] for sid in ids}
    for t in range(3):
        for sid in ids:
            stream = chats[sid].turn(*SCRIPTS[sid][t])
            assert stream.finished.reason in OK_REASONS
            s = session_info(stub, sid)
            assert s.num_turns == t + 1
            assert 0 < s.num_cells <= capacity
            assert s.resident
            results[sid].append((stream.token_ids, s))
        listed = stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10).sessions
        assert sorted(x.session_id for x in listed) == sorted(ids)
    return results


def run_alone(
    stub: infer_pb2_grpc.InferServiceStub, prep: prep_pb2_grpc.PrepServiceStub, sid: str
) -> list[tuple[list[int], infer_pb2.SessionInfo]]:
    create(stub, sid, SEEDED)
    chat = Chat(prep, stub, sid, max_tokens=10)
    out = []
    for parts in SCRIPTS[sid]:
        stream = chat.turn(*parts)
        out.append((stream.token_ids, session_info(stub, sid)))
    return out


def test_more_sessions_than_slots_swap_and_keep_their_state_exactly(
    servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    prep = prep_stub(prep_servers("mrope"))
    # the reference: each conversation alone, never swapped out between its turns
    alone = servers.start("mrope", parallel=1)
    reference = {sid: run_alone(infer_stub(alone.port), prep, sid) for sid in SCRIPTS}
    servers.stop(alone)

    # three sessions taking turns on one slot: every turn swaps (KV state through disk) ...
    swapped = servers.start("mrope", parallel=1, sessions_dir=tmp_path)
    stub = infer_stub(swapped.port)
    capacity = stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10).num_cells_per_slot
    results = run_round_robin(stub, prep, list(SCRIPTS), capacity)
    listed = stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10).sessions
    assert [x.session_id for x in listed if x.resident] == ["c"]
    stats = swapped.engine.stats
    assert stats.num_session_restores >= 9 and stats.num_session_reprefills == 0
    # ... and without a sessions dir (the ledger is decoded again on every swap-in)
    reprefilled = servers.start("mrope", parallel=1)
    stub2 = infer_stub(reprefilled.port)
    results2 = run_round_robin(stub2, prep, list(SCRIPTS), capacity)
    assert reprefilled.engine.stats.num_session_reprefills >= 6

    for sid, ref in reference.items():
        for t, (ids, info) in enumerate(ref):
            for got in (results[sid][t], results2[sid][t]):
                assert got[0] == ids, (sid, t)
                assert (got[1].num_cells, got[1].next_position, got[1].num_media) == (
                    info.num_cells, info.next_position, info.num_media,
                ), (sid, t)  # fmt: skip


# -- 5. bad ids, corrupt files, concurrent turns ---------------------------------------------


@pytest.mark.parametrize(
    "bad", ["../x", "a/b", "x" * 65, ".", "..", "...", ".x", "a..b", "-x", "a b"]
)
def test_invalid_session_ids_are_refused(bad: str, servers: Servers, tmp_path: Path) -> None:
    infer = servers.start("mrope", parallel=1, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    code = grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: create(stub, bad)).code() == code
    assert status_of(lambda: session_info(stub, bad)).code() == code
    for call in (
        lambda: stub.DeleteSession(infer_pb2.DeleteSessionRequest(session_id=bad), timeout=10),
        lambda: stub.SaveSession(infer_pb2.SaveSessionRequest(session_id=bad), timeout=10),
        lambda: stub.RestoreSession(infer_pb2.RestoreSessionRequest(session_id=bad), timeout=10),
    ):
        assert status_of(call).code() == code
    e = status_of(lambda: stub.Generate(infer_pb2.GenerateRequest(session_id=bad), timeout=10))
    assert e.code() == code
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", "media"]  # nothing written


def test_session_errors_have_clear_statuses_and_the_service_goes_on(
    servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    infer = servers.start("mrope", parallel=1, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    assert create(stub, "x" * 64).session_id == "x" * 64  # the longest id
    picked = create(stub, "").session_id  # the server picks one
    assert len(picked) == 32
    wait_saved(tmp_path / f"{picked}.session", 0)
    assert status_of(lambda: create(stub, picked)).code() == grpc.StatusCode.ALREADY_EXISTS

    prompt = prepare(prep, [message("user", "hi ", image(50), " there")])
    e = status_of(lambda: generate(stub, prompt=prompt, session_id="nobody", max_tokens=2))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "nobody" in e.details()
    for call in (
        lambda: session_info(stub, "nobody"),
        lambda: stub.DeleteSession(infer_pb2.DeleteSessionRequest(session_id="nobody")),
        lambda: stub.SaveSession(infer_pb2.SaveSessionRequest(session_id="nobody")),
        lambda: stub.RestoreSession(infer_pb2.RestoreSessionRequest(session_id="nobody")),
    ):
        assert status_of(call).code() == grpc.StatusCode.NOT_FOUND

    # a turn while another turn of the same session runs
    create(stub, "busy")
    long_turn = stub.Generate(
        infer_pb2.GenerateRequest(prompt=prompt, session_id="busy", max_tokens=1 << 20), timeout=60
    )
    assert next(long_turn).WhichOneof("event") == "started"
    for call in (
        lambda: generate(stub, prompt=prompt, session_id="busy", max_tokens=2),
        lambda: stub.DeleteSession(infer_pb2.DeleteSessionRequest(session_id="busy")),
        lambda: stub.SaveSession(infer_pb2.SaveSessionRequest(session_id="busy")),
        lambda: stub.RestoreSession(infer_pb2.RestoreSessionRequest(session_id="busy")),
    ):
        e = status_of(call)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "running" in e.details()
    long_turn.cancel()

    # the cancelled turn is not kept; the session is usable again as soon as it ended
    def turn_once_free() -> Stream | None:
        try:
            return generate(stub, prompt=prompt, session_id="busy", max_tokens=2)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            return None

    stream = wait_until(turn_once_free, what="the session free again")
    assert stream.finished.reason in OK_REASONS
    assert stream.started.num_reused_cells == 0
    assert session_info(stub, "busy").num_turns == 1

    # a turn that expects the session where the caller last saw it: refused once it moved on
    # (and the refusal leaves the session free)
    moved = status_of(
        lambda: generate(stub, prompt=prompt, session_id="busy", max_tokens=2, expect_turns=0)
    )
    assert moved.code() == grpc.StatusCode.FAILED_PRECONDITION and "1 turns" in moved.details()
    stateless = status_of(lambda: generate(stub, prompt=prompt, max_tokens=2, expect_turns=0))
    assert stateless.code() == grpc.StatusCode.INVALID_ARGUMENT
    again = generate(stub, prompt=prompt, session_id="busy", max_tokens=2, expect_turns=1)
    assert again.finished.reason in OK_REASONS
    assert session_info(stub, "busy").num_turns == 2

    # DeleteSession removes the file, and the pixels no other session refers to
    assert (tmp_path / "busy.session").is_file()
    assert len(list((tmp_path / "media").iterdir())) == 1
    stub.DeleteSession(infer_pb2.DeleteSessionRequest(session_id="busy"), timeout=10)
    assert not (tmp_path / "busy.session").exists()
    assert list((tmp_path / "media").iterdir()) == []
    assert status_of(lambda: session_info(stub, "busy")).code() == grpc.StatusCode.NOT_FOUND
    listed = stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10).sessions
    assert sorted(s.session_id for s in listed) == sorted([picked, "x" * 64])


def cancel_after_first_token(
    stub: infer_pb2_grpc.InferServiceStub, prompt: prompt_pb2.PreparedPrompt, session_id: str
) -> None:
    call = stub.Generate(
        infer_pb2.GenerateRequest(prompt=prompt, session_id=session_id, max_tokens=1 << 20),
        timeout=60,
    )
    for event in call:
        if event.WhichOneof("event") == "delta":
            break
    call.cancel()


def wait_idle(stub: infer_pb2_grpc.InferServiceStub) -> None:
    wait_until(
        lambda: not stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10).num_active,
        what="the engine idle",
    )


@pytest.mark.parametrize("persisted", [True, False])
def test_an_unfinished_turn_leaves_no_trace(
    persisted: bool, servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    infer = servers.start("mrope", parallel=1, sessions_dir=tmp_path if persisted else None)
    stub = infer_stub(infer.port)
    create(stub, "u")
    chat = Chat(prep_stub(prep_servers("mrope")), stub, "u", max_tokens=6)
    chat.turn("one ", image(95), " ok")
    before = session_info(stub, "u")
    cancel_after_first_token(stub, chat.ask("two ", image(96), " ok"), "u")
    wait_idle(stub)
    after = session_info(stub, "u")
    assert (after.num_turns, after.num_cells, after.next_position) == (
        before.num_turns, before.num_cells, before.next_position,
    )  # fmt: skip


def test_restore_session_brings_back_the_last_saved_state(
    servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    infer = servers.start("mrope", parallel=1, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    create(stub, "r", SEEDED)
    chat = Chat(prep_stub(prep_servers("mrope")), stub, "r", max_tokens=8)
    for t in range(2):
        chat.turn(f"turn {t} ", image(60 + t), " ok")
    saved = stub.SaveSession(infer_pb2.SaveSessionRequest(session_id="r"), timeout=10).session
    assert saved.num_turns == 2
    snapshot = (tmp_path / "r.session").read_bytes()
    assert not (tmp_path / "r.turns").exists()  # a checkpoint folds the journal in
    messages = list(chat.messages)
    third = chat.turn("turn 2 ", image(62), " ok")
    assert session_info(stub, "r").num_turns == 3
    wait_saved(tmp_path / "r.session", 3)
    assert (tmp_path / "r.turns").stat().st_size < len(snapshot) // 4  # the turn, not the KV

    # RestoreSession reads the files: put the snapshot back and the 3rd turn is undone
    (tmp_path / "r.session").write_bytes(snapshot)
    (tmp_path / "r.turns").unlink()
    restored = stub.RestoreSession(infer_pb2.RestoreSessionRequest(session_id="r"), timeout=10)
    s = restored.session
    assert (s.num_turns, s.num_cells, s.next_position, s.resident) == (
        2, saved.num_cells, saved.next_position, False,
    )  # fmt: skip
    chat.messages = messages
    again = chat.turn("turn 2 ", image(62), " ok")
    assert again.token_ids == third.token_ids
    assert infer.engine.stats.num_session_reprefills == 0  # the KV state itself came back


def corrupt_files(real: bytes) -> dict[str, bytes]:
    """Damaged session files by id; ``real`` is a good file to cut short."""
    # after the 16-byte magic: the header length and the generation
    (n, generation) = struct.unpack_from("<QQ", real, 16)
    magic, v1 = b"SLOTWISE-SESS-G2", b"SLOTWISE-SESSION"  # v1: no generation (files of 0.1)
    return {
        "garbage": b"not a session at all",
        "empty": b"",
        "cut-header": real[: 16 + 16 + n - 10],
        "bad-json": magic + struct.pack("<QQ", 9, generation) + b"{not json",
        "no-ledger": magic + struct.pack("<QQ", 14, generation) + b'{"version": 1}',
        "future": v1 + struct.pack("<Q", 15) + b'{"version": 99}',
    }


def test_corrupt_and_foreign_session_files_are_reported_not_fatal(
    servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    sessions_dir, rope_dir = tmp_path / "mrope", tmp_path / "rope"
    # a session made by the rope pair
    rope = servers.start("rope", parallel=1, sessions_dir=rope_dir)
    create(infer_stub(rope.port), "foreign")
    servers.stop(rope)

    infer = servers.start("mrope", parallel=1, sessions_dir=sessions_dir)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    chats = {}
    for sid in ("good", "kv-cut", "no-pixels", "template"):
        create(stub, sid, SEEDED)
        chats[sid] = Chat(prep, stub, sid, max_tokens=6)
        chats[sid].turn(f"{sid} ", image(70 + len(chats)), " ok")
    servers.stop(infer)

    real = (sessions_dir / "template.session").read_bytes()
    for sid, data in corrupt_files(real).items():
        (sessions_dir / f"{sid}.session").write_bytes(data)
    # KV bytes cut short: the header is fine, so the session is rebuilt from its ledger
    kv = (sessions_dir / "kv-cut.session").read_bytes()
    (sessions_dir / "kv-cut.session").write_bytes(kv[: len(kv) - 5000])
    # the pixels of its image are gone: it cannot be rebuilt
    media = sessions_dir / "media"
    image_id = next(
        c.media.media_id for c in chats["no-pixels"].prompts[0].chunks if c.media.media_id
    )
    (media / f"{image_id}.rgb").unlink()
    shutil.copy(rope_dir / "foreign.session", sessions_dir / "foreign.session")

    infer = servers.start("mrope", parallel=1, sessions_dir=sessions_dir)
    stub = infer_stub(infer.port)
    for chat in chats.values():
        chat.infer = stub
    prompt = prepare(prep, [message("user", "anything ", image(79), " here")])

    def turn_on(sid: str) -> Callable[[], Stream]:
        return lambda: generate(stub, prompt=prompt, session_id=sid, max_tokens=2)

    def info_of(sid: str) -> Callable[[], infer_pb2.SessionInfo]:
        return lambda: session_info(stub, sid)

    for sid in ("garbage", "empty", "cut-header", "bad-json", "no-ledger", "future", "no-pixels"):
        e = status_of(turn_on(sid))
        assert e.code() == grpc.StatusCode.DATA_LOSS, (sid, e.details())
        assert sid in e.details()
        assert status_of(info_of(sid)).code() == grpc.StatusCode.DATA_LOSS
    e = status_of(lambda: generate(stub, prompt=prompt, session_id="foreign", max_tokens=2))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "another model" in e.details()

    listed = stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10).sessions
    assert sorted(s.session_id for s in listed if not s.error) == ["good", "kv-cut", "template"]
    broken = {s.session_id: s.error for s in listed if s.error}
    assert sorted(broken) == sorted(
        [
            "garbage",
            "empty",
            "cut-header",
            "bad-json",
            "no-ledger",
            "future",
            "no-pixels",
            "foreign",
        ]
    )
    assert "another model" in broken["foreign"] and "unreadable" in broken["garbage"]
    for sid in ("good", "kv-cut"):
        stream = chats[sid].turn("and again ", image(80), " ok")
        assert stream.finished.reason in OK_REASONS
        assert session_info(stub, sid).num_turns == 2
    assert infer.engine.stats.num_session_reprefills == 1  # kv-cut only

    # a broken session can be deleted (its file goes) and its id used again
    assert status_of(lambda: create(stub, "garbage")).code() == grpc.StatusCode.ALREADY_EXISTS
    stub.DeleteSession(infer_pb2.DeleteSessionRequest(session_id="garbage"), timeout=10)
    assert not (sessions_dir / "garbage.session").exists()
    assert create(stub, "garbage").num_turns == 0
    stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)


def test_a_session_file_vanishing_under_a_swapped_out_session_is_rebuilt(
    servers: Servers, prep_servers: Callable[[str], int], tmp_path: Path
) -> None:
    """The in-memory ledger is the truth: a damaged file on swap-in costs a re-prefill, never
    a hung or failed turn. (A missing file is a session deleted, by another replica sharing
    the directory, say: test_cluster.)"""
    infer = servers.start("mrope", parallel=1, sessions_dir=tmp_path)
    stub = infer_stub(infer.port)
    prep = prep_stub(prep_servers("mrope"))
    chats = {sid: Chat(prep, stub, sid, max_tokens=6) for sid in ("p", "q")}
    for sid, chat in chats.items():
        create(stub, sid, SEEDED)
        chat.turn(f"{sid} ", image(90), " ok")
    assert not session_info(stub, "p").resident
    wait_saved(tmp_path / "p.session", 1)
    (tmp_path / "p.session").write_bytes(b"damaged")
    stream = chats["p"].turn("more ", image(91), " ok")
    assert stream.finished.reason in OK_REASONS
    assert session_info(stub, "p").num_turns == 2
    assert infer.engine.stats.num_session_reprefills == 1
    # and the completed turn wrote a good file again
    reread = stub.RestoreSession(infer_pb2.RestoreSessionRequest(session_id="p"), timeout=10)
    assert reread.session.num_turns == 2
