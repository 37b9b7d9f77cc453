"""A session turn over HTTP that sends only its new messages (as the README says) continues
after the previous reply: the reply stays in the session, over HTTP and over gRPC alike."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from clients.client import Message, SlotwiseClient, collect
from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks
from support.loop import LoopThread
from support.wait import PATIENCE


@pytest.fixture
def stack(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stack]:
    stacks = Stacks(loop_thread, tiny, prep_servers)
    yield stacks.start("mrope", ctx_size=2048, parallel=2)
    stacks.close()


def _kv(s: Stack) -> dict[str, Any]:
    with (
        httpx.Client(base_url=s.url, timeout=PATIENCE) as api,
        api.stream("GET", "/slotwise/kv") as r,
    ):
        line = next(x for x in r.iter_lines() if x.startswith("data: "))
    return json.loads(line[6:])


def _replies_held(s: Stack, session: str) -> int:
    """How many replies (runs of generated cells) the session's sequence holds."""
    (slot,) = [x for x in _kv(s)["slots"] if x["session_id"] == session]
    kinds = [g["kind"] for g in slot["segments"]]
    return sum(1 for i, k in enumerate(kinds) if k == "generated" and kinds[i - 1 : i] != [k])


def test_a_turn_sending_only_its_new_message_keeps_the_reply(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=PATIENCE) as api:
        for t in range(3):
            r = api.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Question {t}: what then?"}],
                "max_tokens": 6, "temperature": 0, "slotwise": {"session_id": "only-new"},
            })  # fmt: skip
            assert r.status_code == 200, r.text
            if t:  # the replies so far are all in the sequence, not only the newest
                assert _replies_held(stack, "only-new") == t + 1


def test_a_grpc_turn_sending_the_reply_keeps_it_too(stack: Stack) -> None:
    with SlotwiseClient(f"127.0.0.1:{stack.prep_port}", f"127.0.0.1:{stack.infer.port}") as c:
        session = c.create_session("grpc-turns")
        chat = [Message.user("Question 0: what then?")]
        first = 0
        for t in range(3):
            out = collect(
                c.generate(
                    c.prepare(chat, first_message=first), session_id=session.session_id,
                    max_tokens=6, temperature=0,
                )
            )  # fmt: skip
            chat += [Message.assistant(out.text), Message.user(f"Question {t + 1}: and?")]
            first = len(chat) - 2
    assert _replies_held(stack, "grpc-turns") == 3
