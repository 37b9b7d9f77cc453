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
# what `{m,n}` repetitions expand to in llama.cpp's parser (`"a"{0,2000}` 4,000 times: 1.8 GB)
MAX_GRAMMAR_ELEMENTS = 100_000
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
    """Refuse a GBNF text over MAX_GRAMMAR_BYTES, nested deeper than MAX_GRAMMAR_NESTING, or
    whose repetitions llama.cpp would write out past MAX_GRAMMAR_ELEMENTS (groups and `{m,n}`
    read as llama.cpp reads them: outside strings, character classes, `<...>` tokens and
    comments; a repeated literal is copied once per repetition, anything else referenced)."""
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise LimitError(f"grammar: {size} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    depth = deepest = elements = 0
    last = 1  # elements of the symbol a repetition would copy
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[<':  # a string, a character class or a token: to its unescaped end
            close = {'"': '"', "[": "]", "<": ">"}[c]
            start = i
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
            last = max(1, i - start - 1) if c == '"' else 1
        elif c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
            last = 1  # (a group becomes a rule: repeating it repeats a reference)
        elif c == "{":
            end = text.find("}", i)
            counts = [x.strip() for x in text[i + 1 : end if end > 0 else n].split(",")]
            copies = sum(int(x) if x.isdigit() and len(x) <= 9 else 1 for x in counts)
            elements += last * max(1, copies)
            i = end if end > 0 else n
        elif not c.isspace():
            last = 1
        i += 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise LimitError(
            f"grammar: groups nested {deepest} deep, over the limit of {MAX_GRAMMAR_NESTING}"
        )
    if elements > MAX_GRAMMAR_ELEMENTS:
        raise LimitError(
            f"grammar: its repetitions write out {elements} elements, over the limit of "
            f"{MAX_GRAMMAR_ELEMENTS}"
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
