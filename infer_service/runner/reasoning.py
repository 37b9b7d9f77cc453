"""A reasoning model's thoughts in one generation: which generated tokens are thoughts, and
the budget that ends a long one (pure: the executor feeds it each token it emits).

It follows llama.cpp's reasoning budget (common/reasoning-budget.cpp), token for token:
outside a thought it watches for the start sequence (the template's "<think>"); inside, it
counts the thought's tokens and watches for the end sequence ("</think>"). Once a thought has
`budget` tokens (and its text is not in the middle of a UTF-8 character) the tokens of
`forced` are the next ones, one a step, in place of the sampled ones: the message and the
end, decoded into the sequence like any token the model writes. A thought that ends is left
behind; a new start begins another, with a budget of its own.

A token is a thought's when it is written inside one: from the token that completes the start
(or the reply's first, when the prompt opened the thought) to the one that completes the end,
forced or not. The ledger marks those tokens (`Item.thought`), and a shift evicts a thought
whole.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_TAG_TOKENS = 16  # start and end sequences
MAX_FORCED_TOKENS = 512  # a budget message and the end


@dataclass(frozen=True)
class Thoughts:
    """A request's reasoning options (GenerateRequest.reasoning), checked."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    started: bool = False  # the prompt ends inside a thought
    budget: int | None = None  # thought tokens at most (None: no budget)
    forced: tuple[int, ...] = ()  # what ends a thought past its budget (empty: `end`)

    def __post_init__(self) -> None:
        if not 0 < len(self.start) <= MAX_TAG_TOKENS or not 0 < len(self.end) <= MAX_TAG_TOKENS:
            raise ValueError(f"start and end are 1 to {MAX_TAG_TOKENS} token ids each")
        if len(self.forced) > MAX_FORCED_TOKENS:
            raise ValueError(f"at most {MAX_FORCED_TOKENS} forced token ids")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"the budget is a number of tokens, got {self.budget}")

    @property
    def ending(self) -> tuple[int, ...]:
        return self.forced or self.end

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (*self.start, *self.end, *self.forced)


class State(enum.Enum):
    OUTSIDE = "outside"  # (llama.cpp's IDLE and DONE: watching for a start)
    COUNTING = "counting"
    WAITING_UTF8 = "waiting_utf8"  # the budget is spent; a character is still unfinished
    FORCING = "forcing"


class ThoughtTracker:
    """One generation's place in its thoughts."""

    def __init__(self, thoughts: Thoughts):
        self.thoughts = thoughts
        self.state = State.OUTSIDE
        self.remaining = 0
        self._forced_at = 0
        self._recent: list[int] = []  # the last tokens, for the start or end to match
        self.num_thought_tokens = 0
        self.last_was_thought = False
        self.answered = False  # a token outside the thoughts was written
        if thoughts.started:
            self._open()

    @property
    def inside(self) -> bool:
        return self.state is not State.OUTSIDE

    @property
    def leading(self) -> bool:
        """Inside the thought the reply begins with (nothing of the answer written yet)."""
        return self.inside and not self.answered

    def forced(self) -> int | None:
        """The token to write now in place of a sampled one (None: sample)."""
        if self.state is State.FORCING:
            return self.thoughts.ending[self._forced_at]
        return None

    def accept(self, token: int, piece: bytes, *, may_open: bool = True) -> bool:
        """The token written next (`piece`: its bytes); whether it is a thought's (also
        `last_was_thought`). `may_open`: False while a constraint holds the reply (a start
        inside its JSON is text, not a thought)."""
        self.last_was_thought = self._accept(token, piece, may_open)
        self.num_thought_tokens += self.last_was_thought
        self.answered = self.answered or not self.last_was_thought
        return self.last_was_thought

    def _accept(self, token: int, piece: bytes, may_open: bool) -> bool:
        t = self.thoughts
        self._recent = [*self._recent, token][-max(len(t.start), len(t.end)) :]
        if self.state is State.OUTSIDE:
            if not (may_open and self._ends_with(t.start)):
                return False
            self._open()
        elif self.state is State.FORCING:
            self._forced_at += 1
            if self._forced_at >= len(t.ending):
                self._close()
        elif self._ends_with(t.end):
            self._close()
        elif self.state is State.WAITING_UTF8:
            if utf8_complete(piece):
                self._force()
        elif t.budget is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                if utf8_complete(piece):
                    self._force()
                else:
                    self.state, self._recent = State.WAITING_UTF8, []
        return True

    def _ends_with(self, seq: tuple[int, ...]) -> bool:
        return tuple(self._recent[-len(seq) :]) == seq

    def _open(self) -> None:
        self._recent = []
        budget = self.thoughts.budget
        self.state = State.COUNTING
        self.remaining = budget or 0
        if budget is not None and budget <= 0:
            self._force()

    def _force(self) -> None:
        self.state, self._forced_at, self._recent = State.FORCING, 0, []

    def _close(self) -> None:
        self.state, self._recent = State.OUTSIDE, []


def utf8_complete(piece: bytes) -> bool:
    """Whether a token's bytes end on a whole UTF-8 character (llama.cpp's
    common_utf8_is_complete: the piece alone is looked at)."""
    if not piece:
        return True
    for i in range(1, min(4, len(piece)) + 1):
        c = piece[-i]
        if c & 0xC0 != 0x80:
            expected = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i >= expected
    return False
