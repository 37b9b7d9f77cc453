"""Cross-origin calls from browser apps (--cors-origins), as llama-server answers them.

An allowed origin gets itself back in Access-Control-Allow-Origin (with credentials allowed:
``*`` allows every origin that way, as llama-server's default does), ``localhost`` allows any
page on this machine (localhost, 127.0.0.1 or [::1], any port: llama-server's keyword), any
other entry is one origin. A preflight (``OPTIONS`` with Access-Control-Request-Method) is
answered here, on any path, before keys are asked for (browsers send none with it): 200 and
an empty body, the allowed methods and the headers the page asked for; an origin not allowed
gets the same 200 without Access-Control-Allow-Origin, so the browser refuses the call.
Without --cors-origins none of this runs: no cross-origin call is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["LOOPBACK_HOSTS", "METHODS", "Cors"]

METHODS = "GET, POST, DELETE, OPTIONS"  # llama-server's; PATCH is added when asked for
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_EXPOSED = b"x-slotwise-warning, retry-after"


class Cors:
    def __init__(self, app: ASGIApp, origins: Sequence[str]) -> None:
        self.app, self.origins = app, frozenset(origins)

    def allows(self, origin: str) -> bool:
        if "*" in self.origins or origin in self.origins:
            return True
        if "localhost" not in self.origins:
            return False
        try:
            return urlsplit(origin).hostname in LOOPBACK_HOSTS
        except ValueError:
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await send(
                {"type": "http.response.start", "status": 200,
                 "headers": self.preflight(origin, headers)}
            )  # fmt: skip
            await send({"type": "http.response.body", "body": b""})
            return
        if origin is None or not self.allows(origin):
            await self.app(scope, receive, send)
            return
        added = [
            (b"Access-Control-Allow-Origin", origin.encode("latin-1")),
            (b"Access-Control-Allow-Credentials", b"true"),
            (b"Access-Control-Expose-Headers", _EXPOSED),
            (b"Vary", b"Origin"),
        ]

        async def with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *added]}
            await send(message)

        await self.app(scope, receive, with_origin)

    def preflight(self, origin: str | None, headers: Headers) -> list[tuple[bytes, bytes]]:
        """The preflight's headers, written as llama-server writes them (some clients read
        them by their exact names)."""
        methods = METHODS
        if headers["access-control-request-method"].upper() == "PATCH":
            methods = "GET, POST, PATCH, DELETE, OPTIONS"
        # the headers asked for, by name: a browser never lets `*` stand for Authorization
        asked = headers.get("access-control-request-headers", "*")
        out = [
            (b"Access-Control-Allow-Credentials", b"true"),
            (b"Access-Control-Allow-Methods", methods.encode()),
            (b"Access-Control-Allow-Headers", asked.encode("latin-1")),
            (b"Access-Control-Max-Age", b"600"),
            (b"Vary", b"Origin"),
            (b"Content-Type", b"text/html"),
            (b"Content-Length", b"0"),
        ]
        if origin is not None and self.allows(origin):
            out.insert(0, (b"Access-Control-Allow-Origin", origin.encode("latin-1")))
        return out
