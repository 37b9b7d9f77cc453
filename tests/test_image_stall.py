"""Images without stalls: while one request's image is encoded (on the encode worker, with a
projector heavy enough to take a while), the other slots keep decoding.

The measurement is the benchmark's (benchmarks/stall.py, `slotwise bench --only stall`), on
services started in this process. Asserts on how many tokens stream A received while B's image
was being prepared in the engine (B admitted -> B's first token), never on a time: here A gets
about 1,500 with the encode worker, 7 without it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import pytest

from benchmarks.stall import SlotwiseStall, heavy_pair, stall_jpeg
from slotwise.v1 import infer_pb2_grpc, prep_pb2_grpc
from slotwise_core.tiny_models import TinyPair, Vision
from support.loop import LoopThread


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return heavy_pair(tmp_path_factory.mktemp("heavy"), Vision(width=256, layers=4))


@pytest.fixture
def services(loop_thread: LoopThread, heavy: TinyPair) -> Iterator[tuple[int, object]]:
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
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
    prep_channel = grpc.insecure_channel(f"127.0.0.1:{prep_port}")
    infer_channel = grpc.insecure_channel(f"127.0.0.1:{infer.port}")  # type: ignore[attr-defined]
    stall = SlotwiseStall(
        prep_pb2_grpc.PrepServiceStub(prep_channel), infer_pb2_grpc.InferServiceStub(infer_channel)
    )
    try:
        # A streams (20 tokens first), is not timed alone; B sends a 672x672 JPEG
        run = stall.run(stall_jpeg(1, side=672), 1, settle_s=0.0, alone_s=0.0, warm_tokens=20)
    finally:
        prep_channel.close()
        infer_channel.close()
    assert run.b_admitted is not None and run.b_admitted <= run.b_first
    during = run.tokens_between(run.b_admitted, run.b_first)
    assert infer.engine.stats.num_media_decodes >= 1  # type: ignore[attr-defined]
    assert during >= 100, f"A got {during} tokens while B's image was encoded (1541 here)"


def test_the_encoder_yields_the_cores_to_decoding(services: tuple[int, object]) -> None:
    """The encode worker (whose threads inherit it) runs 10 nice levels below decoding."""
    _, infer = services

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    encoder = infer.engine.executor._encoder  # type: ignore[attr-defined]
    assert encoder.submit(nice).result(30) == min(19, nice() + 10)
