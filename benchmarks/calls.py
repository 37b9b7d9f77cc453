"""Talking to slotwise as the bench does: the prompts every section shares, Prepare of a text,
greedy Generate streams read into a Stream, a chat's messages, one turn of a chat resent whole,
and several calls at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.results import BenchError, Stream
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc

SHIFT_POLICIES = {
    "SHIFT": infer_pb2.SHIFT_POLICY_SHIFT,
    "GAP": infer_pb2.SHIFT_POLICY_GAP,
    "REPREFILL": infer_pb2.SHIFT_POLICY_REPREFILL,
}
POLICY_NAMES = {v: k for k, v in SHIFT_POLICIES.items()}

# Prose a base model continues for hundreds of tokens without an end-of-text token.
PROMPTS = (
    "The history of the city begins in the early middle ages, when a small settlement of "
    "fishermen grew up on the banks of the river. Over the following centuries",
    "Chapter one. The rain had not stopped for three days when the old lighthouse keeper "
    "finally decided to walk down to the village. He took his coat and",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In this article we explain",
    "In the year 1850 the railway reached the valley, and with it came merchants, engineers "
    "and a great many workers from the neighbouring provinces. The first station",
)
# ~250 tokens for time to first token: the prefill is part of what is timed.
TTFT_PROMPT = " ".join(PROMPTS) * 2


def prepare_text(
    prep: prep_pb2_grpc.PrepServiceStub, text: str, metadata: Sequence[tuple[str, str]] = ()
) -> Any:
    r = prep.Prepare(
        prep_pb2.PrepareRequest(raw=prep_pb2.RawPrompt(text=text, add_special=True)),
        timeout=60,
        metadata=metadata,
    )
    return r.prompt


STREAM_TOKENS = [1]  # GenerateRequest.stream_tokens of every slotwise stream (--stream-tokens)


def prompt_tokens(prompt: Any) -> list[int]:
    return [t for c in prompt.chunks for t in c.text.token_ids]


def generate(
    infer: infer_pb2_grpc.InferServiceStub,
    prompt: Any,
    max_tokens: int,
    *,
    policy: int = 0,
    keep: int = 0,
    discard_fraction: float | None = None,
    t_sent: float | None = None,
    on_token: Callable[[], None] = lambda: None,
    until: Callable[[], bool] = lambda: False,
    speculative: Any = None,
    cache_salt: str = "",
    grammar: str = "",
    metadata: Sequence[tuple[str, str]] = (),
) -> Stream:
    ctx = infer_pb2.ContextOptions(policy=policy, keep=keep)
    if discard_fraction is not None:
        ctx.discard_fraction = discard_fraction
    req = infer_pb2.GenerateRequest(
        prompt=prompt,
        sampling=infer_pb2.SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        context=ctx,
        stream_tokens=STREAM_TOKENS[0],
        speculative=speculative,
        cache_salt=cache_salt,
    )
    if grammar:
        req.constraint.grammar = grammar
    s = Stream(t_sent=time.perf_counter() if t_sent is None else t_sent)
    call = infer.Generate(req, timeout=600, metadata=metadata)
    for r in call:
        t = time.perf_counter()
        kind = r.WhichOneof("event")
        if kind == "delta":
            s.add(t, len(r.delta.token_ids))
            s.token_ids.extend(r.delta.token_ids)
            on_token()
            if until():
                call.cancel()
                break
        elif kind == "started":
            s.slot, s.prompt_cells = r.started.slot, r.started.num_prompt_cells
        elif kind == "shift":
            s.shifts.append(POLICY_NAMES.get(r.shift.policy, str(r.shift.policy)))
        elif kind == "finished":
            s.finish = infer_pb2.FinishReason.Name(r.finished.reason)
            s.decode_seconds = r.finished.usage.decode_seconds
            s.prefill_seconds = r.finished.usage.prefill_seconds
            s.drafted = r.finished.usage.num_draft_tokens
            s.accepted = r.finished.usage.num_accepted_tokens
            s.cache_hits = sum(d.num_cache_hits for d in r.finished.usage.drafts_by_type)
            if r.finished.reason == infer_pb2.FINISH_REASON_ERROR:
                raise BenchError(f"generation failed: {r.finished.error}")
    return s


def user_message(text: str, jpeg: bytes | None = None) -> Any:
    parts = [prep_pb2.Part(text=text)]
    if jpeg is not None:
        parts.append(prep_pb2.Part(image=prep_pb2.Image(data=jpeg)))
    return prep_pb2.Message(role="user", parts=parts)


def chat_request(messages: Sequence[Any]) -> Any:
    return prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=list(messages)))


@dataclass
class ResentTurn:
    seconds: float  # Prepare of the whole chat to the reply's end
    prepare_seconds: float  # of which the Prepare call
    engine_seconds: float  # infer's prefill and decode time (its Usage)
    reply: str
    prompt_cells: int
    reused_cells: int
    shifts: int
    photo: bool = False


def resent_turn(
    prep: prep_pb2_grpc.PrepServiceStub,
    infer: infer_pb2_grpc.InferServiceStub,
    messages: Sequence[Any],
    max_tokens: int,
    session: str = "",
) -> ResentTurn:
    """One turn of a client that resends the conversation: Prepare of the whole chat, then a
    stateless greedy Generate to its end; timed from the Prepare call to the Finished event.
    With a session: what a session's client sends instead, the chunks from the previous reply
    on (prep neither decodes nor counts the images before it), as that session's turn."""
    t0 = time.perf_counter()
    request = chat_request(messages)
    if session:
        request.first_message = max(0, len(messages) - 2)  # (the previous reply)
    prompt = prep.Prepare(request, timeout=120).prompt
    t_prepared = time.perf_counter()
    req = infer_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, sampling=infer_pb2.SamplingParams(temperature=0.0),
        session_id=session,
    )  # fmt: skip
    text: list[str] = []
    for r in infer.Generate(req, timeout=600):
        kind = r.WhichOneof("event")
        if kind == "delta":
            text.append(r.delta.text)
        elif kind == "finished":
            f = r.finished
            if f.reason == infer_pb2.FINISH_REASON_ERROR:
                raise BenchError(f"resent chat: generation failed: {f.error}")
            u = f.usage
            return ResentTurn(
                time.perf_counter() - t0, t_prepared - t0, u.prefill_seconds + u.decode_seconds,
                "".join(text), u.num_prompt_cells, u.num_reused_cells, u.num_shifts,
            )  # fmt: skip
    raise BenchError("resent chat: the turn ended without a Finished event")


def concurrently(fns: Sequence[Callable[[], Stream]]) -> list[Stream]:
    """Run the calls at once from threads (one gRPC stream or HTTP request each)."""
    start = threading.Barrier(len(fns))

    def run(fn: Callable[[], Stream]) -> Stream:
        start.wait()
        return fn()

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(run, fns))


# -- the bench --------------------------------------------------------------------------------
