"""One pool of KV cells (--kv-unified): the pool's count against a model of the cells, every
sequence's cells against llama.cpp's (tests/pool_oracle.py), and prefixes shared."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pool_oracle import PoolOracle, open_pool

from infer_service.kv.ledger import ContextConfig, Item, Ledger, Segment, atoms, num_pinned
from infer_service.kv.pool import Pool
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.runtime import SamplingConfig
from infer_service.runner.slot import Slot

HOLDERS = (10, 11)
SLOTS = (0, 1, 2)


def segments(num_cells: int) -> tuple[Segment, ...]:
    return (Segment(Item.text(range(num_cells), 0), 0, True),)


# -- the pool's count, against a model that knows every cell -------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), st.integers(0, 3), st.integers(1, 40)),
        st.tuples(st.just("share"), st.sampled_from(SLOTS), st.integers(0, 3)),
        st.tuples(st.just("grow"), st.sampled_from(SLOTS), st.integers(1, 30)),
        st.tuples(st.just("cut"), st.sampled_from(SLOTS), st.integers(0, 60)),
        st.tuples(st.just("clear"), st.sampled_from(SLOTS), st.just(0)),
        st.tuples(st.just("drop"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_pool_counts_each_cell_once(steps: list[tuple[str, int, int]]) -> None:
    """Cells are modelled one by one (a cell: a number; a sequence: the list of its cells in
    order); the pool must count exactly the cells some sequence has."""
    pool = Pool(1 << 20, HOLDERS)
    fresh = iter(range(1 << 30))
    seqs: dict[int, list[int]] = {s: [] for s in (*SLOTS, *HOLDERS)}
    for op, a, b in steps:
        if op == "hold":
            key = ("t", (a,))
            if pool.find(key) is not None:
                continue
            holder, dropped = pool.hold(key, segments(b))
            if dropped is not None:
                seqs[dropped.seq] = []
            if holder is not None:
                seqs[holder.seq] = [next(fresh) for _ in range(b)]
        elif op == "share":
            holder = pool.find(("t", (b,)))
            if holder is None:
                continue
            seqs[a] = list(seqs[holder.seq])  # (a sequence given a prefix was cleared first)
            pool.share(a, holder)
        elif op == "grow":
            seqs[a] += [next(fresh) for _ in range(b)]
        elif op == "cut":
            del seqs[a][b:]
            pool.cut(a, len(seqs[a]))
        elif op == "clear":
            seqs[a] = []
            pool.unshare(a)
        elif op == "drop":
            idle = pool.idle()
            if idle:
                seqs[idle[0].seq] = []
                pool.drop(idle[0])
        in_use = {c for cells in seqs.values() for c in cells}
        assert pool.num_used((s, len(seqs[s])) for s in SLOTS) == len(in_use)
        for h in pool.holders:
            assert len(seqs[h.seq]) == h.num_cells
            for user in h.users:
                n = pool.shared_cells(user)
                assert seqs[user][:n] == seqs[h.seq][:n]
                assert set(seqs[user][n:]).isdisjoint(seqs[h.seq])
        assert all(pool.holder_of(s) is None or s in pool.holder_of(s).users for s in SLOTS)


def test_a_shared_holder_is_never_dropped_and_the_least_recently_used_idle_one_goes() -> None:
    pool = Pool(100, HOLDERS)
    first, _ = pool.hold(("t", (1,)), segments(5))
    second, _ = pool.hold(("t", (2,)), segments(5))
    assert first is not None and second is not None
    pool.share(0, first)
    with pytest.raises(ValueError):
        pool.drop(first)
    third, dropped = pool.hold(("t", (3,)), segments(5))
    assert dropped is second and third is not None and third.seq == second.seq
    pool.share(1, third)
    assert pool.hold(("t", (4,)), segments(5)) == (None, None)  # every holder shared
    pool.unshare(0)
    assert pool.idle() == [first]


# -- the ledger's side ------------------------------------------------------------------------


def test_num_pinned_follows_the_ledgers_own_rule() -> None:
    items = [Item.text([1] * 10, 0), Item.text([2] * 10, 0, group=7), Item.text([3] * 5, 1)]
    for keep in range(0, 30):
        ledger = Ledger(1000, can_shift=True, n_ctx_train=1000, keep=keep)
        for item in items:
            ledger.append(item)
        assert num_pinned(items, keep) == ledger.num_pinned_segments


def test_an_adopted_prefix_is_pinned_exact_and_matched_as_held() -> None:
    donor = Ledger(100, can_shift=True, n_ctx_train=1000, keep=12)
    donor.append(Item.text(range(12), 0))
    donor.append(Item.text(range(50, 55), 1))
    ledger = Ledger(100, can_shift=True, n_ctx_train=1000)
    ledger.adopt(donor.segments[:1])
    assert ledger.num_pinned_cells == ledger.num_cells == 12
    assert ledger.num_exact_segments == 1
    assert atoms(ledger.segments) == tuple(range(12))
    with pytest.raises(ValueError):
        ledger.adopt(donor.segments[:1])  # (only an empty ledger)


# -- against llama.cpp ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(tiny) -> Iterator[PoolOracle]:
    rt = open_pool(tiny["rope"])
    o = PoolOracle(rt)
    try:
        yield o
    finally:
        o.close()
        rt.close()


def test_the_pool_against_llama_cpp(oracle: PoolOracle) -> None:
    """Random chats of two tenants and two salts in a small pool: after every step each
    sequence's cells are its ledger's (holders' untouched by shifts; a generation put aside for
    another tenant holds none), the pool's count is llama.cpp's, no cell crosses a tenant, and
    no decode fails."""
    total = {"shared": 0, "shifts": 0, "waited": 0, "nested": 0, "preempted": 0}
    # (seed 16's script fills the pool while another tenant's prompt waits: a generation is
    # put aside; the first six seldom do, now that a prompt's messages go in one step)
    for seed in (*range(6), 16):
        report = oracle.run(seed)
        for k in total:
            total[k] += getattr(report, k)
    # the scripts did what they are for: prefixes shared (some nested in a longer pinned
    # prefix), shifts and waits for the pool
    assert all(n > 0 for n in total.values()), total


def test_cells_in_use_reads_what_llama_cpp_holds(tiny) -> None:
    """The oracle's reader, checked on a cache it did not fill through the executor."""
    rt = open_pool(tiny["rope"])
    try:
        rt.batch.clear()
        rt.batch.add([5, 6, 7], 0, 0, logits_last=True)
        assert rt.decode() == 0
        rt.seq_cp(0, 3, 0, 2)
        assert rt.cells_in_use() == [(0, (0, 3)), (1, (0, 3)), (2, (0,))]
    finally:
        rt.close()


def test_prompts_that_together_overflow_the_pool_wait_then_one_ends_pool_full(tiny) -> None:
    """Two long prompts go in pieces beside a slot that generates, in a pool that holds one of
    them: while it generates they wait for room (its end frees it); once nothing generates,
    one of them ends RESOURCE_EXHAUSTED (POOL_FULL, retry after) and the other runs to its
    end. No decode fails."""
    from infer_service.events import ErrorKind, Reason
    from infer_service.runner.executor import Executor
    from infer_service.runner.job import Job, KeptEvents
    from infer_service.runner.runtime import SamplingConfig
    from infer_service.runner.slot import Slot
    from infer_service.runner.stats import EngineStats

    rt = open_pool(tiny["rope"], cells=256, batch=256)
    slots = [Slot(seq) for seq in range(rt.num_slots)]
    stats = EngineStats()
    ex = Executor(rt, stats, cache_bytes=0, host_sequence_bytes=0, slots=slots)
    never = tuple((t, float("-inf")) for t in range(rt.num_vocab) if rt.is_eog(t))

    def start(slot: Slot, first: int, n: int, max_tokens: int) -> None:
        job = Job(
            [Item.text([3 + (first + i) % 200 for i in range(n)], 0)], {}, KeptEvents(),
            sampling=SamplingConfig(temperature=0), max_tokens=max_tokens, logit_bias=never,
        )  # fmt: skip
        ex.start(slot, job, ex.enter(slot, job))

    try:
        start(slots[0], 0, 10, max_tokens=30)
        while slots[0].prefilling:
            ex.step(slots)
        start(slots[1], 1, 200, max_tokens=2)
        start(slots[2], 2, 200, max_tokens=2)
        endings = []
        while any(s.job for s in slots):
            endings += ex.step(slots).endings
        assert stats.num_pool_waits > 0
        failed = [e for e in endings if e.problem is not None]
        assert len(endings) == 3 and len(failed) == 1, [e.problem for e in endings]
        assert failed[0].problem.kind is ErrorKind.RESOURCE_EXHAUSTED
        assert failed[0].problem.reason is Reason.POOL_FULL and failed[0].problem.retry_after
        assert stats.num_failed_decodes == 0
    finally:
        ex.close()
        rt.close()


def test_a_new_system_prompt_is_held_where_slots_began_with_another(oracle: PoolOracle) -> None:
    """Chats on one system prompt fill the slots, each sharing it; then the system prompt
    changes (a chat template's header is all the two have in common). The first chat on the
    new one decodes it and the pool holds it, though its slot began with a few of the old one's
    cells; the next chat shares it instead of decoding it again."""
    ex, slots = oracle.executor, oracle.slots
    header = [2, 5, 7, 11]
    old = header + [13 + i % 97 for i in range(60)]
    new = header + [17 + i % 89 for i in range(60)]

    def run(slot: Slot, system: list[int], question: int) -> int:
        items = [Item.text(system, 0), Item.text([40 + question, 41, 42], 1)]
        job = Job(
            items, {}, KeptEvents(), sampling=SamplingConfig(temperature=0), max_tokens=1,
            context=ContextConfig(keep=len(system)),
        )  # fmt: skip
        shared = ex.stats.num_shared_cells
        ex.start(slot, job, ex.enter(slot, job))
        while slot.job is not None:
            ex.step([slot])
            oracle.verify()
        return ex.stats.num_shared_cells - shared

    for i, slot in enumerate(slots):
        assert run(slot, old, i) == (0 if i == 0 else len(old))
    assert run(slots[1], new, 7) == 0  # (the old one's header is not shared: decoded again)
    assert run(slots[2], new, 8) == len(new)
    # a prompt that opens with all of a held one and pins more: the slot keeps what it shares
    # (cleared, it would decode the held prompt again for a prefix of its own)
    longer = new + [19 + i % 83 for i in range(40)]
    ex.stats.num_shared_prefixes = shares = 0
    assert run(slots[2], longer, 9) == 0 and ex.stats.num_shared_prefixes == shares
    assert slots[2].usage.num_reused_cells >= len(new)


def test_a_generation_put_aside_at_its_slot_s_capacity_goes_on(tiny) -> None:
    """A pinned generation whose slot is as large as the pool is put aside at the very step
    its ledger is full, for another tenant's prompt. Once that prompt's reply ends it goes on:
    its next token's room is made by its own policy (a shift of its unpinned cells), not asked
    of the pool, which could never give a full slot's cells and one more."""
    from infer_service.runner.executor import Executor
    from infer_service.runner.stats import EngineStats

    rt = open_pool(tiny["rope"], cells=256, batch=256)
    slots = [Slot(seq) for seq in range(rt.num_slots)]
    stats = EngineStats()
    ex = Executor(rt, stats, cache_bytes=0, host_sequence_bytes=0, slots=slots)
    never = tuple((t, float("-inf")) for t in range(rt.num_vocab) if rt.is_eog(t))

    def start(slot: Slot, tenant: str, n: int, max_tokens: int, keep: int = 0) -> None:
        job = Job(
            [Item.text([3 + (7 * i) % 200 for i in range(n)], 0)], {}, KeptEvents(),
            sampling=SamplingConfig(temperature=0), max_tokens=max_tokens, logit_bias=never,
            context=ContextConfig(keep=keep), tenant=tenant,
        )  # fmt: skip
        ex.start(slot, job, ex.enter(slot, job))

    try:
        assert rt.num_cells_per_slot == 256  # (each slot free to grow to the whole pool)
        start(slots[0], "alice", 200, max_tokens=400, keep=200)
        while slots[0].ledger is None or slots[0].ledger.num_free_cells > 1:
            ex.step(slots)
        # bob's prompt asks for room in the step whose token fills alice's slot: she is put
        # aside after it, full
        start(slots[1], "bob", 120, max_tokens=2)
        for _ in range(2000):
            if not any(s.job for s in slots):
                break
            ex.step(slots)
        assert stats.num_preemptions == 1
        assert not any(s.job for s in slots), "the generation put aside never went on"
        assert slots[0].usage.num_generated_tokens == 400
    finally:
        ex.close()
        rt.close()
