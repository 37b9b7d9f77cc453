"""gRPC plumbing both services share: server creation, health, reflection, drain, errors."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

log = logging.getLogger("slotwise")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # a PreparedPrompt carries raw RGB: several 4K images


class _LateHandlers(grpc.GenericRpcHandler):
    """Handlers registered before start that servicers fill in once the model is loaded.

    grpc does not take handlers after start, and a server must listen (health NOT_SERVING)
    while a model loads; meanwhile calls to its services end with UNAVAILABLE.
    """

    def __init__(self, services: Sequence[str]):
        self.services = tuple(services)
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers.append(grpc.method_handlers_generic_handler(service, handlers))

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        for h in self.handlers:
            found = h.service(handler_call_details)
            if found is not None:
                return found
        service = handler_call_details.method.strip("/").partition("/")[0]
        return _loading_handler() if service in self.services else None


def _loading_handler() -> grpc.RpcMethodHandler:
    async def loading(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort(context, grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry")

    return grpc.unary_unary_rpc_method_handler(loading)


@dataclass
class Server:
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    services: tuple[str, ...]
    _late: _LateHandlers

    def bind(self, add_to_server: Callable[[Any, Any], None], servicer: Any) -> None:
        """Attach a servicer to the running server (until then its methods say UNAVAILABLE)."""
        add_to_server(servicer, self._late)

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
        interceptors=[RequestDecodeInterceptor(), *interceptors],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*services, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server
    )
    late = _LateHandlers(services)
    server.add_generic_rpc_handlers((late,))
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    for name in ("", *services):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return Server(server, port, health, tuple(services), late)


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


class _Undecodable:
    """Stands in for a request whose bytes did not parse; the handler is never called with it."""

    def __init__(self, error: DecodeError):
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(e)

    return deserialize


def _undecodable_message(request: _Undecodable) -> str:
    return f"cannot parse the request: {request.error}"


class RequestDecodeInterceptor(grpc.aio.ServerInterceptor):
    """Answer INVALID_ARGUMENT to a request whose bytes do not parse as its message type.

    grpc itself answers UNKNOWN ("Unexpected DecodeError") when, for example, a string field
    holds invalid UTF-8. Applies to methods with a single request message (unary-unary and
    unary-stream); request-streaming methods are passed through unchanged.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer)
        if not handler.response_streaming:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Undecodable):
                    await abort(
                        context, grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request)
                    )
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        stream = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request)
                )
            result = stream(request, context)
            if hasattr(result, "__aiter__"):
                try:
                    async for item in result:
                        yield item
                finally:  # closed early (client gone): let the handler's own cleanup run now
                    if hasattr(result, "aclose"):
                        await result.aclose()
            elif inspect.isawaitable(result):  # a handler that writes with context.write
                await result
            else:
                for item in result:
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
