"""A request's drafting (`Speculation`): a proposer per draft type it asks for, tried in
llama-server's order, the history they see, and how many drafts a slot verifies
(infer_service/spec/length.py). Here too the n-gram lookup of ngram-simple and ngram-map-k.
Pure: no llama, no grpc.

Edit this file, fix this JSON, answer quoting this document, call a tool with the arguments
just read: most of such a reply is already in the context, and a draft of it costs one
position per token in a batch the step decodes anyway. Each drafted token is checked against
the target's own sample at its position, so the output is what it would have been; a miss
costs the cells of the drafts after it, which the ledger gives back.

`NgramIndex` keeps, per n-gram of the history, where it last ended (and, for `ngram-map-k`,
how often it occurred): a lookup is a dict access, not a scan. The history is bounded: past
`max_tokens` its older half goes and the index is rebuilt (amortised over as many appends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from infer_service.spec.config import HISTORY_TOKENS, MAX_DRAFTS, MODEL_TYPES, SpecConfig, SpecType
from infer_service.spec.length import DraftLength, StepCost
from infer_service.spec.proposer import NO_TOKEN, Proposer
from infer_service.spec.synthetic import SyntheticAcceptance


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
