"""How many drafts a slot verifies: as many as pay their way. `StepCost` measures what a step
of each size costs on this machine, from the engine's own steps; `DraftLength` keeps a slot's
acceptance per position and weighs one against the other, so free text (where a lookup rarely
matches, and a match is rarely right) stays as fast as without drafts. Pure."""

from __future__ import annotations

import math

SLOPE_MIN_CELLS = 16


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
        line = self.line()
        return None if line is None else line[0] + line[1] * num_tokens

    def estimate(self, num_tokens: int) -> float | None:
        """What a step of `num_tokens` costs, erring long: measured at its size bucket, else a
        one-token step plus the steepest cost per token measured over it (a prompt's tokens
        deep in a long context cost more than a large step's near its start: a line, or
        steps between two sizes measured, would promise a step it does not keep); None
        before a one-token step was measured."""
        if num_tokens <= 0:
            return 0.0
        measured = self._by_size.get(_bucket(num_tokens))
        one = self._by_size.get(1)
        if measured is not None or one is None:
            return measured
        # (a few cells over a one-token step make a slope of noise: from 16 cells up, where any)
        sizes = [n for n in self._by_size if n >= SLOPE_MIN_CELLS] or [
            n for n in self._by_size if n > 1
        ]
        slope = max(((self._by_size[n] - one) / (n - 1) for n in sizes), default=None)
        return None if slope is None else one + max(0.0, slope) * (num_tokens - 1)

    def line(self) -> tuple[float, float] | None:
        """(t0, c): a step of n tokens takes about t0 + c*n."""
        if self._n is None or self._t is None or self._nn is None or self._nt is None:
            return None
        spread = self._nn - self._n * self._n
        if spread < 0.25:
            return None
        c = max(0.0, (self._nt - self._n * self._t) / spread)
        return max(0.0, self._t - c * self._n), c

    def worth(
        self, num_generating: int, acceptance: float, limit: int, in_place: int | None = None
    ) -> int:
        """The draft length, at most `limit`, whose expected tokens pay most for the time it
        adds to the step: a slot among g that generate saves (step of g)/g per accepted draft
        (the j-th lands with probability a^j) and adds T(g + k) - T(g). (Hybrid memory) a
        draft longer than `in_place` is taken back from a checkpoint: a rejection after j
        accepted drafts decodes those j and the token before them again next step, which
        costs what j + 1 more tokens add to a step."""
        g = max(1, num_generating)
        base = self.seconds(g)
        if base is None or limit <= 0:
            return limit
        per_token = base / g
        best, best_gain, expected, replay = 0, 0.0, 0.0, 0.0
        for k in range(1, limit + 1):
            cost = self.seconds(g + k)
            if cost is None:
                return limit
            # (k - 1 drafts accepted, the k-th rejected: k tokens decoded again next step)
            replay += acceptance ** (k - 1) * (1 - acceptance) * (cost - base)
            expected += acceptance**k
            gain = per_token * expected - (cost - base)
            if in_place is not None and k > in_place:
                gain -= replay
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def ratio(self, num_generating: int = 1, extra: float = 0.0) -> float:
        """(c + extra) / ((t0 + c*g) / g): a draft's cost (and `extra` seconds of drafting it)
        over the token it may save."""
        if self._t is None:
            return self.prior
        line = self.line()
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
