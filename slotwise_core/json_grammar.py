"""JSON Schema -> GBNF: llama-cpp-python's converter, with two gaps of its 0.3.36 copy closed.

- Strings: its `char` rule lets raw control characters through, which `json.loads` (and so
  every client that parses the reply) refuses; llama.cpp's current rule excludes them.
- Integers: `minimum` / `maximum` (and the exclusive forms) are ignored there (a TODO);
  here they become an exact grammar of the decimal numbers in the range.
"""

from __future__ import annotations

import json
from typing import Any

from llama_cpp.llama_grammar import BuiltinRule, SchemaConverter

from slotwise_core.grammar_limits import check_schema, check_schema_text

_HEX = "[0-9a-fA-F]"
_JSON_CHAR = BuiltinRule(
    r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" ' + " ".join([_HEX] * 4) + ")", []
)
_MAX_DIGITS = 16  # what the converter allows an unbounded integer


def json_schema_to_gbnf(schema: str) -> str:
    """Raises ValueError (or what the converter raises) for a schema it cannot follow, and
    LimitError (a ValueError) for one past the bounds of slotwise_core/grammar_limits.py."""
    check_schema_text(schema)
    return json_schema_rules([json.loads(schema)], root=True)[0]


def json_schema_rules(schemas: list[Any], *, root: bool = False) -> tuple[str, list[str]]:
    """GBNF for several schemas, and the name of each one's rule: the pieces of a larger
    grammar (a tool call's arguments inside its format's markers). root: the one schema's
    rule is `root`. Each schema's definitions get names of their own (the converter names
    a definition's rule by its last path part: two tools' `$defs/Unit` would be one)."""
    for schema in schemas:
        check_schema(schema)
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    names = []
    for i, schema in enumerate(schemas):
        own = _own_definitions(schema, f"s{i}") if not root else schema
        names.append(
            converter.visit(converter.resolve_refs(own, f"schema{i}"), "" if root else f"s{i}")
        )
    return converter.format_grammar(), names


def _own_definitions(schema: Any, prefix: str) -> Any:
    """The schema with its $defs/definitions renamed `prefix-name`, and its refs to them."""
    if not isinstance(schema, dict):
        return schema
    renamed = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            renamed[key] = {name: f"{prefix}-{name}" for name in schema[key]}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                for key, names in renamed.items():
                    head = f"#/{key}/"
                    if v.startswith(head) and v[len(head) :].split("/")[0] in names:
                        name, _, rest = v[len(head) :].partition("/")
                        v = f"{head}{names[name]}" + (f"/{rest}" if rest else "")
                out[k] = v
            elif k in renamed and node is schema:
                out[k] = {renamed[k][n]: walk(d) for n, d in v.items()}
            else:
                out[k] = walk(v)
        return out

    return walk(schema)


class _Converter(SchemaConverter):
    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return super()._add_primitive(name, _JSON_CHAR if name == "char" else rule)

    def visit(self, schema: Any, name: str) -> str:
        if isinstance(schema, dict) and schema.get("type") == "integer":
            bounds = _bounds(schema)
            if bounds is not None:
                lo, hi = bounds
                return self._add_rule(name or "root", f"({integer_range(lo, hi)}) space")
        return super().visit(schema, name)


def _bounds(schema: dict[str, Any]) -> tuple[int, int] | None:
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    if not any(k in schema for k in keys) or "enum" in schema or "const" in schema:
        return None  # (an enum or a constant says more: the converter writes it)
    top = 10 ** (_MAX_DIGITS - 1) - 1
    lo, hi = -top, top
    low_open, high_open = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if "minimum" in schema:  # (draft 4: a true exclusiveMinimum makes the minimum open)
        lo = max(
            lo, _floor(schema["minimum"]) + 1 if low_open is True else _ceil(schema["minimum"])
        )
    if "maximum" in schema:
        hi = min(
            hi, _ceil(schema["maximum"]) - 1 if high_open is True else _floor(schema["maximum"])
        )
    if low_open is not None and not isinstance(low_open, bool):
        lo = max(lo, _floor(low_open) + 1)
    if high_open is not None and not isinstance(high_open, bool):
        hi = min(hi, _ceil(high_open) - 1)
    if lo > hi:
        raise ValueError(f"no integer lies within the bounds of {schema}")
    return lo, hi


def _ceil(x: Any) -> int:
    return -int(-float(x) // 1)


def _floor(x: Any) -> int:
    return int(float(x) // 1)


def integer_range(lo: int, hi: int) -> str:
    """A GBNF expression matching exactly the decimal integers in [lo, hi] (no leading zeros,
    no "-0")."""
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    if hi < 0:
        return f'"-" ({integer_range(-hi, -lo)})'
    if lo < 0:
        return f'"-" ({integer_range(1, -lo)}) | {integer_range(0, hi)}'
    alternatives = []
    while lo <= hi:  # one run of numbers of the same length at a time
        top = min(hi, 10 ** len(str(lo)) - 1)
        alternatives.append(_same_length(str(lo), str(top)))
        lo = top + 1
    return " | ".join(alternatives)


def _same_length(a: str, b: str) -> str:
    """The digit strings from a to b, both of one length (a <= b)."""
    if a == b:
        return f'"{a}"'
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return f'"{a[0]}" ({_same_length(a[1:], b[1:])})'
    rest = len(a) - 1
    low_full, high_full = a[1:] == "0" * rest, b[1:] == "9" * rest
    first = int(a[0]) + (0 if low_full else 1)
    last = int(b[0]) - (0 if high_full else 1)
    alternatives = []
    if not low_full:
        alternatives.append(f'"{a[0]}" ({_same_length(a[1:], "9" * rest)})')
    if first <= last:
        alternatives.append(f"[{first}-{last}]" + " [0-9]" * rest)
    if not high_full:
        alternatives.append(f'"{b[0]}" ({_same_length("0" * rest, b[1:])})')
    return " | ".join(alternatives)
