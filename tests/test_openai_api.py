"""The OpenAI-compatible HTTP API, driven by the official `openai` package (and raw httpx where
the wire itself is the point) against real prep, infer and gateway servers on loopback."""

from __future__ import annotations

import base64
import json
import statistics
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from long_chat import long_chat

from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks
from support.loop import LoopThread
from support.media import image_bytes
from support.wait import assert_nothing_runs_on, wait_until


@pytest.fixture
def stack(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Callable[..., Stack]]:
    """start(pair, api_key=None, **Stacks.start options) -> Stack."""
    stacks = Stacks(loop_thread, tiny, prep_servers)

    def start_one(pair: str = "mrope", *, api_key: str | None = None, **kwargs: Any) -> Stack:
        gateway = {**kwargs.pop("gateway", {}), "api_key": api_key}
        return stacks.start(pair, gateway=gateway, **kwargs)

    yield start_one
    stacks.close()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(text: str, seed: int = 0) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_uri(image_bytes(64, 48, seed=seed))}},
        ],
    }


SYSTEM = {"role": "system", "content": "You are terse."}


# -- the API's shapes ---------------------------------------------------------------------------


def test_chat_with_an_image_streamed_and_not(stack: Callable[..., Stack]) -> None:
    s = stack("mrope")
    client = s.client()
    messages = [SYSTEM, image_message("What is in the picture?")]
    r = client.chat.completions.create(
        model="slotwise", messages=messages, max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion" and r.model == "slotwise"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None and u.completion_tokens >= 1
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra["slotwise"]
    assert extra["prompt_positions"] < u.prompt_tokens  # an M-RoPE image: more cells than pos
    assert set(extra) >= {"shifts", "evicted_cells", "evicted_images", "truncated_cells"}

    stream = client.chat.completions.create(
        model="slotwise",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same reply
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    # the same prompt again: it came from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1

    # the wire: server-sent events ending with [DONE]
    with httpx.stream(
        "POST",
        f"{s.url}/v1/chat/completions",
        json={"model": "slotwise", "messages": [SYSTEM, {"role": "user", "content": "hi"}],
              "max_tokens": 3, "stream": True},
        timeout=30,
    ) as raw:  # fmt: skip
        assert raw.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in raw.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_raw_completions_and_models(stack: Callable[..., Stack]) -> None:
    client = stack("rope").client()
    r = client.completions.create(model="slotwise", prompt="Once upon a time", max_tokens=5)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 5
    streamed = list(
        client.completions.create(
            model="slotwise", prompt="Once upon a time", max_tokens=5, stream=True, temperature=0
        )
    )
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list()] == ["slotwise"]
    assert client.models.retrieve("slotwise").owned_by == "slotwise"


# -- errors, as the SDK's own exceptions -----------------------------------------------------


def test_every_error_class_with_its_status_and_code(stack: Callable[..., Stack]) -> None:
    s = stack("rope", max_queue=1)  # greedy on the rope pair never ends by itself
    client = s.client()
    hi = [{"role": "user", "content": "hi"}]
    for name, extra in [
        ("n", {"n": 9}),
        ("functions", {"functions": [{"name": "f"}]}),
        ("top_logprobs", {"top_logprobs": 2}),
        ("modalities", {"modalities": ["text", "audio"]}),
        ("tool_choice", {"tool_choice": "required"}),  # (no tools)
        ("response_format", {"response_format": {"type": "json_schema"}}),
        ("response_format", {"response_format": {"type": "json_object"},
                             "extra_body": {"grammar": 'root ::= "x"'}}),
        ("logit_bias", {"logit_bias": {"1000000": 5}}),
        ("logit_bias", {"logit_bias": {"7": 500}}),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="slotwise", messages=hi, max_tokens=2, **extra)
        assert e.value.status_code == 400 and e.value.param == name, (name, e.value)

    # any model name is this server's one model (apps hardcode names); a strict server 404s
    r = client.chat.completions.create(model="gpt-4o-mini", messages=hi, max_tokens=2)
    assert r.model == "slotwise"
    strict = stack("rope", gateway={"strict_model_name": True}).client()
    with pytest.raises(openai.NotFoundError) as nf:
        strict.chat.completions.create(model="gpt-4o", messages=hi)
    assert nf.value.code == "model_not_found"

    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model="slotwise", messages=long, extra_body={"slotwise": {"truncate": False}}
        )
    assert too_long.value.code == "context_length_exceeded"
    # with the default (truncate the oldest units) the same chat is served
    ok = client.chat.completions.create(model="slotwise", messages=long, max_tokens=2)
    assert ok.usage is not None and ok.usage.model_extra["slotwise"]["truncated_cells"] > 0

    for bad in (
        {"model": "slotwise", "messages": []},
        {"model": "slotwise", "messages": [{"role": "tool", "content": "x"}]},
        {"model": "slotwise", "messages": hi, "temperature": "hot"},
        {"model": "slotwise", "messages": hi, "slotwise": {"policy": "sideways"}},
        {"model": "slotwise", "messages": hi, "max_tokens": 1 << 33},
        {"model": "slotwise", "messages": hi, "top_k": 1 << 40},
        {"model": "slotwise", "messages": hi, "slotwise": {"keep": -1}},
        {"model": "slotwise", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
        {"model": "slotwise", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
        {"model": "slotwise", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(b"not an image")}}]}]},
        {"model": "slotwise", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
    ):  # fmt: skip
        r = httpx.post(f"{s.url}/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{s.url}/v1/chat/completions", content=b"{not json", timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert r.status_code == 400


def test_a_full_queue_is_429_with_retry_after(stack: Callable[..., Stack]) -> None:
    s = stack("rope", max_queue=1)
    client = s.client()
    hi = [{"role": "user", "content": "hi"}]
    hold = threading.Event()
    s.infer.engine.call(lambda: hold.wait(30))  # the engine thread is busy: nothing starts
    try:
        queued = threading.Thread(
            target=lambda: client.chat.completions.create(
                model="slotwise", messages=hi, max_tokens=2
            )
        )
        queued.start()
        wait_until(lambda: s.infer.engine.num_waiting, what="a request queued")
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model="slotwise", messages=hi, max_tokens=2)
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert limited.value.code == "queue_full"
    finally:
        hold.set()
    queued.join(30)
    assert not queued.is_alive()


def test_a_client_that_disconnects_cancels_its_generation(stack: Callable[..., Stack]) -> None:
    s = stack("rope")
    body = {"model": "slotwise", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100_000, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        head = [next(lines) for _ in range(6)]
    assert not any('finish_reason": "' in line for line in head)  # still generating
    assert_nothing_runs_on(s.infer.port)  # the disconnect reached the engine: it stopped


def test_api_key_and_unavailable_services(
    stack: Callable[..., Stack], loop_thread: LoopThread
) -> None:
    s = stack("rope", api_key="sesame")
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="wrong").chat.completions.create(model="slotwise", messages=hi)
    assert (
        s.client(api_key="sesame")
        .chat.completions.create(model="slotwise", messages=hi, max_tokens=2)
        .choices
    )
    assert httpx.get(f"{s.url}/health").status_code == 200
    assert httpx.get(f"{s.url}/ready").json()["ready"] is True
    assert "slotwise_http_requests" in httpx.get(f"{s.url}/metrics").text

    from clients.gateway import GatewayConfig
    from clients.gateway.serve import start_gateway

    nowhere = loop_thread.run(
        start_gateway(GatewayConfig("127.0.0.1:9", "127.0.0.1:9"), "127.0.0.1", 0)
    )
    try:
        down = openai.OpenAI(
            base_url=f"http://127.0.0.1:{nowhere.port}/v1", api_key="x", max_retries=0
        )
        with pytest.raises(openai.InternalServerError) as e:
            down.chat.completions.create(model="slotwise", messages=hi)
        assert e.value.status_code == 503
        assert httpx.get(f"http://127.0.0.1:{nowhere.port}/ready").status_code == 503
    finally:
        loop_thread.run(nowhere.stop())


# -- stateless conversations that survive shifts ----------------------------------------------


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_a_30_turn_chat_resent_every_turn_decodes_only_what_is_new(
    stack: Callable[..., Stack], pair: str
) -> None:
    """llama-server stops this chat at turn 6 (context shift is off with an mmproj loaded)."""
    s = stack(pair, ctx_size=1024)
    rows = long_chat(s.client())
    print(pair, json.dumps(rows))  # the figures, with -s
    assert len(rows) == 30
    assert sum(r["shifts"] for r in rows) >= 2  # the context filled, more than once
    assert all(r["cached"] > 0 for r in rows[1:])
    assert statistics.median(r["decoded"] for r in rows[1:]) < 150, rows
    assert all(r["truncated"] == 0 for r in rows)  # continued, never cut


def test_four_conversations_on_two_slots_each_decode_only_their_new_part(
    stack: Callable[..., Stack],
) -> None:
    s = stack("mrope", ctx_size=2048, parallel=2)
    client = s.client()
    chats: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"Conversation {k}."}] for k in range(4)
    ]
    decoded: list[list[int]] = [[] for _ in range(4)]
    for t in range(6):
        for k, messages in enumerate(chats):
            text = f"conversation {k}, turn {t}: go on"
            messages.append(image_message(text, seed=10 * k + t) if t % 2 == 0 else
                            {"role": "user", "content": text})  # fmt: skip
            r = client.chat.completions.create(
                model="slotwise", messages=messages, max_tokens=12, temperature=0.7, seed=t
            )
            assert r.usage is not None
            decoded[k].append(r.usage.model_extra["slotwise"]["decoded_prompt_cells"])
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    whole = [sum(len(json.dumps(m)) for m in chat) for chat in chats]
    assert all(w > 600 for w in whole)  # the conversations grew well beyond a turn
    for k in range(4):  # after the first turn, each turn decodes only its new message
        assert max(decoded[k][1:]) < 130, decoded[k]
    assert s.infer.engine.host_sequences.hits > 0  # resumed from host memory, not re-prefilled


def test_the_gateway_imports_no_llama_cpp() -> None:
    """The HTTP edge speaks gRPC only: it runs where llama.cpp is not installed."""
    import subprocess
    import sys

    code = (
        "import sys; import clients.gateway.app, clients.gateway.serve; "
        "print([m for m in ('llama_cpp', 'miniaudio', 'prep_service', 'infer_service') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
