"""Images without stalls: while one request's image is encoded (on the encode worker, with a
projector heavy enough to take a while), the other slots keep decoding.

Asserts on how many tokens stream A received while B's image was being prepared in the engine
(B admitted -> B's first token), never on a time: here A gets about 1,500 with the encode
worker, 7 without it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.tiny_models import TinyPair, Vision, write_tiny_models
from support.loop import LoopThread
from support.media import image_bytes
from support.rpc import message, prepare


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    out = tmp_path_factory.mktemp("heavy")
    return write_tiny_models(out, ["mrope"], vision=Vision(width=256, layers=4))["mrope"]


@pytest.fixture
def services(loop_thread: LoopThread, heavy: TinyPair) -> Iterator[tuple[int, object]]:
    from infer_service.__main__ import start as start_infer
    from infer_service.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    prep = loop_thread.run(start_prep(heavy.model, heavy.mmproj, threads=1))
    config = RuntimeConfig(heavy.model, heavy.mmproj, ctx_size=4096, parallel=2, threads=1)
    infer = loop_thread.run(start_infer(config))
    yield prep.port, infer
    loop_thread.run(infer.stop(0))
    loop_thread.run(prep.stop(0))


def test_a_stream_keeps_receiving_tokens_while_another_requests_image_is_encoded(
    services: tuple[int, object],
) -> None:
    prep_port, infer = services
    stub = infer_pb2_grpc.InferServiceStub(grpc.insecure_channel(f"127.0.0.1:{infer.port}"))  # type: ignore[attr-defined]
    text = prepare(prep_port, messages=[message("user", "tell me a long story")])
    picture = prepare(
        prep_port, messages=[message("user", "what is this? ", image_bytes(672, 672, seed=1))]
    )
    a_times: list[float] = []
    a = stub.Generate(
        infer_pb2.GenerateRequest(
            prompt=text, max_tokens=1 << 20, sampling=infer_pb2.SamplingParams(temperature=0)
        ),
        timeout=120,
    )
    assert next(a).HasField("started")
    stop = threading.Event()

    def read_a() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for event in a:
                if event.HasField("delta"):
                    a_times.extend([time.monotonic()] * len(event.delta.token_ids))
                if stop.is_set():
                    break

    reader = threading.Thread(target=read_a)
    reader.start()
    while len(a_times) < 20:  # A is streaming
        time.sleep(0.01)
    admitted = first = 0.0
    for event in stub.Generate(
        infer_pb2.GenerateRequest(prompt=picture, max_tokens=2), timeout=120
    ):
        kind = event.WhichOneof("event")
        if kind == "started":
            admitted = time.monotonic()
        elif kind == "delta" and not first:
            first = time.monotonic()
    stop.set()
    a.cancel()
    reader.join(10)
    during = sum(1 for t in a_times if admitted <= t <= first)
    assert infer.engine.stats.num_media_decodes >= 1  # type: ignore[attr-defined]
    assert during >= 100, f"A got {during} tokens while B's image was encoded (1541 here)"
