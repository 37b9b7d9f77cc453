"""The tiny GGUF pairs load and run in real llama.cpp / libmtmd (no mocks)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from PIL import Image

from slotwise_core.tiny_models import (
    ALL,
    CONTEXT_LENGTH,
    Text,
    TinyPair,
    main,
    write_text_model,
    write_tiny_models,
)

# read by ggml when it aborts: an abort must not start gdb
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

TEXT = M.MTMD_INPUT_CHUNK_TYPE_TEXT
IMAGE = M.MTMD_INPUT_CHUNK_TYPE_IMAGE


@L.llama_log_callback
def _no_log(level, text, user_data):  # kept referenced at module level: ctypes callback
    pass


@pytest.fixture(scope="session", autouse=True)
def _quiet_llama() -> None:
    L.llama_log_set(_no_log, ctypes.c_void_p())
    M.mtmd_helper_log_set(_no_log, ctypes.c_void_p())
    L.llama_backend_init()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyPair]:
    return write_tiny_models(tmp_path_factory.mktemp("tiny"))


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass
class Loaded:
    model: object
    ctx: object
    vocab: object
    mctx: object


@contextmanager
def loaded(pair: TinyPair, n_ctx: int = 512, n_ubatch: int | None = None) -> Iterator[Loaded]:
    model = L.llama_model_load_from_file(str(pair.model).encode(), L.llama_model_default_params())
    assert model, "llama_model_load_from_file failed"
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    if n_ubatch is not None:
        cp.n_ubatch = n_ubatch
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama_init_from_model failed"
    mp = M.mtmd_context_params_default()
    mp.use_gpu = False
    mp.print_timings = False
    mp.n_threads = 1
    mctx = M.mtmd_init_from_file(str(pair.mmproj).encode(), model, mp)
    assert mctx, "mtmd_init_from_file failed"
    try:
        yield Loaded(model, ctx, L.llama_model_get_vocab(model), mctx)
    finally:
        M.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(model)


def rgb_bitmap(width: int, height: int):
    img = Image.linear_gradient("L").resize((width, height))
    img = Image.merge("RGB", (img, img.transpose(Image.Transpose.FLIP_LEFT_RIGHT), img))
    data = img.tobytes()
    assert len(data) == width * height * 3
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = M.mtmd_bitmap_init(width, height, buf)
    assert bitmap
    return bitmap


@contextmanager
def tokenized(lo: Loaded, text: bytes, sizes: list[tuple[int, int]]):
    chunks = M.mtmd_input_chunks_init()
    bitmaps = [rgb_bitmap(w, h) for w, h in sizes]
    try:
        it = M.mtmd_input_text()
        it.text = text
        it.text_len = len(text)
        it.add_special = True
        it.parse_special = True
        arr = (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        assert M.mtmd_tokenize(lo.mctx, chunks, ctypes.byref(it), arr, len(bitmaps)) == 0
        yield chunks
    finally:
        for b in bitmaps:
            M.mtmd_bitmap_free(b)
        M.mtmd_input_chunks_free(chunks)


def chunk_list(chunks) -> list[tuple[str, int, int]]:
    out = []
    for i in range(M.mtmd_input_chunks_size(chunks)):
        c = M.mtmd_input_chunks_get(chunks, i)
        kind = {TEXT: "text", IMAGE: "image"}[M.mtmd_input_chunk_get_type(c)]
        out.append((kind, M.mtmd_input_chunk_get_n_tokens(c), M.mtmd_input_chunk_get_n_pos(c)))
    return out


def tokenize(vocab, text: bytes, add_special: bool = False) -> list[int]:
    buf = (L.llama_token * 256)()
    n = L.llama_tokenize(vocab, text, len(text), buf, 256, add_special, True)
    assert n >= 0
    return list(buf[:n])


def marker() -> bytes:
    return M.mtmd_default_marker()


# ---------------------------------------------------------------------------------------------
# generator


def test_deterministic(tmp_path: Path) -> None:
    a, b = (write_tiny_models(tmp_path / run) for run in ("a", "b"))
    assert list(a) == list(ALL)
    for name in ALL:
        assert a[name] == TinyPair(name, tmp_path / "a" / name / "model.gguf", a[name].mmproj)
        assert a[name].mmproj == tmp_path / "a" / name / "mmproj.gguf"
        assert a[name].model.read_bytes() == b[name].model.read_bytes()
        assert a[name].mmproj.read_bytes() == b[name].mmproj.read_bytes()


def test_a_wider_text_model_has_its_size_and_decodes(tmp_path: Path) -> None:
    size = Text(width=128, ff=384, layers=3, heads=8, kv_heads=2)
    path = write_text_model(tmp_path / "wide.gguf", size)
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    assert model, "llama_model_load_from_file failed"
    try:
        got = (
            L.llama_model_n_embd(model),
            L.llama_model_n_layer(model),
            L.llama_model_n_head(model),
        )
        assert got == (size.width, size.layers, size.heads)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = 64, 1, 1
        ctx = L.llama_init_from_model(model, cp)
        assert ctx
        try:
            tokens = (L.llama_token * 3)(104, 105, 33)
            assert L.llama_decode(ctx, L.llama_batch_get_one(tokens, 3)) == 0
            logits = np.ctypeslib.as_array(
                L.llama_get_logits_ith(ctx, -1),
                shape=(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)),),
            )
            assert np.isfinite(logits).all() and logits.std() > 0
        finally:
            L.llama_free(ctx)
    finally:
        L.llama_model_free(model)


def test_only_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--only", "rope"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rope:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rope"]
    assert (tmp_path / "rope" / "model.gguf").is_file()
    assert (tmp_path / "rope" / "mmproj.gguf").is_file()
    with pytest.raises(ValueError):
        write_tiny_models(tmp_path, ["nope"])


# ---------------------------------------------------------------------------------------------
# llama.cpp behaviour


@pytest.mark.parametrize(
    ("name", "mrope", "non_causal", "can_shift"),
    [
        ("mrope", True, False, False),
        ("rope", False, False, True),
        ("noncausal", False, True, True),
    ],
)
def test_capabilities(tiny, name, mrope, non_causal, can_shift) -> None:
    with loaded(tiny[name]) as lo:
        assert L.llama_model_n_ctx_train(lo.model) == CONTEXT_LENGTH
        assert L.llama_n_ctx(lo.ctx) == 512
        assert M.mtmd_support_vision(lo.mctx)
        assert M.mtmd_decode_use_mrope(lo.mctx) is mrope
        assert M.mtmd_decode_use_non_causal(lo.mctx, None) is non_causal
        assert L.llama_memory_can_shift(L.llama_get_memory(lo.ctx)) is can_shift


# The marker alone, one image: (kind, n_tokens, n_pos) per chunk. The text chunks are the
# wrapper tokens mtmd inserts around the image for that projector.
@pytest.mark.parametrize(
    ("name", "size", "expected"),
    [
        ("mrope", (1288, 784), [("text", 1, 1), ("image", 1288, 46), ("text", 1, 1)]),
        ("mrope", (448, 392), [("text", 1, 1), ("image", 224, 16), ("text", 1, 1)]),
        ("mrope", (224, 160), [("text", 1, 1), ("image", 48, 8), ("text", 1, 1)]),
        ("rope", (1288, 784), [("image", 64, 64)]),
        ("rope", (224, 160), [("image", 64, 64)]),
        ("noncausal", (1288, 784), [("text", 1, 1), ("image", 64, 64), ("text", 1, 1)]),
        ("noncausal", (224, 160), [("text", 1, 1), ("image", 64, 64), ("text", 1, 1)]),
    ],
)
def test_image_chunks(tiny, name, size, expected) -> None:
    with loaded(tiny[name]) as lo, tokenized(lo, marker(), [size]) as chunks:
        assert chunk_list(chunks) == expected


WRAPPERS = {
    "mrope": ("<|vision_start|>", "<|vision_end|>"),
    "noncausal": ("<start_of_image>", "<end_of_image>"),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrappers_are_control_tokens(tiny, name) -> None:
    with loaded(tiny[name]) as lo, tokenized(lo, marker(), [(224, 160)]) as chunks:
        for idx, text in ((0, WRAPPERS[name][0]), (2, WRAPPERS[name][1])):
            c = M.mtmd_input_chunks_get(chunks, idx)
            n = ctypes.c_size_t()
            toks = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
            assert n.value == 1
            assert [toks[0]] == tokenize(lo.vocab, text.encode())
            assert L.llama_vocab_get_attr(lo.vocab, toks[0]) & L.LLAMA_TOKEN_ATTR_CONTROL


# mrope: the 1288x784 image alone takes 1288 KV cells, so that pair needs a bigger context.
@pytest.mark.parametrize(
    ("name", "size", "n_ctx", "image"),
    [
        ("mrope", (1288, 784), 2048, ("image", 1288, 46)),
        ("rope", (640, 480), 512, ("image", 64, 64)),
        ("noncausal", (640, 480), 512, ("image", 64, 64)),
    ],
)
def test_eval_prompt_and_generate(tiny, name, size, n_ctx, image) -> None:
    prompt = b"describe " + marker() + b" please"
    with loaded(tiny[name], n_ctx=n_ctx) as lo, tokenized(lo, prompt, [size]) as chunks:
        listed = chunk_list(chunks)
        assert [c for c in listed if c[0] == "image"] == [image]
        assert [c[0] for c in listed] == ["text", "image", "text"]
        n_tokens = M.mtmd_helper_get_n_tokens(chunks)
        n_pos = M.mtmd_helper_get_n_pos(chunks)
        assert n_tokens == sum(c[1] for c in listed) <= L.llama_n_ctx(lo.ctx)
        assert n_pos == sum(c[2] for c in listed)
        if M.mtmd_decode_use_non_causal(lo.mctx, None):
            # the whole image must fit one ubatch, else llama.cpp aborts the process
            assert L.llama_n_ubatch(lo.ctx) >= image[1]

        new_n_past = L.llama_pos(0)
        rc = M.mtmd_helper_eval_chunks(
            lo.mctx, lo.ctx, chunks, 0, 0, L.llama_n_batch(lo.ctx), True, ctypes.byref(new_n_past)
        )
        assert rc == 0
        assert new_n_past.value == n_pos

        n_vocab = L.llama_vocab_n_tokens(lo.vocab)
        batch = L.llama_batch_init(1, 0, 1)
        try:
            pos = new_n_past.value
            for _ in range(4):
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(lo.ctx, -1), (n_vocab,))
                assert np.all(np.isfinite(logits))
                batch.n_tokens = 1
                batch.token[0] = int(np.argmax(logits))
                batch.pos[0] = pos
                batch.n_seq_id[0] = 1
                batch.seq_id[0][0] = 0
                batch.logits[0] = 1
                assert L.llama_decode(lo.ctx, batch) == 0
                pos += 1
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(lo.ctx, -1), (n_vocab,))
            assert np.all(np.isfinite(logits))
            mem = L.llama_get_memory(lo.ctx)
            assert L.llama_memory_seq_pos_max(mem, 0) == pos - 1
        finally:
            L.llama_batch_free(batch)


@pytest.mark.parametrize("name", ALL)
def test_chat_template_and_special_tokens(tiny, name) -> None:
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(tiny[name].model).encode(), mp)
    assert model
    try:
        vocab = L.llama_model_get_vocab(model)
        template = L.llama_model_chat_template(model, None)
        assert template
        prompt = Jinja2ChatFormatter(template.decode(), "<|im_end|>", "<|endoftext|>")(
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ]
        ).prompt
        assert prompt == (
            "<|im_start|>system\nbe brief<|im_end|>\n"
            "<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n"
        )

        special = {}
        for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"):
            ids = tokenize(vocab, text.encode())
            assert len(ids) == 1, (text, ids)
            assert L.llama_vocab_get_attr(vocab, ids[0]) & L.LLAMA_TOKEN_ATTR_CONTROL
            special[text] = ids[0]

        ids = tokenize(vocab, prompt.encode(), add_special=True)  # add_bos is false
        assert ids[0] == special["<|im_start|>"]
        assert ids.count(special["<|im_start|>"]) == 3
        assert ids.count(special["<|im_end|>"]) == 2
        assert L.llama_vocab_eos(vocab) == special["<|im_end|>"]
        assert L.llama_vocab_is_eog(vocab, special["<|im_end|>"])
        assert L.llama_vocab_bos(vocab) == special["<|endoftext|>"]
        assert 256 < L.llama_vocab_n_tokens(vocab) < 300
    finally:
        L.llama_model_free(model)
