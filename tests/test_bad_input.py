"""Bad input to both services, the cases test_prep_service / test_infer_service / test_sessions do
not already cover: every refusal has the right status code and a message that names the
problem, and the next good request on the same server succeeds. Then a hypothesis fuzz of the
descriptor path: mutated PreparedPrompts sent to a real infer server.

Covered elsewhere (not repeated here): prep's request matrix and invalid UTF-8
(test_prep_service), stale/foreign/tampered media counts, forged pixels, unknown policy 99 /
unit 7, discard_fraction 1.5, empty prompt, six sampling values, prompts that cannot fit,
non-causal ubatch (test_infer_service), bad session ids (test_sessions).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer_service.__main__ import start as start_infer
from infer_service.api.request import GenerateLimits
from infer_service.runner.runtime import RuntimeConfig
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.media import image_bytes
from support.rpc import Stream, channel, message, prepare, rgb_of, rpc_error, run, server_info
from support.rpc import request as make_request

Code = grpc.StatusCode
IA, FP, RE = Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED
LENGTH = infer_pb2.FINISH_REASON_LENGTH
NAN, INF = float("nan"), float("inf")
DEFAULT_MAX_TOKENS = 5  # the server's default, so that max_tokens 0 shows it is used
MAX_MESSAGE = 1 << 20  # the infer server's receive limit here
NUM_VOCAB = 271  # every tiny pair's vocabulary


@dataclass(frozen=True)
class Prompts:
    text: prompt_pb2.PreparedPrompt
    image: prompt_pb2.PreparedPrompt  # [text, <|vision_start|>, image, <|vision_end|>, text]
    encoded: prompt_pb2.PreparedPrompt  # the same, its image as prep sends it (a file)

    @property
    def media_at(self) -> int:
        return next(i for i, c in enumerate(self.image.chunks) if c.HasField("media"))


@pytest.fixture(scope="module")
def infer(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Any]:
    """One mrope infer server (2 slots x 256 cells) for every case of this module."""
    pair = tiny["mrope"]
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=512, parallel=2, threads=1)
    running = loop_thread.run(
        start_infer(
            config,
            limits=GenerateLimits(default_max_tokens=DEFAULT_MAX_TOKENS),
            max_message_bytes=MAX_MESSAGE,
        )
    )
    yield running
    loop_thread.run(running.stop(0))


@pytest.fixture(scope="module")
def prompts(prep_servers: Callable[[str], int]) -> Prompts:
    port = prep_servers("mrope")
    encoded = prepare(port, messages=[message("user", "see", image_bytes(224, 224, seed=7), "now")])
    return Prompts(
        text=prepare(port, raw="The quick brown fox"), image=as_rgb(encoded), encoded=encoded
    )


def as_rgb(prompt: prompt_pb2.PreparedPrompt) -> prompt_pb2.PreparedPrompt:
    """The prompt with its images as raw RGB (still accepted), decoded as infer decodes them."""
    out = copy(prompt)
    for c in out.chunks:
        if c.WhichOneof("kind") == "media":
            c.media.rgb = rgb_of(c.media)
    return out


def copy(prompt: prompt_pb2.PreparedPrompt) -> prompt_pb2.PreparedPrompt:
    out = prompt_pb2.PreparedPrompt()
    out.CopyFrom(prompt)
    return out


def chunk_cells(c: prompt_pb2.Chunk) -> tuple[int, int]:
    if c.HasField("media"):
        return c.media.num_cells, c.media.num_positions
    n = len(c.text.token_ids)
    return n, n


def fix_totals(prompt: prompt_pb2.PreparedPrompt) -> prompt_pb2.PreparedPrompt:
    """Make the totals agree with the chunks, so that only the edit itself can be refused."""
    prompt.num_cells = sum(chunk_cells(c)[0] for c in prompt.chunks)
    prompt.num_positions = sum(chunk_cells(c)[1] for c in prompt.chunks)
    return prompt


def good_request_succeeds(port: int, prompts: Prompts) -> None:
    s = run(port, make_request(prompts.text, max_tokens=2), timeout=30)
    assert (s.finished.reason, s.finished.error, len(s.token_ids)) == (LENGTH, "", 2)


# -- the Generate matrix ------------------------------------------------------------------------


def with_sampling(**values: float) -> Callable[[Prompts], infer_pb2.GenerateRequest]:
    def build(p: Prompts) -> infer_pb2.GenerateRequest:
        req = make_request(p.text)
        for k, v in values.items():
            setattr(req.sampling, k, v)
        return req

    return build


def with_context(**values: Any) -> Callable[[Prompts], infer_pb2.GenerateRequest]:
    def build(p: Prompts) -> infer_pb2.GenerateRequest:
        req = make_request(p.text)
        for k, v in values.items():
            setattr(req.context, k, v)
        return req

    return build


def edited(
    edit: Callable[[prompt_pb2.PreparedPrompt, Prompts], Any],
    *,
    totals: bool = True,
    encoded: bool = False,
):
    """A request for the image prompt (raw RGB, or as prep encodes it) after edit(prompt,
    prompts); totals fixed unless told."""

    def build(p: Prompts) -> infer_pb2.GenerateRequest:
        prompt = copy(p.encoded if encoded else p.image)
        edit(prompt, p)
        return make_request(fix_totals(prompt) if totals else prompt)

    return build


def tokens(ids: list[int]) -> Callable[[Prompts], infer_pb2.GenerateRequest]:
    def build(p: Prompts) -> infer_pb2.GenerateRequest:
        prompt = copy(p.text)
        prompt.chunks[0].text.token_ids[:] = ids
        return make_request(fix_totals(prompt))

    return build


def set_media(**values: Any) -> Callable[[prompt_pb2.PreparedPrompt, Prompts], None]:
    def edit(prompt: prompt_pb2.PreparedPrompt, p: Prompts) -> None:
        for k, v in values.items():
            setattr(prompt.chunks[p.media_at].media, k, v)

    return edit


def delete_chunks(*offsets: int) -> Callable[[prompt_pb2.PreparedPrompt, Prompts], None]:
    """Delete the chunks at these offsets from the media chunk (-1: the wrapper before it)."""

    def edit(prompt: prompt_pb2.PreparedPrompt, p: Prompts) -> None:
        for at in sorted((p.media_at + o for o in offsets), reverse=True):
            del prompt.chunks[at]

    return edit


def append_chunk(chunk: prompt_pb2.Chunk) -> Callable[[prompt_pb2.PreparedPrompt, Prompts], None]:
    return lambda prompt, p: prompt.chunks.append(chunk)


def wrapper_token(token: int) -> Callable[[prompt_pb2.PreparedPrompt, Prompts], None]:
    def edit(prompt: prompt_pb2.PreparedPrompt, p: Prompts) -> None:
        prompt.chunks[p.media_at - 1].text.token_ids[:] = [token]

    return edit


def other_fingerprint(
    model: str, mmproj: str
) -> Callable[[prompt_pb2.PreparedPrompt, Prompts], None]:
    def edit(prompt: prompt_pb2.PreparedPrompt, p: Prompts) -> None:
        prompt.fingerprint.model, prompt.fingerprint.mmproj = model, mmproj

    return edit


def request_with(**fields: Any) -> Callable[[Prompts], infer_pb2.GenerateRequest]:
    def build(p: Prompts) -> infer_pb2.GenerateRequest:
        req = make_request(p.text)
        for k, v in fields.items():
            if isinstance(v, list):
                getattr(req, k)[:] = v
            else:
                setattr(req, k, v)
        return req

    return build


def oversize(p: Prompts) -> infer_pb2.GenerateRequest:
    prompt = copy(p.image)
    prompt.chunks[p.media_at].media.rgb = bytes(MAX_MESSAGE + 1)
    return make_request(prompt)


def sampling_message(field: str, lo: float, hi: float) -> str:
    return f"sampling.{field} must be within [{lo}, {hi}], got"


GENERATE: dict[str, tuple[Callable[[Prompts], infer_pb2.GenerateRequest], Code, str]] = {
    "max_tokens over the limit": (
        request_with(max_tokens=(1 << 32) - 1),
        IA,
        "max_tokens 4294967295 is over the limit 1048576",
    ),
    "17 stop strings": (request_with(stop=["x"] * 17), IA, "at most 16 stop strings"),
    # sampling: every field, values the existing tests do not try
    "temperature absurd": (
        with_sampling(temperature=1e9),
        IA,
        "sampling.temperature must be within [0.0, 100.0], got 1000000000.0",
    ),
    "temperature inf": (with_sampling(temperature=INF), IA, "got inf"),
    "top_p negative": (with_sampling(top_p=-0.5), IA, sampling_message("top_p", 0.0, 1.0)),
    "top_p NaN": (
        with_sampling(top_p=NAN),
        IA,
        "sampling.top_p must be within [0.0, 1.0], got nan",
    ),
    "min_p over 1": (
        with_sampling(min_p=1.5),
        IA,
        "sampling.min_p must be within [0.0, 1.0], got 1.5",
    ),
    "min_p negative": (with_sampling(min_p=-0.25), IA, sampling_message("min_p", 0.0, 1.0)),
    "top_k absurd": (
        with_sampling(top_k=(1 << 31) - 1),
        IA,
        "sampling.top_k must be within [0, 1048576], got 2147483647",
    ),
    "repeat_penalty NaN": (
        with_sampling(repeat_penalty=NAN),
        IA,
        "sampling.repeat_penalty must be within [0.001, 100.0], got nan",
    ),
    "repeat_penalty negative": (
        with_sampling(repeat_penalty=-1.0),
        IA,
        sampling_message("repeat_penalty", 0.001, 100.0),
    ),
    "penalty_last_n below -1": (
        with_sampling(penalty_last_n=-2),
        IA,
        "sampling.penalty_last_n must be within [-1, 1048576], got -2",
    ),
    "penalty_last_n absurd": (
        with_sampling(penalty_last_n=1 << 30),
        IA,
        "sampling.penalty_last_n must be within [-1, 1048576], got 1073741824",
    ),
    "presence_penalty NaN": (
        with_sampling(presence_penalty=NAN),
        IA,
        "sampling.presence_penalty must be within [-100.0, 100.0], got nan",
    ),
    "presence_penalty absurd": (
        with_sampling(presence_penalty=1e6),
        IA,
        "sampling.presence_penalty must be within [-100.0, 100.0], got 1000000.0",
    ),
    "frequency_penalty -inf": (
        with_sampling(frequency_penalty=-INF),
        IA,
        "sampling.frequency_penalty must be within [-100.0, 100.0], got -inf",
    ),
    "frequency_penalty NaN": (
        with_sampling(frequency_penalty=NAN),
        IA,
        "sampling.frequency_penalty must be within [-100.0, 100.0], got nan",
    ),
    # context options: enum values out of range both ways, fractions outside [0, 1]
    "negative policy": (with_context(policy=-1), IA, "unknown shift policy -1"),
    "policy one past the last": (with_context(policy=6), IA, "unknown shift policy 6"),
    "unit one past the last": (with_context(unit=3), IA, "unknown eviction unit 3"),
    "negative unit": (with_context(unit=-2), IA, "unknown eviction unit -2"),
    "discard_fraction negative": (
        with_context(discard_fraction=-0.25),
        IA,
        "discard_fraction must be within [0, 1], got -0.25",
    ),
    "discard_fraction NaN": (
        with_context(discard_fraction=NAN),
        IA,
        "discard_fraction must be within [0, 1], got nan",
    ),
    # malformed descriptors
    "totals do not add up": (
        edited(lambda prompt, p: setattr(prompt, "num_cells", prompt.num_cells + 1), totals=False),
        IA,
        "prompt totals say",
    ),
    "chunk with neither text nor media": (
        edited(append_chunk(prompt_pb2.Chunk(message_index=1))),
        IA,
        "a chunk has neither text nor media",
    ),
    "media without a group": (
        edited(lambda prompt, p: setattr(prompt.chunks[p.media_at], "media_group", 0)),
        IA,
        "has no media_group",
    ),
    "text chunk without tokens": (
        edited(append_chunk(prompt_pb2.Chunk(text=prompt_pb2.TextChunk()))),
        IA,
        "a text chunk has no tokens",
    ),
    "media with zero cells": (edited(set_media(num_cells=0)), IA, "has zero cells or positions"),
    "media with zero positions": (
        edited(set_media(num_positions=0)),
        IA,
        "has zero cells or positions",
    ),
    "rgb truncated": (
        edited(lambda prompt, p: setattr(prompt.chunks[p.media_at].media, "rgb", b"\0" * 30)),
        IA,
        "30 bytes of RGB do not make a 224x224 image",
    ),
    "encoded image damaged": (
        edited(
            lambda prompt, p: setattr(
                prompt.chunks[p.media_at].media, "encoded", b"\x89PNG" + b"\0" * 64
            ),
            encoded=True,
        ),
        FP,
        "not a PNG, JPEG, WebP, GIF or BMP file",
    ),
    "encoded image of other pixels": (
        edited(
            lambda prompt, p: setattr(
                prompt.chunks[p.media_at].media, "encoded", image_bytes(224, 224, seed=8)
            ),
            encoded=True,
        ),
        FP,
        "the image decodes here to other pixels",
    ),
    "encoded image with another size": (
        edited(set_media(width=112, height=448), encoded=True),
        FP,
        "the image decodes here to other pixels",
    ),
    "width and height swapped for other sizes": (
        edited(set_media(width=112, height=448)),
        IA,
        "media_id is not the hash of its pixels",
    ),
    "group without its media chunk": (
        edited(delete_chunks(0)),
        IA,
        "media group 1 has no media chunk",
    ),
    "group without its closing wrapper": (
        edited(delete_chunks(1)),
        FP,
        "media group 1: libmtmd makes 3 chunks of this image, the descriptor has 2",
    ),
    "wrapper token replaced": (
        edited(wrapper_token(5)),
        FP,
        "media group 1 chunk 0: wrapper tokens differ from libmtmd's",
    ),
    "foreign fingerprint": (
        edited(other_fingerprint("0" * 64, "f" * 64)),
        FP,
        "prompt was prepared for model 000000000000/ffffffffffff but this server runs",
    ),
    "no fingerprint": (
        edited(other_fingerprint("", "")),
        FP,
        "prompt was prepared for model /- but this server runs",
    ),
    # token ids outside the vocabulary: llama_decode would refuse the whole batch (rc -1) and
    # end every sequence in it, other clients' included
    "token id = n_vocab": (
        tokens([5, NUM_VOCAB, 7]),
        IA,
        f"chunk 0: token id {NUM_VOCAB} is outside this model's vocabulary [0, {NUM_VOCAB})",
    ),
    "negative token id": (tokens([-1, 5]), IA, "chunk 0: token id -1 is outside"),
    "token id int32 max": (tokens([5, (1 << 31) - 1]), IA, "token id 2147483647 is outside"),
    "message over the size limit": (oversize, RE, "larger than max"),
}


@pytest.mark.parametrize("case", GENERATE)
def test_bad_generate_requests_are_refused_and_the_server_carries_on(
    case: str, infer: Any, prompts: Prompts
) -> None:
    build, code, expected = GENERATE[case]
    err = rpc_error(lambda: run(infer.port, build(prompts), timeout=30))
    assert err.code() == code, err.details()
    assert expected in err.details()
    good_request_succeeds(infer.port, prompts)


def test_max_tokens_zero_means_the_servers_default(infer: Any, prompts: Prompts) -> None:
    s = run(infer.port, make_request(prompts.text, max_tokens=0))
    assert (s.finished.reason, len(s.token_ids)) == (LENGTH, DEFAULT_MAX_TOKENS)


def test_keep_beyond_the_whole_sequence_pins_everything_and_never_fails(
    infer: Any, prompts: Prompts
) -> None:
    """keep (uint32) larger than the slot: nothing can be evicted, generation stops at capacity."""
    cap = server_info(infer.port).num_cells_per_slot
    req = make_request(prompts.image, max_tokens=cap, keep=(1 << 32) - 1)
    s = run(infer.port, req)
    f = s.finished
    assert (f.reason, f.error, f.usage.num_shifts) == (LENGTH, "", 0)
    assert prompts.image.num_cells + len(s.token_ids) <= cap + 1
    good_request_succeeds(infer.port, prompts)


def raw_generate(port: int, wire: bytes) -> list[bytes]:
    with channel(port) as ch:
        call = ch.unary_stream(
            "/slotwise.v1.InferService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        return list(call(wire, timeout=10))


@pytest.mark.parametrize("where", ["stop", "session_id"])
def test_invalid_utf8_in_a_generate_request(where: str, infer: Any, prompts: Prompts) -> None:
    req = make_request(prompts.text)
    if where == "stop":
        req.stop.append("PLACEHOLDER")
    else:
        req.session_id = "PLACEHOLDER"
    wire = req.SerializeToString()
    assert wire.count(b"PLACEHOLDER") == 1
    err = rpc_error(
        lambda: raw_generate(infer.port, wire.replace(b"PLACEHOLDER", b"\xffLACEHOLDER"))
    )
    assert err.code() == IA and "cannot parse the request" in err.details()
    good_request_succeeds(infer.port, prompts)


def test_garbage_bytes_as_a_generate_request(infer: Any, prompts: Prompts) -> None:
    err = rpc_error(lambda: raw_generate(infer.port, b"\xff" * 64))
    assert err.code() == IA and "cannot parse the request" in err.details()
    good_request_succeeds(infer.port, prompts)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("temperature", NAN, "sampling.temperature must be within"),
        ("top_k", -1, "sampling.top_k must be within"),
    ],
)
def test_create_session_validates_its_defaults(
    field: str, value: float, expected: str, infer: Any, prompts: Prompts
) -> None:
    req = infer_pb2.CreateSessionRequest(session_id="bad-defaults")
    setattr(req.sampling, field, value)
    with channel(infer.port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        err = rpc_error(lambda: stub.CreateSession(req, timeout=10))
        assert err.code() == IA and expected in err.details()
        listed = stub.ListSessions(infer_pb2.ListSessionsRequest(), timeout=10).sessions
    assert "bad-defaults" not in [s.session_id for s in listed]
    good_request_succeeds(infer.port, prompts)


def test_a_bad_token_does_not_end_a_concurrent_generation(infer: Any, prompts: Prompts) -> None:
    """Before the vocabulary check, llama_decode refused the shared batch: both requests ended."""
    with channel(infer.port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        long = stub.Generate(make_request(prompts.text, max_tokens=200), timeout=60)
        events = iter(long)
        assert next(events).HasField("started")
        assert next(e for e in events if e.HasField("delta"))
        for ids in ([3, NUM_VOCAB + 10], [-7]):
            err = rpc_error(lambda ids=ids: run(infer.port, tokens(ids)(prompts), timeout=30))
            assert err.code() == IA and "outside this model's vocabulary" in err.details()
        rest = Stream(list(events))
    f = rest.finished
    assert (f.reason, f.error, f.usage.num_generated_tokens) == (LENGTH, "", 200)


# -- prep: what its own matrix leaves out -------------------------------------------------------


def chat_request(*messages: prep_pb2.Message, first: int = 0) -> prep_pb2.PrepareRequest:
    return prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=list(messages)), first_message=first)


PREP: dict[str, tuple[Callable[[], prep_pb2.PrepareRequest], str]] = {
    "empty role": (lambda: chat_request(message("", "hi")), "message 0: unknown role ''"),
    "first_message past the last": (
        lambda: chat_request(message("user", "hi"), message("assistant", "yo"), first=5),
        "first_message 5 is past the last message (1)",
    ),
    "first_message with a raw prompt": (
        lambda: prep_pb2.PrepareRequest(raw=prep_pb2.RawPrompt(text="hi"), first_message=1),
        "first_message applies to chat input only",
    ),
    "65 images in a chat": (
        lambda: chat_request(*[message("user", image_bytes(28, 28, seed=i)) for i in range(65)]),
        "more than 64 images in one request",
    ),
}


@pytest.mark.parametrize("case", PREP)
def test_bad_prepare_requests_are_refused(
    case: str, prep_servers: Callable[[str], int], prompts: Prompts
) -> None:
    build, expected = PREP[case]
    with channel(prep_servers("mrope")) as ch:
        stub = prep_pb2_grpc.PrepServiceStub(ch)
        err = rpc_error(lambda: stub.Prepare(build(), timeout=30))
        assert err.code() == IA, err.details()
        assert expected in err.details()
        again = stub.Prepare(chat_request(message("user", "see", image_bytes(56, 56))), timeout=30)
    assert sum(c.HasField("media") for c in again.prompt.chunks) == 1


# -- fuzzing the descriptor path ----------------------------------------------------------------

ALLOWED = {IA, FP, RE}
POLICIES = [0, 1, 3, 4, 5]  # unspecified, auto, gap, reprefill, stop (+ truncate_prompt)


def mutate(prompt: prompt_pb2.PreparedPrompt, ops: list[tuple[str, int, int]]) -> None:
    """Apply (op, a, b) edits; a and b are reduced modulo whatever they index."""
    for op, a, b in ops:
        chunks = prompt.chunks
        n = len(chunks)
        if op == "totals":
            prompt.num_cells = (prompt.num_cells + a - 8) % (1 << 32)
            prompt.num_positions = (prompt.num_positions + b - 8) % (1 << 32)
        elif op == "fix_totals":
            fix_totals(prompt)
        elif n == 0:
            continue
        elif op == "drop":
            del chunks[a % n]
        elif op == "duplicate":
            extra = prompt_pb2.Chunk()
            extra.CopyFrom(chunks[a % n])
            chunks.insert(b % (n + 1), extra)
        elif op == "swap":
            i, j = a % n, b % n
            ci, cj = prompt_pb2.Chunk(), prompt_pb2.Chunk()
            ci.CopyFrom(chunks[i])
            cj.CopyFrom(chunks[j])
            chunks[i].CopyFrom(cj)
            chunks[j].CopyFrom(ci)
        elif op == "counts":
            media = [c.media for c in chunks if c.HasField("media")]
            if media:
                m = media[a % len(media)]
                m.num_cells = max(0, m.num_cells + (b % 9) - 4)
                m.num_positions = max(0, m.num_positions + (b // 9 % 9) - 4)
        elif op == "message_index":
            chunks[a % n].message_index = b % 5
        elif op == "media_group":
            chunks[a % n].media_group = b % 4
        elif op == "media_id":
            for c in chunks:
                if c.HasField("media"):
                    c.media.media_id = random.Random(b).randbytes(32).hex() if a % 2 else ""
        elif op == "truncate_rgb":
            for c in chunks:
                if c.HasField("media"):
                    c.media.rgb = c.media.rgb[: b * 97 % len(c.media.rgb)] if c.media.rgb else b""
        elif op == "tokens":
            texts = [c.text for c in chunks if c.HasField("text")]
            if texts:
                r = random.Random(b)
                t = texts[a % len(texts)]
                t.token_ids[:] = [r.randint(-3, NUM_VOCAB + 3) for _ in range(1 + b % 12)]
        elif op == "fingerprint":
            prompt.fingerprint.model = prompt.fingerprint.model[::-1]


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "totals",
                "fix_totals",
                "drop",
                "duplicate",
                "swap",
                "counts",
                "message_index",
                "media_group",
                "media_id",
                "truncate_rgb",
                "tokens",
                "fingerprint",
            ]
        ),
        st.integers(0, 16),
        st.integers(0, 1000),
    ),
    min_size=1,
    max_size=5,
)


def health_ok(port: int) -> bool:
    with channel(port) as ch:
        req = health_pb2.HealthCheckRequest(service="slotwise.v1.InferService")
        status = health_pb2_grpc.HealthStub(ch).Check(req, timeout=10).status
    return status == health_pb2.HealthCheckResponse.SERVING


def test_fuzzed_descriptors_never_break_the_server(infer: Any, prompts: Prompts) -> None:
    seen: dict[str, int] = {}

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        ops=OPS, fix=st.sampled_from([True, True, True, False]), policy=st.sampled_from(POLICIES)
    )
    def one(ops: list[tuple[str, int, int]], fix: bool, policy: int) -> None:
        prompt = copy(prompts.image)
        mutate(prompt, ops)
        if fix:
            fix_totals(prompt)
        req = make_request(prompt, max_tokens=3, policy=policy, truncate_prompt=policy == 5)
        try:
            s = run(infer.port, req, timeout=30)
        except grpc.RpcError as e:
            assert e.code() in ALLOWED, (e.code(), e.details(), ops)
            assert e.details(), ops
            outcome = e.code().name
        else:
            f = s.finished
            assert f.error == "", (f.error, ops)
            assert s.kinds[0] == "started" and s.kinds[-1] == "finished"
            outcome = "stream"
        seen[outcome] = seen.get(outcome, 0) + 1

    one()
    assert health_ok(infer.port)
    good_request_succeeds(infer.port, prompts)
    assert server_info(infer.port).num_active == 0
    assert len(seen) >= 2, seen  # both refusals and streams happened


def test_an_encoded_image_cannot_claim_more_pixels_than_the_limits(infer, prompts) -> None:
    """A small file can decode to a huge image: the claimed sizes are checked first."""
    prompt = copy(prompts.encoded)
    media = prompt.chunks[prompts.media_at].media
    media.width = media.height = 9000  # 81 MP, over the 33 MP a single image may have
    err = rpc_error(lambda: run(infer.port, make_request(fix_totals(prompt)), timeout=30))
    assert err.code() == IA and "over 33177600 pixels" in err.details()
    assert run(infer.port, make_request(prompts.text, max_tokens=2)).finished.reason
