"""infer_service over gRPC: real servers on loopback, real llama.cpp on the tiny pairs, no mocks.

The tiny models have random weights: their text is gibberish, but cells, positions, shifts and
the KV cache are real llama.cpp behaviour. Capacities are always read back from GetServerInfo
(llama.cpp rounds each sequence's cells up to a multiple of 256).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import grpc
import llama_cpp
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from slotwise.v1 import infer_pb2, infer_pb2_grpc, prompt_pb2
from slotwise_core import native
from slotwise_core.images import decode_image, media_id
from slotwise_core.tiny_models import TinyPair, token_id
from support.hold import PrefillHold
from support.media import image_bytes
from support.rpc import (
    Stream,
    channel,
    media_marker,
    message,
    prepare,
    rgb_of,
    rpc_error,
    run,
    server_info,
)
from support.rpc import request as make_request
from support.wait import PATIENCE, assert_nothing_runs_on, idle_stats, wait_until

SERVICE = "slotwise.v1.InferService"
AUTO = infer_pb2.SHIFT_POLICY_AUTO
SHIFT = infer_pb2.SHIFT_POLICY_SHIFT
GAP = infer_pb2.SHIFT_POLICY_GAP
REPREFILL = infer_pb2.SHIFT_POLICY_REPREFILL
STOP_POLICY = infer_pb2.SHIFT_POLICY_STOP
LENGTH = infer_pb2.FINISH_REASON_LENGTH
STOP = infer_pb2.FINISH_REASON_STOP
Code = grpc.StatusCode

# Greedy with these penalties gives long, varied output on the tiny models (plain greedy repeats
# one token), so a wrong logit or a mixed-up sequence changes the text.
VARIED = {"presence_penalty": 1.0, "frequency_penalty": 0.5}
# Images of the sizes the tests need: mrope (qwen2vl, 28x28 pixels per cell) 224x224 -> 64 cells,
# 8 positions; rope (LLaVA mlp) -> always 64 cells, 64 positions.
IMAGE_SIDE = 224


# -- fixtures and helpers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def detokenize(tiny: dict[str, TinyPair]) -> Iterator[Callable[[str, list[int]], str]]:
    """(pair, token ids) -> the text those tokens make, from a vocab-only model of our own."""
    vocabs: dict[str, tuple[int, int]] = {}

    def text_of(name: str, ids: list[int]) -> str:
        if name not in vocabs:
            model = native.load_model(tiny[name].model, vocab_only=True)
            vocabs[name] = (model, llama_cpp.llama_model_get_vocab(model))
        vocab = vocabs[name][1]
        return b"".join(native.token_piece(vocab, t) for t in ids).decode("utf-8", "replace")

    yield text_of
    for model, _ in vocabs.values():
        native.free_model(model)


def chat_with_image(
    prep_port: int, text: str = "Describe this picture:", *, seed: int = 0, tail: str = "Be brief."
):
    img = image_bytes(IMAGE_SIDE, IMAGE_SIDE, seed=seed)
    return prepare(prep_port, messages=[message("user", text, img, tail)])


def text_prompt(prep_port: int, text: str = "The quick brown fox"):
    return prepare(prep_port, raw=text)


def media_chunks(prompt: prompt_pb2.PreparedPrompt) -> list[prompt_pb2.MediaChunk]:
    return [c.media for c in prompt.chunks if c.WhichOneof("kind") == "media"]


def capacity(port: int) -> int:
    return server_info(port).num_cells_per_slot


def assert_consistent(s: Stream, prompt: prompt_pb2.PreparedPrompt) -> None:
    """What every completed stream must satisfy, whatever the request."""
    assert s.kinds[0] == "started" and s.kinds[-1] == "finished"
    assert s.kinds.count("started") == 1 and s.kinds.count("finished") == 1
    st, f = s.started, s.finished
    truncated = st.num_truncated_cells
    assert st.num_prompt_cells == prompt.num_cells - truncated
    if not truncated:
        assert st.num_prompt_positions == prompt.num_positions
    # prefill reports what had to be decoded (a reused prefix is not decoded again)
    to_decode = st.num_prompt_cells - st.num_reused_cells
    done = [p.num_cells_done for p in s.prefill]
    assert all(a < b for a, b in itertools.pairwise(done)), done
    assert {p.num_cells_total for p in s.prefill} == {to_decode}
    assert done[-1] == to_decode
    last_prefill = len(s.kinds) - 1 - s.kinds[::-1].index("prefill")
    assert "delta" not in s.kinds[:last_prefill], "a token before the prompt was in"
    u = f.usage
    assert u.num_generated_tokens == len(s.token_ids)
    assert (u.num_prompt_cells, u.num_prompt_positions, u.num_reused_cells) == (
        st.num_prompt_cells,
        st.num_prompt_positions,
        st.num_reused_cells,
    )
    assert u.num_shifts == len(s.shifts)
    assert u.num_evicted_cells == sum(sh.num_cells_evicted for sh in s.shifts)
    assert all(sh.num_cells_used_after < st.num_capacity_cells for sh in s.shifts)


def assert_good_request_succeeds(port: int, prompt: prompt_pb2.PreparedPrompt) -> Stream:
    s = run(port, make_request(prompt, max_tokens=4))
    assert_consistent(s, prompt)
    assert s.finished.reason == LENGTH and s.finished.error == ""
    assert len(s.token_ids) == 4
    return s


def assert_shift_accounting(
    s: Stream, prompt: prompt_pb2.PreparedPrompt, cap: int, policy: int
) -> None:
    """Every shift happened with the sequence exactly full and left room for the next token.

    Walks the stream in order: when a shift is reported after k generated tokens, the prompt and
    k - 1 of them are in the cache (the k-th waits for its decode), less what earlier shifts
    evicted; the first token is sampled from the prompt's logits.
    """
    cells, pos, k = prompt.num_cells, prompt.num_positions, 0
    for e in s.events:
        kind = e.WhichOneof("event")
        if kind == "delta":
            k += len(e.delta.token_ids)
        elif kind == "shift":
            sh = e.shift
            assert sh.policy == policy
            used_before = cells + max(0, k - 1)
            assert used_before == cap, "a shift before the sequence was full"
            assert 0 < sh.num_cells_evicted <= cap
            assert sh.num_cells_used_after == cap - sh.num_cells_evicted
            assert sh.num_cells_used_after + 1 <= cap
            next_pos = pos + max(0, k - 1)
            if policy == GAP:  # positions keep increasing; relative distances stay
                assert sh.next_position_after == next_pos
            else:  # SHIFT moves the rest back; REPREFILL decodes the kept units from 0
                assert sh.next_position_after == next_pos - sh.num_positions_evicted
                pos -= sh.num_positions_evicted
            cells -= sh.num_cells_evicted


# -- 1. generation: event order and usage -------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "image"])
@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_generation_events_in_order_with_consistent_usage(
    pair: str, kind: str, prep_servers, infer_server, detokenize
) -> None:
    server = infer_server(pair, ctx_size=1024)
    info = server_info(server.port)
    assert info.num_cells_per_slot == 1024 and info.uses_mrope == (pair == "mrope")
    assert info.can_shift == (pair == "rope")
    prompt = (
        text_prompt(prep_servers(pair)) if kind == "text" else chat_with_image(prep_servers(pair))
    )
    media = media_chunks(prompt)
    assert len(media) == (kind == "image")
    if kind == "image" and pair == "mrope":
        assert (media[0].num_cells, media[0].num_positions) == (64, 8)
        assert prompt.num_positions < prompt.num_cells
    before = info.stats

    s = run(server.port, make_request(prompt, max_tokens=40))

    n_prefill, n_delta = s.kinds.count("prefill"), s.kinds.count("delta")
    assert n_prefill >= 1 and n_delta >= 1
    assert s.kinds == ["started"] + ["prefill"] * n_prefill + ["delta"] * n_delta + ["finished"]
    st = s.started
    assert (st.slot, st.num_capacity_cells) == (0, 1024)
    assert (st.num_prompt_cells, st.num_prompt_positions) == (
        prompt.num_cells,
        prompt.num_positions,
    )
    assert (st.num_truncated_cells, st.num_truncated_chunks, list(st.truncated_media_ids)) == (
        0,
        0,
        [],
    )
    done = [p.num_cells_done for p in s.prefill]
    assert all(a < b for a, b in itertools.pairwise(done)), done
    assert done[-1] == prompt.num_cells
    assert {p.num_cells_total for p in s.prefill} == {prompt.num_cells}
    if kind == "image":  # the image is decoded in a step of its own: progress jumps by its cells
        steps = [b - a for a, b in zip([0, *done], done, strict=False)]
        assert media[0].num_cells in steps

    f = s.finished
    assert (f.reason, f.error, f.stop_string) == (LENGTH, "", "")
    u = f.usage
    assert u.num_generated_tokens == len(s.token_ids) == 40
    assert (u.num_prompt_cells, u.num_prompt_positions) == (prompt.num_cells, prompt.num_positions)
    assert (u.num_shifts, u.num_evicted_cells) == (0, 0)
    assert u.prefill_seconds > 0 and u.decode_seconds > 0
    assert s.text == detokenize(pair, s.token_ids)

    after = server_info(server.port)
    assert after.num_active == 0 and after.num_queued == 0
    assert after.stats.num_generated_tokens - before.num_generated_tokens == 40
    assert after.stats.num_media_decodes - before.num_media_decodes == len(media)
    assert after.stats.num_media_cache_misses - before.num_media_cache_misses == len(media)


# -- 2. determinism -----------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_greedy_and_seeded_sampling_are_deterministic(
    pair: str, prep_servers, infer_server
) -> None:
    server = infer_server(pair, ctx_size=512)
    prompt = chat_with_image(prep_servers(pair))
    streams: list[Stream] = []

    def ids(**sampling) -> list[int]:
        s = run(server.port, make_request(prompt, max_tokens=48, **sampling))
        assert_consistent(s, prompt)
        assert s.finished.error == "" and len(s.token_ids) > 0
        streams.append(s)
        return s.token_ids

    greedy = ids(temperature=0.0, **VARIED)
    assert ids(temperature=0.0, **VARIED) == greedy
    seeded = {seed: ids(temperature=0.8, seed=seed) for seed in (1, 2, 3)}
    assert ids(temperature=0.8, seed=2) == seeded[2]
    # the seed and the temperature matter: otherwise this test could not tell sampling apart
    assert len({tuple(v) for v in seeded.values()}) > 1
    assert all(v != greedy for v in seeded.values())
    # the first run decoded the whole prompt; the others found it in the slot (all but the last
    # token, which gives the first logits) and still produced the same tokens
    assert streams[0].started.num_reused_cells == 0
    assert [s.started.num_reused_cells for s in streams[1:]] == [prompt.num_cells - 1] * 5
    assert server_info(server.port).stats.num_media_decodes == 1


# -- 3. stop strings ----------------------------------------------------------------------------


def middle_substring(text: str, size: int = 3) -> str:
    """A substring from the middle of text, of plain characters, that first occurs after 0."""
    for i in range(len(text) // 2, len(text) - size):
        cand = text[i : i + size]
        if cand.isprintable() and "\ufffd" not in cand and text.find(cand) > 0:
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_stop_string_ends_generation_before_it(
    pair: str, prep_servers, infer_server, detokenize
) -> None:
    server = infer_server(pair, ctx_size=512)
    prompt = text_prompt(prep_servers(pair))
    no_end = {token_id(t): -100.0 for t in ("<|im_end|>", "<|endoftext|>")}  # 120 tokens, all
    req = make_request(prompt, max_tokens=120, **VARIED)
    req.logit_bias.update(no_end)
    full = run(server.port, req)
    assert full.finished.reason == LENGTH and len(full.token_ids) == 120
    # random bytes, invalid UTF-8 included: the streamed text is what one decode would give
    assert full.text == detokenize(pair, full.token_ids)
    assert "\ufffd" in full.text
    stop = middle_substring(full.text)
    expected = full.text[: full.text.find(stop)]

    req = make_request(prompt, max_tokens=120, stop=["\x00never", stop], **VARIED)
    req.logit_bias.update(no_end)
    s = run(server.port, req)

    f = s.finished
    assert (f.reason, f.stop_string, f.error) == (STOP, stop, "")
    assert s.text == expected
    n = len(s.token_ids)
    assert f.usage.num_generated_tokens == n < len(full.token_ids)
    assert s.token_ids == full.token_ids[:n]  # the same tokens, up to the one completing the stop
    assert stop not in s.text
    assert_consistent(s, prompt)


def test_earliest_of_several_stop_strings_wins(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=512)
    prompt = text_prompt(prep_servers("mrope"))
    full = run(server.port, make_request(prompt, max_tokens=120, **VARIED)).text
    late = middle_substring(full)
    early = middle_substring(full[: full.find(late)], size=2)
    assert full.find(early) < full.find(late)
    s = run(server.port, make_request(prompt, max_tokens=120, stop=[late, early], **VARIED))
    assert (s.finished.reason, s.finished.stop_string) == (STOP, early)
    assert s.text == full[: full.find(early)]


# -- 4. context shifts under a tight context ----------------------------------------------------


@pytest.mark.parametrize(
    ("pair", "policy", "used"),
    [
        pytest.param("mrope", AUTO, GAP, id="mrope-auto-is-gap"),
        pytest.param("rope", AUTO, SHIFT, id="rope-auto-is-shift"),
        # M-RoPE cannot seq_add (llama.cpp would abort): SHIFT resolves like AUTO there
        pytest.param("mrope", SHIFT, GAP, id="mrope-shift-is-gap"),
        pytest.param("mrope", REPREFILL, REPREFILL, id="mrope-reprefill"),
        pytest.param("rope", REPREFILL, REPREFILL, id="rope-reprefill"),
    ],
)
def test_long_generation_shifts_and_never_fails(
    pair: str, policy: int, used: int, prep_servers, infer_server
) -> None:
    server = infer_server(pair, ctx_size=256)
    cap = capacity(server.port)
    assert cap == 256
    prompt = chat_with_image(prep_servers(pair), "Describe this picture in a few words:")
    (image,) = media_chunks(prompt)
    assert 100 <= prompt.num_cells <= 140
    before = server_info(server.port).stats

    s = run(server.port, make_request(prompt, max_tokens=600, policy=policy))

    assert_consistent(s, prompt)
    f = s.finished
    assert (f.reason, f.error) == (LENGTH, "")
    assert f.usage.num_generated_tokens == len(s.token_ids) == 600
    assert s.shifts, "600 tokens in 256 cells cannot go without shifts"
    assert_shift_accounting(s, prompt, cap, used)
    assert f.usage.num_shifts == len(s.shifts)
    assert f.usage.num_evicted_cells == sum(sh.num_cells_evicted for sh in s.shifts)
    evicting = [sh for sh in s.shifts if image.media_id in sh.media_ids_evicted]
    assert len(evicting) == 1, "the image leaves exactly once"
    assert [m for sh in s.shifts for m in sh.media_ids_evicted] == [image.media_id]
    # it left as a whole unit: its cells (and the wrapper tokens) in one eviction
    assert evicting[0].num_cells_evicted >= image.num_cells
    if used == GAP:  # M-RoPE: the image's 64 cells take 8 positions
        ev = evicting[0]
        assert (
            ev.num_cells_evicted - ev.num_positions_evicted == image.num_cells - image.num_positions
        )
    after = server_info(server.port)
    assert after.num_active == 0
    assert after.stats.num_shifts - before.num_shifts == len(s.shifts)


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_stop_policy_fills_the_context_then_finishes_with_length(
    pair: str, prep_servers, infer_server
) -> None:
    server = infer_server(pair, ctx_size=256)
    cap = capacity(server.port)
    prompt = chat_with_image(prep_servers(pair), "Describe this picture in a few words:")
    s = run(server.port, make_request(prompt, max_tokens=600, policy=STOP_POLICY))
    assert_consistent(s, prompt)
    f = s.finished
    assert (f.reason, f.error) == (LENGTH, "")
    assert s.shifts == []
    n = len(s.token_ids)
    assert f.usage.num_generated_tokens == n
    # the cache ends exactly full (prompt + every generated token but the last, which never
    # needs a decode): cap - prompt + 1 tokens
    assert prompt.num_cells + (n - 1) == cap
    assert n == cap - prompt.num_cells + 1


def test_reprefill_decodes_a_kept_image_again_from_the_embedding_cache(
    prep_servers, infer_server
) -> None:
    server = infer_server("mrope", ctx_size=256)
    cap = capacity(server.port)
    img = image_bytes(IMAGE_SIDE, IMAGE_SIDE, seed=7)
    history = "an old message that goes first " * 3
    prompt = prepare(
        prep_servers("mrope"),
        messages=[message("user", history), message("user", img, "and this?")],
    )
    (image,) = media_chunks(prompt)
    before = server_info(server.port).stats
    req = make_request(prompt, max_tokens=400, policy=REPREFILL)
    req.context.discard_fraction = 0.1  # small evictions: the image survives a few reprefills

    s = run(server.port, req)

    assert_consistent(s, prompt)
    assert (s.finished.reason, s.finished.error) == (LENGTH, "")
    assert len(s.token_ids) == 400
    assert_shift_accounting(s, prompt, cap, REPREFILL)
    first_evicting = next(
        i for i, sh in enumerate(s.shifts) if image.media_id in sh.media_ids_evicted
    )
    assert first_evicting >= 1
    after = server_info(server.port).stats
    # each reprefill before the image left decoded it again, from the cache
    assert after.num_media_cache_hits - before.num_media_cache_hits == first_evicting
    assert after.num_media_cache_misses - before.num_media_cache_misses == 1
    assert after.num_media_decodes - before.num_media_decodes == 1 + first_evicting


# -- 5. the seed replay: a big M-RoPE image in a context budgeted by cells ----------------------


@pytest.mark.slow
def test_seed_replay_big_image_many_tokens(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=1792)
    cap = capacity(server.port)
    assert cap == 1792
    text = "Please look at this photograph closely and tell me what you see in it. " * 2
    prompt = prepare(
        prep_servers("mrope"),
        messages=[message("user", text, image_bytes(1288, 784), "Describe it in detail.")],
    )
    (image,) = media_chunks(prompt)
    assert (image.num_cells, image.num_positions) == (1288, 46)
    num_text = prompt.num_cells - image.num_cells
    assert 150 <= num_text <= 185, num_text
    # by positions (what n_past counts) the cache would look a seventh full
    assert prompt.num_positions < cap // 7 < prompt.num_cells

    s = run(server.port, make_request(prompt, max_tokens=1000, policy=AUTO))
    assert_consistent(s, prompt)
    f = s.finished
    assert (f.reason, f.error) == (LENGTH, "")
    assert f.usage.num_generated_tokens == len(s.token_ids) == 1000
    assert s.shifts
    assert_shift_accounting(s, prompt, cap, GAP)
    assert any(image.media_id in sh.media_ids_evicted for sh in s.shifts)

    s = run(server.port, make_request(prompt, max_tokens=1000, policy=STOP_POLICY))
    assert_consistent(s, prompt)
    f = s.finished
    assert (f.reason, f.error) == (LENGTH, "")
    assert s.shifts == []
    assert f.usage.num_generated_tokens == len(s.token_ids) == cap - prompt.num_cells + 1
    assert server_info(server.port).num_active == 0


# -- 6. concurrent streams ----------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["mrope", "rope"])
def test_four_concurrent_streams_batch_and_match_solo_runs(
    pair: str, prep_servers, infer_server
) -> None:
    server = infer_server(pair, ctx_size=2048, parallel=4)
    info = server_info(server.port)
    assert (info.num_slots, info.num_cells_per_slot) == (4, 512)
    port = prep_servers(pair)
    marker = media_marker(port)
    prompts = [
        text_prompt(port, "The quick brown fox"),  # 300 tokens on both pairs: long streams
        text_prompt(port, "Look at"),
        prepare(port, raw=f"{marker} Tell me about", images=[image_bytes(96, 96, seed=3)]),
        prepare(port, raw=f"{marker} What do you see", images=[image_bytes(96, 96, seed=4)]),
    ]
    requests = [make_request(p, max_tokens=300, **VARIED) for p in prompts]
    results: list[Stream | BaseException | None] = [None] * 4
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            barrier.wait(10)
            results[i] = run(server.port, requests[i])
        except BaseException as e:  # reported below
            results[i] = e

    before = info.stats
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    during = server_info(server.port)
    streams = []
    for prompt, r in zip(prompts, results, strict=True):
        assert isinstance(r, Stream), r
        assert_consistent(r, prompt)
        assert r.finished.reason in (LENGTH, STOP) and r.finished.error == ""
        assert len(r.token_ids) > 0
        streams.append(r)
    assert during.num_active == 0
    assert during.stats.num_multi_seq_decodes > before.num_multi_seq_decodes
    assert during.stats.num_generated_tokens - before.num_generated_tokens == sum(
        len(r.token_ids) for r in streams
    )
    assert len({tuple(r.token_ids) for r in streams}) == 4, "four prompts, four different outputs"

    # the same requests, one at a time, on a server of a single slot
    solo = infer_server(pair, ctx_size=512, parallel=1)
    for req, together in zip(requests, streams, strict=True):
        alone = run(solo.port, req)
        assert alone.started.num_reused_cells == 0
        assert alone.token_ids == together.token_ids
        assert alone.text == together.text
        assert alone.finished.reason == together.finished.reason
    assert server_info(solo.port).stats.num_multi_seq_decodes == 0


# -- 7. cancellation ----------------------------------------------------------------------------


def test_cancel_frees_the_slot(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=256, parallel=1)
    prompt = text_prompt(prep_servers("mrope"))
    with channel(server.port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        call = stub.Generate(make_request(prompt, max_tokens=500_000), timeout=60)
        deltas = 0
        for e in call:
            deltas += e.HasField("delta")
            if deltas == 3:
                break
        assert server_info(server.port).num_active == 1
        call.cancel()
        # the next request gets the only slot (the first would run for minutes otherwise)
        s = run(server.port, make_request(prompt, max_tokens=8), timeout=15)
    assert (s.finished.reason, len(s.token_ids)) == (LENGTH, 8)
    info = server_info(server.port)
    assert (info.num_active, info.num_queued) == (0, 0)
    assert_nothing_runs_on(server.port)


# -- 8. validation errors -----------------------------------------------------------------------


def assert_rpc_error(
    port: int,
    req: infer_pb2.GenerateRequest,
    code: Code,
    details: str,
    reason: str | None = None,
    **metadata: str,
) -> grpc.RpcError:
    """The call fails with code and details, and (when given) the google.rpc.ErrorInfo
    reason and metadata that grpcio-status reads back from the trailers."""
    err = rpc_error(lambda: run(port, req, timeout=30))
    assert (err.code(), err.details()) == (code, details)
    if reason is not None:
        info = error_info(err)
        assert info.reason == reason
        assert {k: info.metadata[k] for k in metadata} == metadata
    return err


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    raise AssertionError(f"no ErrorInfo in {status}")


def short(fp: prompt_pb2.Fingerprint) -> str:
    return f"{fp.model[:12]}/{fp.mmproj[:12] or '-'}"


def first_media_index(prompt: prompt_pb2.PreparedPrompt) -> int:
    return next(i for i, c in enumerate(prompt.chunks) if c.WhichOneof("kind") == "media")


def test_stale_descriptors_are_refused(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=512)
    port = server.port
    good = chat_with_image(prep_servers("mrope"))
    ours = server_info(port).fingerprint

    # prepared for another model pair
    foreign = chat_with_image(prep_servers("rope"))
    assert_rpc_error(
        port,
        make_request(foreign),
        Code.FAILED_PRECONDITION,
        f"prompt was prepared for model {short(foreign.fingerprint)} but this server runs "
        f"{short(ours)}",
    )
    assert_good_request_succeeds(port, good)

    # counts edited, totals kept consistent (so only re-tokenizing the pixels can tell)
    tampered = prompt_pb2.PreparedPrompt()
    tampered.CopyFrom(good)
    m = tampered.chunks[first_media_index(tampered)].media
    m.num_cells += 5
    m.num_positions += 1
    tampered.num_cells += 5
    tampered.num_positions += 1
    assert_rpc_error(
        port,
        make_request(tampered),
        Code.FAILED_PRECONDITION,
        f"media {m.media_id[:12]}: descriptor says {m.num_cells} cells / {m.num_positions} "
        f"positions, libmtmd says {m.num_cells - 5} / {m.num_positions - 1}",
    )
    assert_good_request_succeeds(port, good)

    # pixels of another size with a correct media_id, counts left from the original image
    small = prepare(prep_servers("mrope"), messages=[message("user", image_bytes(112, 112), "x")])
    (small_media,) = media_chunks(small)
    rgb = decode_image(image_bytes(112, 112))
    swapped = prompt_pb2.PreparedPrompt()
    swapped.CopyFrom(good)
    m = swapped.chunks[first_media_index(swapped)].media
    m.width, m.height, m.rgb = rgb.width, rgb.height, rgb.rgb
    m.media_id = media_id(rgb.width, rgb.height, rgb.rgb)
    assert (small_media.num_cells, small_media.num_positions) != (m.num_cells, m.num_positions)
    assert_rpc_error(
        port,
        make_request(swapped),
        Code.FAILED_PRECONDITION,
        f"media {m.media_id[:12]}: descriptor says {m.num_cells} cells / {m.num_positions} "
        f"positions, libmtmd says {small_media.num_cells} / {small_media.num_positions}",
    )
    assert_good_request_succeeds(port, good)

    # pixels that are not what media_id names
    forged = prompt_pb2.PreparedPrompt()
    forged.CopyFrom(good)
    m = forged.chunks[first_media_index(forged)].media
    px = rgb_of(m)
    m.rgb = bytes([px[0] ^ 0xFF]) + px[1:]
    assert_rpc_error(
        port,
        make_request(forged),
        Code.INVALID_ARGUMENT,
        f"media chunk {m.media_id!r}: media_id is not the hash of its pixels",
    )
    assert_good_request_succeeds(port, good)
    assert server_info(port).num_active == 0


def test_noncausal_image_larger_than_the_ubatch_is_refused(prep_servers, infer_server) -> None:
    port = prep_servers("noncausal")
    prompt = prepare(port, messages=[message("user", "look", image_bytes(96, 96), "now")])
    (image,) = media_chunks(prompt)
    assert image.num_cells == 64
    small = infer_server("noncausal", ctx_size=512, ubatch_size=32)
    assert server_info(small.port).ubatch_size == 32
    assert_rpc_error(
        small.port,
        make_request(prompt),
        Code.INVALID_ARGUMENT,
        f"media {image.media_id[:12]} has 64 cells; this projector attends non-causally so it "
        f"must fit one ubatch: start the server with --ubatch-size >= 64 (now 32)",
    )
    assert_good_request_succeeds(small.port, text_prompt(port))
    # the same image decodes where a ubatch holds it
    big = infer_server("noncausal", ctx_size=512, ubatch_size=64)
    assert_good_request_succeeds(big.port, prompt)


@pytest.fixture
def tight(prep_servers, infer_server):
    """An mrope server with 256 cells and a prompt of more: image first, long text after."""
    server = infer_server("mrope", ctx_size=256)
    assert capacity(server.port) == 256
    prompt = prepare(
        prep_servers("mrope"),
        messages=[
            message("user", image_bytes(IMAGE_SIDE, IMAGE_SIDE, seed=11), "first"),
            message("assistant", "A picture. " * 10),
            message("user", "Tell me more about it, with every detail you can find. " * 3),
        ],
    )
    assert prompt.num_cells + 1 - 256 > 120  # the excess reaches past the image
    return server, prompt


@pytest.mark.parametrize("policy", [STOP_POLICY, AUTO], ids=["stop", "auto"])
def test_prompt_that_cannot_fit_is_refused(policy: int, tight, prep_servers) -> None:
    server, prompt = tight
    # permanent, so not the transient RESOURCE_EXHAUSTED: INVALID_ARGUMENT with the numbers
    assert_rpc_error(
        server.port,
        make_request(prompt, policy=policy),
        Code.INVALID_ARGUMENT,
        f"needs {prompt.num_cells + 1} KV cells; the sequence holds 256, 0 of them pinned",
        "PROMPT_TOO_LONG",
        cells_needed=str(prompt.num_cells + 1),
        capacity="256",
    )
    # keep pins whole items: the first chunk (the text before the image)
    first = len(prompt.chunks[0].text.token_ids)
    assert first > 1
    assert_rpc_error(
        server.port,
        make_request(prompt, policy=policy, keep=1),
        Code.INVALID_ARGUMENT,
        f"needs {prompt.num_cells + 1} KV cells; the sequence holds 256, {first} of them pinned",
    )
    assert_good_request_succeeds(server.port, text_prompt(prep_servers("mrope")))


def test_truncate_prompt_drops_the_oldest_units(tight) -> None:
    server, prompt = tight
    (image,) = media_chunks(prompt)
    s = run(server.port, make_request(prompt, truncate_prompt=True, max_tokens=8))
    excess = prompt.num_cells + 1 - 256
    st = s.started
    assert st.num_truncated_cells == excess  # text is dropped token by token: exactly enough
    assert list(st.truncated_media_ids) == [image.media_id]
    # whole chunks before the cut, plus the head of the text chunk the cut falls in
    ends, total = [], 0
    for c in prompt.chunks:
        total += c.media.num_cells if c.WhichOneof("kind") == "media" else len(c.text.token_ids)
        ends.append(total)
    whole = sum(1 for e in ends if e <= excess)
    assert st.num_truncated_chunks == whole + (excess not in ends)
    assert st.num_prompt_cells == 255
    f = s.finished
    assert (f.reason, f.error, f.usage.num_generated_tokens) == (LENGTH, "", 8)
    assert f.usage.num_prompt_cells == 255
    assert [p.num_cells_total for p in s.prefill][-1] == 255


NAN = float("nan")


@pytest.mark.parametrize(
    ("field", "value", "details"),
    [
        ("top_p", 2.0, "sampling.top_p must be within [0.0, 1.0], got 2.0"),
        ("temperature", -1.0, "sampling.temperature must be within [0.0, 100.0], got -1.0"),
        ("temperature", NAN, "sampling.temperature must be within [0.0, 100.0], got nan"),
        ("min_p", NAN, "sampling.min_p must be within [0.0, 1.0], got nan"),
        ("top_k", -3, "sampling.top_k must be within [0, 1048576], got -3"),
        ("repeat_penalty", 0.0, "sampling.repeat_penalty must be within [0.001, 100.0], got 0.0"),
    ],
)
def test_bad_sampling_values_are_invalid(
    field: str, value: float, details: str, prep_servers, infer_server
) -> None:
    server = infer_server("rope", ctx_size=256)
    prompt = text_prompt(prep_servers("rope"))
    req = make_request(prompt)
    setattr(req.sampling, field, value)
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(getattr(req.sampling, field))
    assert_rpc_error(server.port, req, Code.INVALID_ARGUMENT, details)
    assert_good_request_succeeds(server.port, prompt)


def test_bad_requests_are_invalid(prep_servers, infer_server) -> None:
    server = infer_server("rope", ctx_size=256)
    prompt = text_prompt(prep_servers("rope"))

    req = make_request(prompt)
    req.context.policy = 99  # an enum value this server does not know
    assert_rpc_error(server.port, req, Code.INVALID_ARGUMENT, "unknown shift policy 99")
    req = make_request(prompt)
    req.context.unit = 7
    assert_rpc_error(server.port, req, Code.INVALID_ARGUMENT, "unknown eviction unit 7")
    req = make_request(prompt)
    req.context.discard_fraction = 1.5
    assert_rpc_error(
        server.port, req, Code.INVALID_ARGUMENT, "discard_fraction must be within [0, 1], got 1.5"
    )
    assert_rpc_error(
        server.port,
        make_request(prompt_pb2.PreparedPrompt()),
        Code.INVALID_ARGUMENT,
        "prompt has no chunks",
    )
    assert_good_request_succeeds(server.port, prompt)
    assert server_info(server.port).num_active == 0


def test_full_queue_is_resource_exhausted(prep_servers, infer_server) -> None:
    server = infer_server("mrope", ctx_size=256, parallel=1, max_queue=1)
    prompt = text_prompt(prep_servers("mrope"))
    with channel(server.port) as ch:
        stub = infer_pb2_grpc.InferServiceStub(ch)
        running = stub.Generate(make_request(prompt, max_tokens=500_000), timeout=60)
        try:
            assert next(running).HasField("started")
            queued = stub.Generate(make_request(prompt, max_tokens=5), timeout=60)
            wait_until(lambda: server_info(server.port).num_queued == 1)
            err = assert_rpc_error(
                server.port,
                make_request(prompt),
                Code.RESOURCE_EXHAUSTED,
                "all 1 slots are busy and 1 requests wait (queue limit 1); retry later",
                "QUEUE_FULL",
                queue_limit="1",
            )
            retry = error_details_pb2.RetryInfo()
            assert any(d.Unpack(retry) for d in rpc_status.from_call(err).details)
            assert retry.retry_delay.seconds >= 1
            # the place in the queue comes first: a request refused costs no image decoding
            # (a forged image would be FAILED_PRECONDITION once checked)
            forged = chat_with_image(prep_servers("mrope"))
            forged.chunks[first_media_index(forged)].media.num_cells += 5
            forged.num_cells += 5
            assert_rpc_error(
                server.port, make_request(forged), Code.RESOURCE_EXHAUSTED,
                "all 1 slots are busy and 1 requests wait (queue limit 1); retry later",
                "QUEUE_FULL",
            )  # fmt: skip
        finally:
            running.cancel()
        s = Stream(list(queued))  # the queued one gets the slot once the first is gone
    assert (s.finished.reason, len(s.token_ids)) == (LENGTH, 5)
    assert_good_request_succeeds(server.port, prompt)
    info = server_info(server.port)
    assert (info.num_active, info.num_queued) == (0, 0)


# -- 9. deadlines -------------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["deadline", "cancel"])
def test_a_request_ended_mid_prefill_frees_the_slot(prep_servers, infer_server, ending) -> None:
    """The client's deadline passes (or it cancels) while the engine is inside the prompt's
    second batch: no token comes, the rest of the prompt is never decoded, the slot is free."""
    server = infer_server("mrope", ctx_size=4096, batch_size=16, ubatch_size=16)
    port = prep_servers("mrope")
    prompt = text_prompt(port, "The quick brown fox jumps over the lazy dog. " * 90)
    num_batches = math.ceil(prompt.num_cells / 16)
    assert num_batches > 100
    engine = server.engine
    deadline = 1.0  # doubled until this machine reaches the prompt's second batch within it
    while True:
        before = idle_stats(server.port)
        seen: list[str] = []
        with PrefillHold(engine.runtime, at=2) as hold, channel(server.port) as ch:
            stub = infer_pb2_grpc.InferServiceStub(ch)
            timeout = deadline if ending == "deadline" else PATIENCE
            call = stub.Generate(make_request(prompt, max_tokens=4), timeout=timeout)
            with pytest.raises(grpc.RpcError) as err:
                for e in call:
                    seen.append(e.WhichOneof("event"))
                    if ending == "cancel" and seen[-1] == "prefill":
                        hold.held.wait(PATIENCE)
                        call.cancel()
            # the engine is held in the second batch, or the request ended before it
            wait_until(lambda: hold.held.is_set() or engine.slots[0].job is None)
            if not hold.held.is_set():
                deadline *= 2  # it expired before the second batch: try with more time
                assert ending == "deadline" and deadline < PATIENCE, seen
                continue
            held = engine.slots[0].job  # (stable: the engine thread is held)
            assert held is not None and not hold.released.is_set()
            ended = partial(lambda job: job.expired(time.monotonic()), held)
            wait_until(ended, what="the request marked ended")
        break
    code = Code.DEADLINE_EXCEEDED if ending == "deadline" else Code.CANCELLED
    assert err.value.code() == code
    assert seen[0] == "started" and "prefill" in seen
    assert "delta" not in seen and "finished" not in seen, seen
    after = idle_stats(server.port)
    # the batch in flight was the last: the other batches of the prompt were never decoded
    assert after.num_decodes - before.num_decodes == 2 < num_batches
    assert after.num_generated_tokens == before.num_generated_tokens
    assert_nothing_runs_on(server.port)
    assert_good_request_succeeds(server.port, text_prompt(port))
    assert server_info(server.port).num_active == 0


# -- 10. health and reflection ------------------------------------------------------------------


def test_health_serving_and_reflection_lists_the_service(infer_server) -> None:
    server = infer_server("rope", ctx_size=256)
    with channel(server.port) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        ]
        listed, described = list(refl.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    assert any(b"InferService" in f for f in files)


def test_stream_tokens_groups_deltas_without_changing_the_output(
    prep_servers, infer_server
) -> None:
    server = infer_server("rope", ctx_size=512)
    prompt = text_prompt(prep_servers("rope"), "A stream of tokens, grouped or not")
    every = run(server.port, make_request(prompt, max_tokens=200, temperature=0.0))
    req = make_request(prompt, max_tokens=200, temperature=0.0)
    req.stream_tokens = 4
    grouped = run(server.port, req)
    assert (grouped.token_ids, grouped.text) == (every.token_ids, every.text)
    sizes = [len(d.token_ids) for d in grouped.of("delta")]
    assert sum(sizes) == len(every.token_ids)
    # the first token goes alone, then groups of 4, the rest at the end; a reader slower than
    # the engine gets several of these merged into one message, never split
    head = sizes[:-1]
    assert not head or (head[0] % 4 == 1 and all(n % 4 == 0 for n in head[1:])), sizes
    assert len(sizes) <= 2 + math.ceil((len(every.token_ids) - 1) / 4)
    req.stream_tokens = 1000
    with pytest.raises(grpc.RpcError) as err:
        run(server.port, req)
    assert err.value.code() == Code.INVALID_ARGUMENT and "stream_tokens" in err.value.details()
