"""Request bodies as JSON, read with bounds before any API looks at them.

Python's JSON reader takes what JSON has not: NaN, Infinity and -Infinity, and a number too
large for a double (1e400) read as infinity. Nothing past the edge expects them (an int() of
NaN raises, a comparison with NaN is always false), so they are refused here, naming where they
are. A body nested 50,000 deep overflows the reader (RecursionError), and one nested a few
hundred deep still overflows what walks it later (pydantic, the schema converter, protobuf):
nesting is refused past MAX_BODY_DEPTH.

Every route reads its body through this module: FastAPI's body parameters through BoundedRoute
(its requests' `json()`), llama-server's native routes through `read_body`
(llama_server/settings.py).
A refusal is a BodyError, which the route answers in its API's error shape (routing.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

__all__ = ["MAX_BODY_DEPTH", "BodyError", "BoundedRoute", "parse"]

# arrays and objects inside each other (a JSON schema as deep as grammar_limits' 64 levels,
# two JSON levels each, inside a tool's definition, fits)
MAX_BODY_DEPTH = 256


class BodyError(HTTPException):
    """A body refused as it is read, naming the field (`param`, dotted) where one is at fault.
    An HTTPException because FastAPI lets one raised while it reads a body through as it is
    (any other exception there becomes its own plain 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message)
        self.message, self.param = message, param


class _NotANumber(float):
    """What NaN, Infinity or 1e400 is read as: a float still (json's own reader wants one),
    found again afterwards by its type."""

    def __new__(cls, text: str) -> _NotANumber:
        value = super().__new__(cls, math.nan)
        value.text = text
        return value

    text: str


def parse(raw: bytes | str) -> Any:
    """The body's JSON value. Not JSON at all: json.JSONDecodeError (each API words that its own
    way); nested past MAX_BODY_DEPTH or holding a number JSON has not: BodyError."""
    found: list[_NotANumber] = []

    def constant(text: str) -> float:
        found.append(_NotANumber(text))
        return found[-1]

    def number(text: str) -> float:
        value = float(text)
        return value if math.isfinite(value) else constant(text)

    try:
        value = json.loads(raw, parse_constant=constant, parse_float=number)
    except RecursionError:
        raise _too_deep() from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # (an integer of more than 4,300 digits; bytes that are not UTF-8)
        raise BodyError(f"the body is not JSON: {e}") from None
    _check_depth(value, raw)
    if found:
        where, first = next((p, v) for p, v in _leaves(value) if isinstance(v, _NotANumber))
        raise BodyError(f"{where or 'body'}: {first.text} is not a number JSON has", where or None)
    return value


def _too_deep() -> BodyError:
    return BodyError(f"the body nests arrays and objects more than {MAX_BODY_DEPTH} deep")


def _check_depth(value: Any, raw: bytes | str) -> None:
    """Refuse nesting past MAX_BODY_DEPTH: counted only when the body has that many brackets at
    all (two counts in C: most bodies stop there)."""
    text = raw if isinstance(raw, bytes) else raw.encode()
    if text.count(b"[") + text.count(b"{") <= MAX_BODY_DEPTH:
        return
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        v, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise _too_deep()
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _leaves(value: Any) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every value that is no array or object, in the body's order."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict | list):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((f"{path}.{k}" if path else str(k), c) for k, c in reversed(list(items)))
        else:
            yield path, v


class _BoundedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse(await self.body())
        return self._json


class BoundedRoute(APIRoute):
    """A route whose body FastAPI reads with `parse` (its request's `json()`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(_BoundedRequest(request.scope, request.receive))

        return bounded
