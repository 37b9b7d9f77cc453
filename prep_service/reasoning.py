"""Reasoning models: where a chat template writes the model's thoughts, and the variables a
request gives the template (llama-server's chat_template_kwargs, `enable_thinking` among them).

A template's thoughts are found in its source, as its tool format is (tools.template_format):
a template that writes a pair of thought tags we know (DeepSeek-R1 and its distills, QwQ,
Qwen3: `<think>` ... `</think>`) has them. Whether a reply begins inside a thought is read off
the rendered generation prompt: DeepSeek-R1's opens one (`<think>\\n`); Qwen3's does not (the
model writes `<think>` itself), and with enable_thinking false writes an empty one, closed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# (start, end) of the thoughts, as the templates that write them spell them
_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ("[THINK]", "[/THINK]"),  # Magistral, Ministral reasoning
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command R7B
)
# the template's own variables: a request's kwargs may not replace them
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
MAX_KWARGS_BYTES = 64 << 10


@dataclass(frozen=True)
class ThoughtTags:
    start: str
    end: str

    def opened(self, generation_prompt: str) -> str | None:
        """What the generation prompt wrote after the start of a thought it left open (the
        thought's first text, often "\\n"); None when it opened none (or closed it)."""
        at = generation_prompt.rfind(self.start)
        if at < 0 or generation_prompt.rfind(self.end) > at:
            return None
        return generation_prompt[at + len(self.start) :]


def template_reasoning(source: str | None) -> ThoughtTags | None:
    """The thought tags a Jinja template's source writes (None: it writes none we know)."""
    for start, end in _TAGS:
        if source and start in source and end in source:
            return ThoughtTags(start, end)
    return None


def template_kwargs(text: str) -> dict[str, Any]:
    """A request's chat_template_kwargs (JSON text; empty: none), checked as llama-server
    checks enable_thinking; ValueError naming what is wrong."""
    if not text:
        return {}
    if len(text) > MAX_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs: at most {MAX_KWARGS_BYTES} bytes")
    try:
        kwargs = json.loads(text)
    except ValueError:
        raise ValueError("chat_template_kwargs: not JSON") from None
    except RecursionError:
        raise ValueError("chat_template_kwargs: nested too deeply") from None
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs: give a JSON object")
    return checked(kwargs)


def checked(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    for name in RESERVED:
        if name in kwargs:
            raise ValueError(f"chat_template_kwargs: {name} is the chat template's own")
    thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        kind = "string" if isinstance(thinking, str) else type(thinking).__name__
        raise ValueError(
            f'chat_template_kwargs: invalid type for "enable_thinking" (expected boolean, got '
            f"{kind})"
        )
    return dict(kwargs)
