"""What llama.cpp's own server tests (tools/server/tests, run whole by
tests/llama_server_suite/run.py) ask of slotwise, each kept here on real servers on loopback:
CORS as llama-server answers it, /completions as its native alias, /v1/models' `models` list,
aliases and tags, --no-slots, `__verbose`, the role chunk's null content, the Anthropic
stream's prompt tokens at message_start, today's date in the chat template, and the shim that
runs `slotwise serve` with llama-server's flags.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks, stacks_fixture
from support.loop import LoopThread
from support.procs import free_port
from support.wait import wait_until

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "llama_server_suite" / "llama-server"
TEMPLATES = ROOT / "tests" / "templates"
CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best?"}]
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "Authorization",
}


@pytest.fixture(scope="module")
def stacks(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stacks]:
    yield from stacks_fixture(loop_thread, tiny, prep_servers)


@pytest.fixture(scope="module")
def anywhere(stacks: Stacks) -> Stack:
    """llama-server's defaults: every origin (slotwise's own default is none)."""
    return stacks.start("rope", parallel=2, gateway={"cors_origins": ("*",)})


@pytest.fixture(scope="module")
def local(stacks: Stacks) -> Stack:
    """`--cors-origins localhost`, aliases and tags, --no-slots, __verbose in every chat."""
    gateway = {
        "cors_origins": ("localhost",),
        "model_name": "code",
        "model_aliases": ("code", "fim", "tinyllama-2"),
        "model_tags": ("chat", "small"),
        "strict_model_name": True,
        "slots_endpoint": False,
        "verbose_replies": True,
    }
    return stacks.start("rope", parallel=2, gateway=gateway)


def options(s: Stack, origin: str, path: str = "/completions") -> httpx.Response:
    return httpx.options(f"{s.url}{path}", headers={"Origin": origin, **PREFLIGHT})


# -- CORS --------------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", ["localhost", "web.mydomain.fr", "https://app.example"])
def test_every_origin_is_reflected_with_credentials_as_llama_server_does(
    anywhere: Stack, origin: str
) -> None:
    r = options(anywhere, origin)
    assert r.status_code == 200 and r.content == b""
    assert r.headers["access-control-allow-origin"] == origin
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    # the header asked for by name: browsers never let `*` stand for Authorization
    assert r.headers["access-control-allow-headers"] == "Authorization"
    body = {"prompt": "Hi", "n_predict": 1}
    done = httpx.post(f"{anywhere.url}/completion", json=body, headers={"Origin": origin})
    assert done.status_code == 200 and done.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize(
    "origin",
    ["http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]:3000"],
)
def test_localhost_allows_every_page_on_this_machine(local: Stack, origin: str) -> None:
    r = options(local, origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize(
    "origin", ["http://evil.com", "http://notlocalhost", "http://localhost.evil.com", "http://["]
)
def test_localhost_refuses_other_pages_with_a_200_and_no_origin(local: Stack, origin: str) -> None:
    r = options(local, origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    plain = httpx.get(f"{local.url}/health", headers={"Origin": origin})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_without_cors_origins_no_preflight_is_answered(stacks: Stacks) -> None:
    s = stacks.start("rope", parallel=2)
    r = options(s, "http://localhost")
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


# -- routes and their shapes -----------------------------------------------------------------


def test_completions_without_v1_is_the_native_completion(anywhere: Stack) -> None:
    body = {"prompt": "I believe", "n_predict": 2, "temperature": 0}  # (greedy: no sampled end)
    native = httpx.post(f"{anywhere.url}/completions", json=body, timeout=60).json()
    assert isinstance(native["content"], str) and native["tokens_predicted"] == 2
    bad = httpx.post(f"{anywhere.url}/completions", json={"prompt": "x", "n_predict": "2"})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"code", "message", "type"}
    oai = {"model": "x", "prompt": "I believe", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{anywhere.url}/v1/completions", json=oai, timeout=60).json()
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 2


def test_models_lists_llama_servers_models_with_aliases_and_tags(local: Stack) -> None:
    for path in ("/models", "/v1/models"):
        body = httpx.get(f"{local.url}{path}").json()
        (card,) = body["data"]
        assert card["id"] == "code" and card["aliases"] == ["code", "fim", "tinyllama-2"]
        assert card["tags"] == ["chat", "small"]
        (model,) = body["models"]
        # the rope pair has its projector: it reads images
        assert model["capabilities"] == ["completion", "multimodal"]
        assert model["name"] == model["model"] == "code" and model["tags"] == ["chat", "small"]
    # --strict-model-name takes every alias, and only those
    ok = {"model": "fim", "messages": CHAT, "max_tokens": 1}
    assert httpx.post(f"{local.url}/v1/chat/completions", json=ok).status_code == 200
    other = httpx.post(f"{local.url}/v1/chat/completions", json={**ok, "model": "gpt"})
    assert other.status_code == 404


def test_no_slots_is_llama_servers_501(local: Stack, anywhere: Stack) -> None:
    r = httpx.get(f"{local.url}/slots")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert httpx.get(f"{anywhere.url}/slots").status_code == 200


# -- chat completions --------------------------------------------------------------------------


def events(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [x.removeprefix("data: ") for x in r.text.splitlines() if x.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def test_the_role_chunk_has_null_content_and_no_delta_is_empty(anywhere: Stack) -> None:
    body = {"messages": CHAT, "max_tokens": 6, "stream": True}
    r = httpx.post(f"{anywhere.url}/v1/chat/completions", json=body, timeout=60)
    chunks = [c for c in events(r) if c["choices"]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    for c in chunks[1:]:
        delta = c["choices"][0]["delta"]
        assert "role" not in delta and delta.get("content", None) != ""


def test_verbose_shows_the_prompt_as_the_template_wrote_it(anywhere: Stack, local: Stack) -> None:
    shown = httpx.post(f"{anywhere.url}/apply-template", json={"messages": CHAT}).json()["prompt"]
    for verbose in (True, False):
        body = {"messages": CHAT, "max_tokens": 2, "verbose": verbose}
        r = httpx.post(f"{anywhere.url}/v1/chat/completions", json=body, timeout=60).json()
        assert ("__verbose" in r) is verbose
        if verbose:
            assert r["__verbose"]["prompt"] == shown
            assert r["__verbose"]["content"] == r["choices"][0]["message"]["content"]
            assert r["__verbose"]["tokens_evaluated"] == r["usage"]["prompt_tokens"]
    # with --verbose-replies every reply has it; a continued reply's prompt ends with its start
    prefill = [*CHAT, {"role": "assistant", "content": "Whill"}]
    body = {"model": "code", "messages": prefill, "max_tokens": 2}
    r = httpx.post(f"{local.url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["__verbose"]["prompt"] == shown + "Whill"
    off = httpx.post(f"{local.url}/v1/chat/completions", json={**body, "verbose": False})
    assert "__verbose" not in off.json()


def test_anthropic_message_start_counts_the_prompt(anywhere: Stack) -> None:
    body = {"model": "x", "max_tokens": 3, "stream": True, "messages": CHAT[1:]}
    r = httpx.post(f"{anywhere.url}/v1/messages", json=body, timeout=60)
    start = next(e for e in events(r) if e["type"] == "message_start")
    end = next(e for e in events(r) if e["type"] == "message_delta")
    assert start["message"]["usage"]["input_tokens"] == end["usage"]["input_tokens"]
    total = end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
    count = httpx.post(f"{anywhere.url}/v1/messages/count_tokens", json=body).json()
    assert total == count["input_tokens"] > 0


def test_the_template_is_given_todays_date(stacks: Stacks) -> None:
    """llama.cpp gives every template date_string (Llama 3.x: "Today Date: 06 Dec 2026")."""
    template = str(TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja")
    s = stacks.start("rope", parallel=2, prep_port=stacks.prep_with("rope", template))
    chat = {"messages": [{"role": "user", "content": "What is today?"}]}
    before = datetime.date.today()
    prompt = httpx.post(f"{s.url}/apply-template", json=chat).json()["prompt"]
    days = {before, datetime.date.today()}  # (midnight may pass in between)
    assert any(f"Today Date: {d.strftime('%d %b %Y')}" in prompt for d in days), prompt


# -- the shim: llama-server's command line, run as slotwise serve ------------------------------


def test_the_shim_runs_slotwise_serve_with_llama_servers_flags(
    tiny: dict[str, TinyPair], tmp_path: Path
) -> None:
    port = free_port()
    model = str(tiny["rope"].model)
    env = {
        **os.environ,
        "SLOTWISE_SUITE_PYTHON": sys.executable,
        "SLOTWISE_SUITE_MODELS": json.dumps({"text": model, "mmproj": {}}),
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, str(SHIM), "--port", str(port), "--temp", "0.8", "--seed", "42",
            "--host", "127.0.0.1", "--model", model, "--ctx-size", "512", "--parallel", "2",
            "--alias", "tinyllama-2,fim,code", "--tags", "chat,fim", "--no-slots", "--no-jinja",
            "--api-key", "sesame", "-t", "1"]  # fmt: skip
    log = (tmp_path / "shim.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "shim.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, what="the shim's server")
        key = {"Authorization": "Bearer sesame"}
        card = httpx.get(f"{url}/v1/models", headers=key).json()["data"][0]
        assert card["id"] == "code" and set(card["aliases"]) == {"tinyllama-2", "fim", "code"}
        assert set(card["tags"]) == {"chat", "fim"}
        assert httpx.get(f"{url}/slots", headers=key).status_code == 501
        props = httpx.get(f"{url}/props", headers=key).json()
        assert props["model_path"] == model and props["total_slots"] == 2
        assert props["default_generation_settings"]["n_ctx"] == 256
        assert props["default_generation_settings"]["params"]["seed"] == 42
        # --seed 42: a completion that names no seed samples the same tokens each time
        body = {"prompt": "Once upon", "n_predict": 8, "cache_prompt": False, "return_tokens": True}
        runs = [httpx.post(f"{url}/completion", json=body, headers=key, timeout=60)
                for _ in range(2)]  # fmt: skip
        assert runs[0].json()["tokens"] == runs[1].json()["tokens"]
        assert httpx.post(f"{url}/completion", json={"prompt": "x"}).status_code == 401
        # llama-server's default CORS: every origin
        r = httpx.options(f"{url}/completion", headers={"Origin": "http://a.example", **PREFLIGHT})
        assert r.headers["access-control-allow-origin"] == "http://a.example"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    # a flag slotwise cannot honour is refused, with its reason
    refused = subprocess.run(
        [sys.executable, str(SHIM), "--port", str(port), "--hf-repo", "ggml-org/models"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "no model hub here" in refused.stderr
