"""What the engine's parts share: a request (Job), a slot, the engine's errors and counters."""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from infer_service.events import (
    ErrorKind,
    Event,
    Problem,
    ProblemError,
    Reason,
    TokenDelta,
    Usage,
    problem,
)
from infer_service.kv.host_cache import LoraSet, ReuseKey
from infer_service.kv.ledger import CannotFit, ContextConfig, Item, Ledger
from infer_service.kv.pool import Share
from infer_service.kv.view import MAX_SHIFT_MARKS, SequenceRuns, ShiftMark
from infer_service.runner.media import MediaHandle, Pixels, media_key
from infer_service.runner.reasoning import Thoughts, ThoughtTracker
from infer_service.runner.runtime import SamplingConfig
from infer_service.runner.sampling import Constraint, SamplerSpec, SlotSampler
from infer_service.runner.text_stream import TextStream
from infer_service.spec.drafting import SpecConfig, Speculation
from slotwise_core.descriptors import MediaChunk, PreparedPrompt
from slotwise_core.keys import DEFAULT_TENANT

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("slotwise.engine")
T = TypeVar("T")


class QueueFullError(ProblemError):
    pass


class SessionError(ProblemError):
    def __init__(self, kind: ErrorKind, message: str, reason: Reason = Reason.INTERNAL):
        super().__init__(Problem(kind, message, reason))


class EngineStoppedError(ProblemError):
    """The engine thread is gone (stopped, or died): nothing more will run."""


@dataclass(eq=False)  # a job is itself: the wait queue removes this one, not an equal one
class Job:
    items: list[Item]
    # media key -> its native chunk; a session's turn reads its session's (which it does not own)
    media: Mapping[str, MediaHandle]
    emit: Callable[[Event], None]
    sampling: SamplingConfig = SamplingConfig()
    context: ContextConfig = ContextConfig()
    max_tokens: int = 256
    stop: Sequence[str] = ()
    deadline: float | None = None  # time.monotonic()
    session_id: str | None = None
    stream_tokens: int = 1  # tokens per TokenDelta
    pixels: dict[str, Pixels] = field(default_factory=dict)
    rgb: dict[str, bytes] = field(default_factory=dict)  # media_id -> pixels (session turns)
    cancelled: threading.Event = field(default_factory=threading.Event)
    resume: int | None = None  # a StateCache entry to continue (chosen with the slot)
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None  # None: no log-probabilities
    note: bytes = b""  # a session turn's, kept with its record
    tenant: str = DEFAULT_TENANT
    cache_salt: str = ""  # narrows reuse further: only requests with the same salt share KV
    lora: LoraSet = ()  # the LoRA adapters it decodes under (a batch holds one set)
    speculative: SpecConfig = SpecConfig()  # drafts verified in the step's batch
    reasoning: Thoughts | None = None  # a reasoning model's thoughts: marked, and budgeted
    submitted: float = field(default_factory=time.monotonic)  # (queue wait)

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def reuse_key(self) -> ReuseKey:
        """KV computed for one tenant (and salt, and LoRA adapters) is never handed to
        another."""
        return (self.tenant, self.cache_salt, self.lora)

    @property
    def sampler_spec(self) -> SamplerSpec:
        return SamplerSpec(self.sampling, self.constraint, self.logit_bias, self.top_logprobs)

    def release(self) -> None:
        if isinstance(self.media, dict):  # (its own; a session's mapping is the session's)
            for h in self.media.values():
                h.close()

    def expired(self, now: float) -> bool:
        return self.cancelled.is_set() or (self.deadline is not None and now > self.deadline)


def prompt_items(prompt: PreparedPrompt) -> tuple[list[Item], dict[str, Pixels]]:
    """Descriptor chunks -> ledger items (media keyed per slice of an image), and where the
    pixels of each media key come from."""
    items = []
    pixels: dict[str, Pixels] = {}
    slices: dict[int, int] = {}
    for c in prompt.chunks:
        group = c.media_group or None
        if isinstance(c, MediaChunk):
            k = slices.get(c.media_group, 0)
            slices[c.media_group] = k + 1
            key = media_key(c.media_id, k)
            pixels[key] = Pixels(c.width, c.height, c.media_id, c.kind)
            items.append(
                Item(c.num_cells, c.num_positions, c.message_index, media_id=key, group=group)
            )
        else:
            n = len(c.token_ids)
            items.append(Item(n, n, c.message_index, token_ids=c.token_ids, group=group))
    return items, pixels


@dataclass
class MediaPiece:
    """A media chunk entering the cache a piece per step."""

    item: Item
    embd: np.ndarray
    positions: np.ndarray
    non_causal: bool = False  # decoded whole, with non-causal attention
    offset: int = 0  # embeddings decoded so far


@dataclass
class Slot:
    seq: int
    job: Job | None = None
    ledger: Ledger | None = None  # what the sequence holds, also between requests
    owner: str | None = None  # session id whose sequence this is
    reuse_key: ReuseKey | None = None  # whose stateless sequence it holds (None: nobody's)
    pending: deque[Item] = field(default_factory=deque)
    sampler: SlotSampler | None = None
    spec: Speculation | None = None  # the request's drafting, when it speculates
    thoughts: ThoughtTracker | None = None  # where the reply is in its thoughts (reasoning)
    reply: list[str] = field(default_factory=list)  # a session turn's text, for its record
    text: TextStream = field(default_factory=TextStream)
    unsent: TokenDelta | None = None  # tokens held for the next TokenDelta (stream_tokens > 1)
    piece: MediaPiece | None = None  # a media chunk being decoded, a piece per step
    share: Share | None = None  # (pool) a pinned prefix to hold for others once decoded
    usage: Usage = field(default_factory=Usage)
    num_prefill_total: int = 0
    num_prefill_done: int = 0
    prefilling: bool = True
    reply_index: int = 0  # message index of generated tokens
    # (recurrent memory) where in its prompt (cells decoded) a step stops for a checkpoint
    checkpoint_at: frozenset[int] = frozenset()
    # (pool) a generation put aside for another tenant's prompt: its whole state, in host
    # memory, until the pool has room for it again (its cells are no longer in llama.cpp)
    preempted: memoryview | None = None
    # the latest shifts in this slot (each names whose sequence it was), newest first
    shifts: deque[ShiftMark] = field(default_factory=lambda: deque(maxlen=MAX_SHIFT_MARKS))
    num_shift_marks: int = 0  # (a mark's id: per slot, so that it tells nothing of others)
    runs: SequenceRuns = field(default_factory=SequenceRuns)  # what a look at it last saw
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def num_cells(self) -> int:
        return self.ledger.num_cells if self.ledger else 0


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
    shifts_by_policy: dict[str, int] = field(default_factory=dict)
    # speculative decoding, by type: [tokens drafted, tokens accepted]
    drafts_by_type: dict[str, list[int]] = field(default_factory=dict)
    by_tenant: dict[str, TenantStats] = field(default_factory=dict)  # (tenants: the keys file's)
    # from a request's start in its slot to its first sampled token
    time_to_first_token: Latencies = field(default_factory=Latencies)

    def count_drafts(self, spec_type: str, num_drafted: int, num_accepted: int) -> None:
        counts = self.drafts_by_type.setdefault(spec_type, [0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted

    def tenant(self, name: str) -> TenantStats:
        stats = self.by_tenant.get(name)
        if stats is None:
            stats = self.by_tenant[name] = TenantStats()
        return stats


def too_long(plan: CannotFit) -> Problem:
    """A prompt that can never fit: INVALID_ARGUMENT, not the transient RESOURCE_EXHAUSTED."""
    return problem(
        ErrorKind.INVALID_ARGUMENT,
        Reason.PROMPT_TOO_LONG,
        plan.message,
        cells_needed=plan.num_cells_needed,
        capacity=plan.num_capacity_cells,
        pinned_cells=plan.num_pinned_cells,
    )


def cancelled(deadline: bool, why: str) -> Problem:
    if deadline:
        return Problem(ErrorKind.DEADLINE_EXCEEDED, why, Reason.DEADLINE_EXCEEDED)
    return Problem(ErrorKind.CANCELLED, why, Reason.CANCELLED)


def resolve(future: Future[T], result: T | None = None, error: BaseException | None = None) -> bool:
    """Settle a future whose waiter may have given up on it (cancelled), or that is settled
    already: that is no error. Returns whether this call settled it."""
    if future.done():
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
    return True


def emit_best_effort(emit: Callable[[Event], None], event: Event) -> None:
    """Tell a caller that may already be gone (its loop closed): that must not stop us."""
    try:
        emit(event)
    except Exception:
        log.debug("a caller could not be told %r", event, exc_info=True)
