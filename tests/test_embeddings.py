"""Embed: mean-pooled embeddings on a context of their own, beside generation."""

from __future__ import annotations

import threading

import grpc
import numpy as np

from slotwise.v1 import infer_pb2, infer_pb2_grpc
from support.rpc import channel, prepare, rpc_error, run
from support.rpc import request as make_request


def embed(port: int, texts: list[str], normalize: bool = False) -> list[np.ndarray]:
    with channel(port) as ch:
        r = infer_pb2_grpc.InferServiceStub(ch).Embed(
            infer_pb2.EmbedRequest(texts=texts, normalize=normalize), timeout=60
        )
    return [np.array(e.values) for e in r.embeddings]


def test_embeddings_are_deterministic_pooled_and_normalized(infer_server, prep_servers) -> None:
    server = infer_server("rope", ctx_size=512, parallel=2, embeddings_ctx=256)
    a, b, a2 = embed(server.port, ["a red apple", "the stock market", "a red apple"])
    assert a.shape == (64,) and np.array_equal(a, a2) and not np.allclose(a, b)
    (unit,) = embed(server.port, ["a red apple"], normalize=True)
    assert np.isclose(np.linalg.norm(unit), 1.0) and np.allclose(unit, a / np.linalg.norm(a))
    # a generation streams meanwhile on the engine's own context, undisturbed
    prompt = prepare(prep_servers("rope"), raw="Once upon a time")
    alone = run(server.port, make_request(prompt, max_tokens=64, temperature=0.0))
    results: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: results.extend(embed(server.port, ["x y z"] * 20)))
    worker.start()
    beside = run(server.port, make_request(prompt, max_tokens=64, temperature=0.0))
    worker.join(60)
    assert beside.token_ids == alone.token_ids and len(results) == 20


def test_bad_embedding_input_and_a_server_without_embeddings(infer_server) -> None:
    server = infer_server("rope", ctx_size=512, embeddings_ctx=256)
    for texts in ([], [""], ["word " * 400]):
        e = rpc_error(lambda texts=texts: embed(server.port, texts))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert len(embed(server.port, ["still serving"])) == 1
    plain = infer_server("rope", ctx_size=512)
    e = rpc_error(lambda: embed(plain.port, ["hi"]))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED and "--embeddings" in e.details()
