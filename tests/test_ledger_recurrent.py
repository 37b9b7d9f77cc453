"""The ledger on recurrent memory (Qwen3.5, LFM2): cut back only to checkpoints, evict by
re-prefilling from the pinned prefix's, and never let the recurrent state see what the ledger
says is gone.

``FakeHybrid`` plays llama.cpp's hybrid memory for one sequence: attention cells, and a
recurrent state that is everything the sequence absorbed, in order. Like llama.cpp it refuses
to cut the state back (``seq_rm(p, -1)`` inside it fails), restores a checkpoint's state and
then drops the attention cells after it. After every step of random engine loops the state must
equal the atoms of what the ledger holds: a fresh prefill of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.kv.host_cache import reuse_of
from infer_service.kv.ledger import (
    CannotFit,
    Fits,
    Item,
    Ledger,
    Policy,
    Reprefill,
    atoms,
)


class Refused(Exception):
    """What llama.cpp answers with False."""


class FakeHybrid:
    def __init__(self) -> None:
        self.seen: tuple[object, ...] = ()  # the recurrent state: every atom absorbed
        self.cells: list[int] = []  # attention cells' positions
        self.saved: dict[bytes, tuple[object, ...]] = {}

    def decode(self, item: Item, pos: int) -> None:
        self.seen += tuple(atoms([item]))
        n = item.num_cells
        self.cells += [pos] * n if item.is_media else list(range(pos, pos + n))  # (M-RoPE: t)

    def seq_rm(self, p0: int) -> None:
        if self.cells and p0 <= max(self.cells):
            raise Refused  # (the state has seen those tokens)

    def checkpoint(self) -> bytes:
        key = f"{len(self.saved)}".encode()
        self.saved[key] = self.seen
        return key

    def restore(self, state: bytes, pos: int) -> None:
        self.seen = self.saved[state]
        self.cells = [p for p in self.cells if p < pos]

    def clear(self) -> None:
        self.seen, self.cells = (), []


def recurrent(capacity: int = 40, **kwargs: object) -> Ledger:
    options: dict[str, object] = {"can_shift": True, "n_ctx_train": 4096, "recurrent": True}
    options.update(kwargs)
    return Ledger(capacity, **options)  # type: ignore[arg-type]


def text(n: int, message: int = 0, first: int = 0) -> Item:
    return Item.text(range(first, first + n), message)


def decode(ledger: Ledger, fake: FakeHybrid, item: Item) -> None:
    """One item in, as the executor does it: the plan carried out, the decode, the append."""
    plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
    assert not isinstance(plan, CannotFit)
    if isinstance(plan, Reprefill):
        if plan.num_prefix:
            fake.restore(ledger.marks[plan.num_prefix], ledger.pos_at(plan.num_prefix))
        else:
            fake.clear()
        ledger.apply(plan)
        for kept in plan.kept[plan.num_prefix :]:
            decode(ledger, fake, kept)
    else:
        assert isinstance(plan, Fits), plan  # (no shift or gap on recurrent memory)
    fake.decode(item, ledger.next_pos)
    ledger.append(item)


def rewind(ledger: Ledger, fake: FakeHybrid, si: int, so: int) -> list[Item]:
    """The executor's cut back, on the fake (attention memory would seq_rm in place)."""
    k = ledger.cut_point(si, so)
    if k is None:
        fake.seq_rm(ledger.pos_at(si, so))  # (only the end: nothing to remove)
        ledger.truncate(si, so)
        return []
    redo = ledger.redo(k, si, so)
    if k:
        fake.restore(ledger.marks[k], ledger.pos_at(k))
    else:
        fake.clear()
    ledger.truncate(k)
    return redo


def check(ledger: Ledger, fake: FakeHybrid) -> None:
    assert fake.seen == atoms(ledger.segments)  # the state is a fresh prefill of the ledger
    assert len(fake.cells) == ledger.num_cells


# -- rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [Policy.AUTO, Policy.SHIFT, Policy.GAP, Policy.REPREFILL])
def test_every_evicting_policy_resolves_to_reprefill(policy: Policy) -> None:
    ledger = recurrent(10, policy=policy)
    ledger.append(text(10))
    assert isinstance(ledger.ensure(1), Reprefill)
    assert ledger.effective_policy() is Policy.REPREFILL


def test_stop_stays_stop() -> None:
    ledger = recurrent(10, policy=Policy.STOP)
    ledger.append(text(10))
    assert isinstance(ledger.ensure(1), CannotFit)


def test_a_reprefill_keeps_the_pinned_prefix_where_its_checkpoint_is() -> None:
    ledger, fake = recurrent(20, keep=4), FakeHybrid()
    decode(ledger, fake, text(4, 0))
    ledger.mark(fake.checkpoint())
    decode(ledger, fake, text(16, 1, first=10))
    plan = ledger.ensure(2)
    assert isinstance(plan, Reprefill) and plan.num_prefix == 1
    assert plan.kept[0] == text(4, 0) and plan.num_cells_evicted == 8
    decode(ledger, fake, text(2, 1, first=50))
    check(ledger, fake)
    assert ledger.segments[0].item == text(4, 0) and ledger.marks.keys() == {1}


def test_without_that_checkpoint_a_reprefill_starts_from_nothing() -> None:
    ledger = recurrent(20, keep=4)
    ledger.append(text(4, 0))
    ledger.append(text(16, 1, first=10))
    ledger.mark(b"after everything")
    plan = ledger.ensure(2)
    assert isinstance(plan, Reprefill) and plan.num_prefix == 0
    with pytest.raises(ValueError):
        ledger.apply(Reprefill(plan.kept, plan.evicted, num_prefix=1))


def test_cut_point_is_the_last_checkpoint_at_or_before() -> None:
    ledger = recurrent(100)
    for n in range(5):
        ledger.append(text(3, n, first=10 * n))
        if n in (1, 3):
            ledger.mark(f"{n}".encode())
    assert set(ledger.marks) == {2, 4}
    assert ledger.cut_point(5) is None  # the end: nothing to cut
    assert ledger.cut_point(4) == 4
    assert ledger.cut_point(3, 2) == 2
    assert ledger.cut_point(1) == 0
    assert ledger.redo(2, 3, 2) == [text(3, 2, first=20), text(2, 3, first=30)]
    attention = Ledger(100, can_shift=True, n_ctx_train=4096)
    attention.append(text(3))
    assert attention.cut_point(0, 1) is None  # (cut anywhere)


def test_a_checkpoint_inside_a_media_group_is_never_cut_to() -> None:
    ledger = recurrent(100)
    ledger.append(text(2))
    ledger.append(Item.text([7], 0, group=1))  # the image's opening wrapper
    ledger.mark(b"mid-group")
    ledger.append(Item.media("img", 10, 2, 0, group=1))
    ledger.append(Item.text([8], 0, group=1))
    ledger.append(text(2, first=30))
    assert ledger.cut_point(4) == 0


def test_checkpoints_after_a_cut_go_and_are_bounded() -> None:
    ledger = recurrent(100, keep=3, max_marks=3)
    for n in range(6):
        ledger.append(text(3, n, first=10 * n))
        ledger.mark(f"{n}".encode())
    assert set(ledger.marks) == {1, 5, 6}  # the pinned prefix's stays, the oldest others go
    ledger.truncate(5, 1)
    assert set(ledger.marks) == {1, 5}
    copy = ledger.clone()
    ledger.clear()
    assert not ledger.marks and set(copy.marks) == {1, 5}
    assert copy.num_mark_bytes == 2
    none = recurrent(100, max_marks=0)
    none.append(text(3))
    none.mark(b"x")
    assert not none.marks


def test_reuse_is_counted_to_the_checkpoint_only() -> None:
    ledger = recurrent(100)
    ledger.append(text(10, 0))
    ledger.mark(b"prompt end")
    for t in range(5):
        ledger.append(Item(1, 1, 1, (200 + t,), generated=True))
    ledger.mark(b"reply end")
    # a resend whose reply differs from what was generated after 2 tokens
    request = [text(10, 0), text(2, 1, first=200), text(4, 2, first=90)]
    reuse = reuse_of(ledger, request)
    assert reuse is not None and reuse.num_cells == 10 and reuse.num_segments == 1
    assert atoms(reuse.rest) == atoms(request[1:])


# -- random engine loops -------------------------------------------------------------------------

_items = st.lists(
    st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=6
)  # (cells, an image?)


@st.composite
def scripts(draw: st.DrawFn) -> tuple[Ledger, list[tuple[str, object]]]:
    ledger = recurrent(
        draw(st.integers(24, 64)),
        keep=draw(st.integers(0, 8)),
        max_marks=draw(st.integers(0, 4)),
        discard_fraction=draw(st.sampled_from([0.0, 0.5, 1.0])),
    )
    ops: list[tuple[str, object]] = []
    for _ in range(draw(st.integers(1, 12))):
        op = draw(st.sampled_from(["prompt", "mark", "resend"]))
        if op == "prompt":
            ops.append((op, draw(_items)))
        elif op == "resend":
            ops.append((op, (draw(st.floats(0, 1)), draw(_items))))
        else:
            ops.append((op, None))
    return ledger, ops


def _make(spec: Sequence[tuple[int, bool]], message: int, serial: int) -> list[Item]:
    out = []
    for k, (n, is_image) in enumerate(spec):
        if is_image:
            out.append(Item.media(f"m{serial}.{k}", n, max(1, n // 3), message))
        else:
            first = 1000 * serial + 20 * k
            out.append(Item.text(range(first, first + n), message))
    if out[-1].is_media:
        out.append(text(1, message, first=999))
    return out


@settings(max_examples=300, deadline=None, database=None)
@given(scripts())
def test_the_state_always_equals_a_fresh_prefill_of_the_ledger(
    script: tuple[Ledger, list[tuple[str, object]]],
) -> None:
    ledger, ops = script
    fake = FakeHybrid()
    for serial, (op, arg) in enumerate(ops, 1):
        if op == "mark":
            ledger.mark(fake.checkpoint())
        else:
            if op == "resend":  # the sequence so far up to a point, then something else
                share, spec = arg  # type: ignore[misc]
                held = [s.item for s in ledger.segments]
                items = [*held[: int(share * len(held))], *_make(spec, serial, serial)]
                reuse = reuse_of(ledger, items)
                assert reuse is not None
                got = rewind(ledger, fake, reuse.num_segments, reuse.num_tokens)
                assert got == []  # (reuse_of already lowered it to a checkpoint)
                assert ledger.num_cells == reuse.num_cells
                pending = reuse.rest
                check(ledger, fake)
            else:
                pending = _make(arg, serial, serial)  # type: ignore[arg-type]
            admission = ledger.admit(pending, truncate=True)
            if isinstance(admission, CannotFit):
                continue
            for item in admission.kept:
                decode(ledger, fake, item)
                check(ledger, fake)
        for k in ledger.marks:  # (a checkpoint never outlives the segments it saw)
            assert fake.saved[ledger.marks[k]] == atoms(ledger.segments[:k])


def test_a_sequence_out_of_its_slot_keeps_few_checkpoints() -> None:
    ledger = recurrent(100, keep=3)
    for n in range(6):
        ledger.append(text(3, n, first=10 * n))
        ledger.mark(f"{n}".encode())
    ledger.keep_newest_marks(2)
    assert set(ledger.marks) == {1, 5, 6}
