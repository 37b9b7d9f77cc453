"""gRPC plumbing both services share: server creation, health, reflection, drain, errors."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from slotwise_core.keys import DEFAULT_TENANT, Keys, bearer, callers, reload_on_sighup
from slotwise_core.metrics import ServiceMetrics

log = logging.getLogger("slotwise")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # a PreparedPrompt carries raw RGB: several 4K images
DEFAULT_MAX_CONCURRENT_RPCS = 1024


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
class InFlight:
    """Calls of ours being handled now (on the event loop: no lock)."""

    num_calls: int = 0


@dataclass
class Server:
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    services: tuple[str, ...]
    _late: _LateHandlers
    metrics: ServiceMetrics | None = None
    in_flight: InFlight = field(default_factory=InFlight)
    keys: Keys | None = None  # who may call (SIGHUP: run_until_signal re-reads them)
    # set when the drain begins: calls that never end by themselves (watches) end then
    draining: asyncio.Event = field(default_factory=asyncio.Event)

    def bind(self, add_to_server: Callable[[Any, Any], None], servicer: Any) -> None:
        """Attach a servicer to the running server (until then its methods say UNAVAILABLE)."""
        add_to_server(servicer, self._late)

    async def set_serving(self) -> None:
        for name in ("", *self.services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        for name in ("", *self.services):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        self.draining.set()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.metrics is not None:
            self.metrics.close()


async def create_server(
    address: str,
    services: Sequence[str],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    security: Security | None = None,
    metrics: ServiceMetrics | None = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
) -> Server:
    """A started grpc.aio server on address (port 0 picks a free one), NOT_SERVING until told.

    Calls beyond max_concurrent_rpcs are refused by grpc with RESOURCE_EXHAUSTED: a flood
    costs a refusal each, not memory.

    Register servicers with `server.server` before calling `start()`; see `start_server`.
    """
    keys = callers(security.keys, security.token) if security else None
    edge = EdgeInterceptor(keys=keys, metrics=metrics)
    server = grpc.aio.server(
        interceptors=[edge],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*services, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server
    )
    late = _LateHandlers(services)
    server.add_generic_rpc_handlers((late,))
    credentials = security.credentials() if security else None
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    for name in ("", *services):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return Server(server, port, health, tuple(services), late, metrics, edge.in_flight, keys)


async def run_until_signal(
    server: Server, grace: float = 5.0, *, failed: asyncio.Event | None = None
) -> None:
    """Serve until SIGTERM/SIGINT (or `failed` is set), then report NOT_SERVING and drain
    in-flight calls."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server.keys is not None:
        reload_on_sighup(server.keys)
    waits = [asyncio.ensure_future(stop.wait())]
    if failed is not None:
        waits.append(asyncio.ensure_future(failed.wait()))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    log.info("draining %d calls in flight (grace %.1fs)", server.in_flight.num_calls, grace)
    await server.stop(grace)


ERROR_DOMAIN = "slotwise"


def status_of(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str = "",
    metadata: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    retry_after: float | None = None,
    field: str = "",
) -> grpc.Status:
    """A google.rpc.Status with the details a client branches on: ErrorInfo (reason and the
    numbers), RetryInfo (when to try again), BadRequest (the field at fault)."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if reason:
        info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
        info.metadata.update(dict(metadata))
        status.details.add().Pack(info)
    if retry_after is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(timedelta(seconds=retry_after))
        status.details.add().Pack(retry)
    if field:
        bad = error_details_pb2.BadRequest()
        bad.field_violations.add(field=field, description=message)
        status.details.add().Pack(bad)
    return rpc_status.to_status(status)


async def abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, **details: Any
) -> None:
    """End the call with a google.rpc.Status: the code, a message a user can act on, and the
    details of `status_of`. A call whose client is gone (cancelled, deadline passed) just ends.
    """
    if context.cancelled():
        raise asyncio.CancelledError("the client is gone")
    try:
        await context.abort_with_status(status_of(code, message, **details))
    except grpc.aio.AbortError:
        raise
    except Exception as e:  # grpc could not send the status: the client went away meanwhile
        raise asyncio.CancelledError(f"the client is gone ({type(e).__name__})") from None


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


_OPEN_SERVICES = ("grpc.health.v1.Health", reflection.SERVICE_NAME)


_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default=DEFAULT_TENANT)


def current_tenant() -> str:
    """The tenant of the call being handled (its key's, from the keys file)."""
    return _TENANT.get()


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """What every call of ours passes through: auth, request decoding, metrics.

    - With keys, calls must carry `authorization: Bearer <key>` (health and reflection stay
      open for probes): else UNAUTHENTICATED. The key's tenant is the call's
      (`current_tenant()`, in the handler's task).
    - A request whose bytes do not parse (e.g. invalid UTF-8 in a string field) gets
      INVALID_ARGUMENT; grpc itself would answer UNKNOWN ("Unexpected DecodeError").
    - Latency and status codes are counted per method.
    Request-streaming methods are passed through unchanged.
    """

    def __init__(self, *, keys: Keys | None = None, metrics: ServiceMetrics | None = None):
        self._keys = keys
        self._metrics = metrics
        self.in_flight = InFlight()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return handler
        is_open = method.strip("/").partition("/")[0] in _OPEN_SERVICES
        tenant = DEFAULT_TENANT
        if self._keys is not None and not is_open:
            found = self._keys.tenant_of(_bearer(handler_call_details))
            tenant = found or ""
        if not tenant:
            return _refuse(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token",
                method=method,
                metrics=self._metrics,
            )
        if handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer)
        metrics, in_flight = self._metrics, self.in_flight
        if not handler.response_streaming:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                _TENANT.set(tenant)  # (each call is a task of its own)
                async with _observed(context, method, metrics, in_flight):
                    if isinstance(request, _Undecodable):
                        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, _message(request))
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        stream = handler.unary_stream

        async def unary_stream(request, context):
            _TENANT.set(tenant)
            async with _observed(context, method, metrics, in_flight):
                if isinstance(request, _Undecodable):
                    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, _message(request))
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


def _bearer(details: grpc.HandlerCallDetails) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            return bearer(value.decode(errors="replace") if isinstance(value, bytes) else value)
    return None


@contextlib.asynccontextmanager
async def _observed(
    context: grpc.aio.ServicerContext,
    method: str,
    metrics: ServiceMetrics | None,
    in_flight: InFlight,
) -> AsyncIterator[None]:
    """One call of a handler: an unexpected exception becomes INTERNAL (never UNKNOWN), and
    its latency and status code are counted."""
    start = time.perf_counter()
    code = grpc.StatusCode.OK
    in_flight.num_calls += 1
    try:
        yield
    except Exception as e:
        code = context.code() or grpc.StatusCode.INTERNAL
        await _internal(context, method, e)
        raise
    except BaseException:
        code = context.code() or grpc.StatusCode.CANCELLED
        raise
    finally:
        in_flight.num_calls -= 1
        if metrics:
            metrics.observe(method, code, time.perf_counter() - start)


async def _internal(context: grpc.aio.ServicerContext, method: str, e: Exception) -> None:
    """A handler's unexpected exception: INTERNAL with what it was, never grpc's UNKNOWN."""
    if isinstance(e, grpc.aio.AbortError):
        return  # the handler ended the call with its own status
    log.error("%s failed", method, exc_info=e)
    if context.done():
        return
    await abort(
        context,
        grpc.StatusCode.INTERNAL,
        f"internal error: {type(e).__name__}: {e}",
        reason="INTERNAL",
    )


def _message(request: _Undecodable) -> str:
    return f"cannot parse the request: {request.error}"


def _refuse(
    code: grpc.StatusCode, message: str, *, method: str, metrics: ServiceMetrics | None
) -> grpc.RpcMethodHandler:
    """A handler that only refuses; refusals are counted like any call (worth watching)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        if metrics:
            metrics.observe(method, code, 0.0)
        await abort(context, code, message)

    return grpc.unary_unary_rpc_method_handler(refuse)


@dataclass(frozen=True)
class Security:
    """TLS (server cert/key, optional client CA for mutual TLS) and who may call: the keys
    file (or one token, tenant default)."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None
    token: str | None = None
    keys: Keys | None = None

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None and self.key is None:
            return None
        if self.cert is None or self.key is None:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


def add_tls_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="server certificate: serve TLS")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="server private key")
    p.add_argument(
        "--tls-client-ca", type=Path, metavar="PEM", help="require client certificates (its CA)"
    )


DRAIN_SECONDS = 30.0


def add_drain_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, *aliases: str) -> None:
    p.add_argument(
        "--drain-seconds", *aliases, type=float, default=DRAIN_SECONDS, dest="drain_seconds",
        help="on SIGTERM: health turns NOT_SERVING, new calls are refused, and calls in flight "
        f"get this long to finish (default {DRAIN_SECONDS:.0f})",
    )  # fmt: skip


def add_service_arguments(p: argparse.ArgumentParser, *, port: int) -> None:
    """What a service's own command line adds to its options: where it listens, who may
    call, how it drains, what it logs."""
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=port)
    add_security_arguments(p)
    add_drain_argument(p)
    p.add_argument("--log-level", default="info")


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    add_tls_arguments(p)
    p.add_argument(
        "--token-file", type=Path, metavar="KEYS",
        help="require `authorization: Bearer KEY`: the keys file (`TENANT KEY` lines, or one "
        "key; `sha256:HEX` for a key kept as its hash); SIGHUP re-reads it",
    )  # fmt: skip
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_RPCS,
        help="calls served at once; more are refused with RESOURCE_EXHAUSTED",
    )


def security_from_args(args: argparse.Namespace) -> Security:
    keys = Keys(args.token_file) if args.token_file else None
    return Security(args.tls_cert, args.tls_key, args.tls_client_ca, keys=keys)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("grpc._cython.cygrpc").addFilter(_client_gone)


def _client_gone(record: logging.LogRecord) -> bool:
    """grpc logs an ERROR with a traceback whenever a reply cannot be sent because its client
    left (cancel, deadline, dropped connection): an everyday event, not an error of ours."""
    if "ExecuteBatchError" not in record.getMessage():
        return True
    record.levelno, record.levelname, record.exc_info, record.exc_text = (
        logging.DEBUG, "DEBUG", None, None,
    )  # fmt: skip
    return logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.DEBUG)
