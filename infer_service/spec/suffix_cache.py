"""Drafts from what a tenant's earlier requests said, and from what this request said before
(SuffixDecoding, arXiv 2411.04975; vLLM's `method: "suffix"`, Arctic Inference's suffix tree).
Pure: no llama, no grpc.

An agent loop says the same things again: the same tool call with the same arguments, the same
block of code, the same JSON skeleton, many requests later and in a new conversation, where
the request's own history (`drafting.NgramIndex`) has never seen it. `SuffixCache` keeps one
tenant's earlier requests (each one's prompt and reply, added when it ends) within a byte
budget, the oldest going first; `SuffixCaches` keeps one per tenant within a total, the least
recently used tenant's going first; `SuffixDrafts` is one request's `Proposer`.

What is counted (`_ContextTable`): for every position of the text and every order k of the
ladder 1, 2, 4, ..., max_depth, the token that followed the k tokens before it (its context),
in a dict keyed by the context's polynomial hash. A lookup finds the longest order whose
context ends the history (the longest match), then drafts greedily as SuffixDecoding does:
the token that most often followed the context (ties: the one seen last), while its share of
what followed the context, count(token) / count(context), is at least `min_prob` (where the
text ended or a media chunk came, nothing followed: not counted); the drafted token joins the
context, which climbs to the next order once that one was seen too. A request drafts at
most `spec_factor` times as many tokens as its match was long (a short match is weak evidence).

Why this and not a trie of depth D with a dict per node:
- memory: the trie holds D nodes per token of new text; the ladder holds log2(D) + 1 entries
  (7 for D = 64, about 0.8 KB per token where the trie would take over 7 KB), and a
  context of 2^j tokens tells the continuation apart about as well as one of 2^(j+1) - 1;
- the longest match: the suffixes of the history of lengths m and m - 1 start at different
  tokens, so they lie on different paths of a trie and finding the longest walks it once per
  length, O(D^2); with prefix hashes each length is one dict probe: O(D) to hash the tail,
  O(log D) probes, then O(1) per drafted token (the context's hash slides);
- removal: a context's counts go down when the request that added them is evicted, and an
  entry goes when its count reaches 0, so the memory follows the budget.
Two contexts with one hash (modulus 2^61 - 1) share their counts: a wrong draft, which the
target's verification rejects, never a wrong output, and never another tenant's text (each
tenant has its own table).

Costs (CPython 3.11, one core): `SuffixDrafts.append` is a list append (its own history is
counted at the next `propose`, amortised O(log D) per token: a 10,000-token prompt costs about
80 ms at the first, and its counts about 0.8 KB a token while the request lasts); `propose`
is O(D + drafts) (0.1 ms where both lookups draft 16 tokens, on a busy 2-core machine);
`close` adds the request to the cache in O(n log D) dict updates (about 10 ms per 1,000
tokens at D = 64, and as much again for the requests it evicts). The bytes counted are
estimates measured with tracemalloc: ENTRY_BYTES per context followed by one token,
BRANCH_BYTES + CHILD_BYTES per token for one followed by several, and the text kept for
eviction (4 bytes a token). A request is counted whole before the oldest go, so memory may
pass the budget by one request's worth until `add` returns.
Not locked: the engine's thread only.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from infer_service.spec.proposer import NO_TOKEN

# (about 8 us a token counted, on the engine's thread) a proposal counts at most this much of
# its request's own new text, a step at most WORK_TOKENS of the texts ended requests gave
OWN_TOKENS_PER_PROPOSAL = 256
WORK_TOKENS = 64
MAX_PENDING = 16  # texts waiting to be counted, per tenant
# a request's own history counted (about 0.8 KB a token: 6.5 MB a slot at most), and what it
# gives its tenant's cache
OWN_HISTORY_TOKENS = 1 << 13

MODULUS = (1 << 61) - 1  # a Mersenne prime: contexts collide with odds of about 2^-61
BASE = 0x5BD1E9955BD1E995 % MODULUS

# A context followed by one token: count << TOKEN_BITS | token, a plain int in the table
# (token ids are below 2^32; a media chunk is never counted as what followed).
TOKEN_BITS = 32
TOKEN_MASK = (1 << TOKEN_BITS) - 1
# A token among several after one context: count << STAMP_BITS | stamp (when it last followed),
# so the largest value is the likeliest token, ties going to the one seen last.
STAMP_BITS = 48

# Bytes, measured with tracemalloc on CPython 3.11 (a dict's share of an entry swings with its
# fill; these are its mean, rounded up): a table entry (its 61-bit key, its slot, a packed int)
ENTRY_BYTES = 112
BRANCH_BYTES = 296  # a _Branch and its dict of two, less its two children
CHILD_BYTES = 72  # one more token in a _Branch's dict (its key, its slot, a packed int)
TOKEN_BYTES = 4  # the text kept to uncount it on eviction (an array of int32)
REQUEST_BYTES = 96  # that array's header and its place in the queue


class Draft(NamedTuple):
    tokens: list[int]
    score: float  # the tokens expected to be accepted: the sum of their paths' probabilities


class SuffixCache:
    """One tenant's earlier requests, counted for drafting, within `max_bytes`: past it, the
    oldest requests' counts go first. `on_added` hears each add (the registry's budget)."""

    def __init__(
        self,
        max_bytes: int = 64 << 20,
        *,
        max_depth: int = 64,
        on_added: Callable[[], None] | None = None,
    ):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self._table = _ContextTable(max_depth)
        self._requests: deque[array[int]] = deque()  # oldest first
        self._pending: deque[_Pending] = deque()  # enqueued, counted a slice at a time
        self._num_text_bytes = 0
        self._on_added = on_added
        self.retired = False  # dropped by its registry: what in-flight requests add is ignored

    @property
    def num_bytes(self) -> int:
        return self._table.num_bytes + self._num_text_bytes

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_contexts(self) -> int:
        return len(self._table)

    def add(self, tokens: Sequence[int]) -> None:
        """One request's text (prompt and reply); the oldest requests go past the budget. One
        longer than the budget could hold keeps its newest tokens."""
        if self.retired:
            return
        text = self._kept(tokens)
        if text is not None:
            self._table.count(text, _prefix_hashes(text))
            self._kept_whole(text)

    def enqueue(self, tokens: Sequence[int]) -> None:
        """A request's text, to be counted a slice at a time by `work` (counting costs about
        8 us a token: the engine's thread spends a bounded slice of each step on it). At most
        MAX_PENDING texts wait; past that the oldest not yet begun goes."""
        if self.retired:
            return
        text = self._kept(tokens)
        if text is None:
            return
        if len(self._pending) >= MAX_PENDING:
            del self._pending[1]  # (the first may be half counted: it is finished)
        self._pending.append(_Pending(text, [0], 1, self._table.reserve(len(text))))

    def work(self, max_tokens: int) -> int:
        """Count up to `max_tokens` of the enqueued texts, oldest first; returns how many."""
        num_done = 0
        while self._pending and num_done < max_tokens and not self.retired:
            p = self._pending[0]
            stop = min(len(p.text), p.next + max_tokens - num_done)
            _extend_hashes(p.hashes, p.text, stop)
            self._table.count(p.text, p.hashes, start=p.next, stop=stop, base=p.base)
            num_done, p.next = num_done + stop - p.next, stop
            if p.next == len(p.text):
                self._pending.popleft()
                self._kept_whole(p.text)
        return num_done

    @property
    def num_pending(self) -> int:
        return sum(len(p.text) - p.next for p in self._pending)

    def _kept(self, tokens: Sequence[int]) -> array[int] | None:
        """The newest tokens of a text that the budget could hold (None: too few)."""
        per_token = TOKEN_BYTES + len(self._table.orders) * ENTRY_BYTES
        num_kept = min(len(tokens), (self.max_bytes - REQUEST_BYTES) // per_token)
        if num_kept < 2:  # (nothing follows a context in a single token)
            return None
        return array("i", tokens[len(tokens) - num_kept :])

    def _kept_whole(self, text: array[int]) -> None:
        """A text counted whole: kept for its eviction; the oldest go past the budget."""
        self._requests.append(text)
        self._num_text_bytes += _text_bytes(text)
        while self.num_bytes > self.max_bytes and self._requests:
            self._evict_oldest()
        if self._on_added is not None:
            self._on_added()

    def _evict_oldest(self) -> None:
        text = self._requests.popleft()
        self._num_text_bytes -= _text_bytes(text)
        self._table.uncount(text, _prefix_hashes(text))

    def clear(self) -> None:
        self._table = _ContextTable(self.max_depth)
        self._requests.clear()
        self._pending.clear()
        self._num_text_bytes = 0

    def retire(self) -> None:
        self.clear()
        self.retired = True

    def propose(
        self, history: Sequence[int], limit: int, *, min_prob: float = 0.1, spec_factor: float = 1.0
    ) -> Draft:
        """At most `limit` tokens expected after `history` (its last max_depth tokens after its
        last media chunk), and how many of them are expected to be accepted."""
        window = _Window(history, self.max_depth)
        return self._table.draft(window, limit, min_prob=min_prob, spec_factor=spec_factor)


def _text_bytes(text: array[int]) -> int:
    return REQUEST_BYTES + TOKEN_BYTES * len(text)


class SuffixCaches:
    """Every tenant's `SuffixCache`, within `max_bytes` in all: each tenant's within
    `max_bytes_per_tenant`, and past the total the least recently used tenant's goes whole (a
    tenant is used when a request of its starts or ends)."""

    def __init__(
        self,
        max_bytes: int = 1 << 30,
        *,
        max_bytes_per_tenant: int = 64 << 20,
        max_depth: int = 64,
    ):
        self.max_bytes = max_bytes
        self.max_bytes_per_tenant = min(max_bytes_per_tenant, max_bytes)
        self.max_depth = max_depth
        self._caches: OrderedDict[str, SuffixCache] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._caches)

    @property
    def num_bytes(self) -> int:
        return sum(cache.num_bytes for cache in self._caches.values())

    def for_tenant(self, tenant: str) -> SuffixCache:
        cache = self._caches.get(tenant)
        if cache is None:
            cache = SuffixCache(
                self.max_bytes_per_tenant,
                max_depth=self.max_depth,
                on_added=functools.partial(self._added, tenant),
            )
            self._caches[tenant] = cache
        self._caches.move_to_end(tenant)
        return cache

    def work(self, max_tokens: int) -> int:
        """Count up to `max_tokens` of what ended requests gave, the least recently used
        tenant's first."""
        num_done = 0
        for cache in list(self._caches.values()):
            if num_done >= max_tokens:
                break
            num_done += cache.work(max_tokens - num_done)
        return num_done

    def drop_pending(self) -> None:
        """Forget every text not yet counted (what a failed count leaves half done goes too:
        its tenant's cache starts again empty)."""
        for tenant, cache in list(self._caches.items()):
            if cache._pending:
                cache.retire()
                del self._caches[tenant]

    def _added(self, tenant: str) -> None:
        self._caches.move_to_end(tenant)
        num_bytes = self.num_bytes
        while num_bytes > self.max_bytes:  # (the tenant just used is last: it fits alone)
            _, dropped = self._caches.popitem(last=False)
            num_bytes -= dropped.num_bytes
            dropped.retire()


class SuffixDrafts:
    """One request's drafts: from its tenant's cache (what earlier requests said) or from its
    own history (what it said before: SuffixDecoding's per-request tree), whichever expects
    more accepted tokens (ties: its own). Its history (the newest `max_tokens` tokens) goes to
    the cache when it ends. `hits`: proposals that returned the cache's drafts."""

    name = "suffix"

    def __init__(
        self,
        cache: SuffixCache,
        *,
        min_prob: float = 0.1,
        spec_factor: float = 1.0,
        max_tokens: int = OWN_HISTORY_TOKENS,
    ):
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.cache = cache
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.max_tokens = max_tokens
        self.hits = 0
        self._tokens: list[int] = []
        self._own = _ContextTable(cache.max_depth)
        self._hashes = [0]  # prefix hashes of the tokens counted in _own
        self._num_counted = 1  # tokens counted as what followed their contexts (not the first)
        self._closed = False

    def append(self, token: int) -> None:
        if len(self._tokens) >= self.max_tokens:
            self._keep_newer_half()
        self._tokens.append(token)

    def _keep_newer_half(self) -> None:
        """Amortised over as many appends: the own counts start again at the next propose."""
        del self._tokens[: len(self._tokens) // 2]
        self._own = _ContextTable(self.cache.max_depth)
        self._hashes = [0]
        self._num_counted = 1

    def propose(self, limit: int) -> list[int]:
        if limit <= 0 or self._closed:
            return []
        self._count_own_history()
        window = _Window(self._tokens, self.cache.max_depth)  # (hashed once for both lookups)
        own = self._own.draft(window, limit, min_prob=self.min_prob, spec_factor=self.spec_factor)
        shared = self.cache._table.draft(  # (the window is this module's: no public way)
            window, limit, min_prob=self.min_prob, spec_factor=self.spec_factor
        )
        if shared.score > own.score:
            self.hits += 1
            return shared.tokens
        return own.tokens

    def _count_own_history(self) -> None:
        """Count what came since the last proposal (deferred so that `append` stays O(1)),
        at most OWN_TOKENS_PER_PROPOSAL of it: a long prompt is counted over several steps,
        never in one (about 8 us a token, on the engine's thread)."""
        stop = min(len(self._tokens), self._num_counted + OWN_TOKENS_PER_PROPOSAL)
        _extend_hashes(self._hashes, self._tokens, stop)
        self._own.count(self._tokens, self._hashes, start=self._num_counted, stop=stop)
        self._num_counted = max(1, stop)

    def verified(self, num_drafted: int, num_accepted: int) -> None:
        """(Nothing to learn: the executor's draft length follows acceptance.)"""

    def close(self) -> None:
        """Give the cache this request's history, once."""
        if self._closed:
            return
        self._closed = True
        self.cache.enqueue(self._tokens)
        self._tokens, self._hashes = [], [0]
        self._own = _ContextTable(self.cache.max_depth)


@dataclass
class _Pending:
    """A text enqueued: its prefix hashes so far, where counting goes on, its first stamp."""

    text: array[int]
    hashes: list[int]
    next: int
    base: int


class _Branch:
    """A context that more than one token followed: each one's count and stamp, packed."""

    __slots__ = ("best", "counts", "total")

    def __init__(self, single: int):
        token = single & TOKEN_MASK
        # stamp 0: this token last followed before any other did (it was the single one)
        self.counts = {token: (single >> TOKEN_BITS) << STAMP_BITS}
        self.total = single >> TOKEN_BITS
        self.best = token

    def add(self, token: int, stamp: int) -> bool:
        """One more occurrence (the newest); True if the token is new here."""
        old = self.counts.get(token, 0)
        new = ((old >> STAMP_BITS) + 1) << STAMP_BITS | stamp
        self.counts[token] = new
        self.total += 1
        if new > self.counts[self.best]:  # (a tie in count: the newest stamp wins)
            self.best = token
        return old == 0

    def remove(self, token: int) -> bool:
        """One occurrence less, the oldest: the token's stamp, its newest, stays right. True if
        the token is gone."""
        left = self.counts[token] - (1 << STAMP_BITS)
        self.total -= 1
        gone = left >> STAMP_BITS == 0
        if gone:
            del self.counts[token]
        else:
            self.counts[token] = left
        if token == self.best:
            self.best = max(self.counts, key=self.counts.__getitem__)
        return gone


class _ContextTable:
    """For each context of the orders 1, 2, 4, ..., max_depth (keyed by its hash), which tokens
    followed it and how often: a packed int if one token did, a _Branch if several did."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.orders = _orders(max_depth)
        self._next_order = dict(zip(self.orders, self.orders[1:], strict=False))
        self._powers = _powers(max_depth)
        self._entries: dict[int, int | _Branch] = {}
        self._num_stamped = 0  # positions counted so far (a position's stamp: later, larger)
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def count(
        self,
        tokens: Sequence[int],
        hashes: list[int],
        start: int = 1,
        stop: int | None = None,
        base: int | None = None,
    ) -> None:
        """Count what followed each context, for the tokens from `start` to `stop` (hashes
        known that far). `base`: the stamp of the text's first token, reserved (`reserve`)
        when the text is counted a slice at a time; None: the next stamps."""
        stop = len(tokens) if stop is None else stop
        first = self._num_stamped if base is None else base
        for key, token, position in self._pairs(tokens, hashes, start, stop):
            self._increment(key, token, first + position)
        if base is None:
            self._num_stamped += len(tokens)

    def reserve(self, num_tokens: int) -> int:
        """Stamps for a text counted later: later texts stamp as newer."""
        first, self._num_stamped = self._num_stamped, self._num_stamped + num_tokens
        return first

    def uncount(self, tokens: Sequence[int], hashes: list[int]) -> None:
        """Undo `count` of the same tokens (eviction: they were the oldest counted)."""
        for key, token, _ in self._pairs(tokens, hashes, 1, len(tokens)):
            self._decrement(key, token)

    def _pairs(
        self, tokens: Sequence[int], hashes: list[int], start: int, stop: int
    ) -> Iterator[tuple[int, int, int]]:
        """(the context's key, the token after it, its position) for each position from
        `start` and each order whose context holds no media chunk."""
        powers = self._powers
        clean_from = _media_free_start(tokens, start - 1, self.max_depth)
        for i in range(start, stop):
            if tokens[i - 1] == NO_TOKEN:
                clean_from = i
            token = tokens[i]
            if token == NO_TOKEN:
                continue
            for n in self.orders:
                if i - n < clean_from:
                    break
                yield (hashes[i] - hashes[i - n] * powers[n]) % MODULUS, token, i

    def _increment(self, key: int, token: int, stamp: int) -> None:
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = 1 << TOKEN_BITS | token
            self.num_bytes += ENTRY_BYTES
        elif isinstance(entry, _Branch):
            if entry.add(token, stamp):
                self.num_bytes += CHILD_BYTES
        elif entry & TOKEN_MASK == token:
            self._entries[key] = entry + (1 << TOKEN_BITS)
        else:
            branch = self._entries[key] = _Branch(entry)
            branch.add(token, stamp)
            self.num_bytes += BRANCH_BYTES + 2 * CHILD_BYTES

    def _decrement(self, key: int, token: int) -> None:
        entry = self._entries[key]
        if not isinstance(entry, _Branch):
            if entry >> TOKEN_BITS == 1:
                del self._entries[key]
                self.num_bytes -= ENTRY_BYTES
            else:
                self._entries[key] = entry - (1 << TOKEN_BITS)
            return
        if entry.remove(token):
            self.num_bytes -= CHILD_BYTES
        if len(entry.counts) == 1:  # one token left: a packed int again, as if never branched
            self._entries[key] = entry.total << TOKEN_BITS | entry.best
            self.num_bytes -= BRANCH_BYTES + CHILD_BYTES

    def draft(self, window: _Window, limit: int, *, min_prob: float, spec_factor: float) -> Draft:
        """SuffixDecoding's greedy path from the longest match of the window's tail (the
        window is as it was when this returns)."""
        if limit <= 0:
            return Draft([], 0.0)
        order = self._longest_order(window)
        if order == 0:
            return Draft([], 0.0)
        num_wanted = min(limit, max(1, math.floor(spec_factor * order)))
        tokens: list[int] = []
        score, reach = 0.0, 1.0
        while len(tokens) < num_wanted:
            entry = self._entries.get(window.key_of_last(order))
            if entry is None:  # (the context was seen, but only where nothing followed it)
                break
            token, prob = _likeliest(entry)
            if prob < min_prob:
                break
            reach *= prob
            score += reach
            tokens.append(token)
            window.append(token)
            order = self._climbed(window, order)
        window.truncate(len(window) - len(tokens))
        return Draft(tokens, score)

    def _longest_order(self, window: _Window) -> int:
        for n in reversed(self.orders):
            if n <= len(window) and window.key_of_last(n) in self._entries:
                return n
        return 0

    def _climbed(self, window: _Window, order: int) -> int:
        """The next order up, once the context with the drafts is that long and was seen."""
        up = self._next_order.get(order)
        if up is not None and up <= len(window) and window.key_of_last(up) in self._entries:
            return up
        return order


def _likeliest(entry: int | _Branch) -> tuple[int, float]:
    if isinstance(entry, _Branch):
        return entry.best, (entry.counts[entry.best] >> STAMP_BITS) / entry.total
    return entry & TOKEN_MASK, 1.0


class _Window:
    """The history's last tokens after its last media chunk, then the drafts, with prefix
    hashes: the key of its last n tokens costs O(1)."""

    def __init__(self, history: Sequence[int], max_depth: int):
        start = _media_free_start(history, len(history), max_depth)
        self._tokens = list(history[start:])
        self._hashes = _prefix_hashes(self._tokens)
        self._powers = _powers(max_depth)

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        self._tokens.append(token)
        self._hashes.append((self._hashes[-1] * BASE + token + 2) % MODULUS)

    def truncate(self, length: int) -> None:
        del self._tokens[length:]
        del self._hashes[length + 1 :]

    def key_of_last(self, n: int) -> int:
        return (self._hashes[-1] - self._hashes[-1 - n] * self._powers[n]) % MODULUS


def _media_free_start(tokens: Sequence[int], end: int, depth: int) -> int:
    """Where the run of at most `depth` tokens without media that ends before `end` starts."""
    floor = max(0, end - depth)
    for i in range(end - 1, floor - 1, -1):
        if tokens[i] == NO_TOKEN:
            return i + 1
    return floor


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    hashes = [0]
    _extend_hashes(hashes, tokens)
    return hashes


def _extend_hashes(hashes: list[int], tokens: Sequence[int], stop: int | None = None) -> None:
    """Hashes of every prefix of `tokens` (up to `stop` tokens), extended from those `hashes`
    has. A token t is the digit t + 2 (a media chunk 1): no digit is 0, so contexts of
    different lengths differ."""
    h = hashes[-1]
    for i in range(len(hashes) - 1, len(tokens) if stop is None else stop):
        h = (h * BASE + tokens[i] + 2) % MODULUS
        hashes.append(h)


def _orders(max_depth: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_depth, and max_depth itself."""
    orders = [1 << j for j in range(max_depth.bit_length()) if 1 << j < max_depth]
    return (*orders, max_depth)


@functools.cache
def _powers(max_depth: int) -> tuple[int, ...]:
    powers = [1]
    for _ in range(max_depth):
        powers.append(powers[-1] * BASE % MODULUS)
    return tuple(powers)
