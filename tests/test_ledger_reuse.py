"""The ledger's reuse methods: common_prefix, truncate, reconfigure, to_json/load_json and
generated_tail, by hand-worked cases and by properties over random prompts.

The properties use their own definition of a media group (a run of consecutive items sharing a
group id) and of an "atom" (one text token or one media chunk), written independently of the
ledger's helpers, so the two are checked against each other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.kv.ledger import (
    CannotFit,
    EvictionUnit,
    Fits,
    Gap,
    Item,
    Ledger,
    Policy,
    Segment,
    Shift,
    common_atoms,
)

# -- builders ----------------------------------------------------------------------------------


def make_ledger(capacity: int = 4096, **kwargs: object) -> Ledger:
    options: dict[str, object] = {"can_shift": True, "n_ctx_train": 1 << 20}
    options.update(kwargs)
    return Ledger(capacity, **options)  # type: ignore[arg-type]


def text(ids: Sequence[int], message_index: int = 0, *, group: int | None = None) -> Item:
    return Item.text(ids, message_index, group=group)


def media(
    name: str, cells: int = 6, positions: int = 2, message_index: int = 0, *, group: int
) -> Item:
    return Item.media(name, cells, positions, message_index, group=group)


def wrapped(name: str, group: int, message_index: int = 0) -> list[Item]:
    """Qwen-style: <|vision_start|> image <|vision_end|>, one media group."""
    return [
        text([900], message_index, group=group),
        media(name, message_index=message_index, group=group),
        text([901], message_index, group=group),
    ]


def filled(items: Sequence[Item], capacity: int = 4096, **kwargs: object) -> Ledger:
    ledger = make_ledger(capacity, **kwargs)
    for item in items:
        ledger.append(item)
    return ledger


def generated(ids: Sequence[int], message_index: int) -> list[Item]:
    """Tokens as the engine appends them: one item each, flagged generated."""
    return [Item(1, 1, message_index, token_ids=(t,), generated=True) for t in ids]


# -- an independent model of atoms and media groups ---------------------------------------------


def atoms(seq: Sequence[Item] | Sequence[Segment]) -> list[object]:
    """One entry per text token (its id) or media chunk ("media", its id)."""
    out: list[object] = []
    for x in seq:
        if x.media_id is not None:
            out.append(("media", x.media_id))
        else:
            out.extend(x.token_ids)
    return out


def runs(seq: Sequence[Item] | Sequence[Segment]) -> list[int | None]:
    """Per atom: the media-group run it belongs to (None: plain text)."""
    out: list[int | None] = []
    run, prev = 0, None
    for x in seq:
        if x.group is not None and x.group != prev:
            run += 1
        prev = x.group
        n = 1 if x.media_id is not None else len(x.token_ids)
        out.extend([run if x.group is not None else None] * n)
    return out


def closed_at(seq: Sequence[Item] | Sequence[Segment], k: int) -> bool:
    """A cut before atom k splits no media group."""
    r = runs(seq)
    if k <= 0 or k >= len(r):
        return True
    return r[k - 1] is None or r[k - 1] != r[k]


def kept_part(ledger: Ledger, start: int, si: int, so: int) -> list[Segment]:
    """The held segments common_prefix says are kept, from ``start`` on (a cut one included)."""
    segs = list(ledger.segments[start:si])
    if so:
        seg = ledger.segments[si]
        segs.append(Segment(text(seg.token_ids[:so], seg.message_index), seg.pos_start, False))
    return segs


def expected_cells(ledger: Ledger) -> list[int]:
    """The position of every KV cell, as llama.cpp would hold them (M-RoPE media at its start)."""
    cells: list[int] = []
    for s in ledger.segments:
        cells += [s.pos_start] * s.num_cells if s.is_media else range(s.pos_start, s.pos_end)
    return sorted(cells)


# -- hand-worked cases -------------------------------------------------------------------------


def test_identical_prompt_reuses_all_but_the_last_token() -> None:
    items = [text([1, 2, 3], 0), *wrapped("img", 1, 1), text([4, 5, 6], 1), text([7, 8], 2)]
    ledger = filled([*items, *generated([40, 41], 2)])
    si, so, rest = ledger.common_prefix(items)
    assert (si, so) == (5, 1)
    assert rest == [text([8], 2)]
    assert (
        sum(s.num_cells for s in kept_part(ledger, 0, si, so))
        == sum(i.num_cells for i in items) - 1
    )


def test_a_prompt_ending_in_a_media_group_reuses_only_what_precedes_the_group() -> None:
    items = [text([1, 2, 3], 0), *wrapped("img", 1, 0)]
    ledger = filled(items)
    si, so, rest = ledger.common_prefix(items)
    assert (si, so) == (1, 0)  # <|vision_end|> must be decoded again, so its whole group is
    assert rest == items[1:]


def test_a_different_image_stops_reuse_before_its_group() -> None:
    held = [text([1, 2], 0), *wrapped("img-a", 1, 0), text([3, 4], 0)]
    wanted = [text([1, 2], 0), *wrapped("img-b", 1, 0), text([3, 4], 0)]
    si, so, rest = filled(held).common_prefix(wanted)
    assert (si, so) == (1, 0)
    assert rest == wanted[1:]


def test_text_is_cut_inside_a_chunk_and_the_rest_starts_mid_chunk() -> None:
    ledger = filled([text([1, 2, 3, 4, 5], 0)])
    si, so, rest = ledger.common_prefix([text([1, 2, 3, 9, 9], 0)])
    assert (si, so) == (0, 3)
    assert rest == [text([9, 9], 0)]
    assert ledger.truncate(si, so) == 3
    assert atoms(ledger.segments) == [1, 2, 3]


def test_nothing_shared_reuses_nothing() -> None:
    items = [text([7, 8], 0)]
    assert filled([text([1, 2], 0)]).common_prefix(items) == (0, 0, items)
    assert make_ledger().common_prefix(items) == (0, 0, items)


def test_a_sliced_image_is_reused_whole_or_not_at_all() -> None:
    """MiniCPM-style: media, separator text, media, all one group."""
    group = [
        media("a:0", group=1),
        text([500], group=1),
        media("a:1", group=1),
    ]
    held = [text([1], 0), *group, text([2, 3], 0)]
    other = [text([1], 0), group[0], group[1], media("b:1", group=1), text([2, 3], 0)]
    si, so, rest = filled(held).common_prefix(other)
    assert (si, so) == (1, 0)
    assert rest == other[1:]


def test_session_start_compares_only_after_the_generated_tail() -> None:
    """The engine passes start = generated_tail(): what precedes it stays whatever comes."""
    prompt = [text([1, 2, 3], 0), text([4, 5], 1)]
    ledger = filled([*prompt, *generated([60, 61, 62], 1)])
    start = ledger.generated_tail()
    assert start == 2
    turn = [text([60, 61, 62, 63, 64], 1), text([7, 8], 2)]  # the reply as rendered, then more
    si, so, rest = ledger.common_prefix(turn, start)
    assert (si, so) == (5, 0)
    assert rest == [text([63, 64], 1), text([7, 8], 2)]
    # a turn that does not repeat the reply drops it
    si, so, rest = ledger.common_prefix([text([9], 2)], start)
    assert (si, so, rest) == (2, 0, [text([9], 2)])
    assert ledger.truncate(si, so) == 5
    assert ledger.generated_tail() == 2  # the prompt is not generated
    assert not any(s.item.generated for s in ledger.segments)


def test_generated_tail() -> None:
    assert make_ledger().generated_tail() == 0
    assert filled([text([1, 2], 0)]).generated_tail() == 1
    assert filled(generated([1, 2], 0)).generated_tail() == 0
    mixed = [*generated([1], 0), text([2], 1), *generated([3, 4], 1)]
    assert filled(mixed).generated_tail() == 2


def test_truncate_refuses_to_cut_inside_media_groups_and_past_a_segment() -> None:
    ledger = filled([text([1, 2, 3], 0), *wrapped("img", 1)])
    with pytest.raises(ValueError):
        ledger.truncate(1, 1)  # inside <|vision_start|> (grouped text)
    with pytest.raises(ValueError):
        ledger.truncate(0, 3)  # the whole segment: say (1, 0)
    assert ledger.num_cells == 3 + 1 + 6 + 1  # nothing changed
    assert ledger.truncate(1) == 3
    assert ledger.num_cells == 3


def test_truncate_returns_the_seq_rm_position_after_a_gap() -> None:
    ledger = make_ledger(18, policy=Policy.GAP, can_shift=False)
    for ids in ([1] * 8, [2] * 8, [3] * 4, [4] * 5):
        plan = ledger.ensure(len(ids))
        if isinstance(plan, Gap):
            ledger.apply(plan)
        ledger.append(text(ids))
    assert ledger.segments[0].pos_start > 0  # the oldest were evicted: positions have a gap
    before = expected_cells(ledger)
    cut = ledger.truncate(len(ledger.segments) - 1, 2)
    assert cut == ledger.next_pos
    assert expected_cells(ledger) == [p for p in before if p < cut]


def test_reconfigure_recomputes_pins_from_the_new_keep() -> None:
    items = [text([1, 2], 0), *wrapped("img", 1, 0), text([3, 4, 5], 1)]
    ledger = filled(items)
    assert ledger.num_pinned_cells == 0
    ledger.reconfigure(policy=Policy.STOP, keep=3, discard_fraction=0.25, unit=EvictionUnit.MESSAGE)
    # keep 3 reaches into the group: the whole group is pinned (1 + 6 + 1 cells after 2)
    assert [s.pinned for s in ledger.segments] == [True, True, True, True, False]
    assert ledger.num_pinned_cells == 10
    assert (ledger.policy, ledger.keep, ledger.discard_fraction, ledger.unit) == (
        Policy.STOP, 3, 0.25, EvictionUnit.MESSAGE,
    )  # fmt: skip
    ledger.reconfigure(policy=Policy.AUTO, keep=0, discard_fraction=0.5, unit=EvictionUnit.TOKEN)
    assert ledger.num_pinned_cells == 0
    assert [s.item for s in ledger.segments] == items


def test_pins_do_not_spread_to_a_later_run_of_the_same_group_id() -> None:
    """Each prompt numbers its media groups from 1: once the text between two images is
    evicted, a turn's image (group 1) sits right after a pinned image of group 1. Neither the
    next request's reconfigure nor a save/load may pin it: pins would grow turn after turn."""
    ledger = make_ledger(22, keep=3, discard_fraction=0.0)
    for item in [
        text([1, 2], 0),
        *wrapped("img-1", 1, 0),
        text([5] * 4, 0),
        *wrapped("img-2", 1, 1),
    ]:
        ledger.append(item)
    assert ledger.num_pinned_cells == 2 + 8
    plan = ledger.ensure(4)
    assert isinstance(plan, Shift) and plan.num_cells_evicted == 4  # only the text between
    ledger.apply(plan)
    assert [s.pinned for s in ledger.segments] == [True] * 4 + [False] * 3
    ledger.reconfigure(policy=Policy.AUTO, keep=3, discard_fraction=0.0, unit=EvictionUnit.TOKEN)
    assert ledger.num_pinned_cells == 10
    copy = make_ledger(22, keep=3)
    copy.load_json(json.loads(json.dumps(ledger.to_json())))
    assert copy.segments == ledger.segments
    assert copy.num_pinned_cells == 10
    # data saved without pins: recomputed from keep
    legacy = [{k: v for k, v in d.items() if k != "pinned"} for d in ledger.to_json()]
    copy.load_json(legacy)
    assert [s.item for s in copy.segments] == [s.item for s in ledger.segments]
    assert copy.num_pinned_cells >= 10


def test_json_round_trip_keeps_positions_flags_and_media() -> None:
    ledger = make_ledger(40, policy=Policy.GAP, can_shift=False, keep=2)
    items = [text([1, 2], 0), *wrapped("img", 1, 1), text([3] * 12, 1), *generated([7, 8], 1)]
    for item in items * 2:
        plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
        if isinstance(plan, Gap):
            ledger.apply(plan)
        ledger.append(item)
    data = json.loads(json.dumps(ledger.to_json()))
    copy = make_ledger(40, policy=Policy.GAP, can_shift=False, keep=2)
    copy.load_json(data)
    assert copy.segments == ledger.segments
    assert (copy.num_cells, copy.next_pos, copy.num_pinned_cells) == (
        ledger.num_cells, ledger.next_pos, ledger.num_pinned_cells,
    )  # fmt: skip
    assert copy.generated_tail() == ledger.generated_tail() < len(ledger.segments)


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: d[1].update(pos=0), ValueError),  # overlaps the first segment
        (lambda d: d[0].pop("cells"), KeyError),
        (lambda d: d[0].update(cells=5), ValueError),  # text cells != len(tokens)
        (lambda d: d[0].update(tokens=None), TypeError),
        (lambda d: d[1].update(pinned=True), ValueError),  # pins must be a prefix
        (lambda d: d[0].update(pinned="yes"), ValueError),
        (lambda d: d.append({**d[-1], "pos": 99, "cells": 50, "tokens": [1] * 50}), ValueError),
    ],
)
def test_load_json_rejects_malformed_data_and_keeps_what_it_held(mutate, error) -> None:
    held = [text([5, 6], 0), *wrapped("img", 1, 0)]
    source = filled([text([1, 2, 3], 0), text([4], 1)], capacity=30)
    data = json.loads(json.dumps(source.to_json()))
    mutate(data)
    target = filled(held, capacity=30)
    with pytest.raises(error):
        target.load_json(data)
    assert [s.item for s in target.segments] == held
    assert target.num_cells == 2 + 8


def test_reconfigure_and_load_json_are_linear() -> None:
    """Sessions hold one segment per generated token: thousands of them. Ten times the
    segments cost about ten times the time (a quadratic pass would cost a hundred): a ratio in
    one run, the best of three, so the machine's speed and load cancel out."""
    import time

    def seconds(n: int) -> float:
        ledger = filled(generated(range(n), 0), capacity=n)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            ledger.reconfigure(
                policy=Policy.AUTO, keep=10, discard_fraction=0.5, unit=EvictionUnit.TOKEN
            )
            copy = make_ledger(n, keep=10)
            copy.load_json(ledger.to_json())
            best = min(best, time.perf_counter() - t0)
        assert copy.num_cells == n and copy.num_pinned_cells == 10
        return best

    small, large = seconds(2000), seconds(20000)
    assert large / small < 40, f"{large / small:.0f}x the time for 10x the segments"


# -- properties over random prompts --------------------------------------------------------------

# a media id fixes its counts (it hashes the pixels the counts come from)
MEDIA = {"m1": (4, 2), "m2": (6, 1), "m3": (1, 1)}


def media_item(name: str, message_index: int, group: int) -> Item:
    cells, positions = MEDIA[name.partition(":")[0]]
    return Item.media(name, cells, positions, message_index, group=group)


@st.composite
def blocks(draw: st.DrawFn, first_group: int, message_index: int) -> list[list[Item]]:
    """Consecutive blocks of a prompt: plain text, or one media group in one of three shapes."""
    out: list[list[Item]] = []
    group = first_group
    for _ in range(draw(st.integers(1, 6))):
        message_index += draw(st.integers(0, 1))
        kind = draw(st.sampled_from(["text", "text", "bare", "wrapped", "sliced"]))
        if kind == "text":
            ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
            out.append([text(ids, message_index)])
            continue
        name = draw(st.sampled_from(sorted(MEDIA)))
        m = media_item(name, message_index, group)
        if kind == "bare":
            out.append([m])
        elif kind == "wrapped":
            out.append(
                [
                    text([900], message_index, group=group),
                    m,
                    text([901], message_index, group=group),
                ]
            )
        else:  # two slices of one image with a separator
            out.append(
                [
                    media_item(f"{name}:0", message_index, group),
                    text([500], message_index, group=group),
                    media_item(f"{name}:1", message_index, group),
                ]
            )
        group += 1
    return out


@st.composite
def reuse_cases(draw: st.DrawFn) -> tuple[list[Item], int, list[Item]]:
    """(what the ledger holds, start, items of the next request), often sharing a prefix."""
    held_blocks = draw(blocks(1, 0))
    held = [i for b in held_blocks for i in b]
    num_groups = sum(1 for i in held if i.is_media)  # an upper bound on the ids used
    if draw(st.booleans()):
        held += generated(draw(st.lists(st.integers(0, 3), max_size=4)), held[-1].message_index)
    start = draw(st.integers(0, len(held)))
    shared: list[Item] = []
    if draw(st.integers(0, 3)):  # mostly: the request repeats some of what is held
        n = draw(st.integers(0, len(held) - start))
        shared = [replace_generated(i) for i in held[start : start + n]]
        if shared and not shared[-1].is_media and shared[-1].group is None and draw(st.booleans()):
            last = shared[-1]
            cut = draw(st.integers(1, last.num_cells))
            shared[-1] = text(last.token_ids[:cut], last.message_index)
    tail_from = shared[-1].message_index if shared else 0
    tail = [i for b in draw(blocks(num_groups + 10, tail_from)) for i in b]
    wanted = shared + (tail if draw(st.integers(0, 4)) else [])
    if not wanted:
        wanted = tail
    return held, start, wanted


def replace_generated(item: Item) -> Item:
    """A request sends generated tokens back as prompt text."""
    if item.generated:
        return text(item.token_ids, item.message_index)
    return item


@settings(max_examples=400, deadline=None, database=None)
@given(reuse_cases())
def test_common_prefix_properties(case: tuple[list[Item], int, list[Item]]) -> None:
    held, start, wanted = case
    ledger = filled(held)
    si, so, rest = ledger.common_prefix(wanted, start)

    # the answer is well formed: a cut inside a segment is inside plain text only
    assert start <= si <= len(ledger.segments)
    if so:
        seg = ledger.segments[si]
        assert not seg.is_media and seg.group is None and 0 < so < seg.num_cells
    # what is kept equals the head of the items, and the rest is exactly their tail
    kept = kept_part(ledger, start, si, so)
    m = len(atoms(kept))
    assert atoms(kept) == atoms(wanted)[:m]
    assert atoms(rest) == atoms(wanted)[m:]
    j = len(wanted) - len(rest)  # rest is the items from j on, the first maybe cut
    assert rest[1:] == wanted[j + 1 :]
    first = wanted[j]
    assert rest[0] == first or (
        first.group is None
        and not first.is_media
        and rest[0] == text(first.token_ids[-rest[0].num_cells :], first.message_index)
    )
    # at least one token (or chunk) is left to decode: the next logits come from it
    assert rest and len(atoms(rest)) >= 1
    # no media group is split, on either side
    assert closed_at(wanted, m)
    assert closed_at(ledger.segments[start:], m)
    # and it is the longest such prefix
    held_atoms, wanted_atoms = atoms(ledger.segments[start:]), atoms(wanted)
    n = 0
    while n < min(len(held_atoms), len(wanted_atoms)) and held_atoms[n] == wanted_atoms[n]:
        n += 1
    best = max(
        k
        for k in range(0, min(n, len(wanted_atoms) - 1) + 1)
        if closed_at(wanted, k) and closed_at(ledger.segments[start:], k)
    )
    assert m == best


@settings(max_examples=300, deadline=None, database=None)
@given(reuse_cases())
def test_truncate_then_append_holds_exactly_the_new_prompt(
    case: tuple[list[Item], int, list[Item]],
) -> None:
    held, start, wanted = case
    ledger = filled(held)
    before = expected_cells(ledger)
    head = list(ledger.segments[:start])
    si, so, rest = ledger.common_prefix(wanted, start)
    cut = ledger.truncate(si, so)
    # seq_rm(cut, -1) removes exactly the cells the ledger dropped
    assert cut == ledger.next_pos
    assert expected_cells(ledger) == [p for p in before if p < cut]
    assert list(ledger.segments[:start]) == head
    for item in rest:
        ledger.append(item)
    assert atoms(ledger.segments[start:]) == atoms(wanted)
    assert runs(ledger.segments[start:]) == runs(wanted)
    assert ledger.num_cells == sum(s.num_cells for s in head) + sum(i.num_cells for i in wanted)
    for a, b in zip(ledger.segments, ledger.segments[1:], strict=False):
        assert b.pos_start == a.pos_end  # contiguous: nothing evicted here
    # the next request with the same items decodes only the last token or group again
    *_, rest2 = ledger.common_prefix(wanted, start)
    assert atoms(rest2) == atoms(wanted)[len(atoms(wanted)) - len(atoms(rest2)) :]
    assert len(atoms(rest2)) >= 1


@st.composite
def prompts(draw: st.DrawFn) -> list[Item]:
    items = [i for b in draw(blocks(1, 0)) for i in b]
    return items + generated(draw(st.lists(st.integers(0, 3), max_size=3)), items[-1].message_index)


@settings(max_examples=200, deadline=None, database=None)
@given(prompts(), st.integers(0, 40), st.integers(0, 40))
def test_reconfigure_pins_like_a_fresh_ledger(items: list[Item], keep0: int, keep: int) -> None:
    ledger = filled(items, keep=keep0)
    ledger.reconfigure(
        policy=Policy.GAP, keep=keep, discard_fraction=0.3, unit=EvictionUnit.MESSAGE
    )
    fresh = filled(
        items, keep=keep, policy=Policy.GAP, discard_fraction=0.3, unit=EvictionUnit.MESSAGE
    )
    assert ledger.segments == fresh.segments
    assert ledger.num_pinned_cells == fresh.num_pinned_cells
    pins = [s.pinned for s in ledger.segments]
    assert pins == sorted(pins, reverse=True)  # a prefix
    assert ledger.num_pinned_cells >= min(keep, ledger.num_cells)


@settings(max_examples=200, deadline=None, database=None)
@given(prompts(), st.integers(0, 20), st.integers(1, 60), st.booleans())
def test_json_round_trip_preserves_segments(
    items: list[Item], keep: int, capacity_extra: int, mrope: bool
) -> None:
    """Through real JSON, after evictions (GAP: positions keep their gaps)."""
    capacity = max(i.num_cells for i in items) + capacity_extra
    options = {
        "keep": keep,
        "policy": Policy.GAP if mrope else Policy.SHIFT,
        "can_shift": not mrope,
    }
    ledger = make_ledger(capacity, **options)
    for item in items + items:
        plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
        if isinstance(plan, CannotFit):
            continue
        assert isinstance(plan, Fits | Gap | Shift)
        ledger.apply(plan)
        ledger.append(item)
    copy = make_ledger(capacity, **options)
    copy.load_json(json.loads(json.dumps(ledger.to_json())))
    assert copy.segments == ledger.segments
    assert (copy.num_cells, copy.next_pos, copy.num_pinned_cells) == (
        ledger.num_cells, ledger.next_pos, ledger.num_pinned_cells,
    )  # fmt: skip
    assert copy.generated_tail() == ledger.generated_tail()
    assert expected_cells(copy) == expected_cells(ledger)


# -- continuation: a resent conversation after evictions --------------------------------------


def decode_all(ledger: Ledger, items: Sequence[Item]) -> None:
    """Append items as the engine does: a plan before each (evictions remembered)."""
    for item in items:
        plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
        assert not isinstance(plan, CannotFit)
        ledger.apply(plan)
        if not isinstance(plan, Fits) and hasattr(plan, "kept"):
            for kept in plan.kept:  # a re-prefill decodes the kept items again
                ledger.append(kept)
        ledger.append(item)


conversation_turns = st.lists(
    st.tuples(
        st.lists(st.integers(1, 50), min_size=1, max_size=30),  # a user message
        st.booleans(),  # with an image
        st.lists(st.integers(51, 99), min_size=1, max_size=25),  # the reply
    ),
    min_size=2,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(
    turns=conversation_turns,
    policy=st.sampled_from([Policy.SHIFT, Policy.GAP, Policy.REPREFILL]),
    keep=st.integers(0, 12),
    unit=st.sampled_from(list(EvictionUnit)),
    new=st.lists(st.integers(1, 50), min_size=1, max_size=10),
)
def test_a_resent_conversation_continues_what_the_sequence_holds(
    turns: list[tuple[list[int], bool, list[int]]],
    policy: Policy,
    keep: int,
    unit: EvictionUnit,
    new: list[int],
) -> None:
    ledger = make_ledger(64, policy=policy, keep=keep, unit=unit)
    history: list[Item] = [text([1, 2, 3], 0)]  # a system prompt
    decode_all(ledger, history)
    for k, (user, with_image, reply) in enumerate(turns, start=1):
        prompt = [text(user, 2 * k - 1)]
        if with_image:
            prompt += wrapped(f"img{k}", group=k, message_index=2 * k - 1)
        prompt += [text([7], 2 * k - 1)]
        decode_all(ledger, prompt)
        decode_all(ledger, generated(reply, 2 * k))
        history += [*prompt, *generated(reply, 2 * k)]
    request = [*history, text(new, 2 * len(turns) + 1)]
    found = ledger.continuation(request)
    if not ledger.segments or ledger._evicted == []:  # nothing evicted: the exact rule applies
        assert found is None
        return
    assert found is not None
    si, so, rest = found
    assert (si, so) == (len(ledger.segments), 0)  # all it holds is reused
    assert atoms(rest) == atoms([text(new, 0)])  # only the new message is left to decode

    # an edited earlier message is not a continuation
    edited = [text([49, *list(history[0].token_ids[1:])], 0), *request[1:]]
    assert ledger.continuation(edited) is None


def test_a_continuation_may_cut_into_the_generated_reply() -> None:
    """The template renders the reply's end differently from what the model sampled."""
    ledger = make_ledger(16, policy=Policy.GAP)
    decode_all(ledger, [text(list(range(1, 13)), 0)])
    decode_all(ledger, generated([60, 61, 62, 63, 64, 65], 1))  # evicts the oldest tokens
    assert ledger._evicted
    request = [text(list(range(1, 13)), 0), text([60, 61, 62, 99], 1), text([5, 6], 2)]
    found = ledger.continuation(request)
    assert found is not None
    si, _so, rest = found
    kept = ledger.segments[:si]
    assert [t for s in kept for t in s.token_ids][-3:] == [60, 61, 62]
    assert atoms(rest) == [99, 5, 6]
    # a request that stops matching before the reply is not one
    assert ledger.continuation([text([*list(range(1, 12)), 40], 0), text([5], 2)]) is None


def test_a_new_keep_forgets_the_evicted_history() -> None:
    """The history sits after the pinned segments; new pins move that boundary."""
    ledger = make_ledger(8, policy=Policy.GAP, discard_fraction=0.0)
    a, b, c = text([1, 2, 3], 0), text([4, 5, 6], 1), text([7, 8], 2)
    decode_all(ledger, [a, b, c, text([9], 3)])  # a is evicted
    assert ledger.continuation([a, b, c, text([9], 3), text([10], 4)]) is not None
    ledger.reconfigure(policy=Policy.GAP, keep=3, discard_fraction=0.0, unit=EvictionUnit.TOKEN)
    assert ledger.continuation([b, a, c, text([9], 3), text([10], 4)]) is None
    assert ledger.num_history_atoms == 0


def test_units_a_truncation_dropped_become_history() -> None:
    ledger = make_ledger(6, policy=Policy.GAP, keep=2)
    system, old, new = text([1, 2], 0), text([3, 4, 5, 6], 1), text([7, 8], 2)
    admission = ledger.admit([system, old, new], truncate=True)
    assert not isinstance(admission, CannotFit) and admission.dropped
    ledger.begin_history(admission.dropped)
    decode_all(ledger, admission.kept)
    found = ledger.continuation([system, old, new, text([9], 3)])
    assert found is not None and atoms(found[2]) == [9]


def test_a_take_too_large_to_fit_at_once_is_made_smaller() -> None:
    """The executor's text takes: 125 pinned cells and 100 others in 256; 179 tokens at once
    cannot fit (148 to evict, 100 evictable), fewer can, evicting what is not pinned."""
    from infer_service.runner.executor import fitting_take

    ledger = Ledger(256, can_shift=True, n_ctx_train=4096, policy=Policy.REPREFILL, keep=125)
    ledger.append(Item.text(tuple(range(125)), 0))
    ledger.append(Item.text(tuple(range(100)), 1))
    assert ledger.num_pinned_cells == 125
    assert isinstance(ledger.ensure(179), CannotFit)
    n = fitting_take(ledger, 179, None)
    assert 1 <= n <= 256 - 125 and not isinstance(ledger.ensure(n), CannotFit)
    assert fitting_take(ledger, 179, 7) == 179  # grouped text is never split
    assert fitting_take(ledger, 20, None) == 20  # what fits stays whole


def _run(draw: st.DrawFn, stream: list[object]) -> list[Item]:
    """The atoms as items, cut at random places (text runs of any length; media alone)."""
    items: list[Item] = []
    text: list[int] = []
    for atom in stream:
        if isinstance(atom, str):
            if text:
                items.append(Item.text(text, 0))
                text = []
            items.append(Item.media(atom, 4, 2, 0))
            continue
        text.append(int(atom))  # type: ignore[call-overload]
        if draw(st.integers(0, 5)) == 0:
            items.append(Item.text(text, 0))
            text = []
    if text:
        items.append(Item.text(text, 0))
    return items


@st.composite
def _two_runs(draw: st.DrawFn) -> tuple[list[Item], list[Item]]:
    atom = st.one_of(st.integers(3, 5), st.sampled_from(["img-a", "img-b"]))
    shared = draw(st.lists(atom, max_size=60))
    a = shared + draw(st.lists(atom, max_size=20))
    b = shared + draw(st.lists(atom, max_size=20))
    return _run(draw, a), _run(draw, b)


@given(_two_runs())
def test_common_atoms_is_the_atom_by_atom_prefix(runs: tuple[list[Item], list[Item]]) -> None:
    """Runs of text compared whole give what comparing atom by atom gives, however the two
    runs are cut into items."""
    a, b = runs
    x, y = atoms(a), atoms(b)
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert common_atoms(a, b) == common_atoms(b, a) == n
