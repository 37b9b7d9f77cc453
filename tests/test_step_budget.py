"""A long prompt does not stall the slots that generate: while they do, it enters the cache in
pieces (infer_service/runner/step_budget.py), and every engine step still gives each of them a
token.

The engine's own executor on the tiny pair, stepped by hand: each step is looked at, no time is
measured."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infer_service.events import PrefillProgress
from infer_service.kv.ledger import Item
from infer_service.runner.executor import Executor, Sampled
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig, physical_cores
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.runner.step_budget import ALIGN, MIN_PIECE, PIECES, prefill_budget

BATCH = 512


@given(
    num_generating=st.integers(0, 8),
    cells=st.integers(1, 100_000),
    batch=st.sampled_from([64, 512, 2048]),
)
def test_a_budget_is_a_piece_of_the_prompt_within_a_batch(
    num_generating: int, cells: int, batch: int
) -> None:
    budget = prefill_budget(batch, num_generating, cells)
    assert 1 <= budget <= batch
    if num_generating == 0:
        assert budget == batch  # nobody waits: whole batches
        return
    assert budget >= min(batch, MIN_PIECE * num_generating)  # the others' tokens cost little
    wanted = max(-(-cells // PIECES), MIN_PIECE * num_generating)
    if budget < batch:  # about 1/PIECES of the prompt, in whole ALIGNs
        assert wanted <= budget < wanted + ALIGN and budget % ALIGN == 0


@pytest.fixture
def executor(tiny) -> Iterator[Executor]:
    pair = tiny["rope"]
    rt = Runtime(RuntimeConfig(pair.model, None, ctx_size=2 * 4096, parallel=2, threads=1))
    ex = Executor(rt, EngineStats(), cache_bytes=0, host_sequence_bytes=0)
    try:
        yield ex
    finally:
        ex.close()
        rt.close()


def start(ex: Executor, slot: Slot, tokens: list[int], events: KeptEvents) -> Job:
    rt = ex.runtime
    never = tuple((t, float("-inf")) for t in range(rt.num_vocab) if rt.is_eog(t))
    job = Job(
        [Item(len(tokens), len(tokens), 0, token_ids=tuple(tokens))],
        {},
        events,
        sampling=SamplingConfig(temperature=0),
        max_tokens=1 << 20,
        logit_bias=never,  # (A generates until the test is done with it)
    )
    ex.start(slot, job, ex.enter(slot, job))
    return job


def step(ex: Executor, slots: list[Slot]) -> None:
    """One step, its events told to their jobs (as the engine tells them after a step)."""
    for job, event in ex.step(slots).events:
        job.mailbox.post([event])


def tokens_of(events: KeptEvents) -> int:
    return sum(1 for e in events if isinstance(e, Sampled))


def progress_of(events: KeptEvents) -> list[int]:
    return [e.num_cells_done for e in events if isinstance(e, PrefillProgress)]


def test_a_long_prompt_goes_in_pieces_while_another_slot_generates(executor: Executor) -> None:
    ex, slots = executor, [Slot(0), Slot(1)]
    words = random.Random(7).choices(range(10, 200), k=3000)
    a = KeptEvents()
    start(ex, slots[0], words[:8], a)
    while tokens_of(a) < 3:  # A generates
        step(ex, slots)
    b = KeptEvents()
    start(ex, slots[1], words, b)
    budget = prefill_budget(BATCH, 1, len(words))
    steps = 0
    while tokens_of(b) == 0:
        a_before, b_before = tokens_of(a), len(progress_of(b))
        step(ex, slots)
        steps += 1
        assert tokens_of(a) == a_before + 1, f"step {steps}: A got no token"
        assert len(progress_of(b)) == b_before + 1, f"step {steps}: B got not one piece in"
    pieces = progress_of(b)
    sizes = [y - x for x, y in zip([0, *pieces], pieces, strict=False)]
    assert max(sizes) <= budget < BATCH, sizes
    assert len(sizes) >= -(-len(words) // budget) >= PIECES * 3 // 4


def test_a_prompt_alone_goes_in_whole_batches(executor: Executor) -> None:
    ex, slots = executor, [Slot(0), Slot(1)]
    words = random.Random(8).choices(range(10, 200), k=1500)
    b = KeptEvents()
    start(ex, slots[1], words, b)
    while tokens_of(b) == 0:
        step(ex, slots)
    assert progress_of(b) == [512, 1024, 1500]


def test_threads_default_to_the_physical_cores_this_process_may_use() -> None:
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    config = RuntimeConfig(model=Path("m.gguf"))
    assert config.threads == config.threads_batch == config.encode_threads == cores
