"""What each API's router is built with: the route class that answers every error of its
requests in its API's shape, the routes that answer at both /v1{path} and {path}, and what the
routes serve with (the gateway's settings, the caller's client, the model names it answers to).

Each API's router names its route class (ApiRoute, or a subclass with the API's `shaped`), so
an error is worded by the route that took the request, never by looking at its path: a refusal
of the API, a body that cannot be read or validated, a method the path lacks, a refusal of the
services, a fault of the gateway's own. A request refused before any route took it (its key,
its declared size) is answered in the shape of the route that would have taken it
(`error_shape`); a path no route serves in OpenAI's, the gateway's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Receive, Scope, Send

from clients.client import AsyncSlotwiseClient, SlotwiseError
from clients.gateway.bodies import BodyError, BoundedRoute
from clients.gateway.config import GatewayConfig
from clients.gateway.errors import ApiError, bad_request, from_slotwise, invalid

__all__ = ["ApiRoute", "ErrorShape", "Served", "as_api_error", "error_shape", "v1_and_bare"]

log = logging.getLogger("slotwise.gateway")

ErrorShape = Callable[[ApiError], JSONResponse]
F = TypeVar("F", bound=Callable[..., Any])


class ApiRoute(BoundedRoute):
    """A route of one API: whatever error its request meets is answered in that API's shape,
    `shaped` (OpenAI's here, the gateway's own; an API with another shape subclasses this)."""

    @staticmethod
    def shaped(e: ApiError) -> JSONResponse:
        return e.response()

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        shaped = self.shaped

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:
                if not isinstance(e, _REFUSALS):
                    log.exception("a fault of the gateway's own, answered with a 500")
                return shaped(as_api_error(e, request.app.state.max_body_bytes))

        return answered

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A method the path lacks: 405, in the API's shape (as Starlette's Route words it)."""
        if self.methods and scope["method"] not in self.methods:
            refused = ApiError(405, "Method Not Allowed", type="invalid_request_error")
            await self.shaped(refused)(scope, receive, send)
            return
        await super().handle(scope, receive, send)


_REFUSALS = (ApiError, HTTPException, RequestValidationError, SlotwiseError)


def as_api_error(e: Exception, max_body_bytes: int) -> ApiError:
    """An exception as the error the caller hears: the API's own refusals as they are; a body
    past the limit, unreadable or invalid; Starlette's and FastAPI's refusals (rather than their
    {"detail": ...}); a refusal of the services that no API translated itself; anything else a
    fault of the gateway's own (500)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, HTTPException) and e.status_code == 413:
        return too_large(max_body_bytes)
    if isinstance(e, RequestValidationError):
        return invalid(e.errors())
    if isinstance(e, BodyError):
        return bad_request(e.message, e.param)
    if isinstance(e, HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return ApiError(e.status_code, str(e.detail), type=kind)
    if isinstance(e, SlotwiseError):
        return from_slotwise(e)
    return ApiError(500, f"internal error: {e!r}", type="server_error")


def too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is over {max_body_bytes} bytes (--max-body-mb)",
        code="request_too_large",
    )


def error_shape(routes: Sequence[BaseRoute], scope: Scope) -> ErrorShape:
    """The error shape of the route the router will hand this request to (as Starlette's
    router picks it: the first that matches in full, else the first whose path matches); the
    gateway's own where none will."""
    chosen = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            chosen = route
            break
        if match is Match.PARTIAL and chosen is None:
            chosen = route
    return chosen.shaped if isinstance(chosen, ApiRoute) else ApiRoute.shaped


def v1_and_bare(router: APIRouter, method: str, path: str) -> Callable[[F], F]:
    """A route at both /v1{path} and {path}."""

    def register(fn: F) -> F:
        for p in (f"/v1{path}", path):
            router.add_api_route(p, fn, methods=[method], response_model=None)
        return fn

    return register


@dataclass(frozen=True)
class Served:
    """What an API's routes serve with: the gateway's settings, and a client that calls the
    services as the caller (its key), made on first use."""

    config: GatewayConfig
    client: Callable[[], AsyncSlotwiseClient]

    def model_name(self, name: str | None) -> str:
        """The model a request names, as this server answers to it: any name is the one model
        served, unless --strict-model-name (then 404 for a name not its own or an alias)."""
        config = self.config
        if config.strict_model_name and name not in (config.model_name, *config.model_aliases):
            raise ApiError(
                404,
                f"the model {name!r} does not exist here; this server has {config.model_name!r}",
                code="model_not_found",
                param="model",
            )
        return config.model_name
