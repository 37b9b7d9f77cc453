"""Tool calling per chat template: how the template shows tools and calls to the model, and
the grammar that makes the model's reply a valid call in that template's own format.

A template with a tool format of its own is given the tools (its `tools` variable) and the
calls in the history as it expects them; the reply is constrained to that format:

- HERMES (Qwen 2.5, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, each;
- LLAMA3 (Llama 3.x): `{"name": ..., "parameters": {...}}`;
- MISTRAL: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcdefghi"}, ...]`.

A template without one (Gemma's, llama.cpp's built-ins) gets the tools described in a system
message, calls in the history as JSON, tool results as user messages, and the reply is one
JSON object, {"tool_calls": [...]} or, when the model may answer in text, {"response": "..."}
(llama.cpp's generic format). Either way the grammar holds from the first token when a call
is required, and from its trigger when the model may answer in text.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from slotwise_core.json_grammar import json_schema_rules


class ToolFormat(enum.Enum):
    JSON = "json"
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


JSON = ToolFormat.JSON


class Choice(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    FUNCTION = "function"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments object


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Tools:
    """What a chat asks of the model's tool calls."""

    tools: tuple[Tool, ...]
    choice: Choice = Choice.AUTO
    name: str = ""  # Choice.FUNCTION
    parallel: bool | None = None  # several calls in one reply; None: as the format allows

    def parallel_in(self, fmt: ToolFormat) -> bool:
        """Unless asked, several calls only where the template's format has them (as
        llama-server decides): a small model given the generic form repeats its call until
        max_tokens cuts it."""
        if self.parallel is not None:
            return self.parallel
        return fmt in (ToolFormat.HERMES, ToolFormat.MISTRAL)

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice is Choice.FUNCTION:
            return tuple(t for t in self.tools if t.name == self.name)
        return self.tools

    @property
    def required(self) -> bool:
        return self.choice in (Choice.REQUIRED, Choice.FUNCTION)


@dataclass(frozen=True)
class Grammar:
    gbnf: str
    trigger_patterns: tuple[str, ...] = ()  # lazy: free text until one of them


_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_CALLS = 8  # in one reply


def check_tools(tools: Tools) -> None:
    """ValueError naming what is wrong (names, duplicates, the chosen function)."""
    seen = set()
    for t in tools.tools:
        if not _NAME.match(t.name):
            raise ValueError(f"tool name {t.name!r}: 1 to 64 of A-Z a-z 0-9 _ . -")
        if t.name in seen:
            raise ValueError(f"tool {t.name!r} is given twice")
        seen.add(t.name)
        if not isinstance(t.parameters, dict) or t.parameters.get("type", "object") != "object":
            raise ValueError(
                f"tool {t.name!r}: parameters must be a JSON Schema of an object (the arguments)"
            )
    if tools.choice is Choice.FUNCTION and tools.name not in seen:
        raise ValueError(f"tool_choice names {tools.name!r}, which is not among the tools")
    if tools.choice is not Choice.NONE and not tools.tools:
        raise ValueError("a tool choice other than none needs tools")


def template_format(source: str | None) -> ToolFormat:
    """The tool format a Jinja template's source writes (JSON when it has none we know)."""
    if not source or "tools" not in source:
        return ToolFormat.JSON
    if "<tool_call>" in source and "<function=" not in source:  # (Qwen3-Coder's are XML)
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in source:
        return ToolFormat.MISTRAL
    if "<|start_header_id|>" in source and '"parameters"' in source:
        return ToolFormat.LLAMA3
    return ToolFormat.JSON


# -- the prompt ---------------------------------------------------------------------------------


def template_tools(tools: Tools) -> list[dict[str, Any]]:
    """The tools as chat templates read them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools.tools
    ]


def call_id(fmt: ToolFormat, id: str) -> str:
    """Mistral's templates insist on ids of 9 letters and digits: any other id maps to one
    (the same each time, so a tool result still names its call)."""
    if fmt is not ToolFormat.MISTRAL or (len(id) == 9 and id.isalnum()):
        return id
    return hashlib.blake2b(id.encode(), digest_size=16).hexdigest()[:9]


def json_system_prompt(tools: Tools) -> str:
    """What a template without tools is told (the generic format's instructions)."""
    listed = json.dumps(
        [{"name": t.name, "description": t.description, "parameters": t.parameters}
         for t in tools.callable],
        ensure_ascii=False,
    )  # fmt: skip
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    if tools.required:
        how = f"Call tools: reply with one JSON object, {calls}."
    else:
        how = (
            f"Reply with one JSON object: {calls} to call tools, or "
            '{"response": "<your answer>"} to answer the user. Call a tool only for a result '
            "you do not have yet: once the tool_response you need is in the conversation, "
            "answer with it."
        )
    return f"You can call these tools (the JSON Schema of each one's arguments):\n{listed}\n{how}"


def json_call_text(calls: Sequence[ToolCall]) -> str:
    """An assistant message's calls, as the generic format writes them."""
    return json.dumps(
        {"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]},
        ensure_ascii=False,
    )


def json_result_text(name: str, call: str, content: str) -> str:
    """A tool's result, as the generic format shows it to the model (in a user message)."""
    return json.dumps(
        {"tool_response": {"name": name, "id": call, "content": content}}, ensure_ascii=False
    )


# -- the reply's grammar -------------------------------------------------------------------------


def grammar(fmt: ToolFormat, tools: Tools) -> Grammar:
    """The constraint on the reply: a valid call of one of tools.callable (or several, when
    parallel), lazy (from a trigger) when the model may answer in text instead."""
    callable_ = tools.callable
    defined, (text, *args) = json_schema_rules(
        [{"type": "string"}, *(_arguments_schema(t) for t in callable_)]
    )

    def call(arguments_key: str, extra: str = "") -> str:
        return " | ".join(
            f'( "{{" space "\\"name\\"" space ":" space "\\"{t.name}\\"" space "," space '
            f'"\\"{arguments_key}\\"" space ":" space {rule}{extra} "}}" space )'
            for t, rule in zip(callable_, args, strict=True)
        )

    parallel = tools.parallel_in(fmt)
    more = MAX_CALLS - 1  # (bounded: a reply that repeats its call ends all the same)

    def listed(item: str) -> str:
        return (
            f'"[" space {item} ' + (f'("," space {item}){{0,{more}}} ' if parallel else "") + '"]"'
        )

    triggers: tuple[str, ...] = ()
    if fmt is ToolFormat.HERMES:
        rules = {
            "call": call("arguments"),
            "tool-call": '"<tool_call>" "\\n"? call "\\n"? "</tool_call>" space',
            "root": "tool-call" + (f" tool-call{{0,{more}}}" if parallel else ""),
        }
        triggers = (r"(<tool_call>)",)
    elif fmt is ToolFormat.LLAMA3:
        rules = {"call": call("parameters"), "root": "call"}
        triggers = (r"^\s*(\{)",)
    elif fmt is ToolFormat.MISTRAL:
        rules = {
            "call": call("arguments", ' "," space "\\"id\\"" space ":" space call-id'),
            "call-id": '"\\"" [a-zA-Z0-9]{9} "\\"" space',
            "root": f'"[TOOL_CALLS]" {listed("call")} space',
        }
        triggers = (r"(\[TOOL_CALLS\])",)
    else:
        rules = {
            "call": call("arguments"),
            "calls": f'"{{" space "\\"tool_calls\\"" space ":" space {listed("call")} space '
            '"}" space',
            "response": f'"{{" space "\\"response\\"" space ":" space {text} "}}" space',
            "root": "calls" if tools.required else "calls | response",
        }
    lazy = triggers if not tools.required else ()
    ours = "".join(f"{k} ::= {v}\n" for k, v in rules.items())
    return Grammar(f"{defined.rstrip()}\n{ours}", lazy)


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.parameters or {"type": "object"}


def with_ids(calls: Sequence[ToolCall], fmt: ToolFormat) -> list[ToolCall]:
    return [replace(c, id=call_id(fmt, c.id)) for c in calls]
