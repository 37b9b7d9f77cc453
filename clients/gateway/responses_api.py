"""OpenAI's Responses API over slotwise, with stored conversations on sessions.

A stored response (`store`, the default) is one turn of a slotwise session: the chain's
first response creates the session `resp-<chain>`, and `previous_response_id` continues it in
place, sending only the new input (the session holds the rest in its KV cache, however often
it was shifted, images included; on disk with --sessions-dir, so restarts and replicas keep
it). A response id `resp_<chain>_<turn>` names its session and turn: behind nginx it routes
to the session's replica like any session call. What GET needs to show a response again
(its settings, the tool format) is the turn's note; its text and usage are the session's
record of that turn.

A chain is continued from its latest response only: a session is one line of turns, and
slotwise continues it where it stands (branching from an older response is refused).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from clients.client import (
    AsyncSlotwiseClient,
    Constraint,
    Message,
    Prepared,
    SlotwiseError,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFormat,
    ToolOptions,
    TurnRecord,
)
from clients.gateway.errors import ApiError, bad_request, from_slotwise
from clients.gateway.media import MediaPolicy, image_bytes
from clients.gateway.schema import MAX_TOKENS, SlotwiseOptions
from clients.gateway.turns import Keep, Text, TurnEnd, TurnRequest, refuse, start_turn
from clients.tool_calls import parse_reply

_ID = re.compile(r"resp_([0-9a-f]{32})_([0-9]+)")
_MAX_NOTE = 60 << 10  # GenerateRequest.turn_note holds 64 KiB


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputItem(_Open):
    type: str | None = None  # message (or absent), function_call, function_call_output
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    slotwise: SlotwiseOptions = Field(default_factory=SlotwiseOptions)

    def unsupported(self) -> str | None:
        for name in ("reasoning", "conversation", "prompt"):
            if getattr(self, name) not in (None, {}):
                return name
        if self.background:
            return "background"
        if set(self.include or ()) - {"message.output_text.logprobs"}:
            return "include"
        return None


# -- request -> turn ---------------------------------------------------------------------------


async def _messages(items: str | list[InputItem], media: MediaPolicy) -> list[Message]:
    if isinstance(items, str):
        return [Message.user(items)]
    out: list[Message] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            role = "system" if item.role == "developer" else item.role
            if role is None:
                raise bad_request("a message item needs a role", f"input.{i}.role")
            out.append(Message(role, await _parts(item.content, media, f"input.{i}")))
        elif kind == "function_call":
            if not (item.call_id and item.name):
                raise bad_request("a function_call item needs call_id and name", f"input.{i}")
            call = ToolCall(item.call_id, item.name, item.arguments or "{}")
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and not last.parts:
                out[-1] = Message("assistant", (), tool_calls=[*last.tool_calls, call])
            else:
                out.append(Message("assistant", (), tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id:
                raise bad_request("a function_call_output item needs call_id", f"input.{i}")
            output = item.output if isinstance(item.output, str) else _text_of(item.output)
            out.append(Message.tool(item.call_id, output or ""))
        else:
            raise refuse(f"input.{i}.type", f"{kind!r} is not an input item this server takes")
    if not out:
        raise bad_request("input is empty", "input")
    return out


def _text_of(parts: list[dict[str, Any]] | None) -> str:
    return "".join(p.get("text", "") for p in parts or () if isinstance(p, dict))


async def _parts(
    content: str | list[dict[str, Any]] | None, media: MediaPolicy, where: str
) -> list[str | bytes]:
    if content is None or isinstance(content, str):
        return [content or ""]
    parts: list[str | bytes] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(str(part.get("text", "")))
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise refuse(f"{where}.content.{j}", "an input_image needs image_url here")
            parts.append(await image_bytes(url, media, f"{where}.content.{j}.image_url"))
        else:
            raise refuse(f"{where}.content.{j}.type", f"{kind!r} is not supported here")
    return parts or [""]


def _tools(body: ResponsesRequest) -> ToolOptions | None:
    defs = []
    for i, t in enumerate(body.tools or ()):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise refuse(f"tools.{i}", "is not a function tool (the only kind served here)")
        defs.append(Tool(t["name"], t.get("description") or "", t.get("parameters")))
    choice = body.tool_choice
    if not defs:
        if choice not in (None, "auto", "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    parallel = body.parallel_tool_calls
    if choice in (None, "auto", "none", "required"):
        return ToolOptions(defs, ToolChoice(choice or "auto"), parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return ToolOptions(defs, ToolChoice.FUNCTION, str(choice["name"]), parallel)
    raise bad_request(f"tool_choice {choice!r} is not one this server knows", "tool_choice")


def _constraint(body: ResponsesRequest) -> Constraint | None:
    f = body.text.format if body.text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return Constraint(json_schema={"type": "object"})
    if f.schema_ is None:
        raise bad_request("text.format json_schema needs a schema", "text.format.schema")
    return Constraint(json_schema=f.schema_)


def _digest(value: object) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


# -- the API -----------------------------------------------------------------------------------


class Responses:
    def __init__(self, client: AsyncSlotwiseClient, media: MediaPolicy, model: str):
        self.client, self.media, self.model = client, media, model

    async def create(self, body: ResponsesRequest) -> Response:
        name = body.unsupported()
        if name is not None:
            raise refuse(name)
        new = await _messages(body.input, self.media)
        settings = {"instructions": _digest(body.instructions), "tools": _digest(body.tools)}
        chain, turn, before, first = uuid.uuid4().hex, 1, 0, None
        messages = [Message.system(body.instructions), *new] if body.instructions else new
        if body.previous_response_id is not None:
            if not body.store:
                raise bad_request(
                    "previous_response_id goes with store (the chain is a stored session)",
                    "store",
                )
            chain, turn, last, before = await self._latest(body.previous_response_id)
            turn += 1
            held = _note_of(last).get("settings", {})
            for key in ("instructions", "tools"):
                if getattr(body, key) is not None and held.get(key) != settings[key]:
                    raise bad_request(
                        f"{key} differ from the chain's first response, which its KV cache "
                        "holds: start a new chain to change them",
                        key,
                    )
            # the session holds the rest: a stand-in for what came before, its last reply
            # (as the model wrote it, so that it is reused), then only the new input
            messages = [Message.user("(earlier turns)"), Message.assistant(last.text), *new]
            first = 1
        rid = f"resp_{chain}_{turn}" if body.store else f"resp_{uuid.uuid4().hex}"
        shell = self._shell(body, rid, int(time.time()))

        def note(prepared: Prepared) -> bytes:
            fmt = prepared.tool_format if prepared.tool_constraint else ToolFormat.UNSPECIFIED
            kept = {
                "shell": shell,
                "context_cells": before,
                "settings": settings,
                "tool_format": fmt.value,
            }
            data = json.dumps(kept).encode()
            if len(data) > _MAX_NOTE:  # (a large tool list: GET shows none)
                data = json.dumps({**kept, "shell": {**shell, "tools": []}}).encode()
            return data

        o = body.slotwise
        req = TurnRequest(
            messages,
            max_tokens=body.max_output_tokens,
            sampling={"temperature": body.temperature, "top_p": body.top_p},
            context={
                "policy": o.policy,
                "discard_fraction": o.discard_fraction,
                "unit": o.unit,
                "truncate_prompt": body.truncation != "disabled" and o.truncate,
            },
            keep=Keep(o.keep if isinstance(o.keep, int) else None),
            tools=_tools(body),
            constraint=_constraint(body),
            constraint_param="text.format",
            logprobs=bool(body.include) or bool(body.top_logprobs),
            top_logprobs=body.top_logprobs or 0,
            session_id=f"resp-{chain}" if body.store else None,
            first_message=first,
            create_session=body.store and body.previous_response_id is None,
            note=note if body.store else None,
        )
        started, _ = await start_turn(self.client, req)
        if body.stream:
            events = self._stream(started.events(), shell, rid, before)
            return StreamingResponse(events, media_type="text/event-stream")
        end = await started.whole()
        usage = _usage(end, before)
        out = self._finished(
            shell, rid, end.content, _ids(end.calls, rid), usage, end.finish_reason
        )
        headers = {"x-slotwise-warning": end.warning} if end.warning else None
        return JSONResponse(out, headers=headers)

    async def _latest(self, response_id: str) -> tuple[str, int, TurnRecord, int]:
        """The chain and turn a response id names, that turn's record, which must be the
        session's latest, and the cells the session holds."""
        m = _ID.fullmatch(response_id)
        if m is None:
            raise ApiError(
                404,
                f"no stored response {response_id!r}",
                code="not_found",
                param="previous_response_id",
            )
        chain, turn = m.group(1), int(m.group(2))
        record = await self._record(chain, turn, "previous_response_id")
        try:
            info = await self.client.get_session(f"resp-{chain}")
        except SlotwiseError as e:
            raise from_slotwise(e) from None
        if info.num_turns != turn:
            raise bad_request(
                f"{response_id} is not the latest response of its chain (resp_{chain}_"
                f"{info.num_turns} is): slotwise continues a stored chain where it stands",
                "previous_response_id",
            )
        return chain, turn, record, info.num_cells

    async def _record(self, chain: str, turn: int, param: str | None = None) -> TurnRecord:
        try:
            info = await self.client.get_session(f"resp-{chain}", num_records=256)
        except SlotwiseError as e:
            if e.reason == "SESSION_NOT_FOUND":
                raise ApiError(
                    404, f"no stored response resp_{chain}_{turn}", code="not_found", param=param
                ) from None
            raise from_slotwise(e) from None
        record = next((r for r in info.records if r.turn == turn), None)
        if record is None:
            raise ApiError(
                404, f"no stored response resp_{chain}_{turn}", code="not_found", param=param
            )
        return record

    async def get(self, response_id: str) -> dict[str, Any]:
        m = _ID.fullmatch(response_id)
        if m is None:
            raise ApiError(404, f"no stored response {response_id!r}", code="not_found")
        record = await self._record(m.group(1), int(m.group(2)))
        note = _note_of(record)
        shell = note.get("shell") or self._shell(None, response_id, int(record.created))
        fmt = ToolFormat(note.get("tool_format") or "unspecified")
        reply = parse_reply(fmt, record.text) if fmt is not ToolFormat.UNSPECIFIED else None
        content = reply.content if reply else record.text
        calls = _ids(reply.calls if reply else (), response_id)
        before = int(note.get("context_cells", 0))
        usage = _usage_of(
            record.num_prompt_cells, record.num_reused_cells, record.num_generated_tokens, before
        )
        finish = "tool_calls" if calls else ("length" if record.reason.value == "length" else "")
        return self._finished(shell, response_id, content, calls, usage, finish)

    async def delete(self, response_id: str) -> dict[str, Any]:
        m = _ID.fullmatch(response_id)
        if m is None:
            raise ApiError(404, f"no stored response {response_id!r}", code="not_found")
        await self._record(m.group(1), int(m.group(2)))
        try:
            await self.client.delete_session(f"resp-{m.group(1)}")
        except SlotwiseError as e:
            raise from_slotwise(e) from None
        return {"id": response_id, "object": "response", "deleted": True}

    # -- shapes ---------------------------------------------------------------------------

    def _shell(self, body: ResponsesRequest | None, rid: str, created: int) -> dict[str, Any]:
        """The response object around its output (what GET shows again)."""
        m = _ID.fullmatch(rid)
        previous = f"resp_{m.group(1)}_{int(m.group(2)) - 1}" if m and m.group(2) != "1" else None
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "model": self.model,
            "output": [],
            "previous_response_id": previous,
            "instructions": body.instructions if body else None,
            "tools": body.tools or [] if body else [],
            "tool_choice": (body.tool_choice or "auto") if body else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False if body else True,
            "text": {
                "format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                if body and body.text and body.text.format
                else {"type": "text"}
            },
            "max_output_tokens": body.max_output_tokens if body else None,
            "temperature": body.temperature if body else None,
            "top_p": body.top_p if body else None,
            "store": body.store if body else True,
            "metadata": (body.metadata or {}) if body else {},
            "truncation": (body.truncation or "disabled") if body else "disabled",
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def _finished(
        self,
        shell: dict[str, Any],
        rid: str,
        content: str,
        calls: Sequence[ToolCall],
        usage: dict[str, Any],
        finish: str,
    ) -> dict[str, Any]:
        out = {**shell, "status": "completed", "usage": usage}
        out["output"] = _output(rid, content, calls, "completed")
        if finish == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    async def _stream(
        self, events: AsyncIterator[Text | TurnEnd], shell: dict[str, Any], rid: str, before: int
    ) -> AsyncIterator[str]:
        n = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal n
            n += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n - 1, **fields})}\n\n"  # noqa: E501

        public = shell
        yield event("response.created", response=public)
        yield event("response.in_progress", response=public)
        msg_id = f"msg_{_hex(rid, 'message')}"
        text: list[str] = []
        try:
            async for e in events:
                if isinstance(e, Text):
                    if not e.text:
                        continue
                    if not text:
                        item = {
                            "type": "message",
                            "id": msg_id,
                            "status": "in_progress",
                            "role": "assistant",
                            "content": [],
                        }
                        yield event("response.output_item.added", output_index=0, item=item)
                        yield event(
                            "response.content_part.added",
                            item_id=msg_id,
                            output_index=0,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    text.append(e.text)
                    yield event(
                        "response.output_text.delta",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        delta=e.text,
                        logprobs=[],
                    )
                    continue
                end = e
                calls = _ids(end.calls, rid)
                full = self._finished(
                    shell, rid, end.content, calls, _usage(end, before), end.finish_reason
                )
                if text:
                    whole = "".join(text)
                    part = {"type": "output_text", "text": whole, "annotations": []}
                    yield event(
                        "response.output_text.done",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        text=whole,
                        logprobs=[],
                    )
                    yield event(
                        "response.content_part.done",
                        item_id=msg_id,
                        output_index=0,
                        content_index=0,
                        part=part,
                    )
                    yield event("response.output_item.done", output_index=0, item=full["output"][0])
                first = 1 if text else 0
                for k, item in enumerate(full["output"][first:], start=first):
                    pending = {**item, "arguments": "", "status": "in_progress"}
                    yield event("response.output_item.added", output_index=k, item=pending)
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=k,
                        delta=item["arguments"],
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=k,
                        arguments=item["arguments"],
                    )
                    yield event("response.output_item.done", output_index=k, item=item)
                incomplete = full["status"] == "incomplete"
                yield event(
                    f"response.{'incomplete' if incomplete else 'completed'}", response=full
                )
        except ApiError as e:
            failed = {
                **public,
                "status": "failed",
                "error": {"code": e.code or "server_error", "message": e.message},
            }
            yield event("response.failed", response=failed)


def _hex(rid: str, what: str) -> str:
    return hashlib.blake2b(f"{rid}/{what}".encode(), digest_size=12).hexdigest()


def _ids(calls: Sequence[ToolCall], rid: str) -> list[ToolCall]:
    """Call ids that are the same every time the response is shown (GET rebuilds them)."""
    return [ToolCall(f"call_{_hex(rid, str(k))}", c.name, c.arguments) for k, c in enumerate(calls)]


def _output(rid: str, content: str, calls: Sequence[ToolCall], status: str) -> list[Any]:
    items: list[dict[str, Any]] = []
    if content or not calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{_hex(rid, 'message')}",
                "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        )
    for c in calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{c.id[5:]}",
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": status,
            }
        )
    return items


def _usage(end: TurnEnd, before: int) -> dict[str, Any]:
    return _usage_of(end.num_prompt_cells, end.num_reused_cells, end.num_completion_tokens, before)


def _usage_of(prompt: int, reused: int, generated: int, before: int) -> dict[str, Any]:
    """The whole context as input: what the chain's session held before the turn (all of it
    from the cache) and what the turn decoded."""
    new = prompt - reused if before else prompt
    cached = before if before else reused
    return {
        "input_tokens": before + new,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": before + new + generated,
    }


def _note_of(record: TurnRecord) -> dict[str, Any]:
    try:
        note = json.loads(record.note or b"{}")
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}
