"""The output processor: what a step did, told to each request's caller.

The executor says what happened in a step (`StepOutcome`: each request's events and sampled
tokens in the order they happened, and the requests it finished); this is the only code that
walks it. Tokens become text (never half a UTF-8 character, stop strings found and held back);
a request whose text met a stop string finishes; a finished request's turn goes into its
session (a completed one says whether it is on disk); and each request gets the step's events
in one post to its mailbox: one hand-off per request and step, not one per token.

What must be done before the next step is planned runs on the engine thread: the sessions'
part, and the text of a request that its text can end (stop strings) or that a session keeps.
The text of every other request (stateless, no stop strings: most traffic) is made on the
output thread, while the next step decodes (llama_decode releases the GIL): the engine's own
cost per step then does not grow with its streams' text.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import asdict, dataclass, field, replace

from infer_service.events import (
    ContextShift,
    ErrorKind,
    Event,
    Finished,
    FinishReason,
    Persistence,
    Problem,
    ProblemError,
    Reason,
    TokenDelta,
    storage_problem,
)
from infer_service.runner.executor import Ending, Executor, Sampled, StepOutcome
from infer_service.runner.job import Job
from infer_service.runner.runtime import Runtime
from infer_service.runner.stats import EngineStats
from infer_service.runner.text_stream import TextStream
from infer_service.sessions.manager import SessionManager
from infer_service.sessions.session import TurnRecord

log = logging.getLogger("slotwise.engine")

# steps whose text the output thread may have yet to tell before the engine waits for it
MAX_STEPS_BEHIND = 4


@dataclass(eq=False)
class _Reply:
    """One request's text under way."""

    text: TextStream
    unsent: TokenDelta | None = None  # tokens held for the next TokenDelta (stream_tokens > 1)
    num_tokens: int = 0
    parts: list[str] = field(default_factory=list)  # a session turn's text, for its record
    stop_string: str = ""  # the stop string its text met


class OutputProcessor:
    """`process` runs on the engine thread, after each step and before the next is planned (a
    request that met a stop string is out of its slot before the next decode); the text of
    the others is told from the output thread, in the order of the steps."""

    def __init__(
        self, executor: Executor, sessions: SessionManager, stats: EngineStats, runtime: Runtime
    ):
        self._executor = executor
        self._sessions = sessions
        self._stats = stats
        self._runtime = runtime
        self._replies: dict[Job, _Reply] = {}  # (each request's: touched by one thread)
        self._work: queue.SimpleQueue[_Text | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0  # steps handed to the output thread and not yet told
        self._thread = threading.Thread(target=self._serve, name="outputs", daemon=True)
        self._thread.start()

    def process(self, outcome: StepOutcome) -> bool:
        """(Engine thread) what a step did; a request that met a stop string is finished
        before this returns. Whether it finished any request."""
        for dropped, why in outcome.dropped:
            self._drop(dropped, why)
        for seconds in outcome.first_tokens:
            self._stats.time_to_first_token.observe(seconds)
        here, there = _Text(), _Text()
        for job, event in outcome.events:
            (here if _stoppable(job) else there).events.append((job, event))
        for ending in outcome.endings:
            (here if _stoppable(ending.job) else there).endings.append(ending)
        for ending in there.endings:  # (their usage is final: no stop string takes any back)
            self._count(ending)
        if there.events or there.endings:
            with self._idle:  # (a thread that falls behind holds the engine, not memory)
                self._idle.wait_for(lambda: self._pending < MAX_STEPS_BEHIND)
                self._pending += 1
            self._work.put(there)
        self._shifted(outcome)  # (before a turn that ended with a shift is saved)
        told = self._tell(here)
        for ending in told:
            self._count(ending)
        self._tell_sessions(outcome)
        return bool(outcome.dropped or there.endings or told)

    def drain(self) -> None:
        """(Engine thread) wait until the output thread told all it was given."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (text := self._work.get()) is not None:
            self._tell(text)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _count(self, ending: Ending) -> None:
        tenant = self._stats.tenant(ending.job.tenant)
        tenant.num_generated_tokens += ending.usage.num_generated_tokens

    def _tell(self, text: _Text) -> list[Ending]:
        """Tell a step's events and endings (of some of its requests), in order; the endings
        told, stop strings' included. A failure is the requests' it met, told as theirs."""
        posts: dict[Job, list[Event]] = {}
        endings = list(text.endings)
        try:
            self._text(text, posts, endings)
        except Exception:  # (a bug: their endings are told all the same)
            log.exception("making a step's text failed")
        for ending in endings:  # (each on its own: one failing is not another's)
            self._finish_safely(ending, posts.pop(ending.job, []))
        for job, events in posts.items():
            if events:
                post_best_effort(job, events)
        return endings

    def _text(self, text: _Text, posts: dict[Job, list[Event]], endings: list[Ending]) -> None:
        """The step's tokens into text and its events into each request's post; a request
        whose text met a stop string joins `endings`."""
        for i, (job, event) in enumerate(text.events):
            out = posts.get(job)
            if out is None:
                out = posts[job] = []
            if isinstance(event, Sampled):
                if self._token(job, event, out):  # its text met a stop string
                    stopped = self._stopped(job, event.at, text.events[i + 1 :], text.endings)
                    if stopped is not None:
                        endings.append(stopped)
                continue
            if isinstance(event, ContextShift) and job in self._replies:
                self._send(job, self._replies[job], out)  # its tokens before it go first
            out.append(event)

    def _token(self, job: Job, sampled: Sampled, out: list[Event]) -> bool:
        """A sampled token into its request's text; whether its text met a stop string."""
        reply = self._reply(job)
        if reply.stop_string:
            return False  # (drafts confirmed after the stop: never told)
        piece = sampled.piece if sampled.piece is not None else self._runtime.piece(sampled.token)
        text = reply.text.push(piece)
        logprobs = (sampled.logprobs,) if sampled.logprobs else ()
        delta = TokenDelta((sampled.token,), text, logprobs)
        reply.unsent = reply.unsent.merged(delta) if reply.unsent else delta
        reply.num_tokens += 1
        if reply.text.stopped_by is not None:
            reply.stop_string = reply.text.stopped_by
            return True
        if len(reply.unsent.token_ids) >= job.stream_tokens or reply.num_tokens == 1:
            self._send(job, reply, out)
        return False

    def _stopped(
        self, job: Job, at: int, later: list[tuple[Job, Event | Sampled]], endings: list[Ending]
    ) -> Ending | None:
        """A request whose text met a stop string at the step's token `at` for it: what the
        step did after it is taken back, and it finishes; None when the step finished it
        already (its Ending says STOP when it is told)."""
        num_later = sum(1 for j, e in later if j is job and isinstance(e, Sampled))
        slot = next((s for s in self._executor.slots if s.job is job), None)
        if slot is None:
            slot = next((e.slot for e in endings if e.job is job), None)
        if slot is None:
            return None
        try:
            return self._executor.stopped(slot, job, at, num_later)
        except Exception as e:  # (a bug, or llama.cpp refused the cut: it ends, failed)
            log.exception("stopping a request at its stop string failed")
            if slot.job is not job:
                return None
            why = Problem(ErrorKind.INTERNAL, f"internal error: {e!r}", Reason.INTERNAL)
            return self._executor.finish(slot, FinishReason.ERROR, error=why.message, problem=why)

    def _reply(self, job: Job) -> _Reply:
        reply = self._replies.get(job)
        if reply is None:
            reply = self._replies[job] = _Reply(TextStream(job.stop))
        return reply

    def _send(self, job: Job, reply: _Reply, out: list[Event], tail: str = "") -> None:
        delta, reply.unsent = reply.unsent, None
        if tail:
            delta = delta.merged(TokenDelta((), tail)) if delta else TokenDelta((), tail)
        if delta is not None:
            if job.session_id is not None:
                reply.parts.append(delta.text)
            out.append(delta)

    def _drop(self, job: Job, event: Event) -> None:
        """A job that leaves without having had a slot: its turn rolls back, it is told."""
        if job.session_id is not None:
            try:
                self._sessions.end_turn(job, completed=False)
            except Exception:  # (it is told all the same)
                log.exception("rolling back a turn that never started failed")
        post_best_effort(job, [event])
        job.release()

    def _shifted(self, outcome: StepOutcome) -> None:
        for slot in outcome.shifted:
            try:
                self._sessions.on_shift(slot)
            except Exception:  # a count of shifts, never a request's end
                log.exception("counting a shift failed")

    def _tell_sessions(self, outcome: StepOutcome) -> None:
        """The sessions hear what else the step did to their slots (none of it a request's)."""
        try:
            for slot in outcome.unsaved:  # its sequence lacks what its ledger says
                self._sessions.swap_out(slot, save=False)  # its next turn re-prefills it
            if outcome.pool_wanted:  # (the prompt waits on, and asks again next step)
                self._sessions.make_room(outcome.pool_wanted)
        except Exception:
            log.exception("telling the sessions what a step did failed")

    # -- finishing ----------------------------------------------------------------------------

    def _finish_safely(self, ending: Ending, events: list[Event]) -> None:
        try:
            self._finish(ending, events)
        except Exception as e:  # a bug: this request hears it, the others go on
            log.exception("finishing a request failed")
            why = Problem(ErrorKind.INTERNAL, f"internal error: {e}")
            post_best_effort(
                ending.job, [*events, Finished(FinishReason.ERROR, error=why.message, problem=why)]
            )

    def _finish(self, ending: Ending, events: list[Event]) -> None:
        """Tell a finished request's caller (its last text first), after its session took
        the turn in (or rolled it back); a completed session turn says whether it is on
        disk."""
        job, reason, usage = ending.job, ending.reason, ending.usage
        reply = self._replies.pop(job, None)
        stop_string, problem = ending.stop_string, ending.problem
        if reply is not None:
            if reply.stop_string and reason.completed:  # (met in the step that finished it)
                reason, stop_string = FinishReason.STOP, reply.stop_string
            self._send(job, reply, events, reply.text.flush() if reason.completed else "")
        if reason is FinishReason.ERROR and problem is None:
            problem = Problem(ErrorKind.INTERNAL, ending.error or "internal error")
        completed = reason.completed
        record = None
        if completed and job.session_id is not None:
            text = "".join(reply.parts) if reply is not None else ""
            record = TurnRecord(0, text, int(reason), asdict(usage), job.note, time.time())
        saved = None
        if job.session_id is not None:  # (a stateless request is no session's business)
            saved = self._sessions.end_turn(job, completed=completed, record=record)
        # the slot is free before the client hears about it: its next request finds it so
        finished = Finished(
            reason, usage, stop_string=stop_string, error=ending.error, problem=problem
        )
        if saved is None:
            if completed and job.session_id is not None:
                finished = replace(finished, persistence=Persistence.MEMORY)
            post_best_effort(job, [*events, finished])
            return
        post_best_effort(job, events)  # (before the write's word, which may come at once)
        saved.add_done_callback(lambda write: post_best_effort(job, [_saved(job, finished, write)]))


@dataclass
class _Text:
    """A step's events and endings of some of its requests, to be told in order."""

    events: list[tuple[Job, Event | Sampled]] = field(default_factory=list)
    endings: list[Ending] = field(default_factory=list)


def _stoppable(job: Job) -> bool:
    """Whether its text is told on the engine thread: its text may end it (a stop string,
    found before the next step), or it is a session's turn (its end is the session's)."""
    return bool(job.stop) or job.session_id is not None


def _saved(job: Job, finished: Finished, write: Future[None]) -> Finished:
    """A completed turn's Finished once its write is over: on disk, or not (and why)."""
    e = CancelledError() if write.cancelled() else write.exception()
    if e is None:
        return replace(finished, persistence=Persistence.SAVED)
    why = (
        e.problem
        if isinstance(e, ProblemError)
        else storage_problem(
            e if isinstance(e, OSError) else OSError(str(e)), "the turn was not saved"
        )
    )
    why = replace(why, reason=Reason.SESSION_NOT_SAVED, metadata=(
        *why.metadata, ("session_id", job.session_id or ""), ("storage", why.reason.value),
    ))  # fmt: skip
    return replace(
        finished,
        persistence=Persistence.NOT_SAVED,
        error=f"{why.message} (the session goes on in memory)",
        problem=why,
    )


def post_best_effort(job: Job, events: list[Event]) -> None:
    """Tell a caller that may already be gone (its loop closed): that must not stop us."""
    try:
        job.mailbox.post(events)
    except Exception:
        log.debug("a caller could not be told %r", events, exc_info=True)
