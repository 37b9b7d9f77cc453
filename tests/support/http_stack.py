"""Real prep, infer and HTTP gateway servers in this process, for the HTTP API tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread

INFER_START_OPTIONS = ("max_queue", "sessions_dir", "embeddings_ctx")


@dataclass
class Stack:
    infer: Any
    gateway: Any
    url: str
    prep_port: int

    def client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **kwargs)


class Stacks:
    """start(pair, *, prep_port=None, chat_template=None, gateway options, infer options)."""

    def __init__(
        self, loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_port: Callable[[str], int]
    ):
        self.loop_thread, self.tiny, self.prep_port = loop_thread, tiny, prep_port
        self.running: list[Stack] = []
        self.preps: dict[tuple[str, str], Any] = {}

    def prep_with(self, pair: str, chat_template: str) -> int:
        from prep_service.__main__ import start

        key = (pair, chat_template)
        if key not in self.preps:
            p = self.tiny[pair]
            self.preps[key] = self.loop_thread.run(
                start(p.model, p.mmproj, threads=1, chat_template=chat_template)
            )
        return int(self.preps[key].port)

    def start(
        self,
        pair: str = "mrope",
        *,
        prep_port: int | None = None,
        chat_template: str | None = None,
        gateway: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Stack:
        from clients.gateway import GatewayConfig
        from clients.gateway.serve import start_gateway
        from infer_service.__main__ import start
        from infer_service.runner.runtime import RuntimeConfig

        if prep_port is None:
            prep_port = (
                self.prep_with(pair, chat_template) if chat_template else self.prep_port(pair)
            )
        options = {k: kwargs.pop(k) for k in INFER_START_OPTIONS if k in kwargs}
        kwargs.setdefault("threads", 1)
        kwargs.setdefault("ctx_size", 1024)
        config = RuntimeConfig(self.tiny[pair].model, self.tiny[pair].mmproj, **kwargs)
        infer = self.loop_thread.run(start(config, **options))
        addresses = (f"127.0.0.1:{prep_port}", f"127.0.0.1:{infer.port}")
        gw = self.loop_thread.run(
            start_gateway(GatewayConfig(*addresses, **(gateway or {})), "127.0.0.1", 0)
        )
        s = Stack(infer, gw, f"http://127.0.0.1:{gw.port}", prep_port)
        self.running.append(s)
        return s

    def close(self) -> None:
        for s in self.running:
            self.loop_thread.run(s.gateway.stop())
            self.loop_thread.run(s.infer.stop(0))
        for p in self.preps.values():
            self.loop_thread.run(p.stop(0))


def stacks_fixture(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stacks]:
    s = Stacks(loop_thread, tiny, prep_servers)
    yield s
    s.close()
