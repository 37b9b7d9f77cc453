"""Chat messages -> prompt text, one piece per message, with the model's own Jinja template."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(ValueError):
    """The chat template refused the conversation (e.g. roles in an order it does not accept)."""


@dataclass(frozen=True)
class TemplateMessage:
    """One message as the chat template is given it (`as_message`): a chat message's text with
    its media markers, and its tool calls and results in the template's own form."""

    role: str
    content: str  # text with media markers where the images go
    tool_calls: tuple[dict[str, Any], ...] = ()  # assistant: as templates read them
    tool_call_id: str = ""  # tool: the call it answers
    name: str = ""  # tool: the function

    def as_message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name:
            m["name"] = self.name
        return m


Tools = list[dict[str, Any]] | None  # OpenAI's shape, what templates read as `tools`


_FOLD = ("\ue000slotwise-folded\ue001", "\ue000slotwise-next\ue001")  # sentinels (private use)


class _Template:
    source: str | None = None  # a Jinja template's text (its tool format is read from it)

    def render(
        self, turns: Sequence[TemplateMessage], *, add_generation_prompt: bool, tools: Tools = None
    ) -> str:
        raise NotImplementedError

    def pieces(
        self, turns: Sequence[TemplateMessage], tools: Tools = None
    ) -> tuple[list[str], list[int]]:
        """The rendered conversation cut at message boundaries, and who holds each message.

        Piece i is what message i adds to the prompt; the last piece is the generation prompt.
        A cut the template refuses (Llama 3.2 puts tools into the first user message: the
        system message alone fails), or one that the whole rendering does not begin with (a
        template that moves text, like Mistral's tools before the last user message), is no
        boundary: its messages' text goes with the next boundary's message, which holds them
        (holders[i]). The last message holds what has no boundary after it.
        """
        full = self.render(turns, add_generation_prompt=True, tools=tools)
        n = len(turns)
        pieces = [""] * (n + 1)
        holders = list(range(n))
        done, group = "", []
        for i in range(n):
            group.append(i)
            try:
                cut = self.render(turns[: i + 1], add_generation_prompt=False, tools=tools)
            except TemplateError:
                continue
            if cut.startswith(done) and full.startswith(cut):
                pieces[i], done = cut[len(done) :], cut
                for j in group:
                    holders[j] = i
                group = []
        if group:  # no boundary after them: the last message holds them and the rest
            pieces[n - 1] += full[len(done) :]
            for j in group:
                holders[j] = n - 1
        else:
            pieces[n] = full[len(done) :]
        for i in range(n - 1):
            self._unfold(turns, pieces, holders, i, tools)
        return pieces, holders

    def _unfold(
        self,
        turns: Sequence[TemplateMessage],
        pieces: list[str],
        holders: list[int],
        i: int,
        tools: Tools,
    ) -> None:
        """Message i, when the template folds its text into the next message's turn (Gemma
        writes the system message at the start of the first user turn), gets that text back
        (up to the separator the template puts after it). Then it can be pinned, and shared,
        apart from the turn it was folded into. The fold is checked by rendering the two
        messages with sentinels for their contents: where the template put them, and what it
        wrote between them; anything else is left as it was."""
        content, piece = turns[i].content, pieces[i + 1]
        if holders[i] != i or holders[i + 1] != i + 1 or not content or not turns[i + 1].content:
            return
        marked = [*turns[:i], replace(turns[i], content=_FOLD[0]),
                  replace(turns[i + 1], content=_FOLD[1])]  # fmt: skip
        try:
            text = self.render(marked, add_generation_prompt=False, tools=tools)
        except TemplateError:
            return
        own = "".join(pieces[: i + 1])
        a, b = text.find(_FOLD[0]), text.find(_FOLD[1])
        if a < len(own) or b < a or text.count(_FOLD[0]) != 1 or text.count(_FOLD[1]) != 1:
            return  # (its own turn holds it, or the template moved or copied it)
        before, between = text[len(own) : a], text[a + len(_FOLD[0]) : b]
        if not text.startswith(own) or not piece.startswith(before):
            return
        for shown in (content, content.strip()):  # (a template may trim it)
            end = len(before) + len(shown)
            if shown and piece[len(before) : end] == shown and piece[end:].startswith(between):
                end += len(between)
                if end < len(piece):
                    pieces[i], pieces[i + 1] = pieces[i] + piece[:end], piece[end:]
                return


class ChatTemplate(_Template):
    """A Jinja chat template (the model's own, or a file given with --chat-template)."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str):
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.source = source
        self._bos = bos_token
        self._eos = eos_token

    def render(
        self, turns: Sequence[TemplateMessage], *, add_generation_prompt: bool, tools: Tools = None
    ) -> str:
        extra = {"tools": tools} if tools else {}  # (absent, as without tools: `is defined`)
        try:
            return self._template.render(
                messages=[t.as_message() for t in turns],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                **extra,
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None


class BuiltinTemplate(_Template):
    """One of llama.cpp's built-in templates by name (`llama_chat_apply_template`), as
    llama-server's --chat-template takes them: chatml, gemma, llama3, mistral-v7, ..."""

    def __init__(self, name: str):
        names = builtin_template_names()
        if name not in names:
            raise ValueError(
                f"unknown chat template {name!r}: give a Jinja file or one of {', '.join(names)}"
            )
        self.name = name

    def render(
        self, turns: Sequence[TemplateMessage], *, add_generation_prompt: bool, tools: Tools = None
    ) -> str:
        assert not tools, "built-in templates show no tools (prep_service.tools writes them)"
        roles = [t.role.encode() for t in turns]
        contents = [t.content.encode() for t in turns]
        chat = (llama_cpp.llama_chat_message * max(1, len(turns)))()
        for i in range(len(turns)):
            chat[i].role, chat[i].content = roles[i], contents[i]
        size = 4 * sum(len(c) for c in contents) + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(
                self.name.encode(), chat, len(turns), add_generation_prompt, buf, size
            )
            if n < 0:
                raise TemplateError(f"chat template {self.name!r} refused the conversation")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise TemplateError(f"chat template {self.name!r}: output kept growing")


def builtin_template_names() -> list[str]:
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    out = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(out, n)
    return sorted(x.decode() for x in out if x)


def load_template(
    spec: str | None, model_source: str | None, *, bos_token: str, eos_token: str
) -> _Template | None:
    """--chat-template (a Jinja file, or a built-in name), else the model's own, else None."""
    if spec is None:
        if not model_source:
            return None
        return ChatTemplate(model_source, bos_token=bos_token, eos_token=eos_token)
    path = Path(spec)
    if path.is_file():
        return ChatTemplate(path.read_text(), bos_token=bos_token, eos_token=eos_token)
    return BuiltinTemplate(spec)


def _raise(message: str) -> None:
    raise TemplateError(message)
