"""Constrained decoding, logit biases and log-probabilities in the engine, over gRPC.

Random weights produce gibberish, but a grammar makes even them write JSON that parses and
matches its schema: the schemas here are bounded (enums, maxLength, maxItems) so that
max_tokens always suffices.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import grpc
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotwise.v1 import infer_pb2, prompt_pb2
from support.rpc import fields_of, prepare, rpc_error, run
from support.rpc import request as make_request

GRAMMAR = infer_pb2.FINISH_REASON_GRAMMAR
STOP = infer_pb2.FINISH_REASON_STOP
LENGTH = infer_pb2.FINISH_REASON_LENGTH

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "integer", "exclusiveMinimum": -5, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "color", "age", "score", "tags"],
    "additionalProperties": False,
}


def constrained(
    prompt: prompt_pb2.PreparedPrompt, *, grammar: str = "", schema: Any = None, **kw: Any
) -> infer_pb2.GenerateRequest:
    req = make_request(prompt, **kw)
    if schema is not None:
        req.constraint.json_schema = json.dumps(schema)
    else:
        req.constraint.grammar = grammar
    return req


@pytest.fixture(scope="module")
def servers(prep_servers: Callable[[str], int], loop_thread, tiny) -> Any:
    from infer_service.__main__ import start
    from infer_service.runner.runtime import RuntimeConfig

    running = {}
    for name in ("mrope", "rope"):
        pair = tiny[name]
        config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=512, parallel=2, threads=1)
        running[name] = loop_thread.run(start(config))
    yield running
    for r in running.values():
        loop_thread.run(r.stop(0))


def ask(prep_servers: Callable[[str], int], pair: str, text: str = "Describe a person:") -> Any:
    return prepare(prep_servers(pair), raw=text)


@pytest.mark.parametrize("pair", ["mrope", "rope"])
@pytest.mark.parametrize("seed", range(3))
def test_a_json_schema_makes_random_weights_write_valid_json(servers, prep_servers, pair, seed):
    prompt = ask(prep_servers, pair)
    s = run(
        servers[pair].port,
        constrained(prompt, schema=PERSON, max_tokens=400, temperature=1.0, seed=seed),
    )
    assert s.finished.reason == STOP, (s.finished, s.text)
    value = json.loads(s.text)
    jsonschema.validate(value, PERSON)


def test_a_gbnf_grammar_holds_from_the_first_token(servers, prep_servers) -> None:
    prompt = ask(prep_servers, "rope", "Answer:")
    answers = set()
    for seed in range(6):
        req = constrained(
            prompt, grammar='root ::= "yes" | "no" | "maybe"', temperature=1.0, seed=seed
        )
        s = run(servers["rope"].port, req)
        assert s.finished.reason == STOP
        answers.add(s.text)
    assert answers <= {"yes", "no", "maybe"} and answers


def test_a_grammar_no_token_can_continue_ends_with_its_own_reason(servers, prep_servers):
    # a NUL character is in no token's piece: after "ab" nothing may come, and the end may not
    prompt = ask(prep_servers, "mrope")
    s = run(servers["mrope"].port, constrained(prompt, grammar='root ::= "ab" [\\x00]'))
    assert (s.finished.reason, s.text) == (GRAMMAR, "ab")
    assert not s.finished.error


@pytest.mark.parametrize("pair", ["mrope", "rope"])
@pytest.mark.parametrize("policy", ["auto", "reprefill"])
def test_a_constrained_generation_that_shifts_keeps_its_grammar(
    servers, prep_servers, pair, policy
):
    """The grammar follows the generated text, not the KV cache: 700 tokens in 256 cells."""
    port = servers[pair].port
    prompt = ask(prep_servers, pair)
    req = constrained(
        prompt,
        grammar='root ::= "[" ("x" | "yy" | "," )+ "]"',
        max_tokens=700,
        temperature=1.0,
        seed=7,
        policy=getattr(infer_pb2, f"SHIFT_POLICY_{policy.upper()}"),
    )
    req.logit_bias[ord("]")] = -100.0  # (the grammar would let it close at once)
    s = run(port, req)
    assert s.shifts, "no shift: the test needs a generation longer than the context"
    assert s.finished.reason == LENGTH and len(s.token_ids) == 700
    assert re.fullmatch(r"\[(x|yy|,)*y?", s.text), s.text[:200]  # (cut by max_tokens)


def test_a_lazy_grammar_waits_for_its_trigger(servers, prep_servers) -> None:
    """Free text until the trigger; from the match on, the grammar. The bias makes the random
    model write the trigger ('a') at once, then the grammar decides the rest."""
    prompt = ask(prep_servers, "rope")
    a = ord("a")  # the tiny models' first 256 token ids are the bytes
    req = constrained(prompt, grammar='root ::= "a" "bc"', max_tokens=20)
    req.constraint.trigger_patterns.append("a")
    req.logit_bias[a] = 100.0
    s = run(servers["rope"].port, req)
    assert (s.finished.reason, s.text) == (STOP, "abc")
    # a trigger whose text the grammar does not accept ends the generation before that token
    req = constrained(prompt, grammar='root ::= "xyz"', max_tokens=20)
    req.constraint.trigger_patterns.append("a")
    req.logit_bias[a] = 100.0
    s = run(servers["rope"].port, req)
    assert (s.finished.reason, s.text, s.finished.usage.num_generated_tokens) == (GRAMMAR, "", 0)


def test_logprobs_and_the_most_likely_alternatives(servers, prep_servers) -> None:
    prompt = ask(prep_servers, "mrope")
    req = make_request(prompt, max_tokens=12, temperature=0.0)
    req.logprobs, req.top_logprobs = True, 3
    s = run(servers["mrope"].port, req)
    infos = [lp for d in s.of("delta") for lp in d.logprobs]
    assert [lp.chosen.token_id for lp in infos] == s.token_ids
    for lp in infos:
        top = [t.logprob for t in lp.top]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] <= 0.0
        assert sum(math.exp(x) for x in top) <= 1.0 + 1e-5
        assert lp.top[0].token_id == lp.chosen.token_id  # greedy takes the most likely
        assert math.isclose(lp.top[0].logprob, lp.chosen.logprob, abs_tol=1e-6)
    assert b"".join(lp.chosen.piece for lp in infos).decode("utf-8", "replace") == s.text
    # without top_logprobs: the chosen token's only
    req.top_logprobs = 0
    again = run(servers["mrope"].port, req)
    assert all(not lp.top for d in again.of("delta") for lp in d.logprobs)
    assert [lp.chosen.logprob for d in again.of("delta") for lp in d.logprobs] == pytest.approx(
        [lp.chosen.logprob for lp in infos]
    )


def test_a_logit_bias_forces_and_bans_tokens(servers, prep_servers) -> None:
    prompt = ask(prep_servers, "rope")
    port = servers["rope"].port
    plain = run(port, make_request(prompt, max_tokens=16, temperature=0.0))
    req = make_request(prompt, max_tokens=16, temperature=0.0)
    req.logit_bias[ord("q")] = 100.0
    assert run(port, req).text == "q" * 16
    banned = make_request(prompt, max_tokens=16, temperature=0.0)
    for t in set(plain.token_ids):
        banned.logit_bias[t] = -100.0
    assert not set(run(port, banned).token_ids) & set(plain.token_ids)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r.constraint, "grammar", "root ::= ("), "constraint.grammar"),
        (lambda r: setattr(r.constraint, "grammar", 'start ::= "x"'), "constraint.grammar"),
        (lambda r: setattr(r.constraint, "json_schema", "{not json"), "constraint.json_schema"),
        (
            lambda r: setattr(r.constraint, "json_schema", '{"$ref": "https://x.example/s"}'),
            "constraint.json_schema",
        ),
        (lambda r: r.constraint.trigger_patterns.append("("), "constraint"),
        (
            lambda r: (
                setattr(r.constraint, "grammar", 'root ::= "x"'),
                r.constraint.trigger_patterns.append("("),
            ),
            "constraint.trigger_patterns",
        ),
        (lambda r: r.logit_bias.__setitem__(1 << 20, 1.0), "logit_bias"),
        (lambda r: r.logit_bias.__setitem__(5, 1000.0), "logit_bias"),
        (lambda r: setattr(r, "top_logprobs", 3), "top_logprobs"),
        (lambda r: setattr(r, "turn_note", b"a note without a session"), "turn_note"),
        (lambda r: (setattr(r, "logprobs", True), setattr(r, "top_logprobs", 21)), "top_logprobs"),
    ],
)
def test_bad_constraints_are_invalid_argument_naming_the_field(
    servers, prep_servers, mutate, field
) -> None:
    prompt = ask(prep_servers, "rope")
    req = make_request(prompt, max_tokens=4)
    mutate(req)
    e = rpc_error(lambda: run(servers["rope"].port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    fields = fields_of(e)
    assert fields == [field], (fields, e.details())
    # and the server goes on serving
    assert run(servers["rope"].port, make_request(prompt, max_tokens=2)).finished.reason


# -- the JSON Schema converter's integer ranges (pure) --------------------------------------------


def _as_regex(gbnf: str) -> re.Pattern[str]:
    """The subset integer_range writes (literals, digit classes, groups, |) as a regex."""
    pattern = re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf).replace(" ", "")
    return re.compile(pattern)


@given(st.integers(-(10**6), 10**6), st.integers(0, 10**6))
@settings(max_examples=300, deadline=None)
def test_integer_ranges_match_exactly_the_integers_within(lo: int, width: int) -> None:
    from slotwise_core.json_grammar import integer_range

    hi = lo + width
    regex = _as_regex(integer_range(lo, hi))
    probes = {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 0, -1, 1, (lo + hi) // 2}
    probes |= {10**k for k in range(8)} | {10**k - 1 for k in range(8)}
    for n in probes:
        assert bool(regex.fullmatch(str(n))) == (lo <= n <= hi), (lo, hi, n)
    for bad in ("-0", "007", "+1", ""):
        assert not regex.fullmatch(bad)


def test_draft_4_exclusive_bounds() -> None:
    from slotwise_core.json_grammar import _bounds

    assert _bounds({"type": "integer", "maximum": 10, "exclusiveMaximum": True}) == (
        -(10**15 - 1),
        9,
    )
    assert _bounds({"type": "integer", "minimum": 0, "exclusiveMinimum": True})[0] == 1
    assert _bounds({"type": "integer", "minimum": 0, "exclusiveMinimum": False})[0] == 0
    assert _bounds({"type": "integer", "exclusiveMinimum": 2.5}) == (3, 10**15 - 1)
    assert _bounds({"type": "integer", "enum": [1, 2], "maximum": 9}) is None


def test_a_lazy_grammar_keeps_only_the_text_a_trigger_may_begin_in(tiny) -> None:
    """Free text of any length costs a bounded tail per token; a trigger after 3000
    characters of it is still found, and one anchored at the beginning never is."""
    from infer_service.runner.runtime import Runtime, RuntimeConfig
    from infer_service.runner.sampling import _TRIGGER_REACH, Constraint, SamplerSpec, SlotSampler

    rt = Runtime(RuntimeConfig(tiny["rope"].model, None, ctx_size=256, threads=1))
    try:
        x, b = ord("x"), ord("b")  # the tiny models' first 256 token ids are the bytes
        for patterns, found in (((r"(b)",), True), ((r"^\s*(b)",), False)):
            spec = SamplerSpec(constraint=Constraint('root ::= "bc"', patterns))
            sampler = SlotSampler(rt, spec)
            try:
                for _ in range(3000):
                    sampler._watch_for_trigger(x)
                    assert len(sampler._text) <= 4 * _TRIGGER_REACH
                sampler._watch_for_trigger(b)
                assert sampler.awaiting_trigger is not found, patterns
            finally:
                sampler.close()
    finally:
        rt.close()
