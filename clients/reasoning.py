"""A reasoning model's reply -> its thoughts and its content, whole or as it streams (what
llama-server's `--reasoning-format deepseek` does: the thoughts go to `reasoning_content`).

A reply holds thoughts when it begins with the template's start ("<think>"), or
when the prompt opened one (`Reasoning.started`: DeepSeek-R1's generation prompt ends with
"<think>\\n"): then the thoughts begin with what the prompt wrote after the start. They run to
the end ("</think>"; a reply cut before it is all thoughts), which is shown as neither; the
rest is content. Only the reply's first thought is read so (a later "<think>" is content),
and thoughts that are only blanks are none. As llama-server shows them, to the character.
"""

from __future__ import annotations

from dataclasses import dataclass

from clients.types import Reasoning

__all__ = ["ThoughtStream", "Thoughts", "split_thoughts"]


@dataclass(frozen=True)
class Thoughts:
    reasoning: str | None  # None: the reply has no thoughts (or only blanks)
    content: str


class ThoughtStream:
    """push(text) returns (thoughts, content) safe to show now; finish() the rest, and
    `whole` then the reply's."""

    def __init__(self, reasoning: Reasoning):
        self.tags = reasoning
        self._state = "inside" if reasoning.started else "head"
        self._held = reasoning.opened_text if reasoning.started else ""
        self._thoughts: list[str] = []  # shown so far
        self._content: list[str] = []
        self._blank = True  # the thoughts shown so far are blanks only (held back)

    @property
    def inside(self) -> bool:
        """Inside the thoughts."""
        return self._state == "inside"

    def push(self, text: str) -> tuple[str, str]:
        held = self._held + text
        if self._state == "head":  # before the reply shows whether it opens a thought
            if held.startswith(self.tags.start):
                self._state, held = "inside", held[len(self.tags.start) :]
            elif self.tags.start.startswith(held):
                self._held = held  # (part of the start: wait)
                return "", ""
            else:
                self._state = "content"
        if self._state == "content":
            self._held = ""
            return "", self._show_content(held)
        at = held.find(self.tags.end)
        if at >= 0:
            thought, rest = held[:at], held[at + len(self.tags.end) :]
            self._state, self._held = "content", ""
            return self._show_thought(thought), self._show_content(rest)
        keep = _partial(held, self.tags.end)
        self._held = held[len(held) - keep :]
        return self._show_thought(held[: len(held) - keep]), ""

    def finish(self) -> tuple[str, str]:
        """The rest: a reply cut inside its thoughts (or its start) ends there."""
        held, self._held = self._held, ""
        if self._state == "head":
            self._state = "content"
            return "", self._show_content(held)
        if self._state == "inside":
            return self._show_thought(held), ""
        return "", ""

    @property
    def whole(self) -> Thoughts:
        thoughts = "".join(self._thoughts)
        return Thoughts(None if self._blank else thoughts, "".join(self._content))

    def _show_thought(self, text: str) -> str:
        """Thoughts wait while they are blanks only (none may follow)."""
        if self._blank:
            pending = "".join(self._thoughts) + text
            if not pending.strip():
                self._thoughts = [pending]
                return ""
            self._blank = False
            self._thoughts = [pending]
            return pending
        self._thoughts.append(text)
        return text

    def _show_content(self, text: str) -> str:
        self._content.append(text)
        return text


def split_thoughts(reasoning: Reasoning, text: str) -> Thoughts:
    """A whole reply's thoughts and content."""
    stream = ThoughtStream(reasoning)
    stream.push(text)
    stream.finish()
    return stream.whole


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
