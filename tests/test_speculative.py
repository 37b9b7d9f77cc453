"""Speculative decoding over gRPC: with temperature 0 the tokens are the same with and
without drafts, through shifts of every policy, with images in context, with a grammar and
in sessions, on both tiny pairs; the usage counts the drafts; bad options are refused.

(tests/oracle.py drives the same executor with drafts through accepts and rejects and checks
every cell against llama.cpp after every step.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.tiny_models import token_id
from support.media import image_bytes
from support.rpc import Stream, channel, media_marker, prepare, rpc_error, run
from support.rpc import request as make_request

SIMPLE, MAP_K = infer_pb2.SPEC_TYPE_NGRAM_SIMPLE, infer_pb2.SPEC_TYPE_NGRAM_MAP_K
NO_END = {token_id(t): -100.0 for t in ("<|im_end|>", "<|endoftext|>")}
POLICIES = {
    "shift": infer_pb2.SHIFT_POLICY_SHIFT,
    "gap": infer_pb2.SHIFT_POLICY_GAP,
    "reprefill": infer_pb2.SHIFT_POLICY_REPREFILL,
    "auto": infer_pb2.SHIFT_POLICY_AUTO,
}


def speculating(req: infer_pb2.GenerateRequest, kind: int = SIMPLE, **options: int) -> Any:
    out = infer_pb2.GenerateRequest()
    out.CopyFrom(req)
    out.speculative.type = kind
    out.speculative.ngram_size_n = options.pop("ngram_size_n", 2)
    for name, value in options.items():
        setattr(out.speculative, name, value)
    return out


def both(port: int, req: infer_pb2.GenerateRequest, **options: int) -> tuple[Stream, Stream]:
    plain = run(port, req)
    return plain, run(port, speculating(req, **options))


def assert_same(plain: Stream, drafted: Stream) -> None:
    assert drafted.token_ids == plain.token_ids
    assert drafted.text == plain.text
    assert drafted.finished.reason == plain.finished.reason
    u = drafted.finished.usage
    assert u.num_generated_tokens == plain.finished.usage.num_generated_tokens
    assert 0 < u.num_accepted_tokens <= u.num_draft_tokens  # drafts were made, and landed
    assert plain.finished.usage.num_draft_tokens == 0


@pytest.mark.parametrize(
    ("pair", "policy"),
    [(pair, p) for pair in ("mrope", "rope") for p in POLICIES if (pair, p) != ("mrope", "shift")],
)  # (an M-RoPE memory cannot shift)
def test_greedy_tokens_are_the_same_with_drafts_through_shifts_and_images(
    pair: str, policy: str, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    server = infer_server(pair, ctx_size=256)
    marker = media_marker(prep_servers(pair))
    prompt = prepare(
        prep_servers(pair),
        raw=f"Look: {marker} and copy a b c d a b c d",
        images=[image_bytes(64, 48, seed=5)],
    )
    req = make_request(prompt, max_tokens=600, policy=POLICIES[policy], keep=1)
    req.logit_bias.update(NO_END)
    plain, drafted = both(server.port, req)
    assert len(plain.shifts) > 0  # 600 tokens in 256 cells
    assert [s.num_cells_evicted for s in drafted.shifts] == [
        s.num_cells_evicted for s in plain.shifts
    ]
    assert_same(plain, drafted)


@pytest.mark.parametrize(("pair", "rollback"), [(p, r) for p in ("qwen35", "lfm2") for r in (0, 4)])
def test_hybrid_memory_drafts_keep_the_greedy_tokens_through_rejects_and_reprefills(
    pair: str, rollback: int, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """A rejected draft leaves the recurrent state as if it had never been decoded: rolled
    back in place (`rollback` tokens of snapshots) or from the checkpoint before its step; the
    reply is the one without drafts, through re-prefills of a chat with an image in it."""
    server = infer_server(pair, ctx_size=256, spec_rollback=rollback, ctx_checkpoints=4)
    marker = media_marker(prep_servers(pair))
    prompt = prepare(
        prep_servers(pair),
        raw=f"Look: {marker} and copy a b c d a b c d",
        images=[image_bytes(64, 48, seed=5)],
    )
    req = make_request(prompt, max_tokens=400, policy=POLICIES["auto"], keep=1)
    req.logit_bias.update(NO_END)
    # a text the n-gram drafts get half right: after an `a` the last `a` was followed by
    # the other letter (rejected), after a `b` or `c` by the rest of the cycle (accepted)
    req.constraint.grammar = 'root ::= ("abac")+'
    plain, drafted = both(server.port, req, n_max=12, ngram_size_n=1)
    assert plain.text.startswith("abacabac")
    assert len(plain.shifts) > 0  # 400 tokens in 256 cells: evicted by re-prefilling
    assert_same(plain, drafted)
    u = drafted.finished.usage
    assert u.num_accepted_tokens < u.num_draft_tokens  # some were rejected, and taken back


EVERY_TYPE = {
    "ngram-simple": [SIMPLE],
    "ngram-map-k": [MAP_K],
    "ngram-map-k4v": [infer_pb2.SPEC_TYPE_NGRAM_MAP_K4V],
    "ngram-mod": [infer_pb2.SPEC_TYPE_NGRAM_MOD],
    "ngram-cache": [infer_pb2.SPEC_TYPE_NGRAM_CACHE],
    "suffix": [infer_pb2.SPEC_TYPE_SUFFIX],
    "mod+suffix": [infer_pb2.SPEC_TYPE_SUFFIX, infer_pb2.SPEC_TYPE_NGRAM_MOD],
}


@pytest.mark.parametrize("pair", ["rope", "qwen35"])
@pytest.mark.parametrize("name", list(EVERY_TYPE))
def test_every_draft_type_keeps_the_greedy_tokens(
    pair: str, name: str, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """Each n-gram type llama-server has, the suffix cache, and several at once (the first in
    llama-server's order with a draft drafts): the reply is the one without drafts, the usage
    counts each type's drafts."""
    server = infer_server(pair, ctx_size=512, spec_rollback=2)
    prompt = prepare(prep_servers(pair), raw="Say: abacabacabacabac")
    req = make_request(prompt, max_tokens=160)
    req.logit_bias.update(NO_END)
    req.constraint.grammar = 'root ::= ("abac")+'
    plain = run(server.port, req)
    drafted_req = speculating(req, ngram_size_n=2, ngram_mod_n_match=2, ngram_mod_n_min=1)
    drafted_req.speculative.type = infer_pb2.SPEC_TYPE_UNSPECIFIED
    drafted_req.speculative.types.extend(EVERY_TYPE[name])
    drafted = run(server.port, drafted_req)
    assert_same(plain, drafted)
    u = drafted.finished.usage
    by_type = {infer_pb2.SpecType.Name(d.type): d for d in u.drafts_by_type}
    assert sum(d.num_draft_tokens for d in by_type.values()) == u.num_draft_tokens
    assert sum(d.num_accepted_tokens for d in by_type.values()) == u.num_accepted_tokens
    if name == "mod+suffix":  # (ngram-mod comes first in llama-server's order)
        assert "SPEC_TYPE_NGRAM_MOD" in by_type


def test_the_suffix_cache_drafts_a_tenant_s_earlier_reply_and_never_another_s(
    prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """A reply said before is drafted from the tenant's cache when it comes again (hits
    counted); another tenant (another key of the keys file would do the same) never drafts
    from it: a cache_salt-free request under another tenant id gets no hit."""
    server = infer_server("rope", ctx_size=512)
    prompt = prepare(prep_servers("rope"), raw="Call the tool:")
    req = make_request(prompt, max_tokens=120)
    req.logit_bias.update(NO_END)
    req.constraint.grammar = 'root ::= "{\\"name\\": \\"search\\", \\"q\\": \\"" [a-e]+'
    spec = speculating(req, kind=infer_pb2.SPEC_TYPE_SUFFIX)
    first = run(server.port, spec)
    again = run(server.port, spec)
    assert again.token_ids == first.token_ids
    hits = {
        infer_pb2.SpecType.Name(d.type): d.num_cache_hits
        for d in again.finished.usage.drafts_by_type
    }
    assert hits.get("SPEC_TYPE_SUFFIX", 0) > 0


@pytest.mark.parametrize("rollback", [0, 4])
def test_the_model_s_mtp_head_drafts_and_keeps_the_greedy_tokens(
    rollback: int, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """draft-mtp on the tiny qwen35 with a nextn layer: the head's drafts are verified as any
    others (rejected ones rolled back on the hybrid memory); the reply is the one without."""
    mtp = infer_pb2.SPEC_TYPE_DRAFT_MTP
    server = infer_server("qwen35mtp", ctx_size=512, spec_rollback=rollback, mtp=True)
    marker = media_marker(prep_servers("qwen35mtp"))
    prompt = prepare(
        prep_servers("qwen35mtp"), raw=f"Look: {marker} and tell", images=[image_bytes(64, 48)]
    )
    req = make_request(prompt, max_tokens=120)
    req.logit_bias.update(NO_END)
    plain, drafted = both(server.port, req, kind=mtp, n_max=3)
    assert drafted.token_ids == plain.token_ids
    u = drafted.finished.usage
    assert u.num_draft_tokens > u.num_accepted_tokens > 0  # drafts landed, and missed
    (count,) = u.drafts_by_type
    assert count.type == mtp and count.num_draft_tokens == u.num_draft_tokens


def test_draft_mtp_without_the_head_is_invalid_argument(
    prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    server = infer_server("qwen35", ctx_size=256)
    req = make_request(prepare(prep_servers("qwen35"), raw="hi"), max_tokens=2)
    req.speculative.type = infer_pb2.SPEC_TYPE_DRAFT_MTP
    e = rpc_error(lambda: run(server.port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert "draft-mtp" in e.details()


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_synthetic_acceptance_accepts_at_its_rate_whatever_the_model_samples(
    rate: float, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """--spec-synth-rates (llama-server's benchmarking aid): 0 rejects every draft, so the
    reply is the model's own; 1 accepts every one, the model's samples or not."""
    from infer_service.api.request import GenerateLimits
    from infer_service.spec.config import SpecConfig, SpecType
    from infer_service.spec.synthetic import synth_rates

    spec = SpecConfig(SpecType.NGRAM_SIMPLE, n_max=4, size_n=1,
                      synth=synth_rates([rate] * 4, None, 4))  # fmt: skip
    server = infer_server("rope", ctx_size=512, limits=GenerateLimits(speculative=spec))
    req = make_request(prepare(prep_servers("rope"), raw="a b c d a b c d e"), max_tokens=48)
    req.logit_bias.update(NO_END)
    req.sampling.seed = 7
    plain = run(server.port, speculating(req, infer_pb2.SPEC_TYPE_NONE))
    drafted = run(server.port, req)
    u = drafted.finished.usage
    assert u.num_draft_tokens > 0 and u.num_generated_tokens == 48
    if rate == 0.0:
        assert u.num_accepted_tokens == 0 and drafted.token_ids == plain.token_ids
    else:
        assert u.num_accepted_tokens == u.num_draft_tokens
        assert run(server.port, req).token_ids == drafted.token_ids  # (seeded: the same draws)


def test_synthetic_rates_are_refused_unless_llama_server_s_shape() -> None:
    from infer_service.spec.synthetic import synth_rates

    assert synth_rates([], None, 4) == ()
    assert synth_rates([1.0, 0.5, 0.25], None, 3) == (1.0, 0.5, 0.5)
    assert synth_rates([], 1.0, 3) == (0.0, 0.0, 0.0) and synth_rates([], 4.0, 3) == (1.0,) * 3
    for bad in (([0.5], None, 3), ([0.2, 0.5, 0.1], None, 3), ([0.5] * 3, 2.0, 3), ([], 9.0, 3)):
        with pytest.raises(ValueError):
            synth_rates(*bad)


@pytest.mark.parametrize("kind", [SIMPLE, MAP_K])
def test_seeded_sampling_and_a_grammar_keep_their_tokens_with_drafts(
    kind: int, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """Drafts pass through the slot's own sampler chain position by position: its grammar
    and its seeded sampler advance on what is emitted only."""
    server = infer_server("rope", ctx_size=1024)
    prompt = prepare(prep_servers("rope"), raw="A list: [1, 1, 1, 1, 1, 1, 1, 1,")
    schema = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 40, "maxItems": 40}
    req = make_request(prompt, max_tokens=400, temperature=0.0)
    req.constraint.json_schema = json.dumps(schema)
    plain, drafted = both(server.port, req, kind=kind, ngram_min_hits=1)
    assert len(json.loads(plain.text)) == 40
    assert_same(plain, drafted)
    # sampled: each token is the target's own sample at its real prefix, so the text has the
    # same distribution (not always the same tokens: a batch's sums differ from a single
    # token's in the last bits, enough to tip a sample that lands on a boundary)
    sampled = make_request(prompt, max_tokens=300, temperature=0.3, seed=11)
    sampled.logit_bias.update(NO_END)
    drafted = run(server.port, speculating(sampled, kind=kind, ngram_size_n=1))
    u = drafted.finished.usage
    assert drafted.finished.reason == infer_pb2.FINISH_REASON_LENGTH
    assert len(drafted.token_ids) == u.num_generated_tokens == 300
    # (how many: the slot's draft length follows this machine's step times; the oracle
    # drives accepts and rejects of sampled drafts cell by cell)
    assert u.num_draft_tokens > 0


def test_session_turns_are_the_same_with_drafts(
    prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    server = infer_server("mrope", ctx_size=512)
    port = prep_servers("mrope")
    marker = media_marker(port)
    turns: dict[str, list[list[int]]] = {}
    for name, spec in (("plain", None), ("drafted", SIMPLE)):
        create = infer_pb2.CreateSessionRequest(session_id=name)
        create.context.policy = infer_pb2.SHIFT_POLICY_GAP
        with channel(server.port) as ch:
            infer_pb2_grpc.InferServiceStub(ch).CreateSession(create, timeout=10)
        for turn in range(4):
            prompt = prepare(port, raw=f"turn {turn}: {marker} say it again", add_special=False,
                             images=[image_bytes(40, 40, seed=turn)])  # fmt: skip
            req = make_request(prompt, max_tokens=150)
            req.session_id = name
            req.logit_bias.update(NO_END)
            if spec is not None:
                req = speculating(req, spec)
            s = run(server.port, req)
            assert s.finished.reason == infer_pb2.FINISH_REASON_LENGTH
            turns.setdefault(name, []).append(s.token_ids)
    assert turns["drafted"] == turns["plain"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_max", 65), ("ngram_size_n", 0), ("ngram_size_m", 5000), ("p_min", 2.0), ("type", 99)],
)
def test_bad_speculative_options_are_invalid_argument(
    field: str, value: Any, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    server = infer_server("rope", ctx_size=256)
    req = make_request(prepare(prep_servers("rope"), raw="hi"), max_tokens=2)
    setattr(req.speculative, field, value)
    e = rpc_error(lambda: run(server.port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert f"speculative.{field}" in e.details()


def test_the_openai_edge_takes_llama_server_s_speculative_fields(
    loop_thread: Any, tiny: Any, prep_servers: Callable[[str], int]
) -> None:
    """`speculative` (and llama-server's flat `speculative.n_max` keys) through the real
    openai client: the same reply, with the drafts in `usage.slotwise`; a bad value is a 400
    naming it; the metrics count drafts by type."""
    import openai

    from support.http_stack import Stacks

    stacks = Stacks(loop_thread, tiny, prep_servers)
    try:
        stack = stacks.start("rope")
        client = stack.client()
        messages = [{"role": "user", "content": "Repeat: a b c d a b c d a b c d"}]
        common = {"model": "m", "messages": messages, "max_tokens": 200, "temperature": 0,
                  "logit_bias": {str(t): -100 for t in NO_END}}  # fmt: skip
        plain = client.chat.completions.create(**common)
        drafted = client.chat.completions.create(
            **common,
            extra_body={"speculative": {"type": "ngram-simple"}, "speculative.ngram_size_n": 2},
        )
        assert drafted.choices[0].message.content == plain.choices[0].message.content
        extra = drafted.usage.model_extra["slotwise"]  # type: ignore[union-attr]
        assert 0 < extra["accepted_tokens"] <= extra["draft_tokens"]
        assert plain.usage.model_extra["slotwise"]["draft_tokens"] == 0  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**common, extra_body={"speculative.n_max": 1000})
        assert e.value.body["param"] == "speculative.n_max"  # type: ignore[index]
        several = client.chat.completions.create(
            **common, extra_body={"speculative": {"type": "ngram-mod,suffix"},
                                  "speculative.ngram_mod_n_match": 2,
                                  "speculative.ngram_mod_n_min": 1},
        )  # fmt: skip
        assert several.choices[0].message.content == plain.choices[0].message.content
        by_type = several.usage.model_extra["slotwise"]["drafts_by_type"]  # type: ignore[union-attr]
        assert set(by_type) <= {"ngram-mod", "suffix"} and by_type
        _other_apis_take_speculative(stack)
    finally:
        stacks.close()


def _other_apis_take_speculative(stack: Any) -> None:
    """The Responses API and Anthropic Messages read `speculative` too (the engine's counters
    grow by their drafts; a bad value is a 400 in each API's shape)."""
    import anthropic
    import openai

    stats = stack.infer.engine.stats
    client = stack.client()
    spec = {"speculative": {"type": "ngram-simple"}, "speculative.ngram_size_n": 1}
    text = "Repeat: a b c d a b c d a b c d"
    before = sum(c[0] for c in stats.drafts_by_type.values())
    client.responses.create(model="m", input=text, max_output_tokens=60, temperature=0,
                            extra_body=spec)  # fmt: skip
    after_responses = sum(c[0] for c in stats.drafts_by_type.values())
    assert after_responses > before
    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    claude.messages.create(model="m", max_tokens=60, extra_body={**spec, "temperature": 0},
                           messages=[{"role": "user", "content": text}])  # fmt: skip
    assert sum(c[0] for c in stats.drafts_by_type.values()) > after_responses
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input=text, extra_body={"speculative.n_max": 1000})
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=4, extra_body={"speculative": 7},
                               messages=[{"role": "user", "content": text}])  # fmt: skip
    assert e.value.body["type"] == "error"  # type: ignore[index]


# -- a draft model -------------------------------------------------------------------------------

DRAFT = infer_pb2.SPEC_TYPE_DRAFT_SIMPLE


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_a_draft_model_s_guesses_keep_the_tokens_through_shifts(
    draft: str, tiny: Any, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """The model itself as its draft: every guess lands. Another model of the same
    vocabulary (the gemma3 pair's text model): its guesses mostly miss. Either way the
    tokens are the model's own, through SHIFTs (the draft's context follows the ledger)."""
    model_draft = tiny["rope"].model if draft == "itself" else tiny["noncausal"].model
    server = infer_server("rope", ctx_size=256, model_draft=model_draft)
    prompt = prepare(prep_servers("rope"), raw="Tell me a long story about the sea")
    req = make_request(prompt, max_tokens=500, policy=POLICIES["shift"], keep=1)
    req.logit_bias.update(NO_END)
    plain, drafted = both(server.port, req, kind=DRAFT, n_max=6)
    assert len(plain.shifts) > 0
    assert drafted.token_ids == plain.token_ids
    u = drafted.finished.usage
    assert u.num_draft_tokens > 0
    if draft == "itself":
        assert u.num_accepted_tokens == u.num_draft_tokens
    else:
        assert u.num_accepted_tokens < u.num_draft_tokens


def test_a_draft_model_drafts_nothing_for_a_sequence_with_an_image(
    tiny: Any, prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    """A text-only draft model cannot see an image: such a sequence is not drafted for."""
    server = infer_server("rope", ctx_size=512, model_draft=tiny["rope"].model)
    marker = media_marker(prep_servers("rope"))
    prompt = prepare(
        prep_servers("rope"), raw=f"Look: {marker} now", images=[image_bytes(40, 40, seed=2)]
    )
    plain, drafted = run(server.port, make_request(prompt, max_tokens=40)), None
    drafted = run(server.port, speculating(make_request(prompt, max_tokens=40), DRAFT))
    assert drafted.token_ids == plain.token_ids
    assert drafted.finished.usage.num_draft_tokens == 0


def test_draft_simple_without_a_draft_model_is_invalid_argument(
    prep_servers: Callable[[str], int], infer_server: Callable[..., Any]
) -> None:
    server = infer_server("rope", ctx_size=256)
    req = speculating(make_request(prepare(prep_servers("rope"), raw="hi"), max_tokens=2), DRAFT)
    e = rpc_error(lambda: run(server.port, req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--model-draft" in e.details()
