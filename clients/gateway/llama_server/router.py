"""llama-server's native routes, at its own paths (/completion, /tokenize, /props, /slots, ...,
and its /v1 ones). Errors come in llama-server's shape (NativeRoute's): {"error": {"code",
"message", "type"}}."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

from clients.client import AsyncSlotwiseClient
from clients.gateway.config import GatewayConfig
from clients.gateway.llama_server.api import LlamaServer, error_response
from clients.gateway.llama_server.settings import Settings, native_error, read_body
from clients.gateway.llama_server.slots import Slots
from clients.gateway.routing import ApiRoute, Served, v1_and_bare

__all__ = ["NativeRoute", "is_native", "router"]

F = TypeVar("F", bound=Callable[..., Any])


class NativeRoute(ApiRoute):
    shaped = staticmethod(error_response)


def router(served: Served) -> APIRouter:
    routes = APIRouter(route_class=NativeRoute)
    config = served.config
    slots = Slots()
    defaults = completion_defaults(config)

    def native() -> LlamaServer:
        return LlamaServer(
            served.client(), model=config.model_name, media=config.media, slots=slots,
            ui=config.ui, cors=bool(config.cors_origins), max_messages=config.max_messages,
            max_completions=config.max_completions, defaults=defaults,
            model_path=config.model_path, thinking=config.thinking,
        )  # fmt: skip

    _add_generation(routes, native)
    _add_server(routes, native, config)
    _add_input_tokens(routes, native)
    return routes


def completion_defaults(config: GatewayConfig) -> Settings | None:
    """A /completion's settings where its body names none: the server's --temp and --seed."""
    if config.default_temperature is None and config.default_seed is None:
        return None
    defaults = Settings()
    if config.default_temperature is not None:
        defaults.temperature = config.default_temperature
    if config.default_seed is not None:
        defaults.seed = config.default_seed & 0xFFFFFFFF
    return defaults


def _post(routes: APIRouter, *paths: str) -> Callable[[F], F]:
    def register(fn: F) -> F:
        for p in paths:
            routes.add_api_route(p, fn, methods=["POST"], response_model=None)
        return fn

    return register


def _add_generation(routes: APIRouter, native: Callable[[], LlamaServer]) -> None:
    """Completions, infill, tokens, the chat template's prompt, embeddings (and reranking,
    which no model here does)."""

    @_post(routes, "/completion", "/completions")
    async def completion(request: Request) -> Response:
        return await native().completion(await read_body(request))

    @_post(routes, "/infill")
    async def infill(request: Request) -> Response:
        return await native().infill(await read_body(request))

    @_post(routes, "/tokenize")
    async def tokenize(request: Request) -> Response:
        return await native().tokenize(await read_body(request))

    @_post(routes, "/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await native().detokenize(await read_body(request))

    @_post(routes, "/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        return await native().apply_template(await read_body(request))

    @_post(routes, "/embedding")
    async def embedding(request: Request) -> Response:
        return await native().embedding(await read_body(request))

    @_post(routes, "/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
    async def rerank() -> Response:
        raise native_error(501, "This server does not support reranking (no reranking model)")


def _add_server(
    routes: APIRouter, native: Callable[[], LlamaServer], config: GatewayConfig
) -> None:
    """The server's properties, health, LoRA adapters, and slots with their actions."""

    @routes.get("/props")
    async def props() -> dict[str, Any]:
        return await native().props()

    @_post(routes, "/props")
    async def set_props() -> Response:
        raise native_error(501, "This server does not support changing global properties")

    @routes.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @routes.get("/lora-adapters")
    async def lora_adapters() -> list[dict[str, Any]]:
        return await native().lora_adapters()

    @_post(routes, "/lora-adapters")
    async def set_lora_adapters(request: Request) -> dict[str, Any]:
        return await native().set_lora_adapters(await request.body())

    @routes.get("/slots")
    async def get_slots(request: Request) -> Response:
        if not config.slots_endpoint:
            raise native_error(
                501, "This server does not support slots endpoint. Start it without `--no-slots`"
            )
        return await native().get_slots(bool(request.query_params.get("fail_on_no_slot")))

    @_post(routes, "/slots/{id_slot}")
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
        return await server.slot_action(k, action, await read_body(request))


def _add_input_tokens(routes: APIRouter, native: Callable[[], LlamaServer]) -> None:
    """The prompt's size in tokens of a chat, or of a Responses body, at /v1 and without."""

    @v1_and_bare(routes, "POST", "/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request) -> dict[str, Any]:
        return await native().input_tokens(await read_body(request), responses=False)

    @v1_and_bare(routes, "POST", "/responses/input_tokens")
    async def responses_input_tokens(request: Request) -> dict[str, Any]:
        return await native().input_tokens(await read_body(request), responses=True)


def is_native(path: str) -> bool:
    """Whether one of these routes serves `path`, so that its errors come in llama-server's
    shape. For those that read a reply (the tests): the gateway itself never asks, each route
    answers in its own API's shape."""
    routes = _templates().routes
    return any(isinstance(r, APIRoute) and r.path_regex.fullmatch(path) for r in routes)


@functools.cache
def _templates() -> APIRouter:
    """The routes, as a router made with no services behind it (it calls none when made)."""

    def no_client() -> AsyncSlotwiseClient:
        raise RuntimeError("this router only names its paths")

    return router(Served(GatewayConfig("", ""), no_client))
