"""What a request asks of its generation, translated once for every API: each API's module reads
its own body's fields and hands their values here; a TurnRequest takes what comes back.

slotwise's own options (`slotwise` in any body) become the turn's context and pins; a response
format or a grammar its constraint; tools, and the API's tool_choice in slotwise's words, its
ToolOptions; llama-server's `speculative` options its drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from clients.client import Constraint, SpecType, Speculative, Tool, ToolChoice, ToolOptions
from clients.gateway.errors import ApiError, bad_request, invalid
from clients.gateway.schema import SlotwiseOptions, SpeculativeOptions
from clients.gateway.turns import Keep


def context_of(o: SlotwiseOptions, truncate: bool | None = None) -> dict[str, Any]:
    """The turn's context options; `truncate`: the API's own say over cutting a prompt that
    cannot fit (None: slotwise.truncate's)."""
    return {
        "policy": o.policy,
        "discard_fraction": o.discard_fraction,
        "unit": o.unit,
        "truncate_prompt": o.truncate if truncate is None else truncate,
    }


def keep_of(o: SlotwiseOptions, default: int | None = None) -> Keep:
    """The cells a turn pins: slotwise.keep when it is a number, else `default` (None: the
    system message's)."""
    return Keep(o.keep if isinstance(o.keep, int) else default)


def format_constraint(
    kind: str | None, schema: dict[str, Any] | None, missing: ApiError
) -> Constraint | None:
    """A response format's constraint: json_object (any object), json_schema (its schema;
    `missing` is raised without one), anything else none."""
    if kind == "json_object":
        return Constraint(json_schema={"type": "object"})
    if kind != "json_schema":
        return None
    if schema is None:
        raise missing
    return Constraint(json_schema=schema)


def grammar_constraint(
    grammar: str | None, json_schema: dict[str, Any] | None
) -> Constraint | None:
    """llama-server's own body fields: a GBNF grammar, else a JSON schema."""
    if grammar:
        return Constraint(grammar=grammar)
    if json_schema is not None:
        return Constraint(json_schema=json_schema)
    return None


_OPENAI_CHOICES = {
    None: ToolChoice.AUTO,
    "auto": ToolChoice.AUTO,
    "none": ToolChoice.NONE,
    "required": ToolChoice.REQUIRED,
}


def openai_choice(given: object) -> ToolChoice | None:
    """tool_choice in OpenAI's words (absent: auto), but for a named function."""
    return _OPENAI_CHOICES.get(given) if given is None or isinstance(given, str) else None


def tool_options(
    defs: Sequence[Tool],
    choice: ToolChoice | None,
    given: object,
    *,
    name: str = "",
    parallel: bool | None = None,
) -> ToolOptions | None:
    """The tools a request offers, and its tool_choice in slotwise's words: `choice` (None: the
    API's `given` choice has no such word; refused, by what was given)."""
    if not defs:
        if choice not in (ToolChoice.AUTO, ToolChoice.NONE):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice is None:
        raise bad_request(f"tool_choice {given!r} is not one this server knows", "tool_choice")
    return ToolOptions(list(defs), choice, name, parallel)


def speculative_of(nested: Any, body: Mapping[str, Any]) -> Speculative | None:
    """llama-server's `speculative` options: the nested object, with the body's flat keys
    (`"speculative.n_max": 16`) over it."""
    flat = {
        k.removeprefix("speculative."): v for k, v in body.items() if k.startswith("speculative.")
    }
    if nested is None and not flat:
        return None
    if nested is not None and not isinstance(nested, dict):
        raise bad_request("speculative: give an object of its options", "speculative")
    try:
        o = SpeculativeOptions.model_validate({**(nested or {}), **flat})
    except ValidationError as e:
        raise invalid(e.errors(), "speculative") from None
    return Speculative(
        o.type or SpecType.UNSPECIFIED, o.n_max, o.n_min, o.p_min, o.ngram_size_n, o.ngram_size_m,
        o.ngram_min_hits,
    )  # fmt: skip
