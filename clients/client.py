"""Python clients for slotwise: `SlotwiseClient` (blocking) and `AsyncSlotwiseClient` (grpc.aio).

Both speak to the two services through the generated stubs in `slotwise.v1` only:

    with SlotwiseClient("localhost:50051", "localhost:50052") as client:
        conversation = [Message.system("Be brief."), Message.user(Path("cat.png"), "What is this?")]
        for event in client.chat(conversation, max_tokens=64):
            if isinstance(event, Delta):
                print(event.text, end="", flush=True)

Inputs are small `Message`s whose parts are text (`str`) or images (encoded `bytes`, a
`pathlib.Path`, a PIL image, or, for `count` only, an `ImageSize` / `(width, height)` tuple).
`generate` yields typed, frozen events: `Started`, `Prefill`, `Delta`, `Shift`, `Finished`.

Calls that cannot change anything (Prepare, CountTokens, GetModelInfo, GetServerInfo) have a
default deadline and are retried with exponential backoff while the server is UNAVAILABLE.
Generate is never retried and has no deadline unless one is asked for. Every gRPC failure is
raised as `SlotwiseError` (a `grpc.RpcError` with `code()` and `details()`).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import io
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from PIL.Image import Image as PILImage

from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT",
    "NO_RETRY",
    "AsyncSlotwiseClient",
    "ChunkCount",
    "Completion",
    "Count",
    "Delta",
    "EngineStats",
    "Event",
    "FinishReason",
    "Finished",
    "ImageSize",
    "Message",
    "ModelInfo",
    "Persistence",
    "Policy",
    "Prefill",
    "Prepared",
    "RetryPolicy",
    "ServerInfo",
    "SessionInfo",
    "Shift",
    "SlotwiseClient",
    "SlotwiseError",
    "Started",
    "Tls",
    "Unit",
    "Usage",
    "acollect",
    "collect",
]

log = logging.getLogger("slotwise.client")

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # a PreparedPrompt carries raw RGB pixels
DEFAULT_TIMEOUT = 30.0  # seconds, for every call but Generate

# ---------------------------------------------------------------------------------------------
# errors


class SlotwiseError(grpc.RpcError):
    """A call failed: the gRPC status code and the server's message.

    Like the errors grpc raises, `code()` is a `grpc.StatusCode` and `details()` the message;
    `status` holds the google.rpc.Status with its details, when the server sent one: `reason`
    and `metadata` come from its ErrorInfo (e.g. PROMPT_TOO_LONG with cells_needed and
    capacity, QUEUE_FULL, STALE_DESCRIPTOR, SESSION_NOT_SAVED), `retry_delay` from RetryInfo,
    `field_violations` from BadRequest. `finished` is the stream's Finished event when the
    failure came after it (a turn that completed but was not saved, or an error mid-stream).
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, status: status_pb2.Status | None = None
    ):
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self.message = message
        self.status = status
        self.reason = ""
        self.metadata: dict[str, str] = {}
        self.retry_delay: float | None = None
        self.field_violations: dict[str, str] = {}
        self.finished: Finished | None = None
        for detail in status.details if status is not None else ():
            info, retry, bad = (
                error_details_pb2.ErrorInfo(),
                error_details_pb2.RetryInfo(),
                error_details_pb2.BadRequest(),
            )
            if detail.Unpack(info):
                self.reason, self.metadata = info.reason, dict(info.metadata)
            elif detail.Unpack(retry):
                self.retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
            elif detail.Unpack(bad):
                self.field_violations = {v.field: v.description for v in bad.field_violations}

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def __str__(self) -> str:
        return f"{self._code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> SlotwiseError:
        if isinstance(e, SlotwiseError):
            return e
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        message = (e.details() if hasattr(e, "details") else None) or str(e)
        try:
            status = rpc_status.from_call(e) if hasattr(e, "trailing_metadata") else None
        except Exception:  # a malformed or mismatched detail must not hide the error itself
            status = None
        return cls(code or grpc.StatusCode.UNKNOWN, message, status=status)


def _stream_error(e: grpc.RpcError, finished: Finished | None) -> SlotwiseError:
    """A stream's non-OK status; after its Finished event (a turn not saved, an error
    mid-stream) the error carries that event."""
    error = SlotwiseError.from_rpc_error(e)
    error.finished = finished
    return error


# ---------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class ImageSize:
    """An image known by its size only: CountTokens counts it without pixels."""

    width: int
    height: int


ImageInput = bytes | bytearray | os.PathLike | PILImage | ImageSize | tuple[int, int]
Part = str | ImageInput


@dataclass(frozen=True)
class Message:
    """One chat message: a role and parts, each text (`str`) or an image.

    Images: encoded file `bytes` (PNG, JPEG, WebP, GIF, BMP), a `pathlib.Path` (a plain `str` is
    text, never a path), a PIL image, or, for counting only, `ImageSize` / `(width, height)`.
    """

    role: str
    parts: tuple[Part, ...]

    def __init__(self, role: str, parts: Part | Sequence[Part]):
        items: tuple[Part, ...]
        if isinstance(parts, str | bytes | bytearray | os.PathLike | PILImage) or _is_size(parts):
            items = (parts,)  # type: ignore[assignment]  # one part; (w, h) is one size
        else:
            items = tuple(parts)  # type: ignore[arg-type]
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "parts", items)

    @classmethod
    def system(cls, *parts: Part) -> Message:
        return cls("system", parts)

    @classmethod
    def user(cls, *parts: Part) -> Message:
        return cls("user", parts)

    @classmethod
    def assistant(cls, *parts: Part) -> Message:
        return cls("assistant", parts)

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def num_images(self) -> int:
        return sum(1 for p in self.parts if not isinstance(p, str))


def _is_size(value: Any) -> bool:
    return isinstance(value, ImageSize) or (
        isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)
    )


def image_pb(image: ImageInput, *, sizes_allowed: bool) -> prep_pb2.Image:
    """Any accepted image form -> prep_pb2.Image (encoded bytes, or a size for CountTokens)."""
    if isinstance(image, ImageSize | tuple):
        if not _is_size(image):
            raise TypeError(f"an image size is (width, height), got {image!r}")
        w, h = (image.width, image.height) if isinstance(image, ImageSize) else image
        if not sizes_allowed:
            raise ValueError(f"an image given by its size ({w}x{h}) can only be counted")
        return prep_pb2.Image(size=prep_pb2.ImageSize(width=w, height=h))
    if isinstance(image, bytes | bytearray):
        return prep_pb2.Image(data=bytes(image))
    if isinstance(image, os.PathLike):
        return prep_pb2.Image(data=Path(image).read_bytes())
    if isinstance(image, PILImage):
        buf = io.BytesIO()
        image.save(buf, "PNG")
        return prep_pb2.Image(data=buf.getvalue())
    if isinstance(image, str):
        raise TypeError("a str is text; pass an image file as pathlib.Path or bytes")
    raise TypeError(f"not an image: {type(image).__name__}")


def chat_pb(messages: Sequence[Message], *, sizes_allowed: bool) -> prep_pb2.Chat:
    out = []
    for m in messages:
        if not isinstance(m, Message):
            raise TypeError(f"expected Message, got {type(m).__name__}")
        parts = [
            prep_pb2.Part(text=p)
            if isinstance(p, str)
            else prep_pb2.Part(image=image_pb(p, sizes_allowed=sizes_allowed))
            for p in m.parts
        ]
        out.append(prep_pb2.Message(role=m.role, parts=parts))
    return prep_pb2.Chat(messages=out)


PromptInput = str | Sequence[Message]


def _input_fields(
    prompt: PromptInput,
    images: Sequence[ImageInput],
    add_special: bool,
    first_message: int = 0,
    *,
    sizes_allowed: bool,
) -> dict[str, Any]:
    if isinstance(prompt, str):
        if first_message:
            raise ValueError("first_message applies to messages, not to a raw prompt")
        raw = prep_pb2.RawPrompt(
            text=prompt,
            images=[image_pb(im, sizes_allowed=sizes_allowed) for im in images],
            add_special=add_special,
        )
        return {"raw": raw}
    if images:
        raise ValueError("images= goes with a raw prompt; put images in the messages' parts")
    return {
        "chat": chat_pb(list(prompt), sizes_allowed=sizes_allowed),
        "first_message": first_message,
    }


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class ModelInfo:
    model_fingerprint: str
    mmproj_fingerprint: str
    media_marker: str
    uses_mrope: bool
    media_non_causal: bool
    supports_vision: bool
    supports_audio: bool
    n_ctx_train: int
    num_vocab: int
    bos_token_id: int
    eos_token_id: int
    has_chat_template: bool
    model_description: str

    @classmethod
    def from_pb(cls, pb: prep_pb2.ModelInfo) -> ModelInfo:
        return cls(
            model_fingerprint=pb.fingerprint.model,
            mmproj_fingerprint=pb.fingerprint.mmproj,
            media_marker=pb.media_marker,
            uses_mrope=pb.uses_mrope,
            media_non_causal=pb.media_non_causal,
            supports_vision=pb.supports_vision,
            supports_audio=pb.supports_audio,
            n_ctx_train=pb.n_ctx_train,
            num_vocab=pb.num_vocab,
            bos_token_id=pb.bos_token_id,
            eos_token_id=pb.eos_token_id,
            has_chat_template=pb.has_chat_template,
            model_description=pb.model_description,
        )


@dataclass(frozen=True)
class EngineStats:
    num_decodes: int = 0
    num_multi_seq_decodes: int = 0
    num_media_decodes: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0
    num_media_cache_hits: int = 0
    num_media_cache_misses: int = 0


@dataclass(frozen=True)
class ServerInfo:
    model_fingerprint: str
    mmproj_fingerprint: str
    num_slots: int
    num_cells_per_slot: int
    n_ctx_train: int
    can_shift: bool
    uses_mrope: bool
    batch_size: int
    ubatch_size: int
    num_queued: int
    num_active: int
    stats: EngineStats

    @classmethod
    def from_pb(cls, pb: infer_pb2.GetServerInfoResponse) -> ServerInfo:
        s = pb.stats
        return cls(
            model_fingerprint=pb.fingerprint.model,
            mmproj_fingerprint=pb.fingerprint.mmproj,
            num_slots=pb.num_slots,
            num_cells_per_slot=pb.num_cells_per_slot,
            n_ctx_train=pb.n_ctx_train,
            can_shift=pb.can_shift,
            uses_mrope=pb.uses_mrope,
            batch_size=pb.batch_size,
            ubatch_size=pb.ubatch_size,
            num_queued=pb.num_queued,
            num_active=pb.num_active,
            stats=EngineStats(
                num_decodes=s.num_decodes,
                num_multi_seq_decodes=s.num_multi_seq_decodes,
                num_media_decodes=s.num_media_decodes,
                num_generated_tokens=s.num_generated_tokens,
                num_shifts=s.num_shifts,
                num_media_cache_hits=s.num_media_cache_hits,
                num_media_cache_misses=s.num_media_cache_misses,
            ),
        )


@dataclass(frozen=True)
class ChunkCount:
    message_index: int
    media_group: int  # 0: plain text; k > 0: born of the k-th image
    is_media: bool
    num_cells: int
    num_positions: int


@dataclass(frozen=True)
class Count:
    num_cells: int
    num_positions: int
    chunks: tuple[ChunkCount, ...]

    @classmethod
    def from_pb(cls, pb: prep_pb2.CountTokensResponse) -> Count:
        chunks = tuple(
            ChunkCount(c.message_index, c.media_group, c.is_media, c.num_cells, c.num_positions)
            for c in pb.chunks
        )
        return cls(pb.num_cells, pb.num_positions, chunks)


@dataclass(frozen=True)
class Prepared:
    """A prepared prompt (the descriptor to send to Generate) and the rendered prompt text."""

    prompt: prompt_pb2.PreparedPrompt
    rendered_text: str = ""

    @property
    def num_cells(self) -> int:
        return self.prompt.num_cells

    @property
    def num_positions(self) -> int:
        return self.prompt.num_positions

    @property
    def num_images(self) -> int:
        return len({c.media_group for c in self.prompt.chunks if c.media_group})

    def num_cells_of(self, message_index: int) -> int:
        """KV cells the chunks of one chat message use (e.g. the system prompt, to `keep` it)."""
        return sum(_chunk_cells(c) for c in self.prompt.chunks if c.message_index == message_index)

    def count(self) -> Count:
        """The same per-chunk view CountTokens gives."""
        return Count(
            self.num_cells,
            self.num_positions,
            tuple(
                ChunkCount(
                    c.message_index,
                    c.media_group,
                    c.WhichOneof("kind") == "media",
                    _chunk_cells(c),
                    c.media.num_positions if c.WhichOneof("kind") == "media" else _chunk_cells(c),
                )
                for c in self.prompt.chunks
            ),
        )


def _chunk_cells(c: prompt_pb2.Chunk) -> int:
    return c.media.num_cells if c.WhichOneof("kind") == "media" else len(c.text.token_ids)


# ---------------------------------------------------------------------------------------------
# generation options and events


class Policy(enum.StrEnum):
    AUTO = "auto"
    SHIFT = "shift"
    GAP = "gap"
    REPREFILL = "reprefill"
    STOP = "stop"


class Unit(enum.StrEnum):
    TOKEN = "token"
    MESSAGE = "message"


class FinishReason(enum.StrEnum):
    UNSPECIFIED = "unspecified"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


_POLICY_TO_PB = {
    Policy.AUTO: infer_pb2.SHIFT_POLICY_AUTO,
    Policy.SHIFT: infer_pb2.SHIFT_POLICY_SHIFT,
    Policy.GAP: infer_pb2.SHIFT_POLICY_GAP,
    Policy.REPREFILL: infer_pb2.SHIFT_POLICY_REPREFILL,
    Policy.STOP: infer_pb2.SHIFT_POLICY_STOP,
}
_POLICY_FROM_PB = {v: k for k, v in _POLICY_TO_PB.items()} | {
    infer_pb2.SHIFT_POLICY_UNSPECIFIED: Policy.AUTO
}
_UNIT_TO_PB = {
    Unit.TOKEN: infer_pb2.EVICTION_UNIT_TOKEN,
    Unit.MESSAGE: infer_pb2.EVICTION_UNIT_MESSAGE,
}
_REASON_FROM_PB = {
    infer_pb2.FINISH_REASON_UNSPECIFIED: FinishReason.UNSPECIFIED,
    infer_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    infer_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    infer_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
    infer_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class Started:
    """Admission: what the prompt occupies, and what truncate_prompt dropped."""

    slot: int
    num_prompt_cells: int
    num_prompt_positions: int
    num_capacity_cells: int
    num_truncated_cells: int = 0
    num_truncated_chunks: int = 0
    truncated_media_ids: tuple[str, ...] = ()
    num_reused_cells: int = 0


@dataclass(frozen=True)
class Prefill:
    num_cells_done: int
    num_cells_total: int


@dataclass(frozen=True)
class Delta:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Shift:
    """The server made room in the context (`policy` is the one actually used, never AUTO)."""

    policy: Policy
    num_cells_evicted: int
    num_positions_evicted: int
    media_ids_evicted: tuple[str, ...]
    num_cells_used_after: int
    next_position_after: int


@dataclass(frozen=True)
class Usage:
    num_prompt_cells: int = 0
    num_prompt_positions: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0
    num_evicted_cells: int = 0
    num_reused_cells: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


class Persistence(enum.StrEnum):
    """Whether a session turn's result is on disk (see Finished.persistence)."""

    UNSPECIFIED = "unspecified"  # not a session turn, or it did not complete
    MEMORY = "memory"  # the server keeps sessions in memory only
    SAVED = "saved"
    NOT_SAVED = "not_saved"  # completed and kept in memory, but not on disk (error says why)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    stop_string: str = ""
    error: str = ""
    persistence: Persistence = Persistence.UNSPECIFIED

    @property
    def saved(self) -> bool:
        return self.persistence is Persistence.SAVED


Event = Started | Prefill | Delta | Shift | Finished


def event_from_pb(pb: infer_pb2.GenerateResponse) -> Event | None:
    """A GenerateResponse -> its typed event (None for an event kind this client does not know)."""
    kind = pb.WhichOneof("event")
    if kind == "delta":
        return Delta(tuple(pb.delta.token_ids), pb.delta.text)
    if kind == "prefill":
        return Prefill(pb.prefill.num_cells_done, pb.prefill.num_cells_total)
    if kind == "started":
        s = pb.started
        return Started(
            slot=s.slot,
            num_prompt_cells=s.num_prompt_cells,
            num_prompt_positions=s.num_prompt_positions,
            num_capacity_cells=s.num_capacity_cells,
            num_truncated_cells=s.num_truncated_cells,
            num_truncated_chunks=s.num_truncated_chunks,
            truncated_media_ids=tuple(s.truncated_media_ids),
            num_reused_cells=s.num_reused_cells,
        )
    if kind == "shift":
        s = pb.shift
        return Shift(
            policy=_POLICY_FROM_PB.get(s.policy, Policy.AUTO),
            num_cells_evicted=s.num_cells_evicted,
            num_positions_evicted=s.num_positions_evicted,
            media_ids_evicted=tuple(s.media_ids_evicted),
            num_cells_used_after=s.num_cells_used_after,
            next_position_after=s.next_position_after,
        )
    if kind == "finished":
        f, u = pb.finished, pb.finished.usage
        return Finished(
            reason=_REASON_FROM_PB.get(f.reason, FinishReason.UNSPECIFIED),
            usage=Usage(
                num_prompt_cells=u.num_prompt_cells,
                num_prompt_positions=u.num_prompt_positions,
                num_generated_tokens=u.num_generated_tokens,
                num_shifts=u.num_shifts,
                num_evicted_cells=u.num_evicted_cells,
                num_reused_cells=u.num_reused_cells,
                prefill_seconds=u.prefill_seconds,
                decode_seconds=u.decode_seconds,
            ),
            stop_string=f.stop_string,
            error=f.error,
            persistence=_PERSISTENCE_FROM_PB.get(f.persistence, Persistence.UNSPECIFIED),
        )
    return None


_PERSISTENCE_FROM_PB = {
    infer_pb2.PERSISTENCE_MEMORY: Persistence.MEMORY,
    infer_pb2.PERSISTENCE_SAVED: Persistence.SAVED,
    infer_pb2.PERSISTENCE_NOT_SAVED: Persistence.NOT_SAVED,
}


def sampling_pb(
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repeat_penalty: float | None = None,
    penalty_last_n: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
) -> infer_pb2.SamplingParams:
    """SamplingParams with the given fields set; None leaves a field to the server (or session)."""
    fields = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repeat_penalty": repeat_penalty,
        "penalty_last_n": penalty_last_n,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
    }
    return infer_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


def context_pb(
    *,
    policy: Policy | str | None = None,
    keep: int | None = None,
    discard_fraction: float | None = None,
    unit: Unit | str | None = None,
    truncate_prompt: bool | None = None,
) -> infer_pb2.ContextOptions | None:
    """ContextOptions with the options given, or None when none is: the server's defaults (or,
    on a session turn, the session's options) apply to every option left out, one by one."""
    if all(v is None for v in (policy, keep, discard_fraction, unit, truncate_prompt)):
        return None
    context = infer_pb2.ContextOptions()
    if policy is not None:
        context.policy = _POLICY_TO_PB[Policy(policy)]
    if keep is not None:
        context.keep = keep
    if discard_fraction is not None:
        context.discard_fraction = discard_fraction
    if unit is not None:
        context.unit = _UNIT_TO_PB[Unit(unit)]
    if truncate_prompt is not None:
        context.truncate_prompt = truncate_prompt
    return context


_SAMPLING_OPTIONS = frozenset(inspect.signature(sampling_pb).parameters)
_CONTEXT_OPTIONS = frozenset(inspect.signature(context_pb).parameters)


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = set(options) - _SAMPLING_OPTIONS - _CONTEXT_OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    sampling = {k: v for k, v in options.items() if k in _SAMPLING_OPTIONS}
    context = {k: v for k, v in options.items() if k in _CONTEXT_OPTIONS}
    return sampling, context


def generate_request(
    prompt: prompt_pb2.PreparedPrompt,
    *,
    max_tokens: int = 0,
    stop: Sequence[str] | str = (),
    session_id: str = "",
    **options: Any,
) -> infer_pb2.GenerateRequest:
    """The GenerateRequest for these options.

    options: sampling (temperature, top_k, top_p, min_p, repeat_penalty, penalty_last_n,
    presence_penalty, frequency_penalty, seed) and context (policy, keep, discard_fraction,
    unit, truncate_prompt). Options left out (or None) are the server's defaults, or for a
    session turn (session_id) the session's. max_tokens 0: the server's default.
    """
    if isinstance(stop, str):
        stop = (stop,)
    sampling, context = _split_options(options)
    request = infer_pb2.GenerateRequest(
        prompt=prompt,
        sampling=sampling_pb(**sampling),
        max_tokens=max_tokens,
        stop=list(stop),
        session_id=session_id,
    )
    ctx = context_pb(**context)
    if ctx is not None:
        request.context.CopyFrom(ctx)
    return request


def create_session_request(session_id: str = "", **options: Any) -> infer_pb2.CreateSessionRequest:
    sampling, context = _split_options(options)
    request = infer_pb2.CreateSessionRequest(
        session_id=session_id, sampling=sampling_pb(**sampling)
    )
    ctx = context_pb(**context)
    if ctx is not None:
        request.context.CopyFrom(ctx)
    return request


@dataclass(frozen=True)
class SessionInfo:
    """A server-side conversation: its sequence and ledger live on between turns."""

    session_id: str
    num_turns: int
    num_cells: int
    next_position: int
    resident: bool  # in a slot now (else swapped out to disk)
    num_shifts: int
    num_media: int
    policy: Policy
    keep: int
    discard_fraction: float
    unit: Unit
    truncate_prompt: bool
    sampling: dict[str, float | int]  # the session's sampling parameters, as the server reports

    @classmethod
    def from_pb(cls, pb: infer_pb2.SessionInfo) -> SessionInfo:
        c = pb.context
        return cls(
            session_id=pb.session_id,
            num_turns=pb.num_turns,
            num_cells=pb.num_cells,
            next_position=pb.next_position,
            resident=pb.resident,
            num_shifts=pb.num_shifts,
            num_media=pb.num_media,
            policy=_POLICY_FROM_PB.get(c.policy, Policy.AUTO),
            keep=c.keep,
            discard_fraction=c.discard_fraction if c.HasField("discard_fraction") else 0.5,
            unit=Unit.MESSAGE if c.unit == infer_pb2.EVICTION_UNIT_MESSAGE else Unit.TOKEN,
            truncate_prompt=c.truncate_prompt,
            sampling={f.name: v for f, v in pb.sampling.ListFields()},
        )


@dataclass
class Completion:
    """A whole generation, gathered from its events by `collect`."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    started: Started | None = None
    shifts: list[Shift] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.text += event.text
            self.token_ids.extend(event.token_ids)
        elif isinstance(event, Shift):
            self.shifts.append(event)
        elif isinstance(event, Started):
            self.started = event
        elif isinstance(event, Finished):
            self.finished = event

    @property
    def reason(self) -> FinishReason:
        return self.finished.reason if self.finished else FinishReason.UNSPECIFIED

    @property
    def usage(self) -> Usage:
        return self.finished.usage if self.finished else Usage()

    @property
    def num_evicted_cells(self) -> int:
        return sum(s.num_cells_evicted for s in self.shifts)

    @property
    def num_evicted_media(self) -> int:
        return sum(len(s.media_ids_evicted) for s in self.shifts)


def collect(events: Iterable[Event], on_event: Callable[[Event], None] | None = None) -> Completion:
    """Drain a generate() stream into a Completion (on_event sees each event as it comes)."""
    done = Completion()
    for event in events:
        if on_event:
            on_event(event)
        done.add(event)
    return done


async def acollect(
    events: AsyncIterator[Event], on_event: Callable[[Event], None] | None = None
) -> Completion:
    done = Completion()
    async for event in events:
        if on_event:
            on_event(event)
        done.add(event)
    return done


# ---------------------------------------------------------------------------------------------
# connection settings


@dataclass(frozen=True)
class Tls:
    """TLS settings: root certificates to trust, and a client certificate + key for mTLS."""

    root_certificates: bytes | None = None  # None: the system's roots
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # override the name checked in the server's certificate

    @classmethod
    def from_files(
        cls,
        ca: str | os.PathLike | None = None,
        cert: str | os.PathLike | None = None,
        key: str | os.PathLike | None = None,
        server_name: str | None = None,
    ) -> Tls:
        def read(p: str | os.PathLike | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return cls(read(ca), read(cert), read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            self.root_certificates, self.private_key, self.certificate_chain
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for UNAVAILABLE on idempotent calls.

    Attempt k (1-based) that fails is followed by a sleep of
    min(max_backoff, initial_backoff * multiplier ** (k - 1)), +/- jitter of it, as long as
    attempts remain and the call's deadline leaves time for it.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def backoff(self, attempt: int) -> float:
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


NO_RETRY = RetryPolicy(max_attempts=1)

# retried like the other idempotent calls; Create/Delete/Save/Restore change state: never
_IDEMPOTENT_SESSION_CALLS = frozenset({"GetSession", "ListSessions"})


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # reconnect soon after a server (re)appears; our own backoff paces the attempts
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class _Settings:
    """What both clients share: addresses, credentials, metadata, deadlines, retries."""

    def __init__(
        self,
        prep_address: str | None,
        infer_address: str | None,
        *,
        tls: Tls | None,
        token: str | None,
        timeout: float | None,
        retry: RetryPolicy,
        max_message_bytes: int,
        metadata: Sequence[tuple[str, str]],
        compression: grpc.Compression | None = None,
    ):
        if prep_address is None and infer_address is None:
            raise ValueError("give prep_address, infer_address or both")
        self.prep_address = prep_address
        self.infer_address = infer_address
        self.tls = tls
        self.timeout = timeout
        self.retry = retry
        self.options = channel_options(max_message_bytes)
        self.compression = compression
        if tls and tls.server_name:
            self.options.append(("grpc.ssl_target_name_override", tls.server_name))
        md = list(metadata)
        if token:
            md.append(("authorization", f"Bearer {token}"))
        self.metadata = tuple(md)

    def deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        return None if t is None or t <= 0 else time.monotonic() + t

    def next_sleep(
        self, attempt: int, error: grpc.RpcError, deadline: float | None
    ) -> float | None:
        """Seconds to wait before the next attempt, or None to give up now."""
        code = error.code() if hasattr(error, "code") else None
        if code not in self.retry.retry_codes or attempt >= self.retry.max_attempts:
            return None
        sleep = self.retry.backoff(attempt)
        if deadline is not None and time.monotonic() + sleep >= deadline:
            return None
        log.info(
            "%s: attempt %d/%d, retrying in %.2fs",
            code.name if code else "error",
            attempt,
            self.retry.max_attempts,
            sleep,
        )
        return sleep


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.001, deadline - time.monotonic())


def _need(address: str | None, which: str) -> None:
    if address is None:
        raise ValueError(f"this client has no {which} address")


def _prepared_pb(prompt: Prepared | prompt_pb2.PreparedPrompt) -> prompt_pb2.PreparedPrompt:
    return prompt.prompt if isinstance(prompt, Prepared) else prompt


# ---------------------------------------------------------------------------------------------
# the blocking client


class _ClientBase:
    """What both clients are made of: addresses, security, deadlines, retries."""

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
        self._s = _Settings(
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
        self._connect()

    def _connect(self) -> None:
        raise NotImplementedError


class SlotwiseClient(_ClientBase):
    """Blocking client for a PrepService and an InferService (either address may be omitted).

    timeout: default deadline in seconds for every call but Generate (None: no deadline).
    retry: backoff for UNAVAILABLE on Prepare/CountTokens/GetModelInfo/GetServerInfo.
    token: sent as `authorization: Bearer <token>` on every call.
    compression: e.g. grpc.Compression.Gzip for every call (the services accept it); prep
    already sends images as their files, so it mostly helps long token lists.
    """

    def _connect(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        s = self._s
        self._prep = prep_pb2_grpc.PrepServiceStub(self._open("prep")) if s.prep_address else None
        self._infer = (
            infer_pb2_grpc.InferServiceStub(self._open("infer")) if s.infer_address else None
        )

    def _open(self, which: str) -> grpc.Channel:
        address = self._s.prep_address if which == "prep" else self._s.infer_address
        assert address is not None
        if self._s.tls:
            ch = grpc.secure_channel(
                address,
                self._s.tls.credentials(),
                options=self._s.options,
                compression=self._s.compression,
            )
        else:
            ch = grpc.insecure_channel(
                address, options=self._s.options, compression=self._s.compression
            )
        self._channels[which] = ch
        return ch

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> SlotwiseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        deadline = self._s.deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=_remaining(deadline), metadata=self._s.metadata)
            except grpc.RpcError as e:
                sleep = self._s.next_sleep(attempt, e, deadline)
                if sleep is None:
                    raise SlotwiseError.from_rpc_error(e) from None
            time.sleep(sleep)

    # -- PrepService --------------------------------------------------------------------------

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        _need(self._s.prep_address, "prep")
        assert self._prep is not None
        r = self._unary(self._prep.GetModelInfo, prep_pb2.GetModelInfoRequest(), timeout)
        return ModelInfo.from_pb(r.info)

    def prepare(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
    ) -> Prepared:
        """Messages (chat template applied) or a raw prompt whose media markers take `images`.

        first_message: only the chunks of messages[first_message:] (a session turn).
        """
        _need(self._s.prep_address, "prep")
        assert self._prep is not None
        request = prep_pb2.PrepareRequest(
            **_input_fields(prompt, images, add_special, first_message, sizes_allowed=False)
        )
        r = self._unary(self._prep.Prepare, request, timeout)
        return Prepared(r.prompt, r.rendered_text)

    def count(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
    ) -> Count:
        """Cells and positions without preparing; images may be ImageSize / (w, h) sizes."""
        _need(self._s.prep_address, "prep")
        assert self._prep is not None
        request = prep_pb2.CountTokensRequest(
            **_input_fields(prompt, images, add_special, first_message, sizes_allowed=True)
        )
        return Count.from_pb(self._unary(self._prep.CountTokens, request, timeout))

    # -- InferService -------------------------------------------------------------------------

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        _need(self._s.infer_address, "infer")
        assert self._infer is not None
        r = self._unary(self._infer.GetServerInfo, infer_pb2.GetServerInfoRequest(), timeout)
        return ServerInfo.from_pb(r)

    def generate(
        self,
        prompt: Prepared | prompt_pb2.PreparedPrompt | PromptInput,
        images: Sequence[ImageInput] = (),
        *,
        timeout: float | None = None,
        prepare_timeout: float | None = None,
        **options: Any,
    ) -> Generator[Event, None, None]:
        """Stream the events of one generation.

        prompt: a Prepared prompt, or messages / a raw prompt to prepare first.
        options: see `generate_request` (max_tokens, temperature, seed, stop, policy, keep,
        discard_fraction, unit, truncate_prompt, ...). timeout: deadline for the whole
        generation (default none). Never retried. Stopping the iteration cancels the call.
        """
        _need(self._s.infer_address, "infer")
        if isinstance(prompt, Prepared | prompt_pb2.PreparedPrompt):
            pb = _prepared_pb(prompt)
        else:
            pb = self.prepare(prompt, images, timeout=prepare_timeout).prompt
        request = generate_request(pb, **options)
        return self._stream(request, timeout)

    def _stream(
        self, request: infer_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[Event, None, None]:
        assert self._infer is not None
        call = self._infer.Generate(request, timeout=timeout, metadata=self._s.metadata)
        finished: Finished | None = None
        try:
            for pb in call:
                event = event_from_pb(pb)
                if event is not None:
                    finished = event if isinstance(event, Finished) else None
                    yield event
        except grpc.RpcError as e:
            raise _stream_error(e, finished) from None
        finally:
            if finished is None:
                call.cancel()

    # -- sessions (InferService) --------------------------------------------------------------

    def create_session(
        self, session_id: str = "", *, timeout: float | None = None, **options: Any
    ) -> SessionInfo:
        """A new session (empty id: the server picks one) with default sampling/context options
        for its turns (see `generate_request`). Not retried: the id may already be taken."""
        r = self._session_call(
            "CreateSession", create_session_request(session_id, **options), timeout
        )
        return SessionInfo.from_pb(r.session)

    def get_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        request = infer_pb2.GetSessionRequest(session_id=session_id)
        return SessionInfo.from_pb(self._session_call("GetSession", request, timeout).session)

    def list_sessions(self, *, timeout: float | None = None) -> list[SessionInfo]:
        r = self._session_call("ListSessions", infer_pb2.ListSessionsRequest(), timeout)
        return [SessionInfo.from_pb(x) for x in r.sessions]

    def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        request = infer_pb2.DeleteSessionRequest(session_id=session_id)
        self._session_call("DeleteSession", request, timeout)

    def save_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        request = infer_pb2.SaveSessionRequest(session_id=session_id)
        return SessionInfo.from_pb(self._session_call("SaveSession", request, timeout).session)

    def restore_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        request = infer_pb2.RestoreSessionRequest(session_id=session_id)
        return SessionInfo.from_pb(self._session_call("RestoreSession", request, timeout).session)

    def _session_call(self, name: str, request: Any, timeout: float | None) -> Any:
        _need(self._s.infer_address, "infer")
        assert self._infer is not None
        method = getattr(self._infer, name)
        if name in _IDEMPOTENT_SESSION_CALLS:
            return self._unary(method, request, timeout)
        return self._once(method, request, timeout)

    def _once(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        deadline = self._s.deadline(timeout)
        try:
            return method(request, timeout=_remaining(deadline), metadata=self._s.metadata)
        except grpc.RpcError as e:
            raise SlotwiseError.from_rpc_error(e) from None

    def chat(
        self, messages: Sequence[Message], *, prepare_timeout: float | None = None, **options: Any
    ) -> Generator[Event, None, None]:
        """Prepare the whole conversation, then generate the next assistant message."""
        prepared = self.prepare(list(messages), timeout=prepare_timeout)
        return self.generate(prepared, **options)

    def health(
        self, which: str = "prep", service: str = "", *, timeout: float | None = None
    ) -> str:
        """The grpc.health.v1 status ("SERVING", "NOT_SERVING", ...) of the prep or infer server."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if which not in self._channels:
            raise ValueError(f"this client has no {which} address")
        stub = health_pb2_grpc.HealthStub(self._channels[which])
        r = self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


# ---------------------------------------------------------------------------------------------
# the asyncio client


class AsyncSlotwiseClient(_ClientBase):
    """The grpc.aio twin of `SlotwiseClient`: same arguments, awaitable methods, and
    `generate`/`chat` are async iterators of the same events."""

    def _connect(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        s = self._s
        self._prep = prep_pb2_grpc.PrepServiceStub(self._open("prep")) if s.prep_address else None
        self._infer = (
            infer_pb2_grpc.InferServiceStub(self._open("infer")) if s.infer_address else None
        )

    def _open(self, which: str) -> grpc.aio.Channel:
        address = self._s.prep_address if which == "prep" else self._s.infer_address
        assert address is not None
        if self._s.tls:
            ch = grpc.aio.secure_channel(
                address,
                self._s.tls.credentials(),
                options=self._s.options,
                compression=self._s.compression,
            )
        else:
            ch = grpc.aio.insecure_channel(
                address, options=self._s.options, compression=self._s.compression
            )
        self._channels[which] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncSlotwiseClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(
        self, method: Callable[..., Awaitable[T]], request: Any, timeout: float | None
    ) -> T:
        deadline = self._s.deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(
                    request, timeout=_remaining(deadline), metadata=self._s.metadata
                )
            except grpc.RpcError as e:
                sleep = self._s.next_sleep(attempt, e, deadline)
                if sleep is None:
                    raise SlotwiseError.from_rpc_error(e) from None
            await asyncio.sleep(sleep)

    async def serving(self, *, timeout: float = 2.0) -> dict[str, bool]:
        """Whether each service's gRPC health says SERVING (False when it cannot be asked)."""
        out = {}
        for which, channel in self._channels.items():
            try:
                r = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout
                )
                out[which] = r.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                out[which] = False
        return out

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        _need(self._s.prep_address, "prep")
        assert self._prep is not None
        r = await self._unary(self._prep.GetModelInfo, prep_pb2.GetModelInfoRequest(), timeout)
        return ModelInfo.from_pb(r.info)

    async def prepare(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
    ) -> Prepared:
        _need(self._s.prep_address, "prep")
        assert self._prep is not None
        fields = await asyncio.to_thread(
            _input_fields, prompt, images, add_special, first_message, sizes_allowed=False
        )  # reading and encoding images is blocking work
        r = await self._unary(self._prep.Prepare, prep_pb2.PrepareRequest(**fields), timeout)
        return Prepared(r.prompt, r.rendered_text)

    async def count(
        self,
        prompt: PromptInput,
        images: Sequence[ImageInput] = (),
        *,
        add_special: bool = True,
        first_message: int = 0,
        timeout: float | None = None,
    ) -> Count:
        _need(self._s.prep_address, "prep")
        assert self._prep is not None
        fields = await asyncio.to_thread(
            _input_fields, prompt, images, add_special, first_message, sizes_allowed=True
        )
        r = await self._unary(
            self._prep.CountTokens, prep_pb2.CountTokensRequest(**fields), timeout
        )
        return Count.from_pb(r)

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        _need(self._s.infer_address, "infer")
        assert self._infer is not None
        r = await self._unary(self._infer.GetServerInfo, infer_pb2.GetServerInfoRequest(), timeout)
        return ServerInfo.from_pb(r)

    async def generate(
        self,
        prompt: Prepared | prompt_pb2.PreparedPrompt | PromptInput,
        images: Sequence[ImageInput] = (),
        *,
        timeout: float | None = None,
        prepare_timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[Event]:
        """Async iterator of the events of one generation; see SlotwiseClient.generate."""
        _need(self._s.infer_address, "infer")
        assert self._infer is not None
        if isinstance(prompt, Prepared | prompt_pb2.PreparedPrompt):
            pb = _prepared_pb(prompt)
        else:
            pb = (await self.prepare(prompt, images, timeout=prepare_timeout)).prompt
        request = generate_request(pb, **options)
        call = self._infer.Generate(request, timeout=timeout, metadata=self._s.metadata)
        finished: Finished | None = None
        try:
            async for pb_event in call:
                event = event_from_pb(pb_event)
                if event is not None:
                    finished = event if isinstance(event, Finished) else None
                    yield event
        except grpc.RpcError as e:
            raise _stream_error(e, finished) from None
        finally:
            if finished is None:
                call.cancel()

    # -- sessions (InferService) --------------------------------------------------------------

    async def create_session(
        self, session_id: str = "", *, timeout: float | None = None, **options: Any
    ) -> SessionInfo:
        request = create_session_request(session_id, **options)
        return SessionInfo.from_pb(
            (await self._session_call("CreateSession", request, timeout)).session
        )

    async def get_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        request = infer_pb2.GetSessionRequest(session_id=session_id)
        return SessionInfo.from_pb(
            (await self._session_call("GetSession", request, timeout)).session
        )

    async def list_sessions(self, *, timeout: float | None = None) -> list[SessionInfo]:
        r = await self._session_call("ListSessions", infer_pb2.ListSessionsRequest(), timeout)
        return [SessionInfo.from_pb(x) for x in r.sessions]

    async def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        request = infer_pb2.DeleteSessionRequest(session_id=session_id)
        await self._session_call("DeleteSession", request, timeout)

    async def save_session(self, session_id: str, *, timeout: float | None = None) -> SessionInfo:
        request = infer_pb2.SaveSessionRequest(session_id=session_id)
        return SessionInfo.from_pb(
            (await self._session_call("SaveSession", request, timeout)).session
        )

    async def restore_session(
        self, session_id: str, *, timeout: float | None = None
    ) -> SessionInfo:
        request = infer_pb2.RestoreSessionRequest(session_id=session_id)
        r = await self._session_call("RestoreSession", request, timeout)
        return SessionInfo.from_pb(r.session)

    async def _session_call(self, name: str, request: Any, timeout: float | None) -> Any:
        _need(self._s.infer_address, "infer")
        assert self._infer is not None
        method = getattr(self._infer, name)
        if name in _IDEMPOTENT_SESSION_CALLS:
            return await self._unary(method, request, timeout)
        deadline = self._s.deadline(timeout)
        try:
            return await method(request, timeout=_remaining(deadline), metadata=self._s.metadata)
        except grpc.RpcError as e:
            raise SlotwiseError.from_rpc_error(e) from None

    async def chat(
        self, messages: Sequence[Message], *, prepare_timeout: float | None = None, **options: Any
    ) -> AsyncIterator[Event]:
        prepared = await self.prepare(list(messages), timeout=prepare_timeout)
        async for event in self.generate(prepared, **options):
            yield event
