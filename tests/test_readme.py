"""The README's Python example runs as written, against real services."""

from __future__ import annotations

import re
from pathlib import Path

from support.media import image_bytes, wav_bytes

README = Path(__file__).resolve().parent.parent / "README.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_session_example_runs(prep_servers, infer_server, tmp_path, monkeypatch) -> None:
    (code,) = [c for c in examples() if "create_session" in c]
    infer = infer_server("mrope", ctx_size=1024)
    code = code.replace("127.0.0.1:50051", f"127.0.0.1:{prep_servers('mrope')}")
    code = code.replace("127.0.0.1:50052", f"127.0.0.1:{infer.port}")
    (tmp_path / "cat.jpg").write_bytes(image_bytes(224, 160, "JPEG"))
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(code, str(README), "exec"), scope)
    chat = scope["chat"]
    assert isinstance(chat, list) and len(chat) == 6  # system, user+image, 2 turns of replies
    import grpc

    from slotwise.v1 import infer_pb2, infer_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{infer.port}") as ch:
        sessions = (
            infer_pb2_grpc.InferServiceStub(ch)
            .ListSessions(infer_pb2.ListSessionsRequest(), timeout=10)
            .sessions
        )
    assert [s.num_turns for s in sessions] == [2]


def test_the_http_api_examples_run(
    prep_servers, infer_server, loop_thread, tmp_path, monkeypatch
) -> None:
    """The OpenAI example, then (in its scope) the tools, Responses, Anthropic and gRPC ones."""
    from clients.gateway import GatewayConfig
    from clients.gateway.serve import start_gateway

    blocks = examples()
    openai_block = next(i for i, c in enumerate(blocks) if "from openai import OpenAI" in c)
    # (the router's example runs against a router: tests/test_router.py)
    others = [c for c in blocks[openai_block + 1 :] if "model_addresses" not in c]
    infer = infer_server("mrope", ctx_size=4096, parallel=2)
    sound = infer_server("ultravox", ctx_size=1024)
    prep = f"127.0.0.1:{prep_servers('mrope')}"
    gateway = loop_thread.run(
        start_gateway(GatewayConfig(prep, f"127.0.0.1:{infer.port}"), "127.0.0.1", 0)
    )
    scope: dict[str, object] = {}
    try:
        (tmp_path / "cat.jpg").write_bytes(image_bytes(224, 160, "JPEG"))
        (tmp_path / "question.wav").write_bytes(wav_bytes(2.0))
        monkeypatch.chdir(tmp_path)
        for code in [blocks[openai_block], *others]:
            code = code.replace("127.0.0.1:8080", f"127.0.0.1:{gateway.port}")
            pair = "ultravox" if "audio=" in code else "mrope"  # (the audio example's model)
            code = code.replace("127.0.0.1:50051", f"127.0.0.1:{prep_servers(pair)}").replace(
                "127.0.0.1:50052", f"127.0.0.1:{(infer if pair == 'mrope' else sound).port}"
            )
            exec(compile(code, str(README), "exec"), scope)
    finally:
        loop_thread.run(gateway.stop())
    assert {"reply", "call", "second", "message", "done", "heard"} <= set(scope)
    reply = scope["reply"]
    assert reply.choices[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    assert scope["call"].function.name == "get_weather"  # type: ignore[attr-defined]
