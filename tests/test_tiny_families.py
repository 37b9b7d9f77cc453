"""The tiny pairs of newer families (audio: ultravox, qwen2a, ultravox8; 2026: qwen3vl, gemma4)
in real llama.cpp / libmtmd, no mocks: what they load as, and the counts libmtmd gives."""

from __future__ import annotations

import ctypes
import io
import math
import os
import subprocess
import sys
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from slotwise_core.native import free_model, load_model, quiet_native_logs
from slotwise_core.tiny_models import (
    ALL,
    AUDIO,
    BROKEN,
    FAMILIES_2026,
    HYBRID,
    TinyPair,
    main,
    token_id,
    write_tiny_models,
)

# read by ggml when it aborts: an abort must not start gdb
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

NEW = (*AUDIO, *FAMILIES_2026, *BROKEN)
N_EMBD = 64
RATE = 16_000
TEXT, IMAGE, AUDIO_CHUNK = (
    M.MTMD_INPUT_CHUNK_TYPE_TEXT,
    M.MTMD_INPUT_CHUNK_TYPE_IMAGE,
    M.MTMD_INPUT_CHUNK_TYPE_AUDIO,
)
MARKER = M.mtmd_default_marker().decode()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyPair]:
    return write_tiny_models(tmp_path_factory.mktemp("families"), NEW)


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass
class Loaded:
    model: int
    ctx: int
    vocab: int
    mctx: int


@contextmanager
def loaded(pair: TinyPair) -> Iterator[Loaded]:
    quiet_native_logs()
    model = load_model(pair.model, vocab_only=False)
    cp = L.llama_context_default_params()
    cp.n_ctx = 2048
    cp.n_batch = cp.n_ubatch = 1024  # a whole image or 30 s of audio in one ubatch
    cp.n_threads = cp.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, cp)
    mp = M.mtmd_context_params_default()
    mp.use_gpu = mp.print_timings = mp.warmup = False
    mp.n_threads = 2
    mctx = M.mtmd_init_from_file(str(pair.mmproj).encode(), model, mp)
    try:
        assert ctx, "llama_init_from_model failed"
        assert mctx, "mtmd_init_from_file failed"
        yield Loaded(model, ctx, L.llama_model_get_vocab(model), mctx)
    finally:
        if mctx:
            M.mtmd_free(mctx)
        if ctx:
            L.llama_free(ctx)
        free_model(model)


@pytest.fixture(scope="module")
def live(pairs: dict[str, TinyPair]) -> Iterator[dict[str, Loaded]]:
    with (
        loaded(pairs["ultravox"]) as u,
        loaded(pairs["qwen2a"]) as q,
        loaded(pairs["qwen3vl"]) as v,
        loaded(pairs["gemma4"]) as g,
    ):
        yield {"ultravox": u, "qwen2a": q, "qwen3vl": v, "gemma4": g}


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def wav(seconds: float) -> bytes:
    f = io.BytesIO()
    with wave.open(f, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((tone(seconds) * 32767).astype("<i2").tobytes())
    return f.getvalue()


def wav_bitmap(mctx: int, seconds: float) -> int:
    data = wav(seconds)
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = M.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(data), False)
    assert bitmap and M.mtmd_bitmap_is_audio(bitmap)
    return bitmap


def pcm_bitmap(seconds: float) -> int:
    pcm = tone(seconds)
    bitmap = M.mtmd_bitmap_init_from_audio(
        len(pcm), pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    )
    assert bitmap and M.mtmd_bitmap_is_audio(bitmap)
    return bitmap


def image_bitmap(width: int, height: int) -> int:
    rgb = np.random.default_rng(0).integers(0, 256, width * height * 3, dtype=np.uint8)
    bitmap = M.mtmd_bitmap_init(width, height, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    assert bitmap
    return bitmap


@dataclass(frozen=True)
class Chunk:
    kind: int
    n_tokens: int
    n_pos: int
    tokens: tuple[int, ...] = ()


@contextmanager
def tokenized(lo: Loaded, text: str, bitmap: int) -> Iterator[tuple[int, list[Chunk]]]:
    """Tokenize text with one media marker; yields the native chunks and what they hold."""
    chunks = M.mtmd_input_chunks_init()
    try:
        data = text.encode()
        inp = M.mtmd_input_text(data, len(data), False, True)
        array = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert M.mtmd_tokenize(lo.mctx, chunks, ctypes.byref(inp), array, 1) == 0
        M.mtmd_bitmap_free(bitmap)
        out = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            c = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(c)
            if kind == TEXT:
                n = ctypes.c_size_t(0)
                ptr = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                out.append(Chunk(kind, n.value, n.value, tuple(ptr[: n.value])))
            else:
                n_tok = M.mtmd_input_chunk_get_n_tokens(c)
                out.append(Chunk(kind, n_tok, M.mtmd_input_chunk_get_n_pos(c)))
        yield chunks, out
    finally:
        M.mtmd_input_chunks_free(chunks)


def counts(lo: Loaded, bitmap: int) -> list[Chunk]:
    """The chunks of one media item alone (the marker only): its wrapper text and media."""
    with tokenized(lo, MARKER, bitmap) as (_, out):
        return out


def media(chunks: list[Chunk]) -> list[tuple[int, int]]:
    return [(c.n_tokens, c.n_pos) for c in chunks if c.kind != TEXT]


def encode_all(lo: Loaded, chunks: int) -> list[int]:
    """Encode every media chunk; returns each one's token count after checking its output."""
    sizes = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        c = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(c) == TEXT:
            continue
        assert M.mtmd_encode_chunk(lo.mctx, c) == 0
        n = M.mtmd_input_chunk_get_n_tokens(c)
        embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(lo.mctx), shape=(n * N_EMBD,))
        assert np.isfinite(embd).all()
        sizes.append(n)
    return sizes


def eval_all(lo: Loaded, chunks: int) -> int:
    """Encode and decode everything into a fresh sequence 0; returns the new n_past."""
    L.llama_memory_clear(L.llama_get_memory(lo.ctx), True)
    n_past = L.llama_pos(0)
    rc = M.mtmd_helper_eval_chunks(lo.mctx, lo.ctx, chunks, 0, 0, 1024, True, ctypes.byref(n_past))
    assert rc == 0
    logits = L.llama_get_logits_ith(lo.ctx, -1)
    assert all(math.isfinite(logits[i]) for i in range(L.llama_vocab_n_tokens(lo.vocab)))
    return n_past.value


# ---------------------------------------------------------------------------------------------
# the files


def test_writes_are_deterministic_and_the_old_pairs_unchanged_by_the_new(tmp_path: Path) -> None:
    everything = (*ALL, *HYBRID, *NEW)
    a = write_tiny_models(tmp_path / "a", everything)
    b = write_tiny_models(tmp_path / "b", everything)
    old_alone = write_tiny_models(tmp_path / "c", (*ALL, *HYBRID))
    for name in everything:
        for f in ("model", "mmproj"):
            assert getattr(a[name], f).read_bytes() == getattr(b[name], f).read_bytes(), name
    for name in (*ALL, *HYBRID):
        for f in ("model", "mmproj"):
            assert getattr(a[name], f).read_bytes() == getattr(old_alone[name], f).read_bytes()


def test_new_names_are_written_only_when_named(tmp_path: Path) -> None:
    for name in NEW:
        assert name not in ALL and name not in HYBRID
    assert main([str(tmp_path), "--only", *NEW]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NEW)
    with pytest.raises(ValueError, match="ultravox8") as e:
        write_tiny_models(tmp_path, ["nope"])
    for name in (*ALL, *HYBRID, *NEW):
        assert name in str(e.value)
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--only", "nope"])


def test_own_wrapper_tokens_extend_the_shared_vocabulary(pairs: dict[str, TinyPair]) -> None:
    shared = load_model(pairs["ultravox"].model, vocab_only=True)
    own = {n: load_model(pairs[n].model, vocab_only=True) for n in ("qwen2a", "gemma4")}
    try:
        n_shared = L.llama_vocab_n_tokens(L.llama_model_get_vocab(shared))
        extra = {"qwen2a": ["<|audio_bos|>", "<|audio_eos|>"],
                 "gemma4": ["<|image>", "<image|>", "<|audio>", "<audio|>"]}  # fmt: skip
        for name, model in own.items():
            vocab = L.llama_model_get_vocab(model)
            assert L.llama_vocab_n_tokens(vocab) == n_shared + len(extra[name])
            assert L.llama_vocab_get_text(vocab, token_id("<|im_end|>")) == b"<|im_end|>"
            for i, piece in enumerate(extra[name]):
                assert L.llama_vocab_get_text(vocab, n_shared + i) == piece.encode()
    finally:
        for m in (shared, *own.values()):
            free_model(m)


# ---------------------------------------------------------------------------------------------
# text models and capabilities


@pytest.mark.parametrize(
    ("name", "vision", "audio", "mrope", "non_causal", "can_shift", "n_swa"),
    [
        ("ultravox", False, True, False, False, True, 0),
        ("qwen2a", False, True, False, False, True, 0),
        ("qwen3vl", True, False, True, False, False, 0),  # interleaved M-RoPE: no K-shift
        ("gemma4", True, True, False, True, True, 512),  # layer 0 slides over 512 tokens
        ("ultravox8", False, True, False, False, True, 0),
    ],
)
def test_loads_decodes_and_says_what_it_takes(
    pairs: dict[str, TinyPair], name: str, vision: bool, audio: bool, mrope: bool,
    non_causal: bool, can_shift: bool, n_swa: int,
) -> None:  # fmt: skip
    with loaded(pairs[name]) as lo:
        tokens = (L.llama_token * 4)(104, 101, 108, 108)
        assert L.llama_decode(lo.ctx, L.llama_batch_get_one(tokens, 4)) == 0
        logits = L.llama_get_logits_ith(lo.ctx, -1)
        assert all(math.isfinite(logits[i]) for i in range(L.llama_vocab_n_tokens(lo.vocab)))
        assert bool(M.mtmd_support_vision(lo.mctx)) is vision
        assert bool(M.mtmd_support_audio(lo.mctx)) is audio
        assert bool(M.mtmd_decode_use_mrope(lo.mctx)) is mrope
        assert bool(M.mtmd_decode_use_non_causal(lo.mctx, None)) is non_causal
        assert bool(L.llama_memory_can_shift(L.llama_get_memory(lo.ctx))) is can_shift
        assert L.llama_model_n_swa(lo.model) == n_swa
    if name == "qwen3vl":
        model = load_model(pairs[name].model, vocab_only=True)
        try:
            assert L.llama_model_rope_type(model) == L.LLAMA_ROPE_TYPE_IMROPE
        finally:
            free_model(model)


def test_gemma4_shifts_only_with_a_full_size_window_cache(pairs: dict[str, TinyPair]) -> None:
    """Its KV cache is two (full layers, sliding layers): K-shift needs both the same size, which
    swa_full (llama.cpp's default) gives; a window-sized sliding cache cannot shift."""
    model = load_model(pairs["gemma4"].model, vocab_only=False)
    try:
        for swa_full in (True, False):
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.swa_full = 2048, swa_full
            ctx = L.llama_init_from_model(model, cp)
            try:
                assert bool(L.llama_memory_can_shift(L.llama_get_memory(ctx))) is swa_full
            finally:
                L.llama_free(ctx)
    finally:
        free_model(model)


# ---------------------------------------------------------------------------------------------
# audio


# audio tokens per 30 s window (a shorter sound is padded to one; gemma4's is not) and the
# wrapper tokens libmtmd puts around the audio chunks
AUDIO_2S = {"ultravox": 94, "qwen2a": 750, "gemma4": 50}
AUDIO_35S = {"ultravox": [94, 94], "qwen2a": [750, 750], "gemma4": [750, 125]}
WRAPPERS = {
    "ultravox": None,
    "qwen2a": ("<|audio_bos|>", "<|audio_eos|>"),
    "gemma4": ("<|audio>", "<audio|>"),
}


def wrapped(lo: Loaded, chunks: list[Chunk], begin: str, end: str) -> None:
    assert chunks[0].kind == TEXT and chunks[-1].kind == TEXT
    pieces = [L.llama_vocab_get_text(lo.vocab, t).decode() for t in chunks[0].tokens]
    assert pieces == [begin]
    pieces = [L.llama_vocab_get_text(lo.vocab, t).decode() for t in chunks[-1].tokens]
    assert pieces == [end]


@pytest.mark.parametrize("name", ["ultravox", "qwen2a", "gemma4"])
def test_audio_counts(live: dict[str, Loaded], name: str) -> None:
    lo = live[name]
    n = AUDIO_2S[name]
    for bitmap in (wav_bitmap(lo.mctx, 2.0), pcm_bitmap(2.0)):  # a WAV file and raw PCM agree
        chunks = counts(lo, bitmap)
        assert media(chunks) == [(n, n)]  # n_pos == n_tokens: no M-RoPE compression
        assert [c.kind for c in chunks if c.kind != TEXT] == [AUDIO_CHUNK]
        if WRAPPERS[name] is None:
            assert len(chunks) == 1
        else:
            wrapped(lo, chunks, *WRAPPERS[name])
    # longer than 30 s: one audio chunk per window, one wrapper around them all
    chunks = counts(lo, wav_bitmap(lo.mctx, 35.0))
    assert media(chunks) == [(k, k) for k in AUDIO_35S[name]]
    if WRAPPERS[name] is not None:
        wrapped(lo, chunks, *WRAPPERS[name])
        assert len(chunks) == 4


@pytest.mark.parametrize("name", ["ultravox", "qwen2a", "gemma4"])
def test_audio_encodes_and_decodes(live: dict[str, Loaded], name: str) -> None:
    lo = live[name]
    with tokenized(lo, f"hi {MARKER} ok", wav_bitmap(lo.mctx, 2.0)) as (native, chunks):
        assert encode_all(lo, native) == [AUDIO_2S[name]]
        assert not M.mtmd_decode_use_non_causal(lo.mctx, M.mtmd_input_chunks_get(native, 1))
        assert eval_all(lo, native) == sum(c.n_pos for c in chunks)


_ENCODE_IN_A_CHILD = """
import ctypes, sys
import numpy as np
import llama_cpp as L
from llama_cpp import mtmd_cpp as M
from slotwise_core.native import load_model

model = load_model(__import__("pathlib").Path(sys.argv[1]), vocab_only=False)
mp = M.mtmd_context_params_default()
mp.use_gpu = mp.warmup = False
mctx = M.mtmd_init_from_file(sys.argv[2].encode(), model, mp)
pcm = np.zeros(32000, dtype=np.float32)
bitmap = M.mtmd_bitmap_init_from_audio(len(pcm), pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
chunks = M.mtmd_input_chunks_init()
marker = M.mtmd_default_marker()
inp = M.mtmd_input_text(marker, len(marker), False, True)
bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0
chunk = M.mtmd_input_chunks_get(chunks, 0)
print("tokens", M.mtmd_input_chunk_get_n_tokens(chunk), flush=True)
print("encode", M.mtmd_encode_chunk(mctx, chunk), flush=True)
"""


def test_ultravox8_tokenizes_187_then_encoding_aborts_the_process(
    pairs: dict[str, TinyPair],
) -> None:
    """Stack factor 8: libmtmd counts 3000 mel frames / 8 / 2 = 187 tokens, the encoder stacks
    the 1500 encoder frames into 188 and GGML_ABORTs. Never in this process."""
    pair = pairs["ultravox8"]
    with loaded(pair) as lo:
        chunks = counts(lo, pcm_bitmap(2.0))
        assert media(chunks) == [(187, 187)]
        assert media(counts(lo, wav_bitmap(lo.mctx, 35.0))) == [(187, 187), (187, 187)]
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    child = subprocess.run(
        [sys.executable, "-c", _ENCODE_IN_A_CHILD, str(pair.model), str(pair.mmproj)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert "tokens 187" in child.stdout
    assert "encode" not in child.stdout  # it never returned
    assert child.returncode != 0  # -6: SIGABRT
    assert "Invalid number of output tokens" in child.stderr


# ---------------------------------------------------------------------------------------------
# images


# (width, height) -> (cells, positions) of the one image chunk, and its wrapper tokens
IMAGES = {
    "qwen3vl": {(224, 224): (49, 7), (448, 336): (154, 14)},  # 32 px a cell, M-RoPE grid
    "gemma4": {(224, 224): (81, 81), (640, 480): (130, 130)},  # 48 px a cell, >= 70 cells
}
IMAGE_WRAPPERS = {
    "qwen3vl": ("<|vision_start|>", "<|vision_end|>"),
    "gemma4": ("<|image>", "<image|>"),
}


@pytest.mark.parametrize("name", ["qwen3vl", "gemma4"])
def test_image_counts_encode_and_decode(live: dict[str, Loaded], name: str) -> None:
    lo = live[name]
    for (w, h), (cells, positions) in IMAGES[name].items():
        chunks = counts(lo, image_bitmap(w, h))
        assert media(chunks) == [(cells, positions)]
        assert [c.kind for c in chunks] == [TEXT, IMAGE, TEXT]
        wrapped(lo, chunks, *IMAGE_WRAPPERS[name])
        with tokenized(lo, f"hi {MARKER} ok", image_bitmap(w, h)) as (native, described):
            image = M.mtmd_input_chunks_get(native, 1)
            # gemma4 (width 64, neither E2B's 1536 nor E4B's 2560): images decode non-causally
            assert bool(M.mtmd_decode_use_non_causal(lo.mctx, image)) is (name == "gemma4")
            assert encode_all(lo, native) == [cells]
            assert eval_all(lo, native) == sum(c.n_pos for c in described)
