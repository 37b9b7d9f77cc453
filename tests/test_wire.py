"""The infer side's one mapping to the contract (infer_service/api/protobuf.py): every domain
member has its proto twin, a request's unset enum reads as the default, and the finish reason's
number (a turn record on disk keeps it) is the contract's."""

from __future__ import annotations

from infer_service.api import protobuf as wire
from infer_service.events import FinishReason, Persistence
from infer_service.kv.ledger import EvictionUnit, Policy
from slotwise.v1 import infer_pb2


def test_each_domain_enum_maps_onto_every_value_of_its_proto_enum() -> None:
    for table, proto in (
        (wire.POLICY_TO_PB, infer_pb2.ShiftPolicy),
        (wire.UNIT_TO_PB, infer_pb2.EvictionUnit),
        (wire.FINISH_REASON_TO_PB, infer_pb2.FinishReason),
        (wire.PERSISTENCE_TO_PB, infer_pb2.Persistence),
    ):
        named = {v for k, v in proto.items() if not k.endswith("_UNSPECIFIED")}
        assert set(table.values()) | {0} >= named | {0}, proto  # none left unmapped
    assert wire.PERSISTENCE_TO_PB[Persistence.UNSPECIFIED] == 0
    assert wire.POLICIES[infer_pb2.SHIFT_POLICY_UNSPECIFIED] is Policy.AUTO
    assert wire.UNITS[infer_pb2.EVICTION_UNIT_UNSPECIFIED] is EvictionUnit.TOKEN
    assert all(wire.POLICIES[v] is k for k, v in wire.POLICY_TO_PB.items())


def test_a_finish_reason_kept_on_disk_is_the_contract_s_number() -> None:
    for reason in FinishReason:
        assert wire.FINISH_REASON_TO_PB[reason] == int(reason)
