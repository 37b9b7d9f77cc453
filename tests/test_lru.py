"""The byte-bounded map behind the media caches: never over its bound, least recently used out
first, an entry larger than the bound never kept."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from slotwise_core.lru import SizedLRU

ops = st.lists(
    st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 9), st.integers(0, 60)),
    max_size=60,
)


@given(ops, st.integers(0, 100))
def test_the_map_is_an_lru_within_its_bound(script: list[tuple[str, int, int]], bound: int) -> None:
    lru: SizedLRU[int, int] = SizedLRU(bound, lambda size: size)
    model: list[tuple[int, int]] = []  # (key, size), least recently used first
    for op, key, size in script:
        held = dict(model)
        if op == "get":
            assert lru.get(key) == held.get(key)
            if key in held:
                model.remove((key, held[key]))
                model.append((key, held[key]))
            continue
        lru.put(key, size)
        if size > bound:
            continue
        model = [kv for kv in model if kv[0] != key] + [(key, size)]
        while sum(s for _, s in model) > bound:
            model.pop(0)
        assert lru.num_bytes == sum(s for _, s in model) <= bound
        assert len(lru) == len(model) and all(k in lru for k, _ in model)


def test_hits_and_misses_are_counted() -> None:
    lru: SizedLRU[str, bytes] = SizedLRU(10, len)
    lru.put("a", b"12345")
    assert (lru.get("a"), lru.get("b")) == (b"12345", None)
    assert (lru.hits, lru.misses) == (1, 1)
    lru.put("big", b"x" * 11)
    assert "big" not in lru and lru.num_bytes == 5
