"""InferService: the gRPC edge. Validates everything before a request reaches the engine."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from infer_service.engine import Engine, Job, QueueFullError, SessionError, prompt_items
from infer_service.events import POLICY_TO_PB, ErrorKind, Event, Finished, Rejected, TokenDelta
from infer_service.ledger import CannotFit, ContextConfig, EvictionUnit, Policy
from infer_service.media import MediaLimits, StaleDescriptorError, verify_prompt
from infer_service.runtime import SamplingConfig
from infer_service.session_store import SessionIdError, check_session_id
from infer_service.sessions import Session
from prep_service.descriptors import DescriptorError, PreparedPrompt, TextChunk
from prep_service.serving import abort
from slotwise.v1 import infer_pb2, infer_pb2_grpc

POLICIES = {
    infer_pb2.SHIFT_POLICY_UNSPECIFIED: Policy.AUTO,
    infer_pb2.SHIFT_POLICY_AUTO: Policy.AUTO,
    infer_pb2.SHIFT_POLICY_SHIFT: Policy.SHIFT,
    infer_pb2.SHIFT_POLICY_GAP: Policy.GAP,
    infer_pb2.SHIFT_POLICY_REPREFILL: Policy.REPREFILL,
    infer_pb2.SHIFT_POLICY_STOP: Policy.STOP,
}
UNITS = {
    infer_pb2.EVICTION_UNIT_UNSPECIFIED: EvictionUnit.TOKEN,
    infer_pb2.EVICTION_UNIT_TOKEN: EvictionUnit.TOKEN,
    infer_pb2.EVICTION_UNIT_MESSAGE: EvictionUnit.MESSAGE,
}
UNIT_TO_PB = {
    EvictionUnit.TOKEN: infer_pb2.EVICTION_UNIT_TOKEN,
    EvictionUnit.MESSAGE: infer_pb2.EVICTION_UNIT_MESSAGE,
}
CODES = {kind: getattr(grpc.StatusCode, kind.value) for kind in ErrorKind}


class EventRelay:
    """Events from the engine thread to the handlers' queues on one event loop.

    What the engine emits while a hand-off is pending rides along with it: one loop wake-up
    (a self-pipe write) per batch of events instead of one per token and stream.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Event], Event]] = []

    def send(self, queue: asyncio.Queue[Event], event: Event) -> None:
        with self._lock:
            self._items.append((queue, event))
            if len(self._items) > 1:
                return  # a delivery is already on its way
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, event in items:
            queue.put_nowait(event)


class RequestError(ValueError):
    """INVALID_ARGUMENT: the request can never work as sent."""


@dataclass(frozen=True)
class GenerateLimits:
    default_max_tokens: int = 1024
    max_tokens: int = 1 << 20
    max_stop_strings: int = 16


class InferServicer(infer_pb2_grpc.InferServiceServicer):
    def __init__(self, engine: Engine, *, limits: GenerateLimits = GenerateLimits()):
        self.engine = engine
        self.limits = limits
        self._relays: dict[asyncio.AbstractEventLoop, EventRelay] = {}

    async def GetServerInfo(self, request, context):
        rt, st = self.engine.rt, self.engine.stats
        return infer_pb2.GetServerInfoResponse(
            fingerprint=rt.fingerprint.to_pb(),
            num_slots=rt.num_slots,
            num_cells_per_slot=rt.num_cells_per_slot,
            n_ctx_train=rt.n_ctx_train,
            can_shift=rt.can_shift,
            uses_mrope=rt.uses_mrope,
            batch_size=rt.batch_size,
            ubatch_size=rt.ubatch_size,
            num_queued=self.engine.num_waiting,
            num_active=self.engine.num_active,
            stats=infer_pb2.EngineStats(
                num_decodes=st.num_decodes,
                num_multi_seq_decodes=st.num_multi_seq_decodes,
                num_media_decodes=st.num_media_decodes,
                num_generated_tokens=st.num_generated_tokens,
                num_shifts=st.num_shifts,
                num_media_cache_hits=self.engine.cache.hits,
                num_media_cache_misses=self.engine.cache.misses,
            ),
        )

    async def Generate(self, request, context):
        session_id = request.session_id or None
        try:
            if session_id is not None:
                check_session_id(session_id)
            prompt = PreparedPrompt.from_pb(request.prompt)
        except (SessionIdError, DescriptorError) as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        try:
            session = (
                await self._engine_call(self.engine.begin_turn, session_id) if session_id else None
            )
        except SessionError as e:
            await abort(context, CODES[e.kind], str(e))
            return
        made = None
        try:
            made = await self._job(request, prompt, session, context)
        finally:
            if made is None and session_id is not None:
                await self._engine_call(self.engine.abort_turn, session_id)
        if made is None:
            return
        job, queue = made
        try:
            self.engine.submit(job)
        except QueueFullError as e:
            job.release()
            if session_id is not None:
                await self._engine_call(self.engine.abort_turn, session_id)
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        finished = False
        try:
            while not finished:
                event = await queue.get()
                if isinstance(event, Rejected):
                    finished = True
                    await abort(context, CODES[event.kind], event.message)
                    return
                # a slow reader gets the deltas that piled up as one message
                while isinstance(event, TokenDelta) and not queue.empty():
                    nxt = queue.get_nowait()
                    if not isinstance(nxt, TokenDelta):
                        yield event.to_pb()
                        event = nxt
                        break
                    event = event.merged(nxt)
                finished = isinstance(event, Finished)
                yield event.to_pb()
        finally:
            if not finished:
                job.cancel()  # client went away or the deadline passed: free the slot

    async def _job(
        self, request, prompt: PreparedPrompt, session: Session | None, context
    ) -> tuple[Job, asyncio.Queue[Event]] | None:
        """Validate everything that can be checked before queueing; None after an abort."""
        try:
            args = self._parse(request, session)
            _check_token_ids(prompt, self.engine.rt.num_vocab)
        except RequestError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return None
        rt = self.engine.rt
        limits = MediaLimits(rt.ubatch_size, bool(rt.mtmd and rt.mtmd.non_causal))
        try:
            media = await asyncio.to_thread(
                verify_prompt, prompt, fingerprint=rt.fingerprint, mtmd=rt.mtmd, limits=limits
            )
        except StaleDescriptorError as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
            return None
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return None
        items, pixels = prompt_items(prompt)
        message = None
        if items[-1].media_id:
            message = (
                grpc.StatusCode.INVALID_ARGUMENT,
                "the prompt ends with media: add text after it (the model needs a text token "
                "to produce the first logits)",
            )
        elif session is None:  # sessions are admitted by the engine, which knows what they hold
            admission = self.engine.new_ledger(args["context"]).admit(
                items, truncate=args["context"].truncate_prompt
            )
            if isinstance(admission, CannotFit):
                message = (grpc.StatusCode.RESOURCE_EXHAUSTED, admission.message)
        if message is not None:
            for h in media.values():
                h.close()
            await abort(context, *message)
            return None
        if session is not None and self.engine.store is not None:
            store = self.engine.store
            for chunk in prompt.media:
                await asyncio.to_thread(store.save_media, chunk.media_id, chunk.rgb)
        relay = self._relay()
        events: asyncio.Queue[Event] = asyncio.Queue()
        remaining = context.time_remaining()

        def emit(event: Event) -> None:
            relay.send(events, event)

        job = Job(
            items=items,
            media=media,
            pixels=pixels,
            emit=emit,
            deadline=time.monotonic() + remaining if remaining is not None else None,
            session_id=session.session_id if session else None,
            **args,
        )
        return job, events

    def _relay(self) -> EventRelay:
        loop = asyncio.get_running_loop()
        if self._relays.get(loop) is None:
            self._relays[loop] = EventRelay(loop)
        return self._relays[loop]

    async def _engine_call(self, fn, *args):
        return await asyncio.wrap_future(self.engine.call(lambda: fn(*args)))

    # -- sessions ---------------------------------------------------------------------------

    async def _session_rpc(self, context, fn, session_id: str, *args):
        try:
            check_session_id(session_id)
            return await self._engine_call(fn, session_id, *args)
        except SessionIdError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SessionError as e:
            await abort(context, CODES[e.kind], str(e))

    async def CreateSession(self, request, context):
        session_id = request.session_id or uuid.uuid4().hex
        try:
            args = self._parse(
                infer_pb2.GenerateRequest(context=request.context, sampling=request.sampling), None
            )
        except RequestError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        session = await self._session_rpc(
            context, self.engine.create_session, session_id, args["context"], args["sampling"]
        )
        return infer_pb2.CreateSessionResponse(session=session_info(session))

    async def GetSession(self, request, context):
        session = await self._session_rpc(context, self.engine.get_session, request.session_id)
        return infer_pb2.GetSessionResponse(session=session_info(session))

    async def ListSessions(self, request, context):
        sessions, broken = await self._engine_call(
            lambda: (list(self.engine.sessions.values()), dict(self.engine.broken_sessions))
        )
        return infer_pb2.ListSessionsResponse(
            sessions=[session_info(s) for s in sessions]
            + [infer_pb2.SessionInfo(session_id=i, error=str(e)) for i, e in sorted(broken.items())]
        )

    async def DeleteSession(self, request, context):
        await self._session_rpc(context, self.engine.delete_session, request.session_id)
        return infer_pb2.DeleteSessionResponse()

    async def SaveSession(self, request, context):
        session = await self._session_rpc(context, self.engine.save_session, request.session_id)
        return infer_pb2.SaveSessionResponse(session=session_info(session))

    async def RestoreSession(self, request, context):
        session = await self._session_rpc(context, self.engine.restore_session, request.session_id)
        return infer_pb2.RestoreSessionResponse(session=session_info(session))

    def _parse(self, request: infer_pb2.GenerateRequest, session: Session | None) -> dict[str, Any]:
        """Request options, with a session's defaults for what the request leaves unset."""
        c = request.context
        if c.policy not in POLICIES:
            raise RequestError(f"unknown shift policy {c.policy}")
        if c.unit not in UNITS:
            raise RequestError(f"unknown eviction unit {c.unit}")
        fraction = c.discard_fraction if c.HasField("discard_fraction") else 0.5
        if not 0.0 <= fraction <= 1.0:  # NaN fails too
            raise RequestError(f"discard_fraction must be within [0, 1], got {fraction}")
        max_tokens = request.max_tokens or self.limits.default_max_tokens
        if max_tokens > self.limits.max_tokens:
            raise RequestError(
                f"max_tokens {max_tokens} is over the limit {self.limits.max_tokens}"
            )
        if len(request.stop) > self.limits.max_stop_strings:
            raise RequestError(f"at most {self.limits.max_stop_strings} stop strings")
        if request.stream_tokens > 256:
            raise RequestError(f"stream_tokens must be at most 256, got {request.stream_tokens}")
        ctx = ContextConfig(POLICIES[c.policy], c.keep, fraction, UNITS[c.unit], c.truncate_prompt)
        if session is not None and not request.HasField("context"):
            ctx = session.context
        return {
            "context": ctx,
            "sampling": _sampling(
                request.sampling, session.sampling if session else SamplingConfig()
            ),
            "max_tokens": max_tokens,
            "stop": tuple(request.stop),
            "stream_tokens": max(1, request.stream_tokens),
        }


def _check_token_ids(prompt: PreparedPrompt, num_vocab: int) -> None:
    """Token ids outside the vocabulary make llama_decode fail for the whole batch: refuse them.

    (llama.cpp rejects such a batch with rc -1, which would end every sequence decoded with it,
    other clients' included.)
    """
    for i, chunk in enumerate(prompt.chunks):
        if isinstance(chunk, TextChunk) and (
            min(chunk.token_ids) < 0 or max(chunk.token_ids) >= num_vocab
        ):
            bad = next(t for t in chunk.token_ids if not 0 <= t < num_vocab)
            raise RequestError(
                f"chunk {i}: token id {bad} is outside this model's vocabulary [0, {num_vocab})"
            )


def session_info(s: Session) -> infer_pb2.SessionInfo:
    c = s.context
    return infer_pb2.SessionInfo(
        session_id=s.session_id,
        num_turns=s.num_turns,
        num_cells=s.ledger.num_cells,
        next_position=s.ledger.next_pos,
        resident=s.slot is not None,
        context=infer_pb2.ContextOptions(
            policy=POLICY_TO_PB[c.policy],
            keep=c.keep,
            discard_fraction=c.discard_fraction,
            unit=UNIT_TO_PB[c.unit],
            truncate_prompt=c.truncate_prompt,
        ),
        sampling=infer_pb2.SamplingParams(**asdict(s.sampling)),
        num_shifts=s.num_shifts,
        num_media=sum(1 for seg in s.ledger.segments if seg.is_media),
    )


def _sampling(pb: infer_pb2.SamplingParams, d: SamplingConfig) -> SamplingConfig:
    def get(name: str, default: float) -> float:
        return getattr(pb, name) if pb.HasField(name) else default

    s = SamplingConfig(
        temperature=get("temperature", d.temperature),
        top_k=int(get("top_k", d.top_k)),
        top_p=get("top_p", d.top_p),
        min_p=get("min_p", d.min_p),
        repeat_penalty=get("repeat_penalty", d.repeat_penalty),
        penalty_last_n=int(get("penalty_last_n", d.penalty_last_n)),
        presence_penalty=get("presence_penalty", d.presence_penalty),
        frequency_penalty=get("frequency_penalty", d.frequency_penalty),
        seed=int(get("seed", d.seed)),
    )
    checks = [
        ("temperature", s.temperature, 0.0, 100.0),
        ("top_k", s.top_k, 0, 1 << 20),
        ("top_p", s.top_p, 0.0, 1.0),
        ("min_p", s.min_p, 0.0, 1.0),
        ("repeat_penalty", s.repeat_penalty, 1e-3, 100.0),
        ("penalty_last_n", s.penalty_last_n, -1, 1 << 20),
        ("presence_penalty", s.presence_penalty, -100.0, 100.0),
        ("frequency_penalty", s.frequency_penalty, -100.0, 100.0),
    ]
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:  # NaN fails too
            raise RequestError(f"sampling.{name} must be within [{lo}, {hi}], got {value}")
    return s
