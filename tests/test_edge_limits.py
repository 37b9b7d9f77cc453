"""The HTTP gateway's limits at the edge, over real HTTP against a real gateway: a request's
images are counted before any is fetched or decoded (--max-images), and a body is refused
past --max-body-mb as it comes in, with or without a Content-Length; each API answers in its
own error shape."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from test_image_urls import ImageHost

from clients.gateway.media import MediaPolicy
from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks
from support.loop import LoopThread
from support.media import image_bytes

TOO_MANY = 200
SMALL_BODY = 64 << 10  # the body limit of the gateway the 413 tests talk to
OPENAI_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def image_host() -> Iterator[ImageHost]:
    host = ImageHost("127.0.0.1")
    yield host
    host.close()


@pytest.fixture(scope="module")
def stack(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stack]:
    """A gateway with its defaults but for image URLs: fetched, the loopback host included."""
    stacks = Stacks(loop_thread, tiny, prep_servers)
    policy = MediaPolicy(allow_http=True, allow=("127.0.0.1/32",))
    yield stacks.start("mrope", gateway={"media": policy})
    stacks.close()


@pytest.fixture(scope="module")
def gateway(loop_thread: LoopThread, stack: Stack) -> Iterator[Callable[..., str]]:
    """GatewayConfig fields -> the URL of another gateway with them, over the same services."""
    from clients.gateway import GatewayConfig
    from clients.gateway.serve import start_gateway

    addresses = (f"127.0.0.1:{stack.prep_port}", f"127.0.0.1:{stack.infer.port}")
    running = []

    def start(**config: Any) -> str:
        running.append(
            loop_thread.run(start_gateway(GatewayConfig(*addresses, **config), "127.0.0.1", 0))
        )
        return f"http://127.0.0.1:{running[-1].port}"

    yield start
    for g in running:
        loop_thread.run(g.stop())


@pytest.fixture(scope="module")
def small(gateway: Callable[..., str]) -> str:
    """A gateway with a body limit of SMALL_BODY."""
    return gateway(max_body_bytes=SMALL_BODY)


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# -- images per request -------------------------------------------------------------------------


def test_200_image_urls_are_refused_before_any_is_fetched_in_every_api(
    stack: Stack, image_host: ImageHost
) -> None:
    urls = [f"{image_host.url}/cat.png"] * TOO_MANY
    image_host.seen.clear()
    chat_parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    chat = [{"role": "user", "content": [{"type": "text", "text": "Which?"}, *chat_parts]}]

    client = stack.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="x", messages=chat, max_tokens=2)  # type: ignore[arg-type]
    said = refused.value.body
    assert isinstance(said, dict) and set(said) == OPENAI_KEYS, said
    assert (said["type"], said["param"], said["code"]) == (
        "invalid_request_error", "messages", "too_many_images",
    )  # fmt: skip
    assert f"{TOO_MANY} images" in said["message"] and "64" in said["message"]

    items = [{"role": "user", "content": [{"type": "input_image", "image_url": u} for u in urls]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="x", input=items, max_output_tokens=2)  # type: ignore[arg-type]
    assert refused.value.param == "input" and refused.value.code == "too_many_images"

    # the web page's own request: a streamed chat with its slotwise options
    page = {"model": "x", "stream": True, "messages": chat, "slotwise": {"policy": "auto"}}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=page, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images", r.text

    blocks = [{"type": "image", "source": {"type": "url", "url": u}} for u in urls]
    a = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    asked: list[Any] = [{"role": "user", "content": [*blocks, {"type": "text", "text": "?"}]}]
    for call in (
        lambda: a.messages.create(model="x", max_tokens=2, messages=asked),
        lambda: a.messages.count_tokens(model="x", messages=asked),
    ):
        with pytest.raises(anthropic.BadRequestError) as denied:
            call()
        assert denied.value.status_code == 400
        assert denied.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": said["message"]},
        }

    assert image_host.seen == []  # not one of them was fetched

    # the same host is fetched when the images are few: the refusals above were the cap's
    few = [{"role": "user", "content": [{"type": "text", "text": "Which?"}, *chat_parts[:2]]}]
    reply = client.chat.completions.create(model="x", messages=few, max_tokens=2)  # type: ignore[arg-type]
    assert reply.choices and image_host.seen == ["/cat.png"] * 2


def test_the_cap_is_the_gateway_s_own_and_counts_every_message(
    gateway: Callable[..., str],
) -> None:
    url = gateway(media=MediaPolicy(max_images=2))
    png = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(32, 32))}}
    one = {"role": "user", "content": [{"type": "text", "text": "Look."}, png]}
    answer = {"role": "assistant", "content": "Yes."}

    def chat(*messages: dict[str, Any]) -> httpx.Response:
        body = {"model": "x", "max_tokens": 2, "messages": list(messages)}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)

    assert chat(one, answer, one).status_code == 200
    refused = chat(one, answer, one, answer, one)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("3 images in one request")


def test_the_flags_and_their_defaults() -> None:
    from clients.cli import gateway_config
    from clients.gateway import GatewayConfig
    from prep_service.flags import OPTIONS as PREP
    from slotwise_cli import parser as slotwise_parser
    from slotwise_serve.serve_command import parser as serve_parser

    prep_default = next(o for o in PREP if o.flag == "--max-images").kwargs["default"]
    argv = ["gateway", "--prep", "a:1", "--infer", "b:2"]
    config = gateway_config(slotwise_parser().parse_args(argv), "", "", None)
    assert config.media.max_images == MediaPolicy().max_images == prep_default
    assert config.max_body_bytes == GatewayConfig("a", "b").max_body_bytes == 64 << 20

    given = [*argv, "--max-images", "3", "--max-body-mb", "5"]
    config = gateway_config(slotwise_parser().parse_args(given), "", "", None)
    assert (config.media.max_images, config.max_body_bytes) == (3, 5 << 20)

    # serve: prep's --max-images is the gateway's too
    served = serve_parser().parse_args(["--model", "m", "--max-images", "7", "--max-body-mb", "9"])
    config = gateway_config(served, "", "", None, max_images=served.prep_max_images)
    assert (config.media.max_images, config.max_body_bytes) == (7, 9 << 20)


# -- the body's size ----------------------------------------------------------------------------


def big_body(size: int) -> bytes:
    """A chat (OpenAI's and Anthropic's alike) of about size bytes."""
    body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "x" * size}]}
    return json.dumps(body).encode()


def chunked(data: bytes, piece: int = 8 << 10) -> Iterator[bytes]:
    """The body without a Content-Length: httpx sends an iterator chunked."""
    for k in range(0, len(data), piece):
        yield data[k : k + piece]


def post(url: str, body: bytes | Iterator[bytes]) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=body, headers=headers, timeout=60)


def test_a_body_over_the_limit_is_413_with_a_content_length_and_chunked(small: str) -> None:
    data = big_body(2 * SMALL_BODY)
    for body in (data, chunked(data)):
        r = post(f"{small}/v1/chat/completions", body)
        sent = r.request.headers
        assert ("content-length" in sent) == isinstance(body, bytes)  # chunked: none declared
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert set(error) == OPENAI_KEYS
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        assert str(SMALL_BODY) in error["message"]

    # far past the limit, chunked: refused as it comes in (never read whole)
    r = post(f"{small}/v1/chat/completions", chunked(b"[" * (64 * SMALL_BODY), 64 << 10))
    assert r.status_code == 413

    # the real openai client (it sends a Content-Length)
    client = openai.OpenAI(base_url=f"{small}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "x" * 2 * SMALL_BODY}]
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="x", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert refused.value.status_code == 413
    assert refused.value.code == "request_too_large"

    # a body under the limit is served
    ok = post(f"{small}/v1/chat/completions", chunked(big_body(SMALL_BODY // 4)))
    assert ok.status_code == 200, ok.text


def test_anthropic_s_paths_hear_413_in_anthropic_s_shape(small: str) -> None:
    data = big_body(2 * SMALL_BODY)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for body in (data, chunked(data)):
            r = post(f"{small}{path}", body)
            assert r.status_code == 413, r.text
            said = r.json()
            assert said["type"] == "error" and said["error"]["type"] == "request_too_large"
            assert set(said["error"]) == {"type", "message"}

    a = anthropic.Anthropic(base_url=small, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:
        a.messages.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": "x" * 2 * SMALL_BODY}]
        )
    assert refused.value.status_code == 413
