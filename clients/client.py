"""Python clients for slotwise: `SlotwiseClient` (blocking) and `AsyncSlotwiseClient` (grpc.aio).

Both speak to the two services through the generated stubs in `slotwise.v1` only:

    with SlotwiseClient("localhost:50051", "localhost:50052") as client:
        conversation = [Message.system("Be brief."), Message.user(Path("cat.png"), "What is this?")]
        for event in client.chat(conversation, max_tokens=64):
            if isinstance(event, Delta):
                print(event.text, end="", flush=True)

Inputs are small `Message`s whose parts are text (`str`) or images (encoded `bytes`, a
`pathlib.Path`, a PIL image when Pillow is installed, or, for `count` only, an `ImageSize` /
`(width, height)` tuple). `generate` yields typed, frozen events: `Started`, `Prefill`,
`Delta`, `Shift`, `Finished`.

Calls that cannot change anything (GetModelInfo, Prepare, CountTokens, Tokenize, Detokenize,
GetServerInfo, GetSession, ListSessions, health Check) have a default deadline and are retried
by the gRPC channel itself while the server is UNAVAILABLE (its service config's retryPolicy, see
clients/channels.py). Generate is never retried and has no deadline unless one is asked for.
Every gRPC failure is raised as `SlotwiseError` (a `grpc.RpcError` with `code()` and
`details()`).

The parts: clients/types.py (inputs and results), clients/enums.py (the enums and their one
proto mapping), clients/events.py (a generation's events), clients/errors.py, clients/requests.py
(request builders), clients/channels.py (channels, TLS, the retry service config) and
clients/calls.py, the implementation: every RPC built as a `Call` (channel, method, request,
deadline, how the answer is read). The two clients here only make those calls, one line a
method: the blocking one on grpc's own blocking channel, the asyncio one on grpc.aio. The
blocking client is not the asyncio one run on a private event loop: that would need a loop
thread per client, break when called from inside a running loop, and turn cancellation and
shutdown into cross-thread problems, where grpc's blocking stubs have none of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import grpc
import grpc.aio

from clients.calls import DEFAULT_TIMEOUT, Call, Calls, EventReader
from clients.channels import (
    DEFAULT_MAX_MESSAGE_BYTES,
    NO_RETRY,
    RetryPolicy,
    Tls,
    channel_options,
    service_config,
)
from clients.enums import (
    FinishReason,
    Persistence,
    Policy,
    SpecType,
    ToolChoice,
    ToolFormat,
    Unit,
)
from clients.errors import SlotwiseError
from clients.events import (
    Completion,
    Delta,
    Event,
    Finished,
    Prefill,
    Shift,
    Started,
    TokenLogprob,
    TokenLogprobs,
    Usage,
    acollect,
    collect,
    event_from_pb,
)
from clients.requests import (
    ToolOptions,
    chat_pb,
    context_pb,
    count_request,
    create_session_request,
    generate_request,
    image_pb,
    prepare_request,
    sampling_pb,
)
from clients.types import (
    Audio,
    ChunkCount,
    Constraint,
    Count,
    Embedding,
    EngineStats,
    ImageInput,
    ImageSize,
    LoraAdapter,
    Message,
    ModelInfo,
    Part,
    Prepared,
    PromptInput,
    Reasoning,
    ReasoningOptions,
    ServerInfo,
    SessionInfo,
    Speculative,
    Tokens,
    Tool,
    ToolCall,
    TurnRecord,
)
from slotwise.v1 import infer_pb2, prompt_pb2

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT",
    "NO_RETRY",
    "AsyncSlotwiseClient",
    "ChunkCount",
    "Completion",
    "Constraint",
    "Count",
    "Delta",
    "Embedding",
    "EngineStats",
    "Event",
    "FinishReason",
    "Finished",
    "ImageInput",
    "ImageSize",
    "LoraAdapter",
    "Message",
    "ModelInfo",
    "Part",
    "Persistence",
    "Policy",
    "Prefill",
    "Prepared",
    "PromptInput",
    "Reasoning",
    "ReasoningOptions",
    "RetryPolicy",
    "ServerInfo",
    "SessionInfo",
    "Shift",
    "SlotwiseClient",
    "SlotwiseError",
    "SpecType",
    "Speculative",
    "Started",
    "Tls",
    "TokenLogprob",
    "TokenLogprobs",
    "Tokens",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolFormat",
    "ToolOptions",
    "TurnRecord",
    "Unit",
    "Usage",
    "acollect",
    "channel_options",
    "chat_pb",
    "collect",
    "context_pb",
    "count_request",
    "create_session_request",
    "event_from_pb",
    "generate_request",
    "image_pb",
    "prepare_request",
    "sampling_pb",
    "service_config",
]

T = TypeVar("T")

PromptOrPrepared: TypeAlias = Prepared | prompt_pb2.PreparedPrompt | PromptInput


class _Client:
    """What both clients are made of: the shared Calls, and a stub for each of them."""

    _aio = False

    def __init__(
        self,
        prep_address: str | None = None,
        infer_address: str | None = None,
        *,
        tls: Tls | None = None,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        retry: RetryPolicy = RetryPolicy(),
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metadata: Sequence[tuple[str, str]] = (),
        compression: grpc.Compression | None = None,
    ):
        self._calls = Calls(
            prep_address,
            infer_address,
            tls=tls,
            token=token,
            timeout=timeout,
            retry=retry,
            max_message_bytes=max_message_bytes,
            metadata=metadata,
            compression=compression,
        )
        self._channels = self._calls.open_channels(aio=self._aio)
        self._stubs = Calls.stubs(self._channels)

    def _start(self, call: Call[Any]) -> Any:
        """Start call on its stub: a response, a future (aio) or a response stream."""
        method = getattr(self._stubs[call.target, call.service], call.method)
        return method(call.request, **self._calls.kwargs(call))


class SlotwiseClient(_Client):
    """Blocking client for a PrepService and an InferService (either address may be omitted).

    timeout: default deadline in seconds for every call but Generate (None: no deadline).
    retry: how the channel retries UNAVAILABLE on the idempotent calls (clients/channels.py).
    token: sent as `authorization: Bearer <token>` on every call.
    compression: e.g. grpc.Compression.Gzip for every call (the services accept it); prep
    already sends images as their files, so it mostly helps long token lists.
    """

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> SlotwiseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, call: Call[T]) -> T:
        try:
            return call.read(self._start(call))
        except grpc.RpcError as e:
            raise SlotwiseError.from_rpc_error(e) from None

    def _stream(self, call: Call[None]) -> Generator[Event, None, None]:
        reader, responses = EventReader(), self._start(call)
        try:
            for pb in responses:
                event = reader.read(pb)
                if event is not None:
                    yield event
        except grpc.RpcError as e:
            raise reader.error(e) from None
        finally:
            if reader.finished is None:
                responses.cancel()

    # -- PrepService --------------------------------------------------------------------------

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return self._unary(self._calls.model_info(timeout))

    def prepare(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput | Audio] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
        tools: ToolOptions | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prepared:
        """Messages (chat template applied) or a raw prompt whose media markers take `images`.

        first_message: only the chunks of messages[first_message:] (a session turn).
        tools: shown to the model the way its template shows them; the result's
        tool_constraint (passed to generate) makes its calls valid, and
        clients.tool_calls.parse_reply(result.tool_format, text) reads them.
        template_kwargs: the template's variables beside the messages (llama-server's
        chat_template_kwargs, e.g. {"enable_thinking": False}); with a reasoning model's
        template the result's `reasoning` says where its thoughts are (clients.reasoning).
        """
        call = self._calls.prepare(
            prompt, images, add_special, first_message, timeout, tools, template_kwargs
        )
        return self._unary(call)

    def count(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput | Audio] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
        tools: ToolOptions | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Count:
        """Cells and positions without preparing; images may be ImageSize / (w, h) sizes."""
        call = self._calls.count(
            prompt, images, add_special, first_message, timeout, tools, template_kwargs
        )
        return self._unary(call)

    def tokenize(
        self,
        text: str,
        *,
        add_special: bool = False,
        parse_special: bool = True,
        with_pieces: bool = False,
        timeout: float | None = None,
        max_tokens: int = 0,
    ) -> Tokens:
        """The text's token ids as it is (no chat template, no media), as llama-server's
        /tokenize; with_pieces: each token's bytes too; max_tokens > 0: a text of more tokens
        is refused (OUT_OF_RANGE) before they are sent."""
        call = self._calls.tokenize(
            text, add_special, parse_special, with_pieces, timeout, max_tokens
        )
        return self._unary(call)

    def tokenize_batch(
        self,
        texts: Sequence[str],
        *,
        add_special: bool | Sequence[bool] = False,
        parse_special: bool = True,
        timeout: float | None = None,
    ) -> list[Tokens]:
        """Several texts in one call, each as tokenize does it (add_special: for all, or one
        per text); at most slotwise_core.limits.MAX_TOKENIZE_TEXTS."""
        return self._unary(self._calls.tokenize_batch(texts, add_special, parse_special, timeout))

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> Tokens:
        """Each token's bytes and the text they make."""
        return self._unary(self._calls.detokenize(token_ids, timeout))

    # -- InferService -------------------------------------------------------------------------

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return self._unary(self._calls.server_info(timeout))

    def generate(
        self,
        prompt: PromptOrPrepared,
        images: Sequence[ImageInput | Audio] = (),
        *,
        timeout: float | None = None,
        prepare_timeout: float | None = None,
        **options: Any,
    ) -> Generator[Event, None, None]:
        """Stream the events of one generation.

        prompt: a Prepared prompt, or messages / a raw prompt to prepare first (at once).
        options: see `generate_request` (max_tokens, temperature, seed, stop, policy, keep,
        discard_fraction, unit, truncate_prompt, ...). timeout: deadline for the whole
        generation (default none). Never retried. Stopping the iteration cancels the call.
        """
        self._calls.need("infer")
        if not isinstance(prompt, Prepared | prompt_pb2.PreparedPrompt):
            prompt = self.prepare(prompt, images, timeout=prepare_timeout)
        return self._stream(self._calls.generate(prompt, timeout, options))

    def chat(
        self, messages: Sequence[Message], *, prepare_timeout: float | None = None, **options: Any
    ) -> Generator[Event, None, None]:
        """Prepare the whole conversation, then generate the next assistant message."""
        return self.generate(list(messages), prepare_timeout=prepare_timeout, **options)

    # -- sessions (InferService) --------------------------------------------------------------

    def create_session(
        self, session_id: str = "", *, timeout: float | None = None, **options: Any
    ) -> SessionInfo:
        """A new session (empty id: the server picks one) with default sampling/context options
        for its turns (see `generate_request`). Not retried: the id may already be taken."""
        return self._unary(self._calls.create_session(session_id, timeout, options))

    def get_session(
        self, session_id: str, *, num_records: int = 0, timeout: float | None = None
    ) -> SessionInfo:
        """num_records: also the records of the session's last N completed turns."""
        return self._unary(self._calls.get_session(session_id, timeout, num_records))

    def embed(
        self, texts: Sequence[str], *, normalize: bool = False, timeout: float | None = None
    ) -> list[Embedding]:
        """Mean-pooled embeddings (infer started with --embeddings)."""
        return self._unary(self._calls.embed(texts, normalize, timeout))

    def list_sessions(self, *, timeout: float | None = None) -> list[SessionInfo]:
        return self._unary(self._calls.list_sessions(timeout))

    def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        return self._unary(self._calls.delete_session(session_id, timeout))

    def save_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        return self._unary(self._calls.save_session(session_id, timeout))

    def restore_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        return self._unary(self._calls.restore_session(session_id, timeout))

    def rename_session(
        self, session_id: str, title: str, *, timeout: float | None = None
    ) -> SessionInfo:
        return self._unary(self._calls.rename_session(session_id, title, timeout))

    def watch_slots(
        self, *, min_interval_ms: int = 0, once: bool = False, timeout: float | None = None
    ) -> Generator[infer_pb2.WatchSlotsResponse, None, None]:
        """Views of every slot's KV cells (the contract's WatchSlotsResponse): one now, then
        one whenever something changed. Stopping the iteration cancels the call."""
        responses = self._start(self._calls.watch_slots(min_interval_ms, once, timeout))
        try:
            yield from responses
        except grpc.RpcError as e:
            raise SlotwiseError.from_rpc_error(e) from None
        finally:
            responses.cancel()

    # -- LoRA adapters (InferService) ---------------------------------------------------------

    def lora_adapters(self, *, timeout: float | None = None) -> list[LoraAdapter]:
        """The LoRA adapters infer loaded (--lora, --lora-scaled), with the scales this
        caller's requests get when they name none (llama-server's GET /lora-adapters)."""
        return self._unary(self._calls.lora_adapters(timeout))

    def set_lora_scales(
        self,
        scales: Mapping[int, float] | Sequence[tuple[int, float]],
        *,
        timeout: float | None = None,
    ) -> list[LoraAdapter]:
        """Adapter id -> scale for this caller's tenant's requests that name no adapters from
        now on (those left out: 0); the adapters as they are then (POST /lora-adapters)."""
        return self._unary(self._calls.set_lora_scales(scales, timeout))

    # -- grpc.health.v1 -----------------------------------------------------------------------

    def health(
        self, which: str = "prep", service: str = "", *, timeout: float | None = None
    ) -> str:
        """The grpc.health.v1 status ("SERVING", "NOT_SERVING", ...) of the prep or infer server."""
        return self._unary(self._calls.health(which, service, timeout))


class AsyncSlotwiseClient(_Client):
    """The grpc.aio twin of `SlotwiseClient`: same arguments, awaitable methods, and
    `generate`/`chat` are async iterators of the same events."""

    _aio = True

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncSlotwiseClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, call: Call[T]) -> T:
        try:
            return call.read(await self._start(call))
        except grpc.RpcError as e:
            raise SlotwiseError.from_rpc_error(e) from None

    async def _generate(
        self,
        prompt: PromptOrPrepared,
        images: Sequence[ImageInput | Audio],
        timeout: float | None,
        prepare_timeout: float | None,
        options: dict[str, Any],
    ) -> AsyncIterator[Event]:
        self._calls.need("infer")
        if not isinstance(prompt, Prepared | prompt_pb2.PreparedPrompt):
            prompt = await self.prepare(prompt, images, timeout=prepare_timeout)
        call = self._calls.generate(prompt, timeout, options)
        reader, responses = EventReader(), self._start(call)
        try:
            async for pb in responses:
                event = reader.read(pb)
                if event is not None:
                    yield event
        except grpc.RpcError as e:
            raise reader.error(e) from None
        finally:
            if reader.finished is None:
                responses.cancel()

    # -- PrepService --------------------------------------------------------------------------

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._unary(self._calls.model_info(timeout))

    async def prepare(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput | Audio] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
        tools: ToolOptions | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prepared:
        """See SlotwiseClient.prepare; images are read and encoded off the event loop."""
        call = await asyncio.to_thread(
            self._calls.prepare, prompt, images, add_special, first_message, timeout, tools,
            template_kwargs,
        )  # fmt: skip
        return await self._unary(call)

    async def count(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput | Audio] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
        tools: ToolOptions | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Count:
        """See SlotwiseClient.count."""
        call = await asyncio.to_thread(
            self._calls.count, prompt, images, add_special, first_message, timeout, tools,
            template_kwargs,
        )  # fmt: skip
        return await self._unary(call)

    async def tokenize(
        self,
        text: str,
        *,
        add_special: bool = False,
        parse_special: bool = True,
        with_pieces: bool = False,
        timeout: float | None = None,
        max_tokens: int = 0,
    ) -> Tokens:
        """See SlotwiseClient.tokenize."""
        call = self._calls.tokenize(
            text, add_special, parse_special, with_pieces, timeout, max_tokens
        )
        return await self._unary(call)

    async def tokenize_batch(
        self,
        texts: Sequence[str],
        *,
        add_special: bool | Sequence[bool] = False,
        parse_special: bool = True,
        timeout: float | None = None,
    ) -> list[Tokens]:
        """See SlotwiseClient.tokenize_batch."""
        return await self._unary(
            self._calls.tokenize_batch(texts, add_special, parse_special, timeout)
        )

    async def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = None) -> Tokens:
        """See SlotwiseClient.detokenize."""
        return await self._unary(self._calls.detokenize(token_ids, timeout))

    # -- InferService -------------------------------------------------------------------------

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return await self._unary(self._calls.server_info(timeout))

    def generate(
        self,
        prompt: PromptOrPrepared,
        images: Sequence[ImageInput | Audio] = (),
        *,
        timeout: float | None = None,
        prepare_timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[Event]:
        """Async iterator of the events of one generation; see SlotwiseClient.generate."""
        return self._generate(prompt, images, timeout, prepare_timeout, options)

    def chat(
        self, messages: Sequence[Message], *, prepare_timeout: float | None = None, **options: Any
    ) -> AsyncIterator[Event]:
        """See SlotwiseClient.chat."""
        return self.generate(list(messages), prepare_timeout=prepare_timeout, **options)

    # -- sessions (InferService) --------------------------------------------------------------

    async def create_session(
        self, session_id: str = "", *, timeout: float | None = None, **options: Any
    ) -> SessionInfo:
        return await self._unary(self._calls.create_session(session_id, timeout, options))

    async def get_session(
        self, session_id: str, *, num_records: int = 0, timeout: float | None = None
    ) -> SessionInfo:
        return await self._unary(self._calls.get_session(session_id, timeout, num_records))

    async def embed(
        self, texts: Sequence[str], *, normalize: bool = False, timeout: float | None = None
    ) -> list[Embedding]:
        return await self._unary(self._calls.embed(texts, normalize, timeout))

    async def list_sessions(self, *, timeout: float | None = None) -> list[SessionInfo]:
        return await self._unary(self._calls.list_sessions(timeout))

    async def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        return await self._unary(self._calls.delete_session(session_id, timeout))

    async def save_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        return await self._unary(self._calls.save_session(session_id, timeout))

    async def restore_session(
        self, session_id: str, *, timeout: float | None = None
    ) -> SessionInfo:
        return await self._unary(self._calls.restore_session(session_id, timeout))

    async def rename_session(
        self, session_id: str, title: str, *, timeout: float | None = None
    ) -> SessionInfo:
        return await self._unary(self._calls.rename_session(session_id, title, timeout))

    async def watch_slots(
        self, *, min_interval_ms: int = 0, once: bool = False, timeout: float | None = None
    ) -> AsyncIterator[infer_pb2.WatchSlotsResponse]:
        """See SlotwiseClient.watch_slots."""
        responses = self._start(self._calls.watch_slots(min_interval_ms, once, timeout))
        try:
            async for view in responses:
                yield view
        except grpc.RpcError as e:
            raise SlotwiseError.from_rpc_error(e) from None
        finally:
            responses.cancel()

    # -- LoRA adapters (InferService) ---------------------------------------------------------

    async def lora_adapters(self, *, timeout: float | None = None) -> list[LoraAdapter]:
        """See SlotwiseClient.lora_adapters."""
        return await self._unary(self._calls.lora_adapters(timeout))

    async def set_lora_scales(
        self,
        scales: Mapping[int, float] | Sequence[tuple[int, float]],
        *,
        timeout: float | None = None,
    ) -> list[LoraAdapter]:
        """See SlotwiseClient.set_lora_scales."""
        return await self._unary(self._calls.set_lora_scales(scales, timeout))

    # -- grpc.health.v1 -----------------------------------------------------------------------

    async def health(
        self, which: str = "prep", service: str = "", *, timeout: float | None = None
    ) -> str:
        """See SlotwiseClient.health."""
        return await self._unary(self._calls.health(which, service, timeout))

    async def serving(self, *, timeout: float = 2.0) -> dict[str, bool]:
        """Whether each service's gRPC health says SERVING (False when it cannot be asked)."""

        async def one(which: str) -> bool:
            try:
                return await self.health(which, timeout=timeout) == "SERVING"
            except SlotwiseError:
                return False

        names = list(self._channels)
        return dict(zip(names, await asyncio.gather(*map(one, names)), strict=True))
