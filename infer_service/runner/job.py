"""A request as the engine runs it (Job), and a prepared prompt's chunks as ledger items."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from infer_service.events import Event
from infer_service.kv.host_cache import LoraSet, ReuseKey
from infer_service.kv.ledger import ContextConfig, Item
from infer_service.runner.media import MediaHandle, Pixels, media_key
from infer_service.runner.reasoning import Thoughts
from infer_service.runner.runtime import SamplingConfig
from infer_service.runner.sampling import Constraint, SamplerSpec
from infer_service.spec.config import SpecConfig
from slotwise_core.descriptors import MediaChunk, PreparedPrompt
from slotwise_core.keys import DEFAULT_TENANT


class Mailbox(Protocol):
    """Where a job's events go: its caller's, on whatever thread posts them (the engine's, once
    a step; a disk worker's, for a turn's save). It never blocks, and it never fails because
    its reader is gone."""

    def post(self, events: Sequence[Event]) -> None: ...


@dataclass(eq=False)  # a job is itself: the wait queue removes this one, not an equal one
class Job:
    items: list[Item]
    # media key -> its native chunk; a session's turn reads its session's (which it does not own)
    media: Mapping[str, MediaHandle]
    mailbox: Mailbox
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


class KeptEvents(list[Any]):
    """A mailbox that keeps what it is posted, for callers in the engine's own process (the
    oracles, the benchmarks that drive the executor)."""

    def post(self, events: Sequence[Any]) -> None:
        self.extend(events)
