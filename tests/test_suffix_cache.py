"""The cross-request suffix cache (pure): its drafts equal a brute-force scan of the requests it
keeps, its budgets hold and its bytes are counted exactly, the oldest request goes first, no
tenant drafts another tenant's text, and a repeated tool call is drafted whole."""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.spec.proposer import NO_TOKEN
from infer_service.spec.suffix_cache import SuffixCache, SuffixCaches, SuffixDrafts

# a reference ---------------------------------------------------------------------------------


def ladder(max_depth: int) -> list[int]:
    return [*(n for n in (1, 2, 4, 8, 16, 32, 64) if n < max_depth), max_depth]


def followers(texts: list[list[int]], context: list[int]) -> dict[int, tuple[int, int]]:
    """Each token that followed `context` in `texts`: how often, and when it last did."""
    found: dict[int, tuple[int, int]] = {}
    n, offset = len(context), 0
    for text in texts:
        for i in range(n, len(text)):
            if text[i] != NO_TOKEN and text[i - n : i] == context:
                found[text[i]] = (found.get(text[i], (0, 0))[0] + 1, offset + i)
        offset += len(text)
    return found


def reference(
    texts: list[list[int]],
    history: list[int],
    limit: int,
    max_depth: int,
    min_prob: float = 0.1,
    spec_factor: float = 1.0,
) -> tuple[list[int], float]:
    """The greedy path from the longest ladder order that ends the history, by scanning."""
    window = history[max(0, len(history) - max_depth) :]
    if NO_TOKEN in window:
        window = window[len(window) - window[::-1].index(NO_TOKEN) :]
    orders = ladder(max_depth)
    seen = [n for n in orders if n <= len(window) and followers(texts, window[-n:])]
    if not seen or limit <= 0:
        return [], 0.0
    order = seen[-1]
    num_wanted = min(limit, max(1, math.floor(spec_factor * order)))  # (the match's, not climbed)
    drafts: list[int] = []
    score, reach = 0.0, 1.0
    while len(drafts) < num_wanted:
        found = followers(texts, window[-order:])
        if not found:
            break
        token = max(found, key=found.__getitem__)  # the most frequent, then the latest
        prob = found[token][0] / sum(count for count, _ in found.values())
        if prob < min_prob:
            break
        reach *= prob
        score += reach
        drafts.append(token)
        window.append(token)
        up = orders[orders.index(order) + 1] if order != orders[-1] else None
        if up is not None and up <= len(window) and followers(texts, window[-up:]):
            order = up
    return drafts, score


def kept(added: list[list[int]], cache: SuffixCache) -> list[list[int]]:
    """The requests a cache still holds: the newest (a request of under 2 tokens is none)."""
    stored = [text for text in added if len(text) >= 2]
    return stored[len(stored) - cache.num_requests :]


tokens_and_media = st.lists(st.integers(-1, 3), max_size=30)

# drafts --------------------------------------------------------------------------------------


@given(
    st.lists(tokens_and_media, max_size=6),
    st.integers(1, 12),
    st.integers(17_000, 60_000),  # (room for a whole request: none is cut, many are evicted)
    st.lists(st.tuples(tokens_and_media, st.integers(0, 12)), min_size=1, max_size=5),
    st.sampled_from([0.0, 0.1, 0.4]),
    st.sampled_from([0.5, 1.0, 4.0]),
)
@settings(max_examples=300, deadline=None)
def test_the_cache_drafts_what_a_scan_of_its_requests_finds(
    added, max_depth, max_bytes, queries, min_prob, spec_factor
) -> None:
    cache = SuffixCache(max_bytes, max_depth=max_depth)
    for text in added:
        cache.add(text)
    texts = kept(added, cache)
    # random histories, and every context the cache holds (each prefix of what it kept)
    prefixes = [(text[:i], queries[0][1]) for text in texts for i in range(len(text))]
    for history, limit in [*queries, *prefixes]:
        draft = cache.propose(history, limit, min_prob=min_prob, spec_factor=spec_factor)
        expected = reference(texts, history, limit, max_depth, min_prob, spec_factor)
        assert (draft.tokens, draft.score) == expected


@given(
    st.lists(tokens_and_media, max_size=4),
    st.lists(st.tuples(st.lists(st.integers(-1, 3), max_size=12), st.integers(0, 8)), max_size=8),
    st.integers(1, 9),
    st.integers(16, 40),
)
@settings(max_examples=300, deadline=None)
def test_a_request_drafts_the_likelier_of_its_own_history_and_the_cache(
    added, steps, max_depth, max_tokens
) -> None:
    cache = SuffixCache(1 << 30, max_depth=max_depth)
    for text in added:
        cache.add(text)
    drafts = SuffixDrafts(cache, max_tokens=max_tokens)
    history: list[int] = []
    num_hits = 0
    for tokens, limit in steps:
        for t in tokens:
            drafts.append(t)
            if len(history) >= max_tokens:  # (the drafter keeps its newer half)
                del history[: len(history) // 2]
            history.append(t)
        own = reference([history], history, limit, max_depth)
        shared = reference(kept(added, cache), history, limit, max_depth)
        expected = shared[0] if shared[1] > own[1] else own[0]
        num_hits += shared[1] > own[1]
        proposed = drafts.propose(limit)
        assert proposed == expected
        assert len(proposed) <= limit and NO_TOKEN not in proposed
    assert drafts.hits == num_hits


def test_a_repeated_tool_call_is_drafted_whole_on_the_next_request() -> None:
    caches = SuffixCaches()
    system = list(range(100, 180))
    header = [7, 8, 9]  # the chat template's turn for the model
    call = list(range(1000, 1040))  # {"name": "edit_file", "arguments": {...}}
    end = 2
    reply = [*call, end]

    first = SuffixDrafts(caches.for_tenant("acme"))
    prompt = [*system, 11, 12, 13, *header]
    for t in [*prompt, *reply]:
        first.append(t)
        first.propose(8)
    first.close()
    # (counted later: what followed each token, the first none)
    assert caches.for_tenant("acme").num_pending == len(prompt) + len(reply) - 1
    caches.work(1 << 20)  # (the engine's steps, a slice each)
    assert first.hits == 0  # (nothing earlier to draft from)

    # the same turn again: the whole call at once
    cache = caches.for_tenant("acme")
    assert cache.propose(prompt, 64, spec_factor=64).tokens == reply

    # a new conversation calls the tool again: every token is drafted but the target's own
    second = SuffixDrafts(cache)
    for t in [*range(300, 330), 21, 22, *header]:
        second.append(t)
    done, num_steps = 0, 0
    while done < len(reply):
        drafted = second.propose(8)
        assert drafted and drafted == reply[done : done + len(drafted)]
        for t in [*drafted, *reply[done + len(drafted) : done + len(drafted) + 1]]:
            second.append(t)  # the drafts, all accepted, then the target's token
        done += len(drafted) + 1
        num_steps += 1
    assert num_steps <= 8 and second.hits == num_steps

    # another tenant with the same prompt: nothing
    other = SuffixDrafts(caches.for_tenant("globex"))
    for t in prompt:
        other.append(t)
    assert other.propose(8) == [] and other.hits == 0


@given(
    st.lists(st.lists(st.integers(-1, 4), max_size=40), max_size=8),
    st.lists(st.integers(-1, 4), max_size=40),
    st.integers(0, 20),
)
@settings(max_examples=200, deadline=None)
def test_drafts_never_hold_media_nor_pass_the_limit(added, history, limit) -> None:
    cache = SuffixCache(max_depth=8)
    for text in added:
        cache.add(text)
    drafts = SuffixDrafts(cache)
    for t in history:
        drafts.append(t)
        proposed = drafts.propose(limit)
        assert len(proposed) <= limit and NO_TOKEN not in proposed


def test_media_is_never_matched_across() -> None:
    cache = SuffixCache(max_depth=8)
    cache.add([5, 6, NO_TOKEN, 7, 8])
    assert cache.propose([5, 6], 4).tokens == []  # (what followed 5, 6 was a media chunk)
    assert cache.propose([1, NO_TOKEN, 7], 4).tokens == [8]
    assert cache.propose([6, NO_TOKEN], 4).tokens == []  # (the history ends in media)


# budgets -------------------------------------------------------------------------------------


@given(
    st.lists(st.lists(st.integers(-1, 6), max_size=60), max_size=30),
    st.integers(0, 40_000),
    st.integers(1, 16),
)
@settings(max_examples=200, deadline=None)
def test_the_budget_holds_and_the_bytes_are_those_of_the_requests_kept(
    added, max_bytes, max_depth
) -> None:
    cache = SuffixCache(max_bytes, max_depth=max_depth)
    for text in added:
        cache.add(text)
        assert cache.num_bytes <= max_bytes
    # counting is exact: a cache given only what this one kept is this one, byte for byte
    fresh = SuffixCache(1 << 30, max_depth=max_depth)
    num_kept = (max_bytes - 96) // (4 + len(ladder(max_depth)) * 112)
    for text in kept(added, cache):
        fresh.add(text[max(0, len(text) - num_kept) :])
    assert (fresh.num_bytes, fresh.num_contexts) == (cache.num_bytes, cache.num_contexts)
    while cache.num_requests:
        cache._evict_oldest()
    assert (cache.num_bytes, cache.num_contexts) == (0, 0)


@given(
    st.lists(st.tuples(st.sampled_from("abcde"), st.lists(st.integers(0, 50), max_size=80))),
    st.integers(0, 200_000),
    st.integers(0, 100_000),
)
@settings(max_examples=200, deadline=None)
def test_the_registry_holds_its_total_and_each_tenants_share(
    requests, max_bytes, max_bytes_per_tenant
) -> None:
    caches = SuffixCaches(max_bytes, max_bytes_per_tenant=max_bytes_per_tenant, max_depth=16)
    for tenant, text in requests:
        drafts = SuffixDrafts(caches.for_tenant(tenant))
        for t in text:
            drafts.append(t)
        drafts.close()
        caches.work(1 << 20)
        assert caches.num_bytes <= max_bytes
        assert caches.for_tenant(tenant).num_bytes <= min(max_bytes, max_bytes_per_tenant)


def test_eviction_forgets_the_oldest_request() -> None:
    texts = [[1, 2, *range(10 * k, 10 * k + 8)] for k in range(1, 4)]  # 1, 2, then its own
    measure = SuffixCache(1 << 30, max_depth=8)
    for text in texts[1:]:
        measure.add(text)
    cache = SuffixCache(measure.num_bytes, max_depth=8)  # room for two of them
    cache.add(texts[0])
    cache.add(texts[1])
    assert cache.propose([1, 2, 10], 8, spec_factor=8).tokens == texts[0][3:]
    cache.add(texts[2])
    assert cache.num_requests == 2
    assert cache.propose([1, 2, 10], 8, spec_factor=8).tokens == []  # the first is gone
    assert cache.propose([1, 2, 20], 8, spec_factor=8).tokens == texts[1][3:]
    assert cache.propose([1, 2], 8).tokens == [30, 31]  # (20 and 30 once each: the newest)


def test_the_bytes_counted_are_near_what_python_allocates() -> None:
    rng = random.Random(7)
    for vocab in (20, 50_000):
        text = [rng.randrange(vocab) for _ in range(4000)]
        gc.collect()
        tracemalloc.start()
        cache = SuffixCache(1 << 30)
        cache.add(text)
        measured, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert 0.8 < cache.num_bytes / measured < 1.25


# tenants -------------------------------------------------------------------------------------


@given(
    st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=40)), max_size=12),
    st.lists(st.lists(st.integers(0, 3), max_size=20), min_size=1, max_size=6),
    st.integers(20_000, 400_000),
)
@settings(max_examples=200, deadline=None)
def test_no_tenant_drafts_from_another_tenants_text(requests, queries, max_bytes) -> None:
    """A says tokens 0-3, B says 10-13: a draft holding the other's tokens came from its text."""
    caches = SuffixCaches(max_bytes, max_bytes_per_tenant=max_bytes // 2, max_depth=8)
    alphabet = {"A": range(0, 4), "B": range(10, 14)}
    for is_b, text in requests:
        tenant = "B" if is_b else "A"
        drafts = SuffixDrafts(caches.for_tenant(tenant))
        for t in text:
            drafts.append(t + (10 if is_b else 0))
        drafts.close()
        caches.work(1 << 20)
    for query in queries:
        for tenant, offset in (("A", 10), ("B", 0), ("B", 10), ("A", 0)):
            history = [t + offset for t in query]  # (also the other's text, word for word)
            drafted = caches.for_tenant(tenant).propose(history, 16, min_prob=0.0).tokens
            assert all(t in alphabet[tenant] for t in drafted)


def test_the_least_recently_used_tenant_goes_first() -> None:
    text = list(range(200, 260))
    measure = SuffixCache(1 << 30)
    measure.add(text)
    caches = SuffixCaches(2 * measure.num_bytes, max_bytes_per_tenant=1 << 30)  # (two fit)
    a, b = caches.for_tenant("a"), caches.for_tenant("b")
    a.add(text)
    b.add(text)
    caches.for_tenant("a")  # a request of a's starts: b is now the least recently used
    caches.for_tenant("c").add(text)
    assert len(caches) == 2 and b.num_requests == 0 and b.retired
    assert a.num_requests == 1 and caches.for_tenant("a") is a
    b.add(text)  # a request of b's that was in flight ends: its text goes nowhere
    assert b.num_bytes == 0
    fresh_b = caches.for_tenant("b")  # b comes back: an empty cache
    assert fresh_b is not b and fresh_b.num_requests == 0
    assert caches.num_bytes <= caches.max_bytes


def test_a_request_gives_its_history_to_the_cache_once() -> None:
    cache = SuffixCache()
    drafts = SuffixDrafts(cache)
    for t in range(50):
        drafts.append(t)
    drafts.close()
    while cache.work(7):  # (a slice at a time, as the engine's steps count it)
        pass
    num_bytes = cache.num_bytes
    drafts.close()
    assert cache.work(1 << 20) == 0
    assert cache.num_requests == 1 and cache.num_bytes == num_bytes > 0
    assert drafts.propose(4) == []


def test_a_long_history_is_counted_a_slice_a_proposal() -> None:
    """Counting costs about 8 us a token on the engine's thread: a proposal counts at most
    OWN_TOKENS_PER_PROPOSAL new tokens of its own history, an ended request's text goes in a
    slice per `work` call, and what the slices counted drafts as a whole count would."""
    from infer_service.spec.suffix_cache import OWN_TOKENS_PER_PROPOSAL

    cache = SuffixCache()
    drafts = SuffixDrafts(cache)
    text = [t % 50 for t in range(5 * OWN_TOKENS_PER_PROPOSAL)]
    for t in text:
        drafts.append(t)
    drafts.propose(4)
    assert drafts._num_counted == OWN_TOKENS_PER_PROPOSAL + 1
    drafts.close()
    slices = 0
    while cache.work(100):
        slices += 1
    assert slices == -(-(len(text) - 1) // 100)
    whole = SuffixCache()
    whole.add(text)
    assert cache.propose(text[:60], 16).tokens == whole.propose(text[:60], 16).tokens != []
