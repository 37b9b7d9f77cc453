"""Chat messages -> prompt text, one piece per message, with the model's own Jinja template."""

from __future__ import annotations

import copy
import ctypes
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
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
    # variables beside the messages (a request's chat_template_kwargs): with_context
    context: Mapping[str, Any] = MappingProxyType({})

    def with_context(self, context: Mapping[str, Any]) -> _Template:
        """This template, rendering with these variables too (a copy: templates are shared
        by the threads that prepare)."""
        if not context:
            return self
        other = copy.copy(self)
        other.context = MappingProxyType(dict(context))
        return other

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

        The cut after message i is the rendering of messages[:i + 1]; a long conversation
        learns most of them from one rendering instead (`_Cuts`), so that their cost grows
        with the number of messages, not with its square.
        """
        full = self.render(turns, add_generation_prompt=True, tools=tools)
        n = len(turns)
        cuts = _Cuts(self, turns, tools, full)
        pieces = [""] * (n + 1)
        holders = list(range(n))
        done, group = 0, []
        for i in range(n):
            group.append(i)
            cut = cuts.at(i)  # (a prefix of full, or None: both prefixes, a longer one goes on)
            if cut is not None and cut >= done:
                pieces[i], done = full[done:cut], cut
                for j in group:
                    holders[j] = i
                group = []
        if group:  # no boundary after them: the last message holds them and the rest
            pieces[n - 1] += full[done:]
            for j in group:
                holders[j] = n - 1
        else:
            pieces[n] = full[done:]
        # where each message's piece ends (an unfold of message i moves text from piece i + 1
        # to piece i: the ends after i stay where they were)
        ends = list(itertools.accumulate(map(len, pieces)))
        for i in range(n - 1):
            if cuts.may_fold(i, pieces[i + 1], ends[i]):
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


# A conversation of at most this many messages renders every prefix (exact, and cheap: 64
# prefixes of at most 64 messages); a longer one learns its cuts (_Cuts).
EXACT_PIECES = 64
# Messages rendered in prefixes, all of one conversation's together, beyond the three whole
# renderings a long one costs: as many as this many whole renderings hold (a template can take
# 30 us a message: Mistral's), or EXACT_MESSAGES, whichever is more. Past it, a cut that could
# not be learnt is no boundary (its message goes with the next boundary's).
MAX_PREFIX_RENDERINGS = 16
EXACT_MESSAGES = 1 << 15  # (every prefix of 256 messages)
_MARK = re.compile("\ue000slotwise-([0-9]+)\ue001")


class _Cuts:
    """Where the rendering of messages[:i + 1] ends in the whole one, for every i.

    At most EXACT_PIECES messages: each prefix rendered, as the definition says. More: the
    conversation is rendered once more with a sentinel for each message's content, which says
    where every content is and what the template wrote between two of them (the gap). The cut
    in the gap after message i, for a pair of roles (role i, role i + 1), is learnt from the
    first such pair's exact rendering: what follows the cut there (the next turn's header) is
    where the cut is in every other gap that ends with it. The last pair of each kind is
    rendered exactly too, to check what was learnt; a kind that fails is rendered exactly for
    each of its pairs, the latest first (a session continues at the end), within the bound
    above. A template that moves, copies or changes a message's content (but for trimming it)
    learns nothing: every cut is rendered, within the same bound.
    tests/test_hostile_prep.py checks the learnt cuts against the exact ones.
    """

    def __init__(
        self, template: _Template, turns: Sequence[TemplateMessage], tools: Tools, full: str
    ):
        self.template, self.turns, self.tools, self.full = template, turns, tools, full
        self.n = len(turns)
        self.budget = max(MAX_PREFIX_RENDERINGS * self.n, EXACT_MESSAGES)
        self.exact: dict[int, int | None] = {}
        self.learnt: dict[int, int | None] = {}
        self.contents: list[tuple[int, int]] | None = None  # (start, end) of each, learnt
        if self.n > EXACT_PIECES:
            self._learn()

    def at(self, i: int) -> int | None:
        """The cut after message i: the length of the prefix's rendering when the whole one
        begins with it, else None (no boundary)."""
        if self.n <= EXACT_PIECES:
            return self._render(i)
        if i in self.learnt:
            return self.learnt[i]
        return self.exact.get(i)

    def may_fold(self, i: int, next_piece: str, end: int) -> bool:
        """Whether message i's content may have been folded into the next piece (_unfold then
        renders to see): in a long conversation, only if that piece shows it, its content is
        not where its own piece ends (`end`) or before, and within the bound on rendering."""
        if self.n <= EXACT_PIECES:
            return True
        content = self.turns[i].content
        shown = any(c and c in next_piece for c in (content, content.strip()))
        if not shown or self.budget < i + 2:
            return False
        if self.contents is not None and self.contents[i][1] <= end:
            return False
        self.budget -= i + 2
        return True

    def _render(self, i: int) -> int | None:
        try:
            cut = self.template.render(
                self.turns[: i + 1], add_generation_prompt=False, tools=self.tools
            )
        except TemplateError:
            return None
        return len(cut) if self.full.startswith(cut) else None

    def _exactly(self, i: int) -> int | None:
        """The exact cut, within the bound (past it: None, no boundary)."""
        if i not in self.exact:
            if self.budget < i + 1:
                return None
            self.budget -= i + 1
            self.exact[i] = self._render(i)
        return self.exact[i]

    def _learn(self) -> None:
        whole = self.template.render(self.turns, add_generation_prompt=False, tools=self.tools)
        common = _common_prefix(whole, self.full)
        self.learnt[self.n - 1] = len(whole) if common == len(whole) else None
        self.contents = self._locate(whole)
        kinds: dict[tuple[str, str], list[int]] = {}
        for i in range(self.n - 1):
            kinds.setdefault((self.turns[i].role, self.turns[i + 1].role), []).append(i)
        rest: list[int] = []
        for pairs in kinds.values():
            header = self._header(pairs, whole)
            for i in pairs:
                cut = self._cut(i, header, whole)
                if cut is None:
                    rest.append(i)
                else:
                    self.learnt[i] = cut if cut <= common else None
        for i in sorted(rest, reverse=True):  # (the latest first: a session continues there)
            self.learnt[i] = self._exactly(i)

    def _locate(self, whole: str) -> list[tuple[int, int]] | None:
        """Where each message's content is in the whole rendering, from one rendering with a
        sentinel for each content; None when the template does more with a content than write
        it, or trim it, once and in order."""
        marked = [replace(t, content=f"\ue000slotwise-{i}\ue001") for i, t in enumerate(self.turns)]
        try:
            text = self.template.render(marked, add_generation_prompt=False, tools=self.tools)
        except TemplateError:
            return None
        found = list(_MARK.finditer(text))
        if [int(m.group(1)) for m in found] == list(range(self.n)):
            gaps = [text[a.end() : b.start()] for a, b in itertools.pairwise(found)]
            gaps = [text[: found[0].start()], *gaps, text[found[-1].end() :]]
            return _place(whole, [t.content for t in self.turns], gaps)
        return None

    def _header(self, pairs: list[int], whole: str) -> str | None:
        """What follows the cut in the gap after the first of these pairs (the next message's
        header), checked on the last of them; None when the cut is not in that gap."""
        if self.contents is None:
            return None
        first = pairs[0]
        cut = self._exactly(first)
        end, start = self.contents[first][1], self.contents[first + 1][0]
        if cut is None or not end <= cut <= start:
            return None
        header = whole[cut:start]
        last = pairs[-1]
        if last != first and self._exactly(last) != self._cut(last, header, whole):
            return None
        return header

    def _cut(self, i: int, header: str | None, whole: str) -> int | None:
        if header is None or self.contents is None:
            return None
        end, start = self.contents[i][1], self.contents[i + 1][0]
        cut = start - len(header)
        return cut if cut >= end and whole.startswith(header, cut) else None


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix (compared in C, a halving at a time)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid - 1)
    return lo


def _place(whole: str, contents: list[str], gaps: list[str]) -> list[tuple[int, int]] | None:
    """(start, end) of each content in `whole`, which is gaps[0] content[0] gaps[1] ...
    content[n - 1] gaps[n], each content as it is or trimmed; None when it is not."""
    if not whole.startswith(gaps[0]):
        return None
    at, out = len(gaps[0]), []
    for content, gap in zip(contents, gaps[1:], strict=True):
        for shown in (content, content.strip()):
            if whole.startswith(shown, at) and whole.startswith(gap, at + len(shown)):
                out.append((at, at + len(shown)))
                at += len(shown) + len(gap)
                break
        else:
            return None
    return out if at == len(whole) else None


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
        # enable_thinking as llama-server renders every template: true unless a request's
        # chat_template_kwargs say otherwise (prep_service/reasoning.py checks them)
        variables: dict[str, Any] = {"enable_thinking": True, **self.context}
        # today, as llama.cpp gives every template (Llama 3.x writes "Today Date: ...")
        now = datetime.now()
        variables = {"date_string": now.strftime("%d %b %Y"),
                     "datetime": now.strftime("%b %d %Y"), **variables}  # fmt: skip
        if tools:  # (absent, as without tools: `is defined`)
            variables["tools"] = tools
        try:
            return self._template.render(
                messages=[t.as_message() for t in turns],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                **variables,
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
