"""What one tenant may see of another's slots, at every step of a real engine: two tenants'
sessions interleaved through REPREFILLs, image encodes, swaps and shifts, with the KV
picture taken after every step (as WatchSlots takes it, on the engine thread between steps)
and shown as each tenant would be shown it.

Before, another tenant's slot was hidden only while it held cells: between a REPREFILL and
its decode, or while a turn waited for its image, the other tenant was sent the session id
and the previews of what had been evicted.
"""

from __future__ import annotations

import threading
from typing import Any

from test_tenants import ACME, GLOBEX, tenancy  # noqa: F401 (the fixture)

from clients.client import Message, SlotwiseClient, collect
from infer_service.api.protobuf import slot_view
from infer_service.kv.view import SlotPicture, SlotState
from slotwise.v1 import infer_pb2
from support.media import image_bytes

REPREFILL, GAP = "reprefill", "gap"
NO_END = {260: -100.0, 262: -100.0}  # the tiny models' end-of-generation tokens: turns run long


def _conversation(client: SlotwiseClient, session: str, policy: str, seed: int) -> None:
    """Turns with an image each, long enough to shift a 1024-cell slot several times; each
    turn sends only what is new since the last reply (as a chat page does)."""
    client.create_session(session, policy=policy)
    chat: list[Message] = []
    for turn in range(3):
        chat.append(Message.user(f"{session} secret {turn}", image_bytes(96, 64, seed=seed + turn)))
        prepared = client.prepare(chat, first_message=max(0, len(chat) - 2))
        done = collect(
            client.generate(
                prepared, session_id=session, max_tokens=400, temperature=1.0, seed=seed,
                logit_bias=NO_END,
            )
        )  # fmt: skip
        assert done.finished is not None, session
        chat.append(Message.assistant(done.text))


def test_another_tenant_sees_a_state_only_at_every_step(tenancy) -> None:  # noqa: F811
    t = tenancy(parallel=2)
    engine = t.running.engine
    seen: list[tuple[SlotPicture, infer_pb2.SlotView]] = []
    real_execute = engine.executor.execute

    def execute(plan: Any) -> Any:  # (on the engine thread: where WatchSlots looks)
        outcome = real_execute(plan)
        for p in engine.slot_pictures():
            other = "globex" if p.tenant == "acme" else "acme"
            seen.append((p, slot_view(p, other)))
        return outcome

    engine.executor.execute = execute  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def run(key: str, sessions: list[tuple[str, str]], seed: int) -> None:
        try:
            with t.client(key) as c:
                for i, (name, policy) in enumerate(sessions):
                    _conversation(c, name, policy, seed + 10 * i)
        except BaseException as e:
            errors.append(e)

    # three sessions per tenant on two slots: they swap; REPREFILL and GAP shift them
    acme = [("acme-diary", REPREFILL), ("acme-plans", GAP), ("acme-notes", REPREFILL)]
    globex = [("globex-log", REPREFILL), ("globex-memo", GAP), ("globex-todo", GAP)]
    threads = [
        threading.Thread(target=run, args=(ACME, acme, 1)),
        threading.Thread(target=run, args=(GLOBEX, globex, 2)),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    engine.executor.execute = real_execute  # type: ignore[method-assign]
    assert not errors, errors

    owned = [(p, view) for p, view in seen if p.tenant in ("acme", "globex")]
    # the windows the leak lived in were crossed, and shifts and swaps happened
    empty_but_busy = [p for p, _ in owned if not p.num_cells and p.state != SlotState.FREE]
    assert empty_but_busy, "no step showed a busy slot without cells"
    assert any(p.shifts for p, _ in owned)
    assert engine.stats.shifts_by_policy.get("reprefill", 0) > 0
    assert engine.stats.num_session_restores + engine.stats.num_session_reprefills > 0
    for p, view in owned:
        # another tenant's slot is its number and its state, nothing else
        assert view == infer_pb2.SlotView(slot=p.slot, state=view.state), (p.tenant, view)
    text = "".join(str(view) for _, view in owned)
    for leak in ("diary", "plans", "notes", "log", "memo", "todo", "secret"):
        assert leak not in text


def test_media_caches_and_their_counts_are_a_tenant_s_own(tenancy) -> None:  # noqa: F811
    """The same image from two tenants: the second tenant's is checked and encoded again, as
    if nobody had sent it, and each tenant's counts are its own. Before, the projector's
    output and the checked image were keyed by pixels for everyone, and every tenant was
    shown every hit: B learnt whether anyone had sent that image."""
    t = tenancy()
    verified, files = t.running.verified, t.prep_running.servicer.image_cache
    picture = image_bytes(80, 56, seed=42)

    sent = iter(range(100))

    def send(c: SlotwiseClient, salt: str = "") -> None:
        # (other words before the image each time: no prefix reuse decodes it for us)
        prepared = c.prepare([Message.user(f"Question {next(sent)}: what is this?", picture)])
        done = collect(c.generate(prepared, max_tokens=2, cache_salt=salt))
        assert done.finished is not None

    with t.client(ACME) as acme, t.client(GLOBEX) as globex:
        send(acme)
        send(acme)  # the same tenant: from its cache
        mine = acme.server_info().stats
        assert mine.num_media_cache_hits == 1 and mine.num_media_cache_misses == 1
        checked, read = verified.hits, files.hits
        send(globex)
        assert verified.hits == checked  # decoded and checked again, not found
        assert files.hits == read  # prep too decodes the file again for another tenant
        theirs = globex.server_info().stats
        assert theirs.num_media_cache_hits == 0 and theirs.num_media_cache_misses == 1
        assert acme.server_info().stats.num_media_cache_hits == 1  # nothing of globex's
        send(acme, salt="narrower")  # a salt of its own is a scope of its own
        assert acme.server_info().stats.num_media_cache_misses == 2
