"""KV cache types (--cache-type-k/v, --flash-attn): what llama.cpp refuses is refused at start
with its reason; the ledger counts cells whatever their type; a shift of a quantized K cache is
proven against a fresh prefill; a saved session loads only into a context of its types.

The tiny pairs' heads are 16 wide, which no quantized type's 32-value block divides: these
tests write a text model of one 64-wide head (the shared vocabulary, a llama graph)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from clients.client import NO_RETRY, Message, Policy, Shift, SlotwiseClient, collect
from infer_service.runner.cache_types import CacheTypeError, CacheTypes
from infer_service.runner.runtime import Runtime, RuntimeConfig
from slotwise_core.tiny_models import Text, write_text_model

F32 = CacheTypes("f32", "f32", "off")
F16 = CacheTypes()
Q8 = CacheTypes("q8_0", "q8_0", "on")
Q4 = CacheTypes("q4_0", "q4_0", "on")


@pytest.fixture(scope="module")
def head64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(
        tmp_path_factory.mktemp("kv") / "head64.gguf", Text(width=64, heads=1, kv_heads=1)
    )


@pytest.fixture(scope="module")
def head32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(
        tmp_path_factory.mktemp("kv") / "head32.gguf", Text(width=64, heads=2, kv_heads=2)
    )


def runtime(model: Path, types: CacheTypes, ctx_size: int = 256) -> Runtime:
    return Runtime(
        RuntimeConfig(
            model, None, ctx_size=ctx_size, threads=1, threads_batch=1, batch_size=256,
            ubatch_size=256, cache_types=types,
        )
    )  # fmt: skip


def test_what_llama_cpp_refuses_is_refused_with_its_reason(head64: Path, head32: Path) -> None:
    with pytest.raises(CacheTypeError, match=r"quantized V cache .* needs flash attention"):
        CacheTypes("f16", "q8_0", "off")
    with pytest.raises(CacheTypeError, match="one of f32, f16"):
        CacheTypes("q3_k", "f16")
    CacheTypes("q8_0", "f16", "off")  # a quantized K alone needs no flash attention
    with pytest.raises(CacheTypeError, match=r"blocks of 32 values.*head size \(16\)"):
        CacheTypes("q8_0").check_head_size(16)
    # llama.cpp rotates a quantized K through a Hadamard matrix it makes for heads of 64k only;
    # elsewhere its shift multiplies by a null tensor (a segfault, measured)
    assert Q8.shift_crashes(32) and not Q8.shift_crashes(64) and not F16.shift_crashes(32)


@pytest.mark.parametrize(("types", "ratio"), [(Q8, 34 / 64), (Q4, 18 / 64), (F32, 2.0)])
def test_a_cell_takes_the_bytes_of_its_type(head64: Path, types: CacheTypes, ratio: float) -> None:
    """Bytes a cell, read from llama.cpp's own state of one cell: q8_0 stores 32 values in 34
    bytes, q4_0 in 18, f16 in 64."""
    base = runtime(head64, F16)
    other = runtime(head64, types)
    try:
        assert base.bytes_per_cell == 2 * 2 * 64 * 2  # 2 layers, K and V, 64 values, 2 bytes
        assert other.bytes_per_cell == base.bytes_per_cell * ratio
        assert other.layout != base.layout  # a saved state of one never loads into the other
        assert other.can_shift
    finally:
        base.close()
        other.close()


def last_logits(rt: Runtime, tokens: list[int], pos: int) -> np.ndarray:
    rt.batch.clear()
    i = rt.batch.add(tokens, pos, 0, logits_last=True)
    assert rt.decode() == 0
    ptr = llama_cpp.llama_get_logits_ith(rt.ctx, i)
    return np.ctypeslib.as_array(ptr, shape=(rt.num_vocab,)).copy()


def shifted_and_fresh(model: Path, types: CacheTypes, keep: int = 8, n: int = 64):
    """The logits after 200 tokens, `n` of them evicted after the first `keep` and the rest
    moved back (seq_rm + seq_add: llama.cpp's K-shift), and those of a fresh prefill of what
    is kept."""
    tokens = [int(t) for t in np.random.default_rng(0).integers(10, 250, 200)]
    rt = runtime(model, types)
    try:
        last_logits(rt, tokens, 0)
        rt.seq_rm(0, keep, keep + n)
        rt.seq_add(0, keep + n, -n)
        shifted = last_logits(rt, [7], len(tokens) - n)
    finally:
        rt.close()
    rt = runtime(model, types)
    try:
        fresh = last_logits(rt, [*tokens[:keep], *tokens[keep + n :], 7], 0)
    finally:
        rt.close()
    return shifted, fresh


@pytest.mark.parametrize("types", [Q8, Q4, CacheTypes("q8_0", "f16", "on")], ids=str)
def test_a_shift_of_a_quantized_k_costs_no_more_than_its_quantization(
    head64: Path, types: CacheTypes
) -> None:
    """llama.cpp dequantizes a quantized K, rotates it and quantizes it again. Compared with
    the same shift on f32 cells, its logits differ by no more than twice what quantization
    alone costs a fresh prefill, plus what the shift costs f16 cells; greedy picks the same."""
    reference_shifted, reference_fresh = shifted_and_fresh(head64, F32)
    shifted, fresh = shifted_and_fresh(head64, types)
    half_shifted, _ = shifted_and_fresh(head64, F16)
    quantization = np.abs(fresh - reference_fresh).max()
    f16_shift = np.abs(half_shifted - reference_shifted).max()
    assert 0 < quantization < 0.05
    assert np.abs(shifted - reference_shifted).max() <= 2 * quantization + f16_shift
    assert shifted.argmax() == reference_shifted.argmax()


@pytest.fixture
def serve(loop_thread) -> Iterator[Any]:
    from infer_service.__main__ import start
    from prep_service.__main__ import start as start_prep

    started: list[Any] = []

    def open_server(model: Path, types: CacheTypes, **options: Any) -> SlotwiseClient:
        config = RuntimeConfig(model, None, ctx_size=256, threads=1, cache_types=types)
        running = loop_thread.run(start(config, **options))
        prep = loop_thread.run(start_prep(model, None, chat_template="chatml"))
        started.extend([running, prep])
        open_server.infer = running  # type: ignore[attr-defined]
        return SlotwiseClient(f"127.0.0.1:{prep.port}", f"127.0.0.1:{running.port}", retry=NO_RETRY)

    yield open_server
    for r in started:
        loop_thread.run(r.stop(0))


def test_a_quantized_cache_serves_past_its_context_and_says_what_it_is(
    serve, head64: Path, head32: Path
) -> None:
    with serve(head64, Q8) as client:
        info = client.server_info()
        assert (info.cache_type_k, info.cache_type_v, info.flash_attn) == ("q8_0", "q8_0", "on")
        assert info.num_bytes_per_cell == 2 * 2 * 68 and info.can_shift
        chat = [Message.user("Tell me a long story.")]
        shifts: list[Shift] = []
        done = collect(
            client.chat(chat, max_tokens=600, temperature=0, policy=Policy.SHIFT),
            lambda e: shifts.append(e) if isinstance(e, Shift) else None,
        )
        assert done.finished.error == "" and done.finished.usage.num_generated_tokens == 600
        assert shifts and all(sh.policy is Policy.SHIFT for sh in shifts)
        # STOP: the ledger's last cell is llama.cpp's last cell, whatever the cells' type
        stopped = collect(client.chat(chat, max_tokens=600, temperature=0, policy=Policy.STOP))
        usage = stopped.finished.usage
        # (the last token sampled is never decoded: it takes no cell)
        assert usage.num_prompt_cells + usage.num_generated_tokens - 1 == info.num_cells_per_slot
        assert stopped.finished.reason.value == "length"
    # heads of 32: a shift would crash llama.cpp, so none happens (GAP and REPREFILL move no
    # cell), whatever the request asks
    with serve(head32, CacheTypes("q8_0", "f16", "on")) as client:
        assert not client.server_info().can_shift
        for policy in (Policy.AUTO, Policy.SHIFT):
            events: list[Any] = []
            done = collect(
                client.chat(chat, max_tokens=400, temperature=0, policy=policy), events.append
            )
            shifts = [e for e in events if isinstance(e, Shift)]
            assert done.finished.error == "" and shifts
            assert all(sh.policy in (Policy.GAP, Policy.REPREFILL) for sh in shifts), shifts[0]


def test_a_session_saved_with_one_cache_type_is_decoded_again_under_another(
    serve, head64: Path, tmp_path: Path
) -> None:
    sent = [Message.user("Remember this.")]
    with serve(head64, Q8, sessions_dir=tmp_path) as client:
        client.create_session("kept")
        prepared = client.prepare(sent)
        done = collect(client.generate(prepared, session_id="kept", max_tokens=8, temperature=0))
        assert done.finished.saved
    with serve(head64, F16, sessions_dir=tmp_path) as client:
        sent = [*sent, Message.assistant(done.text or "."), Message.user("And now?")]
        prepared = client.prepare(sent, first_message=1)
        again = collect(client.generate(prepared, session_id="kept", max_tokens=8, temperature=0))
        assert again.finished.error == "" and again.finished.saved
        # the q8_0 state was not loaded into f16 cells: the session was decoded again
        assert serve.infer.engine.stats.num_session_reprefills == 1
