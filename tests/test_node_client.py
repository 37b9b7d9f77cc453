"""A Node.js client (@grpc/grpc-js + @grpc/proto-loader, tests/contract/node/) built from protos/
alone talks to the real services and agrees with the Python side; protobufjs reads and writes the
golden fixtures byte for byte.

Needs `node` and the packages: `(cd tests/contract/node && npm ci)`; skipped otherwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2
from support.media import image_bytes
from support.required import require_or_skip

ROOT = Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "tests" / "contract" / "node"
GOLDEN = ROOT / "tests" / "contract" / "golden"
NODE = shutil.which("node")
MAX_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def needs_node() -> None:
    if NODE is None:
        require_or_skip("node", "node is not installed (Node.js >= 20 is needed)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        require_or_skip(
            "node",
            "tests/contract/node/node_modules is absent: run (cd tests/contract/node && npm ci)",
        )


def run_node(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    return subprocess.run(
        [NODE, script, *args], cwd=NODE_DIR, capture_output=True, text=True, timeout=timeout
    )


def python_prepare(port: int, png: bytes, channel_to: Callable[[int], grpc.Channel]):
    """The same chat client.js sends, through the Python stubs."""
    part = prep_pb2.Part
    request = prep_pb2.PrepareRequest(
        chat=prep_pb2.Chat(
            messages=[
                prep_pb2.Message(role="system", parts=[part(text="You are terse.")]),
                prep_pb2.Message(
                    role="user",
                    parts=[
                        part(text="What is in"),
                        part(image=prep_pb2.Image(data=png)),
                        part(text="this picture?"),
                    ],
                ),
            ]
        )
    )
    return prep_pb2_grpc.PrepServiceStub(channel_to(port)).Prepare(request, timeout=60).prompt


def python_generate(port: int, prompt: prompt_pb2.PreparedPrompt, channel_to) -> list:
    request = infer_pb2.GenerateRequest(
        prompt=prompt, sampling=infer_pb2.SamplingParams(temperature=0), max_tokens=MAX_TOKENS
    )
    stub = infer_pb2_grpc.InferServiceStub(channel_to(port))
    return list(stub.Generate(request, timeout=60))


def test_node_client_prepares_and_generates_like_python(
    prep_servers: Callable[[str], int],
    infer_server: Callable[..., object],
    channel_to: Callable[[int], grpc.Channel],
    tmp_path: Path,
) -> None:
    prep_port = prep_servers("mrope")
    infer_port = infer_server("mrope").port  # type: ignore[attr-defined]
    png = image_bytes(84, 56, seed=3)
    image = tmp_path / "image.png"
    image.write_bytes(png)

    done = run_node(
        "client.js",
        *("--prep", f"127.0.0.1:{prep_port}", "--infer", f"127.0.0.1:{infer_port}"),
        *("--image", str(image), "--max-tokens", str(MAX_TOKENS)),
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)

    prompt = python_prepare(prep_port, png, channel_to)
    media = [c for c in prompt.chunks if c.WhichOneof("kind") == "media"]
    assert summary["num_chunks"] == len(prompt.chunks)
    assert summary["num_media_chunks"] == len(media) == 1
    assert summary["num_text_chunks"] == len(prompt.chunks) - len(media)
    assert summary["num_cells"] == summary["num_cells_counted"] == prompt.num_cells
    assert summary["num_positions"] == summary["num_positions_counted"] == prompt.num_positions
    assert summary["num_cells"] != summary["num_positions"]  # M-RoPE: the case that matters
    assert summary["fingerprint"] == {
        "model": prompt.fingerprint.model,
        "mmproj": prompt.fingerprint.mmproj,
    }
    m = media[0]
    assert summary["media"] == [
        {
            "media_id": m.media.media_id,
            "width": 84,
            "height": 56,
            "num_cells": m.media.num_cells,
            "num_positions": m.media.num_positions,
            "message_index": m.message_index,
            "media_group": m.media_group,
        }
    ]
    assert summary["started"]["num_prompt_cells"] == prompt.num_cells
    assert summary["started"]["num_prompt_positions"] == prompt.num_positions

    events = python_generate(infer_port, prompt, channel_to)
    finished = events[-1].finished
    reason = infer_pb2.FinishReason.Name(finished.reason)
    assert summary["finish_reason"] == reason
    if reason == "FINISH_REASON_LENGTH":
        assert summary["num_generated_tokens"] == MAX_TOKENS
    else:
        assert reason == "FINISH_REASON_STOP"
    # greedy on the same prompt: the very same tokens whichever language asked
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    python_tokens = [t for d in deltas for t in d.token_ids]
    assert summary["token_ids"] == python_tokens
    assert summary["num_generated_tokens"] == finished.usage.num_generated_tokens
    assert summary["usage"]["num_generated_tokens"] == finished.usage.num_generated_tokens
    assert summary["event_counts"]["started"] == summary["event_counts"]["finished"] == 1


def test_node_client_reports_the_grpc_status(
    prep_servers: Callable[[str], int], infer_server: Callable[..., object], tmp_path: Path
) -> None:
    not_an_image = tmp_path / "image.png"
    not_an_image.write_bytes(b"this is not a PNG")
    done = run_node(
        "client.js",
        *("--prep", f"127.0.0.1:{prep_servers('mrope')}"),
        *("--infer", f"127.0.0.1:{infer_server('mrope').port}"),  # type: ignore[attr-defined]
        *("--image", str(not_an_image)),
    )
    assert done.returncode == 1
    assert "INVALID_ARGUMENT" in done.stderr
    assert done.stdout == ""


def test_protobufjs_reads_and_writes_the_golden_fixtures_identically() -> None:
    done = run_node("golden.js")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report) == sorted(p.stem for p in GOLDEN.glob("*.binpb"))
    for name, r in report.items():
        assert r["same_bytes"], f"{name}: protobufjs re-encodes different bytes"
        assert r["verify_error"] is None, f"{name}: {r['verify_error']}"
        assert r["json_difference"] is None, f"{name}: {r['json_difference']}"
    golden = json_format.Parse(
        (GOLDEN / "prepared_prompt.json").read_text(), prompt_pb2.PreparedPrompt()
    )
    assert report["prepared_prompt"]["num_cells"] == golden.num_cells
    assert report["prepared_prompt"]["num_positions"] == golden.num_positions
    assert report["prepared_prompt"]["kinds"] == [c.WhichOneof("kind") for c in golden.chunks]
    events = {n: r["kind"] for n, r in report.items() if n.startswith("generate_response_")}
    assert set(events.values()) == {
        f.name for f in infer_pb2.GenerateResponse.DESCRIPTOR.oneofs_by_name["event"].fields
    }


def test_the_openai_npm_package_streams_a_chat_with_an_image(
    prep_servers: Callable[[str], int], infer_server: Callable[..., object], tmp_path: Path,
    loop_thread,
) -> None:  # fmt: skip
    """The official `openai` npm package against the HTTP gateway: one streamed chat."""
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        require_or_skip(
            "node", "the openai npm package is absent: run (cd tests/contract/node && npm ci)"
        )
    from clients.gateway import GatewayConfig
    from clients.gateway.serve import start_gateway

    prep_port = prep_servers("mrope")
    infer_port = infer_server("mrope").port  # type: ignore[attr-defined]
    gateway = loop_thread.run(
        start_gateway(
            GatewayConfig(f"127.0.0.1:{prep_port}", f"127.0.0.1:{infer_port}"), "127.0.0.1", 0
        )
    )
    try:
        image = tmp_path / "image.png"
        image.write_bytes(image_bytes(84, 56, seed=3))
        done = run_node(
            "openai_chat.js",
            *("--base-url", f"http://127.0.0.1:{gateway.port}/v1", "--image", str(image)),
        )
    finally:
        loop_thread.run(gateway.stop())
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["first_role"] == "assistant"
    assert summary["finish_reason"] in ("stop", "length")
    usage = summary["usage"]
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["slotwise"]["prompt_positions"] < usage["prompt_tokens"]  # an M-RoPE image
