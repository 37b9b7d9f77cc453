"""The session table: one lifecycle state per session, changed only by the moves it allows;
a wrong move is an INTERNAL error that leaves the table as it was."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.events import ErrorKind, Reason
from infer_service.kv.ledger import ContextConfig, Ledger
from infer_service.runner.runtime import SamplingConfig
from infer_service.sessions.session import Lifecycle, Session
from infer_service.sessions.table import MOVES, SessionError, SessionTable

L = Lifecycle
IN_MEMORY = (L.STORED, L.RESIDENT, L.IN_TURN)


def session(session_id: str = "s") -> Session:
    return Session(
        session_id, ContextConfig(), SamplingConfig(), Ledger(64, can_shift=True, n_ctx_train=64)
    )


def test_a_session_lives_through_its_turns() -> None:
    table, s = SessionTable(), session()
    table.add(s)
    assert table.state("s") is L.STORED and table.get("s") is s
    table.move(s, L.IN_TURN)
    with pytest.raises(SessionError) as busy:
        table.idle("s")
    assert busy.value.problem.reason is Reason.SESSION_BUSY
    table.move(s, L.RESIDENT)
    assert table.idle("s") is s
    table.move(s, L.STORED)
    table.mark("s", L.DELETING)
    with pytest.raises(SessionError) as gone:
        table.get("s")
    assert gone.value.problem.reason is Reason.SESSION_NOT_FOUND
    table.drop("s")
    assert "s" not in table and table.state("s") is None


def test_each_state_answers_with_its_own_error() -> None:
    table = SessionTable()
    broken = SessionError(ErrorKind.DATA_LOSS, "unreadable", Reason.SESSION_UNREADABLE)
    table.mark("b", L.BROKEN, broken)
    table.add(session("r"))
    table.mark("r", L.RESTORING)
    reasons = {}
    for sid in ("b", "r", "nobody"):
        with pytest.raises(SessionError) as e:
            table.get(sid)
        reasons[sid] = e.value.problem.reason
    assert reasons == {
        "b": Reason.SESSION_UNREADABLE,
        "r": Reason.SESSION_BUSY,
        "nobody": Reason.SESSION_NOT_FOUND,
    }
    assert table.broken() == {"b": broken}
    assert [s.session_id for s in table.sessions()] == []


def test_a_copy_that_is_not_the_tables_cannot_move() -> None:
    table, s = SessionTable(), session()
    table.add(s)
    with pytest.raises(SessionError) as e:
        table.move(session(), L.IN_TURN)  # an older copy, dropped since
    assert e.value.problem.kind is ErrorKind.INTERNAL
    assert s.state is L.STORED


# -- every sequence of moves ------------------------------------------------------------------

ALL: list[Lifecycle | None] = [None, *Lifecycle]


def apply(table: SessionTable, to: Lifecycle | None) -> None:
    """One move of session "s" to `to`, by the table's own operations."""
    now = table.state("s")
    if to is None:
        table.drop("s")
    elif to in IN_MEMORY and now in IN_MEMORY:
        live = table.live("s")
        assert live is not None
        table.move(live, to)
    elif to is L.STORED:
        table.add(session())
    elif to in IN_MEMORY:  # RESIDENT, IN_TURN from outside memory: never allowed directly
        table.move(session(), to)
    else:
        table.mark("s", to, SessionError(ErrorKind.DATA_LOSS, "x") if to is L.BROKEN else None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ALL), max_size=25))
def test_only_the_allowed_moves_happen(moves: list[Lifecycle | None]) -> None:
    table = SessionTable()
    for to in moves:
        before = table.state("s")
        allowed = to in MOVES[before] or (to is None and before is None)
        try:
            apply(table, to)
        except SessionError as e:
            assert not allowed, f"{before} -> {to} refused"
            assert e.problem.kind is ErrorKind.INTERNAL
            assert table.state("s") is before  # a refused move changes nothing
            continue
        assert allowed, f"{before} -> {to} happened"
        assert table.state("s") is to
        live = table.live("s")
        assert (live is not None) == (to in IN_MEMORY)
        assert live is None or live.state is to
