"""The HTTP edge over AsyncSlotwiseClient: OpenAI's Chat Completions, Completions, Responses
and Embeddings, Anthropic's Messages, llama-server's native API (llama_server/api.py), and
models, health, readiness and metrics; the web page at / and its API (ui_api.py).

The routes are one-liners: each API's module (openai/, responses/, anthropic/)
translates its shapes onto one generation (turns.py). Every route answers with and without
the /v1 prefix. Any model name is accepted while one model is served (apps hardcode names),
unless --strict-model-name. The API key goes as `Authorization: Bearer` or as `x-api-key`
(Anthropic's clients send that); browsers may call the API directly with --cors-origins.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from clients.client import AsyncSlotwiseClient, SlotwiseError
from clients.gateway import media
from clients.gateway.anthropic import api as anthropic_api
from clients.gateway.anthropic.api import CountRequest, Messages, MessagesRequest
from clients.gateway.bodies import BodyError, BoundedRoute
from clients.gateway.cors import Cors
from clients.gateway.errors import (
    ApiError,
    bad_request,
    call,
    check_message_count,
    from_slotwise,
    invalid,
)
from clients.gateway.llama_server import api as llama_server_api
from clients.gateway.llama_server.api import DEFAULT_MAX_COMPLETIONS, LlamaServer
from clients.gateway.llama_server.settings import Settings, native_error, read_body
from clients.gateway.llama_server.slots import Slots
from clients.gateway.media import MediaPolicy
from clients.gateway.openai import api as openai_api
from clients.gateway.responses.api import Responses, ResponsesRequest
from clients.gateway.schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from clients.gateway.turns import Thinking, conversation_key
from clients.gateway.ui_api import add_ui, is_open_path
from slotwise_core.keys import Keys, bearer, callers, reload_on_sighup
from slotwise_core.limits import DEFAULT_MAX_MESSAGES

__all__ = ["GatewayConfig", "conversation_key", "create_app"]

_OPEN_PATHS = ("/health", "/ready", "/metrics")
# a body this large holds two images at --max-image-mb's default, base64 (4/3 of their bytes),
# well within what prep and infer take in one message (--max-message-mb, 256)
DEFAULT_MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True)
class GatewayConfig:
    prep_address: str
    infer_address: str
    model_name: str = "slotwise"
    api_key: str | None = None  # one key (tenant default); or:
    api_keys: Keys | None = None  # the keys file (the services' own): callers' keys go on
    media: MediaPolicy = field(default_factory=MediaPolicy)
    token: str | None = None  # bearer token for the gRPC services, without api keys
    strict_model_name: bool = False  # 404 for another model name (else any name is this one)
    cors_origins: tuple[str, ...] = ()
    ui: bool = True  # the web page at / (its API under /slotwise/ is there either way)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 413 beyond: nothing larger is read in
    max_messages: int = DEFAULT_MAX_MESSAGES  # a chat's (400 beyond, before any is read)
    # generations one /completion starts (its prompts x n_cmpl): 400 beyond, before any starts
    max_completions: int = DEFAULT_MAX_COMPLETIONS
    # a reasoning model's thoughts: --reasoning-format, --reasoning-budget(-message),
    # --chat-template-kwargs and --reasoning (what a request leaves unset)
    thinking: Thinking = field(default_factory=Thinking)
    # llama-server's: --no-slots (GET /slots is a 501), --alias and --tags (/v1/models),
    # --verbose (__verbose in chat completions)
    slots_endpoint: bool = True
    model_aliases: tuple[str, ...] = ()
    model_tags: tuple[str, ...] = ()
    verbose_replies: bool = False
    # a native /completion's defaults (llama-server's --temp, --seed), and /props' model_path
    default_temperature: float | None = None
    default_seed: int | None = None
    model_path: str = ""


def create_app(config: GatewayConfig) -> FastAPI:
    keys = callers(config.api_keys, config.api_key)
    clients: dict[str | None, AsyncSlotwiseClient] = {}  # by the caller's key (few: the file's)
    closing = asyncio.Event()  # set when the server stops: long streams end (ui_api)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if keys is not None:
            reload_on_sighup(keys)
        yield
        for c in clients.values():
            await c.close()
        clients.clear()

    app = FastAPI(
        title="slotwise", summary="OpenAI and Anthropic APIs over slotwise", lifespan=lifespan
    )
    app.router.route_class = BoundedRoute  # (every body read with bodies.parse's bounds)
    app.state.closing = closing
    # bodies sent without a Content-Length (chunked) are counted as they come in, and refused
    # past the limit (an HTTPException(413), which too_large below answers); a declared
    # Content-Length is checked in `edge`, first: this middleware would answer that in plain text
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=config.max_body_bytes)
    if config.cors_origins:
        app.add_middleware(Cors, origins=config.cors_origins)  # (llama-server's answers)
    registry = CollectorRegistry()
    registry.register(media.FETCHES)
    requests = Counter(
        "slotwise_http_requests", "HTTP requests", ["endpoint", "status"], registry=registry
    )
    latency = Histogram(
        "slotwise_http_request_seconds",
        "until the response (or its last chunk)",
        ["endpoint"],
        registry=registry,
    )

    def client() -> AsyncSlotwiseClient:
        """A client that calls the services with the caller's key (so that they know its
        tenant), or with the gateway's own token when it has no keys; made on first use."""
        key = _CALLER_KEY.get() if keys is not None else None
        if key not in clients:
            token = key if keys is not None else config.token
            clients[key] = AsyncSlotwiseClient(
                config.prep_address, config.infer_address, token=token, timeout=None
            )
        return clients[key]

    def anthropic(path: str) -> bool:
        return path.removeprefix("/v1").startswith("/messages")

    def error(path: str, e: ApiError) -> JSONResponse:
        if anthropic(path):
            return anthropic_api.error_response(e)
        if llama_server_api.is_native(path):
            return llama_server_api.error_response(e)
        return e.response()

    too_big = ApiError(
        413,
        f"the request body is over {config.max_body_bytes} bytes (--max-body-mb)",
        code="request_too_large",
    )

    @app.middleware("http")
    async def edge(request: Request, call_next: Any) -> Response:
        path = request.url.path
        open_path = path in _OPEN_PATHS or (config.ui and is_open_path(path))
        if keys is not None and request.method != "OPTIONS" and not open_path:
            key = _presented_key(request)
            if keys.tenant_of(key) is None:
                requests.labels("unauthorized", "401").inc()
                refused = ApiError(
                    401,
                    "incorrect or missing API key",
                    code="invalid_api_key",
                    type="authentication_error",
                )
                return error(path, refused)
            _CALLER_KEY.set(key)
        declared = request.headers.get("content-length", "")
        if re.fullmatch("[0-9]+", declared) and int(declared[:20]) > config.max_body_bytes:
            requests.labels("too_large", "413").inc()
            return error(path, too_big)  # (before a byte of it is read)
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")  # the template, never the raw path: bounded labels
        endpoint = getattr(route, "path", "unmatched")
        requests.labels(endpoint, str(response.status_code)).inc()
        latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error(request.url.path, e)

    @app.exception_handler(413)
    async def too_large(request: Request, e: HTTPException) -> JSONResponse:
        return error(request.url.path, too_big)

    @app.exception_handler(RequestValidationError)
    async def unreadable(request: Request, e: RequestValidationError) -> JSONResponse:
        return error(request.url.path, invalid(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's and FastAPI's own refusals (a body refused as it was read, an unknown
        path, a method the path lacks), in the API's shape rather than {"detail": ...}."""
        if isinstance(e, BodyError):
            return error(request.url.path, bad_request(e.message, e.param))
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error(request.url.path, ApiError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(SlotwiseError)
    async def services_error(request: Request, e: SlotwiseError) -> JSONResponse:
        """A refusal of the services that no API translated itself."""
        return error(request.url.path, from_slotwise(e))

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> JSONResponse:
        """A fault of the gateway's own (logged by the server): still the API's error shape."""
        return error(request.url.path, ApiError(500, f"internal error: {e!r}", type="server_error"))

    def route(method: str, path: str) -> Callable[[Any], Any]:
        """Both /v1{path} and {path}."""

        def register(fn: Any) -> Any:
            for p in (f"/v1{path}", path):
                app.add_api_route(p, fn, methods=[method], response_model=None)
            return fn

        return register

    def model_name(name: str | None) -> str:
        known = (config.model_name, *config.model_aliases)
        if config.strict_model_name and name not in known:
            raise ApiError(
                404,
                f"the model {name!r} does not exist here; this server has {config.model_name!r}",
                code="model_not_found",
                param="model",
            )
        return config.model_name

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        serving = await client().serving()
        ok = all(serving.values())
        return JSONResponse({"ready": ok, "services": serving}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @route("GET", "/models")
    async def models() -> dict[str, object]:
        info = await call(client().model_info())
        name = config.model_name
        card = _model_card(name)
        card["aliases"] = sorted({name, *config.model_aliases})
        card["tags"] = sorted(set(config.model_tags))
        multimodal = info.supports_vision or info.supports_audio
        return {
            # llama-server's list beside OpenAI's (Ollama's shape: the tools that read it)
            "models": [
                {
                    "name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                    "type": "model", "description": "", "tags": card["tags"] or [""],
                    "capabilities": ["completion", "multimodal"] if multimodal else ["completion"],
                    "parameters": "",
                    "details": {"parent_model": "", "format": "gguf", "family": "",
                                "families": [""], "parameter_size": "", "quantization_level": ""},
                }
            ],
            "object": "list",
            "data": [card],
        }  # fmt: skip

    @route("GET", "/models/{name}")
    async def model(name: str) -> dict[str, object]:
        return _model_card(model_name(name) if config.strict_model_name else name)

    @route("POST", "/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_message_count(len(body.messages), config.max_messages, "messages")
        name = model_name(body.model)
        return await openai_api.chat_completion(
            client(), body, config.media, name, config.thinking, config.verbose_replies
        )

    # (/completions without /v1 is llama-server's alias of its native /completion)
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        return await openai_api.completion(client(), body, model_name(body.model))

    @route("POST", "/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        return await openai_api.embeddings(client(), body, model_name(body.model))

    @route("POST", "/responses")
    async def create_response(body: ResponsesRequest) -> Response:
        if isinstance(body.input, list):
            check_message_count(len(body.input), config.max_messages, "input")
        return await Responses(
            client(), config.media, model_name(body.model), config.thinking
        ).create(body)

    @route("GET", "/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return await Responses(client(), config.media, config.model_name).get(response_id)

    @route("DELETE", "/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await Responses(client(), config.media, config.model_name).delete(response_id)

    @route("POST", "/messages")
    async def messages(body: MessagesRequest) -> Response:
        check_message_count(len(body.messages), config.max_messages, "messages")
        return await Messages(
            client(), config.media, model_name(body.model), config.thinking
        ).create(body)

    @route("POST", "/messages/count_tokens")
    async def count_tokens(body: CountRequest) -> dict[str, int]:
        check_message_count(len(body.messages), config.max_messages, "messages")
        return await Messages(client(), config.media, model_name(body.model)).count_tokens(body)

    add_llama_server(app, route, client, config)
    add_ui(app, client, page=config.ui, model_name=config.model_name, closing=closing)
    return app


def add_llama_server(
    app: FastAPI,
    route: Callable[[str, str], Callable[[Any], Any]],
    client: Callable[[], AsyncSlotwiseClient],
    config: GatewayConfig,
) -> None:
    """llama-server's native endpoints (llama_server/api.py), at its paths."""
    slots = Slots()
    defaults = None
    if config.default_temperature is not None or config.default_seed is not None:
        defaults = Settings()
        if config.default_temperature is not None:
            defaults.temperature = config.default_temperature
        if config.default_seed is not None:
            defaults.seed = config.default_seed & 0xFFFFFFFF

    def native() -> LlamaServer:
        return LlamaServer(
            client(), model=config.model_name, media=config.media, slots=slots, ui=config.ui,
            cors=bool(config.cors_origins), max_messages=config.max_messages,
            max_completions=config.max_completions, defaults=defaults,
            model_path=config.model_path, thinking=config.thinking,
        )  # fmt: skip

    def post(*paths: str) -> Callable[[Any], Any]:
        def register(fn: Any) -> Any:
            for p in paths:
                app.add_api_route(p, fn, methods=["POST"], response_model=None)
            return fn

        return register

    @post("/completion", "/completions")
    async def completion(request: Request) -> Response:
        return await native().completion(await read_body(request))

    @post("/infill")
    async def infill(request: Request) -> Response:
        return await native().infill(await read_body(request))

    @post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await native().tokenize(await read_body(request))

    @post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await native().detokenize(await read_body(request))

    @post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        return await native().apply_template(await read_body(request))

    @post("/embedding")
    async def embedding(request: Request) -> Response:
        return await native().embedding(await read_body(request))

    @post("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
    async def rerank() -> Response:
        raise native_error(501, "This server does not support reranking (no reranking model)")

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return await native().props()

    @post("/props")
    async def set_props() -> Response:
        raise native_error(501, "This server does not support changing global properties")

    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/lora-adapters")
    async def lora_adapters() -> list[dict[str, Any]]:
        return await native().lora_adapters()

    @post("/lora-adapters")
    async def set_lora_adapters(request: Request) -> dict[str, Any]:
        return await native().set_lora_adapters(await request.body())

    @app.get("/slots")
    async def get_slots(request: Request) -> Response:
        if not config.slots_endpoint:
            raise native_error(
                501, "This server does not support slots endpoint. Start it without `--no-slots`"
            )
        return await native().get_slots(bool(request.query_params.get("fail_on_no_slot")))

    @post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request) -> dict[str, Any]:
        server = native()
        try:
            k = int(id_slot)
        except ValueError:
            raise native_error(400, "Invalid slot ID") from None
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise native_error(400, "Invalid action")
        if not 0 <= k < (await server.server()).num_slots:
            raise native_error(400, "Invalid slot ID")
        body = await read_body(request)
        if action == "erase":
            return await slots.erase(server.client, k)
        if "filename" not in body:
            raise native_error(400, '"filename" is required')
        act = slots.save if action == "save" else slots.restore
        return await act(server.client, k, body["filename"])

    @route("POST", "/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request) -> dict[str, Any]:
        return await native().input_tokens(await read_body(request), responses=False)

    @route("POST", "/responses/input_tokens")
    async def responses_input_tokens(request: Request) -> dict[str, Any]:
        return await native().input_tokens(await read_body(request), responses=True)


_CALLER_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller", default=None)


def _presented_key(request: Request) -> str | None:
    """`Authorization: Bearer KEY` or `x-api-key: KEY` (Keys compares in constant time)."""
    key = bearer(request.headers.get("authorization", ""))
    return key if key is not None else request.headers.get("x-api-key") or None


def _model_card(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "slotwise"}
