"""The engine's state as Prometheus metrics, read at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from infer_service.engine.loop import Engine, EngineSnapshot
from infer_service.events import EngineStoppedError
from infer_service.kv.pool import PoolFigures
from infer_service.runner.stats import TTFT_BUCKETS, EngineStats, Latencies


def engine_metrics(engine: Engine) -> Callable[[], Iterable[Metric]]:
    """The engine's figures, read from a snapshot at each scrape: nothing is wired into the
    engine (its time to first token too is a figure it keeps, in fixed buckets)."""

    def collect() -> Iterable[Metric]:
        read = _read(engine)
        yield GaugeMetricFamily(
            "slotwise_infer_engine_up", "the engine thread runs", value=int(read is not None)
        )
        if read is None:
            return
        snap, sessions = read
        yield from slot_metrics(snap, engine.runtime.num_cells_per_slot)
        yield from pool_metrics(snap.pool, snap.stats)
        yield from work_metrics(snap)
        yield first_token_metric(snap.stats.time_to_first_token)
        yield from tenant_metrics(snap.stats, sessions)

    return collect


def _read(engine: Engine) -> tuple[EngineSnapshot, dict[str, Any]] | None:
    """A consistent snapshot, read on the engine thread between steps (None: it is gone, or
    busier than a scrape may wait)."""
    try:
        future = engine.call(lambda: (engine.snapshot(), engine.sessions.usage()))
    except EngineStoppedError:
        return None
    try:
        return future.result(timeout=2)
    except TimeoutError:
        future.cancel()  # not wanted any more: the engine skips it
        return None


def slot_metrics(snap: EngineSnapshot, capacity: int) -> Iterable[Metric]:
    """Each slot's cells, the queue, the shifts by policy, the drafts by type."""
    cells = GaugeMetricFamily(
        "slotwise_infer_cells_used", "KV cells held by each slot's sequence", labels=["slot"]
    )
    for seq, n in enumerate(snap.cells):
        cells.add_metric([str(seq)], n)
    yield cells
    yield GaugeMetricFamily("slotwise_infer_capacity_cells", "KV cells per slot", value=capacity)
    yield GaugeMetricFamily("slotwise_infer_queue_depth", "requests waiting", value=snap.waiting)
    yield GaugeMetricFamily("slotwise_infer_active", "slots generating", value=snap.active)
    shifts = CounterMetricFamily("slotwise_infer_shifts", "context shifts", labels=["policy"])
    for policy, n in sorted(snap.stats.shifts_by_policy.items()):
        shifts.add_metric([policy], n)
    yield shifts
    for i, (name, help_) in enumerate((
        ("draft_tokens", "speculative drafts verified, by type"),
        ("accepted_tokens", "speculative drafts the model sampled the same, by type"),
        ("draft_cache_hits", "speculative drafts from the tenant's earlier requests (suffix)"),
    )):  # fmt: skip
        drafts = CounterMetricFamily(f"slotwise_infer_{name}", help_, labels=["type"])
        for kind, counts in sorted(snap.stats.drafts_by_type.items()):
            drafts.add_metric([kind], counts[i])
        yield drafts


def first_token_metric(ttft: Latencies) -> Metric:
    """The engine's time-to-first-token histogram (cumulative buckets, as Prometheus has them)."""
    buckets, seen = [], 0
    bounds = (*(floatToGoString(b) for b in TTFT_BUCKETS), "+Inf")  # ("30.0", as before)
    for bound, n in zip(bounds, ttft.counts, strict=True):
        seen += n
        buckets.append((bound, seen))
    return HistogramMetricFamily(
        "slotwise_infer_time_to_first_token_seconds",
        "from the start of a request in its slot to its first sampled token",
        buckets=buckets,
        sum_value=ttft.total,
    )


def work_metrics(snap: EngineSnapshot) -> Iterable[Metric]:
    """What the engine did: cells evicted, tokens, decodes, the media cache, sessions' bytes."""
    st = snap.stats
    for name, help_, value in (
        ("evicted_cells", "cells evicted", st.num_evicted_cells),
        ("generated_tokens", "tokens sampled (rate() = tokens/s)", st.num_generated_tokens),
        ("decodes", "llama_decode calls", st.num_decodes),
        ("media_cache_hits", "projector outputs reused", snap.cache_hits),
        ("session_bytes_written", "bytes of session checkpoints and journals",
         snap.session_bytes_written),
        ("session_reprefill_cells",
         "cells decoded again on a swap-in: what the session's checkpoint lacked",
         st.num_session_reprefill_cells),
    ):  # fmt: skip
        yield CounterMetricFamily(f"slotwise_infer_{name}", help_, value=value)


def tenant_metrics(st: EngineStats, sessions: dict[str, Any]) -> Iterable[Metric]:
    """Each tenant's requests, tokens and queue wait, and the sessions it holds."""
    by_tenant = sorted(st.by_tenant.items())
    for name, help_, value in (
        ("requests", "requests started in a slot, by tenant", "num_requests"),
        ("generated_tokens", "tokens sampled, by tenant", "num_generated_tokens"),
        ("queue_wait_seconds", "seconds waited in the queue, by tenant",
         "queue_wait_seconds"),
    ):  # fmt: skip
        family = CounterMetricFamily(f"slotwise_infer_tenant_{name}", help_, labels=["tenant"])
        for tenant, t in by_tenant:
            family.add_metric([tenant], getattr(t, value))
        yield family
    by_owner = sorted(sessions.items())
    for family_of, name, help_, value in (
        (GaugeMetricFamily, "sessions",
         "sessions a tenant holds, in memory or on disk (as this replica knows them)",
         "num_sessions"),
        (GaugeMetricFamily, "session_bytes",
         "bytes a tenant's sessions take on disk (files and their images' pixels)",
         "num_bytes"),
        (CounterMetricFamily, "sessions_expired",
         "sessions deleted here after going unused past --session-ttl", "num_expired"),
        (CounterMetricFamily, "sessions_evicted",
         "sessions deleted here to keep their tenant within its quota", "num_evicted"),
    ):  # fmt: skip
        per_tenant = family_of(f"slotwise_infer_tenant_{name}", help_, labels=["tenant"])
        for tenant, held in by_owner:
            per_tenant.add_metric([tenant], getattr(held, value))
        yield per_tenant


def pool_metrics(pool: PoolFigures | None, st: EngineStats) -> Iterable[Metric]:
    """(--kv-unified) The pool's cells, each counted once, and its shared prefixes."""
    if pool is None:
        return
    for name, help_, value in (
        ("pool_cells", "KV cells in the pool every sequence draws from", pool.num_cells),
        ("pool_cells_used", "the pool's cells in use, each counted once", pool.num_used),
        ("shared_cells", "cells of shared prefixes, stored once for every sequence sharing them",
         pool.num_held),
        ("shared_prefix_holders", "shared prefixes kept", pool.num_holders),
        ("shared_prefix_holders_in_use", "shared prefixes a sequence shares now",
         pool.num_holders_in_use),
    ):  # fmt: skip
        yield GaugeMetricFamily(f"slotwise_infer_{name}", help_, value=value)
    for name, help_, value in (
        ("shared_prefix_requests", "requests that began on a shared prefix",
         st.num_shared_prefixes),
        ("shared_prefix_cells_reused", "cells those requests did not decode",
         st.num_shared_cells),
        ("pool_waits", "steps a prompt waited for the pool's cells", st.num_pool_waits),
        ("pool_preemptions", "generations put aside in host memory for another tenant's prompt",
         st.num_preemptions),
        ("pool_sessions_reclaimed", "idle sessions swapped out of the pool for a prompt",
         st.num_sessions_reclaimed),
    ):  # fmt: skip
        yield CounterMetricFamily(f"slotwise_infer_{name}", help_, value=value)
