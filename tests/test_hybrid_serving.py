"""Hybrid-memory models (Qwen3.5, LFM2) served as a user would: every turn of a chat resent
whole, regenerations and edits, sessions, Responses chains and the pool, on real servers with
the tiny ``qwen35`` and ``lfm2`` pairs in 256 cells a slot. Their recurrent state cannot be cut
back; what a request reuses comes from a checkpoint of it, and is the same as a fresh prefill
(sampled with a seed, a reply over a reused prefix equals the reply over none)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from responses_chain import responses_chain
from test_responses_chain import serve

from clients.client import Message, SlotwiseClient, collect
from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks
from support.loop import LoopThread
from support.media import image_bytes

HYBRID_PAIRS = ("qwen35", "lfm2")
# sampled, not greedy: a random model's greedy reply repeats one token, and a sample with a
# seed follows the exact distribution (a reused prefix that held another state would show)
SEEDED = {"temperature": 1.0, "top_p": 1.0, "seed": 11}


@pytest.fixture
def stack(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Callable[..., Stack]]:
    stacks = Stacks(loop_thread, tiny, prep_servers)
    yield lambda pair, **kwargs: stacks.start(pair, **kwargs)
    stacks.close()


def _image_turn(text: str, seed: int) -> dict[str, Any]:
    import base64

    uri = "data:image/png;base64," + base64.b64encode(image_bytes(96, 64, seed=seed)).decode()
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": uri}},
        ],
    }


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="slotwise",
        messages=messages,
        max_tokens=12,
        **kwargs,  # type: ignore[arg-type]
    )


def _cached(reply: Any) -> int:
    return int(reply.usage.prompt_tokens_details.cached_tokens)


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_the_memory_kind_is_told(stack: Callable[..., Stack], pair: str) -> None:
    s = stack(pair, ctx_size=512, parallel=2)
    with SlotwiseClient(f"127.0.0.1:{s.prep_port}", f"127.0.0.1:{s.infer.port}") as client:
        server, model = client.server_info(), client.model_info()
    assert server.memory_kind == model.memory_kind == "hybrid"
    assert server.num_checkpoints_per_slot == 32
    props = httpx.get(f"{s.url}/props", timeout=30).json()
    assert props["slotwise"]["memory"] == "hybrid" and props["slotwise"]["ctx_checkpoints"] == 32


def test_an_attention_model_is_told_as_such(stack: Callable[..., Stack]) -> None:
    s = stack("mrope")
    with SlotwiseClient(f"127.0.0.1:{s.prep_port}", f"127.0.0.1:{s.infer.port}") as client:
        server, model = client.server_info(), client.model_info()
    assert server.memory_kind == model.memory_kind == "attention"
    assert server.num_checkpoints_per_slot == 0


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_a_chat_resent_whole_goes_on_past_the_context(
    stack: Callable[..., Stack], pair: str
) -> None:
    s = stack(pair, ctx_size=512, parallel=2)
    client = s.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 4}]
    rows = []
    for t in range(10):
        text = f"Turn {t}: tell me about the number {t}. " * 2
        messages.append(_image_turn(text, t) if t % 4 == 0 else {"role": "user", "content": text})
        reply = _chat(client, messages, temperature=0)  # (a 4xx/5xx raises)
        rows.append((reply.usage.prompt_tokens, _cached(reply), reply.model_extra or {}))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert all(cached > 0 for _, cached, _ in rows[1:]), rows
    assert max(prompt for prompt, _, _ in rows) > 256  # (a slot holds 256 cells)
    info = _server_info(s)
    assert info.stats.num_shifts > 0 and info.stats.num_checkpoint_restores > 0
    assert info.stats.num_checkpoints > 0


def _server_info(s: Stack) -> Any:
    with SlotwiseClient(f"127.0.0.1:{s.prep_port}", f"127.0.0.1:{s.infer.port}") as client:
        return client.server_info()


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_a_reused_prefix_gives_what_a_fresh_prefill_gives(
    stack: Callable[..., Stack], pair: str
) -> None:
    s = stack(pair, ctx_size=1024, parallel=1)
    client = s.client()
    messages = [
        {"role": "system", "content": "You are terse. " * 4},
        _image_turn("What is in it? " * 3, 1),
    ]
    first = _chat(client, messages, **SEEDED)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then? " * 3},
    ]
    reused = _chat(client, messages, **SEEDED)
    fresh = _chat(client, messages, **SEEDED, extra_body={"cache_salt": "fresh"})
    assert _cached(reused) > 0 and _cached(fresh) == 0
    assert reused.choices[0].message.content == fresh.choices[0].message.content
    # regenerated: the same prompt again reuses all but its last 4 cells (a checkpoint there)
    again = _chat(client, messages, **SEEDED)
    assert _cached(again) == again.usage.prompt_tokens - 4
    assert again.choices[0].message.content == fresh.choices[0].message.content
    # the last message edited: reused up to its start (a checkpoint there), the rest decoded
    edited = [*messages[:-1], {"role": "user", "content": "Something else. " * 3}]
    a = _chat(client, edited, **SEEDED)
    b = _chat(client, edited, **SEEDED, extra_body={"cache_salt": "fresh-2"})
    assert 0 < _cached(a) < a.usage.prompt_tokens - 4
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_session_turns_continue_on_the_first_try(stack: Callable[..., Stack], pair: str) -> None:
    """README's gRPC session example, past the context."""
    s = stack(pair, ctx_size=512, parallel=2)
    with SlotwiseClient(f"127.0.0.1:{s.prep_port}", f"127.0.0.1:{s.infer.port}") as client:
        session = client.create_session(keep=16)
        chat = [Message.system("Be brief. " * 3), Message.user(image_bytes(96, 64), "What is it?")]
        first, decoded = 0, []
        for t in range(8):
            out = collect(
                client.generate(
                    client.prepare(chat, first_message=first),
                    session_id=session.session_id,
                    max_tokens=12,
                )
            )
            decoded.append(out.usage.num_prompt_cells - out.usage.num_reused_cells)
            chat += [Message.assistant(out.text), Message.user(f"Question {t}: and then? " * 2)]
            first = len(chat) - 2
        got = client.get_session(session.session_id)
    assert got.num_turns == 8 and got.num_shifts > 0 and got.num_cells <= 256
    # each turn decodes its own chunks (and the reply, where its tokens are not the template's),
    # never the history again (a whole history is over 256 cells)
    assert max(decoded[1:]) < 100, decoded


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_a_responses_chain_continues_on_the_first_try_and_after_a_kill_9(
    tiny: dict[str, TinyPair], tmp_path: Path, pair: str
) -> None:
    sessions = tmp_path / "sessions"
    proc, url, _ = serve(tiny[pair], sessions, tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        rows = responses_chain(client, range(8), temperature=0)
        proc.stop()  # kill -9
        proc, url, _ = serve(tiny[pair], sessions, tmp_path / "serve.log")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        rows += responses_chain(client, range(8, 12), previous=rows[-1]["id"], temperature=0)
    finally:
        proc.stop()
    assert [r["turn"] for r in rows] == list(range(12))
    decoded = [r["decoded"] for r in rows[1:]]
    assert max(decoded) < 150, decoded  # (only each turn's new input, after the restart too)


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_the_pool_shares_a_prefix_with_its_recurrent_state(
    stack: Callable[..., Stack], pair: str
) -> None:
    pooled = stack(pair, ctx_size=1024, parallel=3, kv_unified=True)
    alone = stack(pair, ctx_size=1024, parallel=1)
    system = {"role": "system", "content": "You are a careful and terse assistant. " * 4}
    for t in range(3):
        messages = [system, {"role": "user", "content": f"Chat {t}: hello. " * 2}]
        shared = _chat(pooled.client(), messages, **SEEDED, extra_body={"slotwise": {"keep": 40}})
        fresh = _chat(alone.client(), messages, **SEEDED)
        assert shared.choices[0].message.content == fresh.choices[0].message.content
    assert _server_info(pooled).stats.num_shared_prefixes > 0


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_chats_taking_turns_on_one_slot_resume_from_host_memory(
    stack: Callable[..., Stack], pair: str
) -> None:
    """Two stateless chats alternate on one slot: each one's state goes to the host cache and
    comes back whole, its recurrent part and checkpoints included; what follows equals a fresh
    prefill."""
    s = stack(pair, ctx_size=1024, parallel=1)
    client = s.client()
    chats: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"You are assistant number {c}. " * 6}] for c in range(2)
    ]
    for t in range(3):
        for c, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Chat {c}, turn {t}: go on. " * 2})
            reply = _chat(client, messages, **SEEDED)
            if t:
                fresh = _chat(client, messages, **SEEDED, extra_body={"cache_salt": f"{c}{t}"})
                assert _cached(reply) > 0, (c, t)
                assert reply.choices[0].message.content == fresh.choices[0].message.content
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})


@pytest.mark.parametrize("pair", HYBRID_PAIRS)
def test_drafts_on_recurrent_memory_keep_the_reply(stack: Callable[..., Stack], pair: str) -> None:
    s = stack(pair)
    client = s.client()
    messages = [{"role": "user", "content": "Repeat: a b c d a b c d a b c d"}]
    plain = _chat(client, messages, temperature=0)
    asked = _chat(
        client, messages, temperature=0,
        extra_body={"speculative": {"type": "ngram-simple"}, "speculative.ngram_size_n": 2},
    )  # fmt: skip
    assert asked.choices[0].message.content == plain.choices[0].message.content
    assert asked.usage.model_extra["slotwise"]["draft_tokens"] > 0  # type: ignore[union-attr]
