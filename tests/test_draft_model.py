"""The draft model and drafts in the step, on real llama.cpp with the tiny pairs: guesses for
the position after the sequence's last token, a context that catches up a batch a step and is
never continued across owners, and drafts that leave every other slot its token."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infer_service.events import Finished, TokenDelta
from infer_service.kv.ledger import Item
from infer_service.runner.draft_model import DraftModel
from infer_service.runner.executor import Executor, Sampled
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.spec.config import SpecConfig, SpecType
from support.engines import running_engine
from support.wait import wait_until


@pytest.fixture
def pair(tiny: Any) -> Iterator[tuple[Runtime, DraftModel]]:
    config = RuntimeConfig(tiny["rope"].model, None, ctx_size=1024, parallel=2, threads=1,
                           batch_size=32, ubatch_size=32)  # fmt: skip
    target = Runtime(config)
    draft = DraftModel(config, target)  # the model as its own draft: its guesses are the truth
    try:
        yield target, draft
    finally:
        draft.close()
        target.close()


def greedy(rt: Runtime, tokens: list[int], n: int, seq: int = 1) -> list[int]:
    """The model's greedy continuation of tokens (decoded in sequence `seq`)."""
    rt.seq_clear(seq)
    out, feed, pos = [], list(tokens), 0
    for _ in range(n):
        for start in range(0, len(feed), rt.batch_size):
            piece = feed[start : start + rt.batch_size]
            rt.batch.clear()
            last = rt.batch.add(piece, pos, seq, logits_last=True)
            assert rt.decode() == 0
            pos += len(piece)
        token = int(np.argmax(rt.logits(last)))
        out.append(token)
        feed = [token]
    rt.seq_clear(seq)
    return out


def test_a_guess_is_for_the_position_after_the_last_token(pair) -> None:
    """The executor hands over the sequence with the token it decodes this step last: the
    first guess is the next token after it (not a guess of that token's own position)."""
    target, draft = pair
    words = random.Random(3).choices(range(32, 200), k=20)
    truth = greedy(target, words, 3)
    assert greedy(target, words[:-1], 1) != truth[:1]  # (the test could tell the two apart)
    assert draft.draft(0, words, 3) == truth


def test_the_draft_context_catches_up_a_batch_a_step(pair) -> None:
    target, draft = pair
    words = random.Random(4).choices(range(32, 200), k=100)  # 3 batches of 32, and more
    steps = 0
    while not (found := draft.draft(0, words, 2)):
        steps += 1
        assert steps < 10
    assert steps == 3  # (99 tokens before the last: a batch of 32 a step, then the guesses)
    assert found == greedy(target, words, 2)
    # a sequence that grew by a token: one decode to catch up, then the guesses
    before = draft.num_decodes
    assert draft.draft(0, [*words, found[0]], 1) == found[1:2]
    assert draft.num_decodes - before <= 2


def test_another_owner_s_sequence_is_never_continued_from(pair) -> None:
    _, draft = pair
    words = random.Random(5).choices(range(32, 200), k=20)
    assert draft.draft(0, words, 1, owner=("acme", ""))
    before = draft.num_decodes
    assert draft.draft(0, words, 1, owner=("acme", ""))  # the same owner: nothing to catch up
    assert draft.num_decodes - before == 1
    before = draft.num_decodes
    assert draft.draft(0, words, 1, owner=("globex", ""))  # another: decoded again, from 0
    assert draft.num_decodes - before == 2  # (19 tokens: one batch; then the guess)


def test_drafts_leave_every_other_slot_its_token(tiny: Any) -> None:
    """Three slots drafting as much as they may in a batch of 16: each still gets a token
    every step (the drafts take what the others' shares leave)."""
    config = RuntimeConfig(tiny["rope"].model, None, ctx_size=3 * 512, parallel=3, threads=1,
                           batch_size=16, ubatch_size=16)  # fmt: skip
    rt = Runtime(config)
    ex = Executor(rt, EngineStats(), cache_bytes=0, host_sequence_bytes=0)
    try:
        slots = [Slot(i) for i in range(3)]
        events = [KeptEvents(), KeptEvents(), KeptEvents()]
        never = tuple((t, float("-inf")) for t in range(rt.num_vocab) if rt.is_eog(t))
        spec = SpecConfig(SpecType.NGRAM_SIMPLE, n_max=48, size_n=1)
        for slot, seen in zip(slots, events, strict=True):
            tokens = (7, 8, 9, 7, 8, 9, 7, 8)
            job = Job([Item.text(tokens, 0)], {}, seen,
                      sampling=SamplingConfig(temperature=0), max_tokens=1 << 20,
                      logit_bias=never, speculative=spec)  # fmt: skip
            ex.start(slot, job, ex.enter(slot, job))

        def tokens(i: int) -> int:
            return sum(1 for e in events[i] if isinstance(e, Sampled))

        drafted = 0
        for _ in range(40):
            before = [tokens(i) for i in range(3)]
            outcome = ex.step(slots)
            for job, event in outcome.events:
                job.mailbox.post([event])
            if all(b > 0 for b in before):  # (all three generating)
                assert all(tokens(i) > before[i] for i in range(3)), "a slot got no token"
            drafted = sum(s.usage.num_draft_tokens for s in slots)
        assert drafted > 0
    finally:
        ex.close()
        rt.close()


def test_the_model_as_its_own_draft_has_every_guess_land_in_the_step(tiny: Any) -> None:
    """In the executor: the sequence handed to the draft model ends with the token the step
    decodes, so with the model as its own draft every guess lands (a guess one position
    early would land only where the text repeats one token)."""
    config = RuntimeConfig(tiny["rope"].model, None, ctx_size=1024, parallel=1, threads=1)
    rt = Runtime(config)
    ex = Executor(rt, EngineStats(), cache_bytes=0, host_sequence_bytes=0,
                  draft_model=DraftModel(config, rt))  # fmt: skip
    try:
        slot = Slot(0)
        never = tuple((t, float("-inf")) for t in range(rt.num_vocab) if rt.is_eog(t))
        words = tuple(random.Random(6).choices(range(32, 200), k=40))
        spec = SpecConfig(SpecType.DRAFT_SIMPLE, n_max=4)
        seen = KeptEvents()
        job = Job([Item.text(words, 0)], {}, seen,
                  sampling=SamplingConfig(temperature=0), max_tokens=60, logit_bias=never,
                  speculative=spec)  # fmt: skip
        asked: list[list[int]] = []
        model = ex.draft_model
        assert model is not None
        guess = model.draft

        def draft(seq: int, tokens: Any, k: int, *args: Any, **kw: Any) -> list[int]:
            asked.append(list(tokens))
            return guess(seq, tokens, k, *args, **kw)

        model.draft = draft  # type: ignore[method-assign]
        ex.start(slot, job, ex.enter(slot, job))
        usage = slot.usage
        while slot.job is not None:
            for j, event in ex.step([slot]).events:
                j.mailbox.post([event])
        generated = [e.token for e in seen if isinstance(e, Sampled)]
        # the first guesses follow the prompt and the first token sampled, which this step
        # decodes (not the prompt alone)
        assert asked[0] == [*words, generated[0]]
        assert usage.num_draft_tokens > 0
        assert usage.num_accepted_tokens == usage.num_draft_tokens
    finally:
        ex.close()
        rt.close()


def _finished_reply(
    model: Path, words: tuple[int, ...], stop: tuple[str, ...], spec: SpecConfig
) -> tuple[Finished, str, int]:
    """A greedy reply through a whole engine (its output processor finds the stop strings),
    the model as its own draft; what it said, and the cells its slot holds after it."""
    with running_engine(model, draft=True) as engine:
        runtime = engine.runtime
        never = tuple((t, float("-inf")) for t in range(runtime.num_vocab) if runtime.is_eog(t))
        box = KeptEvents()
        job = Job([Item.text(words, 0)], {}, box, sampling=SamplingConfig(temperature=0),
                  max_tokens=40, stop=stop, logit_bias=never, speculative=spec)  # fmt: skip
        engine.submit(job)
        finished = wait_until(
            lambda: next((e for e in box if isinstance(e, Finished)), None), what="its Finished"
        )
        text = "".join(e.text for e in box if isinstance(e, TokenDelta))
        cells = engine.call(lambda: engine.slots[0].num_cells).result()
        return finished, text, cells


def test_a_stop_string_among_confirmed_drafts_ends_the_reply_where_it_would_without(
    tiny: Any,
) -> None:
    """Drafts the target confirms are several tokens in one step; a stop string met in the
    middle of them (found by the output processor, after the step) ends the reply at the same
    token, with the same usage and the same cells as a reply without drafts."""
    model = tiny["rope"].model
    words = tuple(random.Random(5).choices(range(32, 200), k=24))
    plain = SpecConfig()
    drafts = SpecConfig(SpecType.DRAFT_SIMPLE, n_max=4)
    _, text, _ = _finished_reply(model, words, (), plain)
    assert len(text) > 13, text
    stops = [text[:n] for n in (7, 9, 10, 11, 13)]  # (met at different places in a step)
    for stop in stops:
        want, want_text, want_cells = _finished_reply(model, words, (stop,), plain)
        got, got_text, got_cells = _finished_reply(model, words, (stop,), drafts)
        assert got.usage.num_accepted_tokens > 0
        assert (got.reason, got.stop_string, got_text) == (want.reason, stop, want_text)
        assert got.usage.num_generated_tokens == want.usage.num_generated_tokens
        assert got_cells == want_cells
