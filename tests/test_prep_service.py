"""prep_service end to end: real gRPC servers on loopback, real llama.cpp + libmtmd on the tiny
generated pairs, real images made with Pillow. Every count is checked against libmtmd itself."""

from __future__ import annotations

import asyncio
import io
import random
import shutil
import socket
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from gguf import GGUFReader
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import ExifTags, Image, ImageOps

from prep_service.__main__ import SERVICE, start
from prep_service.service import Limits
from slotwise.v1 import prep_pb2, prep_pb2_grpc
from slotwise_core import model_files, native
from slotwise_core.images import media_id
from slotwise_core.model_files import ModelMismatchError
from slotwise_core.tiny_models import ALL, TinyPair
from support.loop import LoopThread
from support.media import image_bytes
from support.procs import free_port
from support.rpc import rgb_of

MARKER = "<__media__>"
IA = grpc.StatusCode.INVALID_ARGUMENT
WRAPPERS = {  # the text libmtmd puts around one image, per pair
    "mrope": ("<|vision_start|>", "<|vision_end|>"),
    "rope": None,
    "noncausal": ("<start_of_image>", "<end_of_image>"),
}

# -- request builders ---------------------------------------------------------------------------


def text(s: str) -> prep_pb2.Part:
    return prep_pb2.Part(text=s)


def data(b: bytes) -> prep_pb2.Image:
    return prep_pb2.Image(data=b)


def size(w: int, h: int) -> prep_pb2.Image:
    return prep_pb2.Image(size=prep_pb2.ImageSize(width=w, height=h))


def image(im: prep_pb2.Image | bytes) -> prep_pb2.Part:
    return prep_pb2.Part(image=data(im) if isinstance(im, bytes) else im)


def msg(role: str, *parts: prep_pb2.Part) -> prep_pb2.Message:
    return prep_pb2.Message(role=role, parts=list(parts))


def chat(*messages: prep_pb2.Message, count: bool = False) -> Any:
    cls = prep_pb2.CountTokensRequest if count else prep_pb2.PrepareRequest
    return cls(chat=prep_pb2.Chat(messages=list(messages)))


def raw(
    s: str, *images: prep_pb2.Image | bytes, add_special: bool = False, count: bool = False
) -> Any:
    cls = prep_pb2.CountTokensRequest if count else prep_pb2.PrepareRequest
    ims = [data(i) if isinstance(i, bytes) else i for i in images]
    return cls(raw=prep_pb2.RawPrompt(text=s, images=ims, add_special=add_special))


def as_count(req: prep_pb2.PrepareRequest) -> prep_pb2.CountTokensRequest:
    return prep_pb2.CountTokensRequest.FromString(req.SerializeToString())  # same field numbers


# -- images and references ----------------------------------------------------------------------


def encode(img: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def noise(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    n = width * height * len(mode)
    return Image.frombytes(mode, (width, height), random.Random(seed).randbytes(n))


def solid_png(width: int, height: int, seed: int) -> bytes:
    """Cheap to encode and decode at any size; the colour makes each seed's pixels unique."""
    r = random.Random(seed)
    colour = (r.randrange(256), r.randrange(256), r.randrange(256))
    return encode(Image.new("RGB", (width, height), colour), "PNG", compress_level=1)


def pillow_decode(b: bytes) -> tuple[int, int, bytes]:
    """Pillow's own decode (first frame, EXIF applied): the reference for opaque images."""
    with Image.open(io.BytesIO(b)) as img:
        rgb = (ImageOps.exif_transpose(img) or img).convert("RGB")
        return rgb.width, rgb.height, rgb.tobytes()


def bilevel_png(width: int, height: int) -> bytes:
    """A valid all-black 1-bit PNG built by hand: kilobytes on disk, gigapixels in memory."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    row = bytes(1 + (width + 7) // 8)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# -- reading responses --------------------------------------------------------------------------


def summary(chunks: Any) -> list[tuple[int, int, bool, int, int]]:
    """(message_index, media_group, is_media, cells, positions) of Prepare or CountTokens chunks."""
    out = []
    for c in chunks:
        if isinstance(c, prep_pb2.ChunkCount):
            out.append((c.message_index, c.media_group, c.is_media, c.num_cells, c.num_positions))
        elif c.HasField("media"):
            m = c.media
            out.append((c.message_index, c.media_group, True, m.num_cells, m.num_positions))
        else:
            n = len(c.text.token_ids)
            out.append((c.message_index, c.media_group, False, n, n))
    return out


def stream(chunks: Any) -> list[tuple[Any, ...]]:
    """Chunk boundaries erased: every text token, and (cells, positions) of each media chunk."""
    out: list[tuple[Any, ...]] = []
    for c in chunks:
        if isinstance(c, native.RawChunk):
            if c.is_media:
                out.append(("media", c.num_cells, c.num_positions))
            else:
                out.extend(("token", t) for t in c.token_ids)
        elif c.HasField("media"):
            out.append(("media", c.media.num_cells, c.media.num_positions))
        else:
            out.extend(("token", t) for t in c.text.token_ids)
    return out


def media(resp: prep_pb2.PrepareResponse) -> list[Any]:
    return [c for c in resp.prompt.chunks if c.HasField("media")]


def assert_totals(prompt: Any) -> None:
    s = summary(prompt.chunks)
    assert prompt.num_cells == sum(c[3] for c in s)
    assert prompt.num_positions == sum(c[4] for c in s)


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def stub(
    prep_servers: Callable[[str], int], channel_to: Callable[[int], grpc.Channel]
) -> Callable[[str], prep_pb2_grpc.PrepServiceStub]:
    return lambda name: prep_pb2_grpc.PrepServiceStub(channel_to(prep_servers(name)))


class Native:
    """The same tokenization done directly with libmtmd: the reference for every count."""

    def __init__(self, pair: TinyPair):
        self.model = native.load_model(pair.model, vocab_only=True)
        self.vocab = native.llama_cpp.llama_model_get_vocab(self.model)
        self.mtmd = native.Multimodal(pair.mmproj, self.model, n_threads=1)

    def close(self) -> None:
        self.mtmd.close()
        native.free_model(self.model)

    def special(self, s: str) -> int:
        tokens = native.tokenize_text(self.vocab, s, add_special=False, parse_special=True)
        assert len(tokens) == 1, f"{s!r} is not one special token: {tokens}"
        return tokens[0]

    def piece(self, token: int) -> str:
        return native.token_piece(self.vocab, token).decode()


@pytest.fixture(scope="module")
def natives(tiny: dict[str, TinyPair]) -> Iterator[dict[str, Native]]:
    loaded = {name: Native(tiny[name]) for name in ALL}
    yield loaded
    for n in loaded.values():
        n.close()


def patched_copy(src: Path, dst: Path, key: str, value: Any) -> Path:
    """Copy a GGUF file and overwrite one scalar metadata value in place."""
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()  # the reader is a writable memmap of the file
    assert GGUFReader(dst).fields[key].contents() == value
    return dst


@pytest.fixture(scope="module")
def bos_model(tiny: dict[str, TinyPair], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mrope text model with tokenizer.ggml.add_bos_token = true."""
    d = tmp_path_factory.mktemp("bos")
    return patched_copy(tiny["mrope"].model, d / "model.gguf", "tokenizer.ggml.add_bos_token", True)


@pytest.fixture(scope="module")
def extra_servers(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], bos_model: Path
) -> Iterator[Callable[[str], int]]:
    """Servers with unusual settings, started on first use: text_only, limited, bos."""
    mrope = tiny["mrope"]
    configs = {
        "text_only": lambda: start(mrope.model, None),
        "limited": lambda: start(
            mrope.model,
            mrope.mmproj,
            limits=Limits(max_side=100, max_images=3),
            max_message_bytes=64 << 10,
        ),
        "bos": lambda: start(bos_model, mrope.mmproj),
    }
    running: dict[str, Any] = {}

    def port_of(name: str) -> int:
        if name not in running:
            running[name] = loop_thread.run(configs[name]())
        return int(running[name].port)

    yield port_of
    for r in running.values():
        loop_thread.run(r.stop(0))


def good_request_works(s: prep_pb2_grpc.PrepServiceStub) -> None:
    """After a refused call the same server still prepares an image prompt."""
    resp = s.Prepare(raw(f"look {MARKER}", image_bytes(56, 56, seed=99)), timeout=30)
    assert [c.media.width for c in media(resp)] == [56]
    assert resp.rendered_text == f"look {MARKER}"


# -- model info ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_model_info(name: str, stub, tiny: dict[str, TinyPair]) -> None:
    info = stub(name).GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info
    fp = model_files.fingerprint(tiny[name].model, tiny[name].mmproj)
    assert (info.fingerprint.model, info.fingerprint.mmproj) == (fp.model, fp.mmproj)
    assert info.media_marker == MARKER
    assert info.uses_mrope == (name == "mrope")
    assert info.media_non_causal == (name == "noncausal")
    assert info.supports_vision and not info.supports_audio
    assert (info.n_ctx_train, info.num_vocab) == (4096, 271)
    assert info.has_chat_template
    assert info.model_description.startswith("slotwise-tiny-")


# -- counts are libmtmd's -----------------------------------------------------------------------


def two_image_chat(first: prep_pb2.Image, second: prep_pb2.Image, count: bool = False) -> Any:
    return chat(
        msg("system", text("You are terse.")),
        msg("user", text("Look at "), image(first), text(" and tell me.")),
        msg("assistant", text("A cat.")),
        msg("user", image(second), text("And this?")),
        count=count,
    )


@pytest.mark.parametrize("name", ALL)
def test_prepare_counts_equal_libmtmds(name: str, stub, natives: dict[str, Native]) -> None:
    big, small = image_bytes(1288, 784, seed=1), image_bytes(300, 200, seed=2)
    s = stub(name)
    resp = s.Prepare(two_image_chat(data(big), data(small)), timeout=30)
    assert resp.rendered_text.count(MARKER) == 2
    bitmaps = [native.Bitmap(*pillow_decode(b)) for b in (big, small)]
    reference = natives[name].mtmd.count(resp.rendered_text, bitmaps, add_special=True)
    assert stream(resp.prompt.chunks) == stream(reference)
    assert resp.prompt.num_cells == sum(c.num_cells for c in reference)
    assert resp.prompt.num_positions == sum(c.num_positions for c in reference)
    assert_totals(resp.prompt)
    # CountTokens, given only the sizes, says the same chunk by chunk
    counted = s.CountTokens(two_image_chat(size(1288, 784), size(300, 200), count=True))
    assert summary(counted.chunks) == summary(resp.prompt.chunks)
    assert (counted.num_cells, counted.num_positions) == (
        resp.prompt.num_cells,
        resp.prompt.num_positions,
    )


@pytest.mark.parametrize(
    ("name", "cells", "positions"),
    [("mrope", 1288, 46), ("rope", 64, 64), ("noncausal", 64, 64)],
)
def test_one_image_is_one_group(
    name: str, cells: int, positions: int, stub, natives: dict[str, Native]
) -> None:
    resp = stub(name).Prepare(
        raw(f"before {MARKER} after", image_bytes(1288, 784, seed=3)), timeout=30
    )
    chunks = list(resp.prompt.chunks)
    group = [c for c in chunks if c.media_group == 1]
    [m] = media(resp)
    assert (m.media.num_cells, m.media.num_positions) == (cells, positions)
    assert m.media_group == 1
    wrappers = WRAPPERS[name]
    if wrappers is None:
        assert group == [m]
    else:
        # the wrapper tokens are chunks of their own, in the image's group and message
        start_id, end_id = (natives[name].special(w) for w in wrappers)
        assert summary(group) == [
            (0, 1, False, 1, 1),
            (0, 1, True, cells, positions),
            (0, 1, False, 1, 1),
        ]
        assert list(group[0].text.token_ids) == [start_id]
        assert list(group[2].text.token_ids) == [end_id]
    # the plain text around the group is exactly "before " and " after", wrappers cut out
    text_outside = [
        "".join(natives[name].piece(t) for t in c.text.token_ids)
        for c in chunks
        if c.media_group == 0
    ]
    assert text_outside == ["before ", " after"]
    assert [c.media_group for c in chunks] == [0, *[1] * len(group), 0]


@pytest.mark.parametrize("name", ALL)
def test_adjacent_images_keep_their_own_groups(name: str, stub, natives: dict[str, Native]) -> None:
    first, second = image_bytes(100, 80, seed=21), image_bytes(80, 100, seed=22)
    resp = stub(name).Prepare(
        chat(msg("user", image(first), image(second)), msg("user", image(first))), timeout=30
    )
    chunks = list(resp.prompt.chunks)
    bitmaps = [native.Bitmap(*pillow_decode(b)) for b in (first, second, first)]
    reference = natives[name].mtmd.count(resp.rendered_text, bitmaps, add_special=True)
    assert stream(chunks) == stream(reference)
    per_group = 3 if WRAPPERS[name] else 1
    for group, message in ((1, 0), (2, 0), (3, 1)):
        members = [c for c in chunks if c.media_group == group]
        assert len(members) == per_group
        assert {c.message_index for c in members} == {message}
        at = chunks.index(members[0])
        assert chunks[at : at + per_group] == members  # contiguous
        if WRAPPERS[name]:
            start_id, end_id = (natives[name].special(w) for w in WRAPPERS[name])
            assert list(members[0].text.token_ids) == [start_id]
            assert members[1].HasField("media")
            assert list(members[2].text.token_ids) == [end_id]
    # the same pixels twice: one media_id, two groups
    ids = [m.media.media_id for m in media(resp)]
    assert ids[0] == ids[2] != ids[1]


SIZES = [(1, 1), (1, 2000), (2000, 1), (2000, 2000), (1288, 784), (27, 28), (29, 57)]
_rng = random.Random(20240611)
SIZES += [(_rng.randint(1, 2000), _rng.randint(1, 2000)) for _ in range(12)]
SIZES += [(_rng.randint(1, 400), _rng.randint(1, 400)) for _ in range(6)]


def test_count_by_size_equals_prepare_by_pixels(stub) -> None:
    s = stub("mrope")
    seen = set()
    for i, (w, h) in enumerate(SIZES):
        prepared = s.Prepare(raw(MARKER, solid_png(w, h, seed=i)), timeout=30)
        counted = s.CountTokens(raw(MARKER, size(w, h), count=True), timeout=30)
        assert summary(counted.chunks) == summary(prepared.prompt.chunks), (w, h)
        assert (counted.num_cells, counted.num_positions) == (
            prepared.prompt.num_cells,
            prepared.prompt.num_positions,
        ), (w, h)
        [m] = media(prepared)
        assert (m.media.width, m.media.height, len(rgb_of(m.media))) == (w, h, w * h * 3)
        seen.add((m.media.num_cells, m.media.num_positions))
    assert len(SIZES) >= 20
    assert len(seen) >= 10, f"the sizes should exercise many different counts: {seen}"
    assert (1288, 46) in seen


# -- chat templates and raw prompts -------------------------------------------------------------


def test_chat_template_rendering_and_message_indexes(stub, natives: dict[str, Native]) -> None:
    picture = image_bytes(640, 480, seed=5)
    messages = [
        msg("system", text("You are terse.")),
        msg("user", text("Look at "), image(picture), text(" and tell me.")),
        msg("assistant", text("A cat.")),
        msg("user", text("Thanks!")),
    ]
    resp = stub("mrope").Prepare(chat(*messages), timeout=30)
    pieces = [
        "<|im_start|>system\nYou are terse.<|im_end|>\n",
        f"<|im_start|>user\nLook at {MARKER} and tell me.<|im_end|>\n",
        "<|im_start|>assistant\nA cat.<|im_end|>\n",
        "<|im_start|>user\nThanks!<|im_end|>\n",
        "<|im_start|>assistant\n",  # the generation prompt: message index len(messages)
    ]
    assert resp.rendered_text == "".join(pieces)
    # Rebuild each message's text from its chunks (an image group reads as the marker)
    n = natives["mrope"]
    rebuilt = [""] * len(pieces)
    for c in resp.prompt.chunks:
        if c.HasField("media"):
            rebuilt[c.message_index] += MARKER
        elif c.media_group == 0:
            rebuilt[c.message_index] += "".join(n.piece(t) for t in c.text.token_ids)
    assert rebuilt == pieces
    indexes = [c.message_index for c in resp.prompt.chunks]
    assert indexes == sorted(indexes) and indexes[-1] == len(messages)
    assert {c.message_index for c in resp.prompt.chunks if c.media_group == 1} == {1}
    assert_totals(resp.prompt)
    counted = stub("mrope").CountTokens(as_count(chat(*messages)), timeout=30)
    assert (counted.num_cells, counted.num_positions) == (
        resp.prompt.num_cells,
        resp.prompt.num_positions,
    )
    assert counted.num_cells == sum(c.num_cells for c in counted.chunks)
    assert counted.num_positions == sum(c.num_positions for c in counted.chunks)


def test_raw_prompt_images_fill_markers_in_order(stub, natives: dict[str, Native]) -> None:
    sizes = [(28, 28), (600, 100), (100, 900)]
    files = [encode(noise(w, h, seed=w), "PNG") for w, h in sizes]
    prompt = f"A{MARKER}B {MARKER} C{MARKER}"
    resp = stub("mrope").Prepare(raw(prompt, *files), timeout=30)
    assert resp.rendered_text == prompt
    ms = media(resp)
    assert [(m.media.width, m.media.height) for m in ms] == sizes
    assert [m.media_group for m in ms] == [1, 2, 3]
    assert [rgb_of(m.media) for m in ms] == [pillow_decode(f)[2] for f in files]
    assert {c.message_index for c in resp.prompt.chunks} == {0}
    # the counts differ by image, and each is libmtmd's for that image alone
    alone = [natives["mrope"].mtmd.media_group(native.Bitmap(w, h)) for w, h in sizes]
    expected = [next(c for c in group if c.is_media) for group in alone]
    assert [(m.media.num_cells, m.media.num_positions) for m in ms] == [
        (c.num_cells, c.num_positions) for c in expected
    ]
    assert len({m.media.num_cells for m in ms}) == 3


def test_add_special_adds_bos_when_the_vocabulary_asks(
    extra_servers, channel_to, stub, natives: dict[str, Native]
) -> None:
    s = prep_pb2_grpc.PrepServiceStub(channel_to(extra_servers("bos")))
    bos = s.GetModelInfo(prep_pb2.GetModelInfoRequest()).info.bos_token_id
    assert bos == natives["mrope"].special("<|endoftext|>")
    picture = image_bytes(64, 64, seed=6)
    with_bos = s.Prepare(raw(f"hi {MARKER}", picture, add_special=True), timeout=30)
    without = s.Prepare(raw(f"hi {MARKER}", picture, add_special=False), timeout=30)
    assert stream(with_bos.prompt.chunks) == [("token", bos), *stream(without.prompt.chunks)]
    assert bos not in [t for c in without.prompt.chunks for t in c.text.token_ids]
    # a chat gets BOS exactly once, at the start
    conversation = chat(msg("user", text("hi")), msg("assistant", text("yo")))
    tokens = [t for c in s.Prepare(conversation).prompt.chunks for t in c.text.token_ids]
    assert tokens[0] == bos and tokens.count(bos) == 1
    # the vocabulary of the plain tiny model does not ask for BOS: add_special changes nothing
    plain = stub("mrope")
    a = plain.Prepare(raw(f"hi {MARKER}", picture, add_special=True), timeout=30)
    b = plain.Prepare(raw(f"hi {MARKER}", picture, add_special=False), timeout=30)
    assert stream(a.prompt.chunks) == stream(b.prompt.chunks)


# -- pixels -------------------------------------------------------------------------------------


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (40, 30), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=40)


def exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    return encode(noise(48, 32, seed=8), "JPEG", quality=90, exif=exif)


FILES: dict[str, Callable[[], bytes]] = {
    "png": lambda: encode(noise(45, 31, seed=1), "PNG"),
    "jpeg": lambda: encode(noise(45, 31, seed=2), "JPEG", quality=85),
    "webp": lambda: encode(noise(45, 31, seed=3), "WEBP", quality=80),
    "webp-lossless": lambda: encode(noise(45, 31, seed=3), "WEBP", lossless=True),
    "bmp": lambda: encode(noise(45, 31, seed=4), "BMP"),
    "gif-first-frame": animated_gif,
    "jpeg-exif-6": exif_jpeg,
    "grayscale": lambda: encode(noise(45, 31, seed=5, mode="L"), "PNG"),
}


@pytest.mark.parametrize("kind", FILES)
def test_media_chunk_carries_the_decoded_pixels(kind: str, stub) -> None:
    file = FILES[kind]()
    resp = stub("rope").Prepare(raw(MARKER, file), timeout=30)
    [m] = media(resp)
    w, h, rgb = pillow_decode(file)
    assert (m.media.width, m.media.height) == (w, h)
    assert len(rgb_of(m.media)) == w * h * 3
    assert rgb_of(m.media) == rgb
    assert m.media.media_id == media_id(w, h, rgb)
    if kind == "jpeg-exif-6":
        assert (w, h) == (32, 48)  # stored 48x32, shown rotated
    if kind == "gif-first-frame":
        assert rgb == b"\xff\x00\x00" * (40 * 30)


def test_alpha_is_composited_on_white(stub) -> None:
    transparent = encode(Image.new("RGBA", (20, 10), (0, 0, 0, 0)), "PNG")
    [m] = media(stub("rope").Prepare(raw(MARKER, transparent), timeout=30))
    assert rgb_of(m.media) == b"\xff" * (20 * 10 * 3)
    assert m.media.media_id == media_id(20, 10, b"\xff" * 600)


def test_same_pixels_same_media_id_across_formats(stub) -> None:
    source = noise(33, 17, seed=12)
    files = [encode(source, "PNG"), encode(source, "BMP"), encode(source, "WEBP", lossless=True)]
    resp = stub("rope").Prepare(raw(MARKER * 3, *files), timeout=30)
    ids = {m.media.media_id for m in media(resp)}
    assert ids == {media_id(33, 17, source.tobytes())}


def test_max_side_downscales(extra_servers, channel_to) -> None:
    s = prep_pb2_grpc.PrepServiceStub(channel_to(extra_servers("limited")))
    [m] = media(s.Prepare(raw(MARKER, image_bytes(400, 200, seed=9)), timeout=30))
    assert (m.media.width, m.media.height, len(rgb_of(m.media))) == (100, 50, 100 * 50 * 3)
    assert m.media.media_id == media_id(100, 50, rgb_of(m.media))


# -- refusals -----------------------------------------------------------------------------------


def truncated_png() -> bytes:
    png = encode(noise(120, 120, seed=13), "PNG")
    return png[: len(png) * 6 // 10]


M2 = f"a {MARKER} b {MARKER}"
BAD: dict[str, tuple[str, Callable[[], Any], str]] = {
    "empty chat": ("Prepare", lambda: prep_pb2.PrepareRequest(chat=prep_pb2.Chat()), "no messages"),
    "no input": ("Prepare", prep_pb2.PrepareRequest, "neither chat nor raw input"),
    "no input (count)": ("CountTokens", prep_pb2.CountTokensRequest, "neither chat nor raw"),
    "empty raw prompt": ("Prepare", lambda: raw(""), "raw prompt is empty"),
    "more markers than images": (
        "Prepare",
        lambda: raw(M2, image_bytes(30, 30)),
        f"2 media markers ('{MARKER}') but 1 images",
    ),
    "more images than markers": (
        "Prepare",
        lambda: raw(f"x {MARKER}", image_bytes(30, 30), image_bytes(30, 30, seed=1)),
        "1 media markers ('<__media__>') but 2 images",
    ),
    "markers and no images (count)": (
        "CountTokens",
        lambda: raw(M2, count=True),
        "2 media markers ('<__media__>') but 0 images",
    ),
    "unknown role": (
        "Prepare",
        lambda: chat(msg("system", text("hi")), msg("robot", text("beep"))),
        "message 1: unknown role 'robot'",
    ),
    "message without parts": (
        "Prepare",
        lambda: chat(msg("user", text("hi")), msg("assistant")),
        "message 1 has no parts",
    ),
    "empty part": (
        "Prepare",
        lambda: chat(msg("user", text("hi"), prep_pb2.Part())),
        "message 0 part 1 is empty",
    ),
    "marker in a text part": (
        "Prepare",
        lambda: chat(msg("user", text("look"), text(f"at {MARKER}"))),
        "message 0 part 1: text contains the media marker",
    ),
    "undecodable bytes": (
        "Prepare",
        lambda: chat(msg("user", text("see"), image(b"GIF89a? no, just text"))),
        "message 0 part 1: not a PNG, JPEG, WebP, GIF or BMP file",
    ),
    "truncated png": (
        "Prepare",
        lambda: raw(f"{MARKER}{MARKER}", image_bytes(30, 30), truncated_png()),
        "image 1: image file is truncated or corrupt",
    ),
    "zero-byte image": (
        "Prepare",
        lambda: chat(msg("user", image(b""))),
        r"message 0 part 0: image is empty (0 bytes)",
    ),
    "zero-byte image (count)": (
        "CountTokens",
        lambda: chat(msg("user", image(b"")), count=True),
        r"message 0 part 0: image is empty (0 bytes)",
    ),
    "decompression bomb": (
        "Prepare",
        lambda: raw(MARKER, bilevel_png(20000, 20000)),
        "image 0: image refused as a decompression bomb: Image size (400000000 pixels)",
    ),
    "over max pixels": (
        "Prepare",
        lambda: raw(MARKER, bilevel_png(8000, 5000)),
        "image 0: image is 8000x5000 = 40000000 pixels, over the limit of 33177600",
    ),
    "size-only image in Prepare": (
        "Prepare",
        lambda: raw(MARKER, size(64, 64)),
        "image 0: Prepare needs the image bytes, not just a size",
    ),
    "zero size": (
        "CountTokens",
        lambda: chat(msg("user", text("hi"), image(size(0, 10))), count=True),
        "message 0 part 1: size 0x10 must be positive",
    ),
    "size over max pixels": (
        "CountTokens",
        lambda: raw(MARKER, size(10000, 10000), count=True),
        "image 0: size 10000x10000 must be positive and at most 33177600 pixels",
    ),
    "image with neither data nor size": (
        "CountTokens",
        lambda: raw(MARKER, prep_pb2.Image(), count=True),
        "image 0: image has neither data nor size",
    ),
    "too many images": (
        "CountTokens",
        lambda: raw(MARKER * 65, *[size(28, 28)] * 65, count=True),
        "more than 64 images in one request",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_and_the_server_carries_on(case: str, stub) -> None:
    method, build, message = BAD[case]
    s = stub("mrope")
    with pytest.raises(grpc.RpcError) as err:
        getattr(s, method)(build(), timeout=30)
    assert err.value.code() == IA, err.value.details()
    assert message in err.value.details()
    good_request_works(s)


def test_images_to_a_text_only_server(extra_servers, channel_to) -> None:
    s = prep_pb2_grpc.PrepServiceStub(channel_to(extra_servers("text_only")))
    info = s.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info
    assert not info.supports_vision and info.fingerprint.mmproj == ""
    for call, req in [
        (s.Prepare, raw(f"see {MARKER}", image_bytes(40, 40))),
        (s.Prepare, chat(msg("user", text("see"), image(image_bytes(40, 40))))),
        (s.CountTokens, raw(MARKER, size(40, 40), count=True)),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "without an mmproj: it takes no images" in err.value.details()
        # text still works on the same server
        resp = s.Prepare(chat(msg("user", text("hello"))), timeout=30)
        assert resp.rendered_text.startswith("<|im_start|>user\nhello")
        assert not media(resp)


def test_a_message_over_the_size_limit(extra_servers, channel_to) -> None:
    s = prep_pb2_grpc.PrepServiceStub(channel_to(extra_servers("limited")))  # 64 KiB max
    with pytest.raises(grpc.RpcError) as err:
        s.Prepare(raw("x" * (100 << 10)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # the server's own limits can be set too
        s.CountTokens(raw(MARKER * 4, *[size(28, 28)] * 4, count=True), timeout=30)
    assert err.value.code() == IA and "more than 3 images" in err.value.details()
    good_request_works(s)


def with_invalid_utf8(message: Any, placeholder: str) -> bytes:
    """The serialized message with the first byte of a string field's value made 0xFF."""
    wire = message.SerializeToString()
    assert wire.count(placeholder.encode()) == 1
    return wire.replace(placeholder.encode(), b"\xff" + placeholder.encode()[1:])


@pytest.mark.parametrize(
    ("method", "request_bytes"),
    [
        ("Prepare", lambda: with_invalid_utf8(raw("PLACEHOLDER"), "PLACEHOLDER")),
        (
            "Prepare",
            lambda: with_invalid_utf8(chat(msg("user", text("PLACEHOLDER"))), "PLACEHOLDER"),
        ),
        (
            "CountTokens",
            lambda: with_invalid_utf8(chat(msg("ROLE", text("x")), count=True), "ROLE"),
        ),
    ],
)
def test_invalid_utf8_is_invalid_argument(
    method: str, request_bytes: Callable[[], bytes], prep_servers, channel_to
) -> None:
    channel = channel_to(prep_servers("mrope"))
    call = channel.unary_unary(
        f"/slotwise.v1.PrepService/{method}",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as err:
        call(request_bytes(), timeout=10)
    assert err.value.code() == IA, err.value.details()
    assert "cannot parse the request" in err.value.details()
    assert "UTF-8" in err.value.details()
    good_request_works(prep_pb2_grpc.PrepServiceStub(channel))


def test_invalid_utf8_in_a_server_streaming_call(prep_servers, channel_to) -> None:
    # The decode guard covers every service on the server, server-streaming methods included:
    # grpc.health.v1.Health/Watch takes one request and streams.
    channel = channel_to(prep_servers("mrope"))
    bad = with_invalid_utf8(health_pb2.HealthCheckRequest(service="PLACEHOLDER"), "PLACEHOLDER")
    watch = channel.unary_stream(
        "/grpc.health.v1.Health/Watch",
        request_serializer=lambda b: b,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        next(iter(watch(bad, timeout=10)))
    assert err.value.code() == IA and "UTF-8" in err.value.details()
    good = watch(health_pb2.HealthCheckRequest(service=SERVICE).SerializeToString(), timeout=10)
    assert next(iter(good)).status == health_pb2.HealthCheckResponse.SERVING
    good.cancel()


# -- concurrency --------------------------------------------------------------------------------


def test_sixteen_concurrent_prepares(stub) -> None:
    s = stub("mrope")
    sizes = [(40 + 37 * i, 300 - 11 * i) for i in range(16)]
    files = [encode(noise(w, h, seed=100 + i), "PNG") for i, (w, h) in enumerate(sizes)]
    expected = [
        summary(s.CountTokens(raw(f"image {i}: {MARKER}", size(w, h), count=True)).chunks)
        for i, (w, h) in enumerate(sizes)
    ]
    barrier = threading.Barrier(16)

    def one(i: int) -> prep_pb2.PrepareResponse:
        barrier.wait(10)
        return s.Prepare(raw(f"image {i}: {MARKER}", files[i]), timeout=60)

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(one, range(16)))
    for i, resp in enumerate(responses):
        [m] = media(resp)
        w, h, rgb = pillow_decode(files[i])
        assert (m.media.width, m.media.height) == sizes[i] == (w, h)
        assert rgb_of(m.media) == rgb and m.media.media_id == media_id(w, h, rgb)
        assert summary(resp.prompt.chunks) == expected[i]
        assert resp.rendered_text == f"image {i}: {MARKER}"


# -- health and reflection ----------------------------------------------------------------------


def test_health_not_serving_until_loaded_then_serving(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], channel_to
) -> None:
    pair = tiny["rope"]
    port = free_port()
    channel = channel_to(port)
    health = health_pb2_grpc.HealthStub(channel)
    prep = prep_pb2_grpc.PrepServiceStub(channel)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    future = None
    running = None
    try:
        # Hold the lock native.load_model takes: start() listens, then waits for the model.
        with native._LOG_LOCK:
            future = asyncio.run_coroutine_threadsafe(
                start(pair.model, pair.mmproj, address=f"127.0.0.1:{port}"), loop_thread.loop
            )
            for name in ("", SERVICE):
                req = health_pb2.HealthCheckRequest(service=name)
                assert health.Check(req, wait_for_ready=True, timeout=20).status == not_serving
            with pytest.raises(grpc.RpcError) as err:
                prep.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=5)
            # the service is registered before the model loads and says so
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in err.value.details()
            assert not future.done()
        running = future.result(30)
        for name in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        assert prep.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info.supports_vision
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        if running is None and future is not None:
            running = future.result(30)
        if running is not None:
            loop_thread.run(running.stop(0))


def test_reflection_lists_and_describes_prep_service(prep_servers, channel_to) -> None:
    refl = reflection_pb2_grpc.ServerReflectionStub(channel_to(prep_servers("mrope")))
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listed, described = list(refl.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    assert SERVICE == "slotwise.v1.PrepService"
    files = described.file_descriptor_response.file_descriptor_proto
    assert files and any(b"PrepService" in f for f in files)


# -- model mismatch -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mismatched(tiny: dict[str, TinyPair], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mrope's projector, claiming 96-dim output: not for any of the 64-dim tiny text models."""
    d = tmp_path_factory.mktemp("mismatch")
    return patched_copy(tiny["mrope"].mmproj, d / "mmproj.gguf", "clip.vision.projection_dim", 96)


def test_check_embedding_sizes(tiny: dict[str, TinyPair], mismatched: Path, tmp_path: Path) -> None:
    for pair in tiny.values():
        model_files.check_embedding_sizes(pair.model, pair.mmproj)  # the real pairs agree
    with pytest.raises(ModelMismatchError, match=r"projects to 96-dim .* \(qwen2vl\) takes 64"):
        model_files.check_embedding_sizes(tiny["mrope"].model, mismatched)
    for name, pair in tiny.items():
        arch = GGUFReader(pair.model).fields["general.architecture"].contents()
        wide = patched_copy(pair.model, tmp_path / f"{name}.gguf", f"{arch}.embedding_length", 96)
        with pytest.raises(ModelMismatchError, match=rf"projects to 64-dim .*\({arch}\) takes 96"):
            model_files.check_embedding_sizes(wide, pair.mmproj)
        if "clip.vision.projection_dim" not in GGUFReader(pair.mmproj).fields:
            continue  # (an audio tower alone: its key is all that says the size)
        # without projection_dim the size is read off the projector's last tensor
        nodim = tmp_path / f"{name}-nodim.gguf"
        shutil.copy(pair.mmproj, nodim)
        reader = GGUFReader(nodim, "r+")
        key = reader.fields["clip.vision.projection_dim"].parts[1]
        key[-1] = ord("X")  # rename the key: clip.vision.projection_diX
        reader.data.flush()
        assert "clip.vision.projection_dim" not in GGUFReader(nodim).fields
        model_files.check_embedding_sizes(pair.model, nodim)
        with pytest.raises(ModelMismatchError, match="projects to 64-dim"):
            model_files.check_embedding_sizes(wide, nodim)


def test_cli_refuses_a_mismatched_pair(tiny: dict[str, TinyPair], mismatched: Path) -> None:
    cmd = [sys.executable, "-m", "prep_service", "--model", str(tiny["mrope"].model)]
    proc = subprocess.run(
        [*cmd, "--mmproj", str(mismatched), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "projects to 96-dim embeddings but model.gguf (qwen2vl) takes 64" in proc.stderr
    assert "this mmproj belongs to another model" in proc.stderr
    assert "Traceback" not in proc.stderr  # a clean refusal, no half-started server left behind


def test_start_refuses_a_mismatched_pair_and_closes_its_port(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], mismatched: Path
) -> None:
    port = free_port()
    with pytest.raises(ModelMismatchError):
        loop_thread.run(start(tiny["mrope"].model, mismatched, address=f"127.0.0.1:{port}"))
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there any more


def test_a_session_turn_does_not_decode_or_count_the_images_its_session_holds(stub) -> None:
    """A long multimodal session sends its whole chat each turn (the template renders it) with
    first_message at the new message: the images before it are never decoded nor counted
    against --max-images (70 here, past the limit of 64, and not even valid files)."""
    history = []
    for k in range(70):
        history.append(msg("user", text(f"turn {k}"), image(b"not decoded: held by the session")))
        history.append(msg("assistant", text("ok")))
    new = msg("user", text("and this one?"), image(image_bytes(64, 48, seed=5)))
    req = chat(*history, new)
    req.first_message = len(history)
    prompt = stub("mrope").Prepare(req, timeout=30).prompt
    media = [c for c in prompt.chunks if c.WhichOneof("kind") == "media"]
    assert len(media) == 1 and {c.message_index for c in prompt.chunks} == {
        len(history),
        len(history) + 1,
    }
    # from 0, the same chat is refused (more than 64 images), as before
    req.first_message = 0
    with pytest.raises(grpc.RpcError) as e:
        stub("mrope").Prepare(req, timeout=30)
    assert e.value.code() == IA
