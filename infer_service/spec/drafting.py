"""Drafts without a second model: the tokens that followed the sequence's last n tokens the
last time they occurred in it (prompt lookup, llama.cpp's `ngram-simple` and `ngram-map-k`),
and how many of them a slot verifies each step. Pure: no llama, no grpc.

Edit this file, fix this JSON, answer quoting this document, call a tool with the arguments
just read: most of such a reply is already in the context, and a draft of it costs one
position per token in a batch the step decodes anyway. Each drafted token is checked against
the target's own sample at its position, so the output is what it would have been; a miss
costs the cells of the drafts after it, which the ledger gives back.

`NgramIndex` keeps, per n-gram of the history, where it last ended (and, for `ngram-map-k`,
how often it occurred): a lookup is a dict access, not a scan. The history is bounded: past
`max_tokens` its older half goes and the index is rebuilt (amortised over as many appends).

`DraftLength` adapts how many drafts a slot asks for to how many of its recent drafts were
accepted: a slot whose drafts keep missing drafts less, one whose drafts land drafts more, so
free text (where a lookup rarely matches, and a match is rarely right) stays as fast as
without drafts.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from infer_service.spec.proposer import NO_TOKEN

HISTORY_TOKENS = 1 << 16  # a request's history for lookups (its newest tokens)


class SpecType(enum.Enum):
    NONE = "none"
    NGRAM_SIMPLE = "ngram-simple"  # the latest earlier occurrence of the last n tokens
    NGRAM_MAP_K = "ngram-map-k"  # the same, once the n-gram occurred min_hits times
    DRAFT_SIMPLE = "draft-simple"  # a draft model's greedy guesses (--model-draft)


@dataclass(frozen=True)
class SpecConfig:
    """How a request drafts (llama-server's names and defaults where they mean the same)."""

    type: SpecType = SpecType.NONE
    n_max: int = 48  # drafts per step at most (the slot verifies as many as pay their way)
    n_min: int = 0  # fewer than this: draft none
    p_min: float = 0.0  # (a draft model's confidence floor; n-gram drafts have none)
    size_n: int = 12  # the n-gram looked up (--spec-ngram-size-n)
    size_m: int = 48  # the longest continuation drafted from one match (--spec-ngram-size-m)
    min_hits: int = 1  # ngram-map-k: occurrences of the n-gram before it drafts

    @property
    def enabled(self) -> bool:
        return self.type is not SpecType.NONE and self.n_max > 0


class NgramIndex:
    """The history of one sequence's tokens, and where each n-gram of it last ended."""

    def __init__(self, size_n: int, *, max_tokens: int = 1 << 16):
        if size_n < 1 or max_tokens < 2 * size_n:
            raise ValueError(f"size_n must be >= 1 and max_tokens >= 2 * size_n, got {size_n}")
        self.size_n = size_n
        self.max_tokens = max_tokens
        self._tokens: list[int] = []
        # hash of an n-gram -> (where it last ended, where it ended before that, how often)
        self._ends: dict[int, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        if len(self._tokens) >= self.max_tokens:
            self._rebuild(self._tokens[len(self._tokens) // 2 :])
        self._tokens.append(token)
        self._index(len(self._tokens) - 1)

    def _index(self, end: int) -> None:
        key = self._key(end)
        if key is not None:
            latest, _, hits = self._ends.get(key, (-1, -1, 0))
            self._ends[key] = (end, latest, hits + 1)

    def _key(self, end: int) -> int | None:
        start = end - self.size_n + 1
        if start < 0:
            return None
        gram = tuple(self._tokens[start : end + 1])
        return None if NO_TOKEN in gram else hash(gram)

    def _rebuild(self, tokens: list[int]) -> None:
        self._tokens, self._ends = [], {}
        for t in tokens:
            self._tokens.append(t)
            self._index(len(self._tokens) - 1)

    def draft(self, limit: int, *, min_hits: int = 1) -> list[int]:
        """What followed the last n tokens the last time they occurred before now, at most
        `limit` tokens (none across a media chunk); where that runs into the end of the
        history, it goes on as the copy it is (a repeating reply drafts its period again)."""
        end = len(self._tokens) - 1
        key = self._key(end)
        if key is None or limit <= 0:
            return []
        found = self._previous(key, end, min_hits)
        if found is None:
            return []
        return overlapping_copy(self._tokens, found + 1, limit)

    def _previous(self, key: int, end: int, min_hits: int) -> int | None:
        """The end of the n-gram's occurrence before the one at `end` (checked token by
        token: two n-grams may share a hash)."""
        latest, before, hits = self._ends.get(key, (-1, -1, 0))
        found = before if latest == end else latest
        if found < 0 or hits - 1 < min_hits:  # (the occurrence at `end` is one of the hits)
            return None
        n = self.size_n
        if self._tokens[found - n + 1 : found + 1] != self._tokens[end - n + 1 : end + 1]:
            return None
        return found


def overlapping_copy(tokens: Sequence[int], start: int, limit: int) -> list[int]:
    """At most `limit` tokens copied from `start` on, LZ77's way: a copy that reaches the end
    of `tokens` goes on reading what it copied (the history's last `len(tokens) - start`
    tokens, repeated); it stops at a media chunk."""
    out: list[int] = []
    n = len(tokens)
    for i in range(limit):
        k = start + i
        t = tokens[k] if k < n else out[k - n]
        if t == NO_TOKEN:
            break
        out.append(t)
    return out


class StepCost:
    """What verifying one more token costs, against what a token costs when no slot drafts,
    measured on this machine from the engine's own generation steps: a step of n tokens
    takes about t0 + c*n (a least-squares line through moving averages). A slot among g that
    generate saves (t0 + c*g) / g per accepted draft and pays c per draft: on a GPU c is next
    to nothing, on two CPU cores (Gemma 3 270M: t0 11 ms, c 9.5 ms) about half a token alone,
    and more than three quarters of one in a batch of four."""

    def __init__(self, prior: float = 0.5, weight: float = 0.05):
        self.prior, self.weight = prior, weight
        # moving averages of n, t, n*n and n*t
        self._n: float | None = None
        self._t: float | None = None
        self._nn: float | None = None
        self._nt: float | None = None
        # a moving average of the step's seconds per size bucket: where a step of many tokens
        # costs more than the line says (a recurrent layer's chunked scan on a CPU: 49 tokens
        # at 2 ms each, 9 at 1.1), the draft length follows what was measured
        self._by_size: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        n, t, w = float(num_tokens), seconds, self.weight
        self._n = _moved(self._n, n, w)
        self._t = _moved(self._t, t, w)
        self._nn = _moved(self._nn, n * n, w)
        self._nt = _moved(self._nt, n * t, w)
        bucket = _bucket(num_tokens)
        self._by_size[bucket] = _moved(self._by_size.get(bucket), seconds, 4 * w)

    def seconds(self, num_tokens: int) -> float | None:
        """What a step of `num_tokens` costs: measured at its size (or the size bucket it
        shares), else read off the line; None before any step."""
        measured = self._by_size.get(_bucket(num_tokens))
        if measured is not None:
            return measured
        line = self._line()
        return None if line is None else line[0] + line[1] * num_tokens

    def _line(self) -> tuple[float, float] | None:
        """(t0, c): a step of n tokens takes about t0 + c*n."""
        if self._n is None or self._t is None or self._nn is None or self._nt is None:
            return None
        spread = self._nn - self._n * self._n
        if spread < 0.25:
            return None
        c = max(0.0, (self._nt - self._n * self._t) / spread)
        return max(0.0, self._t - c * self._n), c

    def worth(self, num_generating: int, acceptance: float, limit: int) -> int:
        """The draft length, at most `limit`, whose expected tokens pay most for the time it
        adds to the step: a slot among g that generate saves (step of g)/g per accepted draft
        (the j-th lands with probability a^j) and adds T(g + k) - T(g)."""
        g = max(1, num_generating)
        base = self.seconds(g)
        if base is None or limit <= 0:
            return limit
        per_token = base / g
        best, best_gain, expected = 0, 0.0, 0.0
        for k in range(1, limit + 1):
            expected += acceptance**k
            cost = self.seconds(g + k)
            if cost is None:
                return limit
            gain = per_token * expected - (cost - base)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def ratio(self, num_generating: int = 1, extra: float = 0.0) -> float:
        """(c + extra) / ((t0 + c*g) / g): a draft's cost (and `extra` seconds of drafting it)
        over the token it may save."""
        if self._t is None:
            return self.prior
        line = self._line()
        if line is None:  # (steps all of one size so far: no line to draw)
            return min(1.0, self.prior + (extra / self._t if self._t > 0 else 0.0))
        t0, c = line
        g = max(1, num_generating)
        per_token = (t0 + c * g) / g
        return min(1.0, max(0.01, (c + extra) / per_token)) if per_token > 0 else self.prior


def _bucket(num_tokens: int) -> int:
    """Sizes up to 8 on their own, then buckets an eighth of a power of two wide."""
    if num_tokens <= 8:
        return num_tokens
    shift = num_tokens.bit_length() - 4
    return (num_tokens >> shift) << shift


def _moved(average: float | None, value: float, weight: float) -> float:
    return value if average is None else average + weight * (value - average)


class DraftLength:
    """How many drafts a slot verifies next: as many as are worth their cost. The draft at
    position j (from 1) lands with probability a^j, a being the slot's recent acceptance per
    position (a moving average); verifying it costs `ratio` of a one-token step, which an
    accepted draft saves: drafts are asked for while a^j > ratio. A slot whose drafts keep
    missing (a <= ratio) tries one draft now and then, the pause doubling while it misses, so
    free text costs next to nothing and a copy that begins later is still found."""

    def __init__(self, n_max: int, *, prior: float = 0.9, weight: float = 0.1, max_pause: int = 32):
        self.n_max = n_max
        self.a = prior
        self.weight = weight
        self.max_pause = max_pause
        self._pause = 1
        self._wait = 0

    def limit(self, ratio: float) -> int:
        """The drafts to ask for this step (0: draft none)."""
        if self.a > ratio:
            k = math.floor(math.log(ratio) / math.log(self.a)) if self.a < 1 else self.n_max
            return max(1, min(self.n_max, k))
        if self._wait > 0:
            self._wait -= 1
            return 0
        self._wait = self._pause
        return min(1, self.n_max)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        missed = num_accepted < num_drafted
        for landed in [True] * num_accepted + [False] * missed:
            self.a += self.weight * (float(landed) - self.a)
        if num_accepted:
            self._pause, self._wait = 1, 0
        elif missed:
            self._pause = min(self.max_pause, 2 * self._pause)


class Speculation:
    """One request's drafting: the sequence's tokens so far (indexed), and its draft length."""

    def __init__(self, config: SpecConfig, history: Iterable[int], cost: StepCost):
        self.config = config
        self.index: NgramIndex | None = None  # (a draft model draws from its own context)
        if config.type is not SpecType.DRAFT_SIMPLE:
            self.index = NgramIndex(
                config.size_n, max_tokens=max(HISTORY_TOKENS, 4 * config.size_n)
            )
            self.index.extend(history)
        self.length = DraftLength(config.n_max)
        self.cost = cost

    def drafts(
        self,
        room: int,
        num_generating: int = 1,
        draw: Callable[[int], list[int]] | None = None,
        draw_seconds: float = 0.0,
    ) -> tuple[int, ...]:
        """The drafts to verify after the sequence's last token, at most `room` of them, in a
        step where `num_generating` slots generate; `draw(k)`: a draft model's k guesses, at
        `draw_seconds` each."""
        ratio = self.cost.ratio(num_generating, extra=draw_seconds)
        k = min(self.length.limit(ratio), room, self.config.size_m)
        if k > 1 and self.length.a > ratio:  # (a probe of one draft stays one)
            k = max(1, self.cost.worth(num_generating, self.length.a, k))
        if k < max(1, self.config.n_min):
            return ()
        if self.index is not None:
            min_hits = self.config.min_hits if self.config.type is SpecType.NGRAM_MAP_K else 1
            found = self.index.draft(k, min_hits=min_hits)
        else:
            found = draw(k) if draw is not None else []
        return tuple(found) if len(found) >= self.config.n_min else ()

    def took(self, token: int) -> None:
        """A token the target sampled: the history's newest."""
        if self.index is not None:
            self.index.append(token)

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        self.length.update(num_drafted, num_accepted)
