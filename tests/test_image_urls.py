"""image_url fetching without turning the gateway into a proxy into its own network.

A loopback HTTP server in the test serves an image, a redirect to itself, a 404 and a page;
with --allow-image-urls every fetch of it is refused with one and the same 400 (the reason in
the log only), and it records that it was never contacted. --image-url-allow names what may
be fetched although not public.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from clients.gateway.media import MediaPolicy, check_allow_patterns
from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stacks
from support.loop import LoopThread
from support.media import image_bytes

PNG = image_bytes(64, 48, "PNG")
COULD_NOT = "image_url could not be fetched"


class ImageHost:
    """An HTTP server on a loopback address that records every request it gets."""

    def __init__(self, address: str, redirect_to: str = ""):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.path)
                if self.path == "/cat.png":
                    self._send(200, PNG, "image/png")
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", redirect_to or "/cat.png")
                    self.end_headers()
                elif self.path == "/page":
                    self._send(200, b"<html>" + b"x" * 100_000, "text/html")
                else:
                    self._send(404, b"no", "text/plain")

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((address, 0), Handler)
        self.url = f"http://{address}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def image_host() -> Iterator[ImageHost]:
    host = ImageHost("127.0.0.1")
    yield host
    host.close()


@pytest.fixture
def gateway(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Callable[..., str]]:
    """allow patterns -> the URL of a gateway with --allow-image-urls (and those allowed)."""
    stacks = Stacks(loop_thread, tiny, prep_servers)

    def start(*allow: str) -> str:
        policy = MediaPolicy(allow_http=True, allow=check_allow_patterns(list(allow)))
        return stacks.start("mrope", gateway={"media": policy}).url

    yield start
    stacks.close()


def chat(url: str, image_url: str) -> httpx.Response:
    body = {
        "model": "x",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": image_url}},
        ]}],
    }  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_addresses_that_are_not_public_are_never_contacted(
    gateway: Callable[..., str], image_host: ImageHost, caplog: pytest.LogCaptureFixture
) -> None:
    url = gateway()
    port = image_host.url.rsplit(":", 1)[1]
    targets = [
        f"{image_host.url}/cat.png",  # loopback
        f"{image_host.url}/redirect",
        f"{image_host.url}/missing",
        f"http://localhost:{port}/cat.png",  # a name that resolves to loopback
        f"http://[::1]:{port}/cat.png",  # IPv6 loopback
        f"http://[::ffff:127.0.0.1]:{port}/cat.png",  # IPv4-mapped IPv6
        f"http://0.0.0.0:{port}/cat.png",
        "http://169.254.169.254/latest/meta-data/",  # a cloud's metadata service
        "http://10.1.2.3/cat.png",
        "http://user:secret@example.invalid/cat.png",
    ]
    with caplog.at_level(logging.WARNING, logger="slotwise.gateway.media"):
        for target in targets:
            r = chat(url, target)
            assert r.status_code == 400, (target, r.text)
            error = r.json()["error"]
            # one answer whatever happened: nothing is learnt of what lies behind the gateway
            assert (error["message"], error["param"]) == (
                COULD_NOT, "messages.0.content.1.image_url",
            ), target  # fmt: skip
    assert image_host.seen == []  # never contacted
    reasons = " | ".join(r.getMessage() for r in caplog.records)
    assert "not public" in reasons and "127.0.0.1" in reasons and "::1" in reasons
    assert "169.254.169.254" in reasons and "credentials" in reasons
    metrics = httpx.get(f"{url}/metrics").text
    assert 'slotwise_http_image_fetches_total{outcome="refused"}' in metrics


def test_an_allowed_network_is_fetched_and_checked_as_it_comes(
    gateway: Callable[..., str], image_host: ImageHost, caplog: pytest.LogCaptureFixture
) -> None:
    url = gateway("127.0.0.1/32")
    ok = chat(url, f"{image_host.url}/cat.png")
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] > 8  # the image is in the prompt
    assert chat(url, f"{image_host.url}/redirect").status_code == 200  # a hop on the same host
    with caplog.at_level(logging.WARNING, logger="slotwise.gateway.media"):
        for path, why in (("/missing", "HTTP 404"), ("/page", "not an image file")):
            r = chat(url, image_host.url + path)
            assert (r.status_code, r.json()["error"]["message"]) == (400, COULD_NOT)
            assert why in caplog.text
    assert image_host.seen == ["/cat.png", "/redirect", "/cat.png", "/missing", "/page"]


def test_every_redirect_hop_is_checked(gateway: Callable[..., str], image_host: ImageHost) -> None:
    outside = ImageHost("127.0.0.2", redirect_to=f"{image_host.url}/cat.png")
    try:
        url = gateway("127.0.0.2/32")  # the first hop is allowed, where it leads is not
        r = chat(url, f"{outside.url}/redirect")
        assert (r.status_code, r.json()["error"]["message"]) == (400, COULD_NOT)
        assert outside.seen == ["/redirect"] and image_host.seen == []
    finally:
        outside.close()


def test_allow_patterns_are_names_or_networks() -> None:
    assert check_allow_patterns(["images.internal", "10.0.0.0/8", "fd00::/8"])
    for bad in ("http://x", "a b", "10.0.0.0/33", "host:80", ""):
        with pytest.raises(ValueError):
            check_allow_patterns([bad])
