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
import itertools
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from infer_service.spec.proposer import NO_TOKEN, Proposer

HISTORY_TOKENS = 1 << 16  # a request's history for lookups (its newest tokens)
MAX_DRAFTS = 64  # a step's drafts for one slot at most (slotwise_core.limits.MAX_DRAFTS)


class SpecType(enum.Enum):
    NONE = "none"
    NGRAM_SIMPLE = "ngram-simple"  # the latest earlier occurrence of the last n tokens
    NGRAM_MAP_K = "ngram-map-k"  # the same, once the n-gram occurred min_hits times
    NGRAM_MAP_K4V = "ngram-map-k4v"  # n-grams with up to 4 continuations, the likeliest
    NGRAM_MOD = "ngram-mod"  # a hash of n-grams to their next token, chained (the tenant's)
    NGRAM_CACHE = "ngram-cache"  # n-gram statistics of the request and the tenant's earlier
    SUFFIX = "suffix"  # the tenant's earlier prompts and replies (a suffix cache)
    DRAFT_SIMPLE = "draft-simple"  # a draft model's greedy guesses (--model-draft)
    DRAFT_MTP = "draft-mtp"  # the model's own multi-token-prediction head


# llama-server's order of preference (common_speculative_init): the first type with a draft
# drafts; the suffix cache is slotwise's own and goes after the n-gram types
PRECEDENCE = (
    SpecType.NGRAM_SIMPLE, SpecType.NGRAM_MAP_K, SpecType.NGRAM_MAP_K4V, SpecType.NGRAM_MOD,
    SpecType.NGRAM_CACHE, SpecType.SUFFIX, SpecType.DRAFT_SIMPLE, SpecType.DRAFT_MTP,
)  # fmt: skip
MODEL_TYPES = frozenset({SpecType.DRAFT_SIMPLE, SpecType.DRAFT_MTP})
# llama.cpp's draft types that need a draft model's architecture slotwise cannot run
UNSUPPORTED = ("draft-eagle3", "draft-dflash", "draft-dspark")


def spec_types(text: str) -> tuple[SpecType, ...]:
    """`--spec-type a,b` (llama-server's comma-separated list) in precedence order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name in UNSUPPORTED:
            raise ValueError(
                f"{name} needs a draft model of an architecture slotwise does not run "
                "(README: speculative decoding)"
            )
    kinds = {SpecType(n) for n in names} - {SpecType.NONE}
    return tuple(t for t in PRECEDENCE if t in kinds)


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
    types: tuple[SpecType, ...] = ()  # more types beside `type` (--spec-type a,b)
    mod_n_match: int = 24  # ngram-mod (--spec-ngram-mod-n-match, -n-min, -n-max)
    mod_n_min: int = 48
    mod_n_max: int = 64
    # (benchmarking only: the output is not the model's) the probability that draft i is
    # accepted given the ones before were, whatever the target samples (--spec-synth-rates)
    synth: tuple[float, ...] = ()

    @property
    def kinds(self) -> tuple[SpecType, ...]:
        """Every type asked for, in precedence order."""
        asked = {self.type, *self.types} - {SpecType.NONE}
        return tuple(t for t in PRECEDENCE if t in asked)

    @property
    def enabled(self) -> bool:
        return bool(self.kinds) and self.n_max > 0


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
        best, best_gain, expected = 0, 0.0, 0.0
        for k in range(1, limit + 1):
            expected += acceptance**k
            cost = self.seconds(g + k)
            if cost is None:
                return limit
            gain = per_token * expected - (cost - base)
            if in_place is not None and k > in_place:
                gain -= self._replay(g, base, acceptance, k)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def _replay(self, g: int, base: float, acceptance: float, k: int) -> float:
        """The expected time of decoding again what a rejection among k drafts kept."""
        out = 0.0
        for j in range(k):  # (j drafts accepted, the next rejected)
            step = self.seconds(g + j + 1)
            out += acceptance**j * (1 - acceptance) * ((step or base) - base)
        return out

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


def synth_rates(rates: Sequence[float], length: float | None, n_max: int) -> tuple[float, ...]:
    """llama-server's --spec-synth-rates (per position, non-increasing) or --spec-synth-len
    (a mean acceptance length, the target's token included: geometric rates), as the
    conditional probabilities a draft is accepted given the ones before were (llama.cpp's
    common_speculative_synth_rates_resolve). ValueError as llama.cpp's invalid_argument."""
    if rates and length is not None:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    if not rates and length is None:
        return ()
    if rates:
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values")
        if any(not 0.0 <= r <= 1.0 for r in rates) or any(
            b > a for a, b in itertools.pairwise(rates)
        ):
            raise ValueError("synthetic acceptance rates must be within [0, 1], non-increasing")
        resolved = list(rates)
    else:
        assert length is not None
        if not 1.0 <= length <= n_max + 1:
            raise ValueError(f"synthetic acceptance length must be within [1, {n_max + 1}]")
        p = 1.0 if length == n_max + 1 else _geometric(length - 1.0, n_max)
        resolved = [p ** (i + 1) for i in range(n_max)]
    out, before = [], 1.0
    for rate in resolved:
        out.append(rate / before if before > 0 else 0.0)
        before = rate
    return tuple(out)


def _geometric(expected: float, n: int) -> float:
    """p with p + p^2 + ... + p^n = expected (bisection, as llama.cpp)."""
    lo, hi = 0.0, 1.0
    for _ in range(32):
        mid = (lo + hi) / 2
        if sum(mid ** (j + 1) for j in range(n)) < expected:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2 if expected > 0 else 0.0


class SyntheticAcceptance:
    """A request's draws for --spec-synth-rates: seeded by its sampling seed, so the same
    request drafts and accepts the same."""

    def __init__(self, probs: tuple[float, ...], seed: int | None):
        self.probs = probs
        self.rng = random.Random(seed)

    def accepts(self, i: int) -> bool:
        return self.rng.random() < self.probs[min(i, len(self.probs) - 1)]


class IndexDrafts:
    """ngram-simple and ngram-map-k (prompt lookup) as a Proposer, on the request's index."""

    def __init__(self, index: NgramIndex, name: str, min_hits: int):
        self.index, self.name, self.min_hits = index, name, min_hits

    def append(self, token: int) -> None:
        pass  # (the index is the request's: Speculation feeds it once for both types)

    def propose(self, limit: int) -> list[int]:
        return self.index.draft(limit, min_hits=self.min_hits)

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def close(self) -> None:
        pass


class ModelDrafts:
    """A model's drafts (a draft model's, the MTP head's) as a Proposer: `draw(k)`, set for
    the step by the executor, which holds the model; nothing to learn from the history."""

    def __init__(self, name: str):
        self.name = name
        self.draw: Callable[[int], list[int]] | None = None

    def append(self, token: int) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        return self.draw(limit) if self.draw is not None else []

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def close(self) -> None:
        pass


class Speculation:
    """One request's drafting: a proposer per type asked for (in llama-server's order: the
    first with a draft drafts), the history they see, and the draft length."""

    def __init__(
        self,
        config: SpecConfig,
        history: Iterable[int],
        cost: StepCost,
        make: Callable[[SpecType], Proposer] | None = None,
        prior: float = 0.9,
        seed: int | None = None,
    ):
        """make(type): the proposer of a type that learns across requests (ngram-mod,
        ngram-map-k4v, ngram-cache, suffix: infer_service/spec/proposers.py builds them with
        the tenant's stores)."""
        self.config = config
        self.index: NgramIndex | None = None
        self.proposers: dict[SpecType, Proposer] = {}
        for kind in config.kinds:
            if kind in (SpecType.NGRAM_SIMPLE, SpecType.NGRAM_MAP_K):
                if self.index is None:
                    self.index = NgramIndex(
                        config.size_n, max_tokens=max(HISTORY_TOKENS, 4 * config.size_n)
                    )
                hits = config.min_hits if kind is SpecType.NGRAM_MAP_K else 1
                self.proposers[kind] = IndexDrafts(self.index, kind.value, hits)
            elif kind in MODEL_TYPES:
                self.proposers[kind] = ModelDrafts(kind.value)
            elif make is not None:
                self.proposers[kind] = make(kind)
        for t in history:
            self.took(t)
        # (ngram-mod drafts up to its own n_max: llama-server's --spec-default, 64)
        most = max(config.n_max, config.mod_n_max) if SpecType.NGRAM_MOD in config.kinds else 0
        self.length = DraftLength(min(MAX_DRAFTS, max(config.n_max, most)), prior=prior)
        self.cost = cost
        self.last: Proposer | None = None  # the proposer of the drafts being verified
        self.hits_before = 0
        self.synthetic = SyntheticAcceptance(config.synth, seed) if config.synth else None

    def model(self, kind: SpecType) -> ModelDrafts | None:
        proposer = self.proposers.get(kind)
        return proposer if isinstance(proposer, ModelDrafts) else None

    def drafts(
        self,
        room: int,
        num_generating: int = 1,
        draw_seconds: float = 0.0,
        in_place: int | None = None,
    ) -> tuple[int, ...]:
        """The drafts to verify after the sequence's last token, at most `room` of them, in a
        step where `num_generating` slots generate (a model's drafts cost `draw_seconds`
        each; on hybrid memory, rejected drafts past `in_place` cost a replay)."""
        ratio = self.cost.ratio(num_generating, extra=draw_seconds)
        k = min(self.length.limit(ratio), room, max(self.config.size_m, self.config.mod_n_max))
        if self.synthetic is not None:  # (as llama-server: n_max, whatever the steps cost)
            k = min(room, self.length.n_max)
        elif k > 1 and self.length.a > ratio:  # (a probe of one draft stays one)
            k = max(1, self.cost.worth(num_generating, self.length.a, k, in_place))
        self.last = None
        if k < max(1, self.config.n_min):
            return ()
        for proposer in self.proposers.values():
            hits = getattr(proposer, "hits", 0)
            found = proposer.propose(min(k, self._most(proposer)))
            if found and len(found) >= self.config.n_min:
                self.last, self.hits_before = proposer, hits
                return tuple(found)
        return ()

    def _most(self, proposer: Proposer) -> int:
        """The longest draft a type gives: ngram-mod's own n_max, the others' size_m or the
        request's n_max."""
        if proposer.name == SpecType.NGRAM_MOD.value:
            return self.config.mod_n_max
        return self.config.size_m if proposer.name.startswith("ngram") else self.config.n_max

    def took(self, token: int) -> None:
        """A token the target sampled (or the prompt's): the history's newest."""
        if self.index is not None:
            self.index.append(token)
        for proposer in self.proposers.values():
            proposer.append(token)

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        self.length.update(num_drafted, num_accepted)
        if self.last is not None:
            self.last.verified(num_drafted, num_accepted)

    def cache_hit(self) -> bool:
        """Whether the drafts just verified came from the tenant's earlier requests."""
        return self.last is not None and getattr(self.last, "hits", 0) > self.hits_before

    def close(self) -> None:
        """The request ended: what it gives the tenant's stores is handed over."""
        for proposer in self.proposers.values():
            proposer.close()
