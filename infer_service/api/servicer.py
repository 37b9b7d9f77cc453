"""InferService: the gRPC edge. A request's options become checked domain values in
api/protobuf.py, what the model must judge (a constraint, the images) is checked here off the
event loop, and the job goes to the engine through its client (infer_service/engine/client.py);
answers and errors go back through api/protobuf.py. A ProblemError raised anywhere in a handler
is the call's status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from infer_service.api.mailbox import EventRelay, Mailbox
from infer_service.api.protobuf import (
    GenerateLimits,
    GenerateParams,
    abort_problem,
    answering,
    bad_request,
    broken_session_info,
    embed_pb,
    event_pb,
    lora_adapters_pb,
    lora_of,
    prompt_of,
    server_info_pb,
    session_info,
    session_key,
    set_lora_scales,
    slots_pb,
    title_of,
)
from infer_service.engine.client import EngineClient
from infer_service.engine.scheduler import Reservation
from infer_service.events import (
    EngineStoppedError,
    ErrorKind,
    Event,
    Finished,
    Problem,
    ProblemError,
    Reason,
    Rejected,
    storage_problem,
)
from infer_service.runner.embedder import Embedder, EmbedError
from infer_service.runner.job import Job, prompt_items
from infer_service.runner.media import (
    MediaLimits,
    StaleDescriptorError,
    VerifiedMedia,
    verify_prompt,
)
from infer_service.runner.runtime import Runtime, SamplingConfig
from infer_service.runner.sampling import (
    Constraint,
    ConstraintError,
    SamplerSpec,
    check_spec,
    json_schema_grammar,
)
from infer_service.runner.stats import TenantStats
from infer_service.sessions.session import MAX_RECORDS, SessionView
from infer_service.sessions.store import SessionIdError, check_session_id
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.descriptors import PreparedPrompt
from slotwise_core.limits import DEFAULT_WATCH_MS, MIN_WATCH_MS
from slotwise_core.native import NativeError
from slotwise_core.serving import current_tenant
from slotwise_core.sounds import DEFAULT_MAX_SECONDS

__all__ = ["GenerateLimits", "InferServicer"]

log = logging.getLogger("slotwise.infer")
T = TypeVar("T")
access = logging.getLogger("slotwise.access")

MAX_WATCHES, MAX_WATCHES_PER_TENANT = 16, 4  # each costs a look between engine steps


class InferServicer(infer_pb2_grpc.InferServiceServicer):
    def __init__(
        self,
        engine: EngineClient,
        runtime: Runtime,
        *,
        limits: GenerateLimits = GenerateLimits(),
        embedder: Embedder | None = None,
        draining: asyncio.Event | None = None,
        verified: VerifiedMedia | None = None,
    ):
        self.engine = engine
        self.runtime = (
            runtime  # (its model, for checking prompts off the event loop; not the engine)
        )
        self.limits = limits
        self.embedder = embedder
        self.verified = verified  # images checked before: a resent one is not decoded again
        mtmd = runtime.mtmd
        self.media_limits = MediaLimits(
            runtime.ubatch_size,
            bool(mtmd and mtmd.non_causal),
            max_samples=round(DEFAULT_MAX_SECONDS * (mtmd.sample_rate if mtmd else 0)),
        )
        self.draining = draining or asyncio.Event()
        self._watches: Counter[str] = Counter()  # WatchSlots calls open, by tenant
        self._relays: dict[asyncio.AbstractEventLoop, EventRelay] = {}

    @answering
    async def Embed(self, request, context):
        if self.embedder is None:
            raise ProblemError(
                Problem(
                    ErrorKind.UNIMPLEMENTED,
                    "embeddings are off: start infer_service with --embeddings",
                    Reason.EMBEDDINGS_DISABLED,
                )
            )
        try:
            future = self.embedder.embed(list(request.texts), normalize=request.normalize)
            return embed_pb(await asyncio.wrap_future(future))
        except EmbedError as e:
            raise bad_request(str(e), "texts") from None

    @answering
    async def GetServerInfo(self, request, context):
        # made on the engine thread between steps: counters that belong together
        snap = await self.engine.snapshot()
        tenant = current_tenant()
        mine = snap.stats.by_tenant.get(tenant, TenantStats())  # (others' are theirs)
        return server_info_pb(self.runtime, snap, mine, tenant)

    async def Generate(self, request, context):
        """One generation; its access-log line once it is over (tenant, session, status,
        cells, tokens: never the key, never the prompt)."""
        tenant = current_tenant()
        seen: list[Finished] = []
        stream = self._generate(request, context, tenant, seen)
        try:
            async for response in stream:
                yield response
        except ProblemError as e:
            await abort_problem(context, e.problem)
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
        session_id = session_key(tenant, request.session_id) if request.session_id else None
        prompt = prompt_of(request.prompt, self.runtime.num_vocab)
        if session_id is None and request.HasField("expect_turns"):
            raise bad_request("expect_turns goes with a session_id", "expect_turns")
        # a place in the queue first: a request refused costs no image decoding
        reservation = self.engine.reserve(tenant)
        try:
            job, mailbox = await self._admit(request, prompt, session_id, reservation, context)
        finally:
            reservation.release()  # (the job's now, unless it was refused)
        finished = False
        try:
            while not finished:
                event = await mailbox.get()
                if isinstance(event, Rejected):
                    finished = True
                    raise ProblemError(event.problem)
                finished = isinstance(event, Finished)
                if isinstance(event, Finished):
                    seen.append(event)
                yield event_pb(event)
                if isinstance(event, Finished) and event.problem is not None:
                    raise ProblemError(event.problem)  # non-OK after its Finished
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
    ) -> tuple[Job, Mailbox]:
        """Begin the session's turn, check the request and queue its job in the reserved
        place (a refusal: ProblemError, the turn ended again)."""
        session = None
        if session_id is not None:
            session = await self.engine.begin_turn(session_id)
        try:
            # (the turn is ours now: no other can change num_turns under it)
            expected = request.expect_turns if request.HasField("expect_turns") else None
            if session is not None and expected is not None and session.num_turns != expected:
                raise ProblemError(
                    Problem(
                        ErrorKind.FAILED_PRECONDITION,
                        f"the session has {session.num_turns} turns, not the {expected} this "
                        "turn expects",
                        Reason.SESSION_MOVED_ON,
                        (("num_turns", str(session.num_turns)),),
                    )
                )
            job, mailbox = await self._job(request, prompt, session, context)
            try:
                self.engine.submit(job, reservation)
            except BaseException:
                job.release()
                raise
        except BaseException:
            if session_id is not None:
                self.engine.end_turn_later(session_id)  # it must happen even if we go
            raise
        return job, mailbox

    async def _job(
        self, request, prompt: PreparedPrompt, session: SessionView | None, context
    ) -> tuple[Job, Mailbox]:
        """Check everything that can be checked before queueing."""
        rt = self.runtime
        params = GenerateParams.from_pb(request, self.limits, session)
        # a grammar (or schema) is parsed off the event loop: it may be large
        sampler = await asyncio.to_thread(
            _borrowing, rt, _sampler_fields, rt, request, params.sampling
        )
        tenant = current_tenant()
        lora = lora_of(rt.lora, tenant, request.lora)
        limits = self.media_limits
        try:
            media, decoded = await asyncio.to_thread(
                _borrowing, rt, verify_prompt, prompt, fingerprint=rt.fingerprint, mtmd=rt.mtmd,
                limits=limits, cache=self.verified, scope=f"{tenant}\0{params.cache_salt}",
            )  # fmt: skip
        except StaleDescriptorError as e:
            raise ProblemError(
                Problem(ErrorKind.FAILED_PRECONDITION, str(e), Reason.STALE_DESCRIPTOR)
            ) from None
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        items, pixels = prompt_items(prompt)
        # admission is the engine's: a resent conversation longer than the context may continue
        # what a slot holds (only its new part is decoded)
        if items[-1].media_id:
            for h in media.values():
                h.close()
            raise bad_request(
                "the prompt ends with media: add text after it (the model needs a text token "
                "to produce the first logits)", "prompt",
            )  # fmt: skip
        relay, mailbox = self._relay(), Mailbox()
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
            sampling=params.sampling,
            context=params.context,
            max_tokens=params.max_tokens,
            stop=params.stop,
            deadline=time.monotonic() + remaining if remaining is not None else None,
            session_id=session.key if session else None,
            stream_tokens=params.stream_tokens,
            note=params.note,
            tenant=tenant,
            cache_salt=params.cache_salt,
            lora=lora,
            speculative=params.speculative,
            reasoning=params.reasoning,
            **sampler,
        )
        return job, mailbox

    @answering
    async def LoraListAdapters(self, request, context):
        adapters = lora_adapters_pb(self.runtime.lora, current_tenant())
        return infer_pb2.LoraListAdaptersResponse(adapters=adapters)

    @answering
    async def LoraSetScales(self, request, context):
        """The caller's tenant's scales (another tenant's replies never change with them)."""
        adapters = set_lora_scales(self.runtime.lora, current_tenant(), request.scales)
        return infer_pb2.LoraSetScalesResponse(adapters=adapters)

    def _relay(self) -> EventRelay:
        loop = asyncio.get_running_loop()
        if self._relays.get(loop) is None:
            self._relays[loop] = EventRelay(loop)
        return self._relays[loop]

    # -- sessions ---------------------------------------------------------------------------

    async def _session_rpc(self, fn, session_id: str, *args, doing: str = ""):
        """fn(key, *args) of the facade, for the caller's session of that id; a failure of
        the sessions directory is its own status, never UNKNOWN."""
        try:
            return await fn(session_key(current_tenant(), session_id), *args)
        except OSError as e:
            raise ProblemError(storage_problem(e, doing or "the sessions directory")) from None

    @answering
    async def CreateSession(self, request, context):
        options = infer_pb2.GenerateRequest(context=request.context, sampling=request.sampling)
        params = GenerateParams.from_pb(options, self.limits)
        view = await self._session_rpc(
            self.engine.create, request.session_id or uuid.uuid4().hex, params.context,
            params.sampling, title_of(request.title), doing="the session was not saved",
        )  # fmt: skip
        return infer_pb2.CreateSessionResponse(session=session_info(view))

    @answering
    async def GetSession(self, request, context):
        n = min(request.num_records, MAX_RECORDS)
        view = await self._session_rpc(self.engine.get, request.session_id, n)
        return infer_pb2.GetSessionResponse(session=session_info(view))

    @answering
    async def ListSessions(self, request, context):
        """The caller's sessions only (another tenant's are not there for it)."""
        views, broken = await self.engine.sessions_of(current_tenant())
        return infer_pb2.ListSessionsResponse(
            sessions=[session_info(v) for v in views]
            + [broken_session_info(key, why) for key, why in sorted(broken.items())]
        )

    @answering
    async def DeleteSession(self, request, context):
        await self._session_rpc(self.engine.delete, request.session_id, doing="delete failed")
        return infer_pb2.DeleteSessionResponse()

    @answering
    async def SaveSession(self, request, context):
        view = await self._session_rpc(self.engine.save, request.session_id, doing="save failed")
        return infer_pb2.SaveSessionResponse(session=session_info(view))

    @answering
    async def RestoreSession(self, request, context):
        view = await self._session_rpc(
            self.engine.restore, request.session_id, doing="restore failed"
        )
        return infer_pb2.RestoreSessionResponse(session=session_info(view))

    @answering
    async def RenameSession(self, request, context):
        view = await self._session_rpc(
            self.engine.rename, request.session_id, title_of(request.title),
            doing="the title was not saved",
        )  # fmt: skip
        return infer_pb2.RenameSessionResponse(session=session_info(view))

    @answering
    async def WatchSlots(self, request, context):
        """Views made on the engine thread between steps, at most one per interval, sent only
        when they changed; the caller's own slots in full, the others' as a state only.
        Ends when the server drains (a page then reconnects, to this replica or another)."""
        interval = max(request.min_interval_ms or DEFAULT_WATCH_MS, MIN_WATCH_MS) / 1000
        tenant = current_tenant()
        watching = self._watches
        if sum(watching.values()) >= MAX_WATCHES or watching[tenant] >= MAX_WATCHES_PER_TENANT:
            raise ProblemError(
                Problem(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"at most {MAX_WATCHES} watches "
                    f"({MAX_WATCHES_PER_TENANT} per tenant) at once; close one or watch "
                    "less often",
                    Reason.TOO_MANY_WATCHES,
                    retry_after=5.0,
                )
            )
        watching[tenant] += 1
        try:
            last = None
            while not self.draining.is_set():
                try:
                    pictures, shared = await self.engine.slot_pictures()
                    view = slots_pb(self.runtime, pictures, tenant, shared)
                except ProblemError:
                    raise
                except Exception as e:  # a bug in the look: this watch ends, reported
                    log.exception("a look at the slots failed")
                    raise ProblemError(
                        Problem(ErrorKind.INTERNAL, f"internal error: {e!r}")
                    ) from None
                if view != last:
                    yield view
                    last = view
                if request.once:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.draining.wait(), interval)
            raise ProblemError(
                Problem(
                    ErrorKind.UNAVAILABLE,
                    "the server is draining; watch again",
                    Reason.SHUTTING_DOWN,
                )
            )
        finally:
            watching[tenant] -= 1


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
    """The request's constraint, logit biases and log-probabilities, checked against the
    model (INVALID_ARGUMENT naming the field)."""
    try:
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
    except ConstraintError as e:
        raise bad_request(str(e), e.field) from None
    r = request.reasoning
    ids = (*r.start_token_ids, *r.end_token_ids, *r.forced_token_ids)
    if any(not 0 <= t < rt.num_vocab for t in ids):
        raise bad_request(
            f"reasoning: token ids are within the vocabulary [0, {rt.num_vocab})", "reasoning"
        )
    if request.ignore_eos:  # (after the check: the vocabulary's own, not the caller's count)
        spec = replace(spec, logit_bias=spec.logit_bias + rt.eog_bans)
    return {
        "constraint": spec.constraint,
        "logit_bias": spec.logit_bias,
        "top_logprobs": spec.top_logprobs,
    }


def _loggable(session_id: str) -> str:
    """A session id for the access log: as given when it is a valid one, else quoted (a
    newline in it must not start a line of its own)."""
    if not session_id:
        return "-"
    try:
        return check_session_id(session_id)
    except SessionIdError:
        return repr(session_id[:80])
