"""The infer side's one mapping between its domain and the contract's messages (the engine
imports no generated stub; the servicer converts here and nowhere else): requests into checked
domain values (`GenerateParams.from_pb`, raising one ProblemError that names the field), domain
values into answers, and a ProblemError raised anywhere in a handler into the call's status
(`answering`), once.

An enum maps by name (slotwise_core.enum_names): a domain member maps to the proto value of the
same name after the enum's prefix (Policy.GAP <-> SHIFT_POLICY_GAP); a member without its twin
fails at import.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict
from functools import singledispatch
from typing import Any

import grpc

from infer_service.api.request import bad_request
from infer_service.events import (
    ContextShift,
    ErrorKind,
    Finished,
    FinishReason,
    Persistence,
    PrefillProgress,
    Problem,
    ProblemError,
    Started,
    TokenChoice,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from infer_service.kv.ledger import EvictionUnit, Policy
from infer_service.kv.pool import PoolFigures
from infer_service.kv.view import CellKind, CellRun, SharedPicture, SlotPicture, SlotState
from infer_service.runner.lora import LoraAdapters, LoraError
from infer_service.runner.stats import TenantStats
from infer_service.sessions.session import SessionView, public_id
from infer_service.spec.config import SpecType
from slotwise.v1 import infer_pb2
from slotwise_core.descriptors import memory_kind_pb
from slotwise_core.enum_names import from_numbers, to_numbers
from slotwise_core.limits import (
    MAX_TITLE_CHARS,
)
from slotwise_core.serving import abort

POLICY_TO_PB = to_numbers(Policy, infer_pb2.ShiftPolicy, "SHIFT_POLICY_")
UNIT_TO_PB = to_numbers(EvictionUnit, infer_pb2.EvictionUnit, "EVICTION_UNIT_")
FINISH_REASON_TO_PB = to_numbers(FinishReason, infer_pb2.FinishReason, "FINISH_REASON_")
PERSISTENCE_TO_PB = to_numbers(Persistence, infer_pb2.Persistence, "PERSISTENCE_")
CELL_KIND_TO_PB = to_numbers(CellKind, infer_pb2.CellKind, "CELL_KIND_")
SLOT_STATE_TO_PB = to_numbers(SlotState, infer_pb2.SlotState, "SLOT_STATE_")
SPEC_TYPES: Mapping[int, SpecType] = from_numbers(SpecType, infer_pb2.SpecType, "SPEC_TYPE_")
SPEC_TYPE_NUMBERS: Mapping[str, int] = {t.value: n for n, t in SPEC_TYPES.items()}
# requests: an unset policy or unit means the default
POLICIES: Mapping[int, Policy] = from_numbers(
    Policy, infer_pb2.ShiftPolicy, "SHIFT_POLICY_", unset=Policy.AUTO
)
UNITS: Mapping[int, EvictionUnit] = from_numbers(
    EvictionUnit, infer_pb2.EvictionUnit, "EVICTION_UNIT_", unset=EvictionUnit.TOKEN
)
CODES = {kind: getattr(grpc.StatusCode, kind.value) for kind in ErrorKind}


@singledispatch
def event_pb(event: Any) -> infer_pb2.GenerateResponse:
    raise TypeError(f"no message for {type(event).__name__}")


@event_pb.register
def _(e: Started) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        started=infer_pb2.Started(
            slot=e.slot,
            num_prompt_cells=e.num_prompt_cells,
            num_prompt_positions=e.num_prompt_positions,
            num_capacity_cells=e.num_capacity_cells,
            num_truncated_cells=e.num_truncated_cells,
            num_truncated_chunks=e.num_truncated_chunks,
            truncated_media_ids=e.truncated_media_ids,
            num_reused_cells=e.num_reused_cells,
        )
    )


@event_pb.register
def _(e: PrefillProgress) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        prefill=infer_pb2.PrefillProgress(
            num_cells_done=e.num_cells_done, num_cells_total=e.num_cells_total
        )
    )


@event_pb.register
def _(e: TokenDelta) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        delta=infer_pb2.TokenDelta(
            token_ids=e.token_ids, text=e.text, logprobs=[_logprobs_pb(lp) for lp in e.logprobs]
        )
    )


@event_pb.register
def _(e: ContextShift) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(shift=shift_pb(e))


@event_pb.register
def _(e: Finished) -> infer_pb2.GenerateResponse:
    return infer_pb2.GenerateResponse(
        finished=infer_pb2.Finished(
            reason=FINISH_REASON_TO_PB[e.reason],
            usage=usage_pb(e.usage),
            stop_string=e.stop_string,
            error=e.error,
            persistence=PERSISTENCE_TO_PB[e.persistence],
        )
    )


def shift_pb(s: ContextShift) -> infer_pb2.ContextShift:
    return infer_pb2.ContextShift(
        policy=POLICY_TO_PB[s.policy],
        num_cells_evicted=s.num_cells_evicted,
        num_positions_evicted=s.num_positions_evicted,
        media_ids_evicted=s.media_ids_evicted,
        num_cells_used_after=s.num_cells_used_after,
        next_position_after=s.next_position_after,
    )


def usage_pb(u: Usage | Mapping[str, Any]) -> infer_pb2.Usage:
    """A usage, or one kept with a turn record (its fields by name)."""
    fields = dict(u if isinstance(u, Mapping) else u.__dict__)
    by_type = fields.pop("drafts_by_type", None) or {}
    pb = infer_pb2.Usage(**fields)
    for name, (drafted, accepted, hits) in by_type.items():
        pb.drafts_by_type.add(
            type=SPEC_TYPE_NUMBERS[name], num_draft_tokens=drafted,
            num_accepted_tokens=accepted, num_cache_hits=hits,
        )  # fmt: skip
    return pb


def _choice_pb(c: TokenChoice) -> infer_pb2.TokenLogprob:
    return infer_pb2.TokenLogprob(token_id=c.token_id, piece=c.piece, logprob=c.logprob)


def _logprobs_pb(lp: TokenLogprobs) -> infer_pb2.TokenLogprobs:
    return infer_pb2.TokenLogprobs(chosen=_choice_pb(lp.chosen), top=map(_choice_pb, lp.top))


def set_lora_scales(
    lora: LoraAdapters, tenant: str, scales: Sequence[infer_pb2.LoraScale]
) -> list[infer_pb2.LoraAdapter]:
    """The tenant's scales from now on (those not listed: 0), and the adapters as they are."""
    try:
        lora.set_scales(tenant, [(s.id, s.scale) for s in scales])
    except LoraError as e:
        raise bad_request(str(e), "scales") from None
    return lora_adapters_pb(lora, tenant)


def lora_adapters_pb(lora: LoraAdapters, tenant: str) -> list[infer_pb2.LoraAdapter]:
    scales = lora.scales(tenant)
    return [
        infer_pb2.LoraAdapter(
            id=a.id,
            path=a.path,
            scale=scales[a.id],
            task_name=a.task_name,
            prompt_prefix=a.prompt_prefix,
        )
        for a in lora.adapters
    ]


def title_of(title: str) -> str:
    if len(title) > MAX_TITLE_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in title):
        raise bad_request(
            f"a title has at most {MAX_TITLE_CHARS} characters and no control characters", "title"
        )
    return title


# -- answers ------------------------------------------------------------------------------------


def server_info_pb(
    rt: Any, snap: Any, mine: TenantStats, tenant: str
) -> infer_pb2.GetServerInfoResponse:
    """The server as a caller may see it: the media cache's counts and the pool's figures
    (bar its size) are its tenant's own. Another tenant's cells in use, polled, would tell
    how long its prompts and replies are."""
    st = snap.stats
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
            num_shared_prefixes=mine.num_shared_prefixes,
            num_shared_cells=mine.num_shared_cells,
            num_pool_waits=mine.num_pool_waits,
            num_checkpoints=st.num_checkpoints,
            num_checkpoint_restores=st.num_checkpoint_restores,
            num_preemptions=mine.num_preemptions,
            num_sessions_reclaimed=mine.num_sessions_reclaimed,
        ),
        pool=kv_pool_pb(snap.pool, snap.pool_by_tenant.get(tenant)),
        memory_kind=memory_kind_pb(rt.memory_kind),
        num_checkpoints_per_slot=rt.config.ctx_checkpoints if rt.recurrent else 0,
        num_checkpoint_bytes=rt.checkpoint_bytes,
        cache_type_k=rt.cache_types.k,
        cache_type_v=rt.cache_types.v,
        flash_attn=rt.cache_types.flash_attn,
        num_bytes_per_cell=rt.bytes_per_cell,
    )


def kv_pool_pb(pool: PoolFigures | None, own: PoolFigures | None) -> infer_pb2.KvPool | None:
    """The pool's size, and the caller's own part of it (nothing: it holds none)."""
    if pool is None:
        return None
    return infer_pb2.KvPool(
        num_cells=pool.num_cells,
        num_cells_used=own.num_used if own else 0,
        num_shared_cells=own.num_held if own else 0,
        num_holders=own.num_holders if own else 0,
        num_holders_in_use=own.num_holders_in_use if own else 0,
    )


def embed_pb(embedded: Sequence[Any]) -> infer_pb2.EmbedResponse:
    return infer_pb2.EmbedResponse(
        embeddings=[
            infer_pb2.Embedding(values=e.values.tolist(), num_tokens=e.num_tokens) for e in embedded
        ]
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


def broken_session_info(key: str, why: str) -> infer_pb2.SessionInfo:
    return infer_pb2.SessionInfo(session_id=public_id(key), error=why)


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
        num_shared_cells=p.num_shared_cells,
        shared_prefix=p.shared_prefix if p.shared_prefix >= 0 else None,
        num_recurrent_bytes=p.num_recurrent_bytes,
        num_checkpoints=p.num_checkpoints,
        num_checkpoint_bytes=p.num_checkpoint_bytes,
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


def slots_pb(
    rt: Any, pictures: Sequence[SlotPicture], tenant: str, shared: Sequence[SharedPicture] = ()
) -> infer_pb2.WatchSlotsResponse:
    """The slots as `tenant` may see them, and its own shared prefixes (another tenant's are
    not there at all)."""
    return infer_pb2.WatchSlotsResponse(
        num_cells_per_slot=rt.num_cells_per_slot,
        uses_mrope=rt.uses_mrope,
        slots=[slot_view(p, tenant) for p in pictures],
        shared_prefixes=[
            infer_pb2.SharedPrefixView(
                holder=h.holder, num_cells=h.num_cells, slots=h.slots, runs=map(_run_pb, h.runs)
            )
            for h in shared
            if h.tenant == tenant
        ],
    )


# -- errors: raised anywhere in a handler, answered once -------------------------------------------


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


def answering(method: Callable[..., Any]) -> Callable[..., Any]:
    """A servicer method whose ProblemError (or OSError of the sessions directory) becomes
    the call's status with its google.rpc details, once, here (streams and unary alike)."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except ProblemError as e:
                await abort_problem(context, e.problem)

        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except ProblemError as e:
            await abort_problem(context, e.problem)

    return unary
