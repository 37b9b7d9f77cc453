"""Prometheus metrics of both services, scraped over HTTP after real traffic: a multimodal
generation that shifts its context, refused requests, a cancelled stream."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer_service.__main__ import start as start_infer
from infer_service.runner.runtime import RuntimeConfig
from prep_service.__main__ import start as start_prep
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc, prompt_pb2
from slotwise_core.serving import Security
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.media import image_bytes
from support.procs import free_port
from support.rpc import channel, message, prepare, rpc_error, run, server_info
from support.rpc import request as make_request
from support.wait import idle_stats, wait_until

GAP = infer_pb2.SHIFT_POLICY_GAP


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def services(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[dict[str, Any]]:
    """A prep and an infer server (1 slot of 256 cells) with their metrics ports."""
    pair = tiny["mrope"]
    ports = {"prep_metrics": free_port(), "infer_metrics": free_port()}
    prep = loop_thread.run(start_prep(pair.model, pair.mmproj, metrics_port=ports["prep_metrics"]))
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=256, parallel=1, threads=1)
    infer = loop_thread.run(start_infer(config, metrics_port=ports["infer_metrics"]))
    yield {"prep": prep.port, "infer": infer.port, **ports}
    loop_thread.run(infer.stop(0))
    loop_thread.run(prep.stop(0))


def test_metrics_after_a_shifting_multimodal_generation_and_failures(services) -> None:
    prep, infer = services["prep"], services["infer"]
    cap = server_info(infer).num_cells_per_slot
    assert cap == 256

    prompts = [
        prepare(prep, messages=[message("user", "Look:", image_bytes(224, 224, seed=s), "Why?")])
        for s in (1, 2)
    ]
    with channel(prep) as ch:  # a refused Prepare
        err = rpc_error(
            lambda: prep_pb2_grpc.PrepServiceStub(ch).Prepare(
                prep_pb2.PrepareRequest(chat=prep_pb2.Chat()), timeout=10
            )
        )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

    # a long generation in a tight context: GAP shifts (M-RoPE), cells evicted
    s = run(infer, make_request(prompts[0], max_tokens=400, policy=GAP))
    assert s.finished.reason == infer_pb2.FINISH_REASON_LENGTH and s.finished.error == ""
    assert s.shifts, "400 tokens in 256 cells cannot go without shifts"
    seen_tokens = len(s.token_ids)
    evicted = sum(sh.num_cells_evicted for sh in s.shifts)
    second = run(infer, make_request(prompts[1], max_tokens=3))
    seen_tokens += len(second.token_ids)

    # refusals: a foreign fingerprint, a NaN temperature
    foreign = prompt_pb2.PreparedPrompt()
    foreign.CopyFrom(prompts[0])
    foreign.fingerprint.model = "0" * 64
    assert rpc_error(lambda: run(infer, make_request(foreign))).code() == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    bad = make_request(prompts[0], temperature=float("nan"))
    assert rpc_error(lambda: run(infer, bad)).code() == grpc.StatusCode.INVALID_ARGUMENT
    # a stream the client walks away from after its first token
    with channel(infer) as ch:
        call = infer_pb2_grpc.InferServiceStub(ch).Generate(
            make_request(prompts[1], max_tokens=100_000), timeout=30
        )
        for e in call:
            if e.HasField("delta"):
                seen_tokens += len(e.delta.token_ids)
                break
        call.cancel()
    # tokens sampled after the client's last read are counted by the server, not seen by us
    stats = idle_stats(infer)
    tokens_sampled = stats.num_generated_tokens
    assert tokens_sampled >= seen_tokens

    m = scrape(services["infer_metrics"])
    assert value(m, "slotwise_infer_capacity_cells") == cap
    used = value(m, "slotwise_infer_cells_used", slot="0")
    assert 0 < used <= cap
    assert value(m, "slotwise_infer_queue_depth") == 0
    assert value(m, "slotwise_infer_active") == 0
    assert value(m, "slotwise_infer_shifts_total", policy="gap") == len(s.shifts)
    assert value(m, "slotwise_infer_evicted_cells_total") == evicted > 0
    assert value(m, "slotwise_infer_generated_tokens_total") == tokens_sampled
    assert value(m, "slotwise_infer_decodes_total") == stats.num_decodes
    assert value(m, "slotwise_infer_media_cache_hits_total") == stats.num_media_cache_hits
    assert value(m, "slotwise_infer_session_bytes_written_total") == 0  # (no --sessions-dir)
    assert value(m, "slotwise_infer_time_to_first_token_seconds_count") == 3
    assert value(m, "slotwise_infer_time_to_first_token_seconds_sum") > 0
    ttft = "slotwise_infer_time_to_first_token_seconds_bucket"
    cumulative = [value(m, ttft, le=le) for le in ("0.005", "0.25", "30.0", "+Inf")]
    assert cumulative == sorted(cumulative) and cumulative[-1] == 3

    def calls(method: str, code: str) -> float:
        return value(m, "slotwise_infer_requests_total", method=method, code=code)

    assert calls("Generate", "OK") == 2
    assert calls("Generate", "FAILED_PRECONDITION") == 1
    assert calls("Generate", "INVALID_ARGUMENT") == 1
    assert calls("Generate", "CANCELLED") == 1
    assert calls("GetServerInfo", "OK") >= 2
    assert value(m, "slotwise_infer_request_seconds_count", method="Generate") == 5

    p = scrape(services["prep_metrics"])
    assert value(p, "slotwise_prep_requests_total", method="Prepare", code="OK") == 2
    assert value(p, "slotwise_prep_requests_total", method="Prepare", code="INVALID_ARGUMENT") == 1
    assert value(p, "slotwise_prep_request_seconds_count", method="Prepare") == 3
    assert value(p, "slotwise_prep_request_seconds_sum", method="Prepare") > 0
    buckets = [
        (dict(labels)["le"], v)
        for (name, labels), v in p.items()
        if name == "slotwise_prep_request_seconds_bucket" and dict(labels)["method"] == "Prepare"
    ]
    assert ("+Inf", 3.0) in buckets


def test_refused_and_undecodable_calls_are_counted(services) -> None:
    infer = services["infer"]
    before = scrape(services["infer_metrics"])
    with channel(infer) as ch:
        raw = ch.unary_unary(
            "/slotwise.v1.InferService/GetSession",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        err = rpc_error(lambda: raw(b"\x0a\x02\xff\xfe", timeout=10))  # session_id: bad UTF-8
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = infer_pb2_grpc.InferServiceStub(ch)
        err = rpc_error(
            lambda: stub.GetSession(infer_pb2.GetSessionRequest(session_id="nobody"), timeout=10)
        )
        assert err.code() == grpc.StatusCode.NOT_FOUND

    def deltas() -> tuple[float, float]:
        after = scrape(services["infer_metrics"])

        def delta(code: str) -> float:
            key = ("slotwise_infer_requests_total", (("code", code), ("method", "GetSession")))
            return after.get(key, 0) - before.get(key, 0)

        return delta("INVALID_ARGUMENT"), delta("NOT_FOUND")

    # a call is counted as its handler ends, which may be just after its client heard the status
    wait_until(lambda: deltas() == (1, 1), what="both refusals counted")
    assert deltas() == (1, 1)  # and no more


def test_unauthenticated_calls_are_counted(
    loop_thread: LoopThread, tiny: dict[str, TinyPair]
) -> None:
    pair = tiny["mrope"]
    metrics_port = free_port()
    prep = loop_thread.run(
        start_prep(pair.model, None, security=Security(token="t0ken"), metrics_port=metrics_port)
    )
    try:
        with channel(prep.port) as ch:
            stub = prep_pb2_grpc.PrepServiceStub(ch)
            for metadata in ((), (("authorization", "Bearer nope"),)):
                err = rpc_error(
                    lambda md=metadata: stub.GetModelInfo(
                        prep_pb2.GetModelInfoRequest(), timeout=10, metadata=md
                    )
                )
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.GetModelInfo(
                prep_pb2.GetModelInfoRequest(),
                timeout=10,
                metadata=(("authorization", "Bearer t0ken"),),
            )

        def calls() -> tuple[float, float]:
            m = scrape(metrics_port)

            def count(code: str) -> float:
                return value(m, "slotwise_prep_requests_total", method="GetModelInfo", code=code)

            return count("UNAUTHENTICATED"), count("OK")

        # (a call is counted as its handler ends, maybe just after its client heard the status)
        wait_until(lambda: calls() == (2, 1), what="the refused and the good call counted")
    finally:
        loop_thread.run(prep.stop(0))


def test_speculative_drafts_are_counted_by_type(services) -> None:
    before = scrape(services["infer_metrics"])
    prompt = prepare(services["prep"], raw="again and again and again and again")
    req = make_request(prompt, max_tokens=200)
    req.speculative.type = infer_pb2.SPEC_TYPE_NGRAM_SIMPLE
    req.speculative.ngram_size_n = 2
    u = run(services["infer"], req).finished.usage
    assert u.num_draft_tokens > 0
    after = scrape(services["infer_metrics"])

    def grew(name: str) -> float:
        key = (name, (("type", "ngram-simple"),))
        return after[key] - before.get(key, 0.0)

    assert grew("slotwise_infer_draft_tokens_total") == u.num_draft_tokens
    assert grew("slotwise_infer_accepted_tokens_total") == u.num_accepted_tokens
