"""The hybrid-memory tiny pairs (qwen35, lfm2) in real llama.cpp / libmtmd: what a hybrid model
answers, images through each projector, and the recurrent checkpoint llama-server builds on."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from slotwise_core.native import Bitmap, Multimodal, free_model, load_model, tokenize_text
from slotwise_core.tiny_models import ALL, HYBRID, TinyPair, main, write_tiny_models

# read by ggml when it aborts: an abort must not start gdb
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

PARTIAL = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyPair]:
    return write_tiny_models(tmp_path_factory.mktemp("hybrid"), HYBRID)


@pytest.fixture(scope="module")
def models(hybrid: dict[str, TinyPair]) -> Iterator[dict[str, int]]:
    loaded: dict[str, int] = {}
    try:
        for name, pair in hybrid.items():
            loaded[name] = load_model(pair.model, vocab_only=False)
        yield loaded
    finally:
        for model in loaded.values():
            free_model(model)


# ---------------------------------------------------------------------------------------------
# helpers


@contextmanager
def context(model: int, n_ctx: int = 512) -> Iterator[int]:
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama_init_from_model failed"
    try:
        yield ctx
    finally:
        L.llama_free(ctx)


def n_vocab(model: int) -> int:
    return int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))


def tokens(model: int, text: str) -> list[int]:
    vocab = L.llama_model_get_vocab(model)
    return tokenize_text(vocab, text, add_special=False, parse_special=True)


def decode(ctx: int, model: int, ids: list[int], pos: int) -> np.ndarray:
    """Decode ids in seq 0 from pos on; the last token's logits (a copy)."""
    batch = L.llama_batch_init(len(ids), 0, 1)
    try:
        batch.n_tokens = len(ids)
        for i, tok in enumerate(ids):
            batch.token[i] = tok
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        assert L.llama_decode(ctx, batch) == 0
    finally:
        L.llama_batch_free(batch)
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), (n_vocab(model),)).copy()


def greedy(ctx: int, model: int, logits: np.ndarray, pos: int, n: int) -> list[np.ndarray]:
    """n greedy steps from logits at pos: the logits of every step, the first included."""
    out = [logits]
    for i in range(n):
        out.append(decode(ctx, model, [int(np.argmax(out[-1]))], pos + i))
    return out


def save_partial(ctx: int) -> bytes:
    size = L.llama_state_seq_get_size_ext(ctx, 0, PARTIAL)
    assert size > 0
    buf = (ctypes.c_uint8 * size)()
    assert L.llama_state_seq_get_data_ext(ctx, buf, size, 0, PARTIAL) == size
    return bytes(buf)


def restore_partial(ctx: int, state: bytes) -> int:
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    return int(L.llama_state_seq_set_data_ext(ctx, buf, len(state), 0, PARTIAL))


def rgb(width: int, height: int) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1)
    return img.astype(np.uint8).tobytes()


# A (10 tokens), B, C: the checkpoint test's three parts (one token per ASCII byte here).
A, B, C = "abcdefghij", "klmnopqrstuv", "wxyz!?"


# ---------------------------------------------------------------------------------------------
# generator


def test_same_bytes_and_not_in_the_default(tmp_path: Path) -> None:
    a, b = (write_tiny_models(tmp_path / run, HYBRID) for run in ("a", "b"))
    assert list(a) == list(HYBRID)
    for name in HYBRID:
        assert a[name].model.read_bytes() == b[name].model.read_bytes()
        assert a[name].mmproj.read_bytes() == b[name].mmproj.read_bytes()
        assert a[name].model.stat().st_size < 2 << 20  # tiny: well under the "few MB"
    assert not set(HYBRID) & set(ALL)
    assert list(write_tiny_models(tmp_path / "default")) == list(ALL)


def test_cli_writes_hybrid_pairs_by_name(tmp_path: Path) -> None:
    assert main([str(tmp_path), "--only", "lfm2", "qwen35"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lfm2", "qwen35"]
    for name in HYBRID:
        assert (tmp_path / name / "model.gguf").is_file()
        assert (tmp_path / name / "mmproj.gguf").is_file()


# ---------------------------------------------------------------------------------------------
# what llama.cpp answers


@pytest.mark.parametrize(
    ("name", "can_shift", "mrope"), [("qwen35", False, True), ("lfm2", True, False)]
)
def test_hybrid_capabilities(hybrid, models, name, can_shift, mrope) -> None:
    model = models[name]
    assert L.llama_model_is_hybrid(model) is True
    assert L.llama_model_is_recurrent(model) is False
    assert L.llama_model_n_embd(model) == 64
    with context(model) as ctx:
        assert L.llama_memory_can_shift(L.llama_get_memory(ctx)) is can_shift
    mm = Multimodal(hybrid[name].mmproj, model, n_threads=1)
    try:
        assert mm.supports_vision and mm.uses_mrope is mrope and not mm.non_causal
    finally:
        mm.close()


# The marker alone, one image: (is_media, cells, positions) per chunk. qwen35's wrappers are
# <|vision_start|>/<|vision_end|>; the mlp projector has none.
@pytest.mark.parametrize(
    ("name", "size", "expected"),
    [
        ("qwen35", (448, 392), [(False, 1, 1), (True, 168, 14), (False, 1, 1)]),
        ("qwen35", (224, 160), [(False, 1, 1), (True, 35, 7), (False, 1, 1)]),
        ("lfm2", (448, 392), [(True, 64, 64)]),
        ("lfm2", (224, 160), [(True, 64, 64)]),
    ],
)
def test_image_counts(hybrid, models, name, size, expected) -> None:
    mm = Multimodal(hybrid[name].mmproj, models[name], n_threads=1)
    try:
        got = mm.media_group(Bitmap(*size))
    finally:
        mm.close()
    assert [(c.is_media, c.num_cells, c.num_positions) for c in got] == expected


@pytest.mark.parametrize("name", HYBRID)
def test_image_encodes_and_decodes(hybrid, models, name) -> None:
    model, (w, h) = models[name], (448, 392)
    mm = Multimodal(hybrid[name].mmproj, model, n_threads=2)
    try:
        prompt = f"describe {mm.marker} please"
        with (
            context(model) as ctx,
            mm.tokenize(prompt, [Bitmap(w, h, rgb(w, h))], add_special=False) as chunks,
        ):
            described = chunks.describe()
            (image,) = [i for i, c in enumerate(described) if c.is_media]
            n_cells, n_pos = described[image].num_cells, described[image].num_positions
            if name == "qwen35":
                assert n_cells > n_pos  # M-RoPE: the image advances positions less than cells
            assert M.mtmd_encode_chunk(mm.ctx, chunks.native(image)) == 0
            embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(mm.ctx), (n_cells * 64,))
            assert np.isfinite(embd).all() and embd.std() > 0

            new_n_past = L.llama_pos(0)
            rc = M.mtmd_helper_eval_chunks(
                mm.ctx,
                ctx,
                chunks.handle,
                0,
                0,
                L.llama_n_batch(ctx),
                True,
                ctypes.byref(new_n_past),
            )
            assert rc == 0
            assert new_n_past.value == sum(c.num_positions for c in described)
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), (n_vocab(model),))
            assert np.isfinite(logits).all()
            after = decode(ctx, model, [int(np.argmax(logits))], new_n_past.value)
            assert np.isfinite(after).all()
            assert L.llama_memory_seq_pos_max(L.llama_get_memory(ctx), 0) == new_n_past.value
    finally:
        mm.close()


@pytest.mark.parametrize("name", HYBRID)
def test_seq_rm_cannot_drop_the_tail(models, name) -> None:
    model = models[name]
    ids = tokens(model, "the quick brown fox jumps")
    assert len(ids) >= 20
    with context(model) as ctx:
        decode(ctx, model, ids, 0)
        mem, end = L.llama_get_memory(ctx), len(ids)
        # the recurrent state holds every token: its end cannot be taken back
        assert L.llama_memory_seq_rm(mem, 0, end - 6, -1) is False
        assert L.llama_memory_seq_rm(mem, 0, end - 1, -1) is False
        assert L.llama_memory_seq_pos_max(mem, 0) == end - 1  # (a refusal changes nothing)
        assert L.llama_memory_seq_rm(mem, 0, end, -1) is True  # nothing to remove
        assert L.llama_memory_seq_rm(mem, 0, -1, -1) is True  # the whole sequence
        assert L.llama_memory_seq_pos_max(mem, 0) == -1


@pytest.mark.parametrize("name", HYBRID)
def test_partial_state_checkpoint_restores_exactly(models, name) -> None:
    """llama-server's context checkpoint: save the recurrent part after A, go on with B, put the
    state back and drop B's KV cells; C then continues exactly as if B had never been."""
    model = models[name]
    a, b, c = tokens(model, A), tokens(model, B), tokens(model, C)
    assert len(a) == 10
    with context(model) as ctx:
        decode(ctx, model, a, 0)
        state = save_partial(ctx)
        decode(ctx, model, b, len(a))
        mem = L.llama_get_memory(ctx)
        assert L.llama_memory_seq_rm(mem, 0, len(a), -1) is False  # without the checkpoint
        assert restore_partial(ctx, state) != 0
        assert L.llama_memory_seq_rm(mem, 0, len(a), -1) is True
        assert L.llama_memory_seq_pos_max(mem, 0) == len(a) - 1
        got = greedy(ctx, model, decode(ctx, model, c, len(a)), len(a) + len(c), 8)
    with context(model) as ctx:
        decode(ctx, model, a, 0)
        want = greedy(ctx, model, decode(ctx, model, c, len(a)), len(a) + len(c), 8)
    assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in want]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)  # bit-exact: same batches, same cells

    # the control: B left in the recurrent state changes what follows
    with context(model) as ctx:
        decode(ctx, model, a + b, 0)
        polluted = decode(ctx, model, c, len(a) + len(b))
    assert np.abs(polluted - want[0]).max() > 1e-3
