"""Bounds on what a caller may ask the sampler to follow, checked before llama.cpp or the
schema converter sees it.

llama.cpp's GBNF parser descends once per nested group: a grammar nested about 15,000 deep
overflows an 8 MiB thread stack and ends the process (measured on 0.3.36). The schema
converter writes `maxItems`, `maxLength` and a pattern's `{m,n}` out as text, one copy (and
one nested group) per repetition, so a count of 10^9 is gigabytes before any grammar exists.
Both are refused here, by size, by nesting and by count, in time linear in the text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

MAX_GRAMMAR_BYTES = 256 << 10
MAX_GRAMMAR_NESTING = 2000  # a tenth of what overflowed an 8 MiB stack
MAX_SCHEMA_BYTES = 256 << 10
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_REPEAT = 1000  # each count the converter writes out (llama.cpp's own cap is 2000)
MAX_SCHEMA_PATTERN = 1000  # characters of one `pattern`

_COUNTS = (
    "minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
    "minContains", "maxContains",
)  # fmt: skip


class LimitError(ValueError):
    """A grammar or schema past one of the bounds above (the message names it)."""


def check_grammar(text: str) -> None:
    """Refuse a GBNF text over MAX_GRAMMAR_BYTES or nested deeper than MAX_GRAMMAR_NESTING
    (groups counted outside strings, character classes and comments, as llama.cpp reads them)."""
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise LimitError(f"grammar: {size} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':  # a string or a character class: to its unescaped end
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise LimitError(
            f"grammar: groups nested {deepest} deep, over the limit of {MAX_GRAMMAR_NESTING}"
        )


def check_schema_text(text: str) -> None:
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise LimitError(f"json_schema: {size} bytes, over the limit of {MAX_SCHEMA_BYTES}")


def check_schema(schema: Any) -> None:
    """Refuse a (parsed) schema nested deeper than MAX_SCHEMA_DEPTH, or with a count or a
    pattern the converter would write out past the bounds above."""
    for node, depth in _nodes(schema):
        if depth > MAX_SCHEMA_DEPTH:
            raise LimitError(f"json_schema: nested over {MAX_SCHEMA_DEPTH} deep")
        if not isinstance(node, dict):
            continue
        for key in _COUNTS:
            value = node.get(key)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and (value > MAX_SCHEMA_REPEAT)
            ):
                raise LimitError(
                    f"json_schema: {key} {value} is over the limit of {MAX_SCHEMA_REPEAT}"
                )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_pattern(pattern)


def _nodes(schema: Any) -> Iterator[tuple[Any, int]]:
    stack = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        yield node, depth  # (the caller refuses a node past MAX_SCHEMA_DEPTH)
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children)


def _check_pattern(pattern: str) -> None:
    if len(pattern) > MAX_SCHEMA_PATTERN:
        raise LimitError(
            f"json_schema: a pattern of {len(pattern)} characters, over the limit of "
            f"{MAX_SCHEMA_PATTERN}"
        )
    i = 0
    while (i := pattern.find("{", i)) >= 0:
        end = pattern.find("}", i)
        if end < 0:
            return  # (the converter refuses it)
        for number in pattern[i + 1 : end].split(","):
            number = number.strip()
            if number.isdigit() and (len(number) > 9 or int(number) > MAX_SCHEMA_REPEAT):
                raise LimitError(
                    f"json_schema: the repetition {pattern[i : end + 1]} in a pattern is over "
                    f"the limit of {MAX_SCHEMA_REPEAT}"
                )
        i = end + 1
