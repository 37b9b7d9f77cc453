"""A slot: one llama.cpp sequence, the request it runs and what it holds between requests."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer_service.events import Usage
from infer_service.kv.host_cache import ReuseKey
from infer_service.kv.ledger import Item, Ledger
from infer_service.kv.pool import Share
from infer_service.kv.view import MAX_SHIFT_MARKS, SequenceRuns, ShiftMark
from infer_service.runner.job import Job
from infer_service.runner.reasoning import ThoughtTracker
from infer_service.runner.sampling import SlotSampler
from infer_service.spec.drafting import Speculation

if TYPE_CHECKING:
    import numpy as np


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
    piece: MediaPiece | None = None  # a media chunk being decoded, a piece per step
    share: Share | None = None  # (pool) a pinned prefix to hold for others once decoded
    usage: Usage = field(default_factory=Usage)
    num_confirmed: int = 0  # drafts its latest step confirmed
    num_confirmed_cells: int = 0  # ... of which the sequence holds the cells (not replayed)
    # (hybrid memory) the recurrent state before the step that verifies a draft longer than
    # llama.cpp rolls back in place, and the ledger's segment count then
    spec_checkpoint: tuple[bytes, int] | None = None
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
