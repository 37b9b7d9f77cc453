"""The infer side's one mapping between its domain and the contract's messages (the engine
imports no generated stub; service.py converts here and nowhere else).

An enum maps by name: a domain member maps to the proto value of the same name after the
enum's prefix (Policy.GAP <-> SHIFT_POLICY_GAP); a member without its twin fails at import.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from functools import singledispatch
from typing import Any, TypeVar

import grpc
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from infer_service.drafting import SpecType
from infer_service.events import (
    ContextShift,
    ErrorKind,
    Finished,
    FinishReason,
    Persistence,
    PrefillProgress,
    Started,
    TokenChoice,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from infer_service.kv_view import CellKind, SlotState
from infer_service.ledger import EvictionUnit, Policy
from slotwise.v1 import infer_pb2

E = TypeVar("E", bound=enum.Enum)


def by_name(domain: type[E], proto: EnumTypeWrapper, prefix: str) -> dict[E, int]:
    return {m: proto.Value(prefix + m.name) for m in domain}


POLICY_TO_PB = by_name(Policy, infer_pb2.ShiftPolicy, "SHIFT_POLICY_")
UNIT_TO_PB = by_name(EvictionUnit, infer_pb2.EvictionUnit, "EVICTION_UNIT_")
FINISH_REASON_TO_PB = by_name(FinishReason, infer_pb2.FinishReason, "FINISH_REASON_")
PERSISTENCE_TO_PB = by_name(Persistence, infer_pb2.Persistence, "PERSISTENCE_")
CELL_KIND_TO_PB = by_name(CellKind, infer_pb2.CellKind, "CELL_KIND_")
SLOT_STATE_TO_PB = by_name(SlotState, infer_pb2.SlotState, "SLOT_STATE_")
SPEC_TYPE_TO_PB = by_name(SpecType, infer_pb2.SpecType, "SPEC_TYPE_")
SPEC_TYPES: Mapping[int, SpecType] = {v: k for k, v in SPEC_TYPE_TO_PB.items()}
# requests: an unset policy or unit means the default
POLICIES: Mapping[int, Policy] = {
    infer_pb2.SHIFT_POLICY_UNSPECIFIED: Policy.AUTO,
    **{v: k for k, v in POLICY_TO_PB.items()},
}
UNITS: Mapping[int, EvictionUnit] = {
    infer_pb2.EVICTION_UNIT_UNSPECIFIED: EvictionUnit.TOKEN,
    **{v: k for k, v in UNIT_TO_PB.items()},
}
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
    return infer_pb2.Usage(**(u if isinstance(u, Mapping) else u.__dict__))


def _choice_pb(c: TokenChoice) -> infer_pb2.TokenLogprob:
    return infer_pb2.TokenLogprob(token_id=c.token_id, piece=c.piece, logprob=c.logprob)


def _logprobs_pb(lp: TokenLogprobs) -> infer_pb2.TokenLogprobs:
    return infer_pb2.TokenLogprobs(chosen=_choice_pb(lp.chosen), top=map(_choice_pb, lp.top))
