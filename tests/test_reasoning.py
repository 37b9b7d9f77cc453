"""Reasoning models over gRPC: where a template writes its thoughts, the budget that ends a
thought by writing its end into the sequence, and thoughts as eviction units.

The `think` tiny pair's template opens a thought in its generation prompt (as DeepSeek-R1's
distills and QwQ do); its `<think>` and `</think>` are single tokens. The random weights
would end a thought at random: the tests ban `</think>` (logit_bias -inf, the tool-calling
tests' trick the other way round), so that a thought runs until its budget writes the end,
and every count is exact. The tracker is checked token by token against llama.cpp's
reasoning budget (common/reasoning-budget.cpp); the ledger's thought units by hypothesis, as
tests/test_ledger.py checks the rest; the oracle (tests/oracle.py, `reasoning` runs) checks
the forced tokens cell for cell in llama.cpp.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ledger import FakeSequence, expected_cells, step

from clients.client import (
    Delta,
    Message,
    Shift,
    SlotwiseClient,
    SlotwiseError,
    Speculative,
    collect,
)
from infer_service.kv.ledger import CannotFit, EvictionUnit, Item, Ledger, Policy
from infer_service.kv.ledger import Shift as Plan
from infer_service.runner.reasoning import State, Thoughts, ThoughtTracker, utf8_complete
from slotwise_core.tiny_models import TinyPair, token_id
from support.loop import LoopThread

TEMPLATES = Path(__file__).parent / "templates" / "reasoning"
START, END = token_id("<think>"), token_id("</think>")
BAN_END = {END: -math.inf}


# -- the tracker, as llama.cpp's reasoning budget ------------------------------------------------


def run(thoughts: Thoughts, sampled: list[int], pieces: dict[int, bytes] | None = None) -> tuple[
    list[int], list[bool]
]:  # fmt: skip
    """The tokens written (forced ones in place of samples) and which are thoughts'."""
    tracker = ThoughtTracker(thoughts)
    out, marks = [], []
    for t in sampled:
        token = tracker.forced()
        token = t if token is None else token
        out.append(token)
        marks.append(tracker.accept(token, (pieces or {}).get(token, b"x")))
    return out, marks


def test_a_budget_ends_a_thought_after_so_many_tokens_with_its_message_and_end() -> None:
    t = Thoughts((1,), (2,), budget=3, forced=(7, 8, 2))
    out, marks = run(t, [5, 1, 5, 5, 5, 5, 5, 5, 5, 5])
    assert out == [5, 1, 5, 5, 5, 7, 8, 2, 5, 5]  # opened by 1; 3 tokens, then the ending
    assert marks == [False, True, True, True, True, True, True, True, False, False]
    # the prompt opened it: the reply's first token is the thought's
    out, marks = run(Thoughts((1,), (2,), started=True, budget=2), [5, 5, 5, 5])
    assert out == [5, 5, 2, 5] and marks == [True, True, True, False]
    # 0: ended at once; none: never
    assert run(Thoughts((1,), (2,), started=True, budget=0), [5, 5])[0] == [2, 5]
    assert run(Thoughts((1,), (2,), started=True), [5] * 50)[1] == [True] * 50


def test_a_thought_the_model_ends_is_left_alone_and_a_new_one_has_a_budget_of_its_own() -> None:
    t = Thoughts((1,), (2,), budget=2)
    out, marks = run(t, [1, 5, 2, 5, 1, 5, 5, 5, 5])
    assert out == [1, 5, 2, 5, 1, 5, 5, 2, 5]
    assert marks == [True, True, True, False, True, True, True, True, False]


def test_sequences_of_several_tokens_and_an_unfinished_character() -> None:
    t = Thoughts((1, 3), (2, 4), started=False, budget=2)
    out, marks = run(t, [3, 1, 3, 5, 5, 5, 5, 5])
    assert out == [3, 1, 3, 5, 5, 2, 4, 5]  # (the start completes at the second 3)
    assert marks == [False, False, True, True, True, True, True, False]
    # the budget is spent in the middle of a character: the ending waits for a token that
    # ends one (llama.cpp looks at each token's bytes alone: a lone continuation byte ends
    # none either)
    pieces = {5: b"\xe2\x82", 6: b"\xac", 9: b"a"}
    out, _ = run(Thoughts((1,), (2,), started=True, budget=1), [5, 6, 9, 9], pieces)
    assert out == [5, 6, 9, 2]
    assert utf8_complete(b"\xe2\x82\xac") and not utf8_complete(b"\xe2\x82")
    assert utf8_complete(b"") and utf8_complete(b"a\xc3\xa9") and not utf8_complete(b"\xf0\x9f")


def test_the_tracker_states_follow_llama_cpp() -> None:
    tracker = ThoughtTracker(Thoughts((1,), (2,), budget=1))
    assert tracker.state is State.OUTSIDE and tracker.forced() is None
    tracker.accept(1, b"<think>")
    assert tracker.state is State.COUNTING and tracker.inside
    tracker.accept(5, b"\xe2")
    assert tracker.state is State.WAITING_UTF8
    tracker.accept(5, b"\x82\xaca")  # (ends on a whole character)
    assert tracker.state is State.FORCING and tracker.forced() == 2
    tracker.accept(2, b"</think>")
    assert tracker.state is State.OUTSIDE and tracker.num_thought_tokens == 4
    with pytest.raises(ValueError):
        Thoughts((), (2,))
    with pytest.raises(ValueError):
        Thoughts((1,), (2,), budget=-1)


# -- the ledger: a thought is one eviction unit ---------------------------------------------------


def thought(n: int, message: int, first: int) -> list[Item]:
    """n generated tokens of one thought, one item each (as the engine appends them)."""
    return [Item(1, 1, message, (first + k,), generated=True, thought=True) for k in range(n)]


def answer(n: int, message: int, first: int) -> list[Item]:
    return [Item(1, 1, message, (first + k,), generated=True) for k in range(n)]


@pytest.mark.parametrize("unit", list(EvictionUnit))
def test_a_shift_evicts_a_thought_whole_and_the_answer_after_it_stays(unit) -> None:
    ledger = Ledger(16, can_shift=True, n_ctx_train=4096, keep=4, discard_fraction=0.0, unit=unit)
    seq = FakeSequence(16, mrope=False)
    for item in [Item.text(range(100, 104), 0), *thought(6, 1, 200), *answer(6, 1, 300)]:
        assert not isinstance(step(ledger, seq, item), CannotFit)
    plan = step(ledger, seq, Item(1, 1, 1, (400,), generated=True))
    assert isinstance(plan, Plan)  # one cell needed: the whole thought leaves, and only it
    assert [s.token_ids for s in plan.evicted] == [(200 + k,) for k in range(6)]
    assert sorted(seq.cells) == expected_cells(ledger, mrope=False)
    assert [s.token_ids[0] for s in ledger.segments[1:]] == [300, 301, 302, 303, 304, 305, 400]


@st.composite
def thinking_streams(draw: st.DrawFn) -> tuple[Ledger, list[Item]]:
    capacity = draw(st.integers(8, 40))
    ledger = Ledger(
        capacity,
        can_shift=draw(st.booleans()),
        n_ctx_train=draw(st.integers(capacity, 3 * capacity)),
        policy=draw(st.sampled_from(list(Policy))),
        keep=draw(st.sampled_from([0, 0, 2, capacity // 3])),
        discard_fraction=draw(st.sampled_from([0.0, 0.5, 1.0])),
        unit=draw(st.sampled_from(EvictionUnit)),
    )
    items: list[Item] = []
    token = 0
    for message in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, max(1, capacity // 3)))
        items.append(Item.text(range(token, token + n), message))
        token += n
        for _ in range(draw(st.integers(0, 2))):  # thoughts and answers, in turn
            k = draw(st.integers(1, max(1, capacity // 3)))
            items += (
                thought(k, message, token) if draw(st.booleans()) else answer(k, message, token)
            )
            token += k
    return ledger, items


def unpinned_thoughts(ledger: Ledger, first: dict[int, int]) -> Counter[tuple[int, int]]:
    """Unpinned thought tokens held, by thought (its message, and its first token)."""
    out: Counter[tuple[int, int]] = Counter()
    for s in ledger.segments:
        if s.item.thought and not s.pinned:
            out.update((s.message_index, first[t]) for t in s.token_ids)
    return out


@settings(max_examples=300, deadline=None, database=None)
@given(thinking_streams())
def test_a_shift_takes_all_of_a_thought_it_holds_or_none_of_it(
    scenario: tuple[Ledger, list[Item]],
) -> None:
    """Whatever the policy, unit and pins: every plan leaves each thought's unpinned tokens
    all in the cache or none (a thought still being written then goes on as another), and
    the cache is the ledger's, cell for cell."""
    ledger, items = scenario
    seq = FakeSequence(ledger.capacity, mrope=False)
    first: dict[int, int] = {}  # a thought's token -> the thought's first token
    for item in items:
        key = None
        if item.thought:
            t = item.token_ids[0]
            first[t] = first.get(t - 1, t)
            key = (item.message_index, first[t])
        before = unpinned_thoughts(ledger, first)
        if isinstance(step(ledger, seq, item), CannotFit):
            continue
        assert sorted(seq.cells) == expected_cells(ledger, mrope=False)
        after = unpinned_thoughts(ledger, first)
        for k in before | after:
            kept = after[k] - (k == key and not ledger.segments[-1].pinned)
            assert kept in (before[k], 0), (k, before[k], after[k])


# -- the services -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def think(
    loop_thread: LoopThread, tiny: dict[str, TinyPair]
) -> Iterator[Callable[..., SlotwiseClient]]:
    """client(chat_template=None, **infer options) on the think pair's services."""
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    pair = tiny["think"]
    preps: dict[str | None, Any] = {}
    infers: dict[tuple[tuple[str, Any], ...], Any] = {}
    clients: list[SlotwiseClient] = []

    def client(chat_template: str | None = None, **options: Any) -> SlotwiseClient:
        if chat_template not in preps:
            preps[chat_template] = loop_thread.run(
                start_prep(pair.model, pair.mmproj, threads=1, chat_template=chat_template)
            )
        key = tuple(sorted(options.items()))
        if key not in infers:
            options.setdefault("ctx_size", 2048)
            config = RuntimeConfig(pair.model, pair.mmproj, threads=1, **options)
            infers[key] = loop_thread.run(start_infer(config))
        c = SlotwiseClient(
            f"127.0.0.1:{preps[chat_template].port}", f"127.0.0.1:{infers[key].port}"
        )
        clients.append(c)
        return c

    yield client
    for c in clients:
        c.close()
    for running in [*preps.values(), *infers.values()]:
        loop_thread.run(running.stop(0))


HI = [Message.user("hi")]


def test_prep_finds_the_thoughts_in_the_template_and_whether_the_prompt_opened_one(
    think: Callable[..., SlotwiseClient], tiny: dict[str, TinyPair]
) -> None:
    client = think()
    p = client.prepare(HI)
    assert p.rendered_text.endswith("<|im_start|>assistant\n<think>\n")
    r = p.reasoning
    assert r is not None and (r.start, r.end) == ("<think>", "</think>")
    assert (r.start_ids, r.end_ids) == ((START,), (END,))
    assert r.started and r.opened_text == "\n" and r.num_opened == 1
    off = client.prepare(HI, template_kwargs={"enable_thinking": False})
    assert off.rendered_text.endswith("<think>\n\n</think>\n\n")
    assert off.reasoning is not None and not off.reasoning.started
    assert client.count(HI, template_kwargs={"enable_thinking": False}).num_cells == off.num_cells
    # the templates of llama.cpp's own tests, as llama-server renders them (test_template.py)
    cases = {
        "Qwen-Qwen3-0.6B": ("<|im_start|>assistant\n", "<think>\n\n</think>\n\n", False),
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<think>\n", "<think>\n</think>", True),
        "Qwen-QwQ-32B": ("<|im_start|>assistant\n<think>\n", "<think>\n</think>", True),
    }
    for name, (on, closed, started) in cases.items():
        c = think(chat_template=str(TEMPLATES / f"{name}.jinja"))
        p, q = c.prepare(HI), c.prepare(HI, template_kwargs={"enable_thinking": False})
        assert p.rendered_text.endswith(on) and q.rendered_text.endswith(closed), name
        assert p.reasoning is not None and p.reasoning.started is started, name
        assert q.reasoning is not None and not q.reasoning.started, name


def test_template_kwargs_are_checked(think: Callable[..., SlotwiseClient]) -> None:
    client = think()
    for kwargs, words in [
        ({"enable_thinking": "false"}, "expected boolean, got string"),
        ({"messages": []}, "the chat template's own"),
        ({"add_generation_prompt": False}, "the chat template's own"),
    ]:
        with pytest.raises(SlotwiseError) as e:
            client.prepare(HI, template_kwargs=kwargs)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert words in e.value.details()
    with pytest.raises(ValueError):
        client.prepare("raw <think>", template_kwargs={"x": 1})
    # any other variable reaches the template (a model without thoughts has none to find)
    assert think().prepare(HI, template_kwargs={"reasoning_effort": "low"}).reasoning


def test_the_budget_writes_the_end_into_the_sequence_and_counts_it(
    think: Callable[..., SlotwiseClient],
) -> None:
    client = think()
    p = client.prepare(HI)
    assert p.reasoning is not None
    # 5 thought tokens as llama-server counts them: the prompt's "\\n" after <think>, 4 more
    done = collect(
        client.generate(p, max_tokens=12, temperature=0, logit_bias=BAN_END,
                        reasoning=p.reasoning.options(5))
    )  # fmt: skip
    tokens = done.token_ids
    assert tokens[4] == END and END not in tokens[:4] + tokens[5:]
    assert done.finished is not None
    assert done.finished.usage.num_generated_tokens == 12  # (the forced token is one of them)
    assert done.text.count("</think>") == 1
    # a message before the end, as --reasoning-budget-message writes it
    message = client.tokenize(" Enough.").token_ids
    text = collect(
        client.generate(p, max_tokens=16, temperature=0, logit_bias=BAN_END,
                        reasoning=p.reasoning.options(5, message))
    ).text  # fmt: skip
    assert text.index(" Enough.</think>") > 0
    # no budget: the thought goes on (the end banned); 0: ended at once
    assert "</think>" not in collect(
        client.generate(p, max_tokens=20, temperature=0, logit_bias=BAN_END,
                        reasoning=p.reasoning.options())
    ).text  # fmt: skip
    assert _tokens(client, p, 0)[0] == END


def _tokens(client: SlotwiseClient, p: Any, budget: int, **options: Any) -> list[int]:
    out: list[int] = []
    for e in client.generate(p, max_tokens=options.pop("max_tokens", 12), temperature=0,
                             logit_bias=BAN_END, reasoning=p.reasoning.options(budget),
                             **options):  # fmt: skip
        if isinstance(e, Delta):
            out += e.token_ids
    return out


@pytest.mark.parametrize("unit", ["token", "message"])
def test_a_shift_evicts_the_thought_whole_before_the_answer(
    think: Callable[..., SlotwiseClient], unit: str
) -> None:
    """256 cells (llama.cpp's smallest context); the prompt pinned, one cell freed a shift:
    the first shift takes the thought (its 30 tokens, the written end included; the budget
    counts the prompt's "\\n" after <think> too, as llama-server does), the next
    ones the answer a token at a time (or, by message, the answer's tokens together)."""
    client = think(ctx_size=256)
    p = client.prepare(HI)
    assert p.reasoning is not None
    events = list(
        client.generate(
            p, max_tokens=400, temperature=0, logit_bias=BAN_END,
            reasoning=p.reasoning.options(30), keep=p.num_cells, discard_fraction=0.0,
            policy="shift", unit=unit,
        )
    )  # fmt: skip
    shifts = [e.num_cells_evicted for e in events if isinstance(e, Shift)]
    tokens = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    assert tokens.index(END) == 29  # 30 thought tokens: 29 written, then the end
    assert shifts[0] == 30
    answer = 256 - p.num_cells  # (the cells the thought left, filled again by the answer)
    assert shifts[1] == (1 if unit == "token" else answer)


SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_a_constraint_holds_for_the_reply_after_the_thought(
    think: Callable[..., SlotwiseClient],
) -> None:
    from clients.client import Constraint

    client = think()
    p = client.prepare(HI)
    assert p.reasoning is not None
    done = collect(
        client.generate(
            p, max_tokens=300, temperature=0.8, seed=3, logit_bias=BAN_END,
            constraint=Constraint(json_schema=SMALL),
            reasoning=p.reasoning.options(6),
        )
    )  # fmt: skip
    thoughts, reply = done.text.split("</think>")
    assert not thoughts.lstrip().startswith("{")  # (free thoughts, then the valid reply)
    assert json.loads(reply)["a"] in range(10)
    assert done.finished is not None and done.finished.reason.value == "stop"


def test_drafts_change_nothing_of_what_is_written(think: Callable[..., SlotwiseClient]) -> None:
    client = think()
    p = client.prepare(HI)
    plain = _tokens(client, p, 9, max_tokens=80)
    spec = Speculative("ngram-simple", n_max=8, ngram_size_n=2)
    drafted = _tokens(client, p, 9, max_tokens=80, speculative=spec)
    assert drafted == plain and plain[8] == END


def test_reasoning_options_are_checked(think: Callable[..., SlotwiseClient]) -> None:
    from clients.client import ReasoningOptions

    client = think()
    p = client.prepare(HI)
    for options, field in [
        (ReasoningOptions((START,), (10**6,)), "reasoning"),
        (ReasoningOptions((), (END,)), "reasoning"),
        (ReasoningOptions((START,), (END,), budget_tokens=10**9), "reasoning.budget_tokens"),
    ]:
        with pytest.raises(SlotwiseError) as e:
            collect(client.generate(p, max_tokens=2, reasoning=options))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, options
        assert field in e.value.details() or e.value.field == field


def test_a_session_turn_continues_the_reply_as_the_model_wrote_it(
    think: Callable[..., SlotwiseClient],
) -> None:
    """The template shows an earlier reply without its thoughts; the session holds it with
    them: the next turn repeats the reply as written (and reuses its cells), then its end of
    turn and the new message, never a second assistant header."""
    client = think()
    client.create_session("thinking-turns")
    p = client.prepare(HI)
    ascii_only = {**BAN_END, **{t: -math.inf for t in range(128, 256)}}  # (text that reads back)
    first = collect(
        client.generate(p, session_id="thinking-turns", max_tokens=10, temperature=0,
                        logit_bias=ascii_only, reasoning=p.reasoning.options(4))
    )  # fmt: skip
    assert p.reasoning is not None
    record = client.get_session("thinking-turns", num_records=1).records[-1].text
    assert record == first.text and "</think>" in record
    turn = [Message.user(" "), Message.assistant(record), Message.user("again")]
    q = client.prepare(turn, first_message=1)
    assert q.rendered_text == (
        record + "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    done = collect(client.generate(q, session_id="thinking-turns", max_tokens=4, temperature=0))
    assert done.finished is not None
    # the whole reply, thoughts and all (its last token, which ended it, never went in)
    assert done.finished.usage.num_reused_cells == 9
