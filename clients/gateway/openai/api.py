"""OpenAI's Chat Completions, Completions and Embeddings over slotwise.

Each request becomes one TurnRequest per choice (`n` choices are n generations: every slot
has a KV stream of its own, so a choice costs its prefill wherever it runs, and the engine
runs them side by side in as many slots). A message's parts are text, images (image_url) and
sounds (input_audio: sounds.py), counted in `usage` as the cells prep made of them. Tools go to
prep, which shows them as the chat template does and returns the grammar of a valid call;
`response_format`, and llama-server's `grammar` and `json_schema` body fields, constrain the
reply in the engine's sampler chain.

As llama-server answers them: replies carry `system_fingerprint` and `timings`, streams
`timings_per_token` and `return_progress` when asked; a chat that ends with an assistant
message continues that message (llama-server's prefill), and the bodies llama-server refuses
are refused with its words.
"""

from __future__ import annotations

import base64
import contextlib
import struct
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from clients.client import (
    AsyncSlotwiseClient,
    Constraint,
    Message,
    Prepared,
    TokenLogprobs,
    Tool,
    ToolCall,
    ToolChoice,
    ToolOptions,
)
from clients.gateway import generation, sse
from clients.gateway.chat import (
    SYSTEM_FINGERPRINT,
    chat_messages,
    check_messages,
    continuation,
    piece_text,
    prefilled,
    token_logprobs,
)
from clients.gateway.choices import choices, interleaved, start_all, wholes
from clients.gateway.errors import ApiError, bad_request, call, translated
from clients.gateway.media import MediaPolicy
from clients.gateway.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    NamedToolChoice,
    SamplingRequest,
    ToolDef,
)
from clients.gateway.turns import (
    Keep,
    Progress,
    StreamClock,
    Text,
    Thinking,
    Turn,
    TurnEnd,
    TurnRequest,
    per_token,
    refuse,
    system_cells,
)

# -- requests -> turns ------------------------------------------------------------------------


def tool_options(
    tools: Sequence[ToolDef] | None, choice: object, parallel: bool | None
) -> ToolOptions | None:
    """OpenAI's tools and tool_choice (auto, none, required, a named function, or the
    allowed_tools form) -> what prep takes."""
    defs = [Tool(t.function.name, t.function.description, t.function.parameters)
            for t in tools or ()]  # fmt: skip
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return generation.tool_options(
            defs, ToolChoice.FUNCTION, choice, name=name, parallel=parallel
        )
    if defs and isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools") or {}
        names = {t.get("function", {}).get("name") for t in allowed.get("tools", [])}
        chosen = [t for t in defs if t.name in names]
        if not chosen:
            raise bad_request("tool_choice.allowed_tools names none of the tools", "tool_choice")
        mode = allowed.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request(f"tool_choice.allowed_tools.mode {mode!r}", "tool_choice")
        return generation.tool_options(chosen, ToolChoice(mode), choice, parallel=parallel)
    return generation.tool_options(
        defs, generation.openai_choice(choice), choice, parallel=parallel
    )


def constraint_of(body: SamplingRequest) -> Constraint | None:
    """response_format (json_object, json_schema), or llama-server's grammar / json_schema."""
    f = body.response_format
    if f is not None and f.type != "text":
        schema = f.json_schema.schema_ if f.json_schema is not None else None
        missing = bad_request("response_format.json_schema needs a schema", "response_format")
        return generation.format_constraint(f.type, schema, missing)
    return generation.grammar_constraint(body.grammar, body.json_schema)


def logit_bias_of(body: SamplingRequest) -> dict[int, float]:
    try:
        bias = {int(k): float(v) for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        raise bad_request("logit_bias: keys are token ids", "logit_bias") from None
    for t in bias:
        if not 0 <= t < 1 << 31:  # (an int32 on the wire; prep knows the vocabulary's size)
            raise bad_request(f"logit_bias: {t} is not a token id", "logit_bias")
    return bias


def sampling_of(body: SamplingRequest) -> dict[str, Any]:
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repeat_penalty": body.repeat_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
    }


def check_body(body: SamplingRequest) -> None:
    name = body.unsupported()
    if name is not None:
        raise refuse(name)
    if body.n > 1 and body.slotwise.session_id:
        raise refuse("n", "above 1 does not go with a session (one conversation, one reply)")
    if body.slotwise.note and not body.slotwise.session_id:
        raise refuse("slotwise.note", "is kept with a session's turn: give slotwise.session_id")


def _note(note: str) -> Callable[[Prepared], bytes] | None:
    return (lambda _: note.encode()) if note else None


def lora_of(body: SamplingRequest) -> list[tuple[int, float]]:
    return [(x.id, x.scale) for x in body.lora or ()]


# -- Chat Completions -------------------------------------------------------------------------


async def chat_completion(
    client: AsyncSlotwiseClient,
    body: ChatCompletionRequest,
    media: MediaPolicy,
    model: str,
    thinking: Thinking = Thinking(),
    verbose: bool = False,
) -> Response:
    check_body(body)
    thinking = generation.thinking_of(thinking, body.model_extra or {})
    check_messages(body.messages)
    extra = body.model_extra or {}
    continued = not body.slotwise.session_id and continuation(
        body.messages, extra.get("continue_final_message"), extra.get("add_generation_prompt")
    )
    if not continued and extra.get("add_generation_prompt") is False:
        raise refuse("add_generation_prompt", "false is supported only with a final assistant "
                     "message to continue")  # fmt: skip
    messages = await chat_messages(body.messages, media)
    tools = tool_options(body.tools, body.tool_choice, body.parallel_tool_calls)
    keep = generation.keep_of(body.slotwise)
    prompt: list[Message] | Prepared = messages
    prefix = ""
    if continued:
        prompt = await prefilled(client, messages, tools, thinking.kwargs)
        prefix = messages[-1].text
        if keep.cells is None and messages[0].role == "system":
            keep = Keep(system_cells(prompt))
    verbose = extra.get("verbose", verbose) is True  # llama-server's: the prompt in __verbose
    if verbose and not continued and not body.slotwise.session_id:
        with translated():  # prepared here, as start_turn would, to show what it became
            prompt = await client.prepare(messages, tools=tools, template_kwargs=thinking.kwargs)
        if keep.cells is None and messages[0].role == "system":
            keep = Keep(system_cells(prompt))
    req = TurnRequest(
        prompt,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or (),
        sampling=sampling_of(body),
        context=generation.context_of(body.slotwise),
        keep=keep,
        tools=tools,
        constraint=constraint_of(body),
        logit_bias=logit_bias_of(body),
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        session_id=body.slotwise.session_id,
        cache_salt=body.salt,
        speculative=generation.speculative_in(body),
        note=_note(body.slotwise.note),
        lora=lora_of(body),
        thinking=thinking,
    )
    reply = _Chat(client, model, chat=True, body=body, prefix=prefix)
    if verbose and isinstance(prompt, Prepared):
        reply.verbose_prompt = prompt.rendered_text
    return await _respond(client, body, req, reply)


async def completion(client: AsyncSlotwiseClient, body: CompletionRequest, model: str) -> Response:
    check_body(body)
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    req = TurnRequest(
        prompt,
        max_tokens=body.max_tokens,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or (),
        sampling=sampling_of(body),
        context=generation.context_of(body.slotwise),
        keep=generation.keep_of(body.slotwise, 0),
        constraint=constraint_of(body),
        logit_bias=logit_bias_of(body),
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        cache_salt=body.salt,
        speculative=generation.speculative_in(body),
        lora=lora_of(body),
    )
    if body.slotwise.session_id:
        raise refuse("slotwise.session_id", "goes with chat completions")
    reply = _Chat(client, model, chat=False, body=body)
    return await _respond(client, body, req, reply)


async def _respond(
    client: AsyncSlotwiseClient, body: SamplingRequest, req: TurnRequest, reply: _Chat
) -> Response:
    turns = await start_all(client, choices(req, body.n))
    if body.stream:
        return sse.response(reply.stream(turns))
    ends = await wholes(turns)
    return _json(reply.whole(ends), ends)


def _include_usage(body: SamplingRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _json(body: dict[str, Any], ends: list[TurnEnd]) -> JSONResponse:
    warning = next((e.warning for e in ends if e.warning), "")
    headers = {"x-slotwise-warning": warning} if warning else None
    return JSONResponse(body, headers=headers)


class _Chat:
    """One response (of n choices) in the Chat Completions or Completions shape.

    prefix: the assistant message a chat continued, which the whole reply's content begins
    with (a stream sends only what was generated), as llama-server shows it."""

    def __init__(
        self,
        client: AsyncSlotwiseClient,
        model: str,
        *,
        chat: bool,
        body: SamplingRequest,
        prefix: str = "",
    ):
        self.client, self.model, self.chat, self.prefix = client, model, chat, prefix
        self.include_usage = _include_usage(body)
        self.per_token, self.progress = body.timings_per_token, body.return_progress
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.verbose_prompt: str | None = None  # llama-server's __verbose, when asked for

    def _frame(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }

    def usage(self, ends: list[TurnEnd]) -> dict[str, object]:
        prompt = ends[0].num_prompt_cells if ends else 0
        completion = sum(e.num_completion_tokens for e in ends)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": ends[0].num_reused_cells if ends else 0},
            "completion_tokens_details": {
                "reasoning_tokens": sum(e.num_reasoning_tokens for e in ends)
            },
            "slotwise": ends[0].slotwise_usage() if ends else {},
        }

    def whole(self, ends: list[TurnEnd]) -> dict[str, Any]:
        choices = []
        for i, end in enumerate(ends):
            choice: dict[str, Any] = {"index": i, "finish_reason": end.finish_reason}
            if self.chat:
                content = self.prefix + end.content
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": content if content or not end.calls else None,
                    "refusal": None,
                }
                if end.reasoning is not None:  # (llama-server's key, where there are thoughts)
                    message["reasoning_content"] = end.reasoning
                if end.calls:
                    message["tool_calls"] = [_tool_call(c) for c in end.calls]
                choice["message"] = message
                choice["logprobs"] = _chat_logprobs(end.logprobs) if end.logprobs else None
            else:
                choice["text"] = end.content
                choice["logprobs"] = _completion_logprobs(end.logprobs) if end.logprobs else None
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        out = {**self._frame(kind, choices), "usage": self.usage(ends)}
        if self.verbose_prompt is not None and ends:
            out["__verbose"] = self._verbose(ends[0])
        return {**out, "timings": ends[0].timings()} if ends else out

    def _verbose(self, end: TurnEnd) -> dict[str, Any]:
        """llama-server's __verbose: the first choice as its native API gives it, with the
        prompt as the chat template wrote it."""
        return {
            "index": 0,
            "content": self.prefix + end.content,
            "tokens": list(end.token_ids),
            "model": self.model,
            "prompt": self.verbose_prompt,
            "tokens_predicted": end.num_completion_tokens,
            "tokens_evaluated": end.num_prompt_cells,
            "tokens_cached": end.num_reused_cells,
            "timings": end.timings(),
        }

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any] | None,
        finish: str | None = None,
        logprobs: Any = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta or {}
            return self._frame("chat.completion.chunk", [choice])
        choice["text"] = (delta or {}).get("content", "")
        return self._frame("text_completion", [choice])

    def _progress(
        self, i: int, cache: int, total: int, done: int, clock: StreamClock
    ) -> dict[str, Any]:
        """llama-server's return_progress chunk: a role delta (or empty text) with the prompt's
        cells, those from the cache and those done."""
        chunk = self._chunk(i, {"role": "assistant", "content": None} if self.chat else {})
        chunk["prompt_progress"] = {
            "total": total,
            "cache": cache,
            "processed": done,
            "time_ms": int(clock.ms()),
        }
        if self.per_token:
            chunk["timings"] = clock.timings(cache, done - cache, 0)
        return chunk

    async def _tokens(self, turn: Turn) -> AsyncIterator[Text | Progress | TurnEnd]:
        """A choice's events, a Text a token (as llama-server streams them)."""
        async for event in turn.all_events():
            for one in await per_token(self.client, event) if isinstance(event, Text) else [event]:
                yield one

    async def stream(self, turns: list[Turn]) -> AsyncGenerator[str, None]:
        """Per choice: the role delta, content deltas, tool call deltas, the finishing chunk;
        then the usage chunk when asked, and [DONE]. A client that goes away cancels every
        choice's generation."""
        clocks = [StreamClock() for _ in turns]
        generated = [0] * len(turns)
        ends: list[TurnEnd] = []
        shown = [-1] * len(turns)  # the prompt's cells a progress chunk showed done
        try:
            # with return_progress the role comes after the progress (llama-server's order)
            waiting = list(range(len(turns))) if self.chat and self.progress else []
            if self.chat and not self.progress:
                for i in range(len(turns)):
                    yield sse.data(self._chunk(i, {"role": "assistant", "content": None}))
            events = interleaved([self._tokens(t) for t in turns])
            async with contextlib.aclosing(events):
                async for i, event in events:
                    started = turns[i].end.started
                    cache = started.num_reused_cells if started else 0
                    total = started.num_prompt_cells if started else 0
                    if self.progress and shown[i] < total:
                        done = cache + event.done if isinstance(event, Progress) else total
                        steps = [cache, done] if shown[i] < 0 and done > cache else [done]
                        for k in steps:
                            yield sse.data(self._progress(i, cache, total, k, clocks[i]))
                        shown[i] = done
                    if isinstance(event, Progress):
                        continue
                    if i in waiting:
                        waiting.remove(i)
                        yield sse.data(self._chunk(i, {"role": "assistant", "content": None}))
                    if isinstance(event, Text):
                        clocks[i].token()
                        generated[i] += len(event.token_ids)
                        lp = None
                        if event.logprobs:
                            lp = (_chat_logprobs if self.chat else _completion_logprobs)(
                                list(event.logprobs)
                            )
                        delta = {"reasoning_content": event.reasoning} if event.reasoning else {}
                        if event.text or (lp and not delta):
                            delta["content"] = event.text
                        if delta or lp:
                            chunk = self._chunk(i, delta, logprobs=lp)
                            if self.per_token:
                                chunk["timings"] = clocks[i].timings(
                                    cache, total - cache, generated[i]
                                )
                            yield sse.data(chunk)
                        continue
                    ends.append(event)
                    if self.chat:
                        for k, call in enumerate(event.calls):
                            opened = {"index": k, **_tool_call(call, arguments="")}
                            yield sse.data(self._chunk(i, {"tool_calls": [opened]}))
                            arguments = {"index": k, "function": {"arguments": call.arguments}}
                            yield sse.data(self._chunk(i, {"tool_calls": [arguments]}))
                    last = self._chunk(i, None, event.finish_reason)
                    if len(ends) == len(turns) and not self.include_usage:
                        last["timings"] = ends[0].timings()
                    yield sse.data(last)
            if self.include_usage:
                kind = "chat.completion.chunk" if self.chat else "text_completion"
                usage = {**self._frame(kind, []), "usage": self.usage(ends)}
                yield sse.data({**usage, "timings": ends[0].timings()})
            yield sse.DONE
        except ApiError as e:  # the headers are out: the error goes as data
            yield sse.data(e.body())
        finally:
            for turn in turns:
                await turn.close()


def _tool_call(call: ToolCall, arguments: str | None = None) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
        },
    }


def _chat_logprobs(infos: list[TokenLogprobs]) -> dict[str, Any]:
    return {"content": token_logprobs(infos), "refusal": None}


def _completion_logprobs(infos: list[TokenLogprobs]) -> dict[str, Any]:
    offsets, at = [], 0
    for lp in infos:
        offsets.append(at)
        at += len(piece_text(lp.chosen.piece))
    return {
        "tokens": [piece_text(lp.chosen.piece) for lp in infos],
        "token_logprobs": [lp.chosen.logprob for lp in infos],
        "top_logprobs": [{piece_text(t.piece): t.logprob for t in lp.top} for lp in infos],
        "text_offset": offsets,
    }


# -- Embeddings --------------------------------------------------------------------------------


async def embeddings(
    client: AsyncSlotwiseClient, body: EmbeddingRequest, model: str
) -> dict[str, Any]:
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts or not all(isinstance(t, str) for t in texts):
        raise bad_request(
            "input: give a string or a list of strings (token ids are the "
            "tokenizer's of another model)",
            "input",
        )
    out = await call(client.embed(texts, normalize=True))  # type: ignore[arg-type]
    if body.dimensions is not None and out and body.dimensions != len(out[0].values):
        raise bad_request(
            f"dimensions: this model's embeddings have {len(out[0].values)}", "dimensions"
        )
    data = []
    for i, one in enumerate(out):
        if body.encoding_format == "base64":  # (what the openai SDK asks for by default)
            packed = struct.pack(f"<{len(one.values)}f", *one.values)
            vector: Any = base64.b64encode(packed).decode()
        else:
            vector = list(one.values)
        data.append({"object": "embedding", "index": i, "embedding": vector})
    n = sum(one.num_tokens for one in out)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
