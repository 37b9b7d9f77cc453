"""Images the APIs carry: `data:` URIs always; http(s) URLs only when enabled, and then only
from public addresses, never a local path.

A fetch must not turn the gateway into a proxy into its own network (the instance metadata
service, a database's HTTP port, an admin page on loopback). So the host is resolved here and
every address it resolves to must be public (not loopback, private, link-local, multicast,
reserved or unspecified, IPv4-mapped IPv6 included), unless --image-url-allow names the host
or its network; the connection goes to the address that was checked (no second lookup for a
rebinding name to change); each redirect hop (at most 3, http/https only) is checked the same
way. The caller hears one answer for every failure, refused or not, so that the edge maps
nothing of what lies behind it: "image_url could not be fetched"; the reason goes to the log.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx
from prometheus_client import Counter

from clients.gateway.errors import bad_request
from slotwise_core.limits import DEFAULT_MAX_IMAGES

log = logging.getLogger("slotwise.gateway.media")

MAX_REDIRECTS = 3
# Counted per process; each gateway's registry shows it (app.py registers it).
FETCHES = Counter(
    "slotwise_http_image_fetches", "image_url fetches by outcome", ["outcome"], registry=None
)
_MAGIC = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",  # JPEG
    b"GIF87a",
    b"GIF89a",
    b"BM",
)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class MediaPolicy:
    allow_http: bool = False
    max_bytes: int = 20 << 20  # per image (--max-image-mb)
    max_audio_bytes: int = 32 << 20  # per sound (--max-audio-mb; sounds.py)
    timeout: float = 10.0
    # images and sounds per request (prep's --max-images counts both), counted before any is
    # fetched or decoded
    max_images: int = DEFAULT_MAX_IMAGES
    # hosts (exact names) and networks (CIDRs) that may be fetched although not public
    allow: tuple[str, ...] = ()

    def allowed_networks(self) -> list[Network]:
        out: list[Network] = []
        for pattern in self.allow:
            try:
                out.append(ipaddress.ip_network(pattern, strict=False))
            except ValueError:
                continue  # a host name
        return out

    def allowed_hosts(self) -> set[str]:
        return {p.lower().rstrip(".") for p in self.allow if not _is_network(p)}


def check_allow_patterns(patterns: list[str]) -> tuple[str, ...]:
    """--image-url-allow values: host names or CIDRs (ValueError names a bad one)."""
    for p in patterns:
        name = bool(p) and "/" not in p and not any(c in p for c in " :@?#[]")
        if not (name or _is_network(p)):
            raise ValueError(f"--image-url-allow {p!r}: give a host name or a CIDR")
    return tuple(patterns)


def _is_network(pattern: str) -> bool:
    try:
        ipaddress.ip_network(pattern, strict=False)
        return True
    except ValueError:
        return False


def check_image_count(count: int, policy: MediaPolicy, param: str, what: str = "images") -> None:
    """Refuse a request with more images (and sounds: `what` says) than allowed, before any is
    fetched or decoded."""
    if count > policy.max_images:
        raise bad_request(
            f"{count} {what} in one request; at most {policy.max_images} are taken (--max-images)",
            param,
            code="too_many_images",
        )


def check_images(
    contents: Iterable[object],
    policy: MediaPolicy,
    param: str,
    *,
    image: str,
    sound: str | None = None,
) -> None:
    """check_image_count for a chat: its images and sounds are the parts (of the contents that
    are lists of parts) of the API's types for them, `image` and `sound`."""
    kinds = [part_type(part) for c in contents if isinstance(c, list) for part in c]
    images, sounds = kinds.count(image), kinds.count(sound) if sound is not None else 0
    check_image_count(images + sounds, policy, param, "images and sounds" if sounds else "images")


def part_type(part: object) -> object:
    """A content part's type: a model's `type` field, or a JSON object's "type"."""
    return part.get("type") if isinstance(part, dict) else getattr(part, "type", None)


class _Refused(Exception):
    """Why a fetch was not made or not used (for the log only)."""


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
        try:
            data = await fetch(url, policy)
        except _Refused as e:
            FETCHES.labels("refused").inc()
            log.warning("image_url %s not fetched: %s", _safe(url), e)
            raise bad_request("image_url could not be fetched", param) from None
        FETCHES.labels("fetched").inc()
        return data
    raise bad_request("image_url: give a data: URI (or an http(s) URL where enabled)", param)


async def fetch(url: str, policy: MediaPolicy) -> bytes:
    """GET url from a checked address, following at most MAX_REDIRECTS checked hops;
    raises _Refused with the reason."""
    try:
        async with (
            asyncio.timeout(policy.timeout),
            httpx.AsyncClient(
                timeout=policy.timeout, follow_redirects=False, trust_env=False
            ) as http,
        ):
            for _ in range(MAX_REDIRECTS + 1):
                target = await _checked(url, policy)
                async with http.stream(
                    "GET",
                    target.url,
                    headers={"Host": target.host_header},
                    extensions={"sni_hostname": target.host},
                ) as r:
                    if r.is_redirect:
                        location = r.headers.get("location", "")
                        url = urljoin(url, location)
                        if not url.startswith(("http://", "https://")):
                            raise _Refused(f"a redirect to {location[:100]!r}")
                        continue
                    if r.status_code != 200:
                        raise _Refused(f"HTTP {r.status_code}")
                    return await _body(r, policy)
            raise _Refused(f"more than {MAX_REDIRECTS} redirects")
    except TimeoutError:
        raise _Refused(f"no answer within {policy.timeout} s") from None
    except httpx.HTTPError as e:
        raise _Refused(f"{type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class _Target:
    url: str  # with the checked address in place of the host
    host: str  # the name, for TLS (SNI and the certificate)
    host_header: str


async def _checked(url: str, policy: MediaPolicy) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Refused("not an http(s) URL with a host")
    if parts.username or parts.password:
        raise _Refused("credentials in the URL")
    host = parts.hostname.lower().rstrip(".")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
    except ValueError as e:  # a port out of range; a name IDNA cannot encode
        raise _Refused(f"not a usable URL: {e}") from None
    except socket.gaierror as e:
        raise _Refused(f"{host} does not resolve: {e}") from None
    addresses = [_unmapped(ipaddress.ip_address(info[4][0])) for info in infos]
    if not addresses:
        raise _Refused(f"{host} resolves to nothing")
    named = host in policy.allowed_hosts()
    networks = policy.allowed_networks()
    for a in addresses:
        if not (named or _public(a) or any(a in n for n in networks)):
            raise _Refused(f"{host} resolves to {a}, which is not public (--image-url-allow)")
    a = addresses[0]
    literal = f"[{a}]" if a.version == 6 else str(a)
    netloc = f"{literal}:{port}"
    default_port = parts.port is None or parts.port == (443 if parts.scheme == "https" else 80)
    host_header = parts.hostname if default_port else f"{parts.hostname}:{port}"
    rest = parts.path or "/"
    if parts.query:
        rest += f"?{parts.query}"
    return _Target(f"{parts.scheme}://{netloc}{rest}", host, host_header)


_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def _unmapped(a: Address) -> Address:
    """An IPv6 address that carries an IPv4 one is that IPv4 address: IPv4-mapped
    (::ffff:127.0.0.1 is loopback), 6to4, Teredo's client, NAT64 (64:ff9b::a9fe:a9fe reaches
    169.254.169.254 through a NAT64 gateway)."""
    if not isinstance(a, ipaddress.IPv6Address):
        return a
    if a.ipv4_mapped is not None:
        return a.ipv4_mapped
    if a.sixtofour is not None:
        return a.sixtofour
    if a.teredo is not None:
        return a.teredo[1]
    if any(a in n for n in _NAT64):
        return ipaddress.IPv4Address(int(a) & 0xFFFFFFFF)
    return a


def _public(a: Address) -> bool:
    return a.is_global and not (
        a.is_multicast or a.is_loopback or a.is_link_local or a.is_reserved or a.is_unspecified
    )


async def _body(r: httpx.Response, policy: MediaPolicy) -> bytes:
    """The body, at most max_bytes, and refused early unless it begins as an image does."""
    data = bytearray()
    checked = False
    async for piece in r.aiter_bytes():
        data += piece
        if len(data) > policy.max_bytes:
            raise _Refused(f"over {policy.max_bytes} bytes")
        if not checked and len(data) >= 12:
            if not _looks_like_an_image(bytes(data[:12])):
                raise _Refused(f"not an image file (begins {bytes(data[:8])!r})")
            checked = True
    if not checked and not _looks_like_an_image(bytes(data)):
        raise _Refused("not an image file")
    return bytes(data)


def _looks_like_an_image(head: bytes) -> bool:
    webp = head[:4] == b"RIFF" and head[8:12] == b"WEBP"
    return webp or any(head.startswith(m) for m in _MAGIC)


def _safe(url: str) -> str:
    """The URL for the log: no query string (it may carry a signature)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"[:200]


def _too_big(policy: MediaPolicy, param: str) -> Exception:
    return bad_request(f"image_url: the image is over {policy.max_bytes} bytes", param)
