"""The client's enums and the one table between them and the proto's enums.

Each Python enum is paired with its proto enum and the prefix of that enum's value names; a
member maps to the proto value of the same name (Policy.GAP <-> SHIFT_POLICY_GAP, by
slotwise_core.enum_names, the rule every side uses). Every
member must have its proto twin (checked on import); a proto value the client does not know
(a newer server), or an unset one, reads as the enum's default.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

from slotwise.v1 import infer_pb2, prep_pb2
from slotwise_core.enum_names import ProtoEnum, from_numbers, to_numbers

__all__ = [
    "FinishReason",
    "Persistence",
    "Policy",
    "SpecType",
    "ToolChoice",
    "ToolFormat",
    "Unit",
    "from_pb",
    "to_pb",
]


class Policy(enum.StrEnum):
    """How the server makes room in a full context (a Shift reports the one it used)."""

    AUTO = "auto"
    SHIFT = "shift"
    GAP = "gap"
    REPREFILL = "reprefill"
    STOP = "stop"


class Unit(enum.StrEnum):
    """What one eviction takes out: a run of tokens, or whole messages."""

    TOKEN = "token"
    MESSAGE = "message"


class FinishReason(enum.StrEnum):
    UNSPECIFIED = "unspecified"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    GRAMMAR = "grammar"  # the constraint allowed no token next, nor the end


class Persistence(enum.StrEnum):
    """Whether a session turn's result is on disk (see Finished.persistence)."""

    UNSPECIFIED = "unspecified"  # not a session turn, or it did not complete
    MEMORY = "memory"  # the server keeps sessions in memory only
    SAVED = "saved"
    NOT_SAVED = "not_saved"  # completed and kept in memory, but not on disk (error says why)


class SpecType(enum.StrEnum):
    """Where speculative drafts come from (the names are llama-server's --spec-type)."""

    UNSPECIFIED = "unspecified"  # the server's default
    NONE = "none"
    NGRAM_SIMPLE = "ngram-simple"
    NGRAM_MAP_K = "ngram-map-k"
    DRAFT_SIMPLE = "draft-simple"  # a draft model (infer --model-draft)
    NGRAM_MAP_K4V = "ngram-map-k4v"
    NGRAM_MOD = "ngram-mod"  # llama-server's --spec-default (a pool per tenant, across requests)
    NGRAM_CACHE = "ngram-cache"
    SUFFIX = "suffix"  # the tenant's earlier prompts and replies (slotwise's own)
    DRAFT_MTP = "draft-mtp"  # the model's multi-token-prediction head


class ToolChoice(enum.StrEnum):
    AUTO = "auto"  # the model answers in text or calls tools
    NONE = "none"  # no calls (the tools are not shown)
    REQUIRED = "required"  # at least one call
    FUNCTION = "function"  # a call of the function named by tool_name


class ToolFormat(enum.StrEnum):
    """How the chat template's model writes tool calls (clients.tool_calls reads each)."""

    UNSPECIFIED = "unspecified"
    JSON = "json"  # {"tool_calls": [...]} or {"response": "..."} (templates without tools)
    HERMES = "hermes"  # <tool_call>{...}</tool_call>
    LLAMA3 = "llama3"  # {"name": ..., "parameters": ...}
    MISTRAL = "mistral"  # [TOOL_CALLS][{...}]


E = TypeVar("E", bound=enum.Enum)

# enum -> (its proto enum, the prefix of the proto's value names, what unknown values read as)
_PAIRS: dict[type[enum.Enum], tuple[ProtoEnum, str, enum.Enum]] = {
    Policy: (infer_pb2.ShiftPolicy, "SHIFT_POLICY_", Policy.AUTO),
    Unit: (infer_pb2.EvictionUnit, "EVICTION_UNIT_", Unit.TOKEN),
    FinishReason: (infer_pb2.FinishReason, "FINISH_REASON_", FinishReason.UNSPECIFIED),
    Persistence: (infer_pb2.Persistence, "PERSISTENCE_", Persistence.UNSPECIFIED),
    SpecType: (infer_pb2.SpecType, "SPEC_TYPE_", SpecType.UNSPECIFIED),
    ToolChoice: (prep_pb2.ToolChoice, "TOOL_CHOICE_", ToolChoice.AUTO),
    ToolFormat: (prep_pb2.ToolFormat, "TOOL_FORMAT_", ToolFormat.UNSPECIFIED),
}

# (ValueError here: a member lost its twin)
_TO_PB: dict[type[enum.Enum], dict[Any, int]] = {
    kind: to_numbers(kind, proto, prefix) for kind, (proto, prefix, _) in _PAIRS.items()
}
_FROM_PB: dict[type[enum.Enum], dict[int, Any]] = {
    kind: from_numbers(kind, proto, prefix) for kind, (proto, prefix, _) in _PAIRS.items()
}


def to_pb(kind: type[E], value: E | str) -> int:
    """A member (or its string value, e.g. "gap") -> the proto enum's number."""
    return _TO_PB[kind][kind(value)]


def from_pb(kind: type[E], number: int) -> E:
    """A proto enum number -> the member; unknown or unset numbers read as the default."""
    default: E = _PAIRS[kind][2]  # type: ignore[assignment]
    return _FROM_PB[kind].get(number, default)  # type: ignore[no-any-return]
