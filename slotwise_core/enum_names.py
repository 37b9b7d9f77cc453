"""Enums paired with the contract's by name, the one rule for every side (stdlib only: the client
package imports it without the services' dependencies).

A Python member maps to the proto value of the same name after the proto enum's prefix
(Policy.GAP <-> SHIFT_POLICY_GAP); a member without its twin fails where its table is built
(ValueError, at import). A proto enum is the generated wrapper (`infer_pb2.ShiftPolicy`): its
`Value(name)` and `Name(number)` are all that is read.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, TypeVar

__all__ = ["ProtoEnum", "from_numbers", "short_name", "to_numbers"]

E = TypeVar("E", bound=enum.Enum)

UNSET = 0  # a proto3 enum's first value: what a field reads as when nobody set it


class ProtoEnum(Protocol):  # (the generated wrappers' methods, by protobuf's names)
    def Value(self, name: str) -> int: ...
    def Name(self, number: Any) -> str: ...


def to_numbers(domain: type[E], proto: ProtoEnum, prefix: str) -> dict[E, int]:
    """Each member -> the number of its proto twin (prefix + the member's name)."""
    return {m: proto.Value(prefix + m.name) for m in domain}


def from_numbers(
    domain: type[E], proto: ProtoEnum, prefix: str, unset: E | None = None
) -> dict[int, E]:
    """Each twin's number -> its member; with `unset`, the unset value (0) reads as that member
    (unless a member is the unset value's own twin). A number not in the table is one the
    domain does not know: the caller decides whether that is an error or the default."""
    table = {number: member for member, number in to_numbers(domain, proto, prefix).items()}
    if unset is not None:
        table.setdefault(UNSET, unset)
    return table


def short_name(proto: ProtoEnum, number: int, prefix: str) -> str:
    """A proto value's name in plain words: CELL_KIND_MEDIA -> "media" (a number newer than the
    stubs reads as "unspecified", never an error)."""
    try:
        return str(proto.Name(number)).removeprefix(prefix).lower()
    except ValueError:
        return "unspecified"
