"""The proposers of the types that need more than the request's own history (a new type is a
new line here and a file of its own): ngram-map-k4v's key map, ngram-mod's pool and
ngram-cache's store (the tenant's, across requests), the suffix cache (the tenant's). Pure."""

from __future__ import annotations

from infer_service.spec.config import SpecConfig, SpecType
from infer_service.spec.ngram_cache import NgramCache
from infer_service.spec.ngram_map import NgramMapK4v
from infer_service.spec.ngram_mod import NgramMod, NgramModConfig
from infer_service.spec.proposer import Proposer
from infer_service.spec.stores import DraftStores
from infer_service.spec.suffix_cache import SuffixDrafts


def make_proposer(kind: SpecType, config: SpecConfig, stores: DraftStores, tenant: str) -> Proposer:
    """The request's proposer of `kind`, drawing on `tenant`'s stores alone."""
    if kind is SpecType.NGRAM_MAP_K4V:
        return NgramMapK4v(config.size_n, config.size_m, config.min_hits)
    if kind is SpecType.NGRAM_MOD:
        mod = NgramModConfig(config.mod_n_match, config.mod_n_min, config.mod_n_max)
        return NgramMod(stores.mod_pool(tenant, mod.n_match), mod)
    if kind is SpecType.NGRAM_CACHE:
        return NgramCache(stores.ngram_store(tenant))
    if kind is SpecType.SUFFIX:
        return SuffixDrafts(stores.suffix_cache(tenant))
    raise ValueError(f"{kind.value} has no proposer of its own")
