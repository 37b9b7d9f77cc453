"""Both services in one process: `slotwise serve` and `slotwise demo` start them from here.

This is the one module outside the services that imports them (to host them in-process); the
clients themselves only speak gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("slotwise.serve")

T = TypeVar("T")


@dataclass(frozen=True)
class ServeConfig:
    model: Path
    mmproj: Path | None = None
    host: str = "127.0.0.1"
    prep_port: int = 50051  # 0: any free port
    infer_port: int = 50052
    ctx_size: int = 4096
    parallel: int = 1
    batch_size: int = 512
    ubatch_size: int = 512
    gpu_layers: int = 0
    threads: int = max(1, (os.cpu_count() or 2) // 2)
    prep_threads: int = 2
    max_queue: int = 64
    tenant_max_active: int = 0  # 0: no limit of a tenant's own
    tenant_max_queued: int = 0
    fair: bool = True  # the queue round robin across tenants (else FIFO)
    media_cache_mb: int = 1024
    state_cache_mb: int = 256
    default_max_tokens: int = 1024
    max_message_mb: int = 256
    sessions_dir: Path | None = None  # sessions survive restarts when set
    # hardening: TLS (cert + key; client_ca requires client certificates) and a bearer token
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    keys: Any = None  # slotwise_core.keys.Keys: who may call (one file for all three)
    prep_metrics_port: int | None = None  # Prometheus metrics, one port per service
    infer_metrics_port: int | None = None
    chat_template: str | None = None  # NAME|FILE: for models without one (see prep --help)
    embeddings_ctx: int = 0  # > 0: serve Embed, with this many tokens per text


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
    from infer_service.runtime import RuntimeConfig
    from infer_service.scheduler import TenantLimits
    from infer_service.service import GenerateLimits
    from prep_service.__main__ import start as start_prep
    from slotwise_core.serving import Security

    host = _listen_host(config.host)
    security = Security(config.tls_cert, config.tls_key, config.tls_client_ca, keys=config.keys)
    security.credentials()  # a missing or half-given certificate fails here, before any load
    runtime = RuntimeConfig(
        model=config.model,
        mmproj=config.mmproj,
        ctx_size=config.ctx_size,
        parallel=config.parallel,
        batch_size=config.batch_size,
        ubatch_size=config.ubatch_size,
        gpu_layers=config.gpu_layers,
        threads=config.threads,
    )
    prep_task = asyncio.ensure_future(
        start_prep(
            config.model,
            config.mmproj,
            address=f"{host}:{config.prep_port}",
            threads=config.prep_threads,
            max_message_bytes=config.max_message_mb << 20,
            security=security,
            metrics_port=config.prep_metrics_port,
            chat_template=config.chat_template,
        )
    )
    infer_task = asyncio.ensure_future(
        start_infer(
            runtime,
            address=f"{host}:{config.infer_port}",
            max_queue=config.max_queue,
            cache_bytes=config.media_cache_mb << 20,
            limits=GenerateLimits(default_max_tokens=config.default_max_tokens),
            max_message_bytes=config.max_message_mb << 20,
            sessions_dir=config.sessions_dir,
            state_cache_bytes=config.state_cache_mb << 20,
            embeddings_ctx=config.embeddings_ctx,
            security=security,
            metrics_port=config.infer_metrics_port,
            tenant_limits=TenantLimits(config.tenant_max_active, config.tenant_max_queued),
            fair=config.fair,
        )
    )
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
    grace: float = 5.0,
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
