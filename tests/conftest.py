"""Shared fixtures: generated tiny model pairs and real services on loopback ports."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import pytest

os.environ.setdefault("GGML_NO_BACKTRACE", "1")

from slotwise_core.tiny_models import (
    ALL,
    AUDIO,
    BROKEN,
    FAMILIES_2026,
    HYBRID,
    MTP,
    REASONING,
    TinyPair,
    write_tiny_models,
)
from support.loop import LoopThread

T = TypeVar("T")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyPair]:
    names = [*ALL, *HYBRID, *MTP, *AUDIO, *FAMILIES_2026, *REASONING, *BROKEN]
    return write_tiny_models(tmp_path_factory.mktemp("tiny-models"), names)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def prep_servers(
    loop_thread: LoopThread, tiny: dict[str, TinyPair]
) -> Iterator[Callable[[str], int]]:
    """port_of(pair_name) -> port of a PrepService for that pair, started once per session."""
    from prep_service.__main__ import start

    running: dict[str, Any] = {}

    def port_of(name: str) -> int:
        if name not in running:
            pair = tiny[name]
            running[name] = loop_thread.run(start(pair.model, pair.mmproj, threads=2))
        return int(running[name].port)

    yield port_of
    for r in running.values():
        loop_thread.run(r.stop(0))


@pytest.fixture
def channel_to() -> Iterator[Callable[[int], grpc.Channel]]:
    opened: list[grpc.Channel] = []

    def open_channel(port: int) -> grpc.Channel:
        ch = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_send_message_length", 256 << 20),
                ("grpc.max_receive_message_length", 256 << 20),
            ],
        )
        opened.append(ch)
        return ch

    yield open_channel
    for ch in opened:
        ch.close()


@pytest.fixture
def infer_server(
    loop_thread: LoopThread, tiny: dict[str, TinyPair]
) -> Iterator[Callable[..., Any]]:
    """start(pair, **RuntimeConfig fields and start() options) -> RunningInfer; stopped after."""
    from infer_service.__main__ import start
    from infer_service.runner.runtime import RuntimeConfig

    started: list[Any] = []
    start_options = {
        "max_queue",
        "cache_bytes",
        "limits",
        "max_message_bytes",
        "sessions_dir",
        "embeddings_ctx",
        "model_draft",
    }

    def start_one(name: str, **kwargs: Any) -> Any:
        pair = tiny[name]
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in start_options}
        kwargs.setdefault("threads", 1)
        mmproj = kwargs.pop("mmproj", pair.mmproj)
        config = RuntimeConfig(pair.model, mmproj, **kwargs)
        running = loop_thread.run(start(config, **options))
        started.append(running)
        return running

    yield start_one
    for r in started:
        loop_thread.run(r.stop(0))
