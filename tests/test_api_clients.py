"""The field's client libraries, unchanged, against real servers on the tiny models: openai
(logprobs, structured output, tools, n, embeddings, the Responses API), anthropic,
langchain-openai, instructor, pydantic-ai, openai-agents and the `llm` CLI.

Random weights decide nothing of interest, so the checks are about validity: a grammar makes
even them call tools with arguments that match the schema, and write JSON that validates.
The tiny tokenizer spends a token per byte: calls need a few hundred tokens.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks, stacks_fixture
from support.loop import LoopThread
from support.media import image_bytes
from support.wait import wait_until

TEMPLATES = Path(__file__).parent / "templates"
QWEN = str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja")  # Hermes-style <tool_call>
ROOM = 400  # tokens: a call, byte by byte

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER_SCHEMA},
}
HI = [{"role": "user", "content": "What is the weather in Oslo?"}]


class City(BaseModel):
    name: Literal["Oslo", "Lima", "Pune"]
    rank: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def stacks(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stacks]:
    yield from stacks_fixture(loop_thread, tiny, prep_servers)


@pytest.fixture(scope="module")
def hermes(stacks: Stacks, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """mrope with Qwen 2.5's template: tools in its own format; embeddings; sessions on disk."""
    return stacks.start(
        "mrope",
        chat_template=QWEN,
        ctx_size=8192,
        parallel=2,
        embeddings_ctx=256,
        sessions_dir=tmp_path_factory.mktemp("sessions"),
    )


@pytest.fixture(scope="module")
def generic(stacks: Stacks) -> Stack:
    """mrope with llama.cpp's built-in chatml: no tool format of its own (the JSON form)."""
    return stacks.start("mrope", chat_template="chatml", ctx_size=8192, parallel=2)


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# -- openai: Chat Completions and Completions -------------------------------------------------


def test_logprobs_and_top_logprobs(hermes: Stack) -> None:
    client = hermes.client()
    r = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=HI,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    for lp in content:
        tops = [t.logprob for t in lp.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert lp.logprob == pytest.approx(tops[0]) and lp.token == lp.top_logprobs[0].token
    c = client.completions.create(
        model="x", prompt="Once", max_tokens=5, logprobs=2, temperature=0
    )  # (greedy: a sampled reply may end before 5 tokens)
    lps = c.choices[0].logprobs
    assert lps is not None and len(lps.tokens) == len(lps.token_logprobs) == 5
    assert all(len(t) <= 2 for t in lps.top_logprobs) and lps.text_offset[0] == 0


def test_response_format_json_schema_json_object_and_the_body_grammar(hermes: Stack) -> None:
    client = hermes.client()
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True},
    }
    for seed in range(3):
        r = client.chat.completions.create(
            model="gpt-4o-mini",
            messages=HI,
            max_tokens=ROOM,
            response_format=fmt,
            temperature=1.0,
            seed=seed,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), WEATHER_SCHEMA)
    r = client.chat.completions.create(
        model="x",
        messages=HI,
        max_tokens=ROOM,
        response_format={"type": "json_object"},
        extra_body={"logit_bias": {"125": -100}},  # (no early "}": an object with keys)
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    # llama-server's body fields on /completions: applied, never ignored
    c = client.completions.create(
        model="x", prompt="Answer:", max_tokens=ROOM, extra_body={"json_schema": WEATHER_SCHEMA}
    )
    jsonschema.validate(json.loads(c.choices[0].text), WEATHER_SCHEMA)
    g = client.completions.create(
        model="x", prompt="Answer:", max_tokens=10, extra_body={"grammar": 'root ::= "yes" | "no"'}
    )
    assert g.choices[0].text in ("yes", "no")


def test_tools_required_named_streamed_and_a_result_sent_back(hermes: Stack) -> None:
    client = hermes.client()
    r = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=HI,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=ROOM,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)

    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model="x",
        messages=HI,
        tools=[WEATHER],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=ROOM,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            assert chunk.usage is not None and chunk.usage.completion_tokens > 0
            continue
        d = chunk.choices[0].delta
        for t in d.tool_calls or ():
            entry = calls.setdefault(t.index, {"name": "", "arguments": "", "id": ""})
            entry["id"] = t.id or entry["id"]
            entry["name"] += (t.function.name or "") if t.function else ""
            entry["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_SCHEMA)

    # the call and its result in the history, then the model answers (tool_choice none)
    history = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    after = client.chat.completions.create(
        model="x", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert after.choices[0].finish_reason in ("stop", "length")
    assert not after.choices[0].message.tool_calls


def test_n_choices_whole_and_streamed(hermes: Stack) -> None:
    client = hermes.client()
    r = client.chat.completions.create(model="x", messages=HI, n=3, max_tokens=6, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # each its own seed
    seen: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model="x", messages=HI, n=2, max_tokens=6, stream=True
    ):
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
    assert set(seen) == {0, 1}


def test_embeddings_as_the_sdk_asks_for_them(hermes: Stack, generic: Stack) -> None:
    client = hermes.client()
    e = client.embeddings.create(model="text-embedding-3-small", input=["a red apple", "tea"])
    a, b = (d.embedding for d in e.data)
    assert len(a) == 64 and a != b and e.usage.prompt_tokens > 0
    again = client.embeddings.create(model="x", input="a red apple", encoding_format="float")
    assert again.data[0].embedding == pytest.approx(a, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model="x", input=[[1, 2, 3]])
    assert bad.value.param == "input"
    with pytest.raises(openai.APIStatusError) as off:
        generic.client().embeddings.create(model="x", input="hi")
    assert off.value.status_code == 501


def test_routes_without_v1_cors_and_the_api_key_as_x_api_key(stacks: Stacks) -> None:
    s = stacks.start(
        "rope", gateway={"api_key": "sesame", "cors_origins": ("https://app.example",)}
    )
    ok = {"Authorization": "Bearer sesame"}
    for path in ("/models", "/v1/models"):
        assert httpx.get(s.url + path, headers=ok).json()["data"][0]["id"] == "slotwise"
    body = {"model": "whatever", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{s.url}/chat/completions", json=body, headers=ok).status_code == 200
    r = httpx.post(f"{s.url}/chat/completions", json=body, headers={"x-api-key": "sesame"})
    assert r.status_code == 200
    assert httpx.post(f"{s.url}/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{s.url}/v1/messages", json={}, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    preflight = httpx.options(
        f"{s.url}/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(
        f"{s.url}/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers


# -- openai: the Responses API -----------------------------------------------------------------


def test_responses_whole_streamed_with_tools_formats_and_stored(hermes: Stack) -> None:
    client = hermes.client()
    r = client.responses.create(
        model="gpt-4o-mini",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,  # (the same reply every run: the tiny model's greedy one)
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": data_uri(image_bytes(64, 48, seed=3))},
                ],
            }
        ],
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert r.output_text and r.usage is not None and r.usage.output_tokens == 8
    again = client.responses.retrieve(r.id)
    assert (again.id, again.output_text, again.instructions) == (r.id, r.output_text, "Be brief.")

    # the chain goes on from its latest response: only the new input is decoded
    r2 = client.responses.create(
        model="x", input="And its colour?", previous_response_id=r.id, max_output_tokens=8
    )
    assert r2.previous_response_id == r.id and r2.usage is not None
    assert r2.usage.input_tokens_details.cached_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as stale:
        client.responses.create(model="x", input="again", previous_response_id=r.id)
    assert stale.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as changed:
        client.responses.create(
            model="x", input="again", previous_response_id=r2.id, instructions="Be long."
        )
    assert changed.value.param == "instructions"
    # instructions sent again are the chain's: kept once, by its first response, and shown
    r3 = client.responses.create(
        model="x",
        input="Again?",
        previous_response_id=r2.id,
        instructions="Be brief.",
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    assert client.responses.retrieve(r3.id).instructions == "Be brief."
    assert client.responses.retrieve(r2.id).instructions is None  # as OpenAI: not carried
    (lp,) = [c.logprobs for c in r3.output[0].content]  # type: ignore[union-attr]
    assert lp is not None and len(lp) == r3.usage.output_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 for t in lp)

    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather",
        "parameters": WEATHER_SCHEMA,
    }
    calling = client.responses.create(
        model="x", input="Weather?", tools=[tool], tool_choice="required", max_output_tokens=ROOM
    )
    (call,) = [o for o in calling.output if o.type == "function_call"][:1]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)

    def call_ids(r: Any) -> list[str]:
        return [o.call_id for o in r.output if o.type == "function_call"]

    assert call_ids(client.responses.retrieve(calling.id)) == call_ids(calling)
    for shown in (r, r3, calling, client.responses.retrieve(r3.id)):  # the SDK's types, strictly
        openai.types.responses.Response.model_validate(shown.model_dump(mode="json"))
    answered = client.responses.create(
        model="x",
        previous_response_id=calling.id,
        max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert answered.output_text is not None

    formatted = client.responses.create(
        model="x",
        input="Weather?",
        max_output_tokens=ROOM,
        store=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA}},
    )
    jsonschema.validate(json.loads(formatted.output_text), WEATHER_SCHEMA)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(formatted.id)  # not stored

    kinds = [
        e.type
        for e in client.responses.create(
            model="x", input="Stream it", max_output_tokens=6, stream=True, temperature=0
        )
    ]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]

    deleted = client.responses.delete(r2.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)  # the whole chain is its session: gone


def test_a_new_chain_whose_first_response_fails_leaves_no_session(hermes: Stack) -> None:
    from clients.client import SlotwiseClient

    addresses = (f"127.0.0.1:{hermes.prep_port}", f"127.0.0.1:{hermes.infer.port}")
    with SlotwiseClient(*addresses) as grpc_client:
        before = {s.session_id for s in grpc_client.list_sessions()}
        with pytest.raises(openai.BadRequestError) as refused:
            hermes.client().responses.create(model="x", input="word " * 9000, truncation="disabled")
        assert refused.value.code == "context_length_exceeded"
        wait_until(
            lambda: {s.session_id for s in grpc_client.list_sessions()} <= before,
            what="the failed chain's session to be deleted",
        )


def test_a_streamed_empty_reply_is_a_message_without_text() -> None:
    """What the SDK's event types accept, for a reply with neither text nor calls."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from clients.gateway.responses.api import Responses
    from clients.gateway.turns import TurnEnd

    async def events() -> Any:
        yield TurnEnd("", (), "", None, None)

    rid = f"resp_{'0' * 32}_1"
    api = Responses(None, None, "m")  # type: ignore[arg-type]

    async def stream() -> list[str]:
        shell = api._shell(None, rid, 0)
        return [chunk async for chunk in api._stream(events(), shell, rid, 0, False)]

    chunks = asyncio.run(stream())
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_json(c.partition("data: ")[2]) for c in chunks]
    assert [e.type for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert parsed[-1].response.output[0].content[0].text == ""


# -- anthropic ---------------------------------------------------------------------------------


def test_anthropic_messages_tools_streaming_count_and_errors(hermes: Stack) -> None:
    a = anthropic.Anthropic(base_url=hermes.url, api_key="unused", max_retries=0)
    png = base64.b64encode(image_bytes(64, 48, seed=5)).decode()
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is it?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": png},
                },
            ],
        },
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "Sure?"},
    ]
    m = a.messages.create(
        model="claude-x",
        max_tokens=12,
        system="Be brief.",
        messages=chat,
        stop_sequences=["\n\n\n"],
        extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20},
    )
    assert m.type == "message" and m.content[0].type == "text"
    assert m.stop_reason in ("max_tokens", "end_turn", "stop_sequence")
    counted = a.messages.count_tokens(model="x", system="Be brief.", messages=chat)
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

    tools = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER_SCHEMA}]
    called = a.messages.create(
        model="x",
        max_tokens=ROOM,
        tools=tools,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather?"}],
    )
    (use,) = [b for b in called.content if b.type == "tool_use"][:1]
    assert called.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    follow = a.messages.create(
        model="x",
        max_tokens=8,
        tools=tools,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [b.model_dump() for b in called.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert follow.stop_reason in ("max_tokens", "end_turn")

    with a.messages.stream(
        model="x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        assert s.get_final_message().content[0].type == "text"
    with a.messages.stream(
        model="x",
        max_tokens=ROOM,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as s:
        final = s.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]  # one: parallel is off
    jsonschema.validate(streamed.input, WEATHER_SCHEMA)

    with pytest.raises(anthropic.BadRequestError) as bad:
        a.messages.create(model="x", max_tokens=8, messages=[])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(
            model="x",
            max_tokens=8,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "hi"}],
        )


# -- frameworks ----------------------------------------------------------------------------------


def test_langchain_invoke_stream_images_and_structured_output(hermes: Stack) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{hermes.url}/v1",
        api_key="unused",
        model="gpt-4o-mini",
        max_tokens=ROOM,
        max_retries=0,
    )
    assert isinstance(llm.bind(max_tokens=8).invoke("hi").content, str)
    assert len(list(llm.bind(max_tokens=8).stream("hi"))) > 1
    picture = HumanMessage(
        content=[
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": data_uri(image_bytes(64, 48, seed=7))}},
        ]
    )
    assert llm.bind(max_tokens=4).invoke([picture]).usage_metadata["input_tokens"] > 8
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Name a city")
        assert isinstance(city, City), method


def test_instructor_json_schema_and_tools_modes(hermes: Stack) -> None:
    import instructor

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(hermes.client(), mode=mode)
        city = client.chat.completions.create(
            model="gpt-4o-mini",
            response_model=City,
            max_retries=0,
            max_tokens=ROOM,
            messages=[{"role": "user", "content": "Name a city"}],
        )
        assert isinstance(city, City), mode


def test_a_pydantic_ai_agent_calls_a_tool_and_gets_its_result_back(generic: Stack) -> None:
    """The generic (JSON) format: the reply is {"tool_calls": ...} or {"response": ...}; the
    bias on "t" makes the random model take the first, once; the tool then leaves."""
    from pydantic_ai import Agent, RunContext, Tool
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []

    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def until_called(ctx: RunContext, tool_def: Any) -> Any:
        done = any(isinstance(p, ToolReturnPart) for m in ctx.messages for p in m.parts)
        return None if done else tool_def

    provider = OpenAIProvider(base_url=f"{generic.url}/v1", api_key="unused")
    agent = Agent(
        OpenAIChatModel("gpt-4o-mini", provider=provider),
        tools=[Tool(get_weather, prepare=until_called)],
        model_settings={"logit_bias": {str(ord("t")): 100}, "max_tokens": 200},
    )
    result = agent.run_sync("What is the weather in Oslo?")
    parts = [type(p).__name__ for m in result.all_messages() for p in m.parts]
    assert calls and calls[0] in ("Oslo", "Lima")
    assert parts.index("ToolCallPart") < parts.index("ToolReturnPart") < parts.index("TextPart")
    assert isinstance(result.output, str)


def test_an_openai_agents_agent_with_a_function_tool(hermes: Stack) -> None:
    """Agents use the Responses API; tool_choice required for the first step (the SDK resets
    it after a call), so the agent calls the tool, gets its result and answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{hermes.url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="gpt-4o-mini", openai_client=client),
        # the answer after the call is the random model's free text, which must end by itself
        # (the SDK refuses an incomplete response): room for its end-of-text to come (ROOM's
        # 400 tokens were once too few, in a CI run with a busy loop beside it)
        model_settings=ModelSettings(tool_choice="required", max_tokens=5 * ROOM),
    )

    async def run() -> Any:
        try:
            # (after the first, required call the random model picks freely, another call
            # included: turns enough that it ends by itself in all but a vanishing share of runs)
            return await Runner.run(agent, "What is the weather in Oslo?", max_turns=10)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls and calls[0] in ("Oslo", "Lima")
    assert isinstance(result.final_output, str)


def test_the_llm_cli(hermes: Stack, tmp_path: Path) -> None:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f'- model_id: slotwise\n  model_name: gpt-4o-mini\n  api_base: "{hermes.url}/v1"\n'
    )
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"}
    llm = str(Path(sys.executable).parent / "llm")
    for extra in ([], ["--no-stream"]):
        out = subprocess.run(
            [llm, "-m", "slotwise", "Say hello", "-o", "max_tokens", "6", *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()


def test_the_scenario_table_runs_and_every_scenario_works_here(hermes: Stack) -> None:
    """benchmarks/client_scenarios.py, the table of the issue, on the tiny model."""
    from benchmarks.client_scenarios import run

    results = run(hermes.url)
    assert len(results) == 13
    assert all(r == "ok" or r.startswith("ok ") for r in results.values()), results


@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ("/v1/responses", {"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ("/v1/responses", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
        (
            "/v1/responses",
            {"input": "hi", "text": {"format": {"type": "json_schema"}}},
            "text.format.schema",
        ),
        ("/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            "/v1/responses",
            {"input": "hi", "previous_response_id": "resp_nope"},
            "previous_response_id",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 9},
            },
            "thinking",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "x", "type": "web_search_20250305"}],
            },
            "tools.0",
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            "messages.0.content.0.type",
        ),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            "/v1/chat/completions",
            {
                "messages": HI,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "no"}},
            },
            "not among the tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tool name",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                    },
                },
            },
            '"param": "response_format"',
        ),
        ("/v1/embeddings", {"input": [[1, 2]]}, "input"),
    ],
)
def test_bad_input_for_every_new_field_is_a_400_naming_it(hermes: Stack, path, body, names):
    r = httpx.post(hermes.url + path, json={"model": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    said = json.dumps(error)
    assert names in said, said
    # and the server goes on serving
    ok = httpx.post(
        f"{hermes.url}/v1/chat/completions",
        timeout=60,
        json={"model": "x", "messages": HI, "max_tokens": 2},
    )
    assert ok.status_code == 200
