"""The cells a person is shown (infer_service/kv/view.py), against the ledger they come from:
runs tile the sequence exactly and merge what belongs together; an eviction is placed where it
began and named by what it took. Pure: random ledgers driven as the engine drives them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from test_ledger import FakeSequence, carry_out, decode, scenarios

from infer_service.kv.ledger import CannotFit, Fits, Item, Ledger, Reprefill, Segment
from infer_service.kv.view import PREVIEW_CHARS, CellKind, CellRun, at_cell, runs


def read(token_ids: Sequence[int]) -> str:
    return " ".join(f"t{t}" for t in token_ids)


def key(seg: Segment) -> tuple[object, ...]:
    kind = "media" if seg.is_media else ("generated" if seg.item.generated else "text")
    return kind, seg.pinned, seg.message_index, seg.media_id or ""


def check_runs(segments: Sequence[Segment], shown: Sequence[CellRun]) -> None:
    assert sum(r.num_cells for r in shown) == sum(s.num_cells for s in segments)
    # each run covers consecutive segments of one key, contiguous in positions
    i = 0
    for run in shown:
        covered = []
        while i < len(segments) and sum(s.num_cells for s in covered) < run.num_cells:
            covered.append(segments[i])
            i += 1
        assert sum(s.num_cells for s in covered) == run.num_cells
        assert {key(s) for s in covered} == {
            (run.kind.value, run.pinned, run.message_index, run.media_id)
        }
        assert run.pos_start == covered[0].pos_start
        assert run.num_positions == covered[-1].pos_end - covered[0].pos_start
        for a, b in itertools.pairwise(covered):
            assert b.pos_start == a.pos_end
        ids = [t for s in covered for t in s.token_ids]
        if ids:
            assert run.preview and len(run.preview) <= PREVIEW_CHARS
            assert run.preview.startswith(read(ids[:2])[: PREVIEW_CHARS - 1])
        else:
            assert run.preview == "" and run.kind is CellKind.MEDIA
    assert i == len(segments)
    # maximal: two neighbouring runs differ in what they hold, or a gap lies between them
    for a, b in itertools.pairwise(shown):
        same = (a.kind, a.pinned, a.message_index, a.media_id) == (
            b.kind,
            b.pinned,
            b.message_index,
            b.media_id,
        )
        assert not same or b.pos_start != a.pos_start + a.num_positions


@settings(max_examples=250, deadline=None, database=None)
@given(scenarios())
def test_runs_tile_the_sequence_and_shifts_are_placed_where_they_began(
    scenario: tuple[Ledger, bool, list[Item]],
) -> None:
    ledger, mrope, items = scenario
    seq = FakeSequence(ledger.capacity, mrope=mrope)
    for item in items:
        plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
        if isinstance(plan, CannotFit):
            continue
        if not isinstance(plan, Fits) and plan.evicted:
            before = ledger.segments
            # evictions take the oldest unpinned units: what stays in front is the pinned prefix
            assert at_cell(before, plan.evicted) == ledger.num_pinned_cells
            taken = runs(plan.evicted, read)
            assert sum(r.num_cells for r in taken) == plan.num_cells_evicted
            assert sum(r.num_positions for r in taken) == plan.num_positions_evicted
            assert not any(r.pinned for r in taken)
            media = {r.media_id for r in taken if r.kind is CellKind.MEDIA}
            assert media == set(plan.media_ids_evicted)
        elif isinstance(plan, Reprefill):
            assert at_cell(ledger.segments, plan.evicted) == 0
        carry_out(ledger, seq, plan)
        decode(ledger, seq, item)
        check_runs(ledger.segments, runs(ledger.segments, read))


def test_a_reply_is_one_run_however_many_tokens_it_has() -> None:
    ledger = Ledger(64, can_shift=True, n_ctx_train=64, keep=3)
    ledger.append(Item.text([1, 2, 3], 0))
    ledger.append(Item.media("img", 8, 2, 1))
    for t in range(10):
        ledger.append(Item(1, 1, 2, (100 + t,), generated=True))
    shown = runs(ledger.segments, read)
    assert [(r.kind, r.num_cells, r.num_positions, r.pinned) for r in shown] == [
        (CellKind.TEXT, 3, 3, True),
        (CellKind.MEDIA, 8, 2, False),
        (CellKind.GENERATED, 10, 10, False),
    ]
    assert shown[2].preview.startswith("t100 t101") and shown[1].media_id == "img"
