"""llama.cpp's ngram-mod, ngram-map-k4v and ngram-cache drafters (pure): step by step, each
drafts what a literal port of llama.cpp's C++ drafts (its scans, its hash tables, its quirks),
on histories with media chunks; no draft holds a media chunk or passes its limit; memory stays
bounded; a tenant's pool drafts from its earlier requests' text and never from another's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TypeVar
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.spec import ngram_map
from infer_service.spec.ngram_cache import NgramCache, NgramCacheStore
from infer_service.spec.ngram_map import NgramMapK4v
from infer_service.spec.ngram_mod import NgramMod, NgramModConfig, NgramModPool
from infer_service.spec.proposer import NO_TOKEN, Proposer

AnyProposer = TypeVar("AnyProposer", bound=Proposer)

# a step of a request: tokens the target emitted, the drafts asked for, how many may land
Step = tuple[list[int], int, int]


def steps(low: int = -1, high: int = 3, max_steps: int = 40) -> st.SearchStrategy[list[Step]]:
    emitted = st.lists(st.integers(low, high), max_size=8)  # ([]: a draft asked for again)
    return st.lists(st.tuples(emitted, st.integers(0, 12), st.integers(0, 12)), max_size=max_steps)


class Reference:
    """A literal port of one llama.cpp drafter, driven as slotwise drives a proposer."""

    def propose(self, history: list[int], limit: int) -> list[int]:
        raise NotImplementedError

    def accept(self, num_accepted: int) -> None:
        raise NotImplementedError

    def close(self, history: list[int]) -> None:
        raise NotImplementedError


def step_side_by_side(
    proposer: Proposer, reference: Reference, history: list[int], step: Step
) -> list[int]:
    """One step of both, their drafts asserted equal."""
    emitted, limit, num_landing = step
    for t in emitted:
        proposer.append(t)
        history.append(t)
    drafted = proposer.propose(limit)
    assert drafted == reference.propose(history, limit), (history, limit)
    num_accepted = min(num_landing, len(drafted))
    proposer.verified(len(drafted), num_accepted)
    if drafted:  # (llama-server accepts only after a draft)
        reference.accept(num_accepted)
    return drafted


def run_side_by_side(proposer: Proposer, reference: Reference, script: list[Step]) -> int:
    """A request's steps on both; how many drafted."""
    history: list[int] = []
    drafts = [step_side_by_side(proposer, reference, history, step) for step in script]
    proposer.close()
    reference.close(history)
    return sum(1 for d in drafts if d)


def run(proposer: Proposer, script: list[Step]) -> list[list[int]]:
    """The proposer's drafts for a request (each step's first `num_landing` land)."""
    drafts = []
    for emitted, limit, num_landing in script:
        for t in emitted:
            proposer.append(t)
        drafted = proposer.propose(limit)
        proposer.verified(len(drafted), min(num_landing, len(drafted)))
        drafts.append(drafted)
    proposer.close()
    return drafts


def feed(proposer: AnyProposer, tokens: Sequence[int]) -> AnyProposer:
    for t in tokens:
        proposer.append(t)
    return proposer


def cut_at_media(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(NO_TOKEN)] if NO_TOKEN in tokens else tokens


# ngram-mod: common/ngram-mod.cpp and common_speculative_impl_ngram_mod, ported literally


class RefModPool:
    def __init__(self, n: int, size: int):
        self.n, self.entries, self.used = n, [-1] * size, 0

    def idx(self, tokens: list[int]) -> int:
        res = 0
        for t in tokens:
            res = (res * 6364136223846793005 + t) % 2**64
        return res % len(self.entries)

    def add(self, tokens: list[int], i: int) -> None:
        if NO_TOKEN in tokens[i : i + self.n + 1]:  # (slotwise: no n-gram across media)
            return
        j = self.idx(tokens[i : i + self.n])
        if self.entries[j] == -1:
            self.used += 1
        self.entries[j] = tokens[i + self.n]

    def get(self, tokens: list[int]) -> int:
        return self.entries[self.idx(tokens)]

    def reset(self) -> None:
        self.entries, self.used = [-1] * len(self.entries), 0


class RefNgramMod(Reference):
    def __init__(self, pool: RefModPool, n_min: int, n_max: int):
        self.pool, self.n_min, self.n_max = pool, n_min, n_max
        self.i_last = self.n_draft_last = self.n_low = 0
        self.begun = False

    def begin(self, prompt: list[int]) -> None:
        self.begun = True
        self.i_last = self.n_draft_last = 0
        n = self.pool.n
        if len(prompt) < n:
            return
        for i in range(len(prompt) - n):
            self.pool.add(prompt, i)
        self.i_last = len(prompt) - n
        if self.pool.used / len(self.pool.entries) > 0.25:
            self.pool.reset()

    def draft_one(self, prompt: list[int], id_last: int) -> list[int]:
        self.n_draft_last = 0
        n, cur_len = self.pool.n, len(prompt)
        if cur_len < n:
            return []
        if self.i_last + 32 < cur_len:
            for i in range(self.i_last, cur_len - n):
                self.pool.add(prompt, i)
            self.i_last = cur_len - n
        result = [*prompt[cur_len - n + 1 :], id_last]
        if NO_TOKEN in result:  # (slotwise: no n-gram across media)
            return []
        for i in range(self.n_max):
            token = self.pool.get(result[i : i + n])
            if token == -1:
                if i < self.n_min:
                    return []
                break
            result.append(token)
        self.n_draft_last = len(result) - n
        return result[n:]

    def propose(self, history: list[int], limit: int) -> list[int]:
        if limit <= 0 or not history:
            return []
        if not self.begun:
            self.begin(history[:-1])
        return self.draft_one(history[:-1], history[-1] if history else NO_TOKEN)[:limit]

    def accept(self, num_accepted: int) -> None:
        if self.n_draft_last > 0:
            if num_accepted / self.n_draft_last < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.pool.reset()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0

    def close(self, history: list[int]) -> None:
        if not self.begun:
            self.begin(history[:-1])


def test_ngram_mod_defaults_are_llama_cpp_s() -> None:
    assert NgramModConfig() == NgramModConfig(n_match=24, n_min=48, n_max=64)
    pool = NgramModPool()
    assert (pool.n_match, pool.num_entries) == (24, 4 * 1024 * 1024)
    assert pool.size_bytes == 16 * 1024 * 1024
    with pytest.raises(ValueError):
        NgramMod(NgramModPool(n_match=8, num_entries=64))  # the config's n_match is 24


def test_ngram_mod_drafts_a_text_it_saw_in_an_earlier_request() -> None:
    pool = NgramModPool(n_match=4, num_entries=1 << 16)
    config = NgramModConfig(n_match=4, n_min=2, n_max=8)
    first = feed(NgramMod(pool, config), range(100, 160))
    assert first.propose(8) == []  # (nothing follows its own last n-gram yet)
    first.close()
    second = NgramMod(pool, config)
    feed(second, [7, *range(100, 111)])
    assert second.propose(8) == list(range(111, 119))
    assert second.propose(3) == [111, 112, 113]
    assert (second.hits, pool.hits) == (2, 2)


def test_ngram_mod_drops_drafts_shorter_than_n_min() -> None:
    pool = NgramModPool(n_match=2, num_entries=1 << 16)
    feed(NgramMod(pool, NgramModConfig(2, 0, 8)), [1, 2, 3, 4, 5, 9, 0]).close()
    assert feed(NgramMod(pool, NgramModConfig(2, 4, 8)), [0, 1, 2]).propose(8) == [3, 4, 5, 9]
    assert feed(NgramMod(pool, NgramModConfig(2, 4, 8)), [0, 2, 3]).propose(8) == []  # 3 < 4
    assert feed(NgramMod(pool, NgramModConfig(2, 4, 2)), [0, 2, 3]).propose(8) == [4, 5]


def test_ngram_mod_empties_a_crowded_pool_at_begin() -> None:
    pool = NgramModPool(n_match=1, num_entries=100)  # (a 1-gram's entry: its token % 100)
    config = NgramModConfig(n_match=1, n_min=1, n_max=4)
    feed(NgramMod(pool, config), [*range(26), 99]).close()  # 25 of 100 used: kept
    assert (pool.num_used, pool.num_resets) == (25, 0)
    feed(NgramMod(pool, config), [25, 26, 99]).close()  # 26 of 100
    assert (pool.num_used, pool.num_resets) == (0, 1)


def test_ngram_mod_empties_the_pool_after_five_low_acceptances() -> None:
    pool = NgramModPool(n_match=2, num_entries=1 << 16)
    config = NgramModConfig(n_match=2, n_min=1, n_max=4)
    text = list(range(10, 50))
    proposer = feed(NgramMod(pool, config), [*text, 10, 11])
    for num_accepted in (0, 0, 0, 0, 1, 0, 0, 0, 0):  # (1 of 4 is not low: the streak ends)
        assert proposer.propose(4) == [12, 13, 14, 15]
        proposer.verified(4, num_accepted)
    assert pool.num_resets == 0
    proposer.propose(4)
    proposer.verified(4, 0)
    assert (pool.num_resets, pool.num_used) == (1, 0)
    proposer.append(12)  # its next draft adds its whole history again
    assert proposer.propose(4) == [13, 14, 15, 16]


def test_ngram_mod_counts_acceptance_over_what_was_verified() -> None:
    """A slot verifies as many drafts as pay their way: a draft cut to one token and accepted
    is no low acceptance (llama.cpp counts it over the 8 it drafted: five of those would
    empty the tenant's pool); five verified drafts accepted below a quarter do."""
    pool = NgramModPool(n_match=2, num_entries=1 << 16)
    proposer = feed(NgramMod(pool, NgramModConfig(2, 1, 8)), [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    for _ in range(5):
        assert proposer.propose(1) == [3]
        proposer.verified(1, 1)  # all it was given landed
    assert pool.num_resets == 0
    for _ in range(5):
        assert proposer.propose(8)
        proposer.verified(8, 1)  # 1 of 8: low
    assert pool.num_resets == 1


@given(
    st.lists(steps(), min_size=1, max_size=4),
    st.integers(1, 4),
    st.integers(0, 6),
    st.integers(0, 10),
    st.integers(1, 64),
)
@settings(max_examples=250, deadline=None)
def test_ngram_mod_drafts_what_llama_cpp_drafts(
    requests: list[list[Step]], n: int, n_min: int, n_max: int, num_entries: int
) -> None:
    """Two requests at a time share a small pool (collisions, resets), their steps taking
    turns; then the next two."""
    pool, ref_pool = NgramModPool(n, num_entries), RefModPool(n, num_entries)
    config = NgramModConfig(n, n_min, n_max)
    no_steps: list[Step] = []
    for first, second in zip_longest(requests[::2], requests[1::2], fillvalue=no_steps):
        proposers = [NgramMod(pool, config), NgramMod(pool, config)]
        references = [RefNgramMod(ref_pool, n_min, n_max), RefNgramMod(ref_pool, n_min, n_max)]
        histories: list[list[int]] = [[], []]
        for steps_now in zip_longest(first, second):
            for who, step in enumerate(steps_now):
                if step is not None:
                    step_side_by_side(proposers[who], references[who], histories[who], step)
        for who in (0, 1):
            proposers[who].close()
            references[who].close(histories[who])
        assert pool.num_used == ref_pool.used


# ngram-map-k4v: common/ngram-map.cpp with key_only false, ported literally


@dataclass
class RefKey:
    key_idx: int
    size_m: int
    stat_idx: int = 0
    key_num: int = 0
    value_idx: list[int] = field(default_factory=lambda: [0] * 4)
    value_num: list[int] = field(default_factory=lambda: [0] * 4)
    n_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.n_accepted = [self.size_m] * 4


class RefNgramMapK4v(Reference):
    def __init__(self, n: int, m: int, min_hits: int):
        self.n, self.m, self.min_hits = n, m, min_hits
        self.keys: list[RefKey] = []
        self.key_map: dict[int, int] = {}  # (std::vector<uint32_t> key_map, 0: unused)
        self.key_map_last_idx = self.size_last_begin = 0
        self.last_draft_created, self.last_key, self.last_value = False, 0, 0
        self.begun = False

    def hash(self, tokens: list[int], start: int) -> int:
        h = 0
        for t in tokens[start : start + self.n]:
            h = (h * 2654435761 + t) & 0xFFFFFFFF  # (uint32_t)
        return h % ngram_map.KEY_MAP_BUCKETS

    def hold(self, inp: list[int], j: int) -> None:
        if NO_TOKEN in inp[j : j + self.n]:  # (slotwise: no n-gram across media)
            return
        if self.key_map.get(self.hash(inp, j), 0) == 0:
            self.key_map[self.hash(inp, j)] = j

    def draft(self, inp: list[int], sampled: int) -> list[int]:
        self.last_draft_created, self.last_key, self.last_value = False, 0, 0
        n, m, cur_len = self.n, self.m, len(inp)
        if cur_len < 2 * n + m:
            return []
        key = [*inp[cur_len - n + 1 :], sampled]
        usable = NO_TOKEN not in key  # (slotwise: no n-gram across media)
        match_pos = 0
        if usable:
            idx_key = self.key_map.get(self.hash(key, 0), 0)
            if idx_key != 0 and idx_key < cur_len - n - m - 1 and inp[idx_key : idx_key + n] == key:
                match_pos = idx_key
        if usable and match_pos == 0 and self.size_last_begin > n + m + 1:
            j = self.size_last_begin - n - m - 1
            while j > self.key_map_last_idx:
                if inp[j : j + n] == key:
                    match_pos = j
                    break
                j -= 1
        if usable and match_pos == 0:
            j = cur_len - n - m - 1
            while j > self.size_last_begin and j > self.key_map_last_idx:
                if inp[j : j + n] == key:
                    match_pos = j
                    break
                j -= 1
        if self.size_last_begin > n + m + 1:
            j = self.size_last_begin - n - m - 1
            while j > self.key_map_last_idx:
                self.hold(inp, j)
                j -= 1
        j = cur_len - n - m - 1
        while j > self.size_last_begin and j > self.key_map_last_idx:
            self.hold(inp, j)
            j -= 1
        self.key_map_last_idx = max(cur_len - n - m - 1, self.key_map_last_idx)
        if match_pos == 0:
            return []
        offset = len(self.keys)
        for i, k in enumerate(self.keys):
            if inp[k.key_idx : k.key_idx + n] == key:
                offset = i
                break
        if offset == len(self.keys):
            self.keys.append(RefKey(match_pos, m))
        k = self.keys[offset]
        k.key_num = min(k.key_num + 1, 16380)
        if k.key_num < self.min_hits:
            return []
        for i in range(k.stat_idx, match_pos + 1):
            if inp[i : i + n] != key:
                continue
            begin_value = i + n
            idx_value = -1
            for v in range(4):
                if k.value_idx[v] == 0:
                    k.value_idx[v], k.value_num[v], k.n_accepted[v] = begin_value, 0, m
                    idx_value = v
                    break
                if inp[begin_value : begin_value + m] == inp[k.value_idx[v] : k.value_idx[v] + m]:
                    idx_value = v
                    break
            if idx_value >= 0:
                k.value_num[idx_value] = min(k.value_num[idx_value] + 1, 16380)
        k.stat_idx = match_pos
        max_occur, slot_max = 0, 0
        for v in range(4):
            if k.value_num[v] > max_occur:
                max_occur, slot_max = k.value_num[v], v
        sum_occur = sum(k.value_num[v] for v in range(4) if v != slot_max)
        if sum_occur > 0 and max_occur < 2 * sum_occur:
            return []
        n_draft = min(m, k.n_accepted[slot_max])
        self.last_draft_created, self.last_key, self.last_value = True, offset, slot_max
        return inp[match_pos + n : match_pos + n + n_draft]

    def propose(self, history: list[int], limit: int) -> list[int]:
        if limit <= 0 or not history:
            return []
        if not self.begun:  # common_ngram_map_begin on an empty map
            self.begun, self.size_last_begin = True, max(0, len(history) - 1)
        drafted = self.draft(history[:-1], history[-1] if history else NO_TOKEN)
        return cut_at_media(drafted)[:limit]

    def accept(self, num_accepted: int) -> None:
        if self.last_draft_created:
            self.keys[self.last_key].n_accepted[self.last_value] = num_accepted

    def close(self, history: list[int]) -> None:
        pass


def test_ngram_map_k4v_defaults_are_llama_cpp_s() -> None:
    proposer = NgramMapK4v()
    assert (proposer.size_n, proposer.size_m, proposer.min_hits) == (12, 48, 1)
    assert proposer.name == "ngram-map-k4v"


def test_ngram_map_k4v_drafts_what_followed_the_key() -> None:
    text = list(range(1000, 1100))
    proposer = feed(NgramMapK4v(), [*text, *text[:20]])
    assert proposer.propose(10) == text[20:30]
    assert proposer.propose(100) == text[20:68]  # size_m at most


def test_ngram_map_k4v_waits_for_min_hits_lookups() -> None:
    text = list(range(1000, 1100))
    proposer = feed(NgramMapK4v(min_hits=2), [*text, *text[:20]])
    assert proposer.propose(10) == []  # the key was found once
    assert proposer.propose(10) == text[20:30]  # twice (llama.cpp counts lookups)


def test_ngram_map_k4v_drafts_only_a_dominant_value() -> None:
    def history(*values: int) -> list[int]:
        out = []
        for v in values:
            out += [1, 2, v, v + 1, 0]  # the key (1, 2) followed by (v, v + 1)
        return [*out, 1, 2]

    proposer = feed(NgramMapK4v(size_n=2, size_m=2), history(10, 20, 10, 10))
    assert proposer.propose(4) == [10, 11]  # 3 against 1 (at least twice the others)
    proposer = feed(NgramMapK4v(size_n=2, size_m=2), history(10, 20, 10, 20))
    assert proposer.propose(4) == []  # 2 against 2


def test_ngram_map_k4v_drafts_as_much_as_the_value_last_accepted() -> None:
    text = list(range(1000, 1100))
    proposer = feed(NgramMapK4v(), [*text, *text[:20]])
    assert proposer.propose(8) == text[20:28]
    proposer.verified(8, 3)
    assert proposer.propose(8) == text[20:23]
    proposer.verified(3, 0)
    assert proposer.propose(8) == []  # (0 accepted: llama.cpp's value drafts nothing again)


@given(st.lists(steps(max_steps=60), min_size=1, max_size=2), st.integers(1, 3))
@settings(max_examples=250, deadline=None)
def test_ngram_map_k4v_drafts_what_llama_cpp_drafts(requests: list[list[Step]], n: int) -> None:
    for i, script in enumerate(requests):
        m, min_hits = 1 + i % 3, 1 + i % 2
        reference = RefNgramMapK4v(n, m, min_hits)
        run_side_by_side(NgramMapK4v(n, m, min_hits), reference, script)


@given(steps(high=2, max_steps=60), st.integers(1, 2), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_ngram_map_k4v_keeps_llama_cpp_s_hash_collisions(
    script: list[Step], n: int, m: int
) -> None:
    """Eight buckets: which occurrence the hash map holds decides what a draft continues."""
    with mock.patch.object(ngram_map, "KEY_MAP_BUCKETS", 8):
        run_side_by_side(NgramMapK4v(n, m), RefNgramMapK4v(n, m, 1), script)


@given(steps(low=0, high=2, max_steps=80), st.integers(1, 2), st.integers(1, 2))
@settings(max_examples=150, deadline=None)
def test_ngram_map_k4v_past_its_history_drafts_as_a_new_map_of_what_it_kept(
    script: list[Step], n: int, m: int
) -> None:
    max_tokens = 4 * (2 * n + m)
    proposer = NgramMapK4v(n, m, max_tokens=max_tokens)
    reference, history = RefNgramMapK4v(n, m, 1), list[int]()
    for emitted, limit, num_landing in script:
        for t in emitted:
            if len(history) >= max_tokens:  # the older half goes: a map of the rest
                history, reference = history[len(history) // 2 :], RefNgramMapK4v(n, m, 1)
            proposer.append(t)
            history.append(t)
            assert len(proposer) == len(history) <= max_tokens
        drafted = proposer.propose(limit)
        assert drafted == reference.propose(history, limit)
        proposer.verified(len(drafted), min(num_landing, len(drafted)))
        if drafted:
            reference.accept(min(num_landing, len(drafted)))


# ngram-cache: common/ngram-cache.cpp and common_speculative_impl_ngram_cache, ported literally

LAX = ((2, 2, 1, 1), (66, 50, 50, 50))  # draft_min_sample_size_lax, draft_min_percent_lax
STRICT = ((4, 3, 2, 2), (75, 66, 66, 66))
RefCounts = dict[tuple[int, ...], dict[int, int]]


def ref_update(cache: RefCounts, inp: list[int], nnew: int) -> None:
    for ngram_size in range(1, 5):
        for i in range(max(len(inp) - nnew, ngram_size), len(inp)):
            if NO_TOKEN in inp[i - ngram_size : i + 1]:  # (slotwise: no n-gram across media)
                continue
            part = cache.setdefault(tuple(inp[i - ngram_size : i]), {})
            part[inp[i]] = part.get(inp[i], 0) + 1


def ref_try_draft(
    cache: RefCounts, ngrams: list[tuple[int, ...] | None], rule: tuple[tuple[int, ...], ...]
) -> int | None:
    min_sample_size, min_percent = rule
    for i in range(len(ngrams) - 1, -1, -1):
        ngram = ngrams[i]
        if ngram is None or ngram not in cache:
            continue
        part = cache[ngram]
        max_count = sum_count = 0
        max_token = -1
        for token in reversed(list(part)):  # (libstdc++'s order where a tie can draft)
            if part[token] > max_count:
                max_token, max_count = token, part[token]
            sum_count += part[token]
        if sum_count < min_sample_size[i] or 100 * max_count < min_percent[i] * sum_count:
            continue
        return max_token
    return None


def ref_cache_draft(
    inp: list[int], draft: list[int], n_draft: int, context: RefCounts, dynamic: RefCounts
) -> None:
    if len(inp) < 2:
        return
    while len(draft) - 1 < n_draft:
        ngrams: list[tuple[int, ...] | None] = []
        for size in range(1, 5):
            start = len(inp) - size + len(draft) - 1
            seq = [*inp, *draft[1:]]
            ngram = tuple(seq[start : start + size]) if start >= 0 else None
            ngrams.append(None if ngram is None or NO_TOKEN in ngram else ngram)
        token = ref_try_draft(context, ngrams, LAX)
        if token is None:
            token = ref_try_draft(dynamic, ngrams, STRICT)
        if token is None:
            break
        draft.append(token)


class RefNgramCache(Reference):
    def __init__(self, dynamic: RefCounts):
        self.dynamic, self.cache_size = dynamic, 0
        self.context: RefCounts = {}

    def propose(self, history: list[int], limit: int) -> list[int]:
        if limit <= 0:
            return []
        if self.cache_size < len(history):
            tokens_new = history[self.cache_size :]
            ref_update(self.context, tokens_new, len(tokens_new))
            self.cache_size = len(history)
        draft = [history[-1] if history else NO_TOKEN]
        ref_cache_draft(history, draft, 8, self.context, self.dynamic)
        return draft[1:][:limit]

    def accept(self, num_accepted: int) -> None:
        pass

    def close(self, history: list[int]) -> None:
        self.propose(history, 1)  # (the tokens since the last draft are learnt)
        for ngram, part in self.context.items():  # common_ngram_cache_merge
            merged = self.dynamic.setdefault(ngram, {})
            for token, count in part.items():
                merged[token] = merged.get(token, 0) + count


def test_ngram_cache_drafts_the_usual_followers() -> None:
    proposer = feed(NgramCache(), [1, 2, 3, 4, 1, 2, 3])
    assert proposer.propose(8) == [4, 1, 2, 3, 4, 1, 2, 3]
    assert proposer.propose(3) == [4, 1, 2]
    assert NgramCache().n_draft == 8
    assert NgramCache().name == "ngram-cache"


def test_ngram_cache_learns_each_run_of_new_tokens_alone() -> None:
    proposer = feed(NgramCache(), [1, 2, 3])
    assert proposer.propose(8) == []
    feed(proposer, [4])
    assert proposer.propose(8) == []
    feed(proposer, [1, 2, 3])  # (1, 2, 3) -> 4 spans two runs: never learnt
    assert proposer.propose(8) == []
    assert feed(NgramCache(), [1, 2, 3, 4, 1, 2, 3]).propose(8)[:1] == [4]  # in one run


def test_ngram_cache_drafts_from_its_tenant_s_earlier_requests() -> None:
    text = list(range(200, 260))
    store = NgramCacheStore()
    feed(NgramCache(store), text).close()
    assert feed(NgramCache(store), text[:30]).propose(8) == []  # strict: 1 sample is too few
    feed(NgramCache(store), text).close()
    assert feed(NgramCache(store), text[:30]).propose(8) == text[30:38]


def test_a_full_context_cache_starts_again_from_the_newest_tokens() -> None:
    proposer = feed(NgramCache(max_ngrams=32), range(50))  # 190 n-grams
    assert proposer.propose(8) == []
    assert len(proposer.context) == 6  # those of its last 32 // 8 tokens
    feed(proposer, [46, 47, 48])
    assert proposer.propose(8) == [49]  # (46, 47, 48) -> 49 was kept


def test_a_full_store_starts_again_with_the_newest_request() -> None:
    store = NgramCacheStore(max_ngrams=200)
    ours, theirs = list(range(40)), list(range(100, 140))  # 150 n-grams each
    for text in (ours, ours, theirs, theirs):
        feed(NgramCache(store), text).close()
    assert len(store) == 150
    assert feed(NgramCache(store), theirs[:10]).propose(8) == theirs[10:18]
    assert feed(NgramCache(store), ours[:10]).propose(8) == []


@given(st.lists(steps(max_steps=30), min_size=1, max_size=3))
@settings(max_examples=250, deadline=None)
def test_ngram_cache_drafts_what_llama_cpp_drafts(requests: list[list[Step]]) -> None:
    store, dynamic = NgramCacheStore(), RefCounts()
    for script in requests:
        run_side_by_side(NgramCache(store), RefNgramCache(dynamic), script)


@given(st.lists(steps(max_steps=30), min_size=1, max_size=4), st.integers(32, 64))
@settings(max_examples=150, deadline=None)
def test_ngram_cache_memory_stays_bounded(requests: list[list[Step]], max_ngrams: int) -> None:
    store = NgramCacheStore(max_ngrams)
    for script in requests:
        proposer = NgramCache(store, max_ngrams=max_ngrams, max_tokens=16)
        for emitted, limit, _ in script:
            feed(proposer, emitted)
            assert len(proposer.propose(limit)) <= limit
            assert len(proposer.context) <= max_ngrams
            assert len(proposer) <= 16
        proposer.close()
        assert len(store) <= max_ngrams


# all three


def make_mod() -> Proposer:
    return NgramMod(NgramModPool(2, 256), NgramModConfig(2, 1, 6))


PROPOSERS: dict[str, Callable[[], Proposer]] = {
    "ngram-mod": make_mod,
    "ngram-map-k4v": lambda: NgramMapK4v(2, 3),
    "ngram-cache": lambda: NgramCache(NgramCacheStore()),
}


@pytest.mark.parametrize("name", PROPOSERS)
@given(script=steps(low=-1, high=2, max_steps=60))
@settings(max_examples=150, deadline=None)
def test_drafts_hold_no_media_and_fit_the_limit(name: str, script: list[Step]) -> None:
    proposer = PROPOSERS[name]()
    assert proposer.name == name
    for (_, limit, _), drafted in zip(script, run(proposer, script), strict=True):
        assert NO_TOKEN not in drafted
        assert len(drafted) <= max(0, limit)
    if isinstance(proposer, NgramCache) and proposer.store is not None:  # (nor n-grams)
        assert all(NO_TOKEN not in ngram for ngram, _ in proposer.store.items())


def test_no_draft_continues_across_a_media_chunk() -> None:
    history = [0, 1, 2, 3, NO_TOKEN, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    for name, make in PROPOSERS.items():
        assert feed(make(), history).propose(6) == [3], name  # (it stops at the media chunk)


@given(st.integers(64, 400), st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_ngram_mod_memory_stays_bounded(num_tokens: int, n: int) -> None:
    pool = NgramModPool(n, 128)
    proposer = NgramMod(pool, NgramModConfig(n, 0, 8), max_tokens=4 * (n + 1) + 8)
    for t in range(num_tokens):
        proposer.append(t % 7)
        assert len(proposer) <= proposer.max_tokens
        assert all(d != NO_TOKEN for d in proposer.propose(4))
        assert pool.size_bytes == 4 * 128 and 0 <= pool.num_used <= 128


# a tenant's pool and another's


def distinct_text(low: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(low, low + 99), min_size=12, max_size=60, unique=True)


@given(distinct_text(0), distinct_text(1000), st.data())
@settings(max_examples=100, deadline=None, derandomize=True)
def test_a_pool_drafts_its_tenant_s_text_and_never_another_s(
    ours: list[int], theirs: list[int], data: st.DataObject
) -> None:
    config = NgramModConfig(n_match=3, n_min=1, n_max=8)
    our_pool, their_pool = NgramModPool(3), NgramModPool(3)
    feed(NgramMod(our_pool, config), ours).close()
    feed(NgramMod(their_pool, config), theirs).close()
    k = data.draw(st.integers(4, len(ours) - 1))  # (a draft needs n + 1 tokens)
    # (the last n-gram's continuation reaches the pool only through drafts)
    expected = ours[k : min(k + 8, len(ours) - 1)]
    assert feed(NgramMod(our_pool, config), ours[:k]).propose(8) == expected
    drafted = feed(NgramMod(their_pool, config), ours[:k]).propose(8)
    assert set(drafted) <= set(ours[:k]) | set(theirs)
    assert not set(drafted) & set(ours[k:])


@given(distinct_text(0), distinct_text(1000), st.data())
@settings(max_examples=100, deadline=None)
def test_a_store_drafts_its_tenant_s_text_and_never_another_s(
    ours: list[int], theirs: list[int], data: st.DataObject
) -> None:
    our_store, their_store = NgramCacheStore(), NgramCacheStore()
    for _ in range(2):  # (strict thresholds: two samples at least)
        feed(NgramCache(our_store), ours).close()
        feed(NgramCache(their_store), theirs).close()
    k = data.draw(st.integers(4, len(ours) - 1))
    assert feed(NgramCache(our_store), ours[:k]).propose(8) == ours[k : k + 8]
    drafted = feed(NgramCache(their_store), ours[:k]).propose(8)
    assert not set(drafted) & set(ours[k:])


# llama.cpp's own output: common/ngram-{mod,map,cache}.cpp built with g++ (libstdc++) and driven
# as slotwise drives a proposer (begin at the first draft, the prompt all but the last token)

GOLDEN_MOD = (  # n_match 2, n_min 2, n_max 6, a table of 64 entries shared by two requests
    [
        [
            ([1, 0, 2, 2, 2, 1, 1, 0, 1, 2, 2, 0, 2, 1, 1, 0, 1, 2, 0], 10, 10),
            ([0, 1, 1, 0], 10, 10),
            ([2, 0, 1], 1, 10),
            ([1, 2, 0], 10, 10),
            ([2, 2, 1, 0], 6, 10),
            ([2], 10, 10),
        ],
        [
            ([1, 2, 1], 10, 7),
            ([0, 2, 2], 10, 10),
            ([2, 0, 0, 0, 1], 10, 9),
            ([2, 0, 1, 0, 1], 10, 6),
            ([0, 0, 2, 2, 2], 10, 10),
            ([1, 2, 1, 2], 10, 10),
            ([0, 0, 2], 9, 10),
        ],
    ],
    [
        [2, 1, 1, 0, 1, 2],
        [1, 2, 2, 0, 2, 1],
        [2],
        [2, 1, 1, 0, 1, 2],
        [1, 2, 2, 0, 2, 1],
        [1, 1, 0, 1, 2, 2],
        [1, 0, 1, 2, 2, 0],
        [0, 2, 1, 1, 0, 1],
        [2, 2, 0, 2, 1, 1],
        [2, 2, 0, 2, 1, 1],
        [0, 2, 1, 1, 0, 1],
        [2, 0, 2, 1, 1, 0],
        [1, 1, 0, 1, 2, 2],
    ],
)
GOLDEN_K4V = (  # size_n 2, size_m 3, min_hits 1
    [
        [
            ([1, 2, 0, 1, 1, 0, 0, 2, 1, 1, 0, 2, 1, 0, 0], 2, 10),
            ([0], 10, 10),
            ([2, 2], 9, 10),
            ([0, 0], 10, 9),
            ([2], 10, 10),
            ([0, 0], 10, 10),
            ([0, 0], 10, 10),
            ([2, 1, 0, 0], 10, 10),
            ([2, 0, 0], 10, 10),
            ([2, 0, 1, 1, 2], 10, 10),
            ([0, 2], 4, 10),
        ]
    ],
    [[2, 1], [2, 1], [], [2, 1], [1, 1, 0], [2, 1], [2, 1], [2, 1], [2, 1], [], [1, 1, 0]],
)
GOLDEN_CACHE = (  # two requests, one dynamic cache
    [
        [
            ([2, 2, 1, 1, 1, 0, 1, 2, 0, 2, 2, 1, 0, 1, 2, 0, 0, 1, 0, 2], 10, 10),
            ([2, 0], 10, 10),
            ([2], 10, 10),
            ([0, 2, 1, 1, 2], 10, 10),
            ([1, 0, 2], 10, 2),
            ([2, 0, 0, 1], 10, 10),
            ([0, 1], 10, 10),
        ],
        [
            ([2, 1, 0, 0, 2, 0, 1], 10, 10),
            ([0, 0], 10, 10),
            ([0, 0, 0, 0], 10, 8),
            ([1, 1], 10, 10),
            ([1, 1, 0, 2, 1], 10, 6),
            ([1, 1, 2], 10, 10),
            ([1], 10, 10),
        ],
    ],
    [
        [],
        [0, 1, 0, 2],
        [2, 1, 0, 1, 2, 0, 0, 1],
        [0, 0, 1, 0, 2, 1, 1, 2],
        [1, 1, 2, 0, 0, 1, 0, 2],
        [0, 2, 1, 1, 2, 0, 0, 1],
        [2, 0, 0, 1, 0, 2, 1, 1],
        [2, 0, 0, 1, 2, 0, 0, 1],
        [2, 0, 1, 2, 0, 0, 1, 2],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [],
        [1],
        [1, 1, 2, 1, 1, 2, 1, 1],
        [1, 2, 1, 1, 2, 1, 1, 2],
    ],
)


def test_drafts_equal_llama_cpp_s_own() -> None:
    pool, store = NgramModPool(2, 64), NgramCacheStore()
    cases: list[tuple[Callable[[], Proposer], tuple[list[list[Step]], list[list[int]]]]] = [
        (lambda: NgramMod(pool, NgramModConfig(2, 2, 6)), GOLDEN_MOD),
        (lambda: NgramMapK4v(2, 3, 1), GOLDEN_K4V),
        (lambda: NgramCache(store), GOLDEN_CACHE),
    ]
    for make, (requests, expected) in cases:
        drafts = [d for script in requests for d in run(make(), script)]
        assert drafts == expected
