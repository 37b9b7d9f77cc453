"""The Responses API's routes, at /v1 and without: create, get and delete a response. Errors
come in OpenAI's shape (ApiRoute's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from clients.gateway.errors import check_message_count
from clients.gateway.responses.api import Responses
from clients.gateway.responses.schema import ResponsesRequest
from clients.gateway.routing import ApiRoute, Served, v1_and_bare

__all__ = ["router"]


def router(served: Served) -> APIRouter:
    routes = APIRouter(route_class=ApiRoute)
    config, client = served.config, served.client

    @v1_and_bare(routes, "POST", "/responses")
    async def create_response(body: ResponsesRequest) -> Response:
        if isinstance(body.input, list):
            check_message_count(len(body.input), config.max_messages, "input")
        return await Responses(
            client(), config.media, served.model_name(body.model), config.thinking
        ).create(body)

    @v1_and_bare(routes, "GET", "/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return await Responses(client(), config.media, config.model_name).get(response_id)

    @v1_and_bare(routes, "DELETE", "/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await Responses(client(), config.media, config.model_name).delete(response_id)

    return routes
