"""Reasoning models over the HTTP APIs, with the real openai and anthropic clients: thoughts in
`reasoning_content` (streamed as their own deltas), Anthropic thinking blocks, Responses
reasoning items; budgets per request and per server; chat_template_kwargs.

On the `think` tiny pair, greedy, with the bytes the random weights would write as
unreadable text banned (and `</think>`, so that the budget ends the thought), every answer
is what llama-server answers to the same body on the same model, to the character (observed
with the vendored build: a budget of 5 gives `reasoning_content` "\\nAAAA" and the content
'%' after it; the "\\n" is what the generation prompt wrote after `<think>`, which the budget
counts too; with `reasoning_format` none the content begins with that `<think>\\n`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from clients.gateway.turns import Thinking
from slotwise_core.tiny_models import TinyPair, token_id
from support.http_stack import Stack, Stacks, stacks_fixture
from support.loop import LoopThread

END = token_id("</think>")
# what greedy random weights write, kept readable: no control bytes, no lone UTF-8 bytes
READABLE = {str(t): -100 for t in [*range(32), *range(128, 256)]}
NO_END = {**READABLE, str(END): -100}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stacks(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stacks]:
    yield from stacks_fixture(loop_thread, tiny, prep_servers)


@pytest.fixture(scope="module")
def think(stacks: Stacks) -> Stack:
    return stacks.start("think", parallel=2, ctx_size=2048)


def chat(stack: Stack, **body: Any) -> Any:
    extra = {k: body.pop(k) for k in list(body) if k not in ("max_tokens", "stream")}
    return stack.client().chat.completions.create(
        model="x", messages=HI, temperature=0, logit_bias=NO_END, extra_body=extra, **body
    )


def test_thoughts_go_to_reasoning_content_and_stream_as_their_own_deltas(think: Stack) -> None:
    reply = chat(think, max_tokens=10, reasoning_budget_tokens=4)
    message = reply.choices[0].message
    assert message.reasoning_content == "\nAAA"  # type: ignore[attr-defined]
    assert message.content == "%%%%%%"
    # the thoughts' tokens: 3 written, and the end (the prompt's "\n" is the prompt's)
    assert reply.usage is not None and reply.usage.completion_tokens == 10
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4  # type: ignore[union-attr]
    deltas = [
        c.choices[0].delta.model_dump(exclude_none=True)
        for c in chat(think, max_tokens=10, reasoning_budget_tokens=4, stream=True)
        if c.choices
    ]
    thoughts = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if d.get("content")]
    assert thoughts == ["\nA", "A", "A"] and content == ["%"] * 6
    assert not any("reasoning_content" in d and d.get("content") for d in deltas)
    # the thinking_budget_tokens spelling, and a thought the budget never ends
    same = chat(think, max_tokens=10, thinking_budget_tokens=4).choices[0].message
    assert same.reasoning_content == "\nAAA"  # type: ignore[attr-defined]
    endless = chat(think, max_tokens=10).choices[0].message
    assert endless.content == "" and endless.reasoning_content == "\n" + "A" * 10  # type: ignore[attr-defined]


def test_reasoning_format_none_leaves_the_thoughts_in_the_content(think: Stack) -> None:
    message = chat(think, max_tokens=10, reasoning_budget_tokens=4, reasoning_format="none")
    text = message.choices[0].message
    assert text.content == "<think>\nAAA</think>%%%%%%"
    assert getattr(text, "reasoning_content", None) is None
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in chat(think, max_tokens=10, reasoning_budget_tokens=4, reasoning_format="none",
                      stream=True)
        if c.choices
    )  # fmt: skip
    assert streamed == text.content


def test_template_kwargs_and_reasoning_effort_turn_thinking_off(think: Stack) -> None:
    for body in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        message = chat(think, max_tokens=6, **body).choices[0].message
        assert getattr(message, "reasoning_content", None) is None, body
        assert message.content == "A" * 6, body  # (the prompt closed an empty thought)
    prompt = httpx.post(
        f"{think.url}/apply-template",
        json={"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(openai.BadRequestError) as e:
        chat(think, max_tokens=2, chat_template_kwargs={"enable_thinking": "no"})
    assert "enable_thinking" in str(e.value)


def test_the_servers_flags_a_budget_with_its_message_and_thinking_off(stacks: Stacks) -> None:
    flags = stacks.start(
        "think", gateway={"thinking": Thinking(budget=4, message=" Enough.")}, ctx_size=1024
    )
    message = chat(flags, max_tokens=12).choices[0].message
    assert message.reasoning_content == "\nAAA Enough."  # type: ignore[attr-defined]
    # a request's own budget (-1: the server's) goes over the flag
    own = chat(flags, max_tokens=12, reasoning_budget_tokens=2).choices[0].message
    assert own.reasoning_content == "\nA Enough."  # type: ignore[attr-defined]
    assert chat(flags, max_tokens=12, reasoning_budget_tokens=-1).choices[0].message == message
    off = stacks.start(
        "think", gateway={"thinking": Thinking(kwargs={"enable_thinking": False})}, ctx_size=1024
    )
    assert getattr(chat(off, max_tokens=4).choices[0].message, "reasoning_content", None) is None


def test_anthropic_thinking_blocks_whole_and_streamed(stacks: Stacks) -> None:
    """The Messages API has no logit_bias: greedy thoughts are blank lines here, shown as
    thinking only with the budget's message after them (as llama-server shows them)."""
    stack = stacks.start("think", gateway={"thinking": Thinking(message=" Enough.")}, ctx_size=1024)
    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    body: dict[str, Any] = {
        "model": "claude-x",
        "max_tokens": 16,
        "messages": HI,
        "thinking": {"type": "enabled", "budget_tokens": 3},
        "extra_body": {"temperature": 0},
    }
    message = claude.messages.create(**body)
    kinds = [b.type for b in message.content]
    assert kinds == ["thinking", "text"]
    thinking = message.content[0]
    assert thinking.thinking == "\n\n\n Enough." and thinking.signature == ""  # type: ignore[union-attr]
    with claude.messages.stream(**body) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    # without a budget the thought runs to max_tokens: blank lines, shown as no block at all
    plain = claude.messages.create(**{**body, "thinking": {"type": "disabled"}})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == ""  # type: ignore[union-attr]


def test_responses_reasoning_items_stream_and_stored_chain(stacks: Stacks) -> None:
    """(No logit_bias in the Responses API: blank greedy thoughts, and the message.)"""
    stack = stacks.start("think", gateway={"thinking": Thinking(message=" Enough.")}, ctx_size=1024)
    client = stack.client()
    body: dict[str, Any] = {
        "model": "x",
        "input": "hi",
        "max_output_tokens": 16,
        "temperature": 0,
        "reasoning": {"effort": "low"},  # (llama-server gives it to the template)
        "extra_body": {"reasoning_budget_tokens": 3},
    }
    first = client.responses.create(**body)
    assert [o.type for o in first.output] == ["reasoning", "message"]
    thoughts = first.output[0].content[0].text  # type: ignore[union-attr, index]
    assert thoughts == "\n\n\n Enough."
    # 2 written, the message's 8 (a byte each here) and the end
    assert first.usage is not None and first.usage.output_tokens_details.reasoning_tokens == 11
    # GET shows it again, its thoughts apart
    again = client.responses.retrieve(first.id)
    assert [o.model_dump() for o in again.output] == [o.model_dump() for o in first.output]
    # streamed: a reasoning item (its text in deltas), then the message
    kinds, streamed = [], []
    for event in client.responses.create(**body, stream=True):
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            streamed.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert "".join(streamed) == thoughts and done.output_text == first.output_text
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # the chain goes on in its session: the reply as the model wrote it is reused
    second = client.responses.create(**{**body, "input": "and?", "previous_response_id": first.id})
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + 9


def test_asking_a_model_without_thoughts_for_them_is_refused(stacks: Stacks) -> None:
    stack = stacks.start("rope", ctx_size=1024)
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="x", messages=HI, max_tokens=2, extra_body={"reasoning_budget_tokens": 8}
        )
    assert e.value.body["param"] == "reasoning_budget_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input="hi", reasoning={"effort": "high"})
    assert e.value.body["param"] == "reasoning"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as a:
        claude.messages.create(
            model="x", max_tokens=2, messages=HI, thinking={"type": "enabled", "budget_tokens": 9}
        )
    assert "thinking" in str(a.value)
    # a format, and template variables, are no request for thoughts: the template takes them
    fine = client.chat.completions.create(
        model="x", messages=HI, max_tokens=2,
        extra_body={"reasoning_format": "deepseek", "chat_template_kwargs": {"x": 1}},
    )  # fmt: skip
    assert getattr(fine.choices[0].message, "reasoning_content", None) is None


def test_a_session_turn_that_sends_the_reply_back_without_its_thoughts_reuses_it(
    think: Stack,
) -> None:
    """A client keeps `content` and sends it back: the session holds the reply as the model
    wrote it, thoughts and all, and the turn repeats that (its cells reused)."""
    session = {"slotwise": {"session_id": "thinking-chat"}}
    first = chat(think, max_tokens=10, reasoning_budget_tokens=4, **session)
    reply = first.choices[0].message
    assert reply.reasoning_content == "\nAAA" and reply.content == "%%%%%%"  # type: ignore[attr-defined]
    turn = [*HI, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "?"}]
    second = think.client().chat.completions.create(
        model="x", messages=turn, max_tokens=4, temperature=0, logit_bias=NO_END,
        extra_body={**session, "reasoning_budget_tokens": 4},
    )  # fmt: skip
    assert second.usage is not None and first.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached == 9  # (a session turn's own): the reply, thoughts and all, but its last
