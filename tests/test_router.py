"""Several models behind one endpoint (`slotwise serve --models-dir`): real router processes,
a real `slotwise serve` process per loaded model, tiny pairs of several families in one folder.

llama-server's own router tests (unit/test_router.py, vendored, unmodified) run in
tests/llama_server_suite; these show what they do not: a busy model is never the one unloaded,
a model's failure is its own, a conversation outlives its model, memory is checked first.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotwise_core.tiny_models import TinyPair
from support.media import image_bytes
from support.router import Router, chat, models_folder, router_exit, running_router
from support.wait import PATIENCE, wait_until

pytestmark = pytest.mark.timeout(300)


def _image_part(seed: int = 0) -> dict[str, Any]:
    data = base64.b64encode(image_bytes(224, 160, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


class _SmallWindow(http.client.HTTPConnection):
    """A caller that takes its answer slowly: a 4 KiB receive window (set before it connects),
    so an answer it does not read stays with the router, in flight."""

    def connect(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(PATIENCE * 5)
        self.sock.connect((self.host, self.port))


def _generate(
    url: str,
    model: str,
    n: int,
    out: dict[str, Any],
    hold: threading.Event | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """llama-server's /completion of exactly n tokens (end of generation ignored), streamed:
    the chunks into `out`. With `hold`: after 5 chunks, nothing more is read until it is set
    (the answer, over 4 MiB with its probabilities, is then still on its way)."""
    body = {"model": model, "prompt": "Once upon a time", "n_predict": n, "ignore_eos": True,
            "temperature": 0, "stream": True, "n_probs": 20 if hold else 0}  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    conn = _SmallWindow(host, int(port))
    try:
        conn.request("POST", "/completion", json.dumps(body),
                     {"content-type": "application/json", **(headers or {})})  # fmt: skip
        answer = conn.getresponse()
        out["status"] = answer.status
        chunks = out.setdefault("chunks", [])
        while line := answer.readline():
            if line.startswith(b"data: "):
                chunks.append(json.loads(line[6:]))
                if hold is not None and len(chunks) == 5:
                    hold.wait(PATIENCE)
    except Exception as e:  # (the test reads it: a cut stream must show)
        out["error"] = repr(e)
    finally:
        conn.close()


@contextlib.contextmanager
def _held_stream(
    url: str, model: str, n: int = 2000, headers: dict[str, str] | None = None
) -> Iterator[tuple[dict[str, Any], threading.Event]]:
    """A stream of n tokens whose caller has read 5 chunks and reads no more until `hold` is
    set: its model is busy until then. Yields (what it read, hold); joined on the way out."""
    out: dict[str, Any] = {}
    hold = threading.Event()
    t = threading.Thread(target=_generate, args=(url, model, n, out, hold, headers))
    t.start()
    try:
        wait_until(lambda: len(out.get("chunks", [])) >= 5, what=f"{model} streams")
        yield out, hold
    finally:
        hold.set()
        t.join(PATIENCE * 5)


def _in_flight(router: Router, name: str) -> int:
    return int(router.models()[name].get("slotwise", {}).get("in_flight", 0))


@pytest.fixture
def three(tiny: dict[str, TinyPair], tmp_path: Path) -> Path:
    """Three families: LLaVA-style (rope), Qwen2-VL's M-RoPE (mrope), Gemma 3 (noncausal)."""
    return models_folder(tmp_path / "models", {n: tiny[n] for n in ("rope", "mrope", "noncausal")})


def test_each_model_answers_as_its_family_with_two_loaded(three: Path) -> None:
    with running_router("--models-dir", str(three), "--models-max", "2") as router:
        cells: dict[str, list[int]] = {}
        for name in ("rope", "mrope", "noncausal", "rope"):
            r = chat(router.url, name, [{"type": "text", "text": "What is it?"}, _image_part()])
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            cells.setdefault(name, []).append(r.json()["usage"]["prompt_tokens"])
        # the same picture is a different number of cells in each family's projector, and the
        # same number again in the same family's
        assert len({c[0] for c in cells.values()}) == 3, cells
        assert cells["rope"][0] == cells["rope"][1]
        states = {n: m["status"]["value"] for n, m in router.models().items()}
        assert states == {"rope": "loaded", "noncausal": "loaded", "mrope": "unloaded"}
        listed = httpx.get(f"{router.url}/v1/models", timeout=PATIENCE).json()["data"]
        assert {m["id"] for m in listed} == {"rope", "mrope", "noncausal"}


def test_a_model_streaming_is_never_the_one_unloaded(three: Path) -> None:
    with running_router("--models-dir", str(three), "--models-max", "2",
                        "--ctx-size", "4096") as router:  # fmt: skip
        with _held_stream(router.url, "rope") as (long, _hold):
            for name in ("mrope", "noncausal"):  # at the limit: mrope, idle, goes; rope never
                r = chat(router.url, name, "hello")
                assert r.status_code == 200, r.text
                assert router.status("rope") == "loaded" and _in_flight(router, "rope") == 1
        assert "error" not in long, long.get("error")
        tokens = [c for c in long["chunks"] if c.get("content") or c.get("stop")]
        assert long["chunks"][-1]["stop"] is True
        assert long["chunks"][-1]["tokens_predicted"] == 2000, long["chunks"][-1]
        assert len(tokens) >= 2000
        states = {n: m["status"]["value"] for n, m in router.models().items()}
        assert states == {"rope": "loaded", "noncausal": "loaded", "mrope": "unloaded"}


def test_when_every_loaded_model_is_busy_the_next_waits(three: Path) -> None:
    with running_router("--models-dir", str(three), "--models-max", "1",
                        "--ctx-size", "4096") as router:  # fmt: skip
        queued: dict[str, Any] = {}
        q = threading.Thread(target=lambda: queued.update(r=chat(router.url, "mrope", "hi")))
        with _held_stream(router.url, "rope") as (long, _hold):
            q.start()
            wait_until(lambda: httpx.get(f"{router.url}/metrics", timeout=PATIENCE).text.count(
                "slotwise_router_waiting 1.0"), what="mrope waits")  # fmt: skip
            assert router.status("mrope") == "unloaded" and router.status("rope") == "loaded"
        q.join(PATIENCE)
        assert long["status"] == 200 and long["chunks"][-1]["tokens_predicted"] == 2000
        assert queued["r"].status_code == 200, queued["r"].text
        assert router.status("rope") == "unloaded" and router.status("mrope") == "loaded"


def test_a_damaged_model_and_an_aborted_one_fail_alone(
    tiny: dict[str, TinyPair], tmp_path: Path
) -> None:
    folder = models_folder(tmp_path / "models", {n: tiny[n] for n in ("rope", "mrope")})
    (folder / "damaged.gguf").write_bytes(b"GGUF" + os.urandom(4096))
    with running_router("--models-dir", str(folder), "--ctx-size", "4096") as router:
        other: dict[str, Any] = {}
        t = threading.Thread(target=_generate, args=(router.url, "rope", 400, other))
        t.start()
        wait_until(lambda: len(other.get("chunks", [])) >= 5, what="rope streams")
        r = chat(router.url, "damaged", "hello")
        assert r.status_code == 503, r.text
        assert "failed to load" in r.json()["error"]["message"]
        status = router.models()["damaged"]["status"]
        assert status["failed"] is True and status["exit_code"] not in (None, 0)
        assert status["reason"] and status["value"] == "unloaded"
        # mrope aborts (SIGABRT, as GGML_ABORT does) with a request in flight
        victim: dict[str, Any] = {}
        v = threading.Thread(target=_generate, args=(router.url, "mrope", 3000, victim))
        v.start()
        wait_until(lambda: len(victim.get("chunks", [])) >= 2, what="mrope streams")
        os.kill(router.models()["mrope"]["slotwise"]["pid"], signal.SIGABRT)
        v.join(PATIENCE)
        said = json.dumps(victim)
        assert "its process ended" in said and f"exit code {-signal.SIGABRT}" in said, said
        status = router.models()["mrope"]["status"]
        assert status["failed"] is True and status["exit_code"] == -signal.SIGABRT
        t.join(PATIENCE * 5)
        assert "error" not in other and other["chunks"][-1]["tokens_predicted"] == 400
        # and the aborted model loads again for the next request
        assert chat(router.url, "mrope", "again").status_code == 200


def test_a_session_goes_on_after_its_model_was_unloaded(
    tiny: dict[str, TinyPair], tmp_path: Path
) -> None:
    folder = models_folder(tmp_path / "models", {"rope": tiny["rope"]})

    def turn(router: Router, session: str, n: int) -> dict[str, Any]:
        r = chat(router.url, "rope", f"Turn {n}: tell me more.", max_tokens=8,
                 slotwise={"session_id": session})  # fmt: skip
        assert r.status_code == 200, r.text
        return dict(r.json())

    with running_router(
        "--models-dir", str(folder), "--sessions-dir", str(tmp_path / "s")
    ) as router:
        turn(router, "stays", 0)
        turn(router, "leaves", 0)
        stayed = turn(router, "stays", 1)
        r = httpx.post(f"{router.url}/models/unload", json={"model": "rope"}, timeout=PATIENCE)
        assert r.status_code == 200, r.text
        router.wait_status("rope", "unloaded")
        back = turn(router, "leaves", 1)
        assert router.status("rope") == "loaded"
    assert back["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert back["choices"][0]["message"] == stayed["choices"][0]["message"]


def test_one_model_sleeps_when_idle_and_wakes_for_a_request(tiny: dict[str, TinyPair]) -> None:
    pair = tiny["rope"]
    args = ("--model", str(pair.model), "--sleep-idle-seconds", "1", "--model-name", "tiny")
    with running_router(*args) as router:

        def props() -> dict[str, Any]:
            return dict(httpx.get(f"{router.url}/props", timeout=PATIENCE).json())

        awake = wait_until(lambda: (p := props()).get("is_sleeping") is False and p)
        assert awake["model_alias"] == "tiny" and "default_generation_settings" in awake
        router.wait_status("tiny", "sleeping")
        asleep = props()
        # asking (/props, /health, /models, /metrics) neither wakes it nor keeps it awake
        assert asleep["default_generation_settings"] == awake["default_generation_settings"]
        for path in ("/health", "/models", "/metrics"):
            assert httpx.get(f"{router.url}{path}", timeout=PATIENCE).status_code == 200
        assert props()["is_sleeping"] and router.status("tiny") == "sleeping"
        r = httpx.post(f"{router.url}/completion", json={"prompt": "Hello", "n_predict": 2},
                       timeout=PATIENCE)  # fmt: skip
        assert r.status_code == 200 and props()["is_sleeping"] is False


def test_a_model_too_large_for_the_memory_budget_is_refused_with_the_numbers(
    three: Path, tmp_path: Path
) -> None:
    with running_router("--models-dir", str(three), "--models-memory", "64M") as router:
        r = chat(router.url, "rope", "hello")
        assert r.status_code == 507, r.text
        said = r.json()["error"]["message"]
        assert "needs about" in said and "64.0 MiB" in said and "weights" in said
        assert router.status("rope") == "unloaded"
        assert not any("[rope]" in line for line in router.lines)  # no process was started
    preset = tmp_path / "preset.ini"
    preset.write_text(f"[big]\nmodel = {three / 'rope' / 'model.gguf'}\nload-on-startup = true\n")
    code, said = router_exit("--models-preset", str(preset), "--models-memory", "64M")
    assert code == 2 and "'big' needs about" in said and "64.0 MiB" in said


def test_a_reload_lists_the_preset_as_it_is_now(three: Path, tmp_path: Path) -> None:
    preset = tmp_path / "models.ini"

    def write(*names: str) -> None:
        preset.write_text("".join(f"[{n}]\nmodel = {three / n / 'model.gguf'}\n" for n in names))

    write("rope", "mrope")
    with running_router("--models-preset", str(preset), "--models-max", "1") as router:
        assert chat(router.url, "rope", "hi").status_code == 200
        again = httpx.get(f"{router.url}/models?reload=1", timeout=PATIENCE).json()["data"]
        assert {m["id"] for m in again} == {"rope", "mrope"}
        # unchanged by the reload: still there once unloaded for another
        assert chat(router.url, "mrope", "hi").status_code == 200
        router.wait_status("rope", "unloaded")
        assert chat(router.url, "rope", "hi").status_code == 200
        write("rope", "noncausal")  # mrope goes (it is unloaded at once), noncausal comes
        again = httpx.get(f"{router.url}/models?reload=1", timeout=PATIENCE).json()["data"]
        assert {m["id"] for m in again} == {"rope", "noncausal"}
        assert chat(router.url, "mrope", "hi").status_code == 404
        assert chat(router.url, "noncausal", "hi").status_code == 200
        preset.write_text("[broken]\nnot-a-flag = 1\n")
        r = httpx.get(f"{router.url}/models?reload=1", timeout=PATIENCE)
        assert r.status_code == 400 and "not-a-flag" in r.json()["error"]["message"]


def test_models_sse_reports_each_status_change(three: Path) -> None:
    with running_router("--models-dir", str(three)) as router:
        events: list[dict[str, Any]] = []
        ready = threading.Event()

        def listen() -> None:
            with httpx.stream("GET", f"{router.url}/models/sse", timeout=PATIENCE) as r:
                for line in r.iter_lines():
                    ready.set()
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        if events[-1]["data"].get("status") == "unloaded":
                            return

        threading.Thread(target=listen, daemon=True).start()
        assert ready.wait(PATIENCE)
        assert chat(router.url, "mrope", "hi").status_code == 200
        httpx.post(f"{router.url}/models/unload", json={"model": "mrope"}, timeout=PATIENCE)
        wait_until(lambda: len(events) >= 3, what="three events")
        assert [(e["model"], e["data"]["status"]) for e in events] == [
            ("mrope", "loading"), ("mrope", "loaded"), ("mrope", "unloaded")
        ]  # fmt: skip


def test_an_unknown_model_is_a_404_naming_those_there_are(three: Path) -> None:
    with running_router("--models-dir", str(three), "--api-key-file", str(_key(three))) as router:
        r = httpx.post(f"{router.url}/v1/messages", timeout=PATIENCE,
                       headers={"x-api-key": "sk-test"},
                       json={"model": "nope", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 404 and r.json()["type"] == "error"  # (Anthropic's shape)
        assert "mrope, noncausal, rope" in r.json()["error"]["message"]
        r = chat(router.url, "rope", "hi")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # a body declared too large: refused in shape before a byte of it is read
        host, port = router.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=PATIENCE)
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("content-length", str(1 << 40))
        conn.putheader("content-type", "application/json")
        conn.endheaders()
        big = conn.getresponse()
        assert big.status == 413 and "error" in json.loads(big.read())
        conn.close()


def test_a_conversation_s_stream_outlives_its_caller_and_stops_on_delete(three: Path) -> None:
    with running_router("--models-dir", str(three), "--ctx-size", "4096") as router:
        body = {"model": "rope", "prompt": "Once", "n_predict": 300, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        headers = {"x-conversation-id": "talk::rope"}
        with httpx.stream("POST", f"{router.url}/completion", json=body, headers=headers,
                          timeout=PATIENCE) as r:  # fmt: skip
            lines = r.iter_lines()
            assert next(x for x in lines if x.startswith("data: "))  # then the caller leaves
        again = httpx.get(f"{router.url}/v1/stream?conv_id=talk%3A%3Arope&from=0", timeout=PATIENCE)
        chunks = [json.loads(x[6:]) for x in again.text.splitlines() if x.startswith("data: ")]
        assert chunks[-1]["stop"] is True and chunks[-1]["tokens_predicted"] == 300
        looked = httpx.post(f"{router.url}/v1/streams/lookup", timeout=PATIENCE,
                            json={"conversation_ids": ["talk"]}).json()  # fmt: skip
        assert [(x["conversation_id"], x["is_done"]) for x in looked] == [("talk::rope", True)]
        # a stop in the middle ends the generation: the model is idle again, the stream gone
        body["n_predict"] = 3000
        with httpx.stream("POST", f"{router.url}/completion", json=body, headers=headers,
                          timeout=PATIENCE) as r:  # fmt: skip
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: "))
            stop = httpx.delete(f"{router.url}/v1/stream?conv_id=talk::rope", timeout=PATIENCE)
            assert stop.status_code == 204
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
        assert not rest or "stop" not in rest[-1] or rest[-1]["stop"] is False  # cut short
        wait_until(lambda: _in_flight(router, "rope") == 0, what="the generation stopped")
        slots = httpx.get(f"{router.url}/slots?model=rope", timeout=PATIENCE).json()
        assert slots[0]["slotwise"]["num_cells"] < 1500  # (of the 3,000 it was asked for)
        gone = httpx.get(f"{router.url}/v1/stream?conv_id=talk::rope", timeout=PATIENCE)
        assert gone.status_code == 404


def test_a_key_may_be_limited_to_some_models(three: Path) -> None:
    keys = three.parent / "keys"
    keys.write_text("alice sk-alice models=rope\nbob sk-bob\n")
    with running_router("--models-dir", str(three), "--token-file", str(keys)) as router:

        def as_(key: str, path: str, **body: Any) -> httpx.Response:
            return httpx.request("GET" if not body else "POST", f"{router.url}{path}",
                                 json=body or None, headers={"authorization": f"Bearer {key}"},
                                 timeout=PATIENCE)  # fmt: skip

        hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = as_("sk-alice", "/v1/chat/completions", model="mrope", **hi)
        assert refused.status_code == 403, refused.text
        assert as_("sk-alice", "/models/load", model="mrope").status_code == 403
        listed = {m["id"]: m["status"]["value"] for m in as_("sk-bob", "/models").json()["data"]}
        assert listed["mrope"] == "unloaded"  # (nothing was loaded for it)
        assert [m["id"] for m in as_("sk-alice", "/models").json()["data"]] == ["rope"]
        assert as_("sk-alice", "/v1/chat/completions", model="rope", **hi).status_code == 200
        assert as_("sk-bob", "/v1/chat/completions", model="mrope", **hi).status_code == 200
        assert len(as_("sk-bob", "/models").json()["data"]) == 3


def test_one_tenant_cannot_fill_the_queue_for_others(three: Path) -> None:
    keys = three.parent / "keys"
    keys.write_text("alice sk-alice\nbob sk-bob\n")
    args = ("--models-dir", str(three), "--token-file", str(keys), "--models-max", "1",
            "--models-queue-per-tenant", "1", "--ctx-size", "4096")  # fmt: skip
    with running_router(*args) as router:
        auth = {"authorization": "Bearer sk-bob"}

        def ask(key: str, model: str, out: dict[str, Any]) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}  # fmt: skip
            out["r"] = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=PATIENCE,
                                  headers={"authorization": f"Bearer {key}"})  # fmt: skip

        def waiting() -> str:
            return httpx.get(f"{router.url}/metrics", headers=auth, timeout=PATIENCE).text

        assert httpx.post(f"{router.url}/models/load", json={"model": "rope"}, headers=auth,
                          timeout=PATIENCE).status_code == 200  # fmt: skip
        wait_until(lambda: 'slotwise_router_model_loaded{model="rope"} 1.0' in waiting())
        first: dict[str, Any] = {}
        theirs: dict[str, Any] = {}
        a = threading.Thread(target=ask, args=("sk-alice", "mrope", first))
        b = threading.Thread(target=ask, args=("sk-bob", "noncausal", theirs))
        with _held_stream(router.url, "rope", headers=auth):
            a.start()
            wait_until(lambda: "slotwise_router_waiting 1.0" in waiting(), what="alice waits")
            second: dict[str, Any] = {}
            ask("sk-alice", "noncausal", second)  # her second while her first waits: refused
            assert second["r"].status_code == 503 and "alice" in second["r"].text
            b.start()
            wait_until(lambda: "slotwise_router_waiting 2.0" in waiting(), what="bob waits too")
        for th in (a, b):
            th.join(PATIENCE * 2)
        assert first["r"].status_code == 200 and theirs["r"].status_code == 200


def test_the_readme_s_grpc_example_runs_against_a_router(three: Path) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = [
        c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "model_addresses" in c
    ]
    with running_router("--models-dir", str(three)) as router:
        code = code.replace("http://127.0.0.1:8080", router.url).replace("gemma-3-4b", "mrope")
        scope: dict[str, Any] = {}
        exec(compile(code, "README.md", "exec"), scope)
        reply = scope["reply"]
        # (sampled on random weights: it may end before its 16 tokens)
        assert reply.finished is not None and reply.finished.error == ""
        assert 0 < reply.finished.usage.num_generated_tokens <= 16 and reply.text is not None
        assert router.status("mrope") == "loaded"


def test_the_cli_reaches_a_model_by_name_through_the_router(three: Path) -> None:
    with running_router("--models-dir", str(three)) as router:

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-m", "slotwise_cli", *args, "--router", router.url]
            return subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE)

        done = cli("generate", "--model", "mrope", "--prompt", "hi", "--max-tokens", "4")
        assert done.returncode == 0, done.stderr
        assert router.status("mrope") == "loaded" and router.status("rope") == "unloaded"
        info = cli("info", "--model", "mrope")
        assert info.returncode == 0 and "qwen2vl" in info.stdout, info.stdout + info.stderr
        missing = cli("info", "--model", "nope")
        assert missing.returncode == 1
        assert "'nope' not found; the models here: mrope, noncausal, rope" in missing.stderr


def _key(folder: Path) -> Path:
    path = folder.parent / "key"
    path.write_text("sk-test\n")
    return path
