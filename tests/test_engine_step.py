"""The engine's step as three calls (scheduler.schedule, executor.execute, outputs.process), on
real llama.cpp with a tiny generated model: a stateless request never meets the session
manager, and its events reach its mailbox once a step, not once a token."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from infer_service.events import (
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    Started,
    TokenDelta,
)
from infer_service.kv.ledger import Item
from infer_service.runner.job import Job
from infer_service.runner.runtime import SamplingConfig
from support.engines import running_engine


class _Posts:
    """A mailbox that keeps each post as it came."""

    def __init__(self) -> None:
        self.posts: list[list[Event]] = []
        self.done = threading.Event()

    def post(self, events: Sequence[Event]) -> None:
        self.posts.append(list(events))
        if any(isinstance(e, Finished) for e in events):
            self.done.set()


def _job(engine: Any, box: _Posts, max_tokens: int, **options: Any) -> Job:
    runtime = engine.runtime
    never = tuple((t, float("-inf")) for t in range(runtime.num_vocab) if runtime.is_eog(t))
    words = tuple(range(40, 60))
    return Job([Item.text(words, 0)], {}, box, sampling=SamplingConfig(temperature=0),
               max_tokens=max_tokens, logit_bias=never, **options)  # fmt: skip


def test_a_stateless_request_never_meets_the_session_manager(tiny) -> None:
    with running_engine(tiny["rope"].model, parallel=2) as engine:
        met: list[str] = []
        for name in ("enter", "ready", "waits_for_read", "end_turn", "slot_of", "last_used"):
            real = getattr(engine.sessions, name)

            def spy(*args: Any, _name: str = name, _real: Any = real, **kw: Any) -> Any:
                met.append(_name)
                return _real(*args, **kw)

            setattr(engine.sessions, name, spy)
        boxes = [_Posts() for _ in range(3)]
        for box in boxes:
            engine.submit(_job(engine, box, 12))
        for box in boxes:
            assert box.done.wait(60)
        assert met == []
        finished = [e for box in boxes for p in box.posts for e in p if isinstance(e, Finished)]
        assert [f.reason for f in finished] == [FinishReason.LENGTH] * 3


def test_a_request_hears_its_events_once_a_step(tiny) -> None:
    """Every token is its own delta (stream_tokens 1), yet a step's events for one request
    come in one post: posts never outnumber the engine's decodes, and each post holds at most
    one delta per token the step sampled."""
    with running_engine(tiny["rope"].model) as engine:
        box = _Posts()
        engine.submit(_job(engine, box, 24))
        assert box.done.wait(60)
        decodes = engine.call(lambda: engine.stats.num_decodes).result()
        deltas = [e for p in box.posts for e in p if isinstance(e, TokenDelta)]
        assert sum(len(d.token_ids) for d in deltas) == 24
        assert len(deltas) == 24  # (one per token: stream_tokens 1)
        # one post a step: its Started and its prefill's progress come with its first token,
        # its Finished with its last
        assert len(box.posts) == 24 <= decodes, (len(box.posts), decodes)
        first, last = box.posts[0], box.posts[-1]
        assert [type(e) for e in first] == [Started, PrefillProgress, TokenDelta], first
        assert [type(e) for e in last] == [TokenDelta, Finished], last
