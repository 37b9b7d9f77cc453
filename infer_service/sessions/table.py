"""Every session this replica knows, each in one lifecycle state (engine thread only).

A session in memory (STORED, RESIDENT, IN_TURN) carries its state itself; one known by its id
alone (RESTORING, DELETING, BROKEN) has a placeholder here. A state changes only by a move
the table allows: a wrong move is a bug, reported to the request that made it as INTERNAL,
never a half-changed table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from infer_service.events import ErrorKind, Problem, ProblemError, Reason
from infer_service.sessions.session import Lifecycle, Session, owner_of


class SessionError(ProblemError):
    """A session's own refusal: not found, busy, broken, foreign, at its quota."""

    def __init__(self, kind: ErrorKind, message: str, reason: Reason = Reason.INTERNAL):
        super().__init__(Problem(kind, message, reason))


S = Lifecycle
# state -> the states it may move to (None: the table forgets the id)
MOVES: dict[Lifecycle | None, frozenset[Lifecycle | None]] = {
    # created or read from disk; a file deleted that this replica never read
    None: frozenset({S.STORED, S.BROKEN, S.DELETING}),
    S.STORED: frozenset({S.IN_TURN, S.RESTORING, S.DELETING, None}),
    S.RESIDENT: frozenset({S.STORED, S.IN_TURN, S.RESTORING, S.DELETING, None}),
    S.IN_TURN: frozenset({S.STORED, S.RESIDENT}),  # (as it ends: in a slot or not)
    S.RESTORING: frozenset({S.STORED, S.BROKEN, None}),
    S.DELETING: frozenset({None}),
    S.BROKEN: frozenset({S.STORED, S.BROKEN, S.DELETING, None}),
}


@dataclass
class _Known:
    """A session known by its id alone."""

    state: Lifecycle  # RESTORING, DELETING or BROKEN
    error: SessionError | None = None  # BROKEN: why


class SessionTable:
    def __init__(self) -> None:
        self._entries: dict[str, Session | _Known] = {}
        self._tenants: dict[str, set[str]] = {}  # tenant -> its ids (quotas count per tenant)

    def state(self, session_id: str) -> Lifecycle | None:
        entry = self._entries.get(session_id)
        return entry.state if entry is not None else None

    def live(self, session_id: str) -> Session | None:
        """The session in memory (STORED, RESIDENT or IN_TURN), if it is."""
        entry = self._entries.get(session_id)
        return entry if isinstance(entry, Session) else None

    def sessions(self) -> Iterator[Session]:
        return (e for e in self._entries.values() if isinstance(e, Session))

    def broken(self) -> dict[str, SessionError]:
        return {
            sid: e.error
            for sid, e in self._entries.items()
            if isinstance(e, _Known) and e.error is not None
        }

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def ids(self) -> list[str]:
        return list(self._entries)

    def ids_of(self, tenant: str) -> list[str]:
        """A tenant's ids, whatever their state."""
        return list(self._tenants.get(tenant, ()))

    # -- lookups for the RPCs: each state answers with its own error ---------------------------

    def get(self, session_id: str) -> Session:
        entry = self._entries.get(session_id)
        if isinstance(entry, Session):
            return entry
        if entry is None or entry.state is S.DELETING:
            raise not_found(session_id)
        if entry.state is S.BROKEN:
            assert entry.error is not None
            raise entry.error
        raise busy(session_id, "is being restored")

    def idle(self, session_id: str) -> Session:
        """The session, between turns."""
        session = self.get(session_id)
        if session.state is S.IN_TURN:
            raise busy(session_id, "has a turn running")
        return session

    # -- moves ---------------------------------------------------------------------------------

    def add(self, session: Session) -> None:
        """A session into memory, STORED: new, read from disk, or restored."""
        self._check(session.session_id, S.STORED)
        session.state = S.STORED
        self._put(session.session_id, session)

    def move(self, session: Session, to: Lifecycle) -> None:
        """A session in memory to another state in memory."""
        if self._entries.get(session.session_id) is not session:
            raise _bug(f"session {session.session_id!r} is not the table's copy")
        self._check(session.session_id, to)
        session.state = to

    def mark(self, session_id: str, to: Lifecycle, error: SessionError | None = None) -> None:
        """An id to a state without a session in memory (RESTORING, DELETING, BROKEN)."""
        self._check(session_id, to)
        self._put(session_id, _Known(to, error))

    def drop(self, session_id: str) -> None:
        """Forget the id (whatever its state allows)."""
        if session_id in self._entries:
            self._check(session_id, None)
            del self._entries[session_id]
            tenant = owner_of(session_id)
            ids = self._tenants[tenant]
            ids.discard(session_id)
            if not ids:
                del self._tenants[tenant]

    def _put(self, session_id: str, entry: Session | _Known) -> None:
        self._entries[session_id] = entry
        self._tenants.setdefault(owner_of(session_id), set()).add(session_id)

    def _check(self, session_id: str, to: Lifecycle | None) -> None:
        now = self.state(session_id)
        if to not in MOVES[now]:
            names = (now.value if now else "unknown", to.value if to else "gone")
            raise _bug(f"session {session_id!r}: no move from {names[0]} to {names[1]}")


def not_found(session_id: str) -> SessionError:
    return SessionError(ErrorKind.NOT_FOUND, f"no session {session_id!r}", Reason.SESSION_NOT_FOUND)


def busy(session_id: str, why: str) -> SessionError:
    return SessionError(
        ErrorKind.FAILED_PRECONDITION, f"session {session_id!r} {why}", Reason.SESSION_BUSY
    )


def _bug(message: str) -> SessionError:
    return SessionError(ErrorKind.INTERNAL, f"internal error: {message}", Reason.INTERNAL)
