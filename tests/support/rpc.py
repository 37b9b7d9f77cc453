"""Client helpers for tests that talk to real services over loopback (sync stubs)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2

MAX_MESSAGE = 256 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]

_prep_channels: dict[int, grpc.Channel] = {}


def channel(port: int) -> grpc.Channel:
    """A new channel to a loopback port (close it; or use it as a context manager)."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)


def prep_stub(port: int) -> prep_pb2_grpc.PrepServiceStub:
    """Prep servers live for the whole session: their channels are kept."""
    ch = _prep_channels.get(port)
    if ch is None:
        ch = _prep_channels[port] = channel(port)
    return prep_pb2_grpc.PrepServiceStub(ch)


# -- building prompts ---------------------------------------------------------------------------


def image_part(data: bytes) -> prep_pb2.Part:
    return prep_pb2.Part(image=prep_pb2.Image(data=data))


def message(role: str, *parts: str | bytes) -> prep_pb2.Message:
    """A chat message: str parts are text, bytes parts are encoded image files."""
    pbs = [prep_pb2.Part(text=p) if isinstance(p, str) else image_part(p) for p in parts]
    return prep_pb2.Message(role=role, parts=pbs)


def prepare(
    port: int,
    *,
    messages: Iterable[prep_pb2.Message] | None = None,
    raw: str | None = None,
    images: Iterable[bytes] = (),
    add_special: bool = True,
) -> prompt_pb2.PreparedPrompt:
    """Prepare a chat (messages) or a raw prompt (raw text, markers replaced by images)."""
    if (messages is None) == (raw is None):
        raise ValueError("give messages or raw, not both")
    if messages is not None:
        request = prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=list(messages)))
    else:
        request = prep_pb2.PrepareRequest(
            raw=prep_pb2.RawPrompt(
                text=raw,
                images=[prep_pb2.Image(data=d) for d in images],
                add_special=add_special,
            )
        )
    return prep_stub(port).Prepare(request, timeout=30).prompt


def media_marker(port: int) -> str:
    return (
        prep_stub(port).GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info.media_marker
    )


# -- generating ---------------------------------------------------------------------------------


def request(
    prompt: prompt_pb2.PreparedPrompt,
    *,
    max_tokens: int = 32,
    stop: Iterable[str] = (),
    policy: int | None = None,
    truncate_prompt: bool | None = None,
    keep: int | None = None,
    **sampling: float | int,
) -> infer_pb2.GenerateRequest:
    """A GenerateRequest; sampling defaults to greedy (temperature 0). Context options left
    out are not set (the server's, or a session's, apply)."""
    sampling.setdefault("temperature", 0.0)
    context = {"policy": policy, "truncate_prompt": truncate_prompt, "keep": keep}
    return infer_pb2.GenerateRequest(
        prompt=prompt,
        sampling=infer_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        stop=list(stop),
        context=infer_pb2.ContextOptions(**{k: v for k, v in context.items() if v is not None}),  # type: ignore[arg-type]
    )


def generate(
    port: int, req: infer_pb2.GenerateRequest, *, timeout: float = 60
) -> list[infer_pb2.GenerateResponse]:
    """Every event of one Generate stream (raises grpc.RpcError on a failed call)."""
    with channel(port) as ch:
        return list(infer_pb2_grpc.InferServiceStub(ch).Generate(req, timeout=timeout))


def server_info(port: int) -> infer_pb2.GetServerInfoResponse:
    with channel(port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        return stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)


@dataclass
class Stream:
    """The events of one Generate call, sorted by kind."""

    events: list[infer_pb2.GenerateResponse]
    kinds: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.kinds = [e.WhichOneof("event") for e in self.events]

    def of(self, kind: str) -> list:
        return [getattr(e, kind) for e in self.events if e.WhichOneof("event") == kind]

    @property
    def started(self) -> infer_pb2.Started:
        (s,) = self.of("started")
        return s

    @property
    def finished(self) -> infer_pb2.Finished:
        (f,) = self.of("finished")
        return f

    @property
    def prefill(self) -> list[infer_pb2.PrefillProgress]:
        return self.of("prefill")

    @property
    def shifts(self) -> list[infer_pb2.ContextShift]:
        return self.of("shift")

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.of("delta") for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.of("delta"))


def run(port: int, req: infer_pb2.GenerateRequest, *, timeout: float = 60) -> Stream:
    return Stream(generate(port, req, timeout=timeout))


def rpc_error(call) -> grpc.RpcError:
    """Run call() and return the grpc.RpcError it raises (fails when it succeeds)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded, an error was expected")


def rgb_of(media: prompt_pb2.MediaChunk) -> bytes:
    """A media chunk's pixels, whichever form they travel in (prep sends the image file)."""
    if media.WhichOneof("pixels") == "rgb":
        return media.rgb
    from slotwise_core.images import decode_image

    return decode_image(media.encoded).rgb


def fields_of(e: grpc.RpcError) -> list[str]:
    """The request fields a failed call's BadRequest detail names."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(e)
    assert status is not None, e.details()
    fields: list[str] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


def reason_of(e: grpc.RpcError) -> str:
    """The ErrorInfo reason of a failed call ("" without one)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(e)
    assert status is not None, e.details()
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def streams_under_way(stub: infer_pb2_grpc.InferServiceStub, prompt: prompt_pb2.PreparedPrompt,
                      seeds: Iterable[int], max_tokens: int) -> dict[int, Any]:  # fmt: skip
    """Generate calls past their Started and first PrefillProgress, by the slot each took."""
    calls = {}
    for seed in seeds:
        call = stub.Generate(request(prompt, max_tokens=max_tokens, seed=seed), timeout=60)
        calls[next(call).started.slot] = call
        assert next(call).HasField("prefill")
    return calls
