"""gRPC plumbing both services share: server creation, health, reflection, drain, errors."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

log = logging.getLogger("slotwise")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # a PreparedPrompt carries raw RGB: several 4K images


@dataclass
class Server:
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    services: tuple[str, ...]

    async def set_serving(self) -> None:
        for name in ("", *self.services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def create_server(
    address: str,
    services: Sequence[str],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> Server:
    """A started grpc.aio server on address (port 0 picks a free one), NOT_SERVING until told.

    Register servicers with `server.server` before calling `start()`; see `start_server`.
    """
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((*services, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    for name in ("", *services):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return Server(server, port, health, tuple(services))


async def run_until_signal(server: Server, grace: float = 5.0) -> None:
    """Serve until SIGTERM/SIGINT, then report NOT_SERVING and drain in-flight calls."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (grace %.1fs)", grace)
    await server.stop(grace)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call with a google.rpc.Status carrying the code and a message a user can act on."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    await context.abort_with_status(rpc_status.to_status(status))


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
