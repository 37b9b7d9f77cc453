"""What a request asks the sampler to follow costs bounded work on the engine thread:
trigger patterns in RE2, grammars and schemas bounded before llama.cpp's recursive parser
and the schema converter see them, and a grammar whose work grows past its budget ends its
own request only.

Each test here failed before these bounds: the pattern ran until its deadline (Python's
`re` backtracking on the engine thread, the other stream frozen), the nested grammar and the
schema killed the process (a stack overflow in llama.cpp's parser), the ambiguous grammar
froze every stream for seconds a token.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from infer_service.runner.sampling import _PARSES
from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.tiny_models import token_id
from support.rpc import channel, fields_of, prepare, reason_of, rpc_error, run
from support.rpc import request as make_request
from support.wait import wait_until


@pytest.fixture(scope="module")
def server(loop_thread, tiny) -> Any:
    from infer_service.__main__ import start
    from infer_service.runner.runtime import RuntimeConfig

    pair = tiny["rope"]
    config = RuntimeConfig(
        pair.model, pair.mmproj, ctx_size=2048, parallel=2, threads=1, grammar_ms=50
    )
    running = loop_thread.run(start(config))
    yield running
    loop_thread.run(running.stop(0))


@pytest.fixture(scope="module")
def prompt(prep_servers: Callable[[str], int]) -> Any:
    return prepare(prep_servers("rope"), raw="Write something:")


class Beside:
    """Another client's stream, read on a thread: its tokens' arrival times."""

    def __init__(self, port: int, req: infer_pb2.GenerateRequest):
        self.times: list[float] = []
        self.finished: infer_pb2.Finished | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(port, req), daemon=True)
        self._thread.start()

    def _read(self, port: int, req: infer_pb2.GenerateRequest) -> None:
        try:
            with channel(port) as ch:
                for event in infer_pb2_grpc.InferServiceStub(ch).Generate(req, timeout=120):
                    kind = event.WhichOneof("event")
                    if kind == "delta":
                        self.times.append(time.monotonic())
                        self.started.set()
                    elif kind == "finished":
                        self.finished = event.finished
        finally:
            self.started.set()  # (a failed call: the test sees no finish)

    def join(self) -> None:
        self._thread.join(150)

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0)


def test_a_backtracking_trigger_pattern_costs_linear_time_beside_another_stream(server, prompt):
    """The issue's case: `(.*.*)*X` over the free text, beside a 400-token stream. Python's
    `re` backtracks exponentially on the text without an X: the call ran until its deadline
    and the other stream waited seconds a token. RE2 matches in linear time."""
    other = Beside(server.port, make_request(prompt, max_tokens=400, temperature=1.0, seed=3))
    assert other.started.wait(60)
    hostile = make_request(prompt, max_tokens=200, temperature=1.0, seed=7)
    hostile.constraint.grammar = 'root ::= "X"'
    hostile.constraint.trigger_patterns.append("(.*.*)*X")
    # the free text never holds the trigger, nor ends before max_tokens: the worst case
    for t in ("X", "x", "<|im_end|>", "<|endoftext|>"):
        hostile.logit_bias[token_id(t)] = -100.0
    done = run(server.port, hostile, timeout=90)
    other.join()
    assert done.finished.reason == infer_pb2.FINISH_REASON_LENGTH, done.finished
    assert other.finished is not None, "the stream beside it failed"
    assert other.finished.reason in (infer_pb2.FINISH_REASON_STOP, infer_pb2.FINISH_REASON_LENGTH)
    print(f"\nthe other stream's longest gap beside the pattern: {other.longest_gap:.3f} s")


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=a)b", r"(?<!a)b", "(", "a{1001}", "x" * 300])
def test_a_pattern_re2_cannot_take_is_invalid_argument(server, prompt, pattern) -> None:
    req = make_request(prompt, max_tokens=4)
    req.constraint.grammar = 'root ::= "x"'
    req.constraint.trigger_patterns.append(pattern)
    e = rpc_error(lambda: run(server.port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert fields_of(e) == ["constraint.trigger_patterns"], e.details()


def _nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        # llama.cpp's parser recursed 20,000 deep here and the process died of it
        (lambda c: setattr(c, "grammar", _nested(20_000)), "constraint.grammar"),
        (lambda c: setattr(c, "grammar", 'root ::= "' + "a" * (300 << 10) + '"'),
         "constraint.grammar"),
        # the converter writes these out: 20,000 nested groups, or a billion copies
        (lambda c: setattr(c, "json_schema", json.dumps({"type": "array", "maxItems": 20_000})),
         "constraint.json_schema"),
        (lambda c: setattr(c, "json_schema", json.dumps({"type": "array", "minItems": 10**9})),
         "constraint.json_schema"),
        (lambda c: setattr(c, "json_schema", json.dumps({"type": "string", "maxLength": 10**6})),
         "constraint.json_schema"),
        (lambda c: setattr(c, "json_schema",
                           json.dumps({"type": "string", "pattern": "^a{5000000}$"})),
         "constraint.json_schema"),
        (lambda c: setattr(c, "json_schema", "[" * 70 + "]" * 70), "constraint.json_schema"),
    ],
)  # fmt: skip
def test_grammars_and_schemas_past_their_bounds_are_refused(server, prompt, mutate, field):
    req = make_request(prompt, max_tokens=4)
    mutate(req.constraint)
    e = rpc_error(lambda: run(server.port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert fields_of(e) == [field], e.details()
    # and the server is still there
    assert run(server.port, make_request(prompt, max_tokens=2)).finished.reason


def test_grammars_and_schemas_within_the_bounds_still_work(server, prompt) -> None:
    req = make_request(prompt, max_tokens=60, temperature=1.0)
    req.constraint.grammar = _nested(1_500) + ' "b"?'
    assert run(server.port, req).text.startswith("a")
    schema = {"type": "array", "items": {"enum": [1]}, "maxItems": 3}
    req = make_request(prompt, max_tokens=60, temperature=1.0)
    req.constraint.json_schema = json.dumps(schema)
    assert json.loads(run(server.port, req).text) in ([], [1], [1, 1], [1, 1, 1])


def test_a_stop_string_past_its_bound_is_refused(server, prompt) -> None:
    req = make_request(prompt, max_tokens=4, stop=["x" * 1001])
    e = rpc_error(lambda: run(server.port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fields_of(e) == ["stop"]


AMBIGUOUS = " ".join(['("a" | "a" "a")?'] * 400) + ' "b"'


@pytest.mark.parametrize(
    ("grammar", "when"),
    [
        # its first parse stacks already many: the parse before queueing runs past the budget
        (f"root ::= {AMBIGUOUS}", "built"),
        # one stack until the x: the first token's accept, on the lane, runs past it
        (f'root ::= "x" amb\namb ::= {AMBIGUOUS}', "followed"),
    ],
)
def test_an_ambiguous_grammar_past_its_budget_ends_its_own_request(
    server, prompt, grammar, when
) -> None:
    """A small grammar whose parse stacks are thousands: llama.cpp's work on it takes
    seconds (and grows with every token). The request ends RESOURCE_EXHAUSTED naming the
    grammar, whether that work was its build or a token's; the stream beside it goes on;
    the call left running finishes on its own, and frees what it used."""
    other = Beside(server.port, make_request(prompt, max_tokens=300, temperature=1.0, seed=5))
    assert other.started.wait(60)
    req = make_request(prompt, max_tokens=1000, temperature=1.0)
    req.constraint.grammar = grammar
    req.logit_bias[token_id("x")] = 100.0  # the model follows the ambiguous path
    req.logit_bias[token_id("a")] = 90.0
    e = rpc_error(lambda: run(server.port, req, timeout=300))
    other.join()
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    assert reason_of(e) == "GRAMMAR_TOO_COSTLY"
    assert fields_of(e) == ["constraint.grammar"]
    assert other.finished is not None, "the stream beside it failed"
    assert other.finished.reason in (infer_pb2.FINISH_REASON_STOP, infer_pb2.FINISH_REASON_LENGTH)
    print(
        f"\nthe other stream's longest gap beside the grammar ({when}): {other.longest_gap:.3f} s"
    )
    # what ran past the budget ends (a worker reading a sampler the engine let go of would
    # spin, or crash the process); then grammars are served again
    lane = server.engine.executor.grammars
    wait_until(lambda: lane.num_stuck == 0 and _PARSES._late == 0, timeout=300,
               what="the calls left running to finish")  # fmt: skip
    ok = make_request(prompt, max_tokens=4)
    ok.constraint.grammar = 'root ::= "yes" | "no"'
    assert run(server.port, ok).text in ("yes", "no")


# -- the bounds themselves (pure) ----------------------------------------------------------------


def test_nesting_is_counted_as_llama_cpp_reads_groups() -> None:
    from slotwise_core.grammar_limits import MAX_GRAMMAR_NESTING, LimitError, check_grammar

    deep = MAX_GRAMMAR_NESTING + 1
    check_grammar(_nested(MAX_GRAMMAR_NESTING))
    with pytest.raises(LimitError, match="nested"):
        check_grammar(_nested(deep))
    # brackets in strings, character classes and comments are no groups
    for text in (
        'root ::= "' + "(" * deep + '"',
        "root ::= [" + "(" * deep + "]",
        'root ::= "a" # ' + "(" * deep,
        r'root ::= "\"' + "(" * deep + '"',
        r"root ::= [\]" + "(" * deep + "]",
    ):
        check_grammar(text)


def test_schema_counts_and_patterns_are_bounded_where_the_converter_writes_them_out() -> None:
    from slotwise_core.grammar_limits import MAX_SCHEMA_REPEAT, LimitError, check_schema

    ok = {"type": "array", "maxItems": MAX_SCHEMA_REPEAT, "items": {"pattern": "^a{3,1000}$"}}
    check_schema(ok)
    for bad in (
        {"properties": {"x": {"type": "string", "maxLength": MAX_SCHEMA_REPEAT + 1}}},
        {"items": [{"pattern": "b{1001}"}]},
        {"pattern": "b{2," + "9" * 5000 + "}"},
        {"pattern": "x" * 1001},
    ):
        with pytest.raises(LimitError):
            check_schema(bad)
