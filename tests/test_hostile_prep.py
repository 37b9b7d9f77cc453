"""Hostile callers at prep (issue 43), over gRPC against a real prep server on the tiny `rope`
pair: a chat's messages are counted before its template renders any (--max-messages), and the
renderer's cost grows with their number, not its square (one-word messages: 4,000 took 13-20 s
of prep, 20,000 over 110 s); a long conversation's pieces, learnt from a few renderings, are
the pieces every prefix's rendering gives (every template the tests carry, llama.cpp's
built-in ones, tools and system messages); many texts are tokenized in one call, each as
Tokenize does it, their number bounded; Tokenize refuses a text past its max_tokens before
sending a token back.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status

from prep_service import chat as chat_module
from prep_service.chat import (
    BuiltinTemplate,
    ChatTemplate,
    TemplateError,
    TemplateMessage,
    builtin_template_names,
)
from slotwise.v1 import prep_pb2, prep_pb2_grpc
from slotwise_core.limits import DEFAULT_MAX_MESSAGES, MAX_TOKENIZE_TEXTS
from slotwise_core.tiny_models import CHAT_TEMPLATE
from support.rpc import message, rpc_error

TEMPLATES = Path(__file__).resolve().parent / "templates"


@pytest.fixture(scope="module")
def prep(prep_servers: Callable[[str], int]) -> Iterator[prep_pb2_grpc.PrepServiceStub]:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{prep_servers('rope')}", options=options) as ch:
        yield prep_pb2_grpc.PrepServiceStub(ch)


def one_word_chat(n: int) -> prep_pb2.PrepareRequest:
    messages = [message(("user", "assistant")[i % 2], f"w{i}") for i in range(n)]
    return prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=messages))


# -- messages per chat, and what rendering them costs ------------------------------------------


def test_a_chat_past_max_messages_is_refused_before_it_is_rendered(
    prep: prep_pb2_grpc.PrepServiceStub,
) -> None:
    n = DEFAULT_MAX_MESSAGES + 1
    e = rpc_error(lambda: prep.Prepare(one_word_chat(n), timeout=60))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(f"{n} messages in one request: at most {n - 1}")
    count = prep_pb2.CountTokensRequest(chat=one_word_chat(n).chat)
    assert rpc_error(lambda: prep.CountTokens(count, timeout=60)).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_4000_one_word_messages_keep_their_pieces(prep: prep_pb2_grpc.PrepServiceStub) -> None:
    """Every message keeps its own piece (message_index), as with a short chat."""
    got = prep.Prepare(one_word_chat(4000), timeout=120)
    indexes = sorted({c.message_index for c in got.prompt.chunks})
    assert indexes == list(range(4001))  # (4,000 messages and the generation prompt)
    assert got.rendered_text.count("<|im_start|>") == 4001


def test_a_long_chat_s_pieces_cost_renderings_in_proportion_to_its_length() -> None:
    """The messages the template renders to cut 4,000 of them: a few whole renderings, not one
    per prefix (8 million messages rendered: 13-20 s)."""
    rendered: list[int] = []

    class Counting(ChatTemplate):
        def render(self, turns: Any, **kwargs: Any) -> str:
            rendered.append(len(turns))
            return super().render(turns, **kwargs)

    turns = [TemplateMessage("user" if i % 2 == 0 else "assistant", f"w{i}") for i in range(4000)]
    pieces, _ = Counting(CHAT_TEMPLATE, bos_token="", eos_token="").pieces(turns)
    assert len(pieces) == 4001 and all(pieces)
    assert sum(rendered) <= 20 * len(turns), sum(rendered)


def templates() -> Iterator[tuple[str, Any]]:
    yield "tiny", ChatTemplate(CHAT_TEMPLATE, bos_token="", eos_token="")
    for f in sorted(TEMPLATES.glob("*.jinja")):
        yield f.stem, ChatTemplate(f.read_text(), bos_token="<s>", eos_token="</s>")
    for name in builtin_template_names():
        yield name, BuiltinTemplate(name)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


def conversation(rng: random.Random, n: int, *, system: bool, calls: bool) -> list[TemplateMessage]:
    """n turns of one-word (or padded, or repeated, or role-named) messages; with calls, some
    assistant turns are a tool call and its result."""
    words = ["hi", "a", " padded ", "hello there", "user", "assistant", "\n", "w{}"]
    out = [TemplateMessage("system", rng.choice(["Be brief.", " padded "]))] if system else []
    for i in range(n):
        role = ("user", "assistant")[i % 2]
        if calls and role == "assistant" and rng.random() < 0.4:
            call = {"id": f"call{i:05d}", "type": "function",
                    "function": {"name": "f", "arguments": {"x": i}}}  # fmt: skip
            out.append(TemplateMessage("assistant", "", (call,)))
            out.append(TemplateMessage("tool", f"result {i}", tool_call_id=call["id"], name="f"))
        else:
            out.append(TemplateMessage(role, rng.choice(words).format(i)))
    return out


def test_long_conversations_are_cut_as_every_prefix_s_rendering_cuts_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pieces learnt from a few renderings (_Cuts, past EXACT_PIECES messages) are those
    that rendering every prefix gives, for each template and kind of conversation: system
    messages folded (Gemma), moved (Mistral), refused alone (Llama 3.2 with tools), trimmed
    contents, tool calls and results."""
    rng = random.Random(43)
    compared = 0
    for name, template in templates():
        jinja = isinstance(template, ChatTemplate)
        for system, calls, tools in ((True, False, None), (False, jinja, TOOLS if jinja else None)):
            turns = conversation(rng, rng.randint(70, 110), system=system, calls=calls)
            monkeypatch.setattr(chat_module, "EXACT_PIECES", 1 << 30)
            try:
                exact = template.pieces(turns, tools)
            except TemplateError:
                continue  # (a template that refuses the conversation: no pieces either way)
            monkeypatch.setattr(chat_module, "EXACT_PIECES", 0)
            assert template.pieces(turns, tools) == exact, (name, system, calls)
            compared += 1
    assert compared > 60


def test_past_the_rendering_bound_messages_are_held_by_a_later_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A template whose cuts cannot be learnt (Mistral's puts the system message into the
    last user turn) renders prefixes only within the bound, the latest first: the pieces
    still make the whole prompt, and the last messages keep their boundaries."""
    template = ChatTemplate(
        (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(),
        bos_token="<s>", eos_token="</s>",
    )  # fmt: skip
    turns = conversation(random.Random(7), 300, system=True, calls=False)
    monkeypatch.setattr(chat_module, "EXACT_PIECES", 1 << 30)
    exact = template.pieces(turns)
    monkeypatch.setattr(chat_module, "EXACT_PIECES", 0)
    monkeypatch.setattr(chat_module, "MAX_PREFIX_RENDERINGS", 2)
    monkeypatch.setattr(chat_module, "EXACT_MESSAGES", 2000)  # (about 7 prefixes of 300)
    pieces, holders = template.pieces(turns)
    assert "".join(pieces) == "".join(exact[0])
    assert holders == sorted(holders) and holders[-1] == len(turns) - 1
    assert (pieces[-3:], holders[-2:]) == (exact[0][-3:], exact[1][-2:])


# -- tokenizing many texts ---------------------------------------------------------------------


def test_many_texts_are_tokenized_in_one_call_as_one_by_one(
    prep: prep_pb2_grpc.PrepServiceStub,
) -> None:
    texts = [
        prep_pb2.TokenizeRequest(text=t, add_special=k % 2 == 0, parse_special=k % 3 == 0)
        for k, t in enumerate(["hello", "<|im_end|>", "", "á", "w1 w2", "<|im_start|>x"] * 5)
    ]
    batch = prep.TokenizeBatch(prep_pb2.TokenizeBatchRequest(texts=texts), timeout=30)
    assert [list(r.token_ids) for r in batch.texts] == [
        list(prep.Tokenize(t, timeout=30).token_ids) for t in texts
    ]
    many = prep_pb2.TokenizeBatchRequest(
        texts=[prep_pb2.TokenizeRequest(text="x")] * (MAX_TOKENIZE_TEXTS + 1)
    )
    e = rpc_error(lambda: prep.TokenizeBatch(many, timeout=60))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(f"{MAX_TOKENIZE_TEXTS + 1} texts in one call")


def test_tokenize_refuses_a_text_past_max_tokens(prep: prep_pb2_grpc.PrepServiceStub) -> None:
    request = prep_pb2.TokenizeRequest(text="x" * 101, max_tokens=100, with_pieces=True)
    e = rpc_error(lambda: prep.Tokenize(request, timeout=30))
    assert e.code() is grpc.StatusCode.OUT_OF_RANGE
    status = rpc_status.from_call(e)  # type: ignore[arg-type]
    assert status is not None and "TOO_MANY_TOKENS" in str(status.details)
    request.max_tokens = 101
    assert len(prep.Tokenize(request, timeout=30).pieces) == 101
