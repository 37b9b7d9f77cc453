"""The contract of WatchSlots (every slot's KV cells as runs, and its shifts) and of session
titles, against real prep and infer servers on the tiny models."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import grpc
import pytest

from clients.client import Message, SlotwiseClient, SlotwiseError, collect
from slotwise.v1 import infer_pb2
from support.hold import PrefillHold
from support.media import image_bytes
from support.wait import PATIENCE, wait_until

TEXT, MEDIA, GENERATED = (
    infer_pb2.CELL_KIND_TEXT,
    infer_pb2.CELL_KIND_MEDIA,
    infer_pb2.CELL_KIND_GENERATED,
)


def client_of(prep_port: int, infer_port: int) -> SlotwiseClient:
    return SlotwiseClient(f"127.0.0.1:{prep_port}", f"127.0.0.1:{infer_port}")


def view_now(client: SlotwiseClient) -> infer_pb2.WatchSlotsResponse:
    (view,) = list(client.watch_slots(once=True))
    return view


def cells(runs: Any, *kinds: int) -> int:
    return sum(r.num_cells for r in runs if not kinds or r.kind in kinds)


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_a_turn_s_slot_shows_its_prompt_s_exact_cells_and_positions(
    prep_servers, infer_server, pair: str
) -> None:
    server = infer_server(pair, ctx_size=2048, parallel=2)
    with client_of(prep_servers(pair), server.port) as c:
        c.create_session("chat", title="a first chat")
        chat = [
            Message.system("You describe pictures."),
            Message.user("What is this?", image_bytes(64, 48, seed=3)),
        ]
        prepared = c.prepare(chat)
        done = collect(c.generate(prepared, session_id="chat", max_tokens=5, temperature=0))
        assert done.started is not None and done.finished is not None
        view = view_now(c)
        session = c.get_session("chat")

    assert view.num_cells_per_slot == 1024 and len(view.slots) == 2
    slot = view.slots[done.started.slot]
    assert slot.visible and slot.session_id == "chat"
    assert slot.state == infer_pb2.SLOT_STATE_IDLE
    assert slot.num_cells == session.num_cells == cells(slot.runs)
    assert slot.next_position == session.next_position
    # the prompt's runs hold exactly its cells; the image's run its cells and positions
    prompt_runs = [r for r in slot.runs if r.kind != GENERATED]
    assert cells(prompt_runs) == done.started.num_prompt_cells == prepared.num_cells
    (image,) = [r for r in slot.runs if r.kind == MEDIA]
    media = [ch for ch in prepared.prompt.chunks if ch.WhichOneof("kind") == "media"]
    assert image.num_cells == sum(m.media.num_cells for m in media)
    assert image.num_positions == sum(m.media.num_positions for m in media)
    assert image.media_id == media[0].media.media_id and image.message_index == 1
    if pair == "mrope":
        assert image.num_positions < image.num_cells  # M-RoPE: the difference is the point
    # runs tile the sequence: each begins where the one before ends
    for before, after in zip(slot.runs, slot.runs[1:], strict=False):
        assert after.pos_start == before.pos_start + before.num_positions
    assert slot.runs[0].message_index == 0 and "You describe" in slot.runs[0].preview
    (reply,) = [r for r in slot.runs if r.kind == GENERATED]
    assert reply.message_index == 2 and reply.num_cells == slot.num_cells - prepared.num_cells
    other = view.slots[1 - done.started.slot]
    assert other.state == infer_pb2.SLOT_STATE_FREE and other.num_cells == 0 and not other.runs
    assert session.title == "a first chat"


def test_a_shift_is_marked_where_it_happened_with_what_it_evicted(
    prep_servers, infer_server
) -> None:
    server = infer_server("mrope", ctx_size=256)
    with client_of(prep_servers("mrope"), server.port) as c:
        c.create_session("long", keep=1, policy="shift")
        shifts, evicted = [], 0
        for turn in range(12):
            parts: list[str | bytes] = ["Tell me more, please, about the quiet harbour town."]
            if turn % 3 == 0:
                parts.append(image_bytes(48, 48, seed=turn))
            prepared = c.prepare([Message.user(*parts)], first_message=0)
            done = collect(c.generate(prepared, session_id="long", max_tokens=24, temperature=0))
            shifts += done.shifts
            evicted += done.finished.usage.num_evicted_cells
            if len(shifts) >= 3:
                break
        view = view_now(c)

    (slot,) = view.slots
    assert len(shifts) >= 3 and len(slot.shifts) == min(len(shifts), 8)
    marks = list(reversed(slot.shifts))  # oldest first, as the turns reported them
    pinned = cells([r for r in slot.runs if r.pinned])
    assert [m.id for m in marks] == sorted(m.id for m in marks)
    assert sum(m.shift.num_cells_evicted for m in marks) == evicted
    for mark, reported in zip(marks, shifts, strict=True):
        assert mark.shift.num_cells_evicted == reported.num_cells_evicted
        assert mark.shift.num_cells_used_after == reported.num_cells_used_after
        assert cells(mark.evicted) == mark.shift.num_cells_evicted
        assert sum(r.num_positions for r in mark.evicted) == mark.shift.num_positions_evicted
        # the pinned first message (keep=1 rounds up to it) stayed in front of every eviction
        assert mark.at_cell == pinned > 0 and not any(r.pinned for r in mark.evicted)
        assert set(mark.shift.media_ids_evicted) == {r.media_id for r in mark.evicted if r.media_id}
    assert slot.runs[0].pinned and cells(slot.runs) == slot.num_cells


def test_a_view_mid_prefill_shows_the_cells_decoded_so_far(prep_servers, infer_server) -> None:
    server = infer_server("rope", ctx_size=4096, batch_size=16, ubatch_size=16)
    engine = server.engine
    with client_of(prep_servers("rope"), server.port) as c:
        prepared = c.prepare("The quick brown fox jumps over the lazy dog. " * 20)
        views: list[infer_pb2.WatchSlotsResponse] = []
        with PrefillHold(engine.runtime, at=2) as hold:
            events = c.generate(prepared, max_tokens=2)
            first = threading.Thread(target=lambda: next(events), daemon=True)
            first.start()
            assert hold.held.wait(PATIENCE)
            watcher = threading.Thread(target=lambda: views.append(view_now(c)), daemon=True)
            watcher.start()
            wait_until(lambda: engine._calls, what="the view asked for between two steps")
        watcher.join(PATIENCE)
        first.join(PATIENCE)
        events.close()
    (slot,) = views[0].slots
    assert slot.state == infer_pb2.SLOT_STATE_PREFILLING
    assert slot.num_cells == 2 * 16 < prepared.num_cells  # the two batches decoded, no more
    assert cells(slot.runs, TEXT) == 32 and slot.session_id == ""


def test_watching_sends_a_view_when_something_changed_and_ends_on_drain(
    prep_servers, loop_thread, tiny
) -> None:
    from infer_service.__main__ import start
    from infer_service.runner.runtime import RuntimeConfig

    pair = tiny["rope"]
    server = loop_thread.run(start(RuntimeConfig(pair.model, pair.mmproj, ctx_size=512, threads=1)))
    views: list[infer_pb2.WatchSlotsResponse] = []
    ended: list[BaseException] = []
    with client_of(prep_servers("rope"), server.port) as c:

        def watch() -> None:
            try:
                for v in c.watch_slots(min_interval_ms=1):  # (raised to the minimum, 50 ms)
                    views.append(v)
            except SlotwiseError as e:
                ended.append(e)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        wait_until(lambda: views, what="the first view")
        assert views[0].slots[0].state == infer_pb2.SLOT_STATE_FREE
        done = collect(c.generate(c.prepare("Once upon a time"), max_tokens=3))
        # (a view taken mid-generation may arrive after the stream's end: wait for the idle one)
        wait_until(
            lambda: views[-1].slots[0].state == infer_pb2.SLOT_STATE_IDLE,
            what="a view of the slot idle again",
        )
        assert views[-1].slots[0].num_cells > 0
        assert cells(views[-1].slots[0].runs, TEXT) == done.started.num_prompt_cells
        # never the same view twice in a row: unchanged views are not sent
        assert all(a != b for a, b in itertools.pairwise(views))
        # a drain with a long grace: the watch ends at once, it does not hold the drain up
        stopping = threading.Thread(target=lambda: loop_thread.run(server.stop(PATIENCE)))
        stopping.start()
        watcher.join(PATIENCE)
        stopping.join(PATIENCE)
    assert not watcher.is_alive() and not stopping.is_alive()
    (e,) = ended
    assert e.code() == grpc.StatusCode.UNAVAILABLE and e.reason == "SHUTTING_DOWN"


def test_titles_are_kept_renamed_checked_and_saved(prep_servers, infer_server, tmp_path) -> None:
    server = infer_server("rope", ctx_size=512, sessions_dir=tmp_path)
    with client_of(prep_servers("rope"), server.port) as c:
        c.create_session("s", title="Harbour notes")
        assert c.rename_session("s", "Harbour notes, day 2").title == "Harbour notes, day 2"
        assert c.restore_session("s").title == "Harbour notes, day 2"  # read back from its file
        assert [s.title for s in c.list_sessions()] == ["Harbour notes, day 2"]
        for bad in ("line\nbreak", "x" * 201):
            with pytest.raises(SlotwiseError) as err:
                c.rename_session("s", bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "title" in err.value.field_violations
        with pytest.raises(SlotwiseError) as err:
            c.create_session("t", title="\x00")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(SlotwiseError) as err:
            c.rename_session("nobody", "x")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_watches_are_bounded_per_tenant(prep_servers, infer_server) -> None:
    from infer_service.api.servicer import MAX_WATCHES_PER_TENANT

    server = infer_server("rope", ctx_size=256)
    with client_of(prep_servers("rope"), server.port) as c:
        open_ = [c.watch_slots() for _ in range(MAX_WATCHES_PER_TENANT)]
        for w in open_:
            next(w)  # each is under way
        with pytest.raises(SlotwiseError) as err:
            next(c.watch_slots())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.reason == "TOO_MANY_WATCHES" and err.value.retry_delay
        open_.pop().close()  # one ends: another may begin
        wait_until(lambda: _watch_once(c), what="a watch taken again")
        for w in open_:
            w.close()


def _watch_once(c: SlotwiseClient) -> bool:
    try:
        view_now(c)
    except SlotwiseError:
        return False
    return True


def test_a_look_that_fails_ends_the_watch_as_internal(prep_servers, infer_server) -> None:
    server = infer_server("rope", ctx_size=256)

    def broken() -> None:
        raise RuntimeError("a bug in the look")

    server.engine.slot_pictures = broken
    with client_of(prep_servers("rope"), server.port) as c:
        with pytest.raises(SlotwiseError) as err:
            view_now(c)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "a bug" in err.value.message
        del server.engine.slot_pictures  # the engine serves on
        assert len(view_now(c).slots) == 1
