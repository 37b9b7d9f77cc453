"""Images checked once: an image sent again in the same bytes (OpenAI-style clients resend every
image of a chat every turn) is not decoded or tokenized again, and still has to match what
libmtmd made of it; the cache stays within its bytes."""

from __future__ import annotations

import gc

import grpc
import pytest

from infer_service.runner.media import PREPROCESSED_BYTES_PER_PIXEL, Verified, VerifiedMedia
from slotwise.v1 import prompt_pb2
from slotwise_core import native
from slotwise_core.descriptors import MediaChunk
from slotwise_core.images import decode_image
from support.media import image_bytes
from support.rpc import Stream, generate, message, prepare
from support.rpc import request as make_request


def refused(port: int, prompt: prompt_pb2.PreparedPrompt) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(port, make_request(prompt, max_tokens=2))
    return e.value


def first_media(prompt: prompt_pb2.PreparedPrompt) -> prompt_pb2.MediaChunk:
    return next(c.media for c in prompt.chunks if c.WhichOneof("kind") == "media")


def chat(prep_port: int, *seeds: int) -> prompt_pb2.PreparedPrompt:
    parts: list[object] = []
    for seed in seeds:
        parts += [f"Picture {seed}:", image_bytes(120, 90, seed=seed)]
    return prepare(prep_port, messages=[message("user", *parts, "Compare them.")])


def test_a_resent_image_is_not_checked_again(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=2048)
    verified = server.verified
    prep = prep_servers("mrope")
    first = Stream(generate(server.port, make_request(chat(prep, 1), max_tokens=4)))
    assert (verified.misses, len(verified)) == (1, 1)
    # the whole chat again, a new image after it: only the new one is decoded
    again = Stream(generate(server.port, make_request(chat(prep, 1, 2), max_tokens=4)))
    assert (verified.hits, verified.misses, len(verified)) == (1, 2, 2)
    assert first.finished.reason and again.finished.reason
    # a hit gives what a check gives: the same request on a server that never saw the image
    fresh = infer_server("mrope", ctx_size=2048)
    prompt = chat(prep, 1, 2)
    ours = Stream(generate(server.port, make_request(prompt, max_tokens=8)))  # (greedy)
    theirs = Stream(generate(fresh.port, make_request(prompt, max_tokens=8)))
    assert verified.hits >= 3 and fresh.verified.hits == 0
    assert ours.token_ids == theirs.token_ids


def test_a_hit_is_still_held_to_its_counts_and_its_media_id(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=2048)
    good = chat(prep_servers("mrope"), 3)
    Stream(generate(server.port, make_request(good, max_tokens=2)))
    tampered = prompt_pb2.PreparedPrompt()
    tampered.CopyFrom(good)
    m = first_media(tampered)
    m.num_cells += 5
    tampered.num_cells += 5
    e = refused(server.port, tampered)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"media {m.media_id[:12]}: descriptor says {m.num_cells} cells" in e.details()
    hits = server.verified.hits
    # the same bytes under another image's name: checked again (decoded), and refused
    renamed = prompt_pb2.PreparedPrompt()
    renamed.CopyFrom(good)
    first_media(renamed).media_id = "0" * 32
    e = refused(server.port, renamed)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "media 000000000000: the image decodes here to other pixels" in e.details()
    assert server.verified.hits == hits + 1  # (found by its bytes, then refused by its name)


def entry(mtmd: native.Multimodal, seed: int, side: int) -> Verified:
    from infer_service.runner.media import _verify_image

    rgb = decode_image(image_bytes(side, side, seed=seed))
    image = MediaChunk(rgb.media_id, 0, 0, rgb.width, rgb.height, b"")
    return _verify_image(mtmd, image, rgb.rgb)


@pytest.fixture
def mtmd(tiny):
    pair = tiny["mrope"]
    model = native.load_model(pair.model, vocab_only=True)
    mm = native.Multimodal(pair.mmproj, model, n_threads=1)
    yield mm
    mm.close()
    native.free_model(model)


def test_the_cache_stays_within_its_bytes(mtmd) -> None:
    one = entry(mtmd, 0, 64)
    assert one.num_bytes == 64 * 64 * (3 + PREPROCESSED_BYTES_PER_PIXEL)
    cache = VerifiedMedia(max_bytes=3 * one.num_bytes)
    for seed in range(6):
        cache.put(f"k{seed}", entry(mtmd, seed, 64))
        assert cache.num_bytes <= cache.max_bytes
    assert len(cache) == 3
    assert cache.get("k0") is None and cache.get("k5") is not None  # least recently used out
    too_big = VerifiedMedia(max_bytes=one.num_bytes - 1)
    too_big.put("big", one)
    assert len(too_big) == 0 and too_big.num_bytes == 0


def test_a_chunk_lives_while_a_request_holds_it(mtmd) -> None:
    cache = VerifiedMedia(max_bytes=entry(mtmd, 0, 64).num_bytes)
    cache.put("a", entry(mtmd, 1, 64))
    held = cache.get("a")
    assert held is not None
    (handle,) = held.handles
    handle.close()  # a request ends: a shared chunk stays
    cache.put("b", entry(mtmd, 2, 64))  # evicts "a"
    gc.collect()
    assert cache.get("a") is None and handle.chunk  # the request's reference keeps it
    described = native.describe_chunk(handle.chunk)
    assert described.is_media and described.num_cells > 0


def test_bytes_never_decoded_are_never_taken_as_checked(prep_servers, infer_server) -> None:
    """Two groups of one image in a request: the second's bytes are not decoded (the first's
    pixels serve both), so they must not enter the cache as that image's."""
    server = infer_server("mrope", ctx_size=2048)
    prep = prep_servers("mrope")
    image = image_bytes(120, 90, seed=5)
    twice = prepare(prep, messages=[message("user", "A:", image, "B:", image, "Same?")])
    groups = [c.media for c in twice.chunks if c.WhichOneof("kind") == "media"]
    assert len(groups) == 2 and groups[0].media_id == groups[1].media_id
    other = image_bytes(120, 90, seed=6)  # another picture's file, under the first's name
    groups[1].encoded = other
    Stream(generate(server.port, make_request(twice, max_tokens=2)))
    alone = chat(prep, 5)
    first_media(alone).encoded = other
    e = refused(server.port, alone)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the image decodes here to other pixels" in e.details()
