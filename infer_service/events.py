"""What a generation reports, as domain objects; converted to protobuf only at the edge."""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass, field

from infer_service.ledger import Policy
from slotwise.v1 import infer_pb2


class Persistence(enum.IntEnum):
    UNSPECIFIED = infer_pb2.PERSISTENCE_UNSPECIFIED
    MEMORY = infer_pb2.PERSISTENCE_MEMORY
    SAVED = infer_pb2.PERSISTENCE_SAVED
    NOT_SAVED = infer_pb2.PERSISTENCE_NOT_SAVED


class FinishReason(enum.IntEnum):
    STOP = infer_pb2.FINISH_REASON_STOP
    LENGTH = infer_pb2.FINISH_REASON_LENGTH
    CANCELLED = infer_pb2.FINISH_REASON_CANCELLED
    ERROR = infer_pb2.FINISH_REASON_ERROR
    GRAMMAR = infer_pb2.FINISH_REASON_GRAMMAR  # the constraint allows nothing next

    @property
    def completed(self) -> bool:
        """The generation ran to an end of its own (a session keeps such a turn)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR)


POLICY_TO_PB = {
    Policy.AUTO: infer_pb2.SHIFT_POLICY_AUTO,
    Policy.SHIFT: infer_pb2.SHIFT_POLICY_SHIFT,
    Policy.GAP: infer_pb2.SHIFT_POLICY_GAP,
    Policy.REPREFILL: infer_pb2.SHIFT_POLICY_REPREFILL,
    Policy.STOP: infer_pb2.SHIFT_POLICY_STOP,
}


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


class Reason(enum.Enum):
    """The google.rpc.ErrorInfo reason a client can branch on (the message is for people)."""

    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    QUEUE_FULL = "QUEUE_FULL"
    STALE_DESCRIPTOR = "STALE_DESCRIPTOR"
    SESSION_NOT_SAVED = "SESSION_NOT_SAVED"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    SESSION_EXISTS = "SESSION_EXISTS"
    SESSION_BUSY = "SESSION_BUSY"
    SESSION_UNREADABLE = "SESSION_UNREADABLE"
    SESSION_FOREIGN = "SESSION_FOREIGN"
    SESSION_STALE = "SESSION_STALE"  # another replica wrote the session since
    SESSION_MOVED_ON = "SESSION_MOVED_ON"  # it has more turns than the caller expected
    NOT_PERSISTED = "NOT_PERSISTED"
    STORAGE_FULL = "STORAGE_FULL"
    STORAGE_FAILED = "STORAGE_FAILED"
    BAD_REQUEST = "BAD_REQUEST"
    MEDIA_FAILED = "MEDIA_FAILED"
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


class ProblemError(RuntimeError):
    """An exception that carries its Problem (the engine's and the stores' refusals)."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem

    @property
    def kind(self) -> ErrorKind:
        return self.problem.kind


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

    def to_pb(self) -> infer_pb2.GenerateResponse:
        return infer_pb2.GenerateResponse(
            started=infer_pb2.Started(
                slot=self.slot,
                num_prompt_cells=self.num_prompt_cells,
                num_prompt_positions=self.num_prompt_positions,
                num_capacity_cells=self.num_capacity_cells,
                num_truncated_cells=self.num_truncated_cells,
                num_truncated_chunks=self.num_truncated_chunks,
                truncated_media_ids=self.truncated_media_ids,
                num_reused_cells=self.num_reused_cells,
            )
        )


@dataclass(frozen=True)
class PrefillProgress:
    num_cells_done: int
    num_cells_total: int

    def to_pb(self) -> infer_pb2.GenerateResponse:
        return infer_pb2.GenerateResponse(
            prefill=infer_pb2.PrefillProgress(
                num_cells_done=self.num_cells_done, num_cells_total=self.num_cells_total
            )
        )


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

    def to_pb(self) -> infer_pb2.GenerateResponse:
        return infer_pb2.GenerateResponse(
            delta=infer_pb2.TokenDelta(
                token_ids=self.token_ids,
                text=self.text,
                logprobs=[_logprobs_pb(lp) for lp in self.logprobs],
            )
        )


def _choice_pb(c: TokenChoice) -> infer_pb2.TokenLogprob:
    return infer_pb2.TokenLogprob(token_id=c.token_id, piece=c.piece, logprob=c.logprob)


def _logprobs_pb(lp: TokenLogprobs) -> infer_pb2.TokenLogprobs:
    return infer_pb2.TokenLogprobs(chosen=_choice_pb(lp.chosen), top=map(_choice_pb, lp.top))


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

    def to_pb(self) -> infer_pb2.GenerateResponse:
        return infer_pb2.GenerateResponse(
            shift=infer_pb2.ContextShift(
                policy=POLICY_TO_PB[self.policy],
                num_cells_evicted=self.num_cells_evicted,
                num_positions_evicted=self.num_positions_evicted,
                media_ids_evicted=self.media_ids_evicted,
                num_cells_used_after=self.num_cells_used_after,
                next_position_after=self.next_position_after,
            )
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

    def to_pb(self) -> infer_pb2.Usage:
        return infer_pb2.Usage(**self.__dict__)


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

    def to_pb(self) -> infer_pb2.GenerateResponse:
        return infer_pb2.GenerateResponse(
            finished=infer_pb2.Finished(
                reason=int(self.reason),
                usage=self.usage.to_pb(),
                stop_string=self.stop_string,
                error=self.error,
                persistence=int(self.persistence),
            )
        )


Event = Started | PrefillProgress | TokenDelta | ContextShift | Finished | Rejected
