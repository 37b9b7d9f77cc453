"""What a generation reports, as domain objects; converted to protobuf only at the edge
(infer_service/api/protobuf.py)."""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass, field

from infer_service.kv.ledger import CannotFit, Policy


class Persistence(enum.Enum):
    UNSPECIFIED = "unspecified"
    MEMORY = "memory"
    SAVED = "saved"
    NOT_SAVED = "not_saved"


class FinishReason(enum.IntEnum):
    # (a turn record on disk keeps the number: the contract's, which never changes)
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    ERROR = 4
    GRAMMAR = 5  # the constraint allows nothing next

    @property
    def completed(self) -> bool:
        """The generation ran to an end of its own (a session keeps such a turn)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR)


class ErrorKind(enum.Enum):
    """Why a request failed; the gRPC edge maps each to the status code of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    ABORTED = "ABORTED"
    UNIMPLEMENTED = "UNIMPLEMENTED"


class Reason(enum.Enum):
    """The google.rpc.ErrorInfo reason a client can branch on (the message is for people)."""

    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    QUEUE_FULL = "QUEUE_FULL"
    POOL_FULL = "POOL_FULL"  # the KV pool's cells are other prompts' now (kv_unified)
    STALE_DESCRIPTOR = "STALE_DESCRIPTOR"
    SESSION_NOT_SAVED = "SESSION_NOT_SAVED"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    SESSION_EXISTS = "SESSION_EXISTS"
    SESSION_BUSY = "SESSION_BUSY"
    SESSION_UNREADABLE = "SESSION_UNREADABLE"
    SESSION_FOREIGN = "SESSION_FOREIGN"
    SESSION_STALE = "SESSION_STALE"  # another replica wrote the session since
    SESSION_MOVED_ON = "SESSION_MOVED_ON"  # it has more turns than the caller expected
    SESSION_QUOTA = "SESSION_QUOTA"  # the tenant's sessions are at its quota, all in turns
    NOT_PERSISTED = "NOT_PERSISTED"
    STORAGE_FULL = "STORAGE_FULL"
    STORAGE_FAILED = "STORAGE_FAILED"
    BAD_REQUEST = "BAD_REQUEST"
    MEDIA_FAILED = "MEDIA_FAILED"
    GRAMMAR_TOO_COSTLY = "GRAMMAR_TOO_COSTLY"
    EMBEDDINGS_DISABLED = "EMBEDDINGS_DISABLED"
    TOO_MANY_WATCHES = "TOO_MANY_WATCHES"
    DECODE_FAILED = "DECODE_FAILED"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    ENGINE_DIED = "ENGINE_DIED"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class Problem:
    """What went wrong, for the edge to report: status code, ErrorInfo reason and metadata."""

    kind: ErrorKind
    message: str
    reason: Reason = Reason.INTERNAL
    metadata: tuple[tuple[str, str], ...] = ()
    retry_after: float | None = None  # seconds (google.rpc.RetryInfo)
    field: str = ""  # the request field at fault (google.rpc.BadRequest)


class CorruptSessionError(ValueError):
    """A session file that cannot be read (raised by the store, met by the runner too)."""


class ProblemError(RuntimeError):
    """An exception that carries its Problem (the engine's and the stores' refusals)."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem

    @property
    def kind(self) -> ErrorKind:
        return self.problem.kind


class QueueFullError(ProblemError):
    """The engine's wait queue is full (the request was not queued)."""


class EngineStoppedError(ProblemError):
    """The engine thread is gone (stopped, or died): nothing more will run."""


def problem(kind: ErrorKind, reason: Reason, message: str, **metadata: object) -> Problem:
    return Problem(kind, message, reason, tuple((k, str(v)) for k, v in metadata.items()))


def storage_problem(e: OSError, doing: str) -> Problem:
    """An OSError of the sessions directory: a full disk is RESOURCE_EXHAUSTED, the rest
    UNAVAILABLE (never UNKNOWN)."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    return problem(
        ErrorKind.RESOURCE_EXHAUSTED if full else ErrorKind.UNAVAILABLE,
        Reason.STORAGE_FULL if full else Reason.STORAGE_FAILED,
        f"{doing}: {e.strerror or e}",
        errno=errno.errorcode.get(e.errno or 0, str(e.errno)),
    )


def too_long(plan: CannotFit) -> Problem:
    """A prompt that can never fit: INVALID_ARGUMENT, not the transient RESOURCE_EXHAUSTED."""
    return problem(
        ErrorKind.INVALID_ARGUMENT,
        Reason.PROMPT_TOO_LONG,
        plan.message,
        cells_needed=plan.num_cells_needed,
        capacity=plan.num_capacity_cells,
        pinned_cells=plan.num_pinned_cells,
    )


def cancelled(deadline: bool, why: str) -> Problem:
    if deadline:
        return Problem(ErrorKind.DEADLINE_EXCEEDED, why, Reason.DEADLINE_EXCEEDED)
    return Problem(ErrorKind.CANCELLED, why, Reason.CANCELLED)


@dataclass(frozen=True)
class Rejected:
    """The request was refused before anything was decoded (the call ends with a status)."""

    problem: Problem

    @property
    def kind(self) -> ErrorKind:
        return self.problem.kind

    @property
    def message(self) -> str:
        return self.problem.message


@dataclass(frozen=True)
class Started:
    slot: int
    num_prompt_cells: int
    num_prompt_positions: int
    num_capacity_cells: int
    num_truncated_cells: int = 0
    num_truncated_chunks: int = 0
    truncated_media_ids: tuple[str, ...] = ()
    num_reused_cells: int = 0


@dataclass(frozen=True)
class PrefillProgress:
    num_cells_done: int
    num_cells_total: int


@dataclass(frozen=True)
class TokenChoice:
    token_id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked

    def merged(self, other: TokenDelta) -> TokenDelta:
        return TokenDelta(
            self.token_ids + other.token_ids,
            self.text + other.text,
            self.logprobs + other.logprobs,
        )


@dataclass(frozen=True)
class ContextShift:
    policy: Policy
    num_cells_evicted: int
    num_positions_evicted: int
    media_ids_evicted: tuple[str, ...]
    num_cells_used_after: int
    next_position_after: int

    def folded(self, later: ContextShift) -> ContextShift:
        """This shift and a later one as one (what a reader that fell behind is told)."""
        return ContextShift(
            policy=later.policy,
            num_cells_evicted=self.num_cells_evicted + later.num_cells_evicted,
            num_positions_evicted=self.num_positions_evicted + later.num_positions_evicted,
            media_ids_evicted=tuple(
                dict.fromkeys(self.media_ids_evicted + later.media_ids_evicted)
            ),
            num_cells_used_after=later.num_cells_used_after,
            next_position_after=later.next_position_after,
        )


@dataclass
class Usage:
    num_prompt_cells: int = 0
    num_prompt_positions: int = 0
    num_generated_tokens: int = 0
    num_shifts: int = 0
    num_evicted_cells: int = 0
    num_reused_cells: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    num_draft_tokens: int = 0  # speculative: drafted and verified
    num_accepted_tokens: int = 0  # ... of which the target sampled the same
    # the same per draft type (its name): [drafted, accepted, drafts from the tenant's
    # earlier requests (the suffix cache's)]
    drafts_by_type: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Finished:
    """The last event. With a problem (an error, or a turn that was not saved) the call then
    ends with that problem's status."""

    reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    stop_string: str = ""
    error: str = ""
    persistence: Persistence = Persistence.UNSPECIFIED
    problem: Problem | None = None


Event = Started | PrefillProgress | TokenDelta | ContextShift | Finished | Rejected
