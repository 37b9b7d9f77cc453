"""The typed events of one generation (`Started`, `Prefill`, `Delta`, `Shift`, `Finished`),
read from Generate's responses, and `Completion`, a whole generation gathered from them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from clients.enums import FinishReason, Persistence, Policy, SpecType, from_pb
from slotwise.v1 import infer_pb2

__all__ = [
    "Completion",
    "Delta",
    "Event",
    "Finished",
    "Prefill",
    "Shift",
    "Started",
    "TokenLogprob",
    "TokenLogprobs",
    "Usage",
    "acollect",
    "collect",
    "event_from_pb",
]


@dataclass(frozen=True)
class Started:
    """Admission: what the prompt occupies, and what truncate_prompt dropped."""

    slot: int
    num_prompt_cells: int
    num_prompt_positions: int
    num_capacity_cells: int
    num_truncated_cells: int = 0
    num_truncated_chunks: int = 0
    truncated_media_ids: tuple[str, ...] = ()
    num_reused_cells: int = 0


@dataclass(frozen=True)
class Prefill:
    num_cells_done: int
    num_cells_total: int


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    piece: bytes  # the token's bytes (maybe part of a UTF-8 character)
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()  # most likely first (top_logprobs of them)


@dataclass(frozen=True)
class Delta:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # with logprobs: one per token id


@dataclass(frozen=True)
class Shift:
    """The server made room in the context (`policy` is the one actually used, never AUTO)."""

    policy: Policy
    num_cells_evicted: int
    num_positions_evicted: int
    media_ids_evicted: tuple[str, ...]
    num_cells_used_after: int
    next_position_after: int


@dataclass(frozen=True)
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
    num_accepted_tokens: int = 0  # ... of which the model sampled the same
    drafts_by_type: tuple[DraftCount, ...] = ()  # the same per draft type that drafted


@dataclass(frozen=True)
class DraftCount:
    type: SpecType | str
    num_draft_tokens: int
    num_accepted_tokens: int
    num_cache_hits: int = 0  # (suffix) drafts from the tenant's earlier requests


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    stop_string: str = ""
    error: str = ""
    persistence: Persistence = Persistence.UNSPECIFIED

    @property
    def saved(self) -> bool:
        return self.persistence is Persistence.SAVED


Event = Started | Prefill | Delta | Shift | Finished


def event_from_pb(pb: infer_pb2.GenerateResponse) -> Event | None:
    """A GenerateResponse -> its typed event (None for an event kind this client does not know)."""
    kind = pb.WhichOneof("event")
    if kind == "delta":
        d = pb.delta
        return Delta(tuple(d.token_ids), d.text, tuple(map(_logprobs, d.logprobs)))
    if kind == "prefill":
        return Prefill(pb.prefill.num_cells_done, pb.prefill.num_cells_total)
    if kind == "started":
        s = pb.started
        return Started(
            slot=s.slot,
            num_prompt_cells=s.num_prompt_cells,
            num_prompt_positions=s.num_prompt_positions,
            num_capacity_cells=s.num_capacity_cells,
            num_truncated_cells=s.num_truncated_cells,
            num_truncated_chunks=s.num_truncated_chunks,
            truncated_media_ids=tuple(s.truncated_media_ids),
            num_reused_cells=s.num_reused_cells,
        )
    if kind == "shift":
        sh = pb.shift
        return Shift(
            policy=from_pb(Policy, sh.policy),
            num_cells_evicted=sh.num_cells_evicted,
            num_positions_evicted=sh.num_positions_evicted,
            media_ids_evicted=tuple(sh.media_ids_evicted),
            num_cells_used_after=sh.num_cells_used_after,
            next_position_after=sh.next_position_after,
        )
    if kind == "finished":
        f, u = pb.finished, pb.finished.usage
        return Finished(
            reason=from_pb(FinishReason, f.reason),
            usage=Usage(
                num_prompt_cells=u.num_prompt_cells,
                num_prompt_positions=u.num_prompt_positions,
                num_generated_tokens=u.num_generated_tokens,
                num_shifts=u.num_shifts,
                num_evicted_cells=u.num_evicted_cells,
                num_reused_cells=u.num_reused_cells,
                prefill_seconds=u.prefill_seconds,
                decode_seconds=u.decode_seconds,
                num_draft_tokens=u.num_draft_tokens,
                num_accepted_tokens=u.num_accepted_tokens,
                drafts_by_type=tuple(
                    DraftCount(
                        from_pb(SpecType, d.type),
                        d.num_draft_tokens,
                        d.num_accepted_tokens,
                        d.num_cache_hits,
                    )
                    for d in u.drafts_by_type
                ),
            ),
            stop_string=f.stop_string,
            error=f.error,
            persistence=from_pb(Persistence, f.persistence),
        )
    return None


def _logprob(pb: infer_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token_id, pb.piece, pb.logprob)


def _logprobs(pb: infer_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(_logprob(pb.chosen), tuple(map(_logprob, pb.top)))


@dataclass
class Completion:
    """A whole generation, gathered from its events by `collect`."""

    token_ids: list[int] = field(default_factory=list)
    started: Started | None = None
    shifts: list[Shift] = field(default_factory=list)
    finished: Finished | None = None
    pieces: list[str] = field(default_factory=list)  # the deltas' text (joined once, in text)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.pieces.append(event.text)
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)
        elif isinstance(event, Shift):
            self.shifts.append(event)
        elif isinstance(event, Started):
            self.started = event
        elif isinstance(event, Finished):
            self.finished = event

    @property
    def reason(self) -> FinishReason:
        return self.finished.reason if self.finished else FinishReason.UNSPECIFIED

    @property
    def usage(self) -> Usage:
        return self.finished.usage if self.finished else Usage()

    @property
    def num_evicted_cells(self) -> int:
        return sum(s.num_cells_evicted for s in self.shifts)

    @property
    def num_evicted_media(self) -> int:
        return sum(len(s.media_ids_evicted) for s in self.shifts)


def collect(events: Iterable[Event], on_event: Callable[[Event], None] | None = None) -> Completion:
    """Drain a generate() stream into a Completion (on_event sees each event as it comes)."""
    done = Completion()
    for event in events:
        if on_event:
            on_event(event)
        done.add(event)
    return done


async def acollect(
    events: AsyncIterator[Event], on_event: Callable[[Event], None] | None = None
) -> Completion:
    """collect() for AsyncSlotwiseClient.generate."""
    done = Completion()
    async for event in events:
        if on_event:
            on_event(event)
        done.add(event)
    return done
