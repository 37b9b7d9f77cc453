"""prep keeps the tokens of long texts a chat sends again (prep_service/token_cache.py): a burst
of chats on one system prompt tokenizes it once per tenant. Hits are read from the cache's own
counts, never from timing; the tokens are llama.cpp's, checked against an uncached preparer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prep_service.preparer import Message, Preparer
from prep_service.token_cache import ENTRY_OVERHEAD, MIN_CACHED_CHARS, TokenCache
from slotwise_core.tiny_models import TinyPair

SYSTEM = "You answer questions about colours, briefly and in plain words. " * 40


def test_a_long_text_is_tokenized_once_per_scope() -> None:
    calls: list[str] = []
    cache = TokenCache(1 << 20)

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [len(w) for w in text.split()]

    for scope in ("a", "a", "b", "a"):
        assert cache.tokens(scope, SYSTEM, True, lambda: tokenize(SYSTEM)) == tuple(
            len(w) for w in SYSTEM.split()
        )
    assert len(calls) == 2 and (cache.hits, cache.misses) == (2, 2)  # (tenants apart)
    cache.tokens("a", SYSTEM, False, lambda: tokenize(SYSTEM))  # (BOS or not: another entry)
    assert len(calls) == 3
    short = "Hello there."
    for _ in range(2):
        cache.tokens("a", short, True, lambda: tokenize(short))  # (short: never kept)
    assert len(calls) == 5 and len(short) < MIN_CACHED_CHARS


def test_the_bound_is_bytes_and_zero_keeps_nothing() -> None:
    texts = [f"{i} " + "x" * MIN_CACHED_CHARS for i in range(50)]
    cache = TokenCache(8 * (ENTRY_OVERHEAD + 2 * MIN_CACHED_CHARS))
    for t in texts:
        cache.tokens("a", t, True, lambda: [1, 2, 3])
    assert 0 < cache.num_bytes <= 8 * (ENTRY_OVERHEAD + 2 * MIN_CACHED_CHARS)
    off = TokenCache(0)
    for _ in range(2):
        off.tokens("a", texts[0], True, lambda: [1])
    assert off.hits == 0 and off.num_bytes == 0


@pytest.fixture(scope="module")
def preparers(tiny: dict[str, TinyPair]) -> Iterator[tuple[Preparer, Preparer]]:
    cached = Preparer(tiny["rope"].model)
    fresh = Preparer(tiny["rope"].model, token_cache_bytes=0)
    try:
        yield cached, fresh
    finally:
        cached.close()
        fresh.close()


def test_chats_on_one_system_prompt_reuse_its_tokens(preparers) -> None:
    """Eight chats open with the same system message: its tokens come from the cache seven
    times, and every prompt is what an uncached preparer makes of it."""
    cached, fresh = preparers
    for i in range(8):
        chat = [Message("system", [SYSTEM]), Message("user", [f"What is colour {i}?"])]
        got, _ = cached.prepare(chat, scope="tenant-a")
        want, _ = fresh.prepare(chat)
        assert got == want
    assert cached.token_cache.hits == 7
    cached.prepare([Message("system", [SYSTEM]), Message("user", ["Hi"])], scope="tenant-b")
    assert cached.token_cache.hits == 7  # (another tenant: tokenized again)
