"""The OpenAI-compatible HTTP API: chat and raw completions (streamed as server-sent events or
not), models, health, readiness and Prometheus metrics, over AsyncSlotwiseClient.

A client that resends its whole conversation every turn (what OpenAI clients do) is served by
the engine's continuation rule: only the new messages are decoded, however often the
conversation was shifted, and `usage.prompt_tokens_details.cached_tokens` says how many cells
came from the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from clients.client import (
    AsyncSlotwiseClient,
    Delta,
    Finished,
    FinishReason,
    Message,
    Persistence,
    Prepared,
    Shift,
    SlotwiseError,
    Started,
)
from clients.gateway.errors import ApiError, bad_request, from_slotwise
from clients.gateway.media import MediaPolicy, image_bytes
from clients.gateway.schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    SamplingRequest,
)


@dataclass(frozen=True)
class GatewayConfig:
    prep_address: str
    infer_address: str
    model_name: str = "slotwise"
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    token: str | None = None  # bearer token for the gRPC services


_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
_SAVED = {Persistence.SAVED: True, Persistence.NOT_SAVED: False}  # else: not a session turn


def create_app(config: GatewayConfig) -> FastAPI:
    state: dict[str, AsyncSlotwiseClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if "client" in state:
            await state.pop("client").close()

    app = FastAPI(
        title="slotwise", summary="OpenAI-compatible API over slotwise", lifespan=lifespan
    )
    registry = CollectorRegistry()
    requests = Counter(
        "slotwise_http_requests", "HTTP requests", ["endpoint", "status"], registry=registry
    )
    latency = Histogram(
        "slotwise_http_request_seconds", "until the response (or its last chunk)", ["endpoint"],
        registry=registry,
    )  # fmt: skip
    tokens = Counter("slotwise_http_completion_tokens", "tokens generated", registry=registry)

    def client() -> AsyncSlotwiseClient:
        if "client" not in state:  # made on the server's loop, on first use
            state["client"] = AsyncSlotwiseClient(
                config.prep_address, config.infer_address, token=config.token, timeout=None
            )
        return state["client"]

    @app.middleware("http")
    async def edge(request: Request, call_next: Any) -> Response:
        path = request.url.path
        authorized = request.headers.get("authorization", "") == f"Bearer {config.api_key}"
        if config.api_key and path.startswith("/v1/") and not authorized:
            requests.labels(path, "401").inc()
            return ApiError(401, "incorrect or missing API key", code="invalid_api_key").response()
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")  # the template, never the raw path: bounded labels
        endpoint = getattr(route, "path", "unmatched")
        requests.labels(endpoint, str(response.status_code)).inc()
        latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(where) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        return bad_request(message, param).response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        serving = await client().serving()
        ok = all(serving.values())
        return JSONResponse({"ready": ok, "services": serving}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [_model_card(config.model_name)]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict[str, object]:
        _check_model(config, name)
        return _model_card(name)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        _check(config, body)
        messages = [await _message(m, i, config.media) for i, m in enumerate(body.messages)]
        return await _complete(
            client(), config, body, messages, chat=True, tokens=tokens,
            max_tokens=body.max_completion_tokens or body.max_tokens,
        )  # fmt: skip

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Response:
        _check(config, body)
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await _complete(
            client(), config, body, prompt, chat=False, tokens=tokens, max_tokens=body.max_tokens
        )

    return app


def _model_card(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "slotwise"}


def _check_model(config: GatewayConfig, name: str) -> None:
    if name != config.model_name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist here; this server has {config.model_name!r}",
            code="model_not_found",
            param="model",
        )


def _check(config: GatewayConfig, body: SamplingRequest) -> None:
    _check_model(config, body.model)
    name = body.unsupported()
    if name is not None:
        raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")


async def _message(m: ChatMessage, i: int, media: MediaPolicy) -> Message:
    role = "system" if m.role == "developer" else m.role
    if m.content is None or isinstance(m.content, str):
        return Message(role, m.content or "")
    parts: list[str | bytes] = []
    for j, part in enumerate(m.content):
        if isinstance(part, ImagePart):
            param = f"messages.{i}.content.{j}.image_url"
            parts.append(await image_bytes(part.image_url.url, media, param))
        else:
            parts.append(part.text)
    return Message(role, parts)


def _options(body: SamplingRequest, max_tokens: int | None, prepared: Prepared, keep_system: bool):
    o = body.slotwise
    keep = o.keep if isinstance(o.keep, int) else (prepared.num_cells_of(0) if keep_system else 0)
    stop = body.stop if body.stop is not None else ()
    return {
        "max_tokens": max_tokens or 0,
        "stop": stop,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repeat_penalty": body.repeat_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "policy": o.policy,
        "keep": keep,
        "discard_fraction": o.discard_fraction,
        "unit": o.unit,
        "truncate_prompt": o.truncate,
    }


def conversation_key(prompt: Sequence[Message] | str) -> str:
    """The replica a stateless conversation is routed to (x-slotwise-session behind a proxy):
    a digest of how it begins -- its messages up to and including the first user message, or a
    completion prompt's first 512 characters -- which every continuation resends unchanged, so
    that they land where their cache is."""
    h = hashlib.blake2b(digest_size=12)
    if isinstance(prompt, str):
        h.update(prompt[:512].encode())
    else:
        for message in prompt:
            h.update(message.role.encode() + b"\0")
            for part in message.parts:
                data = part.encode() if isinstance(part, str) else bytes(part)  # type: ignore[arg-type]
                h.update(hashlib.blake2b(data, digest_size=16).digest())
            if message.role == "user":
                break
    return f"conversation-{h.hexdigest()}"


async def _complete(
    client: AsyncSlotwiseClient,
    config: GatewayConfig,
    body: SamplingRequest,
    prompt: Sequence[Message] | str,
    *,
    chat: bool,
    tokens: Counter,
    max_tokens: int | None,
) -> Response:
    session_id = body.slotwise.session_id
    first = 0
    try:
        if session_id and chat:
            first = await _session_first_message(client, session_id, prompt)  # type: ignore[arg-type]
        prepared = await client.prepare(prompt, first_message=first)
        keep_system = (
            chat and first == 0 and isinstance(prompt, list) and prompt[0].role == "system"
        )
        options = _options(body, max_tokens, prepared, keep_system)
        if session_id and first > 0:  # a session keeps its own pins
            options.pop("keep")
        if session_id and first == 0:
            await _create_session(client, session_id, options)
        affinity = "" if session_id else conversation_key(prompt)
        events = client.generate(
            prepared, session_id=session_id or "", affinity=affinity, **options
        )
        # the first event says whether it was admitted: refusals get their HTTP status
        first_event = await anext(events)
    except SlotwiseError as e:
        raise from_slotwise(e) from None
    except (ValueError, TypeError) as e:  # a value the contract cannot carry
        raise bad_request(str(e)) from None
    reply = _Reply(chat, config.model_name, body)
    if body.stream:
        return StreamingResponse(
            reply.sse(first_event, events, tokens), media_type="text/event-stream"
        )
    try:
        reply.take(first_event)
        async for event in events:
            reply.take(event)
    except SlotwiseError as e:
        if not reply.completed_despite(e):
            raise from_slotwise(e) from None
    tokens.inc(reply.num_completion_tokens)
    headers = {"x-slotwise-warning": reply.warning} if reply.warning else None
    return JSONResponse(reply.whole(), headers=headers)


async def _session_first_message(
    client: AsyncSlotwiseClient, session_id: str, messages: Sequence[Message]
) -> int:
    """A session turn sends the conversation from the last reply on (it holds the rest)."""
    try:
        info = await client.get_session(session_id)
    except SlotwiseError as e:
        if e.reason == "SESSION_NOT_FOUND":
            return 0
        raise
    if info.num_turns == 0:
        return 0
    replies = [i for i, m in enumerate(messages) if m.role == "assistant"]
    return replies[-1] if replies else 0


async def _create_session(
    client: AsyncSlotwiseClient, session_id: str, options: dict[str, Any]
) -> None:
    context = {k: options[k] for k in ("policy", "keep", "discard_fraction", "unit")}
    try:
        await client.create_session(
            session_id, truncate_prompt=options["truncate_prompt"], **context
        )
    except SlotwiseError as e:
        if e.reason != "SESSION_EXISTS":
            raise


class _Reply:
    """One completion, gathered from the engine's events into the API's shapes."""

    def __init__(self, chat: bool, model: str, body: SamplingRequest):
        self.chat, self.model = chat, model
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text: list[str] = []
        self.started: Started | None = None
        self.finished: Finished | None = None
        self.num_shifts = 0
        self.evicted_media: set[str] = set()
        self.warning = ""

    def completed_despite(self, e: SlotwiseError) -> bool:
        """A session turn that completed but was not saved is still a reply: the client gets
        it with a warning (an error status would make SDKs retry a turn that happened)."""
        if e.finished is None or e.reason != "SESSION_NOT_SAVED":
            return False
        self.take(e.finished)
        self.warning = f"the turn was not saved: {e.message}"
        return True

    @property
    def num_completion_tokens(self) -> int:
        return self.finished.usage.num_generated_tokens if self.finished else 0

    def take(self, event: object) -> str:
        """Record an event; returns the text it adds."""
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Delta):
            self.text.append(event.text)
            return event.text
        elif isinstance(event, Shift):
            self.num_shifts += 1
            self.evicted_media.update(event.media_ids_evicted)
        elif isinstance(event, Finished):
            self.finished = event
        return ""

    @property
    def finish_reason(self) -> str:
        assert self.finished is not None
        return _FINISH.get(self.finished.reason, "stop")

    def usage(self) -> dict[str, object]:
        u = self.finished.usage if self.finished else None
        s = self.started
        prompt = u.num_prompt_cells if u else 0
        completion = u.num_generated_tokens if u else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.num_reused_cells if u else 0},
            "slotwise": {
                "prompt_positions": u.num_prompt_positions if u else 0,
                "decoded_prompt_cells": prompt - (u.num_reused_cells if u else 0),
                "capacity_cells": s.num_capacity_cells if s else 0,
                "shifts": u.num_shifts if u else 0,
                "evicted_cells": u.num_evicted_cells if u else 0,
                "evicted_images": len(self.evicted_media),
                "truncated_cells": s.num_truncated_cells if s else 0,
                "truncated_images": len(set(s.truncated_media_ids)) if s else 0,
                "saved": _SAVED.get(self.finished.persistence) if self.finished else None,
            },
        }

    def whole(self) -> dict[str, object]:
        text = "".join(self.text)
        choice: dict[str, object] = {"index": 0, "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def chunk(
        self, delta: dict[str, str] | None = None, finish: str | None = None
    ) -> dict[str, object]:
        choice: dict[str, object] = {"index": 0, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice.update(text=(delta or {}).get("content", ""), logprobs=None)
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    async def sse(
        self, first: object, events: AsyncIterator[object], tokens: Counter
    ) -> AsyncIterator[str]:
        """role delta, content deltas, the finishing chunk, the usage chunk when asked,
        [DONE]. A client that goes away cancels the generation (the events' call)."""
        if self.chat:
            yield _sse(self.chunk({"role": "assistant", "content": ""}))
        try:
            self.take(first)
            async for event in events:
                text = self.take(event)
                if text:
                    yield _sse(self.chunk({"content": text}))
        except SlotwiseError as e:  # the headers are out: the error goes as an event
            if not self.completed_despite(e):
                yield _sse(from_slotwise(e).body())
                return
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        tokens.inc(self.num_completion_tokens)
        yield _sse(self.chunk(None, self.finish_reason))
        if self.include_usage:
            yield _sse({**self.chunk(), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


def _sse(body: object) -> str:
    return f"data: {json.dumps(body)}\n\n"
