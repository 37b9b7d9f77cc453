"""Errors in the OpenAI JSON shape, with the HTTP status its SDKs map to their exceptions.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

400 invalid_request_error (`context_length_exceeded` for a prompt that can never fit), 401 with
--api-key, 404 for an unknown model, 413 for a body past --max-body-mb, 429 when the queue is
full (with Retry-After), 503 while loading or draining. Bad input never gets a 500.

Every gRPC status of the services has its HTTP status (_BY_CODE, complete: a test walks
grpc.StatusCode): CANCELLED is 503 with Retry-After (a call the services ended, not the caller:
the caller that went away hears nothing), ABORTED 409, UNKNOWN and a status grpc adds later 502;
only INTERNAL and DATA_LOSS are 500, each with its message in the API's error shape.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from fastapi.responses import JSONResponse

from clients.client import SlotwiseError

T = TypeVar("T")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        metadata: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.retry_after = code, param, retry_after
        self.metadata = metadata or {}  # the service's numbers (ErrorInfo), where shown

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid(errors: Sequence[Mapping[str, Any]], *where: str) -> ApiError:
    """A body's first validation error (pydantic's `errors()`), naming its field: `where` (the
    part of the body that was validated), then pydantic's path within it."""
    first = _telling(errors)
    path = [*where, *_field_path(first)]
    param = ".".join(path) or None
    return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)


# the names pydantic gives a union's branches in an error's path (`str`, `list[...]`, ...)
_BRANCH = re.compile(r"(str|int|float|bool|none|[a-z-]+\[.*\])")


def _is_branch(x: object) -> bool:
    return isinstance(x, str) and _BRANCH.fullmatch(x) is not None


def _telling(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The first error, unless it is a union branch's that did not fit at all: content that is
    neither a string nor a valid list of parts fails both, and the string's "Input should be a
    valid string" comes first; the list's error, deeper, names what is wrong with the part."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if loc and _is_branch(loc[-1]):
        for e in errors[1:]:
            other = tuple(e.get("loc", ()))
            if other[: len(loc) - 1] == loc[:-1] and len(other) > len(loc):
                return e
    return first


def _field_path(error: Mapping[str, Any]) -> list[str]:
    """An error's path as the body names it: without pydantic's branch names, and with a tagged
    union's tag once (a part's payload is named after its type: image_url's `image_url`, so
    pydantic's path says it twice). A part of an unknown type is its `type`'s fault."""
    loc = [x for x in error.get("loc", ()) if x != "body" and not _is_branch(x)]
    path: list[str] = []
    for k, x in enumerate(loc):
        tag = k > 0 and isinstance(loc[k - 1], int) and k + 1 < len(loc) and loc[k + 1] == x
        if not tag:
            path.append(str(x))
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        path.append("type")
    return path


_BY_CODE = {
    grpc.StatusCode.OK: (502, "server_error"),  # (a failure with OK: the services misspoke)
    # the services ended the call (a shutdown, a request of the same caller that failed, a
    # transport reset): nothing was wrong with the request, and a retry may succeed
    grpc.StatusCode.CANCELLED: (503, "server_error"),
    grpc.StatusCode.UNKNOWN: (502, "server_error"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error"),  # a conflict: retry the sequence
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "server_error"),  # our token to the services
    grpc.StatusCode.PERMISSION_DENIED: (502, "server_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),  # e.g. infer without --embeddings
}


def from_slotwise(e: SlotwiseError) -> ApiError:
    """A gRPC error of prep or infer, as the OpenAI API would say it."""
    status, kind = _BY_CODE.get(e.code(), (502, "server_error"))
    code: str | None = e.reason.lower() or None
    param = next(iter(e.field_violations), None)
    message, retry_after = e.message, e.retry_delay
    if e.code() is grpc.StatusCode.CANCELLED:
        message = f"the services ended this call before it finished ({e.message}): retry"
        code, retry_after = code or "cancelled", retry_after or 1.0
    if e.reason == "PROMPT_TOO_LONG":
        code, param = "context_length_exceeded", "messages"
    elif e.reason in ("STORAGE_FULL", "STORAGE_FAILED", "SESSION_NOT_SAVED"):
        status, kind = 503, "server_error"
    return ApiError(status, message, type=kind, code=code, param=param,
                    retry_after=retry_after if status in (429, 503) else None,
                    metadata=dict(e.metadata))  # fmt: skip


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """The services' refusals within (SlotwiseError), raised as the API's errors."""
    try:
        yield
    except SlotwiseError as e:
        raise from_slotwise(e) from None


async def call(awaitable: Awaitable[T]) -> T:
    """A call of the services, a refusal raised as the API's error."""
    with translated():
        return await awaitable


def check_message_count(count: int, limit: int, param: str) -> None:
    """Refuse a chat of more than `limit` messages before any is read (the template renders each
    one, and prep refuses past its own --max-messages)."""
    if count > limit:
        raise bad_request(
            f"{count} messages in one request; at most {limit} are taken (--max-messages)",
            param,
            code="too_many_messages",
        )
