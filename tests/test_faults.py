"""Faults around the services: clients that vanish mid-stream or while queued, a prep server that
goes away and comes back (or is still loading), a server stopped with streams in flight.

Covered elsewhere, not repeated: call.cancel() freeing the slot, the full queue answering
RESOURCE_EXHAUSTED and a deadline expiring mid-prefill (test_infer_service); a client that
retries a server that was never up, or comes up late (test_client); an infer process killed
with SIGKILL mid-turn and restarted on the same --sessions-dir, sessions listed and intact
(test_sessions::test_sessions_survive_sigkill_mid_turn_and_a_clean_restart).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import NO_RETRY, Message, RetryPolicy, SlotwiseClient, SlotwiseError
from infer_service.__main__ import start as start_infer
from infer_service.runner.runtime import RuntimeConfig
from prep_service.__main__ import start as start_prep
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core import native, serving
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.procs import free_port
from support.rpc import channel, prepare, rpc_error, run, server_info, streams_under_way
from support.rpc import request as make_request
from support.wait import assert_nothing_runs_on, wait_until

LENGTH = infer_pb2.FINISH_REASON_LENGTH
CANCELLED = infer_pb2.FINISH_REASON_CANCELLED
FOREVER = 1 << 20  # max_tokens of a generation that only ends when its client goes


@pytest.fixture(scope="module")
def one_slot(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Any]:
    """An mrope infer server with a single slot, so that a stuck slot would block the next call."""
    pair = tiny["mrope"]
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=256, parallel=1, threads=1)
    running = loop_thread.run(start_infer(config, max_queue=4))
    yield running
    loop_thread.run(running.stop(0))


@pytest.fixture(scope="module")
def prompt(prep_servers: Callable[[str], int]) -> Any:
    return prepare(prep_servers("mrope"), raw="Once upon a time")


def start_streaming(ch: grpc.Channel, prompt: Any, *, n_deltas: int = 3, **kw: Any) -> Any:
    """A Generate call on ch that is past its first n_deltas token deltas."""
    call = infer_pb2_grpc.InferServiceStub(ch).Generate(
        make_request(prompt, max_tokens=FOREVER, **kw), timeout=60
    )
    deltas = 0
    for e in call:
        deltas += e.HasField("delta")
        if deltas == n_deltas:
            return call
    raise AssertionError("the stream ended early")


# -- clients that vanish ------------------------------------------------------------------------


def test_closing_the_channel_mid_stream_frees_the_slot_at_once(one_slot: Any, prompt: Any) -> None:
    port = one_slot.port
    ch = channel(port)
    call = start_streaming(ch, prompt)  # kept: dropping the call object would cancel it
    assert server_info(port).num_active == 1
    ch.close()  # no cancel(): the connection just goes away
    # the connection's end reaches the engine: nothing runs on for the vanished client
    assert_nothing_runs_on(port)
    assert rpc_error(lambda: list(call)).code() == grpc.StatusCode.CANCELLED
    # the only slot is free: the next request is served right away
    s = run(port, make_request(prompt, max_tokens=4), timeout=10)
    assert (s.finished.reason, len(s.token_ids)) == (LENGTH, 4)


def test_queued_clients_that_leave_never_take_the_slot(one_slot: Any, prompt: Any) -> None:
    port = one_slot.port
    with channel(port) as first_ch:
        first = start_streaming(first_ch, prompt)
        # one waiter closes its channel, another one's deadline passes while it waits
        gone = channel(port)
        waiter = infer_pb2_grpc.InferServiceStub(gone).Generate(  # kept: dropping it cancels
            make_request(prompt, max_tokens=50), timeout=60
        )
        wait_until(lambda: server_info(port).num_queued == 1)
        # the engine drops it at its deadline; the client sees whichever comes first, the
        # engine's finished event or grpc's DEADLINE_EXCEEDED
        try:
            late = run(port, make_request(prompt, max_tokens=50), timeout=0.5)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            f = late.finished
            assert (f.reason, late.token_ids) == (CANCELLED, [])
            assert f.error == "deadline exceeded while queued"
        gone.close()
        wait_until(lambda: server_info(port).num_queued == 0)
        assert rpc_error(lambda: list(waiter)).code() == grpc.StatusCode.CANCELLED
        first.cancel()
    assert_nothing_runs_on(port)  # neither waiter runs once its client is gone
    s = run(port, make_request(prompt, max_tokens=3), timeout=10)
    assert (s.finished.reason, len(s.token_ids)) == (LENGTH, 3)


def test_a_client_reading_slowly_gets_every_token(one_slot: Any, prompt: Any) -> None:
    """Deltas pile up while the client sleeps; they arrive merged, none lost, in order."""
    port = one_slot.port
    fast = run(port, make_request(prompt, max_tokens=60, temperature=0.0))
    with channel(port) as ch:
        call = infer_pb2_grpc.InferServiceStub(ch).Generate(
            make_request(prompt, max_tokens=60, temperature=0.0), timeout=60
        )
        tokens: list[int] = []
        for e in call:
            if e.HasField("delta"):
                tokens.extend(e.delta.token_ids)
                time.sleep(0.05)
    assert tokens == fast.token_ids


# -- the prep server goes away, or is not ready yet ---------------------------------------------

# gRPC's own retryPolicy (UNAVAILABLE, idempotent calls): waits of 0.2, 0.4, 0.8, 1 s, +/-20%
PATIENT = RetryPolicy(max_attempts=5, initial_backoff=0.2, max_backoff=1.0)
BRIEF = RetryPolicy(max_attempts=3, initial_backoff=0.05, multiplier=2.0)


def test_prep_down_then_back_the_same_client_recovers(
    loop_thread: LoopThread, tiny: dict[str, TinyPair]
) -> None:
    pair = tiny["mrope"]
    address = f"127.0.0.1:{free_port()}"
    question = [Message.user((224, 224), "what is this?")]
    prep = loop_thread.run(start_prep(pair.model, pair.mmproj, address=address))
    restarted: list[Any] = []
    try:
        with SlotwiseClient(address, retry=BRIEF) as client:
            expected = client.count(question)
            loop_thread.run(prep.stop(0))
            # down: the channel's retries run out, then a clear error
            with pytest.raises(SlotwiseError) as err:
                client.count(question)
            e = err.value
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert str(e).startswith("UNAVAILABLE: ") and e.details()

            # back on the same port: the same client (its channel reconnects) gets through
            restarted.append(loop_thread.run(start_prep(pair.model, pair.mmproj, address=address)))
            wait_until(lambda: client.health("prep") == "SERVING")
            assert client.count(question) == expected
    finally:
        for r in restarted:
            loop_thread.run(r.stop(0))


def test_a_loading_prep_server_is_retried_until_it_serves(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server listens while its model loads and says UNAVAILABLE ("still loading"); the
    channel's retryPolicy carries the call over the load."""
    pair = tiny["rope"]
    refusals: list[None] = []  # the calls the loading server answered UNAVAILABLE
    loading_handler = serving._loading_handler

    def counted() -> grpc.RpcMethodHandler:
        refusals.append(None)
        return loading_handler()

    monkeypatch.setattr(serving, "_loading_handler", counted)
    address = f"127.0.0.1:{free_port()}"
    future = None
    result: list[Any] = []
    try:
        with (
            SlotwiseClient(address, retry=PATIENT) as client,
            SlotwiseClient(address, retry=NO_RETRY) as impatient,
        ):
            asker = threading.Thread(
                target=lambda: result.append(client.count([Message.user("hi")]))
            )
            with native._LOG_LOCK:  # held: start() listens, then waits to load the model
                future = asyncio.run_coroutine_threadsafe(
                    start_prep(pair.model, pair.mmproj, address=address), loop_thread.loop
                )
                wait_until(lambda: client.health("prep") == "NOT_SERVING")
                with pytest.raises(SlotwiseError) as refused:  # what every attempt hears now
                    impatient.count([Message.user("hi")])
                refused_before = len(refusals)
                asker.start()
                # two attempts or more, all refused: the call is waiting over the load
                wait_until(lambda: len(refusals) >= refused_before + 2, what="two refusals")
                assert asker.is_alive() and not result, "the call did not wait for the load"
            asker.join(30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert result and result[0].num_cells > 0
    finally:
        if future is not None:
            loop_thread.run(future.result(30).stop(0))


# -- stopping a server with streams in flight ---------------------------------------------------


def test_stopping_the_server_ends_streams_and_refuses_new_calls(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prompt: Any
) -> None:
    pair = tiny["mrope"]
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=512, parallel=2, threads=1)
    infer = loop_thread.run(start_infer(config))
    port = infer.port
    with channel(port) as ch:
        streams = [start_streaming(ch, prompt), start_streaming(ch, prompt, n_deltas=1)]
        health = health_pb2_grpc.HealthStub(ch)
        t0 = time.monotonic()
        stopping = asyncio.run_coroutine_threadsafe(infer.stop(0.3), loop_thread.loop)
        # the streams end (drained, then cancelled): nobody hangs
        for call in streams:
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        stopping.result(10)
        assert time.monotonic() - t0 < 5
        assert not infer.engine._thread.is_alive()
        err = rpc_error(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2))
        assert err.code() == grpc.StatusCode.UNAVAILABLE


# -- a batch llama.cpp refuses ------------------------------------------------------------------


def test_a_sequence_llama_cpp_refuses_ends_alone(
    infer_server: Callable[..., Any], prep_servers: Callable[[str], int]
) -> None:
    """When llama_decode refuses a batch, each sequence is decoded again on its own: only the
    one llama.cpp refuses ends (ERROR), the others go on with every token."""
    from infer_service.kv.ledger import Item

    server = infer_server("rope", ctx_size=1024, parallel=2)
    text = prepare(prep_servers("rope"), raw="Two streams side by side")
    with channel(server.port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        calls = streams_under_way(stub, text, (1, 2), max_tokens=300)

        def break_one_ledger() -> tuple[int, int]:
            # the ledger now promises 3 cells llama.cpp never received: the next position it
            # asks for is past the sequence's end, which llama.cpp refuses (Y != X + 1)
            active = [s for s in server.engine.slots if s.job is not None]
            assert active[0].ledger is not None
            active[0].ledger.append(Item.text([5, 6, 7], 0))
            return active[0].seq, len(active)

        broken, num_active = server.engine.call(break_one_ledger).result(10)
        assert num_active == 2  # both in the batch llama.cpp refuses
        refused_events = []
        with pytest.raises(grpc.RpcError) as failed:  # a non-OK status after its Finished
            for event in calls[broken]:
                refused_events.append(event)
        other = list(calls[1 - broken])[-1].finished
    refused = refused_events[-1].finished
    assert refused.reason == infer_pb2.FINISH_REASON_ERROR
    assert "llama_decode failed" in refused.error
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "llama_decode failed" in failed.value.details()
    assert other.reason == infer_pb2.FINISH_REASON_LENGTH and other.error == ""
    assert other.usage.num_generated_tokens == 300


def test_a_bug_in_one_slot_s_step_ends_that_request_alone(
    infer_server: Callable[..., Any], prep_servers: Callable[[str], int]
) -> None:
    """An unexpected exception while one slot's item is carried out (here its sampler
    raises after the batch was decoded) ends that request with INTERNAL; the stream beside
    it, in the same batch, goes on to its last token. Before, every active request failed."""
    server = infer_server("rope", ctx_size=1024, parallel=2)
    text = prepare(prep_servers("rope"), raw="Two streams side by side")

    class Broken:  # a stand-in for a bug in one slot's sampling
        def sample(self, index: int) -> Any:
            raise RuntimeError("a bug in this slot's sampler")

        def close(self) -> None:
            pass

    with channel(server.port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        calls = streams_under_way(stub, text, (1, 2), max_tokens=300)

        def break_one_sampler() -> tuple[int, int]:
            active = [s for s in server.engine.slots if s.job is not None]
            active[0].sampler.close()
            active[0].sampler = Broken()
            return active[0].seq, len(active)

        broken, num_active = server.engine.call(break_one_sampler).result(10)
        assert num_active == 2  # both in the step that meets the bug
        with pytest.raises(grpc.RpcError) as failed:
            list(calls[broken])
        other = list(calls[1 - broken])[-1].finished
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "a bug in this slot's sampler" in failed.value.details()
    assert other.reason == LENGTH and other.error == ""
    assert other.usage.num_generated_tokens == 300
    assert run(server.port, make_request(text, max_tokens=3)).finished.reason == LENGTH
