"""What drafts learn across requests, kept per tenant: ngram-mod's pools, ngram-cache's
dynamic stores and the suffix caches. Drafting from another tenant's text would tell one
tenant what another wrote (a draft that lands is faster: the timing leaks it), so every store
belongs to one tenant, and the whole is bounded by one budget (`--spec-cache-mb`): the least
recently used tenant's stores go first. Used from the engine's thread only. Pure."""

from __future__ import annotations

from collections import OrderedDict

from infer_service.spec.ngram_cache import MAX_NGRAMS, NgramCacheStore
from infer_service.spec.ngram_mod import DEFAULT_ENTRIES, NgramModPool
from infer_service.spec.suffix_cache import WORK_TOKENS, SuffixCache, SuffixCaches

NGRAM_BYTES = 170  # (ngram_cache.py's estimate of one counted n-gram)
MOD_ENTRY_BYTES = 4
PRIVATE_MOD_ENTRIES = 1 << 16  # a request's own ngram-mod pool (256 KiB)


class DraftStores:
    """Every tenant's stores within `max_bytes`: half for suffix caches (each tenant's within
    an eighth of the whole), a quarter for ngram-mod pools, a quarter for ngram-cache stores
    (each of those a tenant's at most an eighth, never more than llama.cpp's own size)."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.suffix = SuffixCaches(max_bytes // 2, max_bytes_per_tenant=max_bytes // 8)
        per_tenant = max_bytes // 8
        self._mod_entries = max(1, min(DEFAULT_ENTRIES, per_tenant // MOD_ENTRY_BYTES))
        self._cache_ngrams = max(64, min(MAX_NGRAMS, per_tenant // NGRAM_BYTES))
        self._mod: OrderedDict[str, NgramModPool] = OrderedDict()
        self._cache: OrderedDict[str, NgramCacheStore] = OrderedDict()

    def suffix_cache(self, tenant: str) -> SuffixCache:
        return self.suffix.for_tenant(tenant)

    def mod_pool(self, tenant: str, n_match: int) -> NgramModPool:
        """The tenant's pool; a request whose n-gram size is not the pool's (the size its
        first request asked for) gets a small one of its own: no request can make a tenant
        hold several pools, nor push other tenants' out by asking for other sizes."""
        pool = self._mod.get(tenant)
        if pool is None:
            pool = self._mod[tenant] = NgramModPool(n_match, self._mod_entries)
            self._fit(self._mod, self.max_bytes // 4, self._mod_entries * MOD_ENTRY_BYTES)
        self._mod.move_to_end(tenant)
        return pool if pool.n_match == n_match else NgramModPool(n_match, PRIVATE_MOD_ENTRIES)

    def ngram_store(self, tenant: str) -> NgramCacheStore:
        store = self._cache.get(tenant)
        if store is None:
            store = self._cache[tenant] = NgramCacheStore(self._cache_ngrams)
            self._fit(self._cache, self.max_bytes // 4, self._cache_ngrams * NGRAM_BYTES)
        self._cache.move_to_end(tenant)
        return store

    def work(self) -> None:
        """A step's slice of counting what ended requests gave the suffix caches."""
        self.suffix.work(WORK_TOKENS)

    @property
    def num_bytes(self) -> int:
        """What the stores may hold now: the suffix caches' bytes, the pools' and stores'
        sizes (allocated or bounded)."""
        return (
            self.suffix.num_bytes
            + len(self._mod) * self._mod_entries * MOD_ENTRY_BYTES
            + len(self._cache) * self._cache_ngrams * NGRAM_BYTES
        )

    @staticmethod
    def _fit(stores: OrderedDict, budget: int, each: int) -> None:  # type: ignore[type-arg]
        """The least recently used go while the stores are over their budget (the newest
        stays: a request in flight may hold an older one, which it keeps using alone)."""
        while len(stores) > 1 and len(stores) * each > budget:
            stores.popitem(last=False)
