"""How a request drafts: the draft types (llama-server's names, and slotwise's suffix cache),
their order of preference, and a request's options with llama-server's defaults. Pure."""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
