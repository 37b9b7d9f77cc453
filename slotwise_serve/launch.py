"""Both services in one process: `slotwise serve` and `slotwise demo` start them from here.

This is the one module outside the services that imports them (to host them in-process); the
clients themselves only speak gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("slotwise.serve")

T = TypeVar("T")


@dataclass(frozen=True)
class ServeConfig:
    """Each service's settings, by the names its own options give them (prep_service/flags.py,
    infer_service/flags.py), and what serving both in one process adds."""

    prep: Mapping[str, Any]
    infer: Mapping[str, Any]
    host: str = "127.0.0.1"
    prep_port: int = 50051  # 0: any free port
    infer_port: int = 50052
    max_concurrent_rpcs: int = 1024  # per service
    # hardening: TLS (cert + key; client_ca requires client certificates) and a bearer token
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    keys: Any = None  # slotwise_core.keys.Keys: who may call (one file for all three)
    prep_metrics_port: int | None = None  # Prometheus metrics, one port per service
    infer_metrics_port: int | None = None

    @classmethod
    def of(
        cls,
        model: Path,
        mmproj: Path | None = None,
        *,
        prep: Mapping[str, Any] | None = None,
        infer: Mapping[str, Any] | None = None,
        **serving: Any,
    ) -> ServeConfig:
        """Every setting its option's default but those given."""
        from infer_service.flags import OPTIONS as INFER
        from prep_service.flags import OPTIONS as PREP
        from slotwise_core.flags import defaults

        files = {"model": model, "mmproj": mmproj}
        return cls(
            prep=defaults(PREP, **files, **(prep or {})),
            infer=defaults(INFER, **files, **(infer or {})),
            **serving,
        )


@dataclass
class Services:
    """A running PrepService and InferService."""

    prep: Any  # prep_service.__main__.RunningPrep
    infer: Any  # infer_service.__main__.RunningInfer
    host: str
    gateway: Any = None  # clients.gateway.serve.RunningGateway, with --http-port

    @property
    def prep_address(self) -> str:
        return f"{_connect_host(self.host)}:{self.prep.port}"

    @property
    def infer_address(self) -> str:
        return f"{_connect_host(self.host)}:{self.infer.port}"

    async def stop(self, grace: float = 5.0) -> None:
        """Both report NOT_SERVING, drain in-flight calls for up to `grace` s, free the models."""
        if self.gateway is not None:
            await self.gateway.stop()
        await asyncio.gather(self.prep.stop(grace), self.infer.stop(grace))


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", "", "[::]", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _listen_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def start_services(config: ServeConfig) -> Services:
    """Start both services (their models load concurrently); on failure nothing stays open."""
    from infer_service.__main__ import start as start_infer
    from infer_service.__main__ import start_arguments as infer_arguments
    from prep_service.__main__ import start as start_prep
    from prep_service.__main__ import start_arguments as prep_arguments
    from slotwise_core.serving import Security

    host = _listen_host(config.host)
    security = Security(config.tls_cert, config.tls_key, config.tls_client_ca, keys=config.keys)
    security.credentials()  # a missing or half-given certificate fails here, before any load
    runtime, infer_args = infer_arguments(config.infer)  # (as each service reads its options)
    model, mmproj, prep_args = prep_arguments(config.prep)
    serving: dict[str, Any] = {
        "security": security,
        "max_concurrent_rpcs": config.max_concurrent_rpcs,
    }
    prep_address, infer_address = f"{host}:{config.prep_port}", f"{host}:{config.infer_port}"
    prep_task = asyncio.ensure_future(
        start_prep(model, mmproj, address=prep_address, metrics_port=config.prep_metrics_port,
                   **serving, **prep_args)
    )  # fmt: skip
    infer_task = asyncio.ensure_future(
        start_infer(runtime, address=infer_address, metrics_port=config.infer_metrics_port,
                    **serving, **infer_args)
    )  # fmt: skip
    results = await asyncio.gather(prep_task, infer_task, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if not isinstance(r, BaseException):
                await r.stop(0)
        raise errors[0]
    prep, infer = results
    return Services(prep, infer, config.host)


async def serve_until_signal(
    config: ServeConfig,
    on_ready: Callable[[Services], None] | None = None,
    grace: float = 30.0,
    http: tuple[Callable[[Services], Any], int] | None = None,
) -> None:
    """Serve both until SIGTERM or SIGINT, then drain and stop them. http: (the gateway's
    configuration for the running services, its port) to serve the OpenAI API beside them."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config.keys is not None:
        from slotwise_core.keys import reload_on_sighup

        reload_on_sighup(config.keys)
    services = await start_services(config)
    try:
        if http is not None:
            from clients.gateway.serve import start_gateway

            make_config, port = http
            services.gateway = await start_gateway(make_config(services), config.host, port)
        if on_ready:
            on_ready(services)
        await stop.wait()
        log.info("draining (grace %.1fs)", grace)
    finally:
        await services.stop(grace)


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="slotwise-services")
        self.thread.daemon = True
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@contextmanager
def background_services(config: ServeConfig) -> Iterator[Services]:
    """Both services on an event loop in a background thread, for blocking code (the demo)."""
    lt = _LoopThread()
    try:
        services = lt.run(start_services(config))
        try:
            yield services
        finally:
            lt.run(services.stop(0.5), timeout=30)
    finally:
        lt.close()
