"""A reply's text -> its content and tool calls, in the template's tool format (the one
`Prepared.tool_format` names), whole or as it streams.

The grammar prep returns makes the calls valid, so parsing is exact; text a format does not
read as calls (a reply cut by max_tokens, say) stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from clients.enums import ToolFormat
from clients.types import ToolCall

__all__ = ["Reply", "ReplyStream", "parse_reply"]

# where calls begin in a reply that may also hold text
_MARKERS = {ToolFormat.HERMES: "<tool_call>", ToolFormat.MISTRAL: "[TOOL_CALLS]"}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Reply:
    content: str
    calls: tuple[ToolCall, ...] = ()


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: object, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    given = obj.get("id")
    return ToolCall(
        given if isinstance(given, str) and given else _new_id(),
        obj["name"],
        json.dumps(arguments, ensure_ascii=False),
    )


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_reply(fmt: ToolFormat, text: str) -> Reply:
    """The content and the calls of a whole reply."""
    if fmt is ToolFormat.HERMES:
        at = text.find("<tool_call>")
        if at < 0:
            return Reply(text)
        calls = [_call(_json(m.group(1))) for m in _HERMES_CALL.finditer(text, at)]
        if not calls or None in calls:
            return Reply(text)
        return Reply(text[:at].rstrip(), tuple(c for c in calls if c))
    if fmt is ToolFormat.MISTRAL:
        at = text.find("[TOOL_CALLS]")
        listed = _json(text[at + len("[TOOL_CALLS]") :]) if at >= 0 else None
        if not isinstance(listed, list) or not listed:
            return Reply(text)
        calls = [_call(x) for x in listed]
        if None in calls:
            return Reply(text)
        return Reply(text[:at].rstrip(), tuple(c for c in calls if c))
    if fmt is ToolFormat.LLAMA3:
        one = _call(_json(text.strip()), "parameters") if text.lstrip().startswith("{") else None
        return Reply("", (one,)) if one else Reply(text)
    if fmt is ToolFormat.JSON:
        obj = _json(text)
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            return Reply(obj["response"])
        listed = obj.get("tool_calls") if isinstance(obj, dict) else None
        if isinstance(listed, list) and listed:
            calls = [_call(x) for x in listed]
            if None not in calls:
                return Reply("", tuple(c for c in calls if c))
    return Reply(text)


class ReplyStream:
    """Content as it streams, held back only where calls may begin; the calls at the end.

    push(text) returns the content safe to show now; finish() returns the rest of the
    content and the calls. A JSON-format reply is one object: nothing shows until its end.
    """

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self._parts: list[str] = []  # the whole text, joined once at the end
        self._held = ""  # after what was shown: what may still begin a call
        self._num_shown = 0  # characters shown as content (always the text's beginning)
        self._calls_begin = False
        self._is_text = False  # (Llama 3) the reply began as text: no call follows

    def push(self, text: str) -> str:
        self._parts.append(text)
        if self._calls_begin or self.fmt is ToolFormat.JSON:
            return ""
        held = self._held + text
        if self.fmt is ToolFormat.LLAMA3 and not self._is_text:
            head = held.lstrip()
            if head.startswith("{"):
                self._calls_begin = True
            self._is_text = bool(head) and not self._calls_begin
            return self._show(held, len(held) if self._is_text else 0)
        marker = _MARKERS.get(self.fmt)
        if marker is None or self._is_text:
            return self._show(held, len(held))
        at = held.find(marker)
        if at >= 0:
            self._calls_begin = True
            return self._show(held, at)
        return self._show(held, len(held) - _partial(held, marker))

    def _show(self, held: str, n: int) -> str:
        self._held, self._num_shown = held[n:], self._num_shown + n
        return held[:n]

    def finish(self) -> Reply:
        text = "".join(self._parts)
        whole = parse_reply(self.fmt, text)
        shown = text[: self._num_shown]
        if not whole.calls:  # all of it is content: what was not shown yet
            if self.fmt is ToolFormat.JSON:
                return Reply(whole.content)
            return Reply(text[self._num_shown :])
        rest = whole.content[len(shown) :] if whole.content.startswith(shown) else ""
        return Reply(rest, whole.calls)


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
