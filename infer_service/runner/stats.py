"""The engine's counters: its own, each tenant's, and time to first token in fixed buckets."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class TenantStats:
    num_requests: int = 0  # started in a slot
    num_generated_tokens: int = 0
    queue_wait_seconds: float = 0.0  # summed over its started requests
    num_media_cache_hits: int = 0  # projector outputs found in its own part of the cache
    num_media_cache_misses: int = 0
    num_shared_prefixes: int = 0  # (pool) its requests that began on a shared prefix
    num_shared_cells: int = 0  # ... the cells they did not decode
    num_pool_waits: int = 0  # ... steps its prompts waited for the pool's cells
    num_preemptions: int = 0  # ... its generations put aside for another tenant's prompt
    num_sessions_reclaimed: int = 0  # ... its idle sessions swapped out for one


TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class Latencies:
    """Seconds observed, in fixed buckets (a Prometheus histogram's, read at scrape time):
    counts[i] of them at most TTFT_BUCKETS[i], the last one above every bound."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        self.total += seconds

    def copy(self) -> Latencies:
        return Latencies(list(self.counts), self.total)


@dataclass
class EngineStats:
    num_decodes: int = 0
    num_failed_decodes: int = 0  # llama_decode != 0 for a batch the ledgers admitted
    num_multi_seq_decodes: int = 0
    num_prompts_put_off: int = 0  # a step left a prompt for the next: shorter ones finished first
    num_media_decodes: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0
    num_session_restores: int = 0
    num_session_reprefills: int = 0
    num_session_reprefill_cells: int = 0  # decoded again: what a swap-in's state lacked
    num_evicted_cells: int = 0
    num_pool_waits: int = 0  # (kv_unified) steps a prompt waited for the pool's cells
    num_preemptions: int = 0  # (kv_unified) generations put aside in host memory for another's
    num_sessions_reclaimed: int = 0  # (kv_unified) idle sessions swapped out for a prompt
    num_shared_prefixes: int = 0  # (kv_unified) requests given a pinned prefix from the pool
    num_shared_cells: int = 0  # (kv_unified) the cells those requests did not decode
    num_checkpoints: int = 0  # (recurrent memory) recurrent states saved
    num_checkpoint_restores: int = 0  # (recurrent memory) sequences cut back to one
    # (hybrid memory) rejected drafts: rolled back in place, or from a checkpoint taken
    # before the step (those checkpoints counted too)
    num_spec_rollbacks: int = 0
    num_spec_restores: int = 0
    num_spec_checkpoints: int = 0
    shifts_by_policy: dict[str, int] = field(default_factory=dict)
    # speculative decoding, by type: [tokens drafted, tokens accepted, drafts from the
    # tenant's earlier requests (the suffix cache's hits)]
    drafts_by_type: dict[str, list[int]] = field(default_factory=dict)
    by_tenant: dict[str, TenantStats] = field(default_factory=dict)  # (tenants: the keys file's)
    # from a request's start in its slot to its first sampled token
    time_to_first_token: Latencies = field(default_factory=Latencies)

    def count_drafts(
        self, spec_type: str, num_drafted: int, num_accepted: int, num_cache_hits: int = 0
    ) -> None:
        counts = self.drafts_by_type.setdefault(spec_type, [0, 0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted
        counts[2] += num_cache_hits

    def tenant(self, name: str) -> TenantStats:
        stats = self.by_tenant.get(name)
        if stats is None:
            stats = self.by_tenant[name] = TenantStats()
        return stats
