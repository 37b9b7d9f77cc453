"""Hostile callers at the HTTP edge (issue 43), over real HTTP against real prep, infer and
gateway servers on the tiny `rope` pair: bad input is a 400 naming its field in each API's own
error shape, never a 500 (NaN, Infinity, wrong JSON types, deep nesting, ids past int32, text
keys in an object logit_bias); a gRPC status the gateway does not expect has its documented
HTTP status; a request's work is bounded before it starts (messages per chat, completions per
/completion, tokens per /tokenize, one tokenize call for many texts). Then a hypothesis test
throws arbitrary and mutated JSON at every route the app has and asserts no 5xx, the route's
error shape, and that /health still answers.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clients.client import SlotwiseError
from clients.gateway import GatewayConfig
from clients.gateway.errors import from_slotwise
from clients.gateway.llama_server.api import MAX_PIECE_TOKENS
from clients.gateway.llama_server.router import is_native
from clients.gateway.serve import start_gateway
from slotwise.v1 import infer_pb2_grpc
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.procs import free_port

SMALL = {"max_messages": 16, "max_completions": 4}  # the gateway the bounds are tested on


@dataclass
class Services:
    prep_port: int
    infer_port: int
    prep_metrics: str  # prep's Prometheus page: its calls by method
    gateway: Callable[..., str]  # GatewayConfig fields -> the URL of a gateway with them
    app: Any  # the default gateway's FastAPI app (its routes)
    url: str  # ... and its URL


@pytest.fixture(scope="module")
def services(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Services]:
    """prep (with its metrics), infer (2 slots, replies of at most 4 tokens unless asked: the
    fuzzed bodies generate little) and gateways over them."""
    from infer_service.__main__ import start as start_infer
    from infer_service.api.request import GenerateLimits
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    pair = tiny["rope"]
    metrics_port = free_port()
    prep = loop_thread.run(
        start_prep(pair.model, pair.mmproj, threads=2, metrics_port=metrics_port)
    )
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=1024, parallel=2, threads=1)
    infer = loop_thread.run(start_infer(config, limits=GenerateLimits(default_max_tokens=4)))
    running = []

    def gateway(**fields: Any) -> str:
        addresses = (f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}")
        running.append(
            loop_thread.run(start_gateway(GatewayConfig(*addresses, **fields), "127.0.0.1", 0))
        )
        return f"http://127.0.0.1:{running[-1].port}"

    url = gateway()
    app = running[0].server.config.app
    yield Services(prep.port, infer.port, f"http://127.0.0.1:{metrics_port}", gateway, app, url)
    for g in running:
        loop_thread.run(g.stop())
    loop_thread.run(infer.stop(0))
    loop_thread.run(prep.stop(0))


@pytest.fixture(scope="module")
def small(services: Services) -> str:
    return services.gateway(**SMALL)


def post(url: str, raw: str | bytes, timeout: float = 60) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=raw, headers=headers, timeout=timeout)


# -- error shapes ------------------------------------------------------------------------------


def api_of(path: str) -> str:
    """The API whose error shape a path answers in (as create_app chooses it)."""
    if is_native(path):
        return "native"
    return "anthropic" if path.removeprefix("/v1").startswith("/messages") else "openai"


def error_of(api: str, r: httpx.Response) -> dict[str, Any]:
    """The error's fields, after checking the body has that API's error shape."""
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return dict(body["error"])
    error = body["error"]
    if api == "native":  # llama-server's: {"error": {"code", "message", "type"}} (+ its numbers)
        assert error["code"] == r.status_code and isinstance(error["type"], str), body
    else:
        assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    return dict(error)


# -- no 500 for bad input ----------------------------------------------------------------------

NATIVE_BAD = [  # (path, raw body, the field its message names) -- each a 500 before
    ("/completion", '{"prompt":"hi","n_predict":NaN}', "n_predict"),
    ("/completion", '{"prompt":"hi","n_probs":Infinity}', "n_probs"),
    ("/completion", '{"prompt":"hi","top_k":NaN}', "top_k"),
    ("/completion", '{"prompt":"hi","id_slot":NaN}', "id_slot"),
    ("/completion", '{"prompt":"hi","top_k":1e300}', "top_k"),
    ("/completion", '{"prompt":"hi","temperature":1' + "0" * 400 + "}", "temperature"),
    ("/completion", '{"prompt":"hi","speculative":"abc"}', "speculative"),
    ("/completion", '{"prompt":"hi","speculative":[1]}', "speculative"),
    ("/completion", '{"prompt":"hi","speculative":5}', "speculative"),
    ("/completion", '{"prompt":"hi","logit_bias":[[4294967296,1]]}', "logit_bias"),
    ("/completion", '{"prompt":"hi","logit_bias":{"4294967296":1}}', "logit_bias"),
    ("/completion", '{"prompt":"hi","logit_bias":[[1,1' + "0" * 400 + "]]}", "logit_bias"),
    ("/completion", '{"prompt":[2147483648]}', "prompt"),
    ("/completion", '{"prompt":"hi","logit_bias":{"' + "9" * 5000 + '":1}}', "logit_bias"),
    ("/completion", "[" * 50_000 + "]" * 50_000, "nests"),
    ("/detokenize", '{"tokens":[2147483648]}', "tokens"),
    ("/tokenize", '{"content":[1099511627776],"with_pieces":true}', "content"),
    ("/embedding", '{"content":"hi","embd_normalize":2147483647}', None),
]


@pytest.mark.parametrize(("path", "raw", "field"), NATIVE_BAD)
def test_bad_native_input_is_a_400_naming_its_field(
    services: Services, path: str, raw: str, field: str | None
) -> None:
    r = post(services.url + path, raw)
    if path == "/embedding":  # (this infer has no --embeddings: the normalisation is not reached)
        assert r.status_code == 501, r.text
        return
    assert r.status_code == 400, r.text
    assert field in error_of("native", r)["message"]


def test_a_text_key_in_an_object_logit_bias_is_tokenized_as_llama_server_does(
    services: Services,
) -> None:
    """{"hello": 1.5} biases the tokens of "hello" (llama-server's object form takes ids or
    texts, tokenized without BOS and with special tokens as text); "72" is token 72."""
    body = {"prompt": "hi", "n_predict": 1, "logit_bias": {"hello": 1.5, "72": -2}}
    r = post(services.url + "/completion", json.dumps(body))
    assert r.status_code == 200, r.text
    plain = {"content": "hello", "parse_special": False}
    ids = post(services.url + "/tokenize", json.dumps(plain)).json()["tokens"]
    assert r.json()["generation_settings"]["logit_bias"] == [
        *({"bias": 1.5, "token": t} for t in ids),
        {"bias": -2.0, "token": 72},
    ]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"model":"x","max_tokens":NaN,"messages":[]}', "max_tokens"),
        ("/v1/completions", '{"model":"x","prompt":"hi","temperature":Infinity}', "temperature"),
        ("/v1/responses", '{"model":"x","input":"hi","top_p":-Infinity}', "top_p"),
        ("/v1/messages", '{"model":"x","max_tokens":1e400,"messages":[]}', "max_tokens"),
        ("/v1/chat/completions", '{"model":"x","messages":' + "[" * 1000 + "]" * 1000 + "}", None),
        ("/v1/messages", '{"model":"x","messages":' + "[" * 1000 + "]" * 1000 + "}", None),
    ],
)
def test_numbers_json_has_not_and_deep_nesting_are_400_in_each_api_s_shape(
    services: Services, path: str, body: str, param: str | None
) -> None:
    r = post(services.url + path, body)
    assert r.status_code == 400, r.text
    error = error_of(api_of(path), r)
    if param is not None:
        assert error["message"].startswith(f"{param}:")
        assert error.get("param", param) == param
    else:
        assert "nests" in error["message"]


def test_an_id_of_thousands_of_digits_is_no_500(services: Services) -> None:
    """Python reads at most 4,300 digits into an int (else ValueError): a response id's turn
    number, and an object logit_bias key, are bounded before they are read."""
    r = httpx.get(f"{services.url}/v1/responses/resp_{'0' * 32}_{'9' * 5000}", timeout=30)
    assert r.status_code == 404, r.text[:200]
    error_of("openai", r)


def test_an_openai_logit_bias_id_past_int32_names_logit_bias(services: Services) -> None:
    client = openai.OpenAI(base_url=f"{services.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="x", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
            logit_bias={"99999999999": 1},
        )  # fmt: skip
    assert e.value.body["param"] == "logit_bias"  # type: ignore[index]


# -- gRPC statuses the gateway does not expect -------------------------------------------------

STATUSES = {  # what the caller hears for each code the services may end a call with
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.UNKNOWN: 502,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}


def test_every_grpc_status_has_a_documented_http_status() -> None:
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        e = from_slotwise(SlotwiseError(code, "why"))
        assert e.status in (400, 404, 409, 429, 500, 501, 502, 503, 504), code
        assert e.status != 500 or code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS)
    cancelled = from_slotwise(SlotwiseError(grpc.StatusCode.CANCELLED, "why"))
    assert (cancelled.status, cancelled.code, cancelled.retry_after) == (503, "cancelled", 1.0)
    assert "retry" in cancelled.message


class _Ending(infer_pb2_grpc.InferServiceServicer):
    """An infer that ends every generation with the status it is told."""

    code = grpc.StatusCode.CANCELLED

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(self.code, "ended by the test")
        yield  # (a stream)


@pytest.fixture(scope="module")
def ending(loop_thread: LoopThread, services: Services) -> Iterator[tuple[_Ending, str]]:
    servicer = _Ending()

    async def serve() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        infer_pb2_grpc.add_InferServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(serve())
    addresses = (f"127.0.0.1:{services.prep_port}", f"127.0.0.1:{port}")
    gw = loop_thread.run(start_gateway(GatewayConfig(*addresses), "127.0.0.1", 0))
    yield servicer, f"http://127.0.0.1:{gw.port}"
    loop_thread.run(gw.stop())
    loop_thread.run(server.stop(0))


@pytest.mark.parametrize("code", list(STATUSES))
def test_a_call_the_services_end_has_its_status_in_each_api(
    ending: tuple[_Ending, str], code: grpc.StatusCode
) -> None:
    servicer, url = ending
    servicer.code = code
    chat = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/messages", chat),
        ("/completion", {"prompt": "hi", "n_predict": 2}),
    ):
        r = post(url + path, json.dumps(body))
        assert r.status_code == STATUSES[code], (path, r.text)
        error_of(api_of(path), r)
        if code is grpc.StatusCode.CANCELLED:
            assert r.headers["retry-after"] == "1"


# -- bounds before the work starts -------------------------------------------------------------


def chat_of(n: int) -> list[dict[str, str]]:
    return [{"role": ("user", "assistant")[i % 2], "content": f"w{i}"} for i in range(n - 1)] + [
        {"role": "user", "content": "last"}
    ]


def test_a_chat_past_max_messages_is_refused_in_each_api(small: str) -> None:
    n = SMALL["max_messages"] + 1
    chat = chat_of(n)
    cases = [
        ("/v1/chat/completions", {"model": "x", "max_tokens": 1, "messages": chat}, "messages"),
        ("/v1/messages", {"model": "x", "max_tokens": 1, "messages": chat}, "messages"),
        ("/v1/messages/count_tokens", {"model": "x", "messages": chat}, "messages"),
        ("/v1/responses", {"model": "x", "input": chat}, "input"),
        ("/apply-template", {"messages": chat}, "messages"),
        ("/v1/chat/completions/input_tokens", {"messages": chat}, "messages"),
    ]
    for path, body, param in cases:
        r = post(small + path, json.dumps(body))
        assert r.status_code == 400, (path, r.text)
        error = error_of(api_of(path), r)
        assert error["message"].startswith(f"{n} messages in one request"), (path, error)
        assert error.get("param", param) == param
    # at the limit: taken
    r = post(small + "/apply-template", json.dumps({"messages": chat[1:]}))
    assert r.status_code == 200, r.text
    # as the SDKs hear it
    an = anthropic.Anthropic(base_url=small, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=f"{n} messages in one request"):
        an.messages.create(model="x", max_tokens=1, messages=chat)  # type: ignore[arg-type]
    oa = openai.OpenAI(base_url=f"{small}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="x", max_tokens=1, messages=chat)  # type: ignore[arg-type]
    assert e.value.body["param"] == "messages"  # type: ignore[index]


def test_the_bounds_flags_and_their_defaults() -> None:
    from clients.cli import gateway_config
    from prep_service.__main__ import start_arguments
    from slotwise_cli import parser as slotwise_parser
    from slotwise_core.limits import DEFAULT_MAX_MESSAGES
    from slotwise_serve.serve_command import config_from
    from slotwise_serve.serve_command import parser as serve_parser

    argv = ["gateway", "--prep", "a:1", "--infer", "b:2"]
    config = gateway_config(slotwise_parser().parse_args(argv), "", "", None)
    assert (config.max_messages, config.max_completions) == (DEFAULT_MAX_MESSAGES, 32)
    assert config == GatewayConfig("", "", media=config.media)
    given = [*argv, "--max-messages", "5", "--max-completions", "7"]
    config = gateway_config(slotwise_parser().parse_args(given), "", "", None)
    assert (config.max_messages, config.max_completions) == (5, 7)
    # serve: prep's --max-messages is the gateway's too
    served = serve_parser().parse_args(["--model", "m", "--max-messages", "9"])
    config = gateway_config(
        served, "", "", None,
        max_images=served.prep_max_images, max_messages=served.prep_max_messages,
    )  # fmt: skip
    assert config.max_messages == 9
    assert start_arguments(config_from(served).prep)[2]["limits"].max_messages == 9


def test_a_completion_past_max_completions_is_refused_before_any_starts(
    services: Services, small: str
) -> None:
    before = prep_calls(services, "Prepare")
    r = post(small + "/completion", json.dumps({"prompt": ["a", "b", "c"], "n_cmpl": 2}))
    assert r.status_code == 400, r.text
    assert "3 prompts x n_cmpl 2 = 6 completions" in error_of("native", r)["message"]
    assert prep_calls(services, "Prepare") == before  # (not a prompt prepared)
    taken = post(small + "/completion", json.dumps({"prompt": ["a", "b"], "n_cmpl": 2}))
    assert taken.status_code == 200 and len(taken.json()) == 4, taken.text


def test_a_large_fan_out_never_fails_another_caller_s_completion(services: Services) -> None:
    """1,000 prompts x 8 is refused at once (it used to start all 8,000 and fail others'
    completions meanwhile); the largest fan-out taken runs beside other callers' requests,
    which all succeed."""
    big = {"prompt": [f"p{i}" for i in range(1000)], "n_cmpl": 8, "n_predict": 2}
    before = prep_calls(services, "Prepare")
    r = post(services.url + "/completion", json.dumps(big))
    assert r.status_code == 400, r.text
    assert prep_calls(services, "Prepare") == before  # (refused before a prompt is prepared)
    largest = {"prompt": [f"p{i}" for i in range(16)], "n_cmpl": 2, "n_predict": 2}
    results: list[int] = []

    def fan_out() -> None:
        results.append(post(services.url + "/completion", json.dumps(largest)).status_code)

    thread = threading.Thread(target=fan_out)
    thread.start()
    others = [
        post(services.url + "/completion", json.dumps({"prompt": f"q{k}", "n_predict": 2}))
        for k in range(6)
    ]
    thread.join(120)
    assert [o.status_code for o in others] == [200] * 6, [o.text for o in others]
    assert results == [200]


def prep_calls(services: Services, method: str) -> float:
    """How many calls of `method` prep has answered (its Prometheus counter)."""
    page = httpx.get(services.prep_metrics, timeout=10).text
    found = re.findall(
        rf'slotwise_prep_requests_total{{[^}}]*method="{method}"[^}}]*}} (\S+)', page
    )
    return sum(float(x) for x in found)


def test_tokenize_with_pieces_is_bounded_in_tokens(services: Services) -> None:
    text = "x" * (MAX_PIECE_TOKENS + 1)  # (the tiny vocabulary: a byte a token)
    r = post(services.url + "/tokenize", json.dumps({"content": text, "with_pieces": True}))
    assert r.status_code == 400, r.text[:200]
    assert f"more than {MAX_PIECE_TOKENS} tokens" in error_of("native", r)["message"]
    plain = post(services.url + "/tokenize", json.dumps({"content": text}))
    assert plain.status_code == 200 and len(plain.json()["tokens"]) == MAX_PIECE_TOKENS + 1


def test_a_large_tokenize_with_pieces_is_written_off_the_event_loop(
    services: Services, loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer's JSON (an object per piece) is built on a worker thread: /health and every
    other request go on meanwhile (it stalled them 14-27 s on the event loop)."""
    from clients.gateway.llama_server import api as llama_server_api

    writers: list[threading.Thread] = []

    class Recording:
        def dumps(self, *args: Any, **kwargs: Any) -> str:
            writers.append(threading.current_thread())
            return json.dumps(*args, **kwargs)

    monkeypatch.setattr(llama_server_api, "json", Recording())
    text = "y" * MAX_PIECE_TOKENS
    r = post(services.url + "/tokenize", json.dumps({"content": text, "with_pieces": True}))
    assert r.status_code == 200 and len(r.json()["tokens"]) == MAX_PIECE_TOKENS
    assert writers and loop_thread.thread not in writers
    assert httpx.get(services.url + "/health", timeout=10).status_code == 200


def test_many_strings_are_tokenized_in_one_call(services: Services) -> None:
    """A prompt of 20,000 strings and ids mixed, and 20,000 logit_bias texts: one TokenizeBatch
    each (one Tokenize per string before: 19-28 s for 240 KB), the ids as tokenize says."""
    strings = [f"s{k % 10}" for k in range(20_000)]
    mixed = [x for s in strings[:10] for x in (s, 72)]
    calls = prep_calls(services, "TokenizeBatch"), prep_calls(services, "Tokenize")
    r = post(services.url + "/tokenize", json.dumps({"content": mixed}))
    alone = [
        post(services.url + "/tokenize", json.dumps({"content": s})).json() for s in mixed[::2]
    ]
    assert r.json()["tokens"] == [t for a in alone for t in (*a["tokens"], 72)]
    big = post(services.url + "/tokenize", json.dumps({"content": strings}))
    bias = [[s + str(k), 0.5] for k, s in enumerate(strings)]
    body = {"prompt": "hi", "n_predict": 1, "logit_bias": bias}
    biased = post(services.url + "/completion", json.dumps(body))
    assert big.status_code == 200 and biased.status_code == 200, (big.text[:200], biased.text)
    assert prep_calls(services, "TokenizeBatch") == calls[0] + 3
    assert prep_calls(services, "Tokenize") == calls[1] + 10  # (the ten texts alone, above)


# -- any JSON at every route -------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
BASE = {  # a body each route takes (its path without /v1)
    "/chat/completions": {"model": "x", "max_tokens": 2, "messages": HI},
    "/completions": {"model": "x", "max_tokens": 2, "prompt": "hi"},
    "/embeddings": {"model": "x", "input": "hi"},
    "/responses": {"model": "x", "max_output_tokens": 2, "input": "hi"},
    "/messages": {"model": "x", "max_tokens": 2, "messages": HI},
    "/messages/count_tokens": {"model": "x", "messages": HI},
    "/completion": {"prompt": "hi", "n_predict": 2},
    "/infill": {"input_prefix": "a", "input_suffix": "b", "n_predict": 2},
    "/tokenize": {"content": "hi", "with_pieces": True},
    "/detokenize": {"tokens": [72, 105]},
    "/apply-template": {"messages": HI},
    "/embedding": {"content": "hi"},
    "/chat/completions/input_tokens": {"messages": HI},
    "/responses/input_tokens": {"input": "hi"},
    "/slotwise/sessions": {"title": "t"},
    "/slotwise/sessions/{session_id}": {"title": "t"},
    "/slots/{id_slot}": {"filename": "f.bin"},
}  # fmt: skip
FIELDS = sorted(
    {k for body in BASE.values() for k in body}
    | {"n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
       "n_keep", "ignore_eos", "stream", "logit_bias", "n_probs", "grammar", "json_schema",
       "samplers", "id_slot", "n_cmpl", "n", "response_fields", "speculative",
       "speculative.n_max", "slotwise", "lora", "min_keep", "typical_p", "mirostat", "tokens",
       "add_special", "parse_special", "input_extra", "multimodal_data", "embd_normalize",
       "tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "system",
       "instructions", "previous_response_id", "cache_prompt", "return_tokens",
       "stream_options"}
)  # fmt: skip
HOSTILE = [
    "NaN", "Infinity", "-Infinity", "1e400", "2147483648", "-2147483649", "9223372036854775808",
    "1" + "0" * 30, "1e300", "0.5", "-1", "0", "true", "false", "null", '"abc"', '""', "[]",
    "[1]", '[["hello", 1]]', "[[2147483648, false]]", "{}", '{"hello": 1}', '{"a": NaN}',
    "[2147483648]", "[1e400]", '"\\u0000"', '[{"role": "user"}]', '{"type": 5}',
    "[" * 300 + "]" * 300, "[" * 30 + "]" * 30, '{"' + "9" * 5000 + '": 1}', "9" * 5000,
]  # fmt: skip
PATH_VALUES = ["0", "1", "-1", "99", "abc", "resp_x", "%00", "9" * 30, "a\u00e9",
               f"resp_{'0' * 32}_{'9' * 5000}", f"resp_{'0' * 32}_1"]  # fmt: skip
GARBAGE = [b"", b"{", b"nul", b"[1,", b"NaN", b"[" * 3000, b'{"a":1}{', b"\xff\xfe", b'"text"',
           b"1" * 5000, b'{"a": "\xc3"}']  # fmt: skip
# what llama-server answers for a feature it lacks, whatever the body: those routes may say 501
NOT_SUPPORTED = ("/rerank", "/reranking", "/props", "/embedding", "/infill", "/slots/")
ENDLESS = "/slotwise/kv"  # an event stream until the caller leaves: its status is read only


def routes(app: Any) -> list[tuple[str, str]]:
    return sorted(
        (method, r.path)
        for r in app.routes
        if isinstance(r, APIRoute)
        for method in r.methods
        if method != "HEAD"
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, path: str) -> str:
    """The route's base body with one to three fields (or a message's) made hostile."""
    base = dict(BASE.get(path.removeprefix("/v1"), {}))
    raws: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS))
        raws.append(draw(st.sampled_from(HOSTILE)))
        marker = f"@hostile{len(raws) - 1}@"
        if field == "messages" and "messages" in base and draw(st.booleans()):
            key = draw(st.sampled_from(["role", "content", "tool_calls", "name"]))
            base["messages"] = [{**base["messages"][0], key: marker}]
        else:
            base[field] = marker
    text = json.dumps(base)
    for k, raw in enumerate(raws):
        text = text.replace(f'"@hostile{k}@"', raw)
    return text


@st.composite
def requests(draw: st.DrawFn, all_routes: list[tuple[str, str]]) -> tuple[str, str, bytes]:
    with_body = [r for r in all_routes if r[0] in ("POST", "PATCH")]
    method, template = draw(st.sampled_from(all_routes) | st.sampled_from(with_body))
    names = re.findall(r"{(\w+)}", template)
    path = template
    for name in names:
        value = draw(st.sampled_from(PATH_VALUES))
        path = path.replace("{" + name + "}", urllib.parse.quote(value, safe="%"))
    if template.startswith("/slots/"):
        path += "?action=" + draw(st.sampled_from(["save", "restore", "erase", "x"]))
    text = mutated(template) | st.builds(json.dumps, json_values)
    body = draw(text.map(str.encode) | st.sampled_from(GARBAGE))
    return method, path, body


def test_any_json_at_any_route_is_never_a_5xx(services: Services) -> None:
    all_routes = routes(services.app)
    assert ("POST", "/completion") in all_routes and ("POST", "/v1/messages") in all_routes
    seen: set[tuple[str, str]] = set()

    with httpx.Client(base_url=services.url, timeout=60) as http:

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(requests(all_routes))
        def check(request: tuple[str, str, bytes]) -> None:
            method, path, body = request
            seen.add((method, path.split("?")[0]))
            headers = {"content-type": "application/json"}
            with http.stream(method, path, content=body, headers=headers) as r:
                if path == ENDLESS and r.status_code == 200:
                    return
                r.read()
            route = path.split("?")[0]
            allowed = r.status_code == 501 and route.removeprefix("/v1").startswith(NOT_SUPPORTED)
            assert r.status_code < 500 or allowed, (method, path, body[:300], r.text[:300])
            if r.status_code >= 400:
                error_of(api_of(route), r)
            assert http.get("/health", timeout=10).status_code == 200

        check()
    assert len(seen) > len(all_routes) // 2  # (most routes were reached)
