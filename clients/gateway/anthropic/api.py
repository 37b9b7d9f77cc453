"""The Anthropic Messages API over slotwise: POST /v1/messages (streamed or not) and
/v1/messages/count_tokens (CountTokens: exact, images counted by their size).

Content blocks map onto the chat the templates render: text and base64 images, `tool_use`
blocks as an assistant message's calls, `tool_result` blocks as tool messages; the API has no
block for sound, and one of another type is refused naming it (`messages.N.content.M.type`,
with where sounds go). Errors come in
Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, Response

from clients.client import (
    AsyncSlotwiseClient,
    Constraint,
    Message,
    Started,
    Tool,
    ToolCall,
    ToolChoice,
    ToolOptions,
)
from clients.gateway import generation, sse
from clients.gateway.anthropic.schema import CountRequest, MessagesRequest
from clients.gateway.errors import ApiError, bad_request, call
from clients.gateway.media import MediaPolicy, check_images, image_bytes
from clients.gateway.turns import Text, Thinking, TurnEnd, TurnRequest, refuse, start_turn

# Anthropic's error types by HTTP status
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    501: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def error_response(e: ApiError) -> JSONResponse:
    body = {
        "type": "error",
        "error": {"type": _TYPES.get(e.status, "api_error"), "message": e.message},
    }
    headers = {"retry-after": str(max(1, round(e.retry_after)))} if e.retry_after else None
    return JSONResponse(body, status_code=e.status, headers=headers)


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(b.get("text", "") for b in system if b.get("type") == "text")


async def _messages(
    body: MessagesRequest | CountRequest, media: MediaPolicy, *, sizes: bool = False
) -> list[Message]:
    check_images((m.content for m in body.messages), media, "messages", image="image")
    out: list[Message] = []
    system = _system_text(body.system)
    if system:
        out.append(Message.system(system))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append(Message(m.role, m.content))
            continue
        parts: list[str | bytes] = []
        calls: list[ToolCall] = []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type")
            if kind == "text":
                parts.append(str(block.get("text", "")))
            elif kind == "image":
                parts.append(await _image(block.get("source") or {}, media, where))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(
                    ToolCall(
                        str(block.get("id", "")),
                        str(block.get("name", "")),
                        json.dumps(block.get("input") or {}),
                    )
                )
            elif kind == "tool_result" and m.role == "user":
                if parts or calls:  # what came before the result is a message of its own
                    out.append(Message(m.role, parts, tool_calls=calls))
                    parts, calls = [], []
                content = block.get("content")
                text = (
                    content
                    if isinstance(content, str)
                    else "".join(
                        c.get("text", "") for c in content or () if c.get("type") == "text"
                    )
                )
                if block.get("is_error"):
                    text = f"(error) {text}"
                out.append(Message.tool(str(block.get("tool_use_id", "")), text))
            elif kind == "thinking" or kind == "redacted_thinking":
                continue  # (a reply's thoughts: templates leave them out of the history)
            elif kind in ("audio", "input_audio"):  # (a block the Messages API does not have)
                raise refuse(f"{where}.type", _NO_AUDIO)
            else:
                raise refuse(f"{where}.type", f"{kind!r} is not a content block served here")
        if parts or calls:
            out.append(Message(m.role, parts or (), tool_calls=calls))
    return out


_NO_AUDIO = (
    "is not a content block of the Messages API (it has none for sound): send sounds as "
    "input_audio parts to /v1/chat/completions"
)


async def _image(source: dict[str, Any], media: MediaPolicy, where: str) -> bytes:
    kind = source.get("type")
    if kind == "base64":
        data = str(source.get("data", ""))
        if len(data) > media.max_bytes * 4 // 3 + 4:
            raise bad_request(f"{where}: the image is over {media.max_bytes} bytes", where)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}: the image is not valid base64", where) from None
    if kind == "url":
        return await image_bytes(str(source.get("url", "")), media, where)
    raise refuse(f"{where}.source.type", f"{kind!r} is not an image source served here")


_CHOICES = {"auto": ToolChoice.AUTO, "none": ToolChoice.NONE, "any": ToolChoice.REQUIRED}


def _tools(body: MessagesRequest | CountRequest) -> ToolOptions | None:
    for i, t in enumerate(body.tools or ()):
        if t.type not in (None, "custom"):
            raise refuse(f"tools.{i}", f"{t.type!r} (a server tool) is not served here")
    defs = [Tool(t.name, t.description, t.input_schema) for t in body.tools or ()]
    choice = body.tool_choice or {"type": "auto"}
    # (disabling is Anthropic's only say: else as the format allows)
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind, name = choice.get("type"), choice.get("name")
    if kind == "tool" and name:
        return generation.tool_options(
            defs, ToolChoice.FUNCTION, choice, name=str(name), parallel=parallel
        )
    known = _CHOICES.get(kind) if isinstance(kind, str) else None
    return generation.tool_options(defs, known, choice, parallel=parallel)


def _thinking(server: Thinking, body: MessagesRequest) -> Thinking:
    """`thinking`: enabled (with budget_tokens, 10,000 unless given, as llama-server takes it)
    asks a reasoning model for its thoughts, as thinking blocks, ended past the budget;
    disabled asks nothing (the template decides, as with llama-server). llama-server's
    chat_template_kwargs pass through."""
    extra = body.model_extra or {}
    passed = {k: extra[k] for k in ("chat_template_kwargs",) if k in extra}
    given = body.thinking
    if given is None or given == {"type": "disabled"}:
        return generation.thinking_of(server, passed)
    if not isinstance(given, dict) or given.get("type") != "enabled":
        raise refuse("thinking", "takes enabled (with budget_tokens) or disabled here")
    if set(given) - {"type", "budget_tokens"}:
        raise refuse("thinking", "takes only type and budget_tokens here")
    budget = generation.reasoning_budget(
        given.get("budget_tokens", 10_000), "thinking.budget_tokens"
    )
    return replace(generation.thinking_of(server, passed), budget=budget, asked="thinking")


class Messages:
    def __init__(
        self,
        client: AsyncSlotwiseClient,
        media: MediaPolicy,
        model: str,
        thinking: Thinking = Thinking(),
    ):
        self.client, self.media, self.model, self.thinking = client, media, model, thinking

    async def create(self, body: MessagesRequest) -> Response:
        thinking = _thinking(self.thinking, body)
        o = body.slotwise
        out = body.output_config or {}
        if out.get("effort") is not None or set(out) - {"effort", "format"}:
            raise refuse("output_config", "takes only format here")
        fmt = out.get("format")
        if fmt is not None and (fmt.get("type") != "json_schema" or "schema" not in fmt):
            raise bad_request(
                "output_config.format: a json_schema with its schema", "output_config.format"
            )
        req = TurnRequest(
            await _messages(body, self.media),
            max_tokens=body.max_tokens,
            stop=body.stop_sequences or (),
            sampling={"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k},
            context=generation.context_of(o),
            keep=generation.keep_of(o),
            tools=_tools(body),
            constraint=Constraint(json_schema=fmt["schema"]) if fmt is not None else None,
            constraint_param="output_config.format",
            session_id=o.session_id,
            cache_salt=o.cache_salt,
            speculative=generation.speculative_in(body),
            thinking=thinking,
        )
        turn, _ = await start_turn(self.client, req)
        mid = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return sse.response(self._stream(turn.events(), mid, turn.admitted))
        return JSONResponse(self._message(mid, await turn.whole()))

    async def count_tokens(self, body: CountRequest) -> dict[str, int]:
        messages = await _messages(body, self.media)
        counted = await call(self.client.count(messages, tools=_tools(body)))
        return {"input_tokens": counted.num_cells}

    def _message(self, mid: str, end: TurnEnd) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if end.reasoning is not None:  # (first, as Anthropic's; no signature here)
            content.append({"type": "thinking", "thinking": end.reasoning, "signature": ""})
        if end.content or not (end.calls or end.reasoning is not None):
            content.append({"type": "text", "text": end.content})
        content += [_tool_use(c) for c in end.calls]
        stop_reason, stop_sequence = _stop(end)
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(end),
        }

    async def _stream(
        self, events: AsyncIterator[Text | TurnEnd], mid: str, admitted: Started | None = None
    ) -> AsyncGenerator[str, None]:
        # the prompt's tokens are known at admission (llama-server's message_start has them)
        fresh = admitted.num_prompt_cells - admitted.num_reused_cells if admitted else 0
        start: dict[str, Any] = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": fresh, "output_tokens": 0},
        }
        yield sse.event("message_start", message=start)
        text_open = thinking_open = False
        index = 0
        try:
            async for e in events:
                if isinstance(e, Text) and e.reasoning:
                    if not thinking_open:
                        opening = {"type": "thinking", "thinking": "", "signature": ""}
                        yield sse.event("content_block_start", index=index, content_block=opening)
                        thinking_open = True
                    yield sse.event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "thinking_delta", "thinking": e.reasoning},
                    )
                if thinking_open and (not isinstance(e, Text) or e.text):
                    yield sse.event("content_block_stop", index=index)
                    index += 1
                    thinking_open = False
                if isinstance(e, Text):
                    if not e.text:
                        continue
                    if not text_open:
                        yield sse.event(
                            "content_block_start",
                            index=index,
                            content_block={"type": "text", "text": ""},
                        )
                        text_open = True
                    yield sse.event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "text_delta", "text": e.text},
                    )
                    continue
                if text_open:
                    yield sse.event("content_block_stop", index=index)
                    index += 1
                for call in e.calls:
                    block = {**_tool_use(call), "input": {}}
                    yield sse.event("content_block_start", index=index, content_block=block)
                    yield sse.event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "input_json_delta", "partial_json": call.arguments},
                    )
                    yield sse.event("content_block_stop", index=index)
                    index += 1
                stop_reason, stop_sequence = _stop(e)
                yield sse.event(
                    "message_delta",
                    delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    usage=_usage(e),
                )
                yield sse.event("message_stop")
        except ApiError as err:
            yield sse.event(
                "error", error={"type": _TYPES.get(err.status, "api_error"), "message": err.message}
            )


def _tool_use(call: ToolCall) -> dict[str, Any]:
    tid = call.id if call.id.startswith("toolu_") else f"toolu_{call.id.removeprefix('call_')}"
    return {"type": "tool_use", "id": tid, "name": call.name, "input": json.loads(call.arguments)}


def _stop(end: TurnEnd) -> tuple[str, str | None]:
    if end.calls:
        return "tool_use", None
    if end.finished is not None and end.finished.stop_string:
        return "stop_sequence", end.finished.stop_string
    if end.finish_reason == "length":
        return "max_tokens", None
    return "end_turn", None


def _usage(end: TurnEnd) -> dict[str, int]:
    return {
        "input_tokens": end.num_prompt_cells - end.num_reused_cells,
        "cache_read_input_tokens": end.num_reused_cells,
        "cache_creation_input_tokens": 0,
        "output_tokens": end.num_completion_tokens,
    }
