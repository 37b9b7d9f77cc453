"""The ledger: hand-computed plans per policy, and invariants over random engine loops.

A fake llama.cpp sequence (``FakeSequence``) carries out each plan the way llama.cpp would
(seq_rm / seq_add / clear, one position per cell, M-RoPE media cells all at t = start) and
checks llama.cpp's capacity and position rules, so the ledger is compared cell for cell.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.kv.ledger import (
    Admission,
    CannotFit,
    EvictionUnit,
    Fits,
    Gap,
    Item,
    Ledger,
    Plan,
    Policy,
    Reprefill,
    Segment,
    Shift,
)

ROOT = Path(__file__).resolve().parents[1]


# -- factory and fabricated engine -------------------------------------------------------------


def make_ledger(capacity: int = 10, **kwargs: object) -> Ledger:
    options: dict[str, object] = {"can_shift": True, "n_ctx_train": 4096}
    options.update(kwargs)
    return Ledger(capacity, **options)  # type: ignore[arg-type]


def text(n: int, message_index: int = 0, *, first: int = 0, group: int | None = None) -> Item:
    return Item.text(range(first, first + n), message_index, group=group)


def image(
    cells: int,
    positions: int,
    message_index: int = 0,
    *,
    group: int | None = None,
    name: str = "img",
) -> Item:
    return Item.media(name, cells, positions, message_index, group=group)


def wrapped(cells: int, positions: int, message_index: int, group: int) -> list[Item]:
    """Qwen-style: <|vision_start|> image <|vision_end|>, one media group."""
    return [
        text(1, message_index, first=900, group=group),
        image(cells, positions, message_index, group=group),
        text(1, message_index, first=901, group=group),
    ]


def fill(ledger: Ledger, items: Sequence[Item]) -> None:
    for item in items:
        ledger.append(item)


class FakeSequence:
    """The cells llama.cpp holds for one sequence: one position per cell."""

    def __init__(self, capacity: int, *, mrope: bool) -> None:
        self.capacity = capacity
        self.mrope = mrope
        self.cells: list[int] = []

    def seq_rm(self, p0: int, p1: int) -> None:
        self.cells = [p for p in self.cells if not p0 <= p < p1]

    def seq_add(self, p0: int, p1: int, delta: int) -> None:
        self.cells = [p + delta if p >= p0 and (p1 < 0 or p < p1) else p for p in self.cells]

    def decode(self, item: Item, pos: int) -> None:
        assert len(self.cells) + item.num_cells <= self.capacity, "no KV slot"
        last = max(self.cells, default=-1)
        if self.mrope:  # llama_batch_allocr: positions may only jump forward (media: X <= Y)
            assert last <= pos if item.is_media else last < pos
        else:  # Y = X + 1
            assert last < 0 or pos == last + 1
        if self.mrope and item.is_media:
            self.cells += [pos] * item.num_cells
        else:
            self.cells += range(pos, pos + item.num_cells)


def expected_cells(ledger: Ledger, *, mrope: bool) -> list[int]:
    cells: list[int] = []
    for s in ledger.segments:
        if mrope and s.is_media:
            cells += [s.pos_start] * s.num_cells
        else:
            cells += range(s.pos_start, s.pos_end)
    return sorted(cells)


def decode(ledger: Ledger, seq: FakeSequence, item: Item) -> Segment:
    seq.decode(item, ledger.next_pos)
    return ledger.append(item)


def carry_out(ledger: Ledger, seq: FakeSequence, plan: Plan) -> None:
    """What the engine does with a plan, then its report back to the ledger."""
    if isinstance(plan, Shift):
        seq.seq_rm(plan.p0, plan.p1)
        seq.seq_add(plan.p1, -1, -plan.delta)
    elif isinstance(plan, Gap):
        seq.seq_rm(plan.p0, plan.p1)
    elif isinstance(plan, Reprefill):
        seq.cells = []
    ledger.apply(plan)
    if isinstance(plan, Reprefill):
        for item in plan.kept:
            assert ledger.ensure(item.num_cells, item.num_positions) == Fits()
            decode(ledger, seq, item)


def step(ledger: Ledger, seq: FakeSequence, item: Item) -> Plan:
    plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
    if not isinstance(plan, CannotFit):
        carry_out(ledger, seq, plan)
        decode(ledger, seq, item)
    return plan


# -- plain unit tests, hand-computed -----------------------------------------------------------


def test_fits_when_there_is_room() -> None:
    ledger = make_ledger(10)
    ledger.append(text(4))
    assert ledger.ensure(6) == Fits()
    assert ledger.ensure(0) == Fits()
    assert ledger.ensure(7) != Fits()
    assert (ledger.num_cells, ledger.num_free_cells, ledger.next_pos) == (4, 6, 4)


def test_shift_evicts_half_of_the_evictable_cells_after_the_pinned_prefix() -> None:
    ledger = make_ledger(10, keep=2)
    fill(ledger, [text(2), text(8, 1, first=10)])
    assert [s.pinned for s in ledger.segments] == [True, False]
    plan = ledger.ensure(1)
    # needed 1, evictable 8, half of it 4: the first 4 tokens of message 1
    assert plan == Shift(p0=2, p1=6, evicted=(Segment(text(4, 1, first=10), 2, False),))
    assert isinstance(plan, Shift)
    assert (plan.delta, plan.num_cells_evicted, plan.num_positions_evicted) == (4, 4, 4)
    ledger.apply(plan)
    assert ledger.segments == (
        Segment(text(2), 0, True),
        Segment(text(4, 1, first=14), 2, False),
    )
    assert (ledger.num_cells, ledger.next_pos, ledger.num_pinned_cells) == (6, 6, 2)


def test_shift_moves_back_by_the_position_span_and_takes_the_wrappers_along() -> None:
    ledger = make_ledger(12, keep=1)
    fill(ledger, [text(1), text(2, 1, first=10), *wrapped(6, 2, 1, group=7), text(1, 1, first=20)])
    assert (ledger.num_cells, ledger.next_pos) == (12, 8)
    plan = ledger.ensure(1)
    # evictable 11, target ceil(5.5) = 6: text(2) then the whole group (8 cells, 4 positions)
    assert isinstance(plan, Shift)
    assert (plan.p0, plan.p1, plan.delta) == (1, 7, 6)
    assert (plan.num_cells_evicted, plan.num_positions_evicted) == (10, 6)
    assert plan.media_ids_evicted == ("img",)
    assert [s.group for s in plan.evicted] == [None, 7, 7, 7]
    ledger.apply(plan)
    assert ledger.segments == (Segment(text(1), 0, True), Segment(text(1, 1, first=20), 1, False))
    assert (ledger.num_cells, ledger.next_pos) == (2, 2)


def mrope_conversation(ledger: Ledger) -> None:
    """2 pinned tokens, a wrapped image (12 cells, 5 positions), 6 tokens: 20 cells, 13 pos."""
    fill(ledger, [text(2), *wrapped(10, 3, 1, group=0), text(6, 1, first=20)])
    assert (ledger.num_cells, ledger.next_pos) == (20, 13)


def test_gap_removes_without_moving_positions() -> None:
    ledger = make_ledger(20, can_shift=False, n_ctx_train=100, keep=2)
    mrope_conversation(ledger)
    assert ledger.effective_policy() is Policy.GAP
    plan = ledger.ensure(1)
    assert isinstance(plan, Gap)
    assert (plan.p0, plan.p1, plan.num_cells_evicted, plan.num_positions_evicted) == (2, 7, 12, 5)
    ledger.apply(plan)
    assert ledger.segments == (Segment(text(2), 0, True), Segment(text(6, 1, first=20), 7, False))
    assert (ledger.num_cells, ledger.next_pos) == (8, 13)
    assert ledger.append(text(1, 2, first=30)).pos_start == 13


def test_gap_turns_into_reprefill_past_n_ctx_train() -> None:
    ledger = make_ledger(20, can_shift=False, n_ctx_train=13, keep=2)
    mrope_conversation(ledger)
    assert ledger.effective_policy() is Policy.REPREFILL
    plan = ledger.ensure(1)
    assert isinstance(plan, Reprefill)
    assert plan.kept == (text(2), text(6, 1, first=20))
    assert plan.num_cells_evicted == 12
    ledger.apply(plan)
    assert (ledger.num_cells, ledger.next_pos) == (0, 0)
    fill(ledger, plan.kept)
    assert [(s.pos_start, s.pinned) for s in ledger.segments] == [(0, True), (2, False)]
    assert ledger.next_pos == 8


def test_gap_renumbers_positions_when_cells_fit_but_positions_pass_n_ctx_train() -> None:
    ledger = make_ledger(20, can_shift=False, n_ctx_train=14, keep=2)
    mrope_conversation(ledger)
    ledger.apply(ledger.ensure(1))  # a Gap: 13 + 1 <= 14
    ledger.append(text(1, 2, first=30))
    assert (ledger.num_cells, ledger.next_pos) == (9, 14)
    plan = ledger.ensure(1)
    assert plan == Reprefill(kept=tuple(s.item for s in ledger.segments), evicted=())
    ledger.apply(plan)
    fill(ledger, plan.kept)
    assert (ledger.num_cells, ledger.next_pos) == (9, 9)
    assert ledger.ensure(1) == Fits()


def test_gap_that_evicts_the_newest_segment_moves_next_pos_back() -> None:
    # llama.cpp without M-RoPE wants the next position right after the last one it holds
    ledger = make_ledger(10, can_shift=False, keep=2, discard_fraction=0.0)
    fill(ledger, [text(2), text(3, 1, first=10)])
    plan = ledger.ensure(8)
    assert plan == Gap(p0=2, p1=5, evicted=(Segment(text(3, 1, first=10), 2, False),))
    ledger.apply(plan)
    assert ledger.next_pos == 2


def test_reprefill_policy_keeps_the_rest_in_order() -> None:
    ledger = make_ledger(8, policy=Policy.REPREFILL)
    fill(ledger, [text(3), text(5, 1, first=10)])
    plan = ledger.ensure(2)
    # needed 2, half of 8 is 4: all of message 0 and the first token of message 1
    assert plan == Reprefill(
        kept=(text(4, 1, first=11),),
        evicted=(Segment(text(3), 0, False), Segment(text(1, 1, first=10), 3, False)),
    )


def test_stop_never_evicts() -> None:
    ledger = make_ledger(4, policy=Policy.STOP)
    ledger.append(text(4))
    assert ledger.ensure(0) == Fits()
    plan = ledger.ensure(1)
    assert plan == CannotFit(num_cells_needed=5, num_capacity_cells=4, num_pinned_cells=0)
    assert isinstance(plan, CannotFit)
    assert "5" in plan.message and "4" in plan.message


def test_discard_fraction_zero_frees_just_what_is_needed() -> None:
    ledger = make_ledger(10, discard_fraction=0.0)
    ledger.append(text(10))
    assert ledger.ensure(3) == Shift(p0=0, p1=3, evicted=(Segment(text(3), 0, False),))


def test_message_unit_evicts_whole_messages() -> None:
    ledger = make_ledger(10, unit=EvictionUnit.MESSAGE, discard_fraction=0.0)
    fill(ledger, [text(3), text(2, 1, first=3), text(2, 1, first=5), text(3, 2, first=7)])
    one = ledger.ensure(1)
    assert isinstance(one, Shift) and (one.p0, one.p1, len(one.evicted)) == (0, 3, 1)
    four = ledger.ensure(4)
    assert isinstance(four, Shift) and (four.p0, four.p1, len(four.evicted)) == (0, 7, 3)


def test_media_without_a_group_is_never_split() -> None:
    ledger = make_ledger(10, discard_fraction=0.0)
    fill(ledger, [image(6, 6), text(4, first=10)])
    plan = ledger.ensure(1)
    assert isinstance(plan, Shift) and (plan.p0, plan.p1) == (0, 6)


def test_pinned_prefix_rounds_up_to_the_whole_group() -> None:
    ledger = make_ledger(12, keep=2)
    fill(ledger, [text(1), *wrapped(4, 4, 0, group=1), text(2, 1, first=10)])
    assert [s.pinned for s in ledger.segments] == [True, True, True, True, False]
    assert ledger.num_pinned_cells == 7


def test_pinned_everything_cannot_fit() -> None:
    ledger = make_ledger(8, keep=100)
    ledger.append(text(8))
    assert ledger.ensure(1) == CannotFit(9, 8, 8)
    assert ledger.ensure(9) == CannotFit(17, 8, 8)


def test_shift_without_shift_support_falls_back_to_gap_then_reprefill() -> None:
    ledger = make_ledger(4, can_shift=False, n_ctx_train=5, policy=Policy.SHIFT)
    ledger.append(text(4))
    assert ledger.effective_policy() is Policy.GAP
    assert isinstance(ledger.ensure(1), Gap)
    assert isinstance(ledger.ensure(2), Reprefill)


def test_the_group_being_decoded_is_not_evicted() -> None:
    ledger = make_ledger(10, discard_fraction=0.0)
    fill(ledger, [text(4), text(1, first=900, group=3)])  # <|vision_start|> decoded
    assert ledger.ensure(10, 2) == Shift(
        p0=0,
        p1=5,
        evicted=(Segment(text(4), 0, False), Segment(text(1, first=900, group=3), 4, False)),
    )
    assert ledger.ensure(10, 2, group=3) == CannotFit(11, 10, 0)
    assert ledger.ensure(9, 2, group=3) == Shift(p0=0, p1=4, evicted=(Segment(text(4), 0, False),))


def test_admit_keeps_a_prompt_that_fits_with_one_token_to_spare() -> None:
    ledger = make_ledger(10)
    items = [text(4), text(5, first=4)]
    assert ledger.admit(items, truncate=False) == Admission(kept=tuple(items))
    assert ledger.admit([text(5), text(5, first=5)], truncate=False) == CannotFit(11, 10, 0)


def test_admit_truncates_the_oldest_unpinned_tokens() -> None:
    ledger = make_ledger(10, keep=2)
    items = [text(3), text(4, 1, first=3), text(5, 2, first=7)]
    result = ledger.admit(items, truncate=True)
    assert result == Admission(
        kept=(text(3), text(1, 1, first=6), text(5, 2, first=7)),
        dropped=(text(3, 1, first=3),),
    )
    assert isinstance(result, Admission) and result.num_cells_dropped == 3


def test_admit_drops_media_groups_whole() -> None:
    ledger = make_ledger(11)
    items = [text(2), *wrapped(6, 2, 1, group=1), text(3, 2, first=10)]
    result = ledger.admit(items, truncate=True)
    assert result == Admission(kept=(items[-1],), dropped=tuple(items[:-1]))
    assert isinstance(result, Admission)
    assert (result.num_cells_dropped, result.num_positions_dropped) == (10, 6)
    assert result.media_ids_dropped == ("img",)


def test_admit_by_message() -> None:
    ledger = make_ledger(10, unit=EvictionUnit.MESSAGE)
    items = [text(3), text(3, 1, first=3), text(3, 1, first=6), text(2, 2, first=9)]
    assert ledger.admit(items, truncate=True) == Admission(
        kept=tuple(items[1:]), dropped=(items[0],)
    )


def test_admit_never_drops_the_newest_unit_or_the_pinned_prefix() -> None:
    assert make_ledger(8).admit([text(2), image(8, 8, 1)], truncate=True) == CannotFit(11, 8, 0)
    assert make_ledger(10, keep=10).admit([text(10)], truncate=True) == CannotFit(11, 10, 10)


def test_admit_counts_what_the_ledger_already_holds() -> None:
    auto = make_ledger(10)
    auto.append(text(6))
    assert auto.admit([text(4, first=6)], truncate=False) == Admission(kept=(text(4, first=6),))
    stop = make_ledger(10, policy=Policy.STOP)
    stop.append(text(6))
    assert stop.admit([text(4, first=6)], truncate=False) == CannotFit(11, 10, 0)


def test_programming_errors_raise() -> None:
    ledger = make_ledger(4)
    ledger.append(text(4))
    with pytest.raises(ValueError):
        ledger.append(text(1))
    with pytest.raises(ValueError):
        ledger.ensure(-1)
    with pytest.raises(ValueError):
        ledger.apply(CannotFit(5, 4, 0))
    plan = ledger.ensure(2)
    ledger.apply(plan)
    with pytest.raises(ValueError):
        ledger.apply(plan)  # stale: those tokens are gone
    for bad in (
        lambda: Item(2, 2, 0, (1,)),
        lambda: Item(1, 1, -1, (1,)),
        lambda: Item(0, 0, 0, ()),
        lambda: Item(1, 1, 0, (1,), media_id="x"),
        lambda: image(0, 1),
        lambda: make_ledger(0),
        lambda: make_ledger(4, discard_fraction=1.5),
        lambda: make_ledger(4, keep=-1),
    ):
        with pytest.raises(ValueError):
            bad()


def test_importing_the_ledger_loads_no_llama_grpc_protobuf_or_numpy() -> None:
    code = (
        "import sys, infer_service.kv.ledger; "
        "print([m for m in ('llama_cpp', 'grpc', 'google.protobuf', 'numpy') if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


# -- properties over random engine loops -------------------------------------------------------


def atoms(items: Sequence[Item]) -> list[object]:
    """One atom per token id, one per media chunk (ids are unique in the generated streams)."""
    return [a for i in items for a in (i.token_ids or (i.media_id,))]


@st.composite
def item_streams(draw: st.DrawFn, capacity: int, mrope: bool) -> list[Item]:
    items: list[Item] = []
    message_index = group = token = 0

    def tokens(n: int, group_id: int | None = None) -> Item:
        nonlocal token
        token += n
        return Item.text(range(token - n, token), message_index, group=group_id)

    for _ in range(draw(st.integers(1, 20))):
        message_index += draw(st.integers(0, 1))
        kind = draw(st.sampled_from(["text", "generated", "media"]))
        if kind == "text":
            items.append(tokens(draw(st.integers(1, max(1, capacity // 2)))))
        elif kind == "generated":
            items += [tokens(1) for _ in range(draw(st.integers(1, 8)))]
        else:
            group += 1
            wrap = draw(st.booleans())
            num_chunks = draw(st.integers(1, 2))
            group_id = group if wrap or num_chunks > 1 or draw(st.booleans()) else None
            chunks: list[Item] = [tokens(1, group_id)] if wrap else []
            for k in range(num_chunks):
                if k:
                    chunks.append(tokens(1, group_id))  # separator between slices
                cells = draw(st.integers(1, max(1, capacity // 2)))
                positions = draw(st.integers(1, max(1, cells // 4))) if mrope else cells
                name = f"img{group}.{k}"
                chunks.append(Item.media(name, cells, positions, message_index, group=group_id))
            items += [*chunks, tokens(1, group_id)] if wrap else chunks
    return items


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Ledger, bool, list[Item]]:
    mrope = draw(st.booleans())
    capacity = draw(st.integers(8, 48))
    ledger = Ledger(
        capacity,
        can_shift=False if mrope else draw(st.booleans()),
        n_ctx_train=draw(st.integers(capacity, 3 * capacity)),
        policy=draw(st.sampled_from([Policy.AUTO, *Policy])),
        keep=draw(st.sampled_from([0, 0, 1, 3, capacity // 2, capacity + 5])),
        discard_fraction=draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0.0, 1.0)),
        unit=draw(st.sampled_from(EvictionUnit)),
    )
    return ledger, mrope, draw(item_streams(capacity, mrope))


def shifts(ledger: Ledger) -> bool:
    return ledger.can_shift and ledger.policy in (Policy.AUTO, Policy.SHIFT)


def check_positions(ledger: Ledger) -> None:
    segs = ledger.segments
    pairs = list(itertools.pairwise(segs))
    if ledger.policy in (Policy.AUTO, Policy.SHIFT, Policy.GAP) and not shifts(ledger):
        assert all(b.pos_start >= a.pos_end for a, b in pairs)  # GAP: strictly increasing
        assert ledger.next_pos <= ledger.n_ctx_train
    else:  # SHIFT, REPREFILL, STOP: contiguous from 0
        assert not segs or segs[0].pos_start == 0
        assert all(b.pos_start == a.pos_end for a, b in pairs)


def check_plan(ledger: Ledger, before: tuple[Segment, ...], item: Item, plan: Plan) -> None:
    num_before = sum(s.num_cells for s in before)
    num_needed = num_before + item.num_cells - ledger.capacity
    if isinstance(plan, CannotFit):
        assert plan.num_cells_needed > plan.num_capacity_cells == ledger.capacity
        assert ledger.segments == before
        return
    if isinstance(plan, Reprefill):  # restarts at 0 with the kept items, in order
        assert [s.item for s in ledger.segments] == [*plan.kept, item]
    if num_needed <= 0:  # nothing evicted when nothing is needed
        assert plan == Fits() or (isinstance(plan, Reprefill) and plan.evicted == ())
        return
    assert not isinstance(plan, Fits)
    assert plan.num_cells_evicted >= num_needed
    assert not any(s.pinned for s in plan.evicted)
    gone = set(atoms([s.item for s in plan.evicted]))
    kept_before = [a for a in atoms([s.item for s in before]) if a not in gone]
    if isinstance(plan, Reprefill):
        assert atoms(plan.kept) == kept_before
    else:
        assert atoms([s.item for s in ledger.segments]) == [*kept_before, *atoms([item])]
        assert ledger.num_cells == num_before - plan.num_cells_evicted + item.num_cells
    if isinstance(plan, Shift):
        assert plan.delta == plan.num_positions_evicted
    if isinstance(plan, Gap):  # kept segments keep their positions
        assert {s.pos_end for s in ledger.segments[:-1]} <= {s.pos_end for s in before}


@settings(max_examples=250, deadline=None, database=None)
@given(scenarios())
def test_engine_loop_invariants(scenario: tuple[Ledger, bool, list[Item]]) -> None:
    ledger, mrope, items = scenario
    seq = FakeSequence(ledger.capacity, mrope=mrope)
    num_appended: Counter[int] = Counter()
    for item in items:
        before = ledger.segments
        plan = step(ledger, seq, item)
        if not isinstance(plan, CannotFit) and item.group is not None:
            num_appended[item.group] += 1
        check_plan(ledger, before, item, plan)
        segs = ledger.segments
        # the account is exact: llama.cpp's cells are the ledger's cells
        assert ledger.num_cells == sum(s.num_cells for s in segs) <= ledger.capacity
        assert sorted(seq.cells) == expected_cells(ledger, mrope=mrope)
        # pinned segments form a prefix and never leave
        pinned = [s for s in segs if s.pinned]
        assert segs[: len(pinned)] == tuple(pinned)
        assert ledger.num_pinned_cells == sum(s.num_cells for s in pinned)
        pinned_before = tuple(s for s in before if s.pinned)
        assert tuple(pinned[: len(pinned_before)]) == pinned_before
        # media groups (wrappers included) are all there or all gone
        present = Counter(s.group for s in segs if s.group is not None)
        assert all(present[g] == num_appended[g] for g in present)
        check_positions(ledger)


@settings(max_examples=200, deadline=None, database=None)
@given(scenarios(), st.booleans())
def test_admit_reports_exactly_what_it_drops(
    scenario: tuple[Ledger, bool, list[Item]], truncate: bool
) -> None:
    ledger, _, items = scenario
    capacity = ledger.capacity
    num_total = sum(i.num_cells for i in items) + 1
    result = ledger.admit(items, truncate=truncate)
    # independent account of pins and of the newest unit
    num_pinned, prev_pinned, prev_group = 0, False, None
    unpinned: list[Item] = []
    for item in items:
        pinned = num_pinned < ledger.keep or (
            prev_pinned and item.group is not None and item.group == prev_group
        )
        num_pinned += item.num_cells if pinned else 0
        if not pinned:
            unpinned.append(item)
        prev_pinned, prev_group = pinned, item.group
    num_newest = 0
    if unpinned:
        last = unpinned[-1]
        if ledger.unit is EvictionUnit.MESSAGE:
            same = [i for i in unpinned if i.message_index == last.message_index]
        elif last.group is not None:
            same = [i for i in unpinned if i.group == last.group]
        else:
            same = [Item.text(last.token_ids[-1:], 0)] if not last.is_media else [last]
        num_newest = sum(i.num_cells for i in same)

    if num_total <= capacity:
        assert result == Admission(kept=tuple(items))
        return
    if not truncate or not unpinned or num_pinned + num_newest + 1 > capacity:
        assert result == CannotFit(num_total, capacity, num_pinned)
        return
    assert isinstance(result, Admission)
    kept, dropped = atoms(result.kept), atoms(result.dropped)
    assert sum(i.num_cells for i in result.kept) + 1 <= capacity
    assert result.num_cells_dropped == num_total - 1 - sum(i.num_cells for i in result.kept)
    # dropped is one contiguous run of the prompt, after the pinned prefix
    everything = atoms(items)
    start = everything.index(dropped[0])
    assert everything[start : start + len(dropped)] == dropped
    assert everything[:start] + everything[start + len(dropped) :] == kept
    cells = {a: i.num_cells if i.is_media else 1 for i in items for a in atoms([i])}
    assert sum(cells[a] for a in everything[:start]) >= num_pinned
    assert everything[-1] in kept
    # groups whole, and nothing more dropped than needed (one unit less would not fit)
    dropped_groups = {i.group for i in result.dropped if i.group is not None}
    assert not dropped_groups & {i.group for i in result.kept if i.group is not None}
    tail = result.dropped[-1]
    if ledger.unit is EvictionUnit.MESSAGE:
        unit = [i for i in result.dropped if i.message_index == tail.message_index]
    elif tail.group is not None:
        unit = [i for i in result.dropped if i.group == tail.group]
    else:
        unit = [tail] if tail.is_media else [Item.text(tail.token_ids[-1:], 0)]
    assert capacity - sum(i.num_cells for i in result.kept) - 1 < sum(i.num_cells for i in unit)
    # and the admitted prompt then decodes without a single eviction
    for item in result.kept:
        assert ledger.ensure(item.num_cells, item.num_positions) == Fits()
        ledger.append(item)
    assert ledger.ensure(1) == Fits()
