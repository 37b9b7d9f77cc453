"""image_url parts -> image bytes: `data:` URIs always, http(s) only when enabled (with a size
limit and a timeout), never a local path."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import httpx

from clients.gateway.errors import bad_request


@dataclass(frozen=True)
class MediaPolicy:
    allow_http: bool = False
    max_bytes: int = 20 << 20
    timeout: float = 10.0


async def image_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise bad_request(
                "image_url: a data URI must be base64 (data:image/png;base64,...)", param
            )
        if len(payload) > policy.max_bytes * 4 // 3 + 4:
            raise _too_big(policy, param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("image_url: the data URI is not valid base64", param) from None
    if url.startswith(("http://", "https://")):
        if not policy.allow_http:
            raise bad_request(
                "image_url: only data: URIs are accepted (start the gateway with "
                "--allow-image-urls to fetch http(s) images)",
                param,
            )
        return await _fetch(url, policy, param)
    raise bad_request("image_url: give a data: URI (or an http(s) URL where enabled)", param)


async def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    try:
        async with (
            httpx.AsyncClient(timeout=policy.timeout, follow_redirects=True) as http,
            http.stream("GET", url) as r,
        ):
            if r.status_code != 200:
                raise bad_request(f"image_url: fetching it gave HTTP {r.status_code}", param)
            data = bytearray()
            async for piece in r.aiter_bytes():
                data += piece
                if len(data) > policy.max_bytes:
                    raise bad_request(
                        f"image_url: the image is over {policy.max_bytes} bytes", param
                    )
            return bytes(data)
    except httpx.HTTPError as e:
        raise bad_request(f"image_url: could not fetch it ({type(e).__name__})", param) from None


def _too_big(policy: MediaPolicy, param: str) -> Exception:
    return bad_request(f"image_url: the image is over {policy.max_bytes} bytes", param)
