"""OpenAI's Responses API over slotwise, with stored conversations on sessions.

A stored response (`store`, the default) is one turn of a slotwise session: the chain's
first response creates the session `resp-<chain>`, and `previous_response_id` continues it in
place, sending only the new input (the session holds the rest in its KV cache, however often
it was shifted, images included; on disk with --sessions-dir, so restarts and replicas keep
it). A response id `resp_<chain>_<turn>` names its session and turn: behind nginx it routes
to the session's replica like any session call. What GET needs to show a response again
(its settings, the tool format) is the turn's note; its text and usage are the session's
record of that turn.

Input messages take text, images (input_image) and sounds (input_audio: the SDK's
ResponseInputAudio part, Chat Completions' {data, format}; sounds.py).

A chain is continued from its latest response only: a session is one line of turns, and
slotwise continues it where it stands (branching from an older response is refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from clients.client import (
    AsyncSlotwiseClient,
    Audio,
    Constraint,
    Message,
    Prepared,
    Reasoning,
    SlotwiseError,
    TokenLogprobs,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFormat,
    ToolOptions,
    TurnRecord,
)
from clients.gateway import generation, sse
from clients.gateway.chat import token_logprobs
from clients.gateway.errors import ApiError, bad_request, call, from_slotwise
from clients.gateway.media import MediaPolicy, check_images, image_bytes
from clients.gateway.responses.schema import InputItem, ResponsesRequest
from clients.gateway.sounds import audio_part
from clients.gateway.turns import Text, Thinking, TurnEnd, TurnRequest, refuse, start_turn
from clients.reasoning import split_thoughts
from clients.tool_calls import parse_reply
from slotwise_core.limits import MAX_TURN_NOTE

_ID = re.compile(r"resp_([0-9a-f]{32})_([0-9]{1,9})")  # (a turn's number: never 4,300 digits)
_MAX_NOTE = MAX_TURN_NOTE - (4 << 10)  # (with room to spare)
_CHAIN_FIXED = ("instructions", "tools")  # refused if a continuation changes them
_CLEANUPS: set[asyncio.Task[None]] = set()
log = logging.getLogger("slotwise.gateway.responses")


# -- request -> turn ---------------------------------------------------------------------------


async def _messages(items: str | list[InputItem], media: MediaPolicy) -> list[Message]:
    if isinstance(items, str):
        return [Message.user(items)]
    check_images((item.content for item in items), media, "input", image="input_image",
                 sound="input_audio")  # fmt: skip
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
) -> list[str | bytes | Audio]:
    if content is None or isinstance(content, str):
        return [content or ""]
    parts: list[str | bytes | Audio] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(str(part.get("text", "")))
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise refuse(f"{where}.content.{j}", "an input_image needs image_url here")
            parts.append(await image_bytes(url, media, f"{where}.content.{j}.image_url"))
        elif kind == "input_audio":
            # (the SDK's ResponseInputAudio: Chat Completions' part, {data, format})
            sound = part.get("input_audio")
            param = f"{where}.content.{j}.input_audio"
            if not isinstance(sound, dict):
                raise bad_request(f"{param}: give {{data, format}}", param)
            parts.append(audio_part(sound.get("data"), sound.get("format"), media, param))
        else:
            raise refuse(f"{where}.content.{j}.type", f"{kind!r} is not supported here")
    return parts or [""]


def _tools(body: ResponsesRequest) -> ToolOptions | None:
    defs = []
    for i, t in enumerate(body.tools or ()):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise refuse(f"tools.{i}", "is not a function tool (the only kind served here)")
        defs.append(Tool(t["name"], t.get("description") or "", t.get("parameters")))
    choice, parallel = body.tool_choice, body.parallel_tool_calls
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        name = str(choice["name"])
        return generation.tool_options(
            defs, ToolChoice.FUNCTION, choice, name=name, parallel=parallel
        )
    return generation.tool_options(
        defs, generation.openai_choice(choice), choice, parallel=parallel
    )


def _constraint(body: ResponsesRequest) -> Constraint | None:
    f = body.text.format if body.text else None
    if f is None:
        return None
    missing = bad_request("text.format json_schema needs a schema", "text.format.schema")
    return generation.format_constraint(f.type, f.schema_, missing)


def _digest(value: object) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


@dataclasses.dataclass(frozen=True)
class _Chain:
    """Where a response goes: a new chain, or the next turn of a stored one."""

    id: str  # the chain's (its session is resp-<id>)
    turn: int  # the response's number in it
    before: int  # the cells its session held before this turn
    first: int | None  # the first new message of the turn's (None: a new chain's, found)
    expect: int  # the turns the session must have (another came first: refused)
    messages: list[Message]
    settings: dict[str, Any]  # what cannot change along the chain, as its first response had it


def _note_writer(
    shell: dict[str, Any], chain: _Chain, thinking: Thinking
) -> Callable[[Prepared], bytes]:
    """What GET needs to show a stored response again, kept as its turn's note: the response
    object around its output, its chain's settings, the tool format to read calls with, where
    a reasoning model's thoughts were."""

    def note(prepared: Prepared) -> bytes:
        fmt = prepared.tool_format if prepared.tool_constraint else ToolFormat.UNSPECIFIED
        r = prepared.reasoning if thinking.apart else None
        # what cannot change along a chain is kept once, by its first response
        lean = [k for k in _CHAIN_FIXED if chain.turn > 1 and shell[k]]
        shown = {k: v for k, v in shell.items() if k not in lean}
        kept = {
            "shell": shown,
            "from_first": lean,
            "context_cells": chain.before,
            "settings": chain.settings,
            "tool_format": fmt.value,
            **({"reasoning": dataclasses.asdict(r)} if r is not None else {}),
        }
        data = json.dumps(kept).encode()
        if len(data) > _MAX_NOTE:  # (a large tool list: GET shows none)
            data = json.dumps({**kept, "shell": {**shown, "tools": []}}).encode()
        return data

    return note


# -- the API -----------------------------------------------------------------------------------


class Responses:
    def __init__(
        self,
        client: AsyncSlotwiseClient,
        media: MediaPolicy,
        model: str,
        thinking: Thinking = Thinking(),
    ):
        self.client, self.media, self.model, self.thinking = client, media, model, thinking

    async def create(self, body: ResponsesRequest) -> Response:
        name = body.unsupported()
        if name is not None:
            raise refuse(name)
        new = await _messages(body.input, self.media)
        chain = await self._chain_of(body, new)
        rid = f"resp_{chain.id}_{chain.turn}" if body.store else f"resp_{uuid.uuid4().hex}"
        shell = self._shell(body, rid, int(time.time()))
        thinking = self._thinking_of(body)
        req = TurnRequest(
            chain.messages,
            max_tokens=body.max_output_tokens,
            sampling={"temperature": body.temperature, "top_p": body.top_p},
            context=generation.context_of(
                body.slotwise, body.truncation != "disabled" and body.slotwise.truncate
            ),
            keep=generation.keep_of(body.slotwise),
            tools=_tools(body),
            constraint=_constraint(body),
            constraint_param="text.format",
            logprobs=bool(body.include) or bool(body.top_logprobs),
            top_logprobs=body.top_logprobs or 0,
            session_id=f"resp-{chain.id}" if body.store else None,
            first_message=chain.first,
            create_session=body.store and body.previous_response_id is None,
            expect_turns=chain.expect if body.store else None,
            cache_salt=body.slotwise.cache_salt,
            speculative=generation.speculative_in(body),
            note=_note_writer(shell, chain, thinking) if body.store else None,
            thinking=thinking,
        )
        return await self._answer(body, req, chain, shell, rid)

    async def _chain_of(self, body: ResponsesRequest, new: list[Message]) -> _Chain:
        """A new chain, or, with previous_response_id, the next turn of that stored chain:
        its session holds the rest, so the turn's messages are a stand-in for what came before,
        its last reply (as the model wrote it, so that it is reused), then only the new input."""
        settings = {"instructions": _digest(body.instructions), "tools": _digest(body.tools)}
        if body.previous_response_id is None:
            messages = [Message.system(body.instructions), *new] if body.instructions else new
            return _Chain(uuid.uuid4().hex, 1, 0, None, 0, messages, settings)
        if not body.store:
            raise bad_request(
                "previous_response_id goes with store (the chain is a stored session)", "store"
            )
        chain, expect, last, before = await self._latest(body.previous_response_id)
        held = _note_of(last).get("settings", {})
        for key in _CHAIN_FIXED:
            if getattr(body, key) is not None and held.get(key) != settings[key]:
                raise bad_request(
                    f"{key} differ from the chain's first response, which its KV cache "
                    "holds: start a new chain to change them",
                    key,
                )
        kept = {key: held.get(key) for key in _CHAIN_FIXED}  # the chain's, carried on
        messages = [Message.user("(earlier turns)"), Message.assistant(last.text), *new]
        return _Chain(chain, expect + 1, before, 1, expect, messages, kept)

    def _thinking_of(self, body: ResponsesRequest) -> Thinking:
        """reasoning.effort as llama-server takes it (reasoning_effort: "none" turns thinking
        off), and its body fields (chat_template_kwargs, reasoning_budget_tokens, ...)."""
        effort = (body.reasoning or {}).get("effort")
        fields = {**(body.model_extra or {}), **({"reasoning_effort": effort} if effort else {})}
        thinking = generation.thinking_of(self.thinking, fields)
        if body.reasoning:
            thinking = dataclasses.replace(thinking, asked="reasoning")
        return thinking

    async def _answer(
        self, body: ResponsesRequest, req: TurnRequest, chain: _Chain, shell: dict[str, Any],
        rid: str,
    ) -> Response:  # fmt: skip
        """The turn started, and its reply streamed or whole; a new chain whose first response
        fails leaves no session behind."""
        new_chain = req.create_session
        try:
            started, _ = await start_turn(self.client, req)
        except BaseException as e:  # (refused, or the client went while it queued)
            if new_chain:
                self._forget(chain.id)
            if isinstance(e, ApiError) and e.code == "session_moved_on":  # another came first
                e.message = f"{body.previous_response_id} is no longer the latest of its chain"
                e.param = "previous_response_id"
            raise
        if body.stream:
            events = started.events()
            return sse.response(self._stream(events, shell, rid, chain.before, new_chain))
        try:
            end = await started.whole()
        except BaseException:
            if new_chain:
                self._forget(chain.id)
            raise
        usage = _usage(end, chain.before)
        out = self._finished(
            shell, rid, end.content, _ids(end.calls, rid), usage, end.finish_reason, end.logprobs,
            end.reasoning,
        )  # fmt: skip
        headers = {"x-slotwise-warning": end.warning} if end.warning else None
        return JSONResponse(out, headers=headers)

    def _forget(self, chain: str) -> None:
        """A new chain whose first response failed leaves no session behind (in the
        background: the failed turn may still be ending, and the client may be gone)."""

        async def delete() -> None:
            for attempt in range(6):
                try:
                    await self.client.delete_session(f"resp-{chain}")
                    return
                except SlotwiseError as e:
                    if e.reason != "SESSION_BUSY":
                        return  # gone already, or not ours to clean up now
                except Exception as e:  # (the gateway shutting down: its channels closed)
                    log.info("resp-%s not deleted: %s", chain, e)
                    return
                await asyncio.sleep(0.05 * 2**attempt)
            log.warning("resp-%s not deleted: its failed turn is still running", chain)

        task = asyncio.get_running_loop().create_task(delete())
        _CLEANUPS.add(task)  # (held here: a Responses lives only as long as its request)
        task.add_done_callback(_CLEANUPS.discard)

    async def _latest(self, response_id: str) -> tuple[str, int, TurnRecord, int]:
        """The chain and turn a response id names, which must be its session's latest, that
        turn's record, and the cells the session holds."""
        param = "previous_response_id"
        chain, turn = _named(response_id, param)
        info = await self._chain(chain, turn, 1, param)
        if info.num_turns > turn:
            raise bad_request(
                f"{response_id} is not the latest response of its chain (resp_{chain}_"
                f"{info.num_turns} is): slotwise continues a stored chain where it stands",
                param,
            )
        if not info.records or info.records[-1].turn != turn:
            raise _not_found(f"resp_{chain}_{turn}", param)
        return chain, turn, info.records[-1], info.num_cells

    async def _chain(self, chain: str, turn: int, num_records: int, param: str | None = None):
        try:
            return await self.client.get_session(f"resp-{chain}", num_records=num_records)
        except SlotwiseError as e:
            if e.reason == "SESSION_NOT_FOUND":
                raise _not_found(f"resp_{chain}_{turn}", param) from None
            raise from_slotwise(e) from None

    async def _records(self, response_id: str) -> dict[int, TurnRecord]:
        """The records of the chain a response belongs to, by turn (it must be one of them)."""
        chain, turn = _named(response_id)
        info = await self._chain(chain, turn, 256)
        records = {r.turn: r for r in info.records}
        if turn not in records:
            raise _not_found(response_id)
        return records

    async def get(self, response_id: str) -> dict[str, Any]:
        records = await self._records(response_id)
        record = records[_named(response_id)[1]]
        note = _note_of(record)
        shell = note.get("shell") or self._shell(None, response_id, int(record.created))
        first = _note_of(records[1]).get("shell", {}) if 1 in records else {}
        for key in note.get("from_first", ()):
            shell[key] = first.get(key)
        fmt = ToolFormat(note.get("tool_format") or "unspecified")
        text, thoughts = record.text, None
        if isinstance(note.get("reasoning"), dict):  # (its thoughts apart, as it was answered)
            split = split_thoughts(Reasoning(**note["reasoning"]), text)
            text, thoughts = split.content, split.reasoning
        reply = parse_reply(fmt, text) if fmt is not ToolFormat.UNSPECIFIED else None
        content = reply.content if reply else text
        calls = _ids(reply.calls if reply else (), response_id)
        before = int(note.get("context_cells", 0))
        usage = _usage_of(
            record.num_prompt_cells, record.num_reused_cells, record.num_generated_tokens, before
        )
        finish = "tool_calls" if calls else ("length" if record.reason.value == "length" else "")
        return self._finished(shell, response_id, content, calls, usage, finish, (), thoughts)

    async def delete(self, response_id: str) -> dict[str, Any]:
        """Deletes the whole chain: its responses are turns of one session."""
        await self._records(response_id)
        await call(self.client.delete_session(f"resp-{_named(response_id)[0]}"))
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
            "truncation": (body.truncation or "auto") if body else "auto",
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
        logprobs: Sequence[TokenLogprobs] = (),
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        out = {**shell, "status": "completed", "usage": usage}
        out["output"] = _output(rid, content, calls, "completed", logprobs, reasoning)
        if finish == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    async def _stream(
        self,
        events: AsyncIterator[Text | TurnEnd],
        shell: dict[str, Any],
        rid: str,
        before: int,
        new_chain: bool,
    ) -> AsyncGenerator[str, None]:
        out = _StreamedResponse(rid)
        completed = False
        yield out.event("response.created", response=shell)
        yield out.event("response.in_progress", response=shell)
        try:
            async for e in events:
                if isinstance(e, Text):
                    for line in out.text(e):
                        yield line
                    continue
                full = self._finished(shell, rid, e.content, _ids(e.calls, rid),
                                      _usage(e, before), e.finish_reason, e.logprobs,
                                      e.reasoning)  # fmt: skip
                for line in out.items_done(full["output"]):
                    yield line
                incomplete = full["status"] == "incomplete"
                completed = True
                yield out.event(
                    f"response.{'incomplete' if incomplete else 'completed'}", response=full
                )
        except ApiError as e:
            failed = {
                **shell,
                "status": "failed",
                "error": {"code": e.code or "server_error", "message": e.message},
            }
            yield out.event("response.failed", response=failed)
        finally:
            if new_chain and not completed:
                self._forget(rid.split("_")[1])


class _StreamedResponse:
    """The events of one streamed response, numbered, and its open items: a reasoning item
    while thoughts come (the message comes after it), then the message."""

    def __init__(self, rid: str):
        self.rid, self.n = rid, 0
        self.msg_id = f"msg_{_hex(rid, 'message')}"
        self.at = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        self.opened = False
        self.thought = {
            "item_id": f"rs_{_hex(rid, 'reasoning')}", "output_index": 0, "content_index": 0,
        }  # fmt: skip
        self.thinking = False  # (a reasoning item is open: the message comes after it)
        self.thoughts: list[str] = []

    def event(self, kind: str, **fields: Any) -> str:
        self.n += 1
        return sse.event(kind, sequence_number=self.n - 1, **fields)

    def text(self, e: Text) -> Iterator[str]:
        """A step's thoughts and text, as deltas of the items they go in."""
        if e.reasoning:
            if not self.thinking:
                self.thinking, self.at["output_index"] = True, 1
                item = {"type": "reasoning", "id": self.thought["item_id"], "summary": [],
                        "content": [], "encrypted_content": "",
                        "status": "in_progress"}  # fmt: skip
                yield self.event("response.output_item.added", output_index=0, item=item)
            self.thoughts.append(e.reasoning)
            yield self.event("response.reasoning_text.delta", **self.thought, delta=e.reasoning)
        if e.text:
            if not self.opened:
                yield from self.open_message()
            yield self.event("response.output_text.delta", **self.at, delta=e.text,
                             logprobs=token_logprobs(e.logprobs))  # fmt: skip

    def items_done(self, output: list[dict[str, Any]]) -> Iterator[str]:
        """The finished response's items, each done: the thoughts, the message, and each
        function call (added, its arguments, done)."""
        for k, item in enumerate(output):
            if item["type"] == "reasoning":  # (a reply that is all thoughts)
                yield from self.close_thoughts()
                continue
            if item["type"] == "message":
                if not self.opened:
                    yield from self.open_message()
                part = item["content"][0]
                yield self.event("response.output_text.done", **self.at, text=part["text"],
                                 logprobs=part["logprobs"])  # fmt: skip
                yield self.event("response.content_part.done", **self.at, part=part)
                yield self.event("response.output_item.done", output_index=k, item=item)
                continue
            pending = {**item, "arguments": "", "status": "in_progress"}
            call = {"item_id": item["id"], "output_index": k}
            yield self.event("response.output_item.added", output_index=k, item=pending)
            yield self.event("response.function_call_arguments.delta", **call,
                             delta=item["arguments"])  # fmt: skip
            yield self.event("response.function_call_arguments.done", **call,
                             arguments=item["arguments"])  # fmt: skip
            yield self.event("response.output_item.done", output_index=k, item=item)

    def close_thoughts(self) -> Iterator[str]:
        """The reasoning item, done (before the message opens, or at the end)."""
        if self.thinking:
            self.thinking, text = False, "".join(self.thoughts)
            item = _output(self.rid, "", (), "completed", (), text)[0]
            yield self.event("response.reasoning_text.done", **self.thought, text=text)
            yield self.event("response.output_item.done", output_index=0, item=item)

    def open_message(self) -> Iterator[str]:
        yield from self.close_thoughts()
        self.opened = True
        item = {"type": "message", "id": self.msg_id, "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        yield self.event("response.output_item.added", output_index=self.at["output_index"],
                         item=item)  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self.event("response.content_part.added", **self.at, part=part)


def _named(response_id: str, param: str | None = None) -> tuple[str, int]:
    """The chain and turn of a stored response's id."""
    m = _ID.fullmatch(response_id)
    if m is None:
        raise _not_found(response_id, param)
    return m.group(1), int(m.group(2))


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    """404 for the id in a path; an id a request body names (param) makes that request a bad
    one: 400, as OpenAI answers it."""
    if param is not None:
        return bad_request(
            f"no stored response {response_id!r}", param, code="previous_response_not_found"
        )
    return ApiError(404, f"no stored response {response_id!r}", code="not_found")


def _hex(rid: str, what: str) -> str:
    return hashlib.blake2b(f"{rid}/{what}".encode(), digest_size=12).hexdigest()


def _ids(calls: Sequence[ToolCall], rid: str) -> list[ToolCall]:
    """Call ids that are the same every time the response is shown (GET rebuilds them)."""
    return [ToolCall(f"call_{_hex(rid, str(k))}", c.name, c.arguments) for k, c in enumerate(calls)]


def _output(
    rid: str,
    content: str,
    calls: Sequence[ToolCall],
    status: str,
    logprobs: Sequence[TokenLogprobs] = (),
    reasoning: str | None = None,
) -> list[Any]:
    items: list[dict[str, Any]] = []
    if reasoning is not None:  # (a reasoning model's thoughts, first: llama-server's item)
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{_hex(rid, 'reasoning')}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "encrypted_content": "",
                "status": status,
            }
        )
    if content or not calls:
        text = {"type": "output_text", "text": content, "annotations": [],
                "logprobs": token_logprobs(logprobs)}  # fmt: skip
        items.append(
            {
                "type": "message",
                "id": f"msg_{_hex(rid, 'message')}",
                "status": status,
                "role": "assistant",
                "content": [text],
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
    return _usage_of(
        end.num_prompt_cells, end.num_reused_cells, end.num_completion_tokens, before,
        end.num_reasoning_tokens,
    )  # fmt: skip


def _usage_of(
    prompt: int, reused: int, generated: int, before: int, reasoning: int = 0
) -> dict[str, Any]:
    """The whole context as input: what the chain's session held before the turn (all of it
    from the cache) and what the turn decoded."""
    new = prompt - reused if before else prompt
    cached = before if before else reused
    return {
        "input_tokens": before + new,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": before + new + generated,
    }


def _note_of(record: TurnRecord) -> dict[str, Any]:
    try:
        note = json.loads(record.note or b"{}")
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}
