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
from clients.gateway.turns import Keep, Thinking
from slotwise_core.limits import MAX_TOKENS


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
        o.ngram_min_hits, o.ngram_mod_n_match, o.ngram_mod_n_min, o.ngram_mod_n_max,
    )  # fmt: skip


def speculative_in(body: Any) -> Speculative | None:
    """A body's `speculative` (a SpeculativeOptions field, any API's) with its flat
    `speculative.*` keys, which an open model keeps as extra."""
    nested = body.speculative.model_dump(exclude_none=True) if body.speculative else None
    return speculative_of(nested, body.model_extra or {})


REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")  # (auto: deepseek)


def reasoning_format(value: object, param: str = "reasoning_format") -> str:
    if value not in REASONING_FORMATS:
        raise bad_request(f"{param}: one of {', '.join(REASONING_FORMATS)}", param)
    return "deepseek" if value == "auto" else str(value)


def reasoning_budget(value: object, param: str) -> int | None:
    """A budget of thought tokens: -1 (or None) is none."""
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise bad_request(f"{param}: -1 (none) or 0 to {MAX_TOKENS} tokens", param)
    return value


def thinking_of(server: Thinking, body: Mapping[str, Any], asked: str = "") -> Thinking:
    """A reasoning model's options in llama-server's body fields over the server's flags:
    reasoning_format, chat_template_kwargs (over --chat-template-kwargs), reasoning_effort
    ("none": enable_thinking false; else the template's reasoning_effort),
    reasoning_budget_tokens (or thinking_budget_tokens, or reasoning_budget; -1: the
    server's) and reasoning_budget_message. `asked`: the API's own parameter that asked for
    thoughts (Anthropic's thinking), refused on a model without them."""
    fmt = server.format
    if body.get("reasoning_format") is not None:
        fmt = reasoning_format(body["reasoning_format"])
    kwargs = dict(server.kwargs)
    given = body.get("chat_template_kwargs")
    if given is not None:
        if not isinstance(given, dict):
            raise bad_request("chat_template_kwargs: give an object", "chat_template_kwargs")
        kwargs |= given
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning_effort: give a string", "reasoning_effort")
    if effort == "none":
        kwargs["enable_thinking"] = False
        kwargs.pop("reasoning_effort", None)
    elif effort:
        kwargs["reasoning_effort"] = effort
    budget = server.budget
    for name in ("reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget"):
        if body.get(name) is not None:
            own = reasoning_budget(body[name], name)
            budget = own if own is not None else server.budget
            asked = asked or (name if own is not None else "")
            break
    message = body.get("reasoning_budget_message", server.message)
    if not isinstance(message, str):
        raise bad_request("reasoning_budget_message: give a string", "reasoning_budget_message")
    return Thinking(fmt, budget, message, kwargs, asked)
