"""The Python clients against real services on loopback ports (tiny models, no mocks)."""

from __future__ import annotations

import asyncio
import io
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image, ImageDraw

from clients.client import (
    NO_RETRY,
    AsyncSlotwiseClient,
    Delta,
    Finished,
    FinishReason,
    ImageSize,
    Message,
    Policy,
    Prefill,
    RetryPolicy,
    Shift,
    SlotwiseClient,
    SlotwiseError,
    Started,
    Tls,
    acollect,
    collect,
    image_pb,
    service_config,
)
from slotwise.v1 import infer_pb2, prep_pb2, prompt_pb2
from support.procs import free_port
from support.wait import PATIENCE, wait_until

CTX = 256  # cells per slot: small, so conversations outgrow it


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    img = Image.new("RGB", (width, height), (40 * seed % 256, 90, 200))
    ImageDraw.Draw(img).ellipse(
        (width // 4, height // 4, width // 2, height // 2), fill=(250, 9, 9)
    )
    return img


def png(width: int, height: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    picture(width, height, seed).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def addresses(prep_servers: Callable[[str], int], infer_server: Callable[..., Any]):
    """(prep, infer) addresses of the tiny M-RoPE pair; a fresh infer server per test."""
    infer = infer_server("mrope", ctx_size=CTX)
    return f"127.0.0.1:{prep_servers('mrope')}", f"127.0.0.1:{infer.port}"


@pytest.fixture
def client(addresses: tuple[str, str]):
    with SlotwiseClient(*addresses) as c:
        yield c


def conversation(*sizes: tuple[int, int]) -> list[Message]:
    messages = [Message.system("You describe pictures.")]
    for k, (w, h) in enumerate(sizes):
        messages.append(Message.user(png(w, h, k), f"What is in picture {k + 1}?"))
        if k < len(sizes) - 1:
            messages.append(Message.assistant("A red circle on blue, I think."))
    return messages


# -- inputs -----------------------------------------------------------------------------------


def test_message_parts_and_image_forms(tmp_path: Path) -> None:
    data = png(64, 48)
    path = tmp_path / "p.png"
    path.write_bytes(data)
    m = Message.user(path, "hi", data)
    assert m.role == "user" and m.text == "hi" and m.num_images == 2
    assert Message("user", "just text").parts == ("just text",)
    assert Message("user", (640, 480)).parts == ((640, 480),)
    assert image_pb(path, sizes_allowed=False).data == data
    assert image_pb(data, sizes_allowed=False).data == data
    decoded = Image.open(io.BytesIO(image_pb(picture(64, 48), sizes_allowed=False).data))
    assert decoded.size == (64, 48)
    assert image_pb((3, 4), sizes_allowed=True).size == prep_pb2.ImageSize(width=3, height=4)
    with pytest.raises(ValueError, match="only be counted"):
        image_pb(ImageSize(3, 4), sizes_allowed=False)
    with pytest.raises(TypeError, match=r"pathlib\.Path"):
        image_pb("cat.png", sizes_allowed=False)  # type: ignore[arg-type]


# -- the blocking client ----------------------------------------------------------------------


def test_model_and_server_info(client: SlotwiseClient) -> None:
    model = client.model_info()
    server = client.server_info()
    assert model.uses_mrope and model.supports_vision and model.has_chat_template
    assert model.media_marker
    assert (model.model_fingerprint, model.mmproj_fingerprint) == (
        server.model_fingerprint,
        server.mmproj_fingerprint,
    )
    assert server.num_cells_per_slot == CTX and server.uses_mrope and not server.can_shift
    assert server.num_active == 0 and server.stats.num_decodes == 0
    assert client.health("prep") == client.health("infer") == "SERVING"


def test_count_by_size_equals_prepare_by_pixels(client: SlotwiseClient, tmp_path: Path) -> None:
    path = tmp_path / "b.png"
    path.write_bytes(png(280, 168, 2))
    by_pixels = [
        Message.system("Compare."),
        Message.user(png(224, 224, 1), "and", path, "and", picture(196, 112)),
    ]
    by_size = [
        Message.system("Compare."),
        Message.user((224, 224), "and", ImageSize(280, 168), "and", (196, 112)),
    ]
    prepared = client.prepare(by_pixels)
    counted = client.count(by_size)
    assert prepared.num_images == 3
    assert counted == prepared.count()
    assert counted.num_cells > counted.num_positions  # M-RoPE: an image uses more cells
    assert sum(c.num_cells for c in counted.chunks) == counted.num_cells
    media = [c for c in counted.chunks if c.is_media]
    assert [c.media_group for c in media] == [1, 2, 3]
    assert media[0].num_cells == 64 and media[0].num_positions == 8  # 224 px = 8 x 8 merged patches
    # the raw form: markers replaced by the images in order
    marker = client.model_info().media_marker
    raw = client.count(f"look {marker} here", [(224, 224)])
    assert raw.num_cells == client.prepare(f"look {marker} here", [png(224, 224)]).num_cells


def test_chat_round_trip_with_typed_events(client: SlotwiseClient) -> None:
    messages = conversation((224, 224))
    events = list(client.chat(messages, max_tokens=24, temperature=0.0))
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    assert all(isinstance(e, Started | Prefill | Delta | Shift | Finished) for e in events)
    prepared = client.prepare(messages)
    started, finished = events[0], events[-1]
    assert started.num_prompt_cells == prepared.num_cells
    assert started.num_prompt_positions == prepared.num_positions
    assert started.num_capacity_cells == CTX
    prefill = [e for e in events if isinstance(e, Prefill)]
    assert prefill[-1].num_cells_done == prefill[-1].num_cells_total == prepared.num_cells
    deltas = [e for e in events if isinstance(e, Delta)]
    assert finished.reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert sum(len(d.token_ids) for d in deltas) == finished.usage.num_generated_tokens
    assert finished.usage.num_prompt_cells == prepared.num_cells

    # the next turn: the reply goes back as an assistant message, everything is prepared again
    reply = "".join(d.text for d in deltas).replace(client.model_info().media_marker, "")
    messages += [Message.assistant(reply or "."), Message.user(png(112, 112, 5), "And now?")]
    done = collect(client.chat(messages, max_tokens=8, temperature=0.0))
    assert done.started is not None and done.started.num_prompt_cells > prepared.num_cells
    assert done.reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_truncated_conversation_shifts_while_generating(client: SlotwiseClient) -> None:
    messages = conversation((224, 224), (280, 168), (224, 224))
    prepared = client.prepare(messages)
    assert prepared.num_cells > CTX
    done = collect(
        client.generate(
            prepared,
            max_tokens=120,
            temperature=0.0,
            keep=prepared.num_cells_of(0),
            truncate_prompt=True,
        )
    )
    assert done.started is not None
    started = done.started
    assert started.num_truncated_cells >= prepared.num_cells - (CTX - 1)  # whole units leave
    assert started.num_prompt_cells == prepared.num_cells - started.num_truncated_cells < CTX
    assert len(done.started.truncated_media_ids) >= 1
    assert done.usage.num_generated_tokens > 0
    # the reply outgrows what is left of the context: cells are freed while generating
    assert started.num_prompt_cells + done.usage.num_generated_tokens > CTX
    assert done.shifts and all(s.policy is Policy.GAP for s in done.shifts)  # M-RoPE: no seq_add
    assert done.usage.num_shifts == len(done.shifts)
    assert done.usage.num_evicted_cells == done.num_evicted_cells > 0
    assert all(s.num_cells_used_after <= CTX for s in done.shifts)


def test_breaking_off_a_stream_cancels_the_generation(client: SlotwiseClient) -> None:
    stream = client.generate(conversation((112, 112)), max_tokens=100_000, policy="gap")
    for event in stream:
        if isinstance(event, Delta):
            break
    stream.close()
    wait_until(lambda: client.server_info().num_active == 0, what="the slot freed")


def test_errors_carry_the_status_code(
    client: SlotwiseClient, prep_servers: Callable[[str], int]
) -> None:
    with pytest.raises(SlotwiseError) as e:
        client.prepare([Message("narrator", "once upon a time")])
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown role" in e.value.details()
    assert isinstance(e.value, grpc.RpcError)
    assert str(e.value).startswith("INVALID_ARGUMENT: ")
    assert (
        e.value.status is not None
        and e.value.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    )

    with pytest.raises(SlotwiseError) as e:
        client.count("no marker here", [(224, 224)])
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(ValueError, match="only be counted"):
        client.prepare([Message.user((224, 224), "hi")])  # no pixels: caught before sending

    big = client.prepare(conversation((224, 224), (280, 168), (224, 224)))
    with pytest.raises(SlotwiseError) as e:
        list(client.generate(big, policy="stop"))  # cannot fit and may not truncate
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    # a prompt prepared for another model pair
    with SlotwiseClient(f"127.0.0.1:{prep_servers('rope')}") as other:
        foreign = other.prepare(conversation((112, 112)))
    with pytest.raises(SlotwiseError) as e:
        list(client.generate(foreign, max_tokens=4))
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_a_client_without_an_address_for_a_service() -> None:
    with SlotwiseClient(prep_address="127.0.0.1:1") as c, pytest.raises(ValueError, match="infer"):
        c.server_info()
    with pytest.raises(ValueError):
        SlotwiseClient()


def test_a_session_conversation(client: SlotwiseClient) -> None:
    info = client.create_session("chat-1", temperature=0.0, truncate_prompt=True)
    assert (info.session_id, info.num_turns, info.sampling["temperature"]) == ("chat-1", 0, 0.0)
    assert info.truncate_prompt and info.policy is Policy.AUTO
    marker = client.model_info().media_marker
    messages = [Message.system("You describe pictures."), Message.user(png(112, 112), "What?")]
    first = collect(client.generate(client.prepare(messages), session_id="chat-1", max_tokens=8))
    assert first.reason in (FinishReason.STOP, FinishReason.LENGTH)
    messages += [Message.assistant(first.text.replace(marker, "") or "."), Message.user("And?")]
    turn = client.prepare(messages, first_message=2)  # from the reply on: the rest is held
    assert turn.num_cells < client.prepare(messages).num_cells
    second = collect(client.generate(turn, session_id="chat-1", max_tokens=8))
    assert second.reason in (FinishReason.STOP, FinishReason.LENGTH)
    held = client.get_session("chat-1")
    assert held.num_turns == 2 and held.num_cells > 0 and held.num_media == 1
    assert [s.session_id for s in client.list_sessions()] == ["chat-1"]
    client.delete_session("chat-1")
    with pytest.raises(SlotwiseError) as e:
        client.get_session("chat-1")
    assert e.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(ValueError, match="raw prompt"):
        client.prepare("raw text", first_message=1)


# -- retries: gRPC's own, through the channel's service config ---------------------------------

RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.1, multiplier=2.0)
BACKOFF = 0.1 + 0.2 + 0.4  # the waits between 4 attempts, before gRPC's +/-20% jitter
FAST = RetryPolicy(max_attempts=5, initial_backoff=0.02, max_backoff=0.05)
PREVIOUS = "grpc-previous-rpc-attempts"  # gRPC sets it on every attempt after the first


class FlakyServer:
    """A bare gRPC server whose methods each fail with `code` for their first `failures`
    attempts, then answer. `attempts[method]` holds, per attempt that reached it, the
    grpc-previous-rpc-attempts header gRPC's retry machinery put on it (None on a first try)."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.failures, self.code = failures, code
        self.attempts: dict[str, list[str | None]] = {}
        self.requests: list[Any] = []

        def unary(name: str, request: Any, response: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                lambda r, ctx: self._answer(name, r, ctx, response),
                request_deserializer=request.FromString,
                response_serializer=type(response).SerializeToString,
            )

        def stream(request: Any, context: grpc.ServicerContext) -> Any:
            yield self._answer("Generate", request, context, infer_pb2.GenerateResponse())

        session = infer_pb2.SessionInfo(session_id="s")
        handlers = [
            grpc.method_handlers_generic_handler(
                "slotwise.v1.PrepService",
                {
                    "Prepare": unary(
                        "Prepare", prep_pb2.PrepareRequest, prep_pb2.PrepareResponse()
                    ),
                    "CountTokens": unary(
                        "CountTokens", prep_pb2.CountTokensRequest, prep_pb2.CountTokensResponse()
                    ),
                },
            ),
            grpc.method_handlers_generic_handler(
                "slotwise.v1.InferService",
                {
                    "Generate": grpc.unary_stream_rpc_method_handler(
                        stream,
                        request_deserializer=infer_pb2.GenerateRequest.FromString,
                        response_serializer=infer_pb2.GenerateResponse.SerializeToString,
                    ),
                    "GetSession": unary(
                        "GetSession",
                        infer_pb2.GetSessionRequest,
                        infer_pb2.GetSessionResponse(session=session),
                    ),
                    "CreateSession": unary(
                        "CreateSession",
                        infer_pb2.CreateSessionRequest,
                        infer_pb2.CreateSessionResponse(session=session),
                    ),
                    "DeleteSession": unary(
                        "DeleteSession",
                        infer_pb2.DeleteSessionRequest,
                        infer_pb2.DeleteSessionResponse(),
                    ),
                },
            ),
        ]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=handlers)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _answer(self, name: str, request: Any, context: grpc.ServicerContext, response: Any) -> Any:
        seen = self.attempts.setdefault(name, [])
        seen.append(dict(context.invocation_metadata()).get(PREVIOUS))
        self.requests.append(request)
        if len(seen) <= self.failures:
            context.abort(self.code, f"{name}: not yet (attempt {len(seen)})")
        return response

    def __enter__(self) -> FlakyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


def test_idempotent_calls_are_retried_by_the_channel() -> None:
    big = png(16, 16) + bytes(1 << 20)  # beyond gRPC's default 256 KiB retry buffer
    with (
        FlakyServer(failures=2) as flaky,
        SlotwiseClient(flaky.address, flaky.address, retry=FAST) as c,
    ):
        c.prepare([Message.user(big, "what is it?")])
        assert c.get_session("s").session_id == "s"
        assert c.count("hi").num_cells == 0
    # three attempts reached the server; the 2nd and 3rd were gRPC's retries, not new calls
    assert flaky.attempts == {m: [None, "1", "2"] for m in ("Prepare", "GetSession", "CountTokens")}
    assert flaky.requests[2].chat.messages[0].parts[0].image.data == big


def test_generate_and_calls_that_change_state_are_never_retried() -> None:
    with (
        FlakyServer(failures=1) as flaky,
        SlotwiseClient(flaky.address, flaky.address, retry=FAST) as c,
    ):
        with pytest.raises(SlotwiseError) as e:
            list(c.generate(prompt_pb2.PreparedPrompt(), max_tokens=4))
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == "Generate: not yet (attempt 1)"
        for call in (lambda: c.create_session("s"), lambda: c.delete_session("s")):
            with pytest.raises(SlotwiseError) as e:
                call()
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert flaky.attempts == {m: [None] for m in ("Generate", "CreateSession", "DeleteSession")}


def test_retries_stop_after_max_attempts_and_only_for_unavailable() -> None:
    with FlakyServer(failures=100) as flaky:
        for policy, attempts in ((RETRY, 4), (NO_RETRY, 1), (replace(FAST, max_attempts=30), 5)):
            flaky.attempts.clear()
            with (
                SlotwiseClient(flaky.address, retry=policy) as c,
                pytest.raises(SlotwiseError) as e,
            ):
                c.prepare("hi")
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            assert len(flaky.attempts["Prepare"]) == attempts  # gRPC allows 5 at most
    with FlakyServer(failures=1, code=grpc.StatusCode.RESOURCE_EXHAUSTED) as flaky:
        with SlotwiseClient(flaky.address, retry=FAST) as c, pytest.raises(SlotwiseError) as e:
            c.prepare("hi")
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert flaky.attempts == {"Prepare": [None]}


def test_retries_stop_at_the_deadline() -> None:
    slow = RetryPolicy(max_attempts=5, initial_backoff=0.3, multiplier=10.0)  # waits 0.3, 2, 2...
    with FlakyServer(failures=100) as flaky, SlotwiseClient(flaky.address, retry=slow) as c:
        t0 = time.monotonic()
        with pytest.raises(SlotwiseError) as e:
            c.prepare("hi", timeout=1.2)
        elapsed = time.monotonic() - t0
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(flaky.attempts["Prepare"]) == 2  # the 2nd after 0.24-0.36 s, a 3rd after 1.84 s
    assert 1.15 < elapsed < 2.5


def test_the_retry_schedule_fits_the_client_timeout() -> None:
    """A server that stays away is reported as UNAVAILABLE, not as the deadline it outlasted:
    the waits (0.05, 0.2, 0.8, 2 s, +/-20%) are cut to those within half the client's timeout."""
    policy = RetryPolicy(max_attempts=5, initial_backoff=0.05, multiplier=4.0)
    with (
        FlakyServer(failures=100) as flaky,
        SlotwiseClient(flaky.address, retry=policy, timeout=2.0) as c,
        pytest.raises(SlotwiseError) as e,
    ):
        c.prepare("hi")
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert len(flaky.attempts["Prepare"]) == 3  # all 5 would outlast the 2 s


def test_the_service_config_names_only_idempotent_methods() -> None:
    config = service_config(RetryPolicy(), timeout=30)
    (method,) = config["methodConfig"]
    assert {(n["service"], n["method"]) for n in method["name"]} == {
        ("slotwise.v1.PrepService", "GetModelInfo"),
        ("slotwise.v1.PrepService", "Prepare"),
        ("slotwise.v1.PrepService", "CountTokens"),
        ("slotwise.v1.PrepService", "Tokenize"),
        ("slotwise.v1.PrepService", "Detokenize"),
        ("slotwise.v1.InferService", "GetServerInfo"),
        ("slotwise.v1.InferService", "GetSession"),
        ("slotwise.v1.InferService", "ListSessions"),
        ("slotwise.v1.InferService", "LoraListAdapters"),
        ("slotwise.v1.InferService", "LoraSetScales"),  # (scales set, not added: twice is once)
        ("grpc.health.v1.Health", "Check"),
    }
    assert method["retryPolicy"] == {
        "maxAttempts": 5,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    assert service_config(NO_RETRY) == {}
    assert (
        service_config(RetryPolicy(), timeout=1.0)["methodConfig"][0]["retryPolicy"]["maxAttempts"]
        == 3
    )
    with pytest.raises(ValueError):
        RetryPolicy(initial_backoff=0)


def test_a_server_that_is_not_there_is_retried_too() -> None:
    dead = f"127.0.0.1:{free_port()}"
    with SlotwiseClient(dead, dead, retry=RETRY) as c:
        t0 = time.monotonic()
        with pytest.raises(SlotwiseError) as e:
            c.count([Message.user((224, 224), "hi")])
        elapsed = time.monotonic() - t0
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert 0.8 * BACKOFF <= elapsed < 1.2 * BACKOFF + 3.0
        t0 = time.monotonic()
        with pytest.raises(SlotwiseError) as e:
            list(c.generate(prompt_pb2.PreparedPrompt(), max_tokens=4))
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 0.8 * BACKOFF  # never retried
    with SlotwiseClient(dead, retry=NO_RETRY) as c, pytest.raises(SlotwiseError) as e:
        t0 = time.monotonic()
        c.count("hi")
    assert time.monotonic() - t0 < 0.8 * BACKOFF


def test_wait_for_ready_reaches_a_server_that_comes_up_late(loop_thread: Any, tiny: dict) -> None:
    """Retries alone give up at once; waiting for ready rides out a server that is not there
    yet (and the retries its moment of loading). The call is seen waiting before the server
    exists: a plain TCP listener on the port counts the channel's connection attempts."""
    from prep_service.__main__ import start

    port = free_port()
    pair = tiny["mrope"]
    running: list[Any] = []
    question = [Message.user((224, 224), "hi")]
    brief = RetryPolicy(max_attempts=3, initial_backoff=0.05)
    patient = replace(brief, wait_for_ready=True)
    with SlotwiseClient(f"127.0.0.1:{port}", retry=brief) as c, pytest.raises(SlotwiseError) as e:
        c.count(question)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    dead = f"127.0.0.1:{free_port()}"
    with SlotwiseClient(infer_address=dead, retry=patient) as c, pytest.raises(SlotwiseError) as e:
        list(c.generate(prompt_pb2.PreparedPrompt(), timeout=PATIENCE))  # Generate never waits
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE

    answers: list[Any] = []
    with (
        socket.create_server(("127.0.0.1", port)) as listener,
        SlotwiseClient(f"127.0.0.1:{port}", retry=patient, timeout=PATIENCE) as c,
    ):
        asker = threading.Thread(target=lambda: answers.append(c.count(question)))
        asker.start()
        try:
            listener.accept()[0].close()  # the call is trying the port: no gRPC server there
            assert asker.is_alive() and not answers
            listener.close()
            running.append(
                loop_thread.run(start(pair.model, pair.mmproj, address=f"127.0.0.1:{port}"))
            )
            asker.join(PATIENCE)
            assert answers and answers[0].num_cells > 64  # it waited, and then was answered
        finally:
            asker.join(PATIENCE)
        for r in running:
            loop_thread.run(r.stop(0))


def test_async_client_retries_through_the_same_config() -> None:
    async def scenario(flaky: FlakyServer) -> None:
        async with AsyncSlotwiseClient(flaky.address, flaky.address, retry=FAST) as c:
            await c.prepare("hi")
            with pytest.raises(SlotwiseError) as e:
                [x async for x in c.generate(prompt_pb2.PreparedPrompt())]
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE

    with FlakyServer(failures=2) as flaky:
        asyncio.run(scenario(flaky))
    assert flaky.attempts == {"Prepare": [None, "1", "2"], "Generate": [None]}


# -- metadata ---------------------------------------------------------------------------------


class BarePrepServer:
    """A bare gRPC server answering GetModelInfo and recording the metadata that arrives.

    The services do not check tokens or certificates yet; this shows what a client sends.
    """

    def __init__(self, credentials: grpc.ServerCredentials | None = None):
        self.seen: list[dict[str, str]] = []
        handler = grpc.method_handlers_generic_handler(
            "slotwise.v1.PrepService",
            {
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self._get_model_info,
                    request_deserializer=prep_pb2.GetModelInfoRequest.FromString,
                    response_serializer=prep_pb2.GetModelInfoResponse.SerializeToString,
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
        if credentials is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    def _get_model_info(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.seen.append(dict(context.invocation_metadata()))
        return prep_pb2.GetModelInfoResponse(info=prep_pb2.ModelInfo(media_marker="<m>"))

    def __enter__(self) -> BarePrepServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


def test_token_is_sent_as_bearer_metadata() -> None:
    with BarePrepServer() as bare:
        with SlotwiseClient(f"127.0.0.1:{bare.port}", token="s3cret") as c:
            assert c.model_info().media_marker == "<m>"
        with SlotwiseClient(f"127.0.0.1:{bare.port}") as c:
            c.model_info()
    assert bare.seen[0]["authorization"] == "Bearer s3cret"
    assert "authorization" not in bare.seen[1]


def make_certificates(d: Path) -> dict[str, bytes]:
    """A throwaway CA, a server certificate for localhost and a client certificate (openssl)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=ca")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-extfile", "san.ext")  # fmt: skip
    return {f.name: f.read_bytes() for f in d.iterdir() if f.suffix in (".pem", ".key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_and_token(tmp_path: Path) -> None:
    pem = make_certificates(tmp_path)
    credentials = grpc.ssl_server_credentials(
        [(pem["server.key"], pem["server.pem"])],
        root_certificates=pem["ca.pem"],
        require_client_auth=True,
    )
    with BarePrepServer(credentials) as bare:
        address = f"localhost:{bare.port}"
        tls = Tls(pem["ca.pem"], pem["client.pem"], pem["client.key"])
        with SlotwiseClient(address, tls=tls, token="t0ken") as c:
            assert c.model_info().media_marker == "<m>"
        assert bare.seen[0]["authorization"] == "Bearer t0ken"
        paths = [tmp_path / f for f in ("ca.pem", "client.pem", "client.key")]
        assert Tls.from_files(*paths) == tls
        # without a client certificate the handshake fails: UNAVAILABLE
        no_cert = SlotwiseClient(address, tls=Tls(pem["ca.pem"]), retry=NO_RETRY)
        with no_cert, pytest.raises(SlotwiseError) as e:
            no_cert.model_info()
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        # nor does a plaintext client
        with SlotwiseClient(address, retry=NO_RETRY) as c, pytest.raises(SlotwiseError):
            c.model_info()


# -- the asyncio client -----------------------------------------------------------------------


def test_async_client(addresses: tuple[str, str], prep_servers: Callable[[str], int]) -> None:
    async def scenario() -> None:
        async with AsyncSlotwiseClient(*addresses) as c:
            model, server = await asyncio.gather(c.model_info(), c.server_info())
            assert model.model_fingerprint == server.model_fingerprint
            messages = conversation((224, 224))
            prepared = await c.prepare(messages)
            by_size = [messages[0], Message.user((224, 224), "What is in picture 1?")]
            assert (await c.count(by_size)) == prepared.count()

            events = [e async for e in c.chat(messages, max_tokens=16, temperature=0.0)]
            assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
            assert events[0].num_prompt_cells == prepared.num_cells
            done = await acollect(c.generate(prepared, max_tokens=16, temperature=0.0))
            assert done.token_ids == [
                t for e in events if isinstance(e, Delta) for t in e.token_ids
            ]

            with pytest.raises(SlotwiseError) as e:
                await c.prepare([Message("narrator", "hi")])
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(SlotwiseError) as e:
                [x async for x in c.generate(prepared, policy="stop", max_tokens=4, top_p=7.0)]
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT

        dead = f"127.0.0.1:{free_port()}"
        async with AsyncSlotwiseClient(dead, dead, retry=RETRY) as c:
            t0 = time.monotonic()
            with pytest.raises(SlotwiseError) as e:
                await c.model_info()
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            assert 0.8 * BACKOFF <= time.monotonic() - t0 < 1.2 * BACKOFF + 3.0
            t0 = time.monotonic()
            with pytest.raises(SlotwiseError) as e:
                [x async for x in c.generate(prepared)]
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < 0.8 * BACKOFF  # never retried

    asyncio.run(scenario())


def test_grpc_compression_is_a_channel_option(prep_servers, infer_server) -> None:
    import grpc as _grpc

    from clients.client import SlotwiseClient, collect

    infer = infer_server("rope")
    with SlotwiseClient(
        f"127.0.0.1:{prep_servers('rope')}",
        f"127.0.0.1:{infer.port}",
        compression=_grpc.Compression.Gzip,
    ) as client:
        done = collect(client.generate("Once upon a time", max_tokens=3))
    assert done.finished is not None and done.finished.usage.num_generated_tokens >= 1


# -- the client alone: `pip install slotwise` has no Pillow, numpy or llama.cpp -----------------

WITHOUT_SERVE_EXTRA = r"""
import sys
from concurrent import futures

BLOCKED = {"PIL", "numpy", "llama_cpp", "gguf", "prep_service", "infer_service", "slotwise_core"}
SHARED = {
    "slotwise_core", "slotwise_core.keys", "slotwise_core.limits", "slotwise_core.enum_names",
    "slotwise_core.sounds",
}  # stdlib only (sounds: miniaudio is imported only where a sound is measured)


class Absent:  # as if these were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED and name not in SHARED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())

import grpc

import clients.client
import clients.gateway
import slotwise_cli
from clients.client import Message, SlotwiseClient, image_pb, prepare_request
from slotwise.v1 import prep_pb2

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
assert image_pb(IMAGE, sizes_allowed=False).data == IMAGE
request = prepare_request([Message.user(IMAGE, "what is it?")])
assert request.chat.messages[0].parts[0].image.data == IMAGE
try:
    image_pb(object(), sizes_allowed=False)
    raise AssertionError("not an image")
except TypeError:
    pass

seen = []


def handler(req, resp):
    def behaviour(request, context):
        seen.append(request)
        return resp(num_cells=7) if resp is prep_pb2.CountTokensResponse else resp()

    return grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=req.FromString, response_serializer=resp.SerializeToString
    )


server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[
    grpc.method_handlers_generic_handler("slotwise.v1.PrepService", {
        "Prepare": handler(prep_pb2.PrepareRequest, prep_pb2.PrepareResponse),
        "CountTokens": handler(prep_pb2.CountTokensRequest, prep_pb2.CountTokensResponse),
    })
])
address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
server.start()
with SlotwiseClient(address) as client:
    client.prepare([Message.user(IMAGE, "what is it?")])
with open(sys.argv[1], "wb") as f:
    f.write(IMAGE)
command = ["count", "--prompt", "what?", "--image", sys.argv[1], "--prep", address]
assert slotwise_cli.main(command) == 0  # the `slotwise` command, client-only
server.stop(0)
prepared, counted = seen  # the image went as its bytes, from the client and from the CLI
assert prepared.chat.messages[0].parts[0].image.data == IMAGE
assert counted.chat.messages[0].parts[0].image.data == IMAGE
loaded = {m.partition(".")[0] for m in set(sys.modules) - SHARED} & BLOCKED
assert not loaded, loaded
print("client without the serve extra: ok")
"""


def test_the_client_works_without_pillow_numpy_or_llama_cpp(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", WITHOUT_SERVE_EXTRA, str(tmp_path / "picture.png")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "client without the serve extra: ok" in r.stdout
    assert "cells=7" in r.stdout
