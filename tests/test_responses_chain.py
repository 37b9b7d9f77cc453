"""A stored Responses chain of 30 turns in 1024 cells, an image every third turn, with the
server killed -9 after turn 20 and restarted on the same --sessions-dir: every turn decodes
only its new input, the chain goes on past the context (its session shifts), and after the
restart it continues from its latest response, whose earlier responses still read back."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import httpx
import openai
from responses_chain import responses_chain

from clients.client import SlotwiseClient
from slotwise_core.tiny_models import TinyPair
from support.cluster import Proc
from support.procs import free_port, serve_argv
from support.wait import wait_until


def serve(pair: TinyPair, sessions: Path, log: Path) -> tuple[Proc, str, str]:
    http, infer = free_port(), free_port()
    argv = serve_argv(pair.model, pair.mmproj, "--infer-port", str(infer), "--ctx-size", "1024",
                      "--sessions-dir", str(sessions), "--http-port", str(http))  # fmt: skip
    proc = Proc("serve", argv, infer, log)
    proc.start()
    url = f"http://127.0.0.1:{http}"

    def ready() -> bool:
        assert proc.alive, log.read_text()[-2000:]
        try:
            return httpx.get(f"{url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, what="slotwise serve ready")
    return proc, url, f"127.0.0.1:{infer}"


def test_a_stored_chain_of_30_turns_survives_its_context_and_a_kill_9(
    tiny: dict[str, TinyPair], tmp_path: Path
) -> None:
    sessions = tmp_path / "sessions"
    proc, url, infer = serve(tiny["mrope"], sessions, tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        # greedy: the same replies, so the same figures, every run
        rows = responses_chain(client, range(20), temperature=0)
        proc.stop()  # kill -9
        proc, url, infer = serve(tiny["mrope"], sessions, tmp_path / "serve.log")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        rows += responses_chain(client, range(20, 30), previous=rows[-1]["id"], temperature=0)
        print(json.dumps(rows))  # the figures, with -s
        assert [r["turn"] for r in rows] == list(range(30))
        decoded = [r["decoded"] for r in rows[1:]]
        # only the new input each turn: no turn re-decodes what came before
        assert max(decoded) < 150 and statistics.median(decoded) < 100, decoded
        assert rows[-1]["cached"] > 0
        chain = rows[0]["id"].split("_")[1]
        with SlotwiseClient(infer_address=infer) as grpc_client:
            session = grpc_client.get_session(f"resp-{chain}")
        assert session.num_turns == 30 and session.num_shifts > 0  # past 1024 cells
        assert session.num_cells <= 1024 and all(r["cached"] <= 1024 for r in rows)
        for early in (rows[1], rows[19], rows[29]):
            again = client.responses.retrieve(early["id"])
            assert again.id == early["id"] and again.usage is not None
            assert again.usage.output_tokens == early["output"]
    finally:
        proc.stop()
