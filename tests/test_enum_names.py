"""The one rule between Python enums and the contract's (slotwise_core/enum_names.py): by name
after the prefix, the unset value read as a default only when asked, a lost twin an error."""

from __future__ import annotations

import enum

import pytest

from slotwise.v1 import infer_pb2
from slotwise_core.enum_names import from_numbers, short_name, to_numbers


class Unit(enum.Enum):
    TOKEN = "token"
    MESSAGE = "message"


def test_members_map_to_their_twins_and_back() -> None:
    assert to_numbers(Unit, infer_pb2.EvictionUnit, "EVICTION_UNIT_") == {
        Unit.TOKEN: infer_pb2.EVICTION_UNIT_TOKEN,
        Unit.MESSAGE: infer_pb2.EVICTION_UNIT_MESSAGE,
    }
    back = from_numbers(Unit, infer_pb2.EvictionUnit, "EVICTION_UNIT_")
    assert infer_pb2.EVICTION_UNIT_UNSPECIFIED not in back  # unknown unless a default is given
    assert back[infer_pb2.EVICTION_UNIT_MESSAGE] is Unit.MESSAGE
    unset = from_numbers(Unit, infer_pb2.EvictionUnit, "EVICTION_UNIT_", unset=Unit.TOKEN)
    assert unset == {**back, infer_pb2.EVICTION_UNIT_UNSPECIFIED: Unit.TOKEN}


def test_a_member_without_its_twin_fails_where_the_table_is_built() -> None:
    lost = enum.Enum("lost", {"TOKEN": 1, "WORD": 2})
    with pytest.raises(ValueError):
        to_numbers(lost, infer_pb2.EvictionUnit, "EVICTION_UNIT_")


def test_a_short_name_is_lower_case_and_a_newer_number_unspecified() -> None:
    assert short_name(infer_pb2.CellKind, infer_pb2.CELL_KIND_MEDIA, "CELL_KIND_") == "media"
    assert short_name(infer_pb2.SlotState, 999, "SLOT_STATE_") == "unspecified"
