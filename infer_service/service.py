"""InferService: the gRPC edge. Validates everything before a request reaches the engine, and
talks to the engine through its facade (infer_service/facade.py) only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import grpc

from infer_service.drafting import SpecConfig, SpecType
from infer_service.embedder import Embedder, EmbedError
from infer_service.events import (
    ContextShift,
    ErrorKind,
    Event,
    Finished,
    Problem,
    ProblemError,
    Reason,
    Rejected,
    TokenDelta,
    storage_problem,
)
from infer_service.facade import EngineFacade
from infer_service.kv_view import CellRun, SlotPicture, SlotState
from infer_service.ledger import ContextConfig
from infer_service.media import (
    MediaLimits,
    StaleDescriptorError,
    VerifiedMedia,
    verify_prompt,
)
from infer_service.runtime import Runtime, SamplingConfig
from infer_service.sampling import (
    Constraint,
    ConstraintError,
    SamplerSpec,
    check_spec,
    json_schema_grammar,
)
from infer_service.scheduler import Reservation
from infer_service.session_store import SessionIdError, check_session_id
from infer_service.sessions import MAX_RECORDS, SessionView, public_id, scoped
from infer_service.slots import EngineStoppedError, Job, TenantStats, prompt_items
from infer_service.wire import (
    CELL_KIND_TO_PB,
    CODES,
    POLICIES,
    POLICY_TO_PB,
    SLOT_STATE_TO_PB,
    SPEC_TYPES,
    UNIT_TO_PB,
    UNITS,
    event_pb,
    shift_pb,
    usage_pb,
)
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.descriptors import DescriptorError, PreparedPrompt, TextChunk
from slotwise_core.native import NativeError
from slotwise_core.serving import abort, current_tenant

log = logging.getLogger("slotwise.infer")
T = TypeVar("T")
access = logging.getLogger("slotwise.access")


class Mailbox:
    """One stream's events on the event loop, bounded however slowly its client reads: token
    deltas that pile up merge into one; past MAX_EVENTS, runs of deltas and shifts fold into
    one shift (their totals) and one delta, so a stalled reader costs one message's worth."""

    MAX_EVENTS = 256

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self._ready = asyncio.Event()

    def put(self, event: Event) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, TokenDelta) and isinstance(last, TokenDelta):
            self._events[-1] = last.merged(event)
        else:
            self._events.append(event)
            if len(self._events) > self.MAX_EVENTS:
                self._events = deque(_folded(self._events))
        self._ready.set()

    async def get(self) -> Event:
        while not self._events:
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()

    def __len__(self) -> int:
        return len(self._events)


def _folded(events: deque[Event]) -> list[Event]:
    out: list[Event] = []
    shift: ContextShift | None = None
    delta: TokenDelta | None = None
    for e in [*events, None]:
        if isinstance(e, TokenDelta):
            delta = delta.merged(e) if delta else e
            continue
        if isinstance(e, ContextShift):
            shift = shift.folded(e) if shift else e
            continue
        out.extend(x for x in (shift, delta) if x is not None)
        shift = delta = None
        if e is not None:
            out.append(e)
    return out


class EventRelay:
    """Events from the engine thread to the handlers' mailboxes on one event loop.

    What the engine emits while a hand-off is pending rides along with it: one loop wake-up
    (a self-pipe write) per batch of events instead of one per token and stream.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Mailbox, Event]] = []

    def send(self, mailbox: Mailbox, event: Event) -> None:
        with self._lock:
            self._items.append((mailbox, event))
            if len(self._items) > 1:
                return  # a delivery is already on its way
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            with self._lock:
                self._items.clear()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for mailbox, event in items:
            mailbox.put(event)


class RequestError(ValueError):
    """INVALID_ARGUMENT: the request can never work as sent (field: the one at fault)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


async def abort_problem(context: grpc.aio.ServicerContext, p: Problem) -> None:
    await abort(
        context,
        CODES[p.kind],
        p.message,
        reason=p.reason.value,
        metadata=p.metadata,
        retry_after=p.retry_after,
        field=p.field,
    )


@dataclass(frozen=True)
class GenerateLimits:
    default_max_tokens: int = 1024
    max_tokens: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_chars: int = 1000  # of each (every token's text is searched for each)
    speculative: SpecConfig = SpecConfig()  # what a request leaves unset (--spec-*)
    draft_model: bool = False  # whether a draft model is loaded (--model-draft)


class InferServicer(infer_pb2_grpc.InferServiceServicer):
    def __init__(
        self,
        engine: EngineFacade,
        runtime: Runtime,
        *,
        limits: GenerateLimits = GenerateLimits(),
        embedder: Embedder | None = None,
        draining: asyncio.Event | None = None,
        verified: VerifiedMedia | None = None,
    ):
        self.engine = engine
        self.rt = runtime  # (its model, for checking prompts off the event loop; not the engine)
        self.limits = limits
        self.embedder = embedder
        self.verified = verified  # images checked before: a resent one is not decoded again
        self.draining = draining or asyncio.Event()
        self._watches: Counter[str] = Counter()  # WatchSlots calls open, by tenant
        self._relays: dict[asyncio.AbstractEventLoop, EventRelay] = {}

    async def Embed(self, request, context):
        if self.embedder is None:
            await abort(context, grpc.StatusCode.UNIMPLEMENTED,
                        "embeddings are off: start infer_service with --embeddings",
                        reason="EMBEDDINGS_DISABLED")  # fmt: skip
            return
        try:
            embedded = await asyncio.wrap_future(
                self.embedder.embed(list(request.texts), normalize=request.normalize)
            )
        except EmbedError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), reason="BAD_REQUEST",
                        field="texts")  # fmt: skip
            return
        return infer_pb2.EmbedResponse(
            embeddings=[
                infer_pb2.Embedding(values=e.values.tolist(), num_tokens=e.num_tokens)
                for e in embedded
            ]
        )

    async def GetServerInfo(self, request, context):
        rt = self.rt
        try:  # made on the engine thread between steps: counters that belong together
            snap = await self.engine.snapshot()
        except ProblemError as e:
            await abort_problem(context, e.problem)
            return
        st = snap.stats
        mine = st.by_tenant.get(current_tenant(), TenantStats())  # (others' hits are theirs)
        return infer_pb2.GetServerInfoResponse(
            fingerprint=rt.fingerprint.to_pb(),
            num_slots=rt.num_slots,
            num_cells_per_slot=rt.num_cells_per_slot,
            n_ctx_train=rt.n_ctx_train,
            can_shift=rt.can_shift,
            uses_mrope=rt.uses_mrope,
            batch_size=rt.batch_size,
            ubatch_size=rt.ubatch_size,
            num_queued=snap.waiting,
            num_active=snap.active,
            stats=infer_pb2.EngineStats(
                num_decodes=st.num_decodes,
                num_multi_seq_decodes=st.num_multi_seq_decodes,
                num_media_decodes=st.num_media_decodes,
                num_generated_tokens=st.num_generated_tokens,
                num_shifts=st.num_shifts,
                num_media_cache_hits=mine.num_media_cache_hits,
                num_media_cache_misses=mine.num_media_cache_misses,
            ),
        )

    async def Generate(self, request, context):
        """One generation; its access-log line once it is over (tenant, session, status,
        cells, tokens: never the key, never the prompt)."""
        tenant = current_tenant()
        seen: list[Finished] = []
        stream = self._generate(request, context, tenant, seen)
        try:
            async for response in stream:
                yield response
        finally:
            await stream.aclose()
            code = context.code()
            status = code.name if code is not None else ("OK" if seen else "CANCELLED")
            usage = seen[0].usage if seen else None
            access.info(
                "tenant=%s session=%s status=%s cells=%d reused=%d tokens=%d",
                tenant, _loggable(request.session_id), status,
                usage.num_prompt_cells if usage else 0, usage.num_reused_cells if usage else 0,
                usage.num_generated_tokens if usage else 0,
            )  # fmt: skip

    async def _generate(self, request, context, tenant: str, seen: list[Finished]):
        session_id = request.session_id or None
        try:
            if session_id is not None:
                session_id = scoped(tenant, check_session_id(session_id))
            prompt = PreparedPrompt.from_pb(request.prompt)
        except SessionIdError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), reason="BAD_REQUEST",
                        field="session_id")  # fmt: skip
            return
        except DescriptorError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), reason="BAD_REQUEST",
                        field="prompt")  # fmt: skip
            return
        if session_id is None and request.HasField("expect_turns"):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        "expect_turns goes with a session_id", reason="BAD_REQUEST",
                        field="expect_turns")  # fmt: skip
            return
        try:  # a place in the queue first: a request refused costs no image decoding
            reservation = self.engine.reserve(tenant)
        except ProblemError as e:
            await abort_problem(context, e.problem)
            return
        try:
            admitted = await self._admit(request, prompt, session_id, reservation, context)
        finally:
            reservation.release()  # (the job's now, unless it was refused)
        if admitted is None:
            return
        job, mailbox = admitted
        finished = False
        try:
            while not finished:
                event = await mailbox.get()
                if isinstance(event, Rejected):
                    finished = True
                    await abort_problem(context, event.problem)
                    return
                finished = isinstance(event, Finished)
                if isinstance(event, Finished):
                    seen.append(event)
                yield event_pb(event)
                if isinstance(event, Finished) and event.problem is not None:
                    await abort_problem(context, event.problem)  # non-OK after its Finished
        finally:
            if not finished:
                job.cancel()  # client went away or the deadline passed: free the slot

    async def _admit(
        self,
        request,
        prompt: PreparedPrompt,
        session_id: str | None,
        reservation: Reservation,
        context,
    ) -> tuple[Job, Mailbox] | None:
        """Begin the session's turn, check the request and queue its job in the reserved
        place; None after an abort."""
        session = None
        if session_id is not None:
            try:
                session = await self.engine.begin_turn(session_id)
            except ProblemError as e:
                await abort_problem(context, e.problem)
                return None
            # (the turn is ours now: no other can change num_turns under it)
            if request.HasField("expect_turns") and session.num_turns != request.expect_turns:
                self.engine.end_turn_later(session_id)
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                            f"the session has {session.num_turns} turns, not the "
                            f"{request.expect_turns} this turn expects",
                            reason=Reason.SESSION_MOVED_ON.value,
                            metadata=(("num_turns", str(session.num_turns)),))  # fmt: skip
                return None
        made = None
        try:
            made = await self._job(request, prompt, session, context)
        finally:
            if made is None and session_id is not None:
                self.engine.end_turn_later(session_id)  # it must happen even if we go
        if made is None:
            return None
        job, mailbox = made
        try:
            self.engine.submit(job, reservation)
        except ProblemError as e:
            job.release()
            if session_id is not None:
                self.engine.end_turn_later(session_id)
            await abort_problem(context, e.problem)
            return None
        return job, mailbox

    async def _job(
        self, request, prompt: PreparedPrompt, session: SessionView | None, context
    ) -> tuple[Job, Mailbox] | None:
        """Validate everything that can be checked before queueing; None after an abort."""
        rt = self.rt
        try:
            args = self._parse(request, session)
            _check_token_ids(prompt, rt.num_vocab)
            if len(request.turn_note) > MAX_TURN_NOTE:
                raise RequestError(f"turn_note: at most {MAX_TURN_NOTE} bytes", "turn_note")
            if request.turn_note and session is None:
                raise RequestError("turn_note goes with a session turn", "turn_note")
            # a grammar (or schema) is parsed off the event loop: it may be large
            args |= await asyncio.to_thread(
                _borrowing, rt, _sampler_fields, rt, request, args["sampling"]
            )
        except RequestError as e:
            await _bad_request(context, e)
            return None
        except ConstraintError as e:
            await _bad_request(context, RequestError(str(e), e.field))
            return None
        except ProblemError as e:  # (shutting down)
            await abort_problem(context, e.problem)
            return None
        args["note"] = request.turn_note
        args["tenant"] = current_tenant()
        if len(request.cache_salt) > 256:
            await _bad_request(context, RequestError("cache_salt: at most 256 characters",
                                                     "cache_salt"))  # fmt: skip
            return None
        args["cache_salt"] = request.cache_salt
        limits = MediaLimits(rt.ubatch_size, bool(rt.mtmd and rt.mtmd.non_causal))
        try:
            media, decoded = await asyncio.to_thread(
                _borrowing, rt, verify_prompt, prompt, fingerprint=rt.fingerprint, mtmd=rt.mtmd,
                limits=limits, cache=self.verified,
                scope=f"{args['tenant']}\0{request.cache_salt}",
            )  # fmt: skip
        except StaleDescriptorError as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e),
                        reason=Reason.STALE_DESCRIPTOR.value)  # fmt: skip
            return None
        except ProblemError as e:  # (shutting down)
            await abort_problem(context, e.problem)
            return None
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e),
                        reason=Reason.BAD_REQUEST.value, field="prompt")  # fmt: skip
            return None
        items, pixels = prompt_items(prompt)
        refusal = None
        if items[-1].media_id:
            refusal = Problem(
                ErrorKind.INVALID_ARGUMENT,
                "the prompt ends with media: add text after it (the model needs a text token "
                "to produce the first logits)",
                Reason.BAD_REQUEST,
                field="prompt",
            )
        # admission is the engine's: a resent conversation longer than the context may continue
        # what a slot holds (only its new part is decoded)
        if refusal is not None:
            for h in media.values():
                h.close()
            await abort_problem(context, refusal)
            return None
        relay = self._relay()
        mailbox = Mailbox()
        remaining = context.time_remaining()

        def emit(event: Event) -> None:
            relay.send(mailbox, event)

        job = Job(
            items=items,
            media=media,
            pixels=pixels,
            # a session keeps the pixels it holds until they are on disk
            rgb=decoded if session is not None else {},
            emit=emit,
            deadline=time.monotonic() + remaining if remaining is not None else None,
            session_id=session.key if session else None,
            **args,
        )
        return job, mailbox

    def _relay(self) -> EventRelay:
        loop = asyncio.get_running_loop()
        if self._relays.get(loop) is None:
            self._relays[loop] = EventRelay(loop)
        return self._relays[loop]

    # -- sessions ---------------------------------------------------------------------------

    async def _session_rpc(self, context, fn, session_id: str, *args, doing: str = ""):
        """fn(key, *args) of the facade, for the caller's session of that id. Every failure
        ends the call with its own status, never UNKNOWN."""
        try:
            key = scoped(current_tenant(), check_session_id(session_id))
            return await fn(key, *args)
        except SessionIdError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), reason="BAD_REQUEST",
                        field="session_id")  # fmt: skip
        except ProblemError as e:
            await abort_problem(context, e.problem)
        except OSError as e:
            await abort_problem(context, storage_problem(e, doing or "the sessions directory"))

    async def CreateSession(self, request, context):
        session_id = request.session_id or uuid.uuid4().hex
        try:
            args = self._parse(
                infer_pb2.GenerateRequest(context=request.context, sampling=request.sampling), None
            )
            title = check_title(request.title)
        except RequestError as e:
            await _bad_request(context, e)
            return
        view = await self._session_rpc(
            context, self.engine.create, session_id, args["context"], args["sampling"], title,
            doing="the session was not saved",
        )  # fmt: skip
        return infer_pb2.CreateSessionResponse(session=session_info(view))

    async def GetSession(self, request, context):
        n = min(request.num_records, MAX_RECORDS)
        view = await self._session_rpc(context, self.engine.get, request.session_id, n)
        return infer_pb2.GetSessionResponse(session=session_info(view))

    async def ListSessions(self, request, context):
        """The caller's sessions only (another tenant's are not there for it)."""
        try:
            views, broken = await self.engine.sessions_of(current_tenant())
        except ProblemError as e:
            await abort_problem(context, e.problem)
            return
        return infer_pb2.ListSessionsResponse(
            sessions=[session_info(v) for v in views]
            + [
                infer_pb2.SessionInfo(session_id=public_id(key), error=why)
                for key, why in sorted(broken.items())
            ]
        )

    async def DeleteSession(self, request, context):
        await self._session_rpc(
            context, self.engine.delete, request.session_id, doing="delete failed"
        )
        return infer_pb2.DeleteSessionResponse()

    async def SaveSession(self, request, context):
        view = await self._session_rpc(
            context, self.engine.save, request.session_id, doing="save failed"
        )
        return infer_pb2.SaveSessionResponse(session=session_info(view))

    async def RestoreSession(self, request, context):
        view = await self._session_rpc(
            context, self.engine.restore, request.session_id, doing="restore failed"
        )
        return infer_pb2.RestoreSessionResponse(session=session_info(view))

    async def RenameSession(self, request, context):
        try:
            title = check_title(request.title)
        except RequestError as e:
            await _bad_request(context, e)
            return
        view = await self._session_rpc(
            context, self.engine.rename, request.session_id, title,
            doing="the title was not saved",
        )  # fmt: skip
        return infer_pb2.RenameSessionResponse(session=session_info(view))

    async def WatchSlots(self, request, context):
        """Views made on the engine thread between steps, at most one per interval, sent only
        when they changed; the caller's own slots in full, the others' as a state and a count.
        Ends when the server drains (a page then reconnects, to this replica or another)."""
        interval = max(request.min_interval_ms or DEFAULT_WATCH_MS, MIN_WATCH_MS) / 1000
        tenant, rt = current_tenant(), self.rt
        watching = self._watches
        if sum(watching.values()) >= MAX_WATCHES or watching[tenant] >= MAX_WATCHES_PER_TENANT:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"at most {MAX_WATCHES} watches ({MAX_WATCHES_PER_TENANT} per tenant) "
                        "at once; close one or watch less often", reason="TOO_MANY_WATCHES",
                        retry_after=5.0)  # fmt: skip
            return
        watching[tenant] += 1
        try:
            async for view in self._views(request, context, tenant, rt, interval):
                yield view
        finally:
            watching[tenant] -= 1

    async def _views(self, request, context, tenant: str, rt: Any, interval: float):
        last = None
        while not self.draining.is_set():
            try:
                pictures = await self.engine.pictures()
            except ProblemError as e:
                await abort_problem(context, e.problem)
                return
            except Exception as e:  # a bug in the look: this watch ends, reported, not UNKNOWN
                log.exception("a look at the slots failed")
                await abort(context, grpc.StatusCode.INTERNAL, f"internal error: {e!r}")
                return
            view = infer_pb2.WatchSlotsResponse(
                num_cells_per_slot=rt.num_cells_per_slot,
                uses_mrope=rt.uses_mrope,
                slots=[slot_view(p, tenant) for p in pictures],
            )
            if view != last:
                yield view
                last = view
            if request.once:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.draining.wait(), interval)
        await abort(context, grpc.StatusCode.UNAVAILABLE, "the server is draining; watch again",
                    reason="SHUTTING_DOWN")  # fmt: skip

    def _parse(
        self, request: infer_pb2.GenerateRequest, session: SessionView | None
    ) -> dict[str, Any]:
        """Request options, with a session's defaults for what the request leaves unset."""
        ctx = _context(request.context, session.context if session else ContextConfig())
        max_tokens = request.max_tokens or self.limits.default_max_tokens
        if max_tokens > self.limits.max_tokens:
            raise RequestError(
                f"max_tokens {max_tokens} is over the limit {self.limits.max_tokens}", "max_tokens"
            )
        if len(request.stop) > self.limits.max_stop_strings:
            raise RequestError(f"at most {self.limits.max_stop_strings} stop strings", "stop")
        if any(len(s) > self.limits.max_stop_chars for s in request.stop):
            raise RequestError(
                f"a stop string has at most {self.limits.max_stop_chars} characters", "stop"
            )
        if request.stream_tokens > 256:
            raise RequestError(
                f"stream_tokens must be at most 256, got {request.stream_tokens}", "stream_tokens"
            )
        return {
            "context": ctx,
            "sampling": _sampling(
                request.sampling, session.sampling if session else SamplingConfig()
            ),
            "max_tokens": max_tokens,
            "stop": tuple(request.stop),
            "stream_tokens": max(1, request.stream_tokens),
            "speculative": speculative(
                request.speculative, self.limits.speculative, self.limits.draft_model
            ),
        }


MAX_TURN_NOTE = 64 << 10


def _borrowing(rt: Runtime, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn on a worker thread, with the runtime borrowed: it is not freed under fn (a handler
    cancelled at shutdown leaves its thread running)."""
    try:
        with rt.borrowed():
            return fn(*args, **kwargs)
    except NativeError as e:
        if rt.closing:
            raise EngineStoppedError(
                Problem(ErrorKind.UNAVAILABLE, str(e), Reason.SHUTTING_DOWN)
            ) from None
        raise


def _sampler_fields(
    rt: Runtime, request: infer_pb2.GenerateRequest, sampling: SamplingConfig
) -> dict[str, Any]:
    """The request's constraint, logit biases and log-probabilities, checked (ConstraintError
    names the field)."""
    constraint = None
    c = request.constraint
    kind = c.WhichOneof("kind")
    if kind is not None or c.trigger_patterns:
        if kind == "json_schema":
            grammar = json_schema_grammar(c.json_schema)
        elif kind == "grammar" and c.grammar.strip():
            grammar = c.grammar
        else:
            raise ConstraintError("constraint: give a grammar or a json_schema", "constraint")
        constraint = Constraint(grammar, tuple(c.trigger_patterns))
    if request.top_logprobs and not request.logprobs:
        raise ConstraintError("top_logprobs needs logprobs", "top_logprobs")
    spec = SamplerSpec(
        sampling,
        constraint,
        logit_bias=tuple(sorted(request.logit_bias.items())),
        top_logprobs=request.top_logprobs if request.logprobs else None,
    )
    check_spec(rt, spec)
    return {
        "constraint": spec.constraint,
        "logit_bias": spec.logit_bias,
        "top_logprobs": spec.top_logprobs,
    }


MAX_DRAFTS = 64  # per step: a slot's drafts take that much of the step's batch at most
MAX_NGRAM = 64


def speculative(
    pb: infer_pb2.SpeculativeOptions, d: SpecConfig, draft_model: bool = False
) -> SpecConfig:
    """The request's speculative options over the server's (RequestError names a bad one)."""
    if pb.type and pb.type not in SPEC_TYPES:
        raise RequestError(f"speculative.type {pb.type} is not a known type", "speculative.type")

    def get(name: str, default: float) -> float:
        return getattr(pb, name) if pb.HasField(name) else default

    s = SpecConfig(
        type=SPEC_TYPES[pb.type] if pb.type else d.type,
        n_max=int(get("n_max", d.n_max)),
        n_min=int(get("n_min", d.n_min)),
        p_min=get("p_min", d.p_min),
        size_n=int(get("ngram_size_n", d.size_n)),
        size_m=int(get("ngram_size_m", d.size_m)),
        min_hits=int(get("ngram_min_hits", d.min_hits)),
    )
    checks = [
        ("n_max", s.n_max, 0, MAX_DRAFTS),
        ("n_min", s.n_min, 0, s.n_max),
        ("p_min", s.p_min, 0.0, 1.0),
        ("ngram_size_n", s.size_n, 1, MAX_NGRAM),
        ("ngram_size_m", s.size_m, 1, 1024),
        ("ngram_min_hits", s.min_hits, 1, 1 << 16),
    ]
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:  # NaN fails too
            raise RequestError(
                f"speculative.{name} must be within [{lo}, {hi}], got {value}",
                f"speculative.{name}",
            )
    if s.type is SpecType.DRAFT_SIMPLE and not draft_model:
        raise RequestError(
            "speculative.type draft-simple needs a draft model: start infer_service with "
            "--model-draft", "speculative.type",
        )  # fmt: skip
    return s


def _context(c: infer_pb2.ContextOptions, base: ContextConfig) -> ContextConfig:
    """The fields the request sets, over base (a session's options, or the defaults)."""
    if c.HasField("policy") and c.policy not in POLICIES:
        raise RequestError(f"unknown shift policy {c.policy}", "context.policy")
    if c.HasField("unit") and c.unit not in UNITS:
        raise RequestError(f"unknown eviction unit {c.unit}", "context.unit")
    fraction = c.discard_fraction if c.HasField("discard_fraction") else base.discard_fraction
    if not 0.0 <= fraction <= 1.0:  # NaN fails too
        raise RequestError(
            f"discard_fraction must be within [0, 1], got {fraction}", "context.discard_fraction"
        )
    return ContextConfig(
        policy=POLICIES[c.policy] if c.HasField("policy") else base.policy,
        keep=c.keep if c.HasField("keep") else base.keep,
        discard_fraction=fraction,
        unit=UNITS[c.unit] if c.HasField("unit") else base.unit,
        truncate_prompt=c.truncate_prompt
        if c.HasField("truncate_prompt")
        else base.truncate_prompt,
    )


async def _bad_request(context: grpc.aio.ServicerContext, e: RequestError) -> None:
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), reason="BAD_REQUEST",
                field=e.field)  # fmt: skip


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
                f"chunk {i}: token id {bad} is outside this model's vocabulary [0, {num_vocab})",
                f"prompt.chunks[{i}].text.token_ids",
            )


def session_info(s: SessionView) -> infer_pb2.SessionInfo:
    c = s.context
    return infer_pb2.SessionInfo(
        records=[
            infer_pb2.TurnRecord(
                turn=r.turn,
                text=r.text,
                reason=r.reason,  # type: ignore[arg-type]
                usage=usage_pb(r.usage),
                note=r.note,
                created=r.created,
            )
            for r in s.records
        ],
        session_id=public_id(s.key),
        title=s.title,
        num_turns=s.num_turns,
        num_cells=s.num_cells,
        next_position=s.next_position,
        resident=s.resident,
        context=infer_pb2.ContextOptions(
            policy=POLICY_TO_PB[c.policy],
            keep=c.keep,
            discard_fraction=c.discard_fraction,
            unit=UNIT_TO_PB[c.unit],
            truncate_prompt=c.truncate_prompt,
        ),
        sampling=infer_pb2.SamplingParams(**asdict(s.sampling)),
        num_shifts=s.num_shifts,
        num_media=s.num_media,
    )


MAX_TITLE_CHARS = 200
DEFAULT_WATCH_MS, MIN_WATCH_MS = 250, 100
MAX_WATCHES, MAX_WATCHES_PER_TENANT = 16, 4  # each costs a look between engine steps


def check_title(title: str) -> str:
    if len(title) > MAX_TITLE_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in title):
        raise RequestError(
            f"a title has at most {MAX_TITLE_CHARS} characters and no control characters",
            "title",
        )
    return title


def _run_pb(r: CellRun) -> infer_pb2.CellRun:
    return infer_pb2.CellRun(
        kind=CELL_KIND_TO_PB[r.kind],
        pinned=r.pinned,
        message_index=r.message_index,
        media_id=r.media_id,
        num_cells=r.num_cells,
        num_positions=r.num_positions,
        pos_start=r.pos_start,
        preview=r.preview,
    )


def slot_view(p: SlotPicture, tenant: str) -> infer_pb2.SlotView:
    """A slot as `tenant` may see it: whole when the sequence is its own; another tenant's as
    its state only (not even its size: a cell count a few times a second would tell how long
    others' prompts and replies are). Whose the slot is decides, never what it holds now: a
    sequence between a REPREFILL and its decode, or waiting for its image, holds no cells
    yet still has its session and its shifts."""
    state = SLOT_STATE_TO_PB[p.state]
    nobodys = not p.tenant and p.state is SlotState.FREE and not (p.runs or p.shifts)
    if p.tenant != tenant and not nobodys:
        return infer_pb2.SlotView(slot=p.slot, state=state)
    return infer_pb2.SlotView(
        slot=p.slot,
        visible=True,
        session_id=public_id(p.session_id) if p.session_id else "",
        state=state,
        num_cells=p.num_cells,
        next_position=p.next_position,
        runs=map(_run_pb, p.runs),
        shifts=[
            infer_pb2.ShiftMark(
                id=m.id,
                shift=shift_pb(m.shift),
                at_cell=m.at_cell,
                evicted=map(_run_pb, m.evicted),
                time=m.time,
            )
            for m in p.shifts
        ],
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
            raise RequestError(
                f"sampling.{name} must be within [{lo}, {hi}], got {value}", f"sampling.{name}"
            )
    return s


def _loggable(session_id: str) -> str:
    """A session id for the access log: as given when it is a valid one, else quoted (a
    newline in it must not start a line of its own)."""
    if not session_id:
        return "-"
    try:
        return check_session_id(session_id)
    except SessionIdError:
        return repr(session_id[:80])
