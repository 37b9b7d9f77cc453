"""ignore_eos and banned tokens, as llama-server has them: end-of-generation tokens are never
sampled inside the engine (every one the vocabulary marks), and a logit bias of -infinity
bans a token outright (its `[id, false]`), while a finite bias stays within [-100, 100]."""

from __future__ import annotations

import math

import grpc
import pytest
from test_infer_service import run, text_prompt

from slotwise.v1 import infer_pb2
from slotwise_core.tiny_models import token_id
from support.rpc import request as make_request

EOG = ("<|im_end|>", "<|endoftext|>")  # the tiny vocabulary's end-of-generation tokens


def test_ignore_eos_generates_past_a_forced_end(prep_servers, infer_server) -> None:
    server = infer_server("rope", ctx_size=512)
    prompt = text_prompt(prep_servers("rope"))
    ending = make_request(prompt, max_tokens=20, temperature=0)
    ending.logit_bias[token_id("<|im_end|>")] = 100.0  # (all but forces the end)
    stopped = run(server.port, ending)
    assert stopped.finished.reason == infer_pb2.FINISH_REASON_STOP and not stopped.token_ids

    ending.ignore_eos = True
    s = run(server.port, ending)
    assert s.finished.reason == infer_pb2.FINISH_REASON_LENGTH and len(s.token_ids) == 20
    assert not {token_id(t) for t in EOG} & set(s.token_ids)


def test_a_minus_infinity_bias_bans_a_token(prep_servers, infer_server) -> None:
    server = infer_server("rope", ctx_size=512)
    prompt = text_prompt(prep_servers("rope"))
    plain = run(server.port, make_request(prompt, max_tokens=12, temperature=0))
    favourite = max(set(plain.token_ids), key=plain.token_ids.count)
    banned = make_request(prompt, max_tokens=12, temperature=0)
    banned.logit_bias[favourite] = -math.inf
    s = run(server.port, banned)
    assert s.token_ids and favourite not in s.token_ids


@pytest.mark.parametrize("bias", [math.inf, math.nan, 101.0, -1e9])
def test_other_biases_outside_the_range_are_refused(prep_servers, infer_server, bias) -> None:
    server = infer_server("rope", ctx_size=512)
    req = make_request(text_prompt(prep_servers("rope")), max_tokens=2)
    req.logit_bias[5] = bias
    with pytest.raises(grpc.RpcError) as e:
        run(server.port, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in (e.value.details() or "")


@pytest.fixture
def http_stack(loop_thread, tiny, prep_servers):
    from support.http_stack import Stacks

    stacks = Stacks(loop_thread, tiny, prep_servers)
    yield stacks.start("rope")
    stacks.close()


def test_the_native_api_takes_ignore_eos_and_false_biases(http_stack) -> None:
    import httpx

    end = token_id("<|im_end|>")
    with httpx.Client(base_url=http_stack.url, timeout=120) as api:
        body = {"prompt": "hi", "n_predict": 12, "temperature": 0, "return_tokens": True}
        forced = api.post("/completion", json={**body, "logit_bias": [[end, 100]]})
        assert forced.status_code == 200 and forced.json()["tokens_predicted"] <= 1
        ignored = api.post(
            "/completion", json={**body, "logit_bias": [[end, 100]], "ignore_eos": True}
        )
        assert ignored.status_code == 200, ignored.text
        assert ignored.json()["tokens_predicted"] == 12 and end not in ignored.json()["tokens"]
        plain = api.post("/completion", json=body).json()["tokens"]
        banned = api.post("/completion", json={**body, "logit_bias": [[plain[0], False]]})
        assert banned.status_code == 200, banned.text
        assert plain[0] not in banned.json()["tokens"]
