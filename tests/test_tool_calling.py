"""Tool calls per chat template family, over gRPC with the Python client.

Real templates (tests/templates/, copied from llama.cpp's models/templates/) on the tiny
mrope pair: the template shows the tools its own way, prep returns the grammar of that
template's call format, and even random weights then write a valid call, which
clients.tool_calls reads back. History with calls and tool results renders as the
template's own, or, for templates without tools, as the generic JSON form.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients.client import (
    Message,
    SlotwiseClient,
    SlotwiseError,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFormat,
    ToolOptions,
    collect,
)
from clients.tool_calls import ReplyStream, parse_reply
from slotwise_core.tiny_models import TinyPair, token_id
from support.loop import LoopThread

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = {  # --chat-template -> the format its model writes calls in
    str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"): ToolFormat.HERMES,
    str(TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja"): ToolFormat.LLAMA3,
    str(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja"): ToolFormat.MISTRAL,
    str(TEMPLATES / "google-gemma-2-2b-it.jinja"): ToolFormat.JSON,
    "gemma": ToolFormat.JSON,  # llama.cpp's built-in
    "chatml": ToolFormat.JSON,
}
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
ADD = Tool(
    "add",
    "Add two small numbers",
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)
SCHEMAS = {t.name: t.parameters for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def family(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Callable[[str], Any]]:
    """template -> a client on a prep server with that template and one shared infer server."""
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    pair = tiny["mrope"]
    infer = loop_thread.run(
        start_infer(RuntimeConfig(pair.model, pair.mmproj, ctx_size=8192, parallel=2, threads=1))
    )
    preps: dict[str, Any] = {}
    clients: list[SlotwiseClient] = []

    def client(template: str) -> SlotwiseClient:
        if template not in preps:
            preps[template] = loop_thread.run(
                start_prep(pair.model, pair.mmproj, threads=1, chat_template=template)
            )
        c = SlotwiseClient(f"127.0.0.1:{preps[template].port}", f"127.0.0.1:{infer.port}")
        clients.append(c)
        return c

    yield client
    for c in clients:
        c.close()
    for p in preps.values():
        loop_thread.run(p.stop(0))
    loop_thread.run(infer.stop(0))


def assert_valid(calls: tuple[ToolCall, ...], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.name in names and call.id
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("template", FAMILIES)
@pytest.mark.parametrize("seed", range(2))
def test_a_required_call_is_valid_in_every_template_family(family, template, seed) -> None:
    client = family(template)
    chat = [Message.user("What is the weather in Oslo?")]
    tools = ToolOptions((WEATHER, ADD), ToolChoice.REQUIRED)
    prepared = client.prepare(chat, tools=tools)
    assert prepared.tool_format is FAMILIES[template]
    assert "get_weather" in prepared.rendered_text  # shown to the model
    done = collect(
        client.generate(
            prepared,
            constraint=prepared.tool_constraint,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
    )
    reply = parse_reply(prepared.tool_format, done.text)
    assert_valid(reply.calls, {"get_weather", "add"})
    # the same text, streamed piece by piece, gives the same calls and shows no markup
    stream = ReplyStream(prepared.tool_format)
    shown = "".join(stream.push(piece) for piece in done.pieces)
    end = stream.finish()
    assert [(c.name, c.arguments) for c in end.calls] == [
        (c.name, c.arguments) for c in reply.calls
    ]
    assert (shown + end.content).strip() == reply.content.strip()


@pytest.mark.parametrize("template", list(FAMILIES)[:4])
def test_a_named_function_and_one_call_only(family, template) -> None:
    client = family(template)
    chat = [Message.user("add 2 and 3")]
    tools = ToolOptions((WEATHER, ADD), ToolChoice.FUNCTION, name="add", parallel=False)
    prepared = client.prepare(chat, tools=tools)
    done = collect(
        client.generate(prepared, constraint=prepared.tool_constraint, max_tokens=200, seed=3)
    )
    (call,) = parse_reply(prepared.tool_format, done.text).calls
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD.parameters)


@pytest.mark.parametrize("template", FAMILIES)
def test_history_with_calls_and_results_renders_in_the_templates_own_form(family, template):
    client = family(template)
    call = ToolCall("call_1", "get_weather", json.dumps({"city": "Paris", "days": 2}))
    chat = [
        Message.user("Weather in Paris?"),
        Message("assistant", (), tool_calls=[call]),
        Message.tool("call_1", "sunny, 21 C", name="get_weather"),
        Message.assistant("Sunny."),
        Message.user("And tomorrow?"),
    ]
    prepared = client.prepare(chat, tools=ToolOptions((WEATHER,)))
    text = prepared.rendered_text
    assert "sunny, 21 C" in text and "Paris" in text
    expect = {
        ToolFormat.HERMES: ("<tool_call>", "<tool_response>"),
        ToolFormat.LLAMA3: ('"parameters"', "ipython"),
        ToolFormat.MISTRAL: ("[TOOL_CALLS]", "[TOOL_RESULTS]"),
        ToolFormat.JSON: ('"tool_calls"', '"tool_response"'),
    }[FAMILIES[template]]
    for marker in expect:
        assert marker in text, (marker, text)
    # auto: the model may answer in text. The bias makes even random weights open a call
    # (the lazy grammar's trigger token; in the generic form, "tool_calls" over "response"),
    # so the grammar takes over from the trigger and the call reads back, every time
    opener = {
        ToolFormat.HERMES: "<tool_call>",
        ToolFormat.LLAMA3: "{",
        ToolFormat.MISTRAL: "[TOOL_CALLS]",
        ToolFormat.JSON: "t",
    }[FAMILIES[template]]
    done = collect(
        client.generate(
            prepared, constraint=prepared.tool_constraint, max_tokens=600, seed=1,
            logit_bias={token_id(opener): 100.0},
        )
    )  # fmt: skip
    reply = parse_reply(prepared.tool_format, done.text)
    assert_valid(reply.calls, {"get_weather"})


def test_bad_tools_are_refused_naming_what_is_wrong(family) -> None:
    client = family(str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    chat = [Message.user("hi")]
    cases = [
        (ToolOptions((Tool("bad name!", "", {}),)), "tool name"),
        (ToolOptions((WEATHER, WEATHER)), "twice"),
        (ToolOptions((WEATHER,), ToolChoice.FUNCTION, name="nope"), "not among the tools"),
        (ToolOptions((), ToolChoice.REQUIRED), "needs tools"),
    ]
    for tools, words in cases:
        with pytest.raises(SlotwiseError) as e:
            client.prepare(chat, tools=tools)
        assert e.value.code().name == "INVALID_ARGUMENT" and words in e.value.details()
    with pytest.raises(SlotwiseError) as e:
        client.prepare([Message("user", "hi", tool_calls=[ToolCall("x", "add", "{}")])])
    assert "only assistant messages" in e.value.details()
    with pytest.raises(SlotwiseError) as e:
        client.prepare([Message("assistant", (), tool_calls=[ToolCall("x", "add", "[1]")])])
    assert "JSON object" in e.value.details()


def test_results_of_parallel_calls_merge_for_a_template_that_insists_on_alternation(family):
    """Gemma's template refuses two user messages in a row; two tool results are two (the
    generic format shows results as user messages): they are rendered as one message, whose
    chunks belong to the first of them."""
    client = family(str(TEMPLATES / "google-gemma-2-2b-it.jinja"))
    calls = [
        ToolCall("c1", "get_weather", json.dumps({"city": "Oslo", "days": 1})),
        ToolCall("c2", "add", json.dumps({"a": 1, "b": 2})),
    ]
    chat = [
        Message.user("Weather in Oslo, and 1 + 2?"),
        Message("assistant", (), tool_calls=calls),
        Message.tool("c1", "snow", name="get_weather"),
        Message.tool("c2", "3", name="add"),
    ]
    prepared = client.prepare(chat, tools=ToolOptions((WEATHER, ADD)))
    assert prepared.rendered_text.count("<start_of_turn>user") == 2
    assert '"snow"' in prepared.rendered_text and '"3"' in prepared.rendered_text
    owners = {c.message_index for c in prepared.prompt.chunks}
    assert owners == {0, 1, 2, 4}  # message 3 is rendered with message 2; 4: the reply's start


def test_a_session_turn_never_resends_what_the_template_moved_before_it(family) -> None:
    """Llama 3.2 puts the tools into the first user message (the system message alone does
    not render): the two are one piece, and later turns still continue a session. Mistral
    puts them before the last user message: a turn after it would resend the conversation,
    so it is refused rather than appended twice."""
    chat = [
        Message.system("Be brief."),
        Message.user("Weather?"),
        Message.assistant("Which city?"),
        Message.user("Oslo."),
    ]
    tools = ToolOptions((WEATHER,))
    llama = family(str(TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja"))
    whole = llama.prepare(chat, tools=tools)
    assert {c.message_index for c in whole.prompt.chunks} >= {1, 2, 3}  # 0 is held by 1
    assert all(c.message_index != 0 for c in whole.prompt.chunks)
    turn = llama.prepare(chat, tools=tools, first_message=2)
    assert "Oslo" in turn.rendered_text and "Weather?" not in turn.rendered_text
    mistral = family(str(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja"))
    with pytest.raises(SlotwiseError) as e:
        mistral.prepare(chat, tools=tools, first_message=2)
    assert "cannot continue a session" in e.value.details()


def test_two_tools_with_definitions_of_one_name_keep_their_own(family) -> None:
    """pydantic writes $defs per model: two tools' `Unit` must stay two rules."""

    def with_unit(name: str, units: list[str]) -> Tool:
        return Tool(
            name,
            "",
            {
                "type": "object",
                "$defs": {"Unit": {"enum": units}},
                "properties": {"unit": {"$ref": "#/$defs/Unit"}},
                "required": ["unit"],
            },
        )

    client = family(str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    heat = with_unit("heat", ["celsius", "kelvin"])
    length = with_unit("length", ["metre", "foot"])
    for tool, units in ((heat, {"celsius", "kelvin"}), (length, {"metre", "foot"})):
        options = ToolOptions((heat, length), ToolChoice.FUNCTION, name=tool.name)
        prepared = client.prepare([Message.user("go")], tools=options)
        for seed in range(3):
            done = collect(
                client.generate(
                    prepared,
                    constraint=prepared.tool_constraint,
                    max_tokens=200,
                    seed=seed,
                    temperature=1.0,
                )
            )
            calls = parse_reply(prepared.tool_format, done.text).calls
            assert calls and all(json.loads(c.arguments)["unit"] in units for c in calls)


def test_a_schema_the_converter_cannot_follow_is_a_bad_request(family) -> None:
    client = family(str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    broken = Tool("broken", "", {"type": "object", "properties": {"x": {"$ref": "#/$defs/Nope"}}})
    with pytest.raises(SlotwiseError) as e:
        client.prepare([Message.user("go")], tools=ToolOptions((broken,), ToolChoice.REQUIRED))
    assert e.value.code().name == "INVALID_ARGUMENT" and "'broken'" in e.value.details()
    scalar = Tool("scalar", "", {"type": "string"})
    with pytest.raises(SlotwiseError) as e:
        client.prepare([Message.user("go")], tools=ToolOptions((scalar,)))
    assert "JSON Schema of an object" in e.value.details()


REPLIES = [
    (
        ToolFormat.HERMES,
        'Let me look. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    ),
    (ToolFormat.HERMES, "No call here, only a < and a <tool"),
    (
        ToolFormat.MISTRAL,
        'Sure[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}]',
    ),
    (ToolFormat.LLAMA3, '  {"name": "f", "parameters": {"a": 1}}'),
    (ToolFormat.LLAMA3, "Plain text, then {braces} later"),
    (ToolFormat.JSON, '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}'),
    (ToolFormat.JSON, '{"response": "hi"}'),
]


@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 80), max_size=12))
def test_a_streamed_reply_shows_what_the_whole_one_says_wherever_it_is_cut(reply, cuts) -> None:
    fmt, text = reply
    whole = parse_reply(fmt, text)
    bounds = [0, *sorted(c for c in cuts if c < len(text)), len(text)]
    stream = ReplyStream(fmt)
    shown = "".join(stream.push(text[a:b]) for a, b in itertools.pairwise(bounds))
    end = stream.finish()
    assert [(c.name, c.arguments) for c in end.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    assert (shown + end.content).strip() == whole.content.strip()
    assert not any(m in shown for m in ("<tool_call>", "[TOOL_CALLS]", '"name"'))
