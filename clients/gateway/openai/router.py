"""OpenAI's routes: the model list, Chat Completions, Completions and Embeddings, each at /v1
and without (but /completions, llama-server's native one). Errors come in OpenAI's shape
(ApiRoute's): {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from clients.client import AsyncSlotwiseClient
from clients.gateway.config import GatewayConfig
from clients.gateway.errors import call, check_message_count
from clients.gateway.openai import api
from clients.gateway.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from clients.gateway.routing import ApiRoute, Served, v1_and_bare

__all__ = ["router"]


def router(served: Served) -> APIRouter:
    routes = APIRouter(route_class=ApiRoute)
    config, client = served.config, served.client

    @v1_and_bare(routes, "GET", "/models")
    async def models() -> dict[str, object]:
        return await model_list(client(), config)

    @v1_and_bare(routes, "GET", "/models/{name}")
    async def model(name: str) -> dict[str, object]:
        return model_card(served.model_name(name) if config.strict_model_name else name)

    @v1_and_bare(routes, "POST", "/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_message_count(len(body.messages), config.max_messages, "messages")
        name = served.model_name(body.model)
        return await api.chat_completion(
            client(), body, config.media, name, config.thinking, config.verbose_replies
        )

    # (/completions without /v1 is llama-server's alias of its native /completion)
    @routes.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        return await api.completion(client(), body, served.model_name(body.model))

    @v1_and_bare(routes, "POST", "/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        return await api.embeddings(client(), body, served.model_name(body.model))

    return routes


async def model_list(client: AsyncSlotwiseClient, config: GatewayConfig) -> dict[str, object]:
    """OpenAI's list of the one model, its aliases and tags, beside llama-server's (Ollama's
    shape: the tools that read it)."""
    info = await call(client.model_info())
    name = config.model_name
    card = model_card(name)
    card["aliases"] = sorted({name, *config.model_aliases})
    card["tags"] = sorted(set(config.model_tags))
    multimodal = info.supports_vision or info.supports_audio
    return {
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


def model_card(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "slotwise"}
