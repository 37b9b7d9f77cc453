"""Running the HTTP gateway: alone (`slotwise gateway`), or beside the services in one process
(`slotwise serve --http-port N`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from clients.gateway.app import GatewayConfig, create_app


class _Embedded(uvicorn.Server):
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


async def start_gateway(config: GatewayConfig, host: str, port: int) -> RunningGateway:
    """Serve on host:port (0: any free port) on this event loop until `stop`."""
    uv = uvicorn.Config(create_app(config), host=host, port=port, log_level="warning")
    server = _Embedded(uv)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():  # the port is taken, ...
            task.result()
            raise OSError(f"the HTTP gateway did not start on {host}:{port}")
        await asyncio.sleep(0.01)
    return RunningGateway(server, task)


def run_gateway(config: GatewayConfig, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's own graceful shutdown)."""
    uvicorn.run(create_app(config), host=host, port=port, log_level="info")
