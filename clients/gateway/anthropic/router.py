"""The Messages API's routes, at /v1 and without: a message, and its count of tokens. Errors
come in Anthropic's shape (AnthropicRoute's): {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

from fastapi import APIRouter, Response

from clients.gateway.anthropic.api import Messages, error_response
from clients.gateway.anthropic.schema import CountRequest, MessagesRequest
from clients.gateway.errors import check_message_count
from clients.gateway.routing import ApiRoute, Served, v1_and_bare

__all__ = ["AnthropicRoute", "router"]


class AnthropicRoute(ApiRoute):
    shaped = staticmethod(error_response)


def router(served: Served) -> APIRouter:
    routes = APIRouter(route_class=AnthropicRoute)
    config, client = served.config, served.client

    @v1_and_bare(routes, "POST", "/messages")
    async def messages(body: MessagesRequest) -> Response:
        check_message_count(len(body.messages), config.max_messages, "messages")
        return await Messages(
            client(), config.media, served.model_name(body.model), config.thinking
        ).create(body)

    @v1_and_bare(routes, "POST", "/messages/count_tokens")
    async def count_tokens(body: CountRequest) -> dict[str, int]:
        check_message_count(len(body.messages), config.max_messages, "messages")
        return await Messages(client(), config.media, served.model_name(body.model)).count_tokens(
            body
        )

    return routes
