"""The executor: the only code that calls llama.cpp for a slot.

Every item a slot decodes is one transaction: the ledger's `ensure` -> the plan carried out in
the cache (seq_rm / seq_add / seq_clear) -> llama_decode -> the ledger's `append`. A step puts
one piece (at most a batch) of each slot's media chunk into the cache, then every slot's next
text (one generated token, or up to batch_size prompt tokens) into ONE llama_decode, and
samples every slot whose logits came out of it. While some slots generate, a prompt (or an
image's embeddings) goes in pieces (infer_service/runner/step_budget.py), so that their tokens keep
coming while it prefills.

Images are encoded on a worker beside llama_decode: the other slots keep decoding while one
waits for its image (libmtmd's encode and llama.cpp's decode share no state, and the
embeddings are copied out of the mtmd context before the executor sees them).

A step returns what happened (`StepOutcome`): the requests it ended, with their usage and
reply, the slots it shifted, the first tokens it sampled. The engine applies that after the
step (events, session records and writes); nothing the executor calls reaches back into the
engine. A job's media chunks are in `job.media` (a session turn's: its session's). The oracle
(tests/oracle.py) drives this same code, with an observer that checks the cache against the
ledgers after every plan, and after every step.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import numpy as np
from llama_cpp import mtmd_cpp

from infer_service.events import (
    ContextShift,
    CorruptSessionError,
    ErrorKind,
    Event,
    FinishReason,
    PrefillProgress,
    Problem,
    ProblemError,
    Reason,
    Rejected,
    Started,
    TokenLogprobs,
    Usage,
    too_long,
)
from infer_service.kv.host_cache import HostSequenceCache, LoraSet, reuse_of
from infer_service.kv.ledger import (
    CannotFit,
    ContextConfig,
    Fits,
    Gap,
    Item,
    Ledger,
    Plan,
    Policy,
    Reprefill,
    Segment,
    Shift,
    atoms,
    num_pinned,
    text_like,
)
from infer_service.kv.pool import Holder, Pool, PoolFigures, Share
from infer_service.kv.view import ShiftMark, at_cell, runs
from infer_service.runner.draft_model import DraftModel
from infer_service.runner.grammar_worker import GrammarTooCostly, GrammarWorker
from infer_service.runner.job import Job
from infer_service.runner.media import MediaHandle
from infer_service.runner.mtp import MtpDrafter
from infer_service.runner.plan import SlotChoice, StepPlan
from infer_service.runner.prefill_order import (
    UNMEASURED_SECONDS_PER_CELL,
    admitted,
    priority,
    step_budget,
)
from infer_service.runner.reasoning import ThoughtTracker
from infer_service.runner.runtime import RANDOM_SEED, EmbeddingCache, Runtime
from infer_service.runner.sampling import ConstraintError, GrammarDeadEnd, SlotSampler
from infer_service.runner.slot import MediaPiece, Slot
from infer_service.runner.stats import EngineStats
from infer_service.runner.step_budget import prefill_budget
from infer_service.spec.config import SpecType
from infer_service.spec.drafting import NO_TOKEN, Speculation
from infer_service.spec.length import StepCost
from infer_service.spec.proposers import make_proposer
from infer_service.spec.stores import DraftStores
from slotwise_core import native
from slotwise_core.lru import SizedLRU

log = logging.getLogger("slotwise.engine")

WORTH_KEEPING = 32  # cells: a displaced sequence smaller than this is not worth a cache entry
WORTH_SHARING = 32  # cells: a pinned prefix smaller than this is decoded by each slot itself


@dataclass
class Ending:
    """A request the executor finished: its slot is free, the rest is the output processor's
    to tell (infer_service/engine/outputs.py)."""

    slot: Slot
    job: Job
    reason: FinishReason
    usage: Usage
    error: str = ""
    stop_string: str = ""
    problem: Problem | None = None


@dataclass(frozen=True, slots=True)
class Sampled:
    """A token the step sampled for a request: its text is the output processor's to make."""

    token: int
    logprobs: TokenLogprobs | None = None
    piece: bytes | None = None  # its bytes, when the step read them (a thought tracker's)
    at: int = 0  # its place among the tokens the step sampled for the request (drafts: > 0)


@dataclass
class StepOutcome:
    """What a plan's step did, for the output processor to tell: each request's events and
    tokens in the order they happened, then the requests it finished."""

    events: list[tuple[Job, Event | Sampled]] = field(default_factory=list)
    endings: list[Ending] = field(default_factory=list)
    # jobs that left without a slot, each with its one event (the plan's, and refused starts)
    dropped: list[tuple[Job, Event]] = field(default_factory=list)
    # (a session's turn) slots whose sequence lacks what its ledger says: never saved
    unsaved: list[Slot] = field(default_factory=list)
    shifted: list[Slot] = field(default_factory=list)  # one entry per shift carried out
    first_tokens: list[float] = field(default_factory=list)  # seconds from start (TTFT)
    # (pool) cells a prompt waits for that idle sessions hold: the engine swaps them out
    pool_wanted: int = 0


class Taken(NamedTuple):
    """A slot's text in the step's batch."""

    slot: Slot
    item: Item  # a generating slot's: its last token, then its drafts
    logits_at: int | None  # batch index of the first logits (None: a prompt piece)
    drafts: tuple[int, ...] = ()
    at: int = 0  # batch index of its first token
    parts: tuple[Item, ...] = ()  # what the ledger gets: a segment per message (default: item)


class StepObserver(Protocol):
    """What the oracle looks at inside a step (given at construction; the engine has none)."""

    def on_plan(self, slot: Slot) -> None: ...  # a shift carried out, before the next decode

    def on_cannot_fit(self, slot: Slot, plan: CannotFit, num_cells: int) -> None: ...


class Executor:
    def __init__(
        self,
        rt: Runtime,
        stats: EngineStats,
        *,
        cache_bytes: int = 1 << 30,
        host_sequence_bytes: int = 256 << 20,
        notify: Callable[[], None] = lambda: None,
        observer: StepObserver | None = None,
        draft_model: DraftModel | None = None,
        slots: Sequence[Slot] = (),
        spec_cache_bytes: int = 256 << 20,
    ):
        self.runtime = rt
        self.slots = slots  # every slot: the pool counts their cells
        # one pool of cells, where slots share pinned prefixes (None: a budget per slot)
        self.pool = Pool(rt.num_cells, rt.holder_seqs) if rt.config.kv_unified else None
        self._reserved = 0  # cells the step's batch takes before its decode (the pool's)
        self.draft_model = draft_model  # speculative's draft-simple: guesses of a small model
        self.stats = stats
        self.cache = EmbeddingCache(cache_bytes)
        self.host_sequences = HostSequenceCache(
            host_sequence_bytes
        )  # stateless conversations that lost a slot
        self._notify = notify  # an encode finished: the engine may sleep
        self._encoder = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="media-encode",
            initializer=_niced, initargs=(rt.config.encode_nice,),
        )  # fmt: skip
        self._encoding: dict[str, Future[np.ndarray]] = {}  # media key -> its encode
        self._encoded: dict[str, np.ndarray] = {}  # finished, until their slot decodes them
        self._observer = observer
        self.grammars = GrammarWorker()  # every slot's grammar work, each call under a budget
        self.step_cost = StepCost()  # what a draft costs to verify, for slots to weigh it by
        self.prefill_cost = StepCost()  # what a prompt token costs a step: who joins one
        # when a prompt started and how long it waited (its place in a step: aging); an oracle
        # stops it, so that a seed replays the same steps
        self.clock: Callable[[], float] = time.perf_counter
        # what drafts learn across requests, per tenant (ngram-mod, ngram-cache, suffix)
        self.draft_stores = DraftStores(spec_cache_bytes)
        # the acceptance its drafts last ended with, per tenant and types: a request starts
        # drafting where the tenant's last one of its kind ended (a tenant's own figure)
        self._acceptance: SizedLRU[tuple[str, tuple[SpecType, ...]], float] = SizedLRU(
            1024, lambda _: 1
        )  # (a count of entries)
        self._outcome = StepOutcome()  # what the step under way did so far
        self._preempting: list[Slot] = []  # (pool) to put aside once the step's decode is done
        self._num_generating = 0  # slots of the step under way that generate (not prefilling)

    def close(self) -> None:
        self._encoder.shutdown(wait=True, cancel_futures=True)
        self.grammars.close()
        if self.draft_model is not None:
            self.draft_model.close()

    def new_ledger(self, ctx: ContextConfig) -> Ledger:
        return Ledger(
            self.runtime.num_cells_per_slot,
            can_shift=self.runtime.can_shift,
            n_ctx_train=self.runtime.n_ctx_train,
            policy=ctx.policy,
            keep=ctx.keep,
            discard_fraction=ctx.discard_fraction,
            unit=ctx.unit,
            recurrent=self.runtime.recurrent,
            max_marks=self.runtime.config.ctx_checkpoints,
        )

    # -- a slot's sequence as a whole ---------------------------------------------------------

    def clear(self, slot: Slot) -> None:
        self.runtime.seq_clear(slot.seq)
        if self.runtime.mtp is not None:
            self.runtime.mtp.clear(slot.seq)
        slot.share = None
        if self.pool is not None:
            self.pool.unshare(slot.seq)

    def _rewind(
        self, slot: Slot, ledger: Ledger, num_segments: int, num_tokens: int = 0,
        *, held: int | None = None,
    ) -> list[Item]:  # fmt: skip
        """The sequence keeps the ledger's first segments (and num_tokens of the next): in
        llama.cpp first, then in the ledger. Returns what must be decoded again to hold all of
        them: on recurrent memory the cut goes back to the last checkpoint before it. `held`:
        the segments the sequence holds (a saved state older or newer than the ledger), by
        default all. A refused call clears the sequence: everything is decoded again."""
        k = ledger.cut_point(num_segments, num_tokens, held=held)
        try:
            if k is None:
                if not ledger.recurrent:
                    self.runtime.seq_rm(slot.seq, ledger.pos_at(num_segments, num_tokens), -1)
                ledger.truncate(num_segments, num_tokens)
                redo: list[Item] = []
            else:
                redo = ledger.redo(k, num_segments, num_tokens)
                if k == 0:
                    self.clear(slot)
                else:
                    self.runtime.restore(slot.seq, ledger.marks[k], ledger.pos_at(k))
                    self.stats.num_checkpoint_restores += 1
                ledger.truncate(k)
        except native.NativeError as e:
            log.warning("slot %d: %s; its sequence is decoded again", slot.seq, e)
            redo = ledger.redo(0, num_segments, num_tokens)
            self.clear(slot)
            ledger.truncate(0)
        if self.pool is not None:
            self.pool.cut(slot.seq, ledger.num_cells)
        return redo

    def _checkpoint(self, slot: Slot, *, due: bool = False) -> None:
        """(recurrent memory) Save the slot's recurrent state where its ledger ends, if `due`
        (the end of the pinned prefix, of a prompt, of a reply) or a long prompt went
        `checkpoint_min_step` cells past the last one. A failed save only costs reuse."""
        ledger = slot.ledger
        if not self.runtime.recurrent or ledger is None or not ledger.max_marks or slot.piece:
            return
        n = ledger.num_segments
        if not n or n in ledger.marks:
            return
        due = due or n == ledger.num_pinned_segments
        if not due and ledger.num_cells_since_mark() < self.runtime.config.checkpoint_min_step:
            return
        try:
            ledger.mark(self.runtime.checkpoint(slot.seq))
        except native.NativeError as e:
            log.warning("slot %d: no checkpoint: %s", slot.seq, e)
            return
        self.stats.num_checkpoints += 1

    def state_of(self, slot: Slot) -> memoryview:
        """The sequence's whole state, shared prefix included: a restore gets its own copy
        (a reference would break when the holder left the pool in between)."""
        return self.runtime.state_get(slot.seq)

    def load_state(self, slot: Slot, state: bytes) -> bool:
        if self.pool is not None:
            self.pool.unshare(slot.seq)
        return self.runtime.state_set(slot.seq, state)

    def stash(self, slot: Slot) -> None:
        """Keep a stateless sequence that is about to be overwritten in the host cache: not one
        whose own cells are few beside a prefix the pool shares (a burst on one system prompt
        would copy the prefix out once per request, for a conversation that shares it again
        when it comes back)."""
        ledger = slot.ledger
        if (
            ledger is None
            or self.own_cells(slot) < WORTH_KEEPING
            or not self.host_sequences.max_bytes
        ):
            return
        if slot.reuse_key is not None:
            self.host_sequences.put(
                ledger.clone(), self.runtime.state_get(slot.seq), slot.reuse_key
            )

    def enter(self, slot: Slot, job: Job, resume: int | None = None) -> Ledger:
        """The ledger a stateless request continues: what the slot holds, or the cached
        sequence `resume` put back into it (what the slot held goes to the cache: after the
        take, so that its put cannot evict the entry being taken). A sequence of another
        tenant (or salt) is never continued: the slot starts empty. (An entry that left the
        cache since it was chosen is no error: the slot goes on with what it holds.)"""
        if resume is not None and resume in self.host_sequences:
            ledger, state = self.host_sequences.take(resume)
            self.stash(slot)
            self.clear(slot)
            slot.ledger = ledger if self.load_state(slot, bytes(state)) else None
        elif slot.ledger is not None and slot.reuse_key != job.reuse_key:
            self.stash(slot)
            self.clear(slot)
            slot.ledger = None
        if slot.ledger is None:
            slot.ledger = self.new_ledger(job.context)
        slot.reuse_key = job.reuse_key
        return slot.ledger

    # -- starting and finishing a request -----------------------------------------------------

    def _start_choice(self, choice: SlotChoice) -> None:
        """A choice of the plan starts; a refusal is its job's alone (it leaves, told why)."""
        slot, job, entry = choice.slot, choice.job, choice.entry
        tenant = self.stats.tenant(job.tenant)
        tenant.num_requests += 1
        tenant.queue_wait_seconds += time.monotonic() - job.submitted
        try:
            if entry is None:
                ledger, start, reprefill = self.enter(slot, job, choice.resume), 0, None
            else:
                ledger, start, reprefill = entry
            self.start(slot, job, ledger, start, reprefill=reprefill, resumed=choice.resume)
        except Exception as e:
            slot.job = None
            if isinstance(e, ProblemError):
                why = e.problem
            else:  # a bug: the request fails, the engine goes on
                log.exception("starting a request failed")
                why = Problem(ErrorKind.INTERNAL, f"internal error: {e}")
            if entry is not None and entry.reprefill is not None:
                self._outcome.unsaved.append(slot)  # its next turn re-prefills it
            self._outcome.dropped.append((job, Rejected(why)))

    def start(
        self,
        slot: Slot,
        job: Job,
        ledger: Ledger,
        start: int = 0,
        *,
        reprefill: int | None = None,
        resumed: int | None = None,
    ) -> None:
        """Reuse what the sequence shares with the job's prompt, admit the rest and make the
        job the slot's. `start`: the segments before it are the session's and stay.
        `reprefill`: the sequence holds only the ledger's segments before this one (a
        checkpoint older than the ledger; 0: its saved state did not load); those the ledger
        keeps after it are decoded again. `resumed`: the host sequence `enter` put back in
        the slot. A refused prompt raises ProblemError."""
        if job.sampler_spec.constraint is not None and self.grammars.full(job.tenant):
            raise ProblemError(
                Problem(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    "this tenant's grammars that ran past their budget are still being "
                    "followed; retry shortly",
                    Reason.GRAMMAR_TOO_COSTLY,
                    retry_after=1.0,
                    field="constraint.grammar",
                )
            )
        try:  # first: a refusal here changes nothing
            sampler = SlotSampler(self.runtime, job.sampler_spec, self.grammars, owner=job.tenant)
        except ConstraintError as e:
            bad = Problem(ErrorKind.INVALID_ARGUMENT, str(e), Reason.BAD_REQUEST)
            raise ProblemError(bad) from e
        try:
            self._begin(slot, job, ledger, start, sampler, reprefill=reprefill, resumed=resumed)
        except BaseException:
            if slot.sampler is not sampler:  # (not the slot's yet: nobody else frees it)
                sampler.close()
            raise

    def _begin(
        self,
        slot: Slot,
        job: Job,
        ledger: Ledger,
        start: int,
        sampler: SlotSampler,
        *,
        reprefill: int | None,
        resumed: int | None,
    ) -> None:
        ctx = job.context
        ledger.reconfigure(
            policy=ctx.policy, keep=ctx.keep, discard_fraction=ctx.discard_fraction, unit=ctx.unit
        )
        num_before = sum(seg.num_cells for seg in ledger.segments[:start])
        reused = self._reuse(slot, job, ledger, start, reprefill, resumed)
        # (a turn whose session state was decoded again, or cut back before it began, reuses
        # none of its own)
        num_reused = max(0, ledger.num_cells - num_before)
        # a reused M-RoPE image holds more cells than positions: count its positions
        num_reused_positions = sum(seg.num_positions for seg in ledger.segments[start:])
        kept, dropped = _admitted(job, ledger, reused.rest, reused.continued)
        self._occupy(slot, job, ledger, sampler, deque([*reused.restore, *kept]))
        slot.reply_index = max((i.message_index for i in kept), default=0)
        prompt, before = [*reused.again_in_turn, *kept], reused.again_before
        slot.usage = Usage(
            num_prompt_cells=num_reused
            + sum(i.num_cells for i in prompt)
            - sum(i.num_cells for i in before),
            num_prompt_positions=num_reused_positions
            + sum(i.num_positions for i in prompt)
            - sum(i.num_positions for i in before),
            num_reused_cells=num_reused,
        )
        self._record(
            job,
            Started(
                slot=slot.seq,
                num_prompt_cells=slot.usage.num_prompt_cells,
                num_prompt_positions=slot.usage.num_prompt_positions,
                num_capacity_cells=self.runtime.num_cells_per_slot,
                num_truncated_cells=sum(i.num_cells for i in dropped),
                num_truncated_chunks=len(dropped),
                truncated_media_ids=tuple(i.media_id for i in dropped if i.media_id),
                num_reused_cells=num_reused,
            ),
        )

    def _reuse(
        self,
        slot: Slot,
        job: Job,
        ledger: Ledger,
        start: int,
        reprefill: int | None,
        resumed: int | None,
    ) -> _Reused:
        """Cut the sequence back to what the job reuses of it (a session: what it holds; a
        stateless request: the longer of the continuation and the exact-prefix rule; (pool)
        the shared prefix of its kind), and say what is left to decode."""
        continued = False
        if job.session_id is not None:  # a session continues what it holds
            si, so, rest = ledger.common_prefix(job.items, start)
        else:
            # a resent conversation continues its sequence (shifted); any other request reuses
            # only what equals a fresh prefill of its prefix: same tokens in, same tokens out
            reuse = reuse_of(ledger, job.items)
            assert reuse is not None
            si, so, rest, continued = (
                reuse.num_segments,
                reuse.num_tokens,
                reuse.rest,
                reuse.continued,
            )
            if ledger.num_cells - reuse.num_cells >= WORTH_KEEPING and resumed is None:
                self.stash(slot)  # what the cut drops may be resumed later
        restore: list[Item] = []
        # (what is decoded again of the turn's own items is still its prompt; what is decoded
        # again of the session before it is not)
        again_in_turn: list[Item] = []
        if reprefill is not None and (si, so) > (reprefill, 0):
            # the saved state holds less than the turn reuses: the rest is decoded again
            restore = ledger.redo(reprefill, si, so)
            again_in_turn = ledger.redo(max(reprefill, start), si, so) if si >= start else []
            si, so = reprefill, 0
        uncut = ledger.segments
        rest = [*self._rewind(slot, ledger, si, so, held=reprefill), *rest]
        # (cut back before the turn began: the session's own items, decoded again)
        again_before = [seg.item for seg in uncut[len(ledger.segments) : min(start, si)]]
        if restore:
            self.stats.num_session_reprefills += 1
            self.stats.num_session_reprefill_cells += sum(i.num_cells for i in restore)
        if self.pool is not None:
            ledger.capacity = self.runtime.num_cells_per_slot  # (admission: the most a slot holds)
            self.pool.cut(slot.seq, ledger.num_cells)  # (what the reuse rule kept of it)
            slot.share = None
            shared = None
            if start == 0 and reprefill is None:
                shared = self._share_prefix(slot, job, ledger)
            if shared is not None:
                rest, continued, restore = list(job.items[shared:]), False, []
            self._pin_shared(slot, ledger)
        return _Reused(rest, continued, restore, again_in_turn, again_before)

    def _occupy(
        self, slot: Slot, job: Job, ledger: Ledger, sampler: SlotSampler, pending: deque[Item]
    ) -> None:
        """The job is the slot's now, its prompt pending."""
        spec = None
        if job.speculative.enabled:
            # (a salt narrows what drafts learn as it narrows KV reuse: a draft's usage would
            # tell one salt's user what another's said)
            owner = f"{job.tenant}\x00{job.cache_salt}"
            make = functools.partial(
                make_proposer, config=job.speculative, stores=self.draft_stores, tenant=owner
            )
            prior = self._acceptance.get((owner, job.speculative.kinds))
            seed = job.sampler_spec.sampling.seed  # (--spec-synth-rates' draws: the request's)
            spec = Speculation(
                job.speculative, history(ledger.segments, pending), self.step_cost, make,
                prior=0.9 if prior is None else prior,
                seed=None if seed == RANDOM_SEED else seed,
            )  # fmt: skip
        slot.job = job
        slot.ledger = ledger
        slot.pending = pending
        slot.sampler = sampler
        slot.spec = spec
        slot.thoughts = ThoughtTracker(job.reasoning) if job.reasoning is not None else None
        slot.num_prefill_total = sum(i.num_cells for i in slot.pending)
        slot.num_prefill_done = 0
        slot.checkpoint_at = (
            checkpoint_points(pending)
            if self.runtime.recurrent and ledger.max_marks
            else frozenset()
        )
        slot.prefilling = True
        slot.t_start = self.clock()

    # -- the pool (kv_unified) ----------------------------------------------------------------

    def _share_prefix(self, slot: Slot, job: Job, ledger: Ledger) -> int | None:
        """The job's pinned prefix from the pool. A slot that lacks it gets the holder's cells
        (their ids copied, nothing decoded): returns how many of the job's items that covers
        (None: nothing shared now). A prefix nobody holds is held once the slot decoded it."""
        pool = self.pool
        assert pool is not None
        share = shareable(job)
        if share is None:
            return None
        holder, num_items = self._held_prefix(job, share)
        if holder is None and 0 < pool.shared_cells(slot.seq) < WORTH_SHARING:
            # the slot begins with a few cells of another prefix (a chat template's header):
            # a sequence with another holder's cells cannot hold this one, which every later
            # request would then decode whole. Decoded again here, it can.
            self.clear(slot)
            ledger.truncate(0)
            slot.share = share
            return 0
        if holder is None or ledger.num_cells >= holder.num_cells:
            slot.share = share  # (the slot holds it, or will: it is held from there)
            self._hold(slot)
            return None
        self.clear(slot)
        ledger.truncate(0)
        ledger.adopt(holder.segments)
        self.runtime.seq_cp(holder.seq, slot.seq, 0, holder.next_pos)
        pool.share(slot.seq, holder)
        self._checkpoint(slot, due=True)  # (the holder's recurrent state came with the cells)
        for stats in (self.stats, self.stats.tenant(job.tenant)):
            stats.num_shared_prefixes += 1
            stats.num_shared_cells += holder.num_cells
        return num_items

    def _held_prefix(self, job: Job, share: Share) -> tuple[Holder | None, int]:
        """The holder of the job's pinned prefix, or else of the longest run of its first
        items that is held (a system prompt held alone, for a job that pins examples after
        it): the holder, and how many of the job's items it covers. (A look: not a use.)"""
        assert self.pool is not None
        holder = self.pool.get(share.key)
        if holder is not None:
            return holder, share.num_items
        ends, n = {}, 0  # atoms to each end of the job's pinned items that closes a group
        items = job.items
        for k, item in enumerate(items[: share.num_items - 1], 1):
            n += 1 if item.media_id is not None else len(item.token_ids)
            if item.group is None or items[k].group != item.group:
                ends[n] = k
        best: tuple[Holder | None, int] = (None, 0)
        whose, wanted = share.key
        for h in self.pool.holders:  # (nested: the job decodes the rest)
            held = h.key[1]
            k = ends.get(len(held), 0)
            if k > best[1] and h.key[0] == whose and wanted[: len(held)] == held:
                best = (h, k)
        return best

    def pooled_cells(self, job: Job) -> int:
        """(pool) The cells of the job's pinned prefix the pool holds: a slot that starts it
        begins with them, whatever it held."""
        share = shareable(job) if self.pool is not None else None
        if self.pool is None or share is None:
            return 0
        holder, _ = self._held_prefix(job, share)
        return holder.num_cells if holder else 0

    def own_cells(self, slot: Slot) -> int:
        """The slot's cells less those of its shared prefix (which stay in the pool)."""
        return slot.num_cells - (self.pool.shared_cells(slot.seq) if self.pool is not None else 0)

    def _pin_shared(self, slot: Slot, ledger: Ledger) -> None:
        """Shared cells stay pinned whatever the request keeps (and however its prompt went
        in: a piece that starts past `keep` is not pinned by it): a shift would move them for
        every sequence that has them."""
        assert self.pool is not None
        shared = self.pool.shared_cells(slot.seq)
        if shared > ledger.num_pinned_cells:
            ledger.reconfigure(
                policy=ledger.policy, keep=max(ledger.keep, shared),
                discard_fraction=ledger.discard_fraction, unit=ledger.unit,
            )  # fmt: skip

    def _hold(self, slot: Slot) -> None:
        """Once the slot holds its job's pinned prefix, exactly, the pool keeps it in a holder
        sequence (a copy of the cells' ids) for the slots that open with it next."""
        share, ledger, pool = slot.share, slot.ledger, self.pool
        if share is None or ledger is None or pool is None or slot.piece is not None:
            return
        if ledger.num_cells < share.num_cells:
            return  # not decoded yet
        slot.share = None
        if pool.find(share.key) is not None or pool.holder_of(slot.seq) is not None:
            return  # another slot was first; or some of its cells are another prefix's
        segments, n = ledger.segments, 0
        k = 0
        while n < share.num_cells:
            n += segments[k].num_cells
            k += 1
        if n != share.num_cells or k > ledger.num_exact_segments:
            return  # (one of its segments goes on past it, or it is not a fresh prefill)
        if self.runtime.recurrent and k != len(segments):
            return  # (a recurrent state copied whole: it must have seen the prefix alone)
        if atoms(segments[:k]) != share.key[1]:
            return
        holder, dropped = pool.hold(share.key, segments[:k])
        if dropped is not None:
            self.runtime.seq_clear(dropped.seq)
        if holder is not None:
            self.runtime.seq_cp(slot.seq, holder.seq, 0, holder.next_pos)
            pool.share(slot.seq, holder)
            self._pin_shared(slot, ledger)

    def _held(self) -> Iterator[tuple[int, int]]:
        return (
            (s.seq, s.ledger.num_cells)
            for s in self.slots
            if s.ledger is not None and s.preempted is None
        )

    def pool_free(self) -> int:
        """(pool) Cells no sequence holds, less what the step's batch is taking."""
        assert self.pool is not None
        return self.pool.num_cells - self.pool.num_used(self._held()) - self._reserved

    def pool_figures(self) -> PoolFigures | None:
        return None if self.pool is None else self.pool.figures(self._held())

    def _fit(self, slot: Slot, num_cells: int) -> None:
        """(pool) The slot's ledger may grow by what the pool has free, up to the most a slot
        holds; what no request uses (idle holders, idle stateless slots) is taken first."""
        ledger = slot.ledger
        if self.pool is None or ledger is None:
            return
        room = self.runtime.num_cells_per_slot - ledger.num_cells
        free = self.pool_free()
        if free < min(num_cells, room):
            self._reclaim(min(num_cells, room) - free, slot)
            free = self.pool_free()
        ledger.capacity = ledger.num_cells + max(0, min(free, room))  # (0: it waits)

    def _reclaim(self, num_cells: int, keeper: Slot) -> None:
        """Free cells that no request uses: holders nobody shares (least recently used
        first), then idle stateless slots' sequences (kept in the host cache)."""
        pool = self.pool
        assert pool is not None
        while num_cells > 0:
            idle = pool.idle()
            if idle:
                self.runtime.seq_clear(idle[0].seq)
                pool.drop(idle[0])
                num_cells -= idle[0].num_cells
                continue
            others = [
                s for s in self.slots
                if s is not keeper and s.job is None and s.owner is None and s.num_cells
            ]  # fmt: skip
            if not others:
                return
            other = max(others, key=lambda s: s.num_cells - pool.shared_cells(s.seq))
            num_cells -= other.num_cells - pool.shared_cells(other.seq)
            self.stash(other)
            self.clear(other)
            other.ledger, other.reuse_key = None, None

    def _waits_for_pool(self, slot: Slot, num_cells: int) -> bool:
        """(pool) A prompt that would fit in a slot of its own, short of cells only because
        other requests hold them, waits while something will free them: idle sessions (the
        engine swaps them out after this step, least recently used first), another tenant's
        generation holding more than its share of the pool (put aside in host memory now),
        or a generation's end. When nothing will, it ends, RESOURCE_EXHAUSTED."""
        ledger, job = slot.ledger, slot.job
        if self.pool is None or ledger is None or job is None or not slot.prefilling:
            return False
        if ledger.num_cells + num_cells > self.runtime.num_cells_per_slot:
            return False  # too long for any slot: its own policy decides
        others = [s for s in self.slots if s is not slot]
        idle = [s for s in others if s.job is None and s.owner is not None and self.own_cells(s)]
        victim = None if idle else self._victim(job.tenant)
        if idle:
            self._outcome.pool_wanted += num_cells
        elif victim is not None and victim not in self._preempting:
            self._preempting.append(victim)  # (after this step's decode: it may be in it)
        if idle or victim or any(s.job and not s.prefilling for s in others):
            self.stats.num_pool_waits += 1
            self.stats.tenant(job.tenant).num_pool_waits += 1
            return True
        why = Problem(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"the KV pool's {self.pool.num_cells} cells are held by other prompts; retry shortly",
            Reason.POOL_FULL,
            retry_after=1.0,
        )
        self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)
        return True

    def _victim(self, tenant: str) -> Slot | None:
        """(pool) The generation to put aside for `tenant`'s prompt: another tenant's, of the
        tenant holding the most beyond its fair share of the pool (its size over the tenants
        with requests in slots), the one of it holding the most cells. Session turns stay."""
        assert self.pool is not None
        held: dict[str, int] = {}
        for s in self.slots:  # (a generation put aside still claims its cells)
            if s.job is not None:
                mine = self.own_cells(s) if s.preempted is None else s.num_cells
                held[s.job.tenant] = held.get(s.job.tenant, 0) + mine
        fair = self.pool.num_cells // max(1, len(held | {tenant: 0}))
        candidates = [
            s for s in self.slots
            if s.job is not None and s.job.tenant != tenant and s.job.session_id is None
            and not s.prefilling and s.preempted is None
            and held[s.job.tenant] > fair and self.own_cells(s)
        ]  # fmt: skip
        if not candidates:
            return None
        return max(candidates, key=lambda s: (held[s.job.tenant], self.own_cells(s)))  # type: ignore[union-attr]

    def _preempt(self, slot: Slot) -> None:
        """Put a generation aside: its whole state to host memory, its cells freed. It goes on
        where it stopped once the pool has room again (`_resume`)."""
        state = self.runtime.state_get(slot.seq)  # (its own buffer: no second copy)
        self.runtime.seq_clear(slot.seq)
        if self.pool is not None:
            self.pool.unshare(slot.seq)
        slot.share, slot.preempted = None, state
        self.stats.num_preemptions += 1
        if slot.job is not None:
            self.stats.tenant(slot.job.tenant).num_preemptions += 1
        log.info("slot %d: put aside in host memory (%d cells) for another tenant's prompt",
                 slot.seq, slot.num_cells)  # fmt: skip

    def _short_of(self, slot: Slot) -> int:
        """(pool) The cells a put-aside generation lacks to go on, beside what the prompts being
        prefilled still need (else it would be put aside again at once): its cells, and one for
        its next token unless it is at its capacity (then its own policy makes that room: a
        generation put aside with a slot as large as the pool could never go on)."""
        assert slot.ledger is not None
        wanted = sum(
            i.num_cells
            for s in self.slots
            if s.job and s.prefilling and s.preempted is None
            for i in s.pending
        )
        grows = 1 if slot.ledger.num_free_cells > 0 else 0
        return slot.ledger.num_cells + grows + wanted - self.pool_free()

    def _reclaimable(self, keeper: Slot) -> tuple[int, int]:
        """(pool) Cells no request uses: idle holders' and idle stateless slots' (freed here),
        and idle sessions' (the engine swaps them out after the step; with a shared prefix
        counted whole: its holder is idle then, unless a request shares it too)."""
        assert self.pool is not None
        idle = [s for s in self.slots if s is not keeper and s.job is None]
        mine = sum(h.num_cells for h in self.pool.idle())
        mine += sum(self.own_cells(s) for s in idle if s.owner is None)
        return mine, sum(s.num_cells for s in idle if s.owner is not None)

    def can_resume(self, slot: Slot) -> bool:
        """(pool) A generation put aside could go on now (the engine steps for it then, and
        does not spin while it cannot)."""
        if slot.preempted is None or slot.ledger is None or self.pool is None:
            return False
        short = self._short_of(slot)
        return short <= 0 or sum(self._reclaimable(slot)) >= short

    def _resume(self, slots: Sequence[Slot]) -> None:
        """Generations put aside go on once the pool has room for them. What no request uses
        makes way (idle sessions after the step), but only where that is enough: a cache is not
        emptied for a generation that must wait for another's end anyway."""
        if self.pool is None:
            return
        for slot in slots:
            if slot.preempted is None or slot.ledger is None:
                continue
            short = self._short_of(slot)
            if short > 0:
                mine, sessions = self._reclaimable(slot)
                if mine + sessions < short:
                    continue  # (until a generation ends)
                self._reclaim(min(short, mine), slot)
                short = self._short_of(slot)
                if short > 0:
                    self._outcome.pool_wanted += short  # (idle sessions go after the step)
                    continue
            state, slot.preempted = slot.preempted, None
            if not self.runtime.state_set(slot.seq, state):  # (another layout? decoded again)
                log.warning("slot %d: its state did not load; decoded again", slot.seq)
                items = [seg.item for seg in slot.ledger.segments]
                slot.ledger.truncate(0)
                slot.pending.extendleft(reversed(items))

    def finish(
        self,
        slot: Slot,
        reason: FinishReason,
        *,
        error: str = "",
        stop_string: str = "",
        problem: Problem | None = None,
    ) -> Ending:
        """The slot's request is over: it leaves the slot, and this says how. The sequence
        stays for the next request with the same prefix, unless the request failed without a
        session."""
        usage = slot.usage
        job = self._vacate(slot, reason)
        return Ending(slot, job, reason, usage, error, stop_string, problem)

    def _vacate(self, slot: Slot, reason: FinishReason) -> Job:
        job = slot.job
        assert job is not None
        self._drop_piece(slot)
        if slot.preempted is not None:  # (ended while put aside: its conversation is kept)
            state, slot.preempted = slot.preempted, None
            if slot.ledger is not None and slot.reuse_key is not None:
                self.host_sequences.put(slot.ledger, state, slot.reuse_key)
            slot.ledger = None
        if reason is not FinishReason.ERROR:
            self._checkpoint(slot, due=True)  # (the end of its reply: the next turn's start)
        if slot.prefilling:
            slot.usage.prefill_seconds = self.clock() - slot.t_start
        if slot.sampler is not None:
            slot.sampler.close()
            slot.sampler = None
        slot.job = None
        if slot.spec is not None:
            slot.spec.close()  # (what it learnt goes to its tenant's stores)
            key = (f"{job.tenant}\x00{job.cache_salt}", slot.spec.config.kinds)
            self._acceptance.put(key, slot.spec.length.a)
        slot.spec = None
        slot.spec_checkpoint = None  # (a step that failed before its give-back leaves one)
        slot.thoughts = None
        slot.share = None
        slot.pending.clear()
        if reason is FinishReason.ERROR and job.session_id is None:
            self.clear(slot)
            slot.ledger = None
        job.release()
        return job

    def _finish(self, slot: Slot, reason: FinishReason, **why: Any) -> None:
        self._outcome.endings.append(self.finish(slot, reason, **why))

    def stopped(self, slot: Slot, job: Job, at: int, num_later: int) -> Ending | None:
        """The output processor found a stop string in the job's text at the step's token
        `at` for it, with `num_later` tokens sampled after it: those leave its usage, and the
        cells of the drafts confirmed after it its sequence (as if it had stopped there); it
        finishes (STOP), unless the step finished it already (its Ending says so then)."""
        slot.usage.num_generated_tokens -= num_later
        self.stats.num_generated_tokens -= num_later
        confirmed_after = max(0, slot.num_confirmed - at)
        if confirmed_after:
            slot.usage.num_accepted_tokens -= confirmed_after
            last = slot.spec.last if slot.spec is not None else None
            if last is not None and last.name in slot.usage.drafts_by_type:
                slot.usage.drafts_by_type[last.name][1] -= confirmed_after
        in_cells = max(0, slot.num_confirmed_cells - at)
        if in_cells and slot.preempted is None:  # (put aside: its saved state holds them)
            self._give_back(slot, in_cells)
        return self.finish(slot, FinishReason.STOP) if slot.job is job else None

    def _record(self, job: Job, event: Event | Sampled) -> None:
        """An event for the job's caller, told by the output processor once the step is over
        (the executor itself tells nobody anything)."""
        self._outcome.events.append((job, event))

    def take_outcome(self) -> StepOutcome:
        """What happened since the last take (all of a step; part of one that raised)."""
        outcome, self._outcome = self._outcome, StepOutcome()
        return outcome

    # -- the step -----------------------------------------------------------------------------

    def waits_for_encode(self, slot: Slot) -> bool:
        front = slot.pending[0] if slot.pending else None
        if front is None or not front.media_id or slot.job is None:
            return False
        encode = self._encoding.get(media_cache_key(slot.job, front.media_id))
        return encode is not None and not encode.done()

    @property
    def encoding(self) -> bool:
        return bool(self._encoding)

    def execute(self, plan: StepPlan) -> StepOutcome:
        """Carry out a plan: its overdue requests finish, its choices start, and every slot
        that can goes a step (at most one llama_decode per LoRA set, and media pieces)."""
        self._outcome.dropped.extend(plan.dropped)
        for slot, why in plan.overdue:
            self._finish(slot, FinishReason.CANCELLED, error=why.message, problem=why)
        for choice in plan.starts:
            self._start_choice(choice)
        if self._encoding or any(s.job for s in self.slots):
            self._step(self.slots)
            try:  # (a bounded slice: what ended requests gave the cache)
                self.draft_stores.work()
            except Exception:  # a bug there costs the cache a text, never the step
                log.exception("the draft stores' work failed")
                self.draft_stores.suffix.drop_pending()
        return self.take_outcome()

    def step(self, slots: Sequence[Slot]) -> StepOutcome:
        """A step of these slots alone, no plan (the oracles drive the executor so)."""
        self._step(slots)
        return self.take_outcome()

    def fail_all(self, e: Exception, plan: StepPlan) -> StepOutcome:
        """A step that raised (a bug): what it did before, every request in a slot finished,
        and every job of the plan not yet in its slot refused (INTERNAL); the engine goes on."""
        why = Problem(ErrorKind.INTERNAL, f"internal error: {e}", Reason.INTERNAL)
        for slot in self.slots:
            if slot.job is not None:
                self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)
        told = {id(job) for job, _ in self._outcome.dropped}
        for choice in plan.starts:
            if id(choice.job) not in told and not any(
                ending.job is choice.job for ending in self._outcome.endings
            ):
                self._outcome.dropped.append((choice.job, Rejected(why)))
        return self.take_outcome()

    def _step(self, slots: Sequence[Slot]) -> None:
        self._preempting = []  # (a step that raised leaves none behind)
        self._resume(slots)
        broken = self._collect_encodes()
        self._num_generating = sum(
            1 for s in slots if s.job and not s.prefilling and s.preempted is None
        )
        for slot in slots:
            if slot.preempted is not None:
                continue
            if slot.job and slot.pending and slot.pending[0].media_id:
                try:
                    error = broken.get(media_cache_key(slot.job, slot.pending[0].media_id))
                    if error is not None:
                        raise error
                    self._decode_media(slot)
                except Exception as e:  # this request's image: it ends alone (its sequence
                    # is cleared, or rolled back to its last completed turn)
                    log.warning("slot %d: media failed: %s", slot.seq, e)
                    lost = isinstance(e, CorruptSessionError)
                    failed = Problem(
                        ErrorKind.DATA_LOSS if lost else ErrorKind.INTERNAL,
                        f"the image could not be decoded: {e}",
                        Reason.MEDIA_FAILED,
                    )
                    self._finish(slot, FinishReason.ERROR, error=failed.message, problem=failed)
        self._decode_text(slots)
        if self._encoding or self._encoded:  # (nothing to look at on a plain text step)
            self._forget_unwanted_media(slots)
        victims, self._preempting = self._preempting, []
        for slot in victims:
            job = slot.job
            if job and job.session_id is None and slot.preempted is None and not slot.prefilling:
                self._preempt(slot)

    def _forget_unwanted_media(self, slots: Sequence[Slot]) -> None:
        """An encode no active request waits for any more (cancelled, deadline) and that has
        not started is dropped: stale work must not hold up the live requests behind it.
        Finished embeddings no slot is about to decode leave `_encoded` (they stay cached)."""
        wanted = {
            media_cache_key(s.job, i.media_id)
            for s in slots
            if s.job
            for i in s.pending
            if i.media_id
        }
        for key in [k for k in self._encoding if k not in wanted]:
            if self._encoding[key].cancel():
                del self._encoding[key]
        fronts = {
            media_cache_key(s.job, s.pending[0].media_id)
            for s in slots
            if s.job and s.pending and s.pending[0].media_id
        }
        for key in [k for k in self._encoded if k not in fronts]:
            del self._encoded[key]

    # -- media --------------------------------------------------------------------------------

    def _collect_encodes(self) -> dict[str, BaseException]:
        """Take the finished encodes: embeddings to decode, or the errors of those that
        failed (their requests end alone)."""
        failed: dict[str, BaseException] = {}
        if not self._encoding:
            return failed
        for key, future in [(k, f) for k, f in self._encoding.items() if f.done()]:
            del self._encoding[key]
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                failed[key] = error
            else:
                self._encoded[key] = embd = future.result()
                self.cache.put(key, embd)
        return failed

    def _embeddings(self, slot: Slot, media_key: str) -> np.ndarray | None:
        """The projector's output for the media key, or None while it is being encoded
        (started here on the encode worker, with its own copy of the chunk: the request may
        end first). Kept, and shared, within the job's tenant and salt only."""
        assert slot.job is not None
        key = media_cache_key(slot.job, media_key)
        embd = self._encoded.get(key)
        if embd is not None or key in self._encoding:
            return embd
        embd = self.cache.get(key)
        counts = self.stats.tenant(slot.job.tenant)
        if embd is not None:
            counts.num_media_cache_hits += 1
            return embd
        counts.num_media_cache_misses += 1
        copy = MediaHandle(mtmd_cpp.mtmd_input_chunk_copy(_media(slot, media_key).chunk), media_key)

        def encode() -> np.ndarray:
            try:
                return self.runtime.encode_media(copy.chunk)
            finally:
                copy.close()

        self._encoding[key] = future = self._encoder.submit(encode)
        future.add_done_callback(lambda _: copy.close())  # also when cancelled before it ran
        future.add_done_callback(lambda _: self._notify())
        return None

    def _decode_media(self, slot: Slot) -> None:
        """One piece (at most a batch) of the slot's media chunk per step, so the other slots'
        steps go on between the pieces. Room for the whole chunk is made, and the chunk
        entered in the ledger, before its first piece; a non-causal chunk goes whole."""
        if slot.piece is None and not self._begin_media(slot):
            return
        piece = slot.piece
        assert piece is not None
        item, offset = piece.item, piece.offset
        n = item.num_cells - offset
        if not piece.non_causal:
            n = min(n, self._prefill_budget(slot))
        assert slot.job is not None
        self.runtime.use_lora(slot.job.lora)  # (its cells are decoded under its adapters too)
        rc = self.runtime.decode_embeddings(
            piece.embd, piece.positions, offset, n, slot.seq, piece.non_causal
        )
        if rc != 0:
            raise native.NativeError(f"llama_decode of media failed (rc={rc})")
        piece.offset += n
        self._progress(slot, n)
        if piece.offset == item.num_cells:
            slot.piece = None
            slot.pending.popleft()
            self.stats.num_media_decodes += 1
            # (draft-mtp: the text after it pairs with its last row)
            self._mtp([slot.seq], "media row", lambda mtp: mtp.after_media(slot.seq, n - 1))
            self._hold(slot)
            self._checkpoint(slot)

    def _begin_media(self, slot: Slot) -> bool:
        item = slot.pending[0]
        assert item.media_id
        embd = self._embeddings(slot, item.media_id)
        if embd is None:
            return False  # encoding: this slot waits, the others go on
        if not self._make_room(slot, item.num_cells, item.num_positions, item.group):
            return False
        if not slot.pending or slot.pending[0] is not item:
            return False  # a reprefill put other items first
        assert slot.job and slot.ledger
        handle = _media(slot, item.media_id)
        if embd.size != item.num_cells * self.runtime.n_embd:  # never read past the embeddings
            raise native.NativeError(
                f"media {item.media_id[:12]}: {embd.size // self.runtime.n_embd} embeddings for "
                f"{item.num_cells} cells"
            )
        positions = self.runtime.media_positions(handle.chunk, slot.ledger.next_pos)
        slot.ledger.append(item)  # the whole chunk: a failure or cancel before the last piece
        # (removed again by _drop_piece)
        slot.piece = MediaPiece(item, embd, positions, self.runtime.non_causal(handle.chunk))
        return True

    def _drop_piece(self, slot: Slot) -> None:
        """A media chunk decoded in part leaves the ledger and the cache (its cells are not a
        prefix anyone may reuse)."""
        piece, slot.piece = slot.piece, None
        if piece is None or slot.ledger is None:
            return
        segments = slot.ledger.segments
        if segments and segments[-1].item is piece.item:  # (nothing follows it mid-chunk)
            self._rewind(slot, slot.ledger, len(segments) - 1)  # (what it redoes: nobody's)

    # -- text ---------------------------------------------------------------------------------

    def _prefill_budget(self, slot: Slot) -> int:
        """What of its prompt a slot may decode in this step (a piece while others generate)."""
        return prefill_budget(self.runtime.batch_size, self._num_generating, slot.num_prefill_total)

    def _decode_text(self, slots: Iterable[Slot]) -> None:
        """Every ready slot's next text: one llama_decode per LoRA adapter set among them
        (llama.cpp applies adapters to the whole context), the set the context has first, so
        that a step changes it as seldom as it can."""
        # short work first: a generating slot's one token always gets in, then the prompts,
        # shortest remaining first (with aging)
        line = self.prefill_cost.line()
        per_cell = line[1] if line and line[1] > 0 else UNMEASURED_SECONDS_PER_CELL
        now = self.clock()

        def order(s: Slot) -> tuple[bool, float]:
            if not s.prefilling:
                return False, s.pending[0].num_cells
            return True, priority(_remaining(s), now - s.t_start, per_cell)

        ready = sorted(
            (
                s
                for s in slots
                if s.job and s.pending and not s.pending[0].media_id and s.preempted is None
            ),
            key=order,
        )
        groups: dict[LoraSet, list[Slot]] = {}
        for s in ready:
            groups.setdefault(s.job.lora if s.job else (), []).append(s)
        applied = self.runtime.lora.applied
        for lora in sorted(groups, key=lambda k: k != applied):
            self._decode_batch(groups[lora], lora)

    def _step_prompts(self, ready: list[Slot]) -> tuple[list[Slot], list[Slot]]:
        """The ready slots (in order) less the prompts left for a later step: those past the
        step's budget (runner/prefill_order.py); and those prompts."""
        prompts = [s for s in ready if s.prefilling]
        if len(prompts) < 2:
            return ready, []
        takes = [min(_remaining(s), self._prefill_budget(s)) for s in prompts]
        budget = step_budget(
            len(ready) - len(prompts), self.prefill_cost.estimate, self.runtime.batch_size
        )
        later = prompts[admitted(takes, budget) :]
        put_off = {s.seq for s in later}
        return [s for s in ready if s.seq not in put_off], later

    def _decode_batch(self, ready: list[Slot], lora: LoraSet) -> None:
        """The ready slots' next text (all of one adapter set) in one llama_decode."""
        ready, later = self._step_prompts(ready)
        batch = self.runtime.batch
        batch.clear()
        self._reserved = 0
        budget = self.runtime.batch_size
        taken: list[Taken] = []
        # what each slot takes at least (a token; a prompt's piece): no slot's drafts take it
        owed = {s.seq: 1 if not s.prefilling else self._prefill_budget(s) for s in ready}
        reserved = sum(owed.values())
        for slot in ready:
            if budget == 0:
                break
            reserved -= owed[slot.seq]
            budget -= self._take_into(slot, budget, max(0, budget - reserved), taken)
        if later and not any(t.slot.prefilling for t in taken):
            # the prompts let in took nothing (waiting for the pool, a reprefill put first):
            # the step takes the next one instead, never none while prompts wait
            for slot in later:
                if budget == 0:
                    break
                took = self._take_into(slot, budget, budget, taken)
                budget -= took
                later = later[1:]
                if took:
                    break
        self.stats.num_prompts_put_off += len(later)
        if not taken:
            return
        try:
            self.runtime.use_lora(lora)
        except native.NativeError as e:  # (nothing decoded: each of these requests is told)
            self._reserved = 0
            for t in taken:
                self._fail(t.slot, e)
            return
        t0 = time.perf_counter()
        rc = self.runtime.decode()
        self._reserved = 0  # (in the ledgers below, or given back by a failed decode)
        self.stats.num_decodes += 1
        if len(taken) > 1 and len({t.slot.seq for t in taken}) > 1:
            self.stats.num_multi_seq_decodes += 1
        if rc != 0:
            self.stats.num_failed_decodes += 1
            log.error("llama_decode returned %d for a batch the ledgers admitted", rc)
            self._decode_alone(taken)  # a failed decode changes nothing: find the culprit
            return
        elapsed = time.perf_counter() - t0
        num_cells = sum(t.item.num_cells for t in taken)
        if any(t.slot.prefilling for t in taken):  # (a logit per prompt it finishes)
            self.prefill_cost.observe(num_cells, elapsed)
        else:  # (generation only: a logit per token)
            self.step_cost.observe(num_cells, elapsed)
            if num_cells == 1:  # (a step of one token is a prompt step's least)
                self.prefill_cost.observe(1, elapsed)
        if self.runtime.mtp is not None:
            pos = self.runtime.batch.pos  # (where the batch put each one's first token)
            rows = [(t.slot.seq, t.item.token_ids, int(pos[t.at]), t.at) for t in taken]
            self._mtp([r[0] for r in rows], "catch-up", functools.partial(_catch_up, rows=rows))
        for t in taken:
            slot = t.slot
            try:
                assert slot.ledger is not None
                for part in t.parts or (t.item,):  # (drafts too: held until verified)
                    slot.ledger.append(part)
                if slot.prefilling:
                    self._progress(slot, t.item.num_cells)
                    self._hold(slot)
                    due = t.logits_at is not None or slot.num_prefill_done in slot.checkpoint_at
                    self._checkpoint(slot, due=due)
                else:
                    slot.usage.decode_seconds += elapsed
                    if not t.item.generated and slot.pending and slot.pending[0].generated:
                        self._checkpoint(slot, due=True)  # (re-prefilled up to its reply)
                if t.logits_at is not None:
                    self._sample(slot, t.logits_at, t.drafts)
            except Exception as e:
                self._fail(slot, e)

    def _take_into(self, slot: Slot, budget: int, spare: int, taken: list[Taken]) -> int:
        """The slot's next text into the batch (`_take_text`), kept in `taken`: the cells it
        took. A failure is the slot's alone: the batch goes on without it."""
        try:
            took = self._take_text(slot, budget, spare)
        except Exception as e:
            self._fail(slot, e)
            return 0
        if took is None:
            return 0
        taken.append(took)
        return took.item.num_cells

    def _take_text(self, slot: Slot, budget: int, spare: int | None = None) -> Taken | None:
        """The slot's next text into the batch, after the ledger's plan made room for it (a
        generating slot's token with its drafts, if it has any, in `spare`: what the batch
        has left once every other slot has its share); None when it takes nothing this
        step."""
        allowed = budget
        if slot.prefilling:  # (grouped text of less than a batch goes whole)
            head = slot.pending[0]
            whole = head.num_cells if head.group is not None else 0
            allowed = min(budget, max(self._prefill_budget(slot), whole))
        n = text_take_size(
            slot.pending, allowed, self.runtime.batch_size,
            across_messages=not self.runtime.recurrent,
        )  # fmt: skip
        if slot.prefilling and slot.checkpoint_at:  # (the step stops where one is due)
            done = slot.num_prefill_done
            n = min([n, *(p - done for p in slot.checkpoint_at if p > done)])
        if n == 0:
            return None
        head = slot.pending[0]
        assert slot.ledger is not None
        self._fit(slot, n)
        if self.pool is not None and slot.prefilling and head.group is None:
            n = min(n, max(1, slot.ledger.num_free_cells))  # (what the pool has, now)
        n = fitting_take(slot.ledger, n, head.group)
        if not self._make_room(slot, n, n, head.group):
            return None  # finished, or a reprefill put other items first
        item, parts = take_text(slot.pending, n)
        assert slot.ledger is not None
        last = not slot.pending
        generating = last and item.generated and not slot.prefilling
        drafts = (
            self._drafts(slot, item, (budget if spare is None else spare) - n) if generating else ()
        )
        if drafts and not self._rollback_ready(slot, len(drafts)):
            drafts = drafts[: self.runtime.rollback_tokens]
        if drafts:
            tokens = item.token_ids + drafts
            item = replace(item, num_cells=len(tokens), num_positions=len(tokens), token_ids=tokens)
            last_ids = parts[-1].token_ids + drafts
            n_last = len(last_ids)
            parts = (
                *parts[:-1],
                replace(parts[-1], num_cells=n_last, num_positions=n_last, token_ids=last_ids),
            )
        end = self.runtime.batch.add(
            item.token_ids, slot.ledger.next_pos, slot.seq, logits_last=last,
            num_logits=1 + len(drafts),
        )  # fmt: skip
        self._reserved += item.num_cells
        first = end - item.num_cells + 1
        return Taken(slot, item, end - len(drafts) if last else None, drafts, first, parts)

    def _rollback_ready(self, slot: Slot, num_drafts: int) -> bool:
        """(hybrid memory) Whether the step can take back `num_drafts` rejected drafts: in
        place (llama.cpp's per-token snapshots of the recurrent state), or else from a
        checkpoint of the state taken now, before the step (llama-server's speculative
        checkpoint). False where neither: the draft is cut to what rolls back in place."""
        slot.spec_checkpoint = None
        if not self.runtime.recurrent or num_drafts <= self.runtime.rollback_tokens:
            return True
        assert slot.ledger is not None
        try:
            state = self.runtime.checkpoint(slot.seq)
        except native.NativeError as e:
            log.warning("slot %d: no speculative checkpoint: %s", slot.seq, e)
            return False
        slot.spec_checkpoint = (state, slot.ledger.num_segments)
        self.stats.num_spec_checkpoints += 1
        return True

    def _drafts(self, slot: Slot, taken: Item, budget: int) -> tuple[int, ...]:
        """Tokens to verify after the slot's last one (the end of `taken`), in the cells left
        once the ledger made room for `taken`: drafts never make a shift of their own (where
        the room is short, fewer), nor pass max_tokens, nor take more of the step's batch
        than is left."""
        spec, ledger, job = slot.spec, slot.ledger, slot.job
        if spec is None or ledger is None or job is None:
            return ()
        thoughts = slot.thoughts
        if thoughts is not None and (thoughts.inside or taken.thought):
            return ()  # (drafts are decoded as one item with it: never half a thought)
        room = min(
            budget,
            ledger.num_free_cells - taken.num_cells,
            ledger.n_ctx_train - ledger.next_pos - taken.num_cells,  # (positions, under GAP)
            job.max_tokens - slot.usage.num_generated_tokens - 1,
        )
        cost = self._model_draws(slot, spec, taken) if room > 0 else 0.0
        in_place = self.runtime.rollback_tokens if self.runtime.recurrent else None
        drafts = spec.drafts(room, self._num_generating, cost, in_place) if room > 0 else ()
        if thoughts is not None and drafts:  # (nor one that opens a thought)
            opens = [k for k, t in enumerate(drafts) if t in thoughts.thoughts.start]
            drafts = drafts[: opens[0]] if opens else drafts
        return drafts

    def _model_draws(self, slot: Slot, spec: Speculation, taken: Item) -> float:
        """Give this step's model drafters what they draw from (a draft model: the sequence's
        text; the MTP head: the slot's last token and its position): the seconds a model's
        draft costs. A guess that fails is no request's end: no drafts."""
        ledger, job = slot.ledger, slot.job
        assert ledger is not None and job is not None
        cost, p_min = 0.0, spec.config.p_min
        simple, mtp = spec.model(SpecType.DRAFT_SIMPLE), spec.model(SpecType.DRAFT_MTP)
        if simple is not None:
            simple.draw = None
            model, tokens = self.draft_model, text_tokens(ledger.segments, [taken])
            if model is not None and tokens is not None:  # (None: it holds media)
                owner = job.reuse_key
                simple.draw = _guarded(
                    slot, lambda k: model.draft(slot.seq, tokens, k, p_min, owner=owner)
                )
                cost = model.seconds_per_draft
        if mtp is not None:
            mtp.draw = None
            head = self.runtime.mtp
            if head is not None and taken.num_cells == 1:  # (after a replay: none this step)
                last, pos = taken.token_ids[0], ledger.next_pos
                mtp.draw = _guarded(slot, lambda k: head.draft(slot.seq, last, pos, k, p_min))
        return cost

    def _fail(self, slot: Slot, e: Exception) -> None:
        """A bug met while carrying out one slot's item: that request ends (INTERNAL, its
        sequence cleared or its session rolled back), the step goes on for the others."""
        log.error("slot %d: its item failed", slot.seq, exc_info=e)
        why = Problem(ErrorKind.INTERNAL, f"internal error: {e!r}", Reason.INTERNAL)
        if slot.job is not None:
            self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)

    def _decode_alone(self, taken: list[Taken]) -> None:
        """Decode each sequence of a failed batch on its own: only those that fail again end."""
        batch = self.runtime.batch
        for slot, item, logits_at, drafts, _, parts in taken:
            assert slot.ledger is not None
            batch.clear()
            end = batch.add(
                item.token_ids, slot.ledger.next_pos, slot.seq, logits_last=True,
                num_logits=1 + len(drafts),
            )  # fmt: skip
            rc = self.runtime.decode()
            self.stats.num_decodes += 1
            if rc != 0:
                self.stats.num_failed_decodes += 1
                why = Problem(
                    ErrorKind.INTERNAL, f"llama_decode failed (rc={rc})", Reason.DECODE_FAILED
                )
                self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)
                continue
            try:
                for part in parts or (item,):
                    slot.ledger.append(part)
                self._progress(slot, item.num_cells)
                if slot.prefilling:
                    self._checkpoint(slot, due=logits_at is not None)
                if logits_at is not None:  # (before the next decode wipes these logits)
                    self._sample(slot, end - len(drafts), drafts)
            except Exception as e:
                self._fail(slot, e)

    def _sample(self, slot: Slot, index: int, drafts: tuple[int, ...] = ()) -> None:
        """The slot's next token from the logits at batch index `index`; after drafts (each
        decoded with logits, from index + 1 on), the next ones while the target's sample
        equals the draft: each token is the target's own sample given its real prefix (its
        sampler chain, grammar and penalties advance on what is emitted only). The cells of
        drafts past the last one confirmed are given back, in the ledger and in llama.cpp."""
        if slot.prefilling:
            slot.prefilling = False
            slot.usage.prefill_seconds = self.clock() - slot.t_start
            self._outcome.first_tokens.append(slot.usage.prefill_seconds)
        spec = slot.spec  # (an ending below lets go of it)
        confirmed = 0  # drafts whose sample matched: their cells hold the right input
        synthetic = spec is not None and spec.synthetic is not None
        for i in range(len(drafts) + 1):
            given = None
            if synthetic and i < len(drafts):
                assert spec is not None and spec.synthetic is not None
                if spec.synthetic.accepts(i) and not self.runtime.is_eog(drafts[i]):
                    given = drafts[i]
            token = self._emit_next(slot, index + i, i, given)
            if token is None:  # the request ended here (the token that ended it is no input)
                break
            if i < len(drafts) and token == drafts[i] and (given is not None or not synthetic):
                confirmed += 1
                continue
            thought = slot.thoughts is not None and slot.thoughts.last_was_thought
            slot.pending.append(
                Item(1, 1, slot.reply_index, token_ids=(token,), generated=True, thought=thought)
            )
            break
        slot.num_confirmed = slot.num_confirmed_cells = confirmed
        if drafts:
            slot.usage.num_draft_tokens += len(drafts)
            slot.usage.num_accepted_tokens += confirmed
            if spec is not None:
                self._count_drafts(slot, spec, len(drafts), confirmed)
            self._mtp([slot.seq], "accept", lambda mtp: mtp.accept(slot.seq, confirmed))
            self._give_back(slot, len(drafts) - confirmed)

    def _count_drafts(
        self, slot: Slot, spec: Speculation, num_drafted: int, num_accepted: int
    ) -> None:
        """The drafts just verified, counted for their type (and as the suffix cache's hits
        when they came from the tenant's earlier requests); the slot's length adapts."""
        kind = spec.last.name if spec.last is not None else "unknown"
        hit = int(kind == SpecType.SUFFIX.value and spec.cache_hit())
        self.stats.count_drafts(kind, num_drafted, num_accepted, hit)
        counts = slot.usage.drafts_by_type.setdefault(kind, [0, 0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted
        counts[2] += hit
        spec.verified(num_drafted, num_accepted)

    def _mtp(self, seqs: Sequence[int], what: str, call: Callable[[MtpDrafter], None]) -> None:
        """(draft-mtp) A call on the MTP context: its catch-up after a decode, its accept
        after a verification, an image's last row. A failure costs these sequences their MTP
        cells (their drafts get worse), never a request."""
        mtp = self.runtime.mtp
        if mtp is None:
            return
        try:
            call(mtp)
        except native.NativeError as e:
            log.warning("the MTP context's %s failed: %s", what, e)
            for seq in seqs:
                mtp.clear(seq)

    def _give_back(self, slot: Slot, num_cells: int) -> None:
        """The last cells of the sequence's newest segment leave it (rejected drafts)."""
        ledger = slot.ledger
        checkpoint, slot.spec_checkpoint = slot.spec_checkpoint, None
        if num_cells <= 0 or ledger is None or not ledger.segments:
            return  # (a request that failed without a session: its sequence is cleared)
        newest = len(ledger.segments) - 1
        last = ledger.segments[newest]
        keep = last.num_cells - num_cells
        if self.runtime.recurrent and not self._roll_back(slot, last.pos_start + keep, num_cells):
            self._take_back(slot, ledger, newest, keep, checkpoint)
        else:
            self.runtime.seq_rm(slot.seq, last.pos_start + keep, -1)
            ledger.truncate(newest, keep)  # (once llama.cpp has let go)
        if self.pool is not None:
            self.pool.cut(slot.seq, ledger.num_cells)

    def _roll_back(self, slot: Slot, pos: int, num_cells: int) -> bool:
        """(hybrid memory) Whether llama.cpp can take the last `num_cells` out of the
        sequence in place: once a step, and no more than its per-token snapshots reach."""
        if num_cells > self.runtime.rollback_tokens:
            return False
        if not self.runtime.try_seq_rm(slot.seq, pos, -1):
            return False  # (refused, nothing changed: a rollback of this step came first)
        self.stats.num_spec_rollbacks += 1
        return True

    def _take_back(
        self, slot: Slot, ledger: Ledger, newest: int, keep: int,
        checkpoint: tuple[bytes, int] | None,
    ) -> None:  # fmt: skip
        """(hybrid memory) The newest segment cut to its first `keep` tokens where the state
        cannot roll back in place: the state before the segment's step is put back and the
        kept tokens go in again with the slot's next step (llama-server's replay), or, without
        that checkpoint, the sequence goes back to its last context checkpoint."""
        segment = ledger.segments[newest]
        redo: list[Item]
        if checkpoint is not None and checkpoint[1] == newest:
            try:
                self.runtime.restore(slot.seq, checkpoint[0], segment.pos_start)
            except native.NativeError as e:  # (the sequence was cleared: all of it again)
                log.warning("slot %d: %s; its sequence is decoded again", slot.seq, e)
                redo = ledger.redo(0, newest, keep)
                self.clear(slot)
                ledger.truncate(0)
            else:
                ledger.truncate(newest)
                tokens = segment.token_ids[:keep]
                redo = [text_like(segment.item, tokens)] if tokens else []
                self.stats.num_spec_restores += 1
        else:
            redo = self._rewind(slot, ledger, newest, keep)
        # the kept drafts are pending text now, not cells: a stop string found among them
        # after the step has nothing to give back
        slot.num_confirmed_cells = 0
        if slot.job is not None:  # (a finished request's slot keeps what its cache holds)
            slot.pending.extendleft(reversed(redo))

    def _emit_next(
        self, slot: Slot, index: int, at: int = 0, synthetic: int | None = None
    ) -> int | None:
        """Sample at `index`: the token, handed on to the output processor, or None when the
        request finished here (its end of generation, its grammar's dead end, max_tokens;
        stop strings are found in its text, by the output processor). `synthetic`: a draft
        accepted by --spec-synth-rates, emitted whatever the target samples (benchmarking
        only, as llama-server's: it feeds no grammar)."""
        job = slot.job
        assert job is not None and slot.sampler is not None
        thoughts = slot.thoughts
        forced = thoughts.forced() if thoughts is not None else None
        # a constraint holds for the reply after its thoughts; a lazy one is not triggered
        # inside any (as llama-server has them)
        free = thoughts is not None and (
            thoughts.leading or (thoughts.inside and slot.sampler.awaiting_trigger)
        )
        try:
            if synthetic is not None:
                token, logprobs = slot.sampler.force(index, synthetic)
            elif forced is not None:  # (a thought past its budget: its end, written)
                token, logprobs = slot.sampler.force(index, forced)
            elif free:
                token, logprobs = slot.sampler.sample(index, free=True)
            else:
                token, logprobs = slot.sampler.sample(index)
        except GrammarDeadEnd:
            self._finish(slot, FinishReason.GRAMMAR)
            return None
        except GrammarTooCostly as e:
            self._finish(slot, FinishReason.ERROR, error=e.problem.message, problem=e.problem)
            return None
        if self.runtime.is_eog(token):
            self._finish(slot, FinishReason.STOP)
            return None
        slot.usage.num_generated_tokens += 1
        self.stats.num_generated_tokens += 1
        piece = None
        if thoughts is not None:  # (a grammar that holds the reply: no thought opens in it)
            piece = self.runtime.piece(token)  # (read once: the text is made of it too)
            may_open = not slot.sampler.grammar or slot.sampler.awaiting_trigger
            thoughts.accept(token, piece, may_open=may_open)
        if slot.spec is not None:
            slot.spec.took(token)
        self._record(job, Sampled(token, logprobs, piece, at))
        if slot.usage.num_generated_tokens >= job.max_tokens:
            self._finish(slot, FinishReason.LENGTH)
            return None
        return token

    # -- the ledger's plans -------------------------------------------------------------------

    def _make_room(self, slot: Slot, num_cells: int, num_positions: int, group: int | None) -> bool:
        """Carry out the ledger's plan for the next decode; False when the slot cannot go on."""
        ledger = slot.ledger
        assert ledger is not None and slot.job is not None
        self._fit(slot, num_cells)
        plan: Plan = ledger.ensure(num_cells, num_positions, group=group)
        if isinstance(plan, Fits):
            return True
        if self._waits_for_pool(slot, num_cells):
            return False
        if isinstance(plan, CannotFit):
            if self._observer is not None:
                self._observer.on_cannot_fit(slot, plan, num_cells)
            if slot.prefilling:
                why = too_long(plan)
                self._finish(slot, FinishReason.ERROR, error=why.message, problem=why)
            else:
                self._finish(slot, FinishReason.LENGTH)
            return False
        if isinstance(plan, Shift):
            self.runtime.seq_rm(slot.seq, plan.p0, plan.p1)
            self.runtime.seq_add(slot.seq, plan.p1, -plan.delta)
        elif isinstance(plan, Gap):
            self.runtime.seq_rm(slot.seq, plan.p0, plan.p1)
        elif isinstance(plan, Reprefill):
            plan = self._reprefill(slot, ledger, plan)
        evicted_at = at_cell(ledger.segments, plan.evicted)
        ledger.apply(plan)
        if isinstance(plan, Reprefill):
            slot.pending.extendleft(reversed(plan.kept[plan.num_prefix :]))
            if slot.checkpoint_at:  # (where the steps stop: in what is pending now)
                done = slot.num_prefill_done
                slot.checkpoint_at = frozenset(done + p for p in checkpoint_points(slot.pending))
        slot.usage.num_shifts += 1
        slot.usage.num_evicted_cells += plan.num_cells_evicted
        self._outcome.shifted.append(slot)
        if self._observer is not None:
            self._observer.on_plan(slot)
        self.stats.num_shifts += 1
        self.stats.num_evicted_cells += plan.num_cells_evicted
        used = policy_of(plan).value
        self.stats.shifts_by_policy[used] = self.stats.shifts_by_policy.get(used, 0) + 1
        if isinstance(plan, Reprefill):  # the ledger is empty until the kept items are decoded
            used_after = sum(i.num_cells for i in plan.kept)
            next_pos_after = sum(i.num_positions for i in plan.kept)
        else:
            used_after, next_pos_after = ledger.num_cells, ledger.next_pos
        shift = ContextShift(
            policy=policy_of(plan),
            num_cells_evicted=plan.num_cells_evicted,
            num_positions_evicted=plan.num_positions_evicted,
            media_ids_evicted=tuple(plan.media_ids_evicted),
            num_cells_used_after=used_after,
            next_position_after=next_pos_after,
        )
        slot.num_shift_marks += 1
        job = slot.job
        slot.shifts.appendleft(
            ShiftMark(
                id=slot.num_shift_marks,
                shift=shift,
                at_cell=evicted_at,
                evicted=runs(plan.evicted, self.read),
                time=time.time(),
                tenant=job.tenant,
                session_id=job.session_id,
                sequence=ledger.serial,
            )
        )
        self._record(slot.job, shift)
        return not isinstance(plan, Reprefill)

    def _reprefill(self, slot: Slot, ledger: Ledger, plan: Reprefill) -> Reprefill:
        """Empty the sequence for the plan's kept items, or (recurrent memory) cut it back to
        the checkpoint after its pinned prefix, which stays; where that checkpoint does not
        load, the sequence is cleared and the prefix decoded again too."""
        if plan.num_prefix:
            try:
                pos = ledger.pos_at(plan.num_prefix)
                self.runtime.restore(slot.seq, ledger.marks[plan.num_prefix], pos)
                self.stats.num_checkpoint_restores += 1
                return plan
            except native.NativeError as e:
                log.warning("slot %d: %s; its prefix is decoded again", slot.seq, e)
        self.clear(slot)  # (a shared prefix too: it is decoded again, the slot's own)
        return replace(plan, num_prefix=0)

    def read(self, token_ids: Sequence[int]) -> str:
        """Tokens as words (a preview of cells for people: undecodable bytes replaced)."""
        return b"".join(self.runtime.piece(t) for t in token_ids).decode("utf-8", errors="replace")

    def _progress(self, slot: Slot, num_cells: int) -> None:
        if not slot.prefilling or slot.job is None:
            return
        slot.num_prefill_done += num_cells
        self._record(slot.job, PrefillProgress(slot.num_prefill_done, slot.num_prefill_total))


class _Reused(NamedTuple):
    """What a starting request reuses of its sequence, and what is left to decode."""

    rest: list[Item]  # its items past what the sequence keeps
    continued: bool  # (stateless) by the continuation rule
    restore: list[Item]  # decoded again first: what a saved state lacked
    again_in_turn: list[Item]  # ... of them, the turn's own (still its prompt)
    again_before: list[Item]  # the session's own items cut back before the turn began


def _admitted(
    job: Job, ledger: Ledger, rest: list[Item], continued: bool
) -> tuple[Sequence[Item], Sequence[Item]]:
    """The ledger's admission of the rest: what is decoded, and what truncation dropped
    (ProblemError: a prompt that can never fit, or that ends with media)."""
    admission = ledger.admit(rest, truncate=job.context.truncate_prompt)
    if isinstance(admission, CannotFit):
        raise ProblemError(too_long(admission))
    if admission.kept and admission.kept[-1].media_id:
        raise ProblemError(
            Problem(
                ErrorKind.INVALID_ARGUMENT,
                "the prompt ends with media: add text after it",
                Reason.BAD_REQUEST,
            )
        )
    kept, dropped = admission.kept, admission.dropped
    if (
        job.session_id is None
        and dropped
        and not continued
        and len(ledger.segments) == ledger.num_pinned_segments
    ):
        ledger.begin_history(dropped)  # truncated now: continued next turn
    return kept, dropped


def shareable(job: Job) -> Share | None:
    """The job's pinned prefix as the pool shares it: keyed by tenant and salt and by what it
    puts in the cache; None when it is too small to be worth it, or all there is."""
    k = num_pinned(job.items, job.context.keep)
    if k >= len(job.items):
        return None  # (the prompt's last item is decoded by the slot itself: its logits)
    num_cells = sum(i.num_cells for i in job.items[:k])
    if num_cells < WORTH_SHARING:
        return None
    return Share((job.reuse_key, atoms(job.items[:k])), k, num_cells)


def checkpoint_points(items: Sequence[Item], tail: int = 4) -> frozenset[int]:
    """(recurrent memory) Where in a prompt (cells from its start) a step stops to save a
    checkpoint, as llama-server does: at the start of its last two messages (where an edited
    last message parts from what a slot holds) and `tail` cells before its end (where the same
    prompt sent again does: a reuse leaves one token to decode). Only between items that close
    a media group, or inside plain text."""
    points: list[int] = []
    starts: list[int] = []
    total, n = sum(i.num_cells for i in items), 0
    for k, item in enumerate(items):
        closed = k == 0 or items[k - 1].group is None or items[k - 1].group != item.group
        if k and closed and item.message_index != items[k - 1].message_index:
            starts.append(n)
        end = n + item.num_cells
        plain = item.group is None and not item.is_media
        if n <= total - tail < end and (plain or (closed and total - tail == n)):
            points.append(total - tail)
        n = end
    return frozenset(p for p in [*starts[-2:], *points] if 0 < p < total)


def _niced(nice: int) -> None:
    """The encode worker (and the threads its encodes start, which inherit it) runs at a lower
    priority than decoding: the cores are the generating slots' when they need them, the
    encoder's the rest of the time (Linux: a thread's nice value is its own)."""
    if nice and sys.platform.startswith("linux"):  # (elsewhere the id would name a process)
        with contextlib.suppress(Exception):  # (a refusal leaves the encoder as it is)
            me = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + nice))


def _remaining(slot: Slot) -> int:
    """The cells of its prompt a slot has still to decode."""
    return max(1, slot.num_prefill_total - slot.num_prefill_done)


def media_cache_key(job: Job, media_key: str) -> str:
    """A media key within its job's tenant and salt, as prefix reuse is: the projector's work
    for one tenant is never another's (a hit would tell that someone sent the image)."""
    return f"{job.tenant}\0{job.cache_salt}\0{media_key}"


def _media(slot: Slot, key: str) -> MediaHandle:
    assert slot.job is not None
    return slot.job.media[key]


def text_take_size(
    pending: deque[Item], budget: int, batch_size: int, *, across_messages: bool = True
) -> int:
    """How many tokens of the front text items go into this batch.

    Grouped (wrapper) text goes whole unless it is larger than a whole batch; ungrouped text
    joins the next ungrouped text items of the same origin (prompt, reply, thought): the rest
    of a prompt goes in one step, not one step per message (a chat's new turn is its message
    and the generation prompt after it: two steps for every request of a burst), and a
    re-prefill after a long reply does not cost a llama_decode per generated token.
    `across_messages=False` (recurrent memory) stops at the message's end, where a step must
    end for a checkpoint there.
    """
    first = pending[0]
    if first.num_cells > budget:
        return 0 if first.group is not None and first.num_cells <= batch_size else budget
    n = first.num_cells
    if first.group is not None:
        return n
    for item in itertools.islice(pending, 1, None):
        if not _joins(first, item, across_messages) or n == budget:
            break
        n += min(item.num_cells, budget - n)
    return n


def fitting_take(ledger: Ledger, n: int, group: int | None) -> int:
    """A take of n text tokens, made smaller until the ledger can make room for it at once.

    An admitted prompt fits when it goes in piece by piece, evicting as it goes; one take of
    it may not (after a REPREFILL, the kept items and the prompt's rest join into one take
    larger than what is not pinned). Grouped text goes whole, as it must.
    """
    while n > 1 and group is None and isinstance(ledger.ensure(n, n), CannotFit):
        n //= 2
    return n


def _joins(first: Item, item: Item, across_messages: bool = True) -> bool:
    """Whether `item` goes into the batch with `first` (text of the same origin)."""
    return (
        item.media_id is None
        and item.group is None
        and (item.generated, item.thought) == (first.generated, first.thought)
        and (across_messages or item.message_index == first.message_index)
    )


def _one_segment(first: Item, item: Item) -> bool:
    """Whether `item`, taken with `first`, is one ledger segment with it (one message)."""
    return _joins(first, item, across_messages=False)


def take_text(pending: deque[Item], n: int) -> tuple[Item, tuple[Item, ...]]:
    """Pop n tokens from the front text items (as text_take_size counted them): as one item
    for the batch, and as the ledger's segments (one per message: eviction, reuse and the
    pool go by message)."""
    first = pending[0]
    if n == first.num_cells:  # the common case: one generated token, or one whole chunk
        return (item := pending.popleft()), (item,)
    runs: list[tuple[Item, list[int]]] = []  # (a message's first piece, its tokens)
    taken = 0
    while taken < n:
        item = pending[0]
        k = min(item.num_cells, n - taken)
        if k == item.num_cells:
            pending.popleft()
        else:
            rest = item.token_ids[k:]
            pending[0] = replace(item, num_cells=len(rest), num_positions=len(rest), token_ids=rest)
        if runs and _one_segment(runs[-1][0], item):
            runs[-1][1].extend(item.token_ids[:k])
        else:
            runs.append((item, list(item.token_ids[:k])))
        taken += k
    parts = tuple(
        replace(head, num_cells=len(ids), num_positions=len(ids), token_ids=tuple(ids))
        for head, ids in runs
    )
    tokens = tuple(t for p in parts for t in p.token_ids)
    return replace(first, num_cells=n, num_positions=n, token_ids=tokens), parts


def text_tokens(segments: Iterable[Segment | Item], pending: Iterable[Item]) -> list[int] | None:
    """A sequence's tokens in order, if it holds text only (what a draft model can follow)."""
    out: list[int] = []
    for x in itertools.chain(segments, pending):
        if x.media_id is not None:
            return None
        out.extend(x.token_ids)
    return out


def history(segments: Iterable[Segment | Item], pending: Iterable[Item]) -> list[int]:
    """A sequence's tokens in order, for drafts to be looked up in (a media chunk breaks it)."""
    out: list[int] = []
    for x in itertools.chain(segments, pending):
        out.extend(x.token_ids if x.media_id is None else (NO_TOKEN,))
    return out


def policy_of(plan: Plan) -> Policy:
    if isinstance(plan, Shift):
        return Policy.SHIFT
    if isinstance(plan, Gap):
        return Policy.GAP
    return Policy.REPREFILL


def _guarded(slot: Slot, draw: Callable[[int], list[int]]) -> Callable[[int], list[int]]:
    """A model's draw whose failure drafts nothing (the request goes on without drafts)."""

    def guarded(k: int) -> list[int]:
        try:
            return draw(k)
        except native.NativeError:
            log.warning("slot %d: drafting failed", slot.seq, exc_info=True)
            return []

    return guarded


def _catch_up(mtp: MtpDrafter, rows: list[tuple[int, tuple[int, ...], int, int]]) -> None:
    """(draft-mtp) The MTP context decodes what the target just did, each token beside the
    target's hidden state of the one before (llama.cpp's process()); what it held from each
    row's position on was another text's."""
    for seq, _, pos, _ in rows:
        mtp.rewind(seq, pos)
    mtp.after_decode(rows)
