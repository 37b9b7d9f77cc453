"""images.decode_image: encoded files -> the exact RGB bytes libmtmd gets (real Pillow files)."""

from __future__ import annotations

import functools
import hashlib
import io
import random
import struct
import zlib

import pytest
from PIL import ExifTags, Image, ImageOps

from slotwise_core.images import (
    DEFAULT_MAX_PIXELS,
    ImageError,
    RgbImage,
    decode_image,
    image_facts,
    media_id,
)

RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)


def noise(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    n = width * height * len(mode)
    return Image.frombytes(mode, (width, height), random.Random(seed).randbytes(n))


def encode(img: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def pillow_rgb(data: bytes) -> tuple[int, int, bytes]:
    """Pillow's own decode of a file without alpha or EXIF: the reference."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        return rgb.width, rgb.height, rgb.tobytes()


def pixel(im: RgbImage, x: int, y: int) -> tuple[int, int, int]:
    i = (y * im.width + x) * 3
    return tuple(im.rgb[i : i + 3])  # type: ignore[return-value]


def close_to(actual: tuple[int, ...], expected: tuple[int, ...], tol: int = 40) -> bool:
    return all(abs(a - e) <= tol for a, e in zip(actual, expected, strict=True))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.cache
def bilevel_png(width: int, height: int) -> bytes:
    """A complete, valid all-black 1-bit PNG, built by hand: tiny on disk, huge in memory."""
    row = bytes(1 + (width + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


# -- exact pixels -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "params"),
    [
        ("PNG", {}),
        ("BMP", {}),
        ("WEBP", {"lossless": True}),
        ("WEBP", {"quality": 80}),
        ("JPEG", {"quality": 90}),
    ],
)
def test_decode_equals_pillows_own_decode(fmt: str, params: dict[str, object]) -> None:
    source = noise(37, 23, seed=zlib.crc32(fmt.encode()))
    data = encode(source, fmt, **params)
    im = decode_image(data)
    assert (im.width, im.height, im.rgb) == pillow_rgb(data)
    assert len(im.rgb) == 37 * 23 * 3
    if fmt in ("PNG", "BMP") or params.get("lossless"):
        assert im.rgb == source.tobytes()  # lossless formats give back the very pixels


def test_grayscale_and_cmyk_become_rgb() -> None:
    gray = noise(20, 10, seed=3, mode="L")
    im = decode_image(encode(gray, "PNG"))
    assert im.rgb == gray.convert("RGB").tobytes()
    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # red
    im = decode_image(encode(cmyk, "JPEG", quality=95))
    assert (im.width, im.height) == (16, 16)
    assert close_to(pixel(im, 8, 8), RED)


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (30, 20), c) for c in (RED, GREEN, BLUE)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    with Image.open(io.BytesIO(data)) as check:
        assert check.n_frames == 3  # really animated
    im = decode_image(data)
    assert (im.width, im.height) == (30, 20)
    assert im.rgb == bytes(RED) * (30 * 20)


# -- EXIF orientation ---------------------------------------------------------------------------


def halves(width: int, height: int) -> Image.Image:
    """Left half red, right half blue."""
    img = Image.new("RGB", (width, height), BLUE)
    img.paste(RED, (0, 0, width // 2, height))
    return img


def jpeg_with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    return encode(img, "JPEG", quality=95, exif=exif)


def test_exif_orientation_6_rotates_clockwise() -> None:
    data = jpeg_with_orientation(halves(64, 32), 6)
    assert pillow_rgb(data)[:2] == (64, 32)  # stored landscape
    im = decode_image(data)
    assert (im.width, im.height) == (32, 64)  # shown portrait: the size is swapped
    # 90° clockwise: the stored left edge (red) is now the top
    assert close_to(pixel(im, 16, 8), RED)
    assert close_to(pixel(im, 16, 56), BLUE)


@pytest.mark.parametrize("orientation", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_exif_orientation_matches_pillow(orientation: int) -> None:
    data = jpeg_with_orientation(noise(24, 16, seed=orientation), orientation)
    im = decode_image(data)
    with Image.open(io.BytesIO(data)) as img:
        ref = ImageOps.exif_transpose(img).convert("RGB")
    assert (im.width, im.height) == ref.size == ((16, 24) if orientation >= 5 else (24, 16))
    assert im.rgb == ref.tobytes()


# -- alpha --------------------------------------------------------------------------------------


def test_fully_transparent_rgba_is_white() -> None:
    data = encode(Image.new("RGBA", (10, 7), (12, 34, 56, 0)), "PNG")
    assert decode_image(data).rgb == b"\xff" * (10 * 7 * 3)


def test_alpha_is_composited_on_white() -> None:
    data = encode(Image.new("RGBA", (4, 4), (255, 0, 0, 128)), "PNG")
    im = decode_image(data)
    assert close_to(pixel(im, 1, 1), (255, 127, 127), tol=1)
    opaque = noise(9, 9, seed=5, mode="RGB").convert("RGBA")
    assert decode_image(encode(opaque, "PNG")).rgb == opaque.convert("RGB").tobytes()


def test_gray_alpha_and_palette_transparency_are_composited() -> None:
    la = Image.new("LA", (5, 5), (0, 0))  # black, fully transparent
    assert decode_image(encode(la, "PNG")).rgb == b"\xff" * 75
    p = Image.new("P", (6, 3), 1)
    p.putpalette([*RED, *GREEN])
    p.paste(0, (0, 0, 3, 3))  # left half index 0 (red), right half index 1 (green)
    data = encode(p, "PNG", transparency=1)
    im = decode_image(data)
    assert pixel(im, 0, 0) == RED
    assert pixel(im, 5, 2) == WHITE  # transparent index


def test_transparent_webp_is_composited() -> None:
    img = Image.new("RGBA", (8, 8), (0, 0, 255, 0))
    img.paste((0, 0, 255, 255), (0, 0, 4, 8))
    im = decode_image(encode(img, "WEBP", lossless=True))
    assert pixel(im, 1, 1) == BLUE
    assert pixel(im, 6, 6) == WHITE


# -- downscaling --------------------------------------------------------------------------------


def test_max_side_downscales_keeping_the_aspect_ratio() -> None:
    source = noise(400, 200, seed=7)
    data = encode(source, "PNG")
    im = decode_image(data, max_side=100)
    assert (im.width, im.height) == (100, 50)
    assert im.rgb == source.resize((100, 50), Image.Resampling.BICUBIC).tobytes()
    tall = decode_image(encode(noise(30, 301, seed=8), "PNG"), max_side=100)
    assert (tall.width, tall.height) == (10, 100)
    thin = decode_image(encode(noise(1000, 1, seed=9), "PNG"), max_side=10)
    assert (thin.width, thin.height) == (10, 1)  # never rounded down to zero


def test_max_side_leaves_smaller_images_alone() -> None:
    source = noise(100, 60, seed=11)
    data = encode(source, "PNG")
    for max_side in (0, 100, 1000):
        im = decode_image(data, max_side=max_side)
        assert (im.width, im.height, im.rgb) == (100, 60, source.tobytes())


# -- refusals -----------------------------------------------------------------------------------


def test_decompression_bomb_is_refused_before_decoding() -> None:
    data = bilevel_png(20000, 20000)  # 400 MP
    assert len(data) < 100_000  # small on disk
    with pytest.raises(ImageError, match=r"400000000 pixels"):
        decode_image(data)


def test_over_max_pixels_is_refused_with_its_size() -> None:
    data = bilevel_png(6000, 6000)  # 36 MP: over our 8K limit, under Pillow's own bomb limit
    with pytest.raises(ImageError, match=rf"6000x6000 = 36000000 pixels.*{DEFAULT_MAX_PIXELS}"):
        decode_image(data)
    assert decode_image(bilevel_png(600, 600)).rgb == bytes(600 * 600 * 3)  # the same, smaller
    with pytest.raises(ImageError, match="over the limit of 359999"):
        decode_image(bilevel_png(600, 600), max_pixels=359_999)


def test_empty_garbage_truncated_and_foreign_files_are_refused() -> None:
    with pytest.raises(ImageError, match=r"empty \(0 bytes\)"):
        decode_image(b"")
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP, GIF or BMP"):
        decode_image(b"this is not an image at all")
    png = encode(noise(200, 200, seed=1), "PNG")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(png[: len(png) * 6 // 10])
    jpeg = encode(noise(200, 200, seed=2), "JPEG")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(jpeg[: len(jpeg) // 2])
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP, GIF or BMP"):
        decode_image(encode(noise(8, 8), "TIFF"))  # Pillow reads it, we don't accept it


# -- identity -----------------------------------------------------------------------------------


def test_media_id_is_the_content_hash_of_the_rgb() -> None:
    source = noise(12, 5, seed=4)
    png = decode_image(encode(source, "PNG"))
    expected = hashlib.blake2b(b"12x5:" + source.tobytes(), digest_size=16).hexdigest()
    assert png.media_id == media_id(12, 5, source.tobytes()) == expected
    # the same pixels from another file format: same id
    assert decode_image(encode(source, "BMP")).media_id == expected
    assert decode_image(encode(source, "WEBP", lossless=True)).media_id == expected
    # one pixel changed: another id; the same bytes read as another shape: another id
    changed = source.copy()
    changed.putpixel((0, 0), tuple(255 - v for v in source.getpixel((0, 0))))
    assert decode_image(encode(changed, "PNG")).media_id != expected
    assert media_id(5, 12, source.tobytes()) != expected


# -- what prep keeps of an image ----------------------------------------------------------------


def facts_cases() -> dict[str, tuple[bytes, int]]:
    """(file, max_side) of every path decoding takes: plain, rotated, alpha, palette, resized."""
    rgba = noise(30, 20, seed=20, mode="RGBA")
    palette = noise(25, 15, seed=21).convert("P")
    return {
        "jpeg": (encode(noise(40, 30, seed=22), "JPEG", quality=90), 0),
        "jpeg-exif-6": (jpeg_with_orientation(noise(40, 30, seed=23), 6), 0),
        "jpeg-exif-1": (jpeg_with_orientation(noise(40, 30, seed=24), 1), 0),
        "png-rgba": (encode(rgba, "PNG"), 0),
        "png-palette": (encode(palette, "PNG"), 0),
        "gray": (encode(noise(20, 10, seed=25, mode="L"), "PNG"), 0),
        "resized": (encode(noise(400, 200, seed=26), "PNG"), 100),
        "resized-and-rotated": (jpeg_with_orientation(noise(300, 100, seed=27), 8), 60),
    }


@pytest.mark.parametrize("case", list(facts_cases()))
def test_image_facts_are_decode_images_without_the_pixels(case: str) -> None:
    data, max_side = facts_cases()[case]
    im = decode_image(data, max_side=max_side)
    facts = image_facts(data, max_side=max_side)
    assert (facts.width, facts.height, facts.media_id) == (im.width, im.height, im.media_id)
    # what is sent: the file itself unless it was resized, and it decodes to exactly the pixels
    sent = facts.reencoded or data
    assert sent == im.encoded
    assert (facts.reencoded != b"") == case.startswith("resized")
    again = decode_image(sent, max_pixels=im.width * im.height)
    assert (again.width, again.height, again.rgb) == (im.width, im.height, im.rgb)


def test_a_rotated_file_is_sent_as_it_is() -> None:
    """Decoding applies EXIF orientation, so the file itself decodes to the rotated pixels:
    no re-encoding (a phone photo stays the JPEG it was)."""
    data = jpeg_with_orientation(halves(64, 32), 6)
    im = decode_image(data)
    assert (im.width, im.height) == (32, 64)
    assert im.encoded == data


def test_image_facts_refuse_what_decode_image_refuses() -> None:
    for bad, message in (
        (b"", "empty"),
        (b"not an image", "not a PNG"),
        (encode(noise(30, 30), "PNG")[:300], "truncated or corrupt"),
        (bilevel_png(600, 600), "over the limit of 1000"),
    ):
        with pytest.raises(ImageError, match=message):
            image_facts(bad, max_pixels=1000)
        with pytest.raises(ImageError, match=message):
            decode_image(bad, max_pixels=1000)
