"""Chat messages -> prompt text, one piece per message, with the model's own Jinja template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(ValueError):
    """The chat template refused the conversation (e.g. roles in an order it does not accept)."""


@dataclass(frozen=True)
class Turn:
    role: str
    content: str  # text with media markers where the images go


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str, eos_token: str):
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, turns: Sequence[Turn], *, add_generation_prompt: bool) -> str:
        messages: list[dict[str, Any]] = [{"role": t.role, "content": t.content} for t in turns]
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None

    def pieces(self, turns: Sequence[Turn]) -> list[str]:
        """The rendered conversation cut at message boundaries.

        Piece i is what message i adds to the prompt; the last piece is the generation prompt.
        Templates that are not prefix-stable (rendering n messages does not start with the
        rendering of n-1) come back as one piece for the last message, which is all they allow.
        """
        full = self.render(turns, add_generation_prompt=True)
        cuts = [self.render(turns[: i + 1], add_generation_prompt=False) for i in range(len(turns))]
        pieces: list[str] = []
        done = ""
        for cut in [*cuts, full]:
            if not cut.startswith(done):
                return [""] * (len(turns) - 1) + [full, ""]
            pieces.append(cut[len(done) :])
            done = cut
        return pieces


def _raise(message: str) -> None:
    raise TemplateError(message)
