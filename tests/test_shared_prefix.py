"""Shared prefixes on real servers (prep and infer with --kv-unified, the tiny M-RoPE pair): a
system message with an image, pinned, is decoded once and given to the next conversation
that opens with it in another slot; never to another tenant or salt; and a prompt longer than
ctx_size / parallel fits in the pool."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from PIL import Image, ImageDraw
from test_metrics import scrape, value

from clients.client import Message, SlotwiseClient, SlotwiseError, collect
from clients.events import Delta
from slotwise.v1 import infer_pb2
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.procs import free_port
from support.wait import wait_until

SYSTEM = "You answer questions about the picture below, briefly and kindly. " * 4


def picture() -> Image.Image:
    img = Image.new("RGB", (96, 64), (30, 90, 160))
    ImageDraw.Draw(img).rectangle((10, 10, 60, 40), fill=(240, 200, 20))
    return img


@pytest.fixture
def servers(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Callable[..., Any]]:
    """start(kv_unified, parallel, ctx_size) -> (prep address, infer address, infer, its
    metrics port)."""
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    pair = tiny["mrope"]
    started: list[Any] = []

    def start(*, kv_unified: bool, parallel: int = 2, ctx_size: int = 2048, **options: Any) -> Any:
        config = RuntimeConfig(
            pair.model, pair.mmproj, ctx_size=ctx_size, parallel=parallel, threads=1,
            kv_unified=kv_unified,
        )  # fmt: skip
        prep = loop_thread.run(start_prep(pair.model, pair.mmproj, threads=1))
        metrics_port = free_port()
        infer = loop_thread.run(start_infer(config, metrics_port=metrics_port, **options))
        started.extend([infer, prep])
        return f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}", infer, metrics_port

    yield start
    for s in started:
        loop_thread.run(s.stop(0))


def client(addresses: Any) -> SlotwiseClient:
    return SlotwiseClient(addresses[0], addresses[1])


def no_end(infer: Any) -> dict[int, float]:
    """A logit_bias that bans the model's end tokens: a turn that runs to max_tokens."""
    rt = infer.engine.runtime
    return {t: -100.0 for t in range(rt.num_vocab) if rt.is_eog(t)}


def generating_beside(c: SlotwiseClient, prompt: Any, **options: Any) -> threading.Thread:
    """A long turn in a thread of its own; returns once its first token came (it holds its
    slot until the caller joins it)."""
    holding = threading.Event()

    def turn() -> None:
        for event in c.generate(prompt, **options):
            if isinstance(event, Delta):
                holding.set()

    runner = threading.Thread(target=turn)
    runner.start()
    wait_until(holding.is_set)
    return runner


def beside_and_fresh(
    c: SlotwiseClient, infer: Any, holding: Any, holding_keep: int, prompt: Any, keep: int
) -> tuple[Any, Any]:
    """`prompt` while `holding` generates in slot 0 (its pinned prefix held in the pool),
    then the same prompt under a salt of its own: decoded whole, nothing shared."""
    runner = generating_beside(
        c, holding, keep=holding_keep, max_tokens=300, logit_bias=no_end(infer)
    )
    try:
        done = collect(c.generate(prompt, keep=keep, max_tokens=8, temperature=0))
        fresh = collect(
            c.generate(prompt, keep=keep, max_tokens=8, temperature=0, cache_salt="own")
        )
    finally:
        runner.join()
    return done, fresh


def test_a_pinned_system_message_with_an_image_is_decoded_once(servers) -> None:
    addresses = servers(kv_unified=True)
    infer = addresses[2]
    with client(addresses) as c:
        first = c.prepare([Message.system(SYSTEM, picture()), Message.user("What is yellow?")])
        second = c.prepare([Message.system(SYSTEM, picture()), Message.user("And the blue?")])
        keep = first.num_cells_of(0)
        assert keep == second.num_cells_of(0) and keep > 32
        # the first conversation generates on while the second starts in the other slot; the
        # shared cells hold exactly what a fresh prefill does, so greedy tokens agree
        done, fresh = beside_and_fresh(c, infer, first, keep, second, keep)
        assert done.token_ids == fresh.token_ids and fresh.usage.num_reused_cells == 0
        assert done.started is not None and done.started.slot != 0
        # the system message and its image came from the pool: nothing of it decoded again
        assert done.started.num_reused_cells >= keep
        stats = infer.engine.stats
        assert stats.num_shared_prefixes == 1 and stats.num_shared_cells == keep
        assert stats.num_failed_decodes == 0
        # what an operator sees: the pool counts the shared prefix once, for both sequences
        info = c.server_info()
        assert info.pool is not None and info.pool.num_cells == infer.engine.runtime.num_cells
        # (the salted run's prefix is held too, apart: a salt shares with nobody else)
        assert (info.pool.num_holders, info.pool.num_shared_cells) == (2, 2 * keep)
        engine = infer.engine
        in_use = engine.call(lambda: len(engine.runtime.cells_in_use())).result(timeout=30)
        assert info.pool.num_cells_used == in_use  # read from llama.cpp's own state
        assert (info.stats.num_shared_prefixes, info.stats.num_shared_cells) == (1, keep)
        # another tenant is told the pool's size, and nothing of this one's part of it
        from infer_service.api.protobuf import server_info_pb
        from infer_service.runner.stats import TenantStats

        snap = engine.call(engine.snapshot).result(timeout=30)
        other = server_info_pb(engine.runtime, snap, TenantStats(), "someone else")
        assert other.pool.num_cells == info.pool.num_cells and other.pool.num_cells_used == 0
        assert (other.pool.num_holders, other.stats.num_shared_prefixes) == (0, 0)
        m = scrape(addresses[3])
        assert value(m, "slotwise_infer_shared_cells") == 2 * keep
        assert value(m, "slotwise_infer_pool_cells_used") == info.pool.num_cells_used
        assert value(m, "slotwise_infer_shared_prefix_requests_total") == 1


def test_the_per_slot_layout_reports_no_pool(servers) -> None:
    addresses = servers(kv_unified=False)
    with client(addresses) as c:
        assert c.server_info().pool is None
    assert not any(name.startswith("slotwise_infer_pool") for name, _ in scrape(addresses[3]))


def test_the_pool_shares_within_a_tenant_and_salt_only(servers) -> None:
    addresses = servers(kv_unified=True, parallel=3)
    infer = addresses[2]
    with client(addresses) as c:
        prompt = c.prepare([Message.system(SYSTEM), Message.user("Hello there.")])
        keep = prompt.num_cells_of(0)
        runner = generating_beside(c, prompt, keep=keep, max_tokens=300, logit_bias=no_end(infer))
        try:
            salted = collect(c.generate(prompt, keep=keep, max_tokens=2, cache_salt="other"))
            assert salted.started is not None and salted.started.num_reused_cells == 0
            assert infer.engine.stats.num_shared_prefixes == 0
            # the same tenant and salt as the first, in the third slot: shared
            same = collect(c.generate(prompt, keep=keep, max_tokens=2))
        finally:
            runner.join()
        assert same.started is not None and same.started.slot not in (0, salted.started.slot)
        assert same.started.num_reused_cells >= keep
        assert infer.engine.stats.num_shared_prefixes == 1


def test_a_prompt_longer_than_a_slots_share_fits_in_the_pool(servers) -> None:
    """ctx_size 1024 over 4 slots: 256 cells a slot without the pool; with it, the pool."""
    text = "A long document, read whole, line after line after line. " * 10
    per_slot = servers(kv_unified=False, parallel=4, ctx_size=1024)
    with client(per_slot) as c:
        prompt = c.prepare([Message.user(text)])
        assert 256 < prompt.num_cells < 1024
        with pytest.raises(SlotwiseError) as refused:
            collect(c.generate(prompt, max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    pooled = servers(kv_unified=True, parallel=4, ctx_size=1024)
    with client(pooled) as c:
        done = collect(c.generate(c.prepare([Message.user(text)]), max_tokens=2))
        assert done.finished is not None and done.finished.usage.num_prompt_cells > 256


def test_the_kv_view_shows_a_shared_prefix_once_and_to_its_tenant_only(servers) -> None:
    addresses = servers(kv_unified=True, parallel=3)
    infer = addresses[2]
    with client(addresses) as c:
        chats = [
            c.prepare([Message.system(SYSTEM, picture()), Message.user(q)])
            for q in ("What is yellow?", "And the blue?")
        ]
        keep = chats[0].num_cells_of(0)
        runner = generating_beside(
            c, chats[0], keep=keep, max_tokens=300, logit_bias=no_end(infer)
        )  # (in slot 0 while the second chat starts)
        try:
            done = collect(c.generate(chats[1], keep=keep, max_tokens=3, temperature=0))
            (view,) = list(c.watch_slots(once=True))
        finally:
            runner.join()
    assert done.started is not None
    slots = sorted({0, done.started.slot})
    assert len(slots) == 2
    (prefix,) = view.shared_prefixes
    assert prefix.num_cells == keep and sorted(prefix.slots) == slots
    assert sum(r.num_cells for r in prefix.runs) == keep
    assert any(r.kind == infer_pb2.CELL_KIND_MEDIA for r in prefix.runs)
    for s in slots:
        seen = view.slots[s]
        assert seen.shared_prefix == prefix.holder and seen.num_shared_cells == keep
        # the slot's own runs: what follows the prefix (the prefix is drawn once, above)
        assert sum(r.num_cells for r in seen.runs) == seen.num_cells - keep
        assert seen.runs[0].message_index == 1
    # another tenant is shown no prefix of this one's (nor its slots)
    from infer_service.api.protobuf import slots_pb

    pictures, shared = infer.engine.call(
        lambda: (infer.engine.slot_pictures(), infer.engine.shared_pictures())
    ).result(timeout=30)
    (whose,) = {h.tenant for h in shared}
    assert slots_pb(infer.engine.runtime, pictures, whose, shared).shared_prefixes
    others = slots_pb(infer.engine.runtime, pictures, "someone else", shared)
    assert not others.shared_prefixes and not any(v.visible for v in others.slots if v.num_cells)


def test_sessions_swapped_out_and_in_keep_the_pool_s_count_exact(servers, tmp_path) -> None:
    """Three sessions on one system message and two slots: a swap-out clears a sharing
    sequence, a swap-in loads a whole state of its own. After every turn the pool's count of
    cells in use is llama.cpp's, and the prefix is still held once."""
    addresses = servers(kv_unified=True, parallel=2, sessions_dir=tmp_path / "sessions")
    engine = addresses[2].engine

    def counts() -> tuple[int, int, int]:
        def read() -> tuple[int, int, int]:
            figures = engine.executor.pool_figures()
            return figures.num_used, len(engine.runtime.cells_in_use()), figures.num_holders

        return engine.call(read).result(timeout=30)

    with client(addresses) as c:
        chats: dict[str, list[Message]] = {}
        for turn, name in enumerate(["a", "b", "c", "a", "b", "c", "a"]):
            if name not in chats:
                c.create_session(name)
                chats[name] = [Message.system(SYSTEM, picture())]
            chat = chats[name]
            first = len(chat) - 1 if len(chat) > 1 else 0  # (from the last reply on)
            chat.append(Message.user(f"Turn {turn}, what now?"))
            keep = c.prepare(chat).num_cells_of(0)
            done = collect(
                c.generate(c.prepare(chat, first_message=first), session_id=name, keep=keep,
                           max_tokens=3, temperature=0)
            )  # fmt: skip
            chat.append(Message.assistant(done.text or "."))
            used, in_llama, holders = counts()
            assert used == in_llama and holders == 1, (turn, name)
    stats = engine.stats
    assert stats.num_session_restores >= 2  # (sessions came back from disk into a slot)
    assert stats.num_shared_prefixes >= 1 and stats.num_failed_decodes == 0


def test_a_pinned_prefix_that_opens_with_a_held_one_shares_it(servers) -> None:
    """Nested prefixes: one chat pins the system message; another pins it and a worked
    example after it. The second gets the system message's cells from the pool and decodes
    only the example (and its question): the same greedy tokens as a whole prefill."""
    addresses = servers(kv_unified=True)
    infer = addresses[2]
    with client(addresses) as c:
        plain = c.prepare([Message.system(SYSTEM, picture()), Message.user("What is yellow?")])
        example = [Message.user("What is red?"), Message.assistant("Nothing here is red.")]
        nested = c.prepare(
            [Message.system(SYSTEM, picture()), *example, Message.user("And the blue?")]
        )
        system = plain.num_cells_of(0)
        pinned = system + nested.num_cells_of(1) + nested.num_cells_of(2)
        done, fresh = beside_and_fresh(c, infer, plain, system, nested, pinned)
    assert done.started is not None and done.started.slot != 0
    assert done.started.num_reused_cells == system  # the system message: not the example
    assert done.token_ids == fresh.token_ids and fresh.usage.num_reused_cells == 0
    stats = infer.engine.stats
    assert stats.num_shared_prefixes == 1 and stats.num_shared_cells == system


def test_a_new_chat_does_not_clear_a_held_one_for_a_turn_s_header(servers) -> None:
    """With the pool every slot starts with the shared prefix: a slot that holds another chat
    of the same system message reuses only a few tokens more (the user turn's header), not
    worth that chat's cells. The new chat takes an empty slot; the first stays held."""
    addresses = servers(kv_unified=True, parallel=3)
    ban = no_end(addresses[2])
    with client(addresses) as c:
        chats = [
            c.prepare([Message.system(SYSTEM), Message.user(q)])
            for q in ("Which colour is the sky?", "Which colour is the sea?")
        ]
        keep = chats[0].num_cells_of(0)
        first, second = (
            collect(c.generate(p, keep=keep, max_tokens=4, logit_bias=ban)) for p in chats
        )
        (view,) = list(c.watch_slots(once=True))
    assert first.started is not None and second.started is not None
    assert second.started.slot != first.started.slot
    assert second.started.num_reused_cells == keep  # the pool's prefix, nothing in place
    held = view.slots[first.started.slot]
    assert held.num_cells == first.finished.usage.num_prompt_cells + 3  # (4 tokens, 3 decoded)
