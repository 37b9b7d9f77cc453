"""One generation as every HTTP API needs it, whatever its shape.

An API module turns its request body into a `TurnRequest`; `start_turn` prepares the prompt
(tools shown the way the template shows them), starts the generation (a constraint, biases,
log-probabilities, a session turn) and waits for admission, so that a refusal still gets its
HTTP status; the `Turn` then yields the reply's text as it streams and ends with `TurnEnd`:
the content and tool calls read back in the template's format, the finish reason, usage.
"""

from __future__ import annotations

import codecs
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from clients.client import (
    AsyncSlotwiseClient,
    Audio,
    Constraint,
    Delta,
    Finished,
    FinishReason,
    Message,
    Persistence,
    Prefill,
    Prepared,
    Reasoning,
    ReasoningOptions,
    Shift,
    SlotwiseError,
    Speculative,
    Started,
    TokenLogprobs,
    ToolCall,
    ToolFormat,
    ToolOptions,
)
from clients.gateway.errors import ApiError, bad_request, from_slotwise
from clients.reasoning import ThoughtStream
from clients.tool_calls import ReplyStream

_SAVED = {Persistence.SAVED: True, Persistence.NOT_SAVED: False}  # else: not a session turn


@dataclass(frozen=True)
class Keep:
    """What a request pins: a number of cells, or the system message (the default)."""

    cells: int | None = None  # None: the system message's cells, when the chat begins with one


@dataclass(frozen=True)
class Thinking:
    """What a request asks of a reasoning model's thoughts: where they go (`format`,
    llama-server's reasoning_format: deepseek, or deepseek-legacy, which this llama-server
    answers alike, puts them apart; none leaves them in the content, the generation prompt's
    start in front), a budget of thought tokens (None: none) ended by `message` and the
    template's end, and the template's variables (chat_template_kwargs: enable_thinking,
    ...). `asked`: the request's own parameter asking for thoughts, refused (naming it) on a
    model whose template writes none; the rest is a reasoning model's only."""

    format: str = "deepseek"
    budget: int | None = None
    message: str = ""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    asked: str = ""

    @property
    def apart(self) -> bool:
        return self.format != "none"


@dataclass
class TurnRequest:
    prompt: Sequence[Message] | str | Prepared  # a chat, a raw prompt, or one prepared already
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, seed, ...
    context: dict[str, Any] = field(default_factory=dict)  # policy, discard_fraction, ...
    keep: Keep = Keep()
    tools: ToolOptions | None = None
    constraint: Constraint | None = None  # a response format or a grammar
    constraint_param: str = "response_format"  # the API's name for it, in errors
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    session_id: str | None = None  # a server-side session's turn
    first_message: int | None = None  # a session turn's first new message (None: found)
    create_session: bool = False  # the session is new: create it first
    expect_turns: int | None = None  # a session turn: only if it has this many turns
    cache_salt: str = ""  # KV reused only between requests of the same salt (and tenant)
    speculative: Speculative | None = None  # drafts verified in the batch (None: the server's)
    ignore_eos: bool = False  # end-of-generation tokens are never sampled
    lora: Sequence[tuple[int, float]] = ()  # LoRA adapter (id, scale); (): the server's scales
    note: Callable[[Prepared], bytes] | None = None  # a session turn's note, once prepared
    thinking: Thinking = Thinking()  # a reasoning model's thoughts


@dataclass
class Text:
    """Reply content as it streams (held back where tool calls may begin), and a reasoning
    model's thoughts apart (`reasoning`)."""

    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    token_ids: tuple[int, ...] = ()  # the tokens sampled (without tools: this text's)
    reasoning: str = ""


@dataclass
class Progress:
    """The prompt's cells decoded so far (Turn.all_events)."""

    done: int
    total: int


@dataclass
class TurnEnd:
    content: str  # what the reply says (its tool calls taken out)
    calls: tuple[ToolCall, ...]
    raw_text: str  # what the model wrote
    finished: Finished | None
    started: Started | None
    num_shifts: int = 0
    evicted_media: set[str] = field(default_factory=set)
    warning: str = ""  # a completed session turn that was not saved
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every token sampled
    media: list[dict[str, Any]] = field(default_factory=list)  # prompt_media: the turn's own
    reasoning: str | None = None  # a reasoning model's thoughts, apart (None: none)
    num_reasoning_tokens: int = 0  # the thoughts' tokens, their start and end included

    @property
    def finish_reason(self) -> str:
        """OpenAI's words: tool_calls, stop or length."""
        if self.calls:
            return "tool_calls"
        if self.finished is not None and self.finished.reason is FinishReason.LENGTH:
            return "length"
        return "stop"

    @property
    def num_prompt_cells(self) -> int:
        return self.finished.usage.num_prompt_cells if self.finished else 0

    @property
    def num_reused_cells(self) -> int:
        return self.finished.usage.num_reused_cells if self.finished else 0

    @property
    def num_completion_tokens(self) -> int:
        return self.finished.usage.num_generated_tokens if self.finished else 0

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings` of the turn, by the engine's clock."""
        u = self.finished.usage if self.finished else None
        if u is None:
            return llama_timings(0, 0, 0.0, 0, 0.0)
        out = llama_timings(
            u.num_reused_cells,
            u.num_prompt_cells - u.num_reused_cells,
            u.prefill_seconds * 1000,
            u.num_generated_tokens,
            u.decode_seconds * 1000,
        )
        if u.num_draft_tokens:
            out |= {"draft_n": u.num_draft_tokens, "draft_n_accepted": u.num_accepted_tokens}
        return out

    def slotwise_usage(self) -> dict[str, object]:
        """slotwise's own numbers beside an API's usage."""
        u = self.finished.usage if self.finished else None
        s = self.started
        prompt = u.num_prompt_cells if u else 0
        return {
            "prompt_positions": u.num_prompt_positions if u else 0,
            "decoded_prompt_cells": prompt - (u.num_reused_cells if u else 0),
            "capacity_cells": s.num_capacity_cells if s else 0,
            "shifts": u.num_shifts if u else 0,
            "evicted_cells": u.num_evicted_cells if u else 0,
            "evicted_images": len(self.evicted_media),  # (its first name: sounds count too)
            "evicted_media": len(self.evicted_media),  # images and sounds, each left whole
            "truncated_cells": s.num_truncated_cells if s else 0,
            "truncated_images": len(set(s.truncated_media_ids)) if s else 0,
            "saved": _SAVED.get(self.finished.persistence) if self.finished else None,
            "draft_tokens": u.num_draft_tokens if u else 0,
            "accepted_tokens": u.num_accepted_tokens if u else 0,
            "drafts_by_type": {
                str(d.type): {
                    "draft_tokens": d.num_draft_tokens,
                    "accepted_tokens": d.num_accepted_tokens,
                    "cache_hits": d.num_cache_hits,
                }
                for d in (u.drafts_by_type if u else ())
            },
            "finish": self.finished.reason.value if self.finished else "unspecified",
            "media": self.media,
        }


class Turn:
    """A started generation: `events()` yields Text and then one TurnEnd."""

    def __init__(
        self,
        first: object,
        events: AsyncIterator[object],
        fmt: ToolFormat,
        reasoning: Reasoning | None = None,
        thinking: Thinking = Thinking(),
        client: AsyncSlotwiseClient | None = None,
    ):
        self._first, self._events, self._client = first, events, client
        self._reply = ReplyStream(fmt) if fmt is not ToolFormat.UNSPECIFIED else None
        self.end = TurnEnd("", (), "", None, None)
        self._pieces: list[str] = []  # what the model wrote
        self._shown: list[str] = []  # what of it was shown as content (joined at the end)
        # thoughts apart, or (format none) in the content, after the thought the prompt opened
        apart = reasoning is not None and thinking.apart
        self._thoughts = ThoughtStream(reasoning) if reasoning is not None and apart else None
        opened = reasoning is not None and reasoning.started and not apart
        self._lead = reasoning.start + reasoning.opened_text if reasoning and opened else ""
        self._content: list[str] = []  # the content before tools are read out of it

    async def events(self) -> AsyncIterator[Text | TurnEnd]:
        every = self.all_events()
        try:
            async for event in every:
                if not isinstance(event, Progress):
                    yield event
        finally:
            await every.aclose()

    async def all_events(self) -> AsyncGenerator[Text | Progress | TurnEnd, None]:
        """events(), and the prompt's Progress while it is decoded."""
        try:
            event: object | None = self._first
            while event is not None:
                for one in await self._tokens(event):
                    text = self._take(one)
                    if text is not None:
                        yield text
                event = await anext(self._events, None)
        except SlotwiseError as e:
            if not self._completed_despite(e):
                raise from_slotwise(e) from None
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
        end = self.end
        end.raw_text = "".join(self._pieces)
        if self._thoughts is not None:
            thought, rest = self._thoughts.finish()
            self._content.append(rest)
            last = self._reply.push(rest) if self._reply is not None else rest
            self._shown.append(last)
            if thought or last:
                yield Text(last, reasoning=thought)
            end.reasoning = self._thoughts.whole.reasoning
        if self._reply is not None:
            reply = self._reply.finish()
            shown = "".join(self._shown)
            end.calls = reply.calls
            end.content = shown + reply.content
            if end.calls and not end.content.strip():
                end.content = ""  # (the blank line before the calls is no answer)
            elif reply.content:
                yield Text(reply.content)
        else:
            end.content = "".join(self._content)
        yield end

    async def _tokens(self, event: object) -> list[object]:
        """A Delta of several tokens (sent together when the reader fell behind) as one a
        token, where thoughts are read out of it: a thought ends at a token, and each token's
        text is counted as the thoughts' or the content's (llama-server streams them so)."""
        several = isinstance(event, Delta) and len(event.token_ids) > 1
        if not several or self._thoughts is None or self._client is None:
            return [event]
        assert isinstance(event, Delta)
        one = await per_token(self._client, Text(event.text, event.logprobs, event.token_ids))
        return [Delta(t.token_ids, t.text, t.logprobs) for t in one]

    async def whole(self) -> TurnEnd:
        async for _ in self.events():
            pass
        return self.end

    @property
    def admitted(self) -> Started | None:
        """The admission (the prompt's cells, those reused), known once start_turn returns."""
        return self._first if isinstance(self._first, Started) else None

    async def close(self) -> None:
        """End the generation if it still runs (a client gone, another choice refused)."""
        await self._events.aclose()  # type: ignore[attr-defined]

    def _take(self, event: object) -> Text | Progress | None:
        end = self.end
        if isinstance(event, Started):
            end.started = event
        elif isinstance(event, Prefill):
            return Progress(event.num_cells_done, event.num_cells_total)
        elif isinstance(event, Delta):
            self._pieces.append(event.text)
            end.logprobs.extend(event.logprobs)
            end.token_ids.extend(event.token_ids)
            text, thought = self._lead + event.text, ""
            self._lead = ""
            if self._thoughts is not None:
                inside = self._thoughts.inside
                thought, text = self._thoughts.push(text)
                if inside or self._thoughts.inside:  # (a token that ends them is theirs)
                    end.num_reasoning_tokens += len(event.token_ids)
            self._content.append(text)
            shown = self._reply.push(text) if self._reply is not None else text
            if self._reply is not None:
                self._shown.append(shown)
            plain = self._reply is None and self._thoughts is None
            if shown or thought or event.logprobs or (plain and event.token_ids):
                return Text(shown, event.logprobs, event.token_ids, thought)
        elif isinstance(event, Shift):
            end.num_shifts += 1
            end.evicted_media.update(event.media_ids_evicted)
        elif isinstance(event, Finished):
            end.finished = event
        return None

    def _completed_despite(self, e: SlotwiseError) -> bool:
        """A session turn that completed but was not saved is still a reply: the client gets
        it with a warning (an error status would make SDKs retry a turn that happened)."""
        if e.finished is None or e.reason != "SESSION_NOT_SAVED":
            return False
        self._take(e.finished)
        self.end.warning = f"the turn was not saved: {e.message}"
        return True


async def start_turn(client: AsyncSlotwiseClient, req: TurnRequest) -> tuple[Turn, Prepared]:
    """Prepare and start the generation; refusals (the prompt, the queue, a session) raise
    ApiError before any byte of the reply is sent."""
    try:
        first = 0
        given = req.prompt if isinstance(req.prompt, Prepared) else None
        messages = req.prompt if not isinstance(req.prompt, str | Prepared) else None
        if req.session_id and messages is not None:
            if req.first_message is not None:
                first = req.first_message
            else:
                messages, first = await _session_turn(client, req.session_id, messages)
        tools = req.tools if messages is not None else None
        prepared = given or await client.prepare(
            messages if messages is not None else req.prompt,  # type: ignore[arg-type]
            first_message=first,
            tools=tools,
            template_kwargs=req.thinking.kwargs if messages is not None else None,
        )
        reasoning = await reasoning_options(client, req.thinking, prepared)
        constraint = req.constraint
        if prepared.tool_constraint is not None:
            if constraint is not None:
                raise bad_request(
                    "a response format (or grammar) and tool calls cannot constrain one reply "
                    "together here: give one of them",
                    req.constraint_param,
                )
            constraint = prepared.tool_constraint
        options = _options(req, prepared, first, messages)
        if req.expect_turns is not None:
            options["expect_turns"] = req.expect_turns
        if req.session_id and (req.create_session or (first == 0 and messages is not None)):
            await _create_session(client, req.session_id, options, required=req.create_session)
        if req.session_id and first > 0:
            options.pop("keep")  # a session keeps its own pins
        affinity = "" if req.session_id else conversation_key(req.prompt)
        events = client.generate(
            prepared,
            session_id=req.session_id or "",
            affinity=affinity,
            constraint=constraint,
            logit_bias=req.logit_bias or None,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            turn_note=req.note(prepared) if req.note is not None else b"",
            cache_salt=req.cache_salt,
            speculative=req.speculative,
            ignore_eos=req.ignore_eos,
            lora=req.lora or None,
            reasoning=reasoning,
            **options,
        )
        try:
            first_event = await anext(events)  # admitted, or refused with its own status
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise
    except SlotwiseError as e:
        refused = from_slotwise(e)
        if refused.param and refused.param.startswith("constraint"):  # in the API's words
            refused.param = req.constraint_param if req.constraint is not None else "tools"
        raise refused from None
    except (ValueError, TypeError) as e:  # a value the contract cannot carry
        raise bad_request(str(e)) from None
    fmt = prepared.tool_format if prepared.tool_constraint is not None else ToolFormat.UNSPECIFIED
    turn = Turn(first_event, events, fmt, prepared.reasoning, req.thinking, client)
    turn.end.media = prompt_media(prepared)
    return turn, prepared


async def reasoning_options(
    client: AsyncSlotwiseClient, thinking: Thinking, prepared: Prepared
) -> ReasoningOptions | None:
    """The generation's thoughts, where the template writes them (a request that asked for
    them of a model whose template writes none is refused, naming what it asked with)."""
    reasoning = prepared.reasoning
    if reasoning is None:
        if thinking.asked:
            raise refuse(thinking.asked, "needs a reasoning model: this model's chat template "
                         "writes no thoughts")  # fmt: skip
        return None
    message: Sequence[int] = ()
    if thinking.budget is not None and thinking.message:
        message = (await client.tokenize(thinking.message, parse_special=True)).token_ids
    return reasoning.options(thinking.budget, message)


def _options(
    req: TurnRequest, prepared: Prepared, first: int, messages: Sequence[Message] | None
) -> dict[str, Any]:
    keep = req.keep.cells
    if keep is None:
        system = first == 0 and messages is not None and messages[0].role == "system"
        keep = system_cells(prepared) if system else 0
    return {
        "max_tokens": req.max_tokens or 0,
        "stop": tuple(req.stop),
        "keep": keep,
        **{k: v for k, v in req.sampling.items() if v is not None},
        **{k: v for k, v in req.context.items() if v is not None},
    }


def system_cells(prepared: Prepared) -> int:
    """The cells that hold the system message: its own, or, where the chat template renders it
    inside the first user message (Gemma's has no system turn), that message's whole."""
    own = prepared.num_cells_of(0)
    if own or not prepared.prompt.chunks:
        return own
    return prepared.num_cells_of(min(c.message_index for c in prepared.prompt.chunks))


async def _session_turn(
    client: AsyncSlotwiseClient, session_id: str, messages: Sequence[Message]
) -> tuple[Sequence[Message], int]:
    """A session turn sends the conversation from the last reply on (the session holds the
    rest): the messages to render and the first of them to send. A turn that brings only its
    new messages gets the session's last reply put in front of them (after a stand-in user
    turn, so that the template writes it as it writes any reply): the reply stays in the
    session, where the engine finds the turn repeating it."""
    try:
        info = await client.get_session(session_id, num_records=1)
    except SlotwiseError as e:
        if e.reason == "SESSION_NOT_FOUND":
            return messages, 0
        raise
    if info.num_turns == 0:
        return messages, 0
    replies = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if replies:
        k, record = replies[-1], info.records[-1].text if info.records else ""
        sent = messages[k].text
        if sent and record != sent and record.endswith(sent) and not messages[k].tool_calls:
            # (a reasoning model's reply, sent back without its thoughts: the session holds
            # it as the model wrote it, which the turn repeats)
            messages = [*messages[:k], Message.assistant(record), *messages[k + 1 :]]
        return messages, k
    if not info.records:
        return messages, 0
    reply = Message.assistant(info.records[-1].text)
    return [Message.user(" "), reply, *messages], 1


async def _create_session(
    client: AsyncSlotwiseClient, session_id: str, options: dict[str, Any], *, required: bool
) -> None:
    context = {
        k: options[k] for k in ("policy", "keep", "discard_fraction", "unit") if k in options
    }
    try:
        await client.create_session(
            session_id, truncate_prompt=options.get("truncate_prompt"), **context
        )
    except SlotwiseError as e:
        if required or e.reason != "SESSION_EXISTS":
            raise


async def per_token(client: AsyncSlotwiseClient, text: Text) -> list[Text]:
    """A Text of several tokens (the engine sends them together when the reader falls behind)
    as one Text per token, the way llama-server streams them. Where the tokens' pieces do not
    add up to the text (a stop string held back, a tool call, a character cut between two
    Texts), the text stays whole, with the last token."""
    ids = text.token_ids
    if len(ids) < 2 or text.reasoning:
        return [text]
    parts: list[str] = []
    try:
        if len(text.logprobs) == len(ids):  # (the pieces came with them)
            pieces: Sequence[bytes] = [lp.chosen.piece for lp in text.logprobs]
        else:
            pieces = (await client.detokenize(ids)).pieces
        decoder = codecs.getincrementaldecoder("utf-8")()
        parts = [decoder.decode(p) for p in pieces]
    except (SlotwiseError, UnicodeDecodeError):
        parts = []
    if len(parts) != len(ids) or "".join(parts) != text.text:
        parts = [""] * (len(ids) - 1) + [text.text]
    lps = text.logprobs
    return [Text(parts[k], lps[k : k + 1], (t,)) for k, t in enumerate(ids)]


def llama_timings(
    cache: int, prompt_n: int, prompt_ms: float, gen: int, gen_ms: float
) -> dict[str, Any]:
    """llama-server's timings object (server_slot_stats): per token and per second over the
    prompt's decoded cells, and over the decode steps (the first token comes with the prompt)."""
    steps = max(gen - 1, 0)
    return {
        "cache_n": cache,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
        "predicted_n": gen,
        "predicted_ms": gen_ms,
        "predicted_per_token_ms": gen_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / gen_ms * steps if gen_ms > 0 else 0.0,
    }


class StreamClock:
    """llama-server's timings mid-stream (timings_per_token), by the gateway's clock: the
    engine's own come with the end of the turn."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first = 0.0  # when the first token came

    def token(self) -> None:
        self.first = self.first or time.perf_counter()

    def ms(self) -> float:
        """Since the stream began."""
        return (time.perf_counter() - self.t0) * 1000

    def timings(self, cache: int, prompt_n: int, gen: int) -> dict[str, Any]:
        now = time.perf_counter()
        prompt_ms = ((self.first or now) - self.t0) * 1000
        gen_ms = (now - self.first) * 1000 if self.first else 0.0
        return llama_timings(cache, prompt_n, prompt_ms, gen, gen_ms)


def conversation_key(prompt: Sequence[Message] | str | Prepared) -> str:
    """The replica a stateless conversation is routed to (x-slotwise-session behind a proxy):
    a digest of how it begins -- its messages up to and including the first user message, or a
    completion prompt's first 512 characters (or tokens) -- which every continuation resends
    unchanged, so that they land where their cache is."""
    h = hashlib.blake2b(digest_size=12)
    if isinstance(prompt, Prepared):
        ids = [t for c in prompt.prompt.chunks for t in c.text.token_ids][:512]
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in ids))
    elif isinstance(prompt, str):
        h.update(prompt[:512].encode())
    else:
        for message in prompt:
            h.update(message.role.encode() + b"\0")
            for part in message.parts:
                h.update(hashlib.blake2b(_part_bytes(part), digest_size=16).digest())
            if message.role == "user":
                break
    return f"conversation-{h.hexdigest()}"


def _part_bytes(part: object) -> bytes:
    """What of a message's part the conversation key digests (a sound: its file or samples)."""
    if isinstance(part, str):
        return part.encode()
    if isinstance(part, Audio):  # (the edges send a file's bytes; a path is not read here)
        return part.pcm or (b"" if isinstance(part.data, PathLike) else bytes(part.data or b""))
    return bytes(part)  # type: ignore[call-overload]


def prompt_media(prepared: Prepared) -> list[dict[str, Any]]:
    """The prompt's images and sounds, in order: each one's media id, kind and cells (a sound
    longer than the projector's window is several chunks of one id). The web page tells a
    sound's cells from an image's by these ids (the KV view names media by id alone)."""
    out: dict[str, dict[str, Any]] = {}
    for c in prepared.prompt.chunks:
        if c.WhichOneof("kind") != "media":
            continue
        kind = "audio" if c.media.WhichOneof("pixels") in ("audio", "pcm") else "image"
        one = out.setdefault(c.media.media_id, {"id": c.media.media_id, "kind": kind, "cells": 0})
        one["cells"] += c.media.num_cells
    return list(out.values())


def refuse(name: str, why: str = "is not supported by this server") -> ApiError:
    return bad_request(f"{name} {why}", name, "unsupported_parameter")
