"""The one implementation both clients share: every RPC as a `Call` (the channel, the method,
the request, the deadline, and how the answer is read), and what is done with a Generate
stream's responses. `SlotwiseClient` makes a Call blocking, `AsyncSlotwiseClient` awaits it;
neither builds a request or reads a response itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.channels import (
    DEFAULT_MAX_MESSAGE_BYTES,
    HEALTH_SERVICE,
    IDEMPOTENT_METHODS,
    INFER_SERVICE,
    PREP_SERVICE,
    RetryPolicy,
    Tls,
    channel_options,
    open_channel,
)
from clients.errors import SlotwiseError
from clients.events import Event, Finished, event_from_pb
from clients.requests import (
    ToolOptions,
    count_request,
    create_session_request,
    generate_request,
    lora_pb,
    prepare_request,
)
from clients.types import (
    Audio,
    Count,
    Embedding,
    ImageInput,
    LoraAdapter,
    ModelInfo,
    Prepared,
    PromptInput,
    ServerInfo,
    SessionInfo,
    Tokens,
)
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2

__all__ = ["AFFINITY_HEADER", "DEFAULT_TIMEOUT", "Call", "Calls", "EventReader"]

DEFAULT_TIMEOUT = 30.0  # seconds, for every call but Generate
# Session RPCs and turns carry their session id here, so that a proxy in front of several
# replicas (nginx: hash on it) sends every call of one session to the replica that holds it.
AFFINITY_HEADER = "x-slotwise-session"

T = TypeVar("T")

# the generated stubs each channel carries
_STUBS: dict[str, dict[str, type]] = {
    "prep": {
        PREP_SERVICE: prep_pb2_grpc.PrepServiceStub,
        HEALTH_SERVICE: health_pb2_grpc.HealthStub,
    },
    "infer": {
        INFER_SERVICE: infer_pb2_grpc.InferServiceStub,
        HEALTH_SERVICE: health_pb2_grpc.HealthStub,
    },
}


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC, built but not made."""

    target: str  # the channel: "prep" or "infer"
    service: str
    method: str
    request: Any
    read: Callable[[Any], T]  # the response -> what the client returns
    timeout: float | None  # seconds; None: no deadline
    affinity: str = ""  # x-slotwise-session: the replica a proxy sends this call to

    @property
    def idempotent(self) -> bool:
        """Retried by the channel's service config (and waits for ready, when asked)."""
        return (self.service, self.method) in IDEMPOTENT_METHODS


def _prepared_pb(prompt: Prepared | prompt_pb2.PreparedPrompt) -> prompt_pb2.PreparedPrompt:
    return prompt.prompt if isinstance(prompt, Prepared) else prompt


# how responses are read


def _nothing(_: Any) -> None:
    return None


def _model_info(r: prep_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo.from_pb(r.info)


def _session(r: Any) -> SessionInfo:  # any response with a `session` field
    return SessionInfo.from_pb(r.session)


def _sessions(r: infer_pb2.ListSessionsResponse) -> list[SessionInfo]:
    return [SessionInfo.from_pb(s) for s in r.sessions]


def _embeddings(r: infer_pb2.EmbedResponse) -> list[Embedding]:
    return [Embedding(tuple(e.values), e.num_tokens) for e in r.embeddings]


def _lora_adapters(r: Any) -> list[LoraAdapter]:  # (either Lora response)
    return [LoraAdapter.from_pb(a) for a in r.adapters]


def _status(r: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class Calls:
    """A client's settings (addresses, credentials, metadata, deadlines, retries) and the
    Calls they make."""

    def __init__(
        self,
        prep_address: str | None,
        infer_address: str | None,
        *,
        tls: Tls | None,
        token: str | None,
        timeout: float | None,
        retry: RetryPolicy,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metadata: Sequence[tuple[str, str]] = (),
        compression: grpc.Compression | None = None,
    ):
        if prep_address is None and infer_address is None:
            raise ValueError("give prep_address, infer_address or both")
        self.addresses = {
            which: address
            for which, address in (("prep", prep_address), ("infer", infer_address))
            if address is not None
        }
        self.tls = tls
        self.timeout = timeout
        self.retry = retry
        self.compression = compression
        self.options = channel_options(max_message_bytes, retry, timeout, tls)
        md = list(metadata)
        if token:
            md.append(("authorization", f"Bearer {token}"))
        self.metadata = tuple(md)

    # -- making a call ------------------------------------------------------------------------

    def open_channels(self, *, aio: bool) -> dict[str, Any]:
        return {
            which: open_channel(
                address, aio=aio, tls=self.tls, options=self.options, compression=self.compression
            )
            for which, address in self.addresses.items()
        }

    @staticmethod
    def stubs(channels: dict[str, Any]) -> dict[tuple[str, str], Any]:
        """(target, service) -> the generated stub on that channel (grpc or grpc.aio)."""
        return {
            (which, service): stub(channel)
            for which, channel in channels.items()
            for service, stub in _STUBS[which].items()
        }

    def kwargs(self, call: Call[Any]) -> dict[str, Any]:
        """The per-call arguments of a stub method."""
        wait = True if call.idempotent and self.retry.wait_for_ready else None
        metadata = self.metadata
        if call.affinity and all(key != AFFINITY_HEADER for key, _ in metadata):
            metadata = (*metadata, (AFFINITY_HEADER, call.affinity))
        return {"timeout": call.timeout, "metadata": metadata, "wait_for_ready": wait}

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        return None if t is None or t <= 0 else t

    def need(self, which: str) -> None:
        if which not in self.addresses:
            raise ValueError(f"this client has no {which} address")

    def _call(
        self,
        target: str,
        service: str,
        method: str,
        request: Any,
        read: Callable[[Any], T],
        timeout: float | None,
    ) -> Call[T]:
        self.need(target)
        return Call(target, service, method, request, read, self._deadline(timeout))

    # -- PrepService --------------------------------------------------------------------------

    def model_info(self, timeout: float | None) -> Call[ModelInfo]:
        request = prep_pb2.GetModelInfoRequest()
        return self._call("prep", PREP_SERVICE, "GetModelInfo", request, _model_info, timeout)

    def prepare(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput | Audio],
        add_special: bool,
        first_message: int,
        timeout: float | None,
        tools: ToolOptions | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Call[Prepared]:
        self.need("prep")
        request = prepare_request(
            prompt, images, add_special=add_special, first_message=first_message, tools=tools,
            template_kwargs=template_kwargs,
        )  # fmt: skip
        return self._call("prep", PREP_SERVICE, "Prepare", request, Prepared.from_pb, timeout)

    def count(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput | Audio],
        add_special: bool,
        first_message: int,
        timeout: float | None,
        tools: ToolOptions | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Call[Count]:
        self.need("prep")
        request = count_request(
            prompt, images, add_special=add_special, first_message=first_message, tools=tools,
            template_kwargs=template_kwargs,
        )  # fmt: skip
        return self._call("prep", PREP_SERVICE, "CountTokens", request, Count.from_pb, timeout)

    def tokenize(
        self, text: str, add_special: bool, parse_special: bool, with_pieces: bool,
        timeout: float | None, max_tokens: int = 0,
    ) -> Call[Tokens]:  # fmt: skip
        request = prep_pb2.TokenizeRequest(
            text=text, add_special=add_special, parse_special=parse_special,
            with_pieces=with_pieces, max_tokens=max_tokens,
        )  # fmt: skip
        return self._call("prep", PREP_SERVICE, "Tokenize", request, Tokens.from_pb, timeout)

    def tokenize_batch(
        self, texts: Sequence[str], add_special: bool | Sequence[bool], parse_special: bool,
        timeout: float | None,
    ) -> Call[list[Tokens]]:  # fmt: skip
        specials = [add_special] * len(texts) if isinstance(add_special, bool) else add_special
        request = prep_pb2.TokenizeBatchRequest(
            texts=[
                prep_pb2.TokenizeRequest(text=t, add_special=a, parse_special=parse_special)
                for t, a in zip(texts, specials, strict=True)
            ]
        )

        def read(r: prep_pb2.TokenizeBatchResponse) -> list[Tokens]:
            return [Tokens.from_pb(t) for t in r.texts]

        return self._call("prep", PREP_SERVICE, "TokenizeBatch", request, read, timeout)

    def detokenize(self, token_ids: Sequence[int], timeout: float | None) -> Call[Tokens]:
        request = prep_pb2.DetokenizeRequest(token_ids=list(token_ids))

        def read(r: prep_pb2.DetokenizeResponse) -> Tokens:
            return replace(Tokens.from_pb(r), token_ids=tuple(token_ids))

        return self._call("prep", PREP_SERVICE, "Detokenize", request, read, timeout)

    # -- InferService -------------------------------------------------------------------------

    def server_info(self, timeout: float | None) -> Call[ServerInfo]:
        request = infer_pb2.GetServerInfoRequest()
        return self._call(
            "infer", INFER_SERVICE, "GetServerInfo", request, ServerInfo.from_pb, timeout
        )

    def generate(
        self,
        prompt: Prepared | prompt_pb2.PreparedPrompt,
        timeout: float | None,
        options: dict[str, Any],
    ) -> Call[None]:
        """Generate's deadline is `timeout` only: the client's default does not apply.
        options["affinity"]: the key a stateless conversation is routed by (a session turn is
        routed by its session id)."""
        self.need("infer")
        options = dict(options)
        explicit = options.pop("affinity", None) or ""
        affinity = options.get("session_id") or explicit
        request = generate_request(_prepared_pb(prompt), **options)
        t = None if timeout is None or timeout <= 0 else timeout
        return Call("infer", INFER_SERVICE, "Generate", request, _nothing, t, affinity)

    def create_session(
        self, session_id: str, timeout: float | None, options: dict[str, Any]
    ) -> Call[SessionInfo]:
        request = create_session_request(session_id, **options)
        return self._session("CreateSession", request, timeout)

    def get_session(
        self, session_id: str, timeout: float | None, num_records: int = 0
    ) -> Call[SessionInfo]:
        request = infer_pb2.GetSessionRequest(session_id=session_id, num_records=num_records)
        return self._session("GetSession", request, timeout)

    def embed(
        self, texts: Sequence[str], normalize: bool, timeout: float | None
    ) -> Call[list[Embedding]]:
        request = infer_pb2.EmbedRequest(texts=list(texts), normalize=normalize)
        return self._call("infer", INFER_SERVICE, "Embed", request, _embeddings, timeout)

    def list_sessions(self, timeout: float | None) -> Call[list[SessionInfo]]:
        request = infer_pb2.ListSessionsRequest()
        return self._call("infer", INFER_SERVICE, "ListSessions", request, _sessions, timeout)

    def delete_session(self, session_id: str, timeout: float | None) -> Call[None]:
        request = infer_pb2.DeleteSessionRequest(session_id=session_id)
        call = self._call("infer", INFER_SERVICE, "DeleteSession", request, _nothing, timeout)
        return replace(call, affinity=session_id)

    def save_session(self, session_id: str, timeout: float | None) -> Call[SessionInfo]:
        request = infer_pb2.SaveSessionRequest(session_id=session_id)
        return self._session("SaveSession", request, timeout)

    def restore_session(self, session_id: str, timeout: float | None) -> Call[SessionInfo]:
        request = infer_pb2.RestoreSessionRequest(session_id=session_id)
        return self._session("RestoreSession", request, timeout)

    def rename_session(
        self, session_id: str, title: str, timeout: float | None
    ) -> Call[SessionInfo]:
        request = infer_pb2.RenameSessionRequest(session_id=session_id, title=title)
        return self._session("RenameSession", request, timeout)

    def watch_slots(self, min_interval_ms: int, once: bool, timeout: float | None) -> Call[None]:
        """A watch's deadline is `timeout` only (none by default): it runs until stopped."""
        self.need("infer")
        request = infer_pb2.WatchSlotsRequest(min_interval_ms=min_interval_ms, once=once)
        t = None if timeout is None or timeout <= 0 else timeout
        return Call("infer", INFER_SERVICE, "WatchSlots", request, _nothing, t)

    def lora_adapters(self, timeout: float | None) -> Call[list[LoraAdapter]]:
        request = infer_pb2.LoraListAdaptersRequest()
        return self._call(
            "infer", INFER_SERVICE, "LoraListAdapters", request, _lora_adapters, timeout
        )

    def set_lora_scales(
        self, scales: Mapping[int, float] | Sequence[tuple[int, float]], timeout: float | None
    ) -> Call[list[LoraAdapter]]:
        request = infer_pb2.LoraSetScalesRequest(scales=lora_pb(scales))
        return self._call("infer", INFER_SERVICE, "LoraSetScales", request, _lora_adapters, timeout)

    def _session(self, method: str, request: Any, timeout: float | None) -> Call[SessionInfo]:
        call = self._call("infer", INFER_SERVICE, method, request, _session, timeout)
        return replace(call, affinity=request.session_id)

    # -- grpc.health.v1 -----------------------------------------------------------------------

    def health(self, which: str, service: str, timeout: float | None) -> Call[str]:
        request = health_pb2.HealthCheckRequest(service=service)
        return self._call(which, HEALTH_SERVICE, "Check", request, _status, timeout)


class EventReader:
    """What both clients do with one Generate stream's responses: typed events, and the error
    that ends the stream, carrying the Finished event when it came after one."""

    def __init__(self) -> None:
        self.finished: Finished | None = None

    def read(self, pb: infer_pb2.GenerateResponse) -> Event | None:
        event = event_from_pb(pb)
        if event is not None:
            self.finished = event if isinstance(event, Finished) else None
        return event

    def error(self, e: grpc.RpcError) -> SlotwiseError:
        return SlotwiseError.from_rpc_error(e, finished=self.finished)
