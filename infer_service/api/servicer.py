"""InferService: the gRPC edge. A GenerateRequest is checked and queued as a job in one call
(api/request.py, through the engine's client, infer_service/engine/client.py); its events come
back through its mailbox, and answers and errors go out through api/protobuf.py. A ProblemError
raised anywhere in a handler is the call's status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from typing import TypeVar

from infer_service.api.protobuf import (
    abort_problem,
    answering,
    broken_session_info,
    embed_pb,
    event_pb,
    lora_adapters_pb,
    server_info_pb,
    session_info,
    set_lora_scales,
    slots_pb,
    title_of,
)
from infer_service.api.request import (
    Admission,
    GenerateLimits,
    GenerateParams,
    bad_request,
    session_key,
)
from infer_service.engine.client import EngineClient
from infer_service.events import (
    ErrorKind,
    Finished,
    Problem,
    ProblemError,
    Reason,
    Rejected,
    storage_problem,
)
from infer_service.runner.embedder import Embedder, EmbedError
from infer_service.runner.media import (
    VerifiedMedia,
)
from infer_service.runner.runtime import Runtime
from infer_service.runner.stats import TenantStats
from infer_service.sessions.session import MAX_RECORDS
from infer_service.sessions.store import SessionIdError, check_session_id
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.limits import DEFAULT_WATCH_MS, MIN_WATCH_MS
from slotwise_core.serving import current_tenant

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
        self.runtime = runtime  # (its model's facts; the engine's is the engine's)
        self.limits = limits
        self.embedder = embedder
        self.admission = Admission(engine, runtime, limits, verified)
        self.draining = draining or asyncio.Event()
        self._watches: Counter[str] = Counter()  # WatchSlots calls open, by tenant

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
        job, mailbox = await self.admission.admit(request, tenant, context.time_remaining())
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

    @answering
    async def LoraListAdapters(self, request, context):
        adapters = lora_adapters_pb(self.runtime.lora, current_tenant())
        return infer_pb2.LoraListAdaptersResponse(adapters=adapters)

    @answering
    async def LoraSetScales(self, request, context):
        """The caller's tenant's scales (another tenant's replies never change with them)."""
        adapters = set_lora_scales(self.runtime.lora, current_tenant(), request.scales)
        return infer_pb2.LoraSetScalesResponse(adapters=adapters)

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


def _loggable(session_id: str) -> str:
    """A session id for the access log: as given when it is a valid one, else quoted (a
    newline in it must not start a line of its own)."""
    if not session_id:
        return "-"
    try:
        return check_session_id(session_id)
    except SessionIdError:
        return repr(session_id[:80])
