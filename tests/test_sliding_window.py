"""Sliding-window models (the tiny gemma4, a 512-position window): a sequence state that
llama.cpp writes leaves out the cells the window hides, so a state that reaches past the window
is never loaded (a later cut back or shift would need those cells); the session is decoded
again. A shorter one loads as any state does."""

from __future__ import annotations

from typing import Any

import pytest

from clients.client import NO_RETRY, Message, SlotwiseClient, collect


@pytest.mark.parametrize(("words", "decoded_again"), [(40, 0), (400, 1)])
def test_a_state_past_the_window_is_decoded_again_not_loaded(
    prep_servers: Any, infer_server: Any, tmp_path: Any, words: int, decoded_again: int
) -> None:
    prep = f"127.0.0.1:{prep_servers('gemma4')}"
    first = infer_server("gemma4", ctx_size=2048, sessions_dir=tmp_path)
    sent = [Message.user(" ".join(f"w{k}" for k in range(words)))]
    with SlotwiseClient(prep, f"127.0.0.1:{first.port}", retry=NO_RETRY) as client:
        client.create_session("long")
        prepared = client.prepare(sent)
        done = collect(client.generate(prepared, session_id="long", max_tokens=8, temperature=0))
        assert done.finished.saved
        assert (prepared.num_cells > 512) == bool(decoded_again)
        client.save_session("long")  # its KV state on disk too, beside the journal
    second = infer_server("gemma4", ctx_size=2048, sessions_dir=tmp_path)  # the same layout
    with SlotwiseClient(prep, f"127.0.0.1:{second.port}", retry=NO_RETRY) as client:
        sent = [*sent, Message.assistant(done.text or "."), Message.user("And?")]
        turn = client.prepare(sent, first_message=1)
        again = collect(client.generate(turn, session_id="long", max_tokens=8, temperature=0))
        assert again.finished.error == "" and again.finished.saved
    assert second.engine.stats.num_session_reprefills == decoded_again
