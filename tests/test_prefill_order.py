"""A burst of prompts is answered shortest first (infer_service/runner/prefill_order.py): the
order and the steps are looked at, never timed. The rule is pure and checked on its own; then
the engine's own executor on the tiny pair, its step costs fixed (a CPU's, a GPU's, none
measured yet), shows who gets a first token in which step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infer_service.kv.ledger import ContextConfig, Item
from infer_service.runner.executor import Executor, Sampled, take_text
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.prefill_order import AGING, STEP_SPAN, admitted, priority, step_budget
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.spec.length import StepCost
from support.step_costs import CPU, GPU, FixedCost, linear

# -- the rule ---------------------------------------------------------------------------------


def test_shorter_first_and_a_long_wait_overtakes() -> None:
    per_cell = CPU[1]
    assert priority(16, 0.0, per_cell) < priority(400, 0.0, per_cell)
    assert priority(16, 0.5, per_cell) < priority(400, 0.5, per_cell)  # (waited alike)
    # a 400-cell prompt (1.6 s of work) that waited a quarter of that goes before a new short
    assert priority(400, 1.6 / AGING + 0.01, per_cell) < priority(16, 0.0, per_cell)
    assert priority(16, 3.0, 0.0) == 16  # (no cost measured: the cells alone)


@given(
    long=st.integers(64, 20_000),
    short=st.integers(1, 63),
    per_cell=st.floats(1e-5, 0.01),
)
def test_a_long_prompt_waits_for_new_short_ones_a_bounded_time(
    long: int, short: int, per_cell: float
) -> None:
    """Short prompts that keep arriving go first only until the long one has waited 1/AGING
    of its own work: no starvation."""
    own = long * per_cell
    assert priority(long, own / AGING + 1e-9, per_cell) < priority(short, 0.0, per_cell)


def test_a_step_s_budget_is_the_machine_s() -> None:
    """The prompt cells whose step costs at most STEP_SPAN one-token steps: on a CPU's costs a
    few short chats, on a GPU's the whole batch; before any step was measured, the batch."""
    t0, c = CPU
    cpu = step_budget(0, linear(*CPU), 512)
    assert t0 + c * cpu <= STEP_SPAN * (t0 + c) < t0 + c * (cpu + 1)
    assert step_budget(4, linear(*CPU), 512) == cpu - 4  # (generating slots' tokens count)
    assert step_budget(0, linear(*GPU), 512) == 512
    assert step_budget(0, lambda n: None, 512) == 512
    assert step_budget(0, linear(0.0, 1.0), 512) == STEP_SPAN  # (no fixed cost at all)


@given(takes=st.lists(st.integers(1, 600), max_size=20), budget=st.integers(0, 600))
def test_the_first_prompt_always_joins_and_the_rest_fit_the_budget(
    takes: list[int], budget: int
) -> None:
    k = admitted(takes, budget)
    assert k == len(takes) or (k >= 1 and sum(takes[: k + 1]) > budget)
    assert k <= 1 or sum(takes[:k]) <= budget


def simulate(sizes: list[int], seconds: Callable[[int], float], ruled: bool) -> list[float]:
    """Each prompt's time to its first token when the steps take them by the rule (or all at
    once), shortest first."""
    left, now, done = sorted(sizes), 0.0, []
    while left:
        k = admitted(left, step_budget(0, seconds, 4096)) if ruled else len(left)
        now += seconds(sum(left[:k]))
        done += [now] * k
        left = left[k:]
    return done


def test_a_burst_on_a_cpu_gets_its_median_first_token_sooner() -> None:
    """Fifteen chats of 16 tokens beside a shared prefix (the benchmark's burst), on a CPU's
    costs: the median first token comes sooner than in one step for all (the last later); on
    a GPU's, all in one step, as before."""
    burst = [16] * 15
    ruled, together = simulate(burst, linear(*CPU), True), simulate(burst, linear(*CPU), False)
    assert sorted(ruled)[7] < sorted(together)[7] and max(ruled) > max(together)
    assert simulate(burst, linear(*GPU), True) == simulate(burst, linear(*GPU), False)


# -- in the executor ---------------------------------------------------------------------------


@pytest.fixture
def executor(tiny) -> Iterator[Executor]:
    pair = tiny["rope"]
    rt = Runtime(RuntimeConfig(pair.model, None, ctx_size=12 * 1024, parallel=12, threads=1))
    slots = [Slot(seq) for seq in range(12)]
    ex = Executor(rt, EngineStats(), cache_bytes=0, host_sequence_bytes=0, slots=slots)
    ex.clock = lambda: 0.0  # (no prompt ages while the test runs, however slow the machine)
    try:
        yield ex
    finally:
        ex.close()
        rt.close()


def chat(n: int, seed: int) -> list[Item]:
    """A prompt of n tokens as a chat renders it: a message, the generation prompt after it."""
    tokens = [3 + (seed * 7919 + i * 104729) % 200 for i in range(n)]
    return [Item.text(tokens[:-3], 0), Item.text(tokens[-3:], 1)]


def first_token_steps(ex: Executor, prompts: list[list[Item]]) -> list[int]:
    """The prompts started together, one per slot: the step in which each got its first
    token."""
    slots = ex.slots[: len(prompts)]
    for i, (slot, items) in enumerate(zip(slots, prompts, strict=True)):
        job = Job(
            items, {}, KeptEvents(), sampling=SamplingConfig(temperature=0), max_tokens=2,
            context=ContextConfig(),
        )  # fmt: skip
        job.note = str(i).encode()
        ex.start(slot, job, ex.enter(slot, job))
    first: dict[int, int] = {}
    step = 0
    while any(s.job for s in slots):
        step += 1
        for job, event in ex.step(slots).events:
            if isinstance(event, Sampled):
                first.setdefault(int(job.note), step)
        assert step < 100
    return [first[i] for i in range(len(prompts))]


def test_a_chat_s_prompt_goes_in_one_step_a_segment_per_message(executor: Executor) -> None:
    """The message and the generation prompt after it: one llama_decode (before, one each),
    and the ledger still has a segment per message (eviction and reuse go by message)."""
    executor.prefill_cost = FixedCost(None)
    assert first_token_steps(executor, [chat(40, 1)]) == [1]
    ledger = executor.slots[0].ledger
    assert ledger is not None
    assert [s.item.message_index for s in ledger.segments[:2]] == [0, 1]
    assert [s.item.num_cells for s in ledger.segments[:2]] == [37, 3]


def test_short_prompts_get_their_first_tokens_before_a_long_one(executor: Executor) -> None:
    """Eleven chats of 17 to 27 tokens and one of 400 start together. On a CPU's costs the
    first step takes the shortest that fit its budget, the next steps the others, shortest
    first; the long one comes last. On a GPU's, or before anything was measured, the first
    step takes every short one (and the batch's rest of the long one)."""
    sizes = [16 + i for i in range(1, 12)]
    burst = [chat(400, 0), *(chat(n, i) for i, n in enumerate(sizes, 1))]
    executor.prefill_cost = FixedCost(CPU)
    long, *short = first_token_steps(executor, burst)
    first = admitted(sizes, step_budget(0, linear(*CPU), executor.runtime.batch_size))
    assert 1 < first < len(sizes) and short.count(1) == first
    assert short == sorted(short) and long > max(short)
    assert executor.stats.num_prompts_put_off > 0
    for line in (GPU, None):
        for slot in executor.slots:
            executor.clear(slot)
            slot.ledger = None
        executor.prefill_cost = FixedCost(line)
        # (every short one in the first step; the long one's rest past the batch after)
        assert first_token_steps(executor, burst)[1:] == [1] * 11, line


def test_a_long_prompt_that_waited_goes_first(executor: Executor) -> None:
    """Aging: the long prompt started a while ago (its start moved back, not waited for)."""
    executor.prefill_cost = FixedCost(CPU)
    slots: list[Slot] = executor.slots[:2]
    for i, (slot, items) in enumerate(zip(slots, [chat(400, 0), chat(16, 1)], strict=True)):
        job = Job(items, {}, KeptEvents(), sampling=SamplingConfig(temperature=0), max_tokens=2)
        job.note = str(i).encode()
        executor.start(slot, job, executor.enter(slot, job))
    slots[0].t_start -= 400 * CPU[1] / AGING + 1.0
    outcome = executor.step(slots)
    assert slots[0].num_prefill_done == 400 and slots[1].num_prefill_done == 0
    assert [int(job.note) for job, e in outcome.events if isinstance(e, Sampled)] == [0]


def test_a_step_s_estimate_errs_long() -> None:
    """Measured sizes as measured; others from a one-token step on the steepest cost per
    token seen (a burst's tokens deep in a context cost more than a long prompt's first
    batch's): never a cheaper step than the measurements say."""
    cost = StepCost()
    assert cost.estimate(16) is None  # (no one-token step yet)
    cost.observe(1, 0.02)
    cost.observe(72, 0.25)  # (3.2 ms a token more)
    cost.observe(512, 0.85)  # (1.6 ms)
    assert cost.estimate(72) == 0.25 and cost.estimate(0) == 0.0
    steep = (0.25 - 0.02) / 71
    assert cost.estimate(200) == pytest.approx(0.02 + steep * 199)
    assert cost.estimate(200) > 0.25 + (0.85 - 0.25) * (200 - 72) / (512 - 72)  # (no line)


def test_a_few_cells_over_a_one_token_step_do_not_make_the_slope() -> None:
    """(a GPU: one jittery 2-token step must not cut a burst's budget by a factor)"""
    cost = StepCost()
    for n, t in ((1, 0.010), (256, 0.018), (512, 0.025)):
        cost.observe(n, t)
    budget = step_budget(0, cost.estimate, 512)
    cost.observe(2, 0.013)
    assert step_budget(0, cost.estimate, 512) == budget == 512
    assert cost.estimate(300) == pytest.approx(0.010 + (0.018 - 0.010) / 255 * 299)


def test_a_take_is_a_segment_per_message() -> None:
    """Pieces of one message join into one segment; another message starts its own; the batch
    gets them all as one run of tokens."""
    pending = deque(
        [Item.text([5, 6], 0), Item.text([7], 0), Item.text([8, 9], 1), Item.text([10, 11], 1)]
    )
    item, parts = take_text(pending, 6)
    assert item.token_ids == (5, 6, 7, 8, 9, 10)
    assert [(p.message_index, p.token_ids) for p in parts] == [(0, (5, 6, 7)), (1, (8, 9, 10))]
    assert [i.token_ids for i in pending] == [(11,)]
