"""The HTTP edge over AsyncSlotwiseClient: OpenAI's Chat Completions, Completions, Responses
and Embeddings, Anthropic's Messages, llama-server's native API, and models, health, readiness
and metrics; the web page at / and its API (ui_api.py).

Each API is a router of its own (openai/, responses/, anthropic/, llama_server/), whose routes
translate its shapes onto one generation (turns.py) and answer its errors in its own shape
(routing.py). Every route answers with and without the /v1 prefix. Any model name is accepted
while one model is served (apps hardcode names), unless --strict-model-name. The API key goes as
`Authorization: Bearer` or as `x-api-key` (Anthropic's clients send that); browsers may call the
API directly with --cors-origins.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from clients.client import AsyncSlotwiseClient
from clients.gateway import media
from clients.gateway.anthropic.router import router as anthropic_router
from clients.gateway.config import GatewayConfig
from clients.gateway.cors import Cors
from clients.gateway.errors import ApiError
from clients.gateway.llama_server.router import router as llama_server_router
from clients.gateway.openai.router import router as openai_router
from clients.gateway.responses.router import router as responses_router
from clients.gateway.routing import ApiRoute, Served, as_api_error, error_shape, too_large
from clients.gateway.turns import conversation_key
from clients.gateway.ui_api import add_ui, is_open_path
from slotwise_core.keys import Keys, bearer, callers, reload_on_sighup

__all__ = ["GatewayConfig", "conversation_key", "create_app"]

_OPEN_PATHS = ("/health", "/ready", "/metrics")


def create_app(config: GatewayConfig) -> FastAPI:
    keys = callers(config.api_keys, config.api_key)
    clients = _Clients(config, keys)
    app = FastAPI(
        title="slotwise",
        summary="OpenAI and Anthropic APIs over slotwise",
        lifespan=_lifespan(keys, clients),
    )
    app.router.route_class = ApiRoute  # (routes of no API: OpenAI's error shape)
    app.state.closing = asyncio.Event()  # set when the server stops: long streams end (ui_api)
    app.state.max_body_bytes = config.max_body_bytes
    metrics = _Metrics()
    _add_edge(app, config, keys, metrics)
    _add_unrouted_errors(app)
    _add_service_routes(app, clients, metrics)
    served = Served(config, clients.client)
    for router in (openai_router, responses_router, anthropic_router, llama_server_router):
        # each API's routes as they are, in the app's own list (include_router would put them
        # behind a sub-router: the metrics and the edge read the route a request takes)
        app.router.routes.extend(router(served).routes)
    add_ui(app, clients.client, page=config.ui, model_name=config.model_name,
           closing=app.state.closing)  # fmt: skip
    return app


class _Clients:
    """The services' clients, by the caller's key (few: the keys file's), made on first use."""

    def __init__(self, config: GatewayConfig, keys: Keys | None):
        self.config, self.keys = config, keys
        self.made: dict[str | None, AsyncSlotwiseClient] = {}

    def client(self) -> AsyncSlotwiseClient:
        """A client that calls the services with the caller's key (so that they know its
        tenant), or with the gateway's own token when it has no keys."""
        key = _CALLER_KEY.get() if self.keys is not None else None
        if key not in self.made:
            token = key if self.keys is not None else self.config.token
            self.made[key] = AsyncSlotwiseClient(
                self.config.prep_address, self.config.infer_address, token=token, timeout=None
            )
        return self.made[key]

    async def close(self) -> None:
        for c in self.made.values():
            await c.close()
        self.made.clear()


def _lifespan(
    keys: Keys | None, clients: _Clients
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if keys is not None:
            reload_on_sighup(keys)
        yield
        await clients.close()

    return lifespan


class _Metrics:
    """The gateway's own: requests by route and status, and their time to the response."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(media.FETCHES)
        self.requests = Counter(
            "slotwise_http_requests", "HTTP requests", ["endpoint", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "slotwise_http_request_seconds",
            "until the response (or its last chunk)",
            ["endpoint"],
            registry=self.registry,
        )


def _add_edge(app: FastAPI, config: GatewayConfig, keys: Keys | None, metrics: _Metrics) -> None:
    """The checks before any route: the caller's key, and the body's declared size (both
    answered in the shape of the route that would have taken the request); the metrics."""
    # bodies sent without a Content-Length (chunked) are counted as they come in, and refused
    # past the limit (an HTTPException(413), which the route answers); a declared Content-Length
    # is checked in `edge`, first: this middleware would answer that in plain text
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=config.max_body_bytes)
    if config.cors_origins:
        app.add_middleware(Cors, origins=config.cors_origins)  # (llama-server's answers)

    def refuse(request: Request, e: ApiError) -> Response:
        return error_shape(app.router.routes, request.scope)(e)

    @app.middleware("http")
    async def edge(request: Request, call_next: Any) -> Response:
        path = request.url.path
        open_path = path in _OPEN_PATHS or (config.ui and is_open_path(path))
        if keys is not None and request.method != "OPTIONS" and not open_path:
            key = _presented_key(request)
            if keys.tenant_of(key) is None:
                metrics.requests.labels("unauthorized", "401").inc()
                refused = ApiError(
                    401,
                    "incorrect or missing API key",
                    code="invalid_api_key",
                    type="authentication_error",
                )
                return refuse(request, refused)
            _CALLER_KEY.set(key)
        declared = request.headers.get("content-length", "")
        if re.fullmatch("[0-9]+", declared) and int(declared[:20]) > config.max_body_bytes:
            metrics.requests.labels("too_large", "413").inc()
            return refuse(request, too_large(config.max_body_bytes))  # (before a byte is read)
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")  # the template, never the raw path: bounded labels
        endpoint = getattr(route, "path", "unmatched")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response


def _add_unrouted_errors(app: FastAPI) -> None:
    """What no API's route answered (every route answers its own errors): a path no route
    serves, the page's files, a fault outside any route; in OpenAI's shape, the gateway's
    own."""

    async def answer(request: Request, e: Exception) -> JSONResponse:
        return as_api_error(e, request.app.state.max_body_bytes).response()

    app.add_exception_handler(HTTPException, answer)
    app.add_exception_handler(Exception, answer)


def _add_service_routes(app: FastAPI, clients: _Clients, meters: _Metrics) -> None:
    """Health, readiness and metrics: open to any caller."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        serving = await clients.client().serving()
        ok = all(serving.values())
        return JSONResponse({"ready": ok, "services": serving}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(meters.registry), media_type=CONTENT_TYPE_LATEST)


_CALLER_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller", default=None)


def _presented_key(request: Request) -> str | None:
    """`Authorization: Bearer KEY` or `x-api-key: KEY` (Keys compares in constant time)."""
    key = bearer(request.headers.get("authorization", ""))
    return key if key is not None else request.headers.get("x-api-key") or None
