"""Running the HTTP gateway: alone (`slotwise gateway`), or beside the services in one process
(`slotwise serve --http-port N`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from clients.gateway.app import GatewayConfig, create_app


class _Server(uvicorn.Server):
    """uvicorn that ends the app's long streams (the KV views) as its shutdown begins: it
    waits for open responses, and a page left open would hold it up."""

    app_closing: asyncio.Event

    async def shutdown(self, sockets: Any = None) -> None:
        self.app_closing.set()
        await super().shutdown(sockets)


class _Embedded(_Server):
    """uvicorn in a process that handles its own signals (it stops when told)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class RunningGateway:
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


def _uvicorn(config: GatewayConfig, host: str, port: int, log_level: str, cls: type) -> Any:
    app = create_app(config)
    server = cls(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    server.app_closing = app.state.closing
    return server


async def start_gateway(config: GatewayConfig, host: str, port: int) -> RunningGateway:
    """Serve on host:port (0: any free port) on this event loop until `stop`."""
    server = _uvicorn(config, host, port, "warning", _Embedded)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():  # the port is taken, ...
            task.result()
            raise OSError(f"the HTTP gateway did not start on {host}:{port}")
        await asyncio.sleep(0.01)
    return RunningGateway(server, task)


def run_gateway(config: GatewayConfig, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's own graceful shutdown)."""
    _uvicorn(config, host, port, "info", _Server).run()
