"""Encoded image files -> the exact RGB pixels libmtmd counts and encodes."""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_PIXELS = 33_177_600  # 8K UHD (7680x4320): larger files are refused, not decoded
DEFAULT_MAX_TOTAL_PIXELS = 4 * DEFAULT_MAX_PIXELS  # one request's images together


class ImageError(ValueError):
    """An image that cannot be used, with a message naming what is wrong."""


@dataclass(frozen=True)
class RgbImage:
    width: int
    height: int
    rgb: bytes  # width * height * 3, row-major
    # a file that decode_image turns into exactly these pixels (the original when it does)
    encoded: bytes = b""

    @property
    def media_id(self) -> str:
        return media_id(self.width, self.height, self.rgb)


def lossless(width: int, height: int, rgb: bytes) -> bytes:
    """A PNG of exactly these pixels (fast compression: it travels once, between services)."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), rgb).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def media_id(width: int, height: int, rgb: bytes) -> str:
    """Content hash of the pixels; the size is part of it so a reshaped buffer differs."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{width}x{height}:".encode())
    h.update(rgb)
    return h.hexdigest()


def image_size(data: bytes) -> tuple[int, int]:
    """Width and height from the file's header alone (nothing is decoded); (0, 0) when the
    header is unreadable (decode_image then says what is wrong)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as img:
                return img.size
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError, EOFError):
        return (0, 0)


def decode_image(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int = 0
) -> RgbImage:
    """Decode PNG/JPEG/WebP/GIF/BMP bytes to RGB.

    EXIF orientation is applied, alpha is composited on white, animations give their first
    frame; files over max_pixels (decompression bombs included) are refused before decoding.
    max_side > 0 downscales so that neither side exceeds it.
    """
    image, resized = _decode(data, max_pixels, max_side)
    # decoding the same bytes again gives the same pixels (EXIF rotation included), unless
    # they were resized here
    encoded = lossless(image.width, image.height, image.rgb) if resized else data
    return RgbImage(image.width, image.height, image.rgb, encoded)


@dataclass(frozen=True)
class ImageFacts:
    """An image file as prep needs it: decode_image's size and media_id, and what to send
    for it; the pixels themselves are not kept."""

    width: int
    height: int
    media_id: str
    # a lossless file of the pixels when max_side resized them; b"": the file itself decodes
    # to exactly them
    reencoded: bytes = b""


def image_facts(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int = 0
) -> ImageFacts:
    """decode_image(data, ...) without keeping the pixels: the same decoding, the same
    refusals, the same media_id."""
    image, resized = _decode(data, max_pixels, max_side)
    w, h = image.width, image.height
    return ImageFacts(w, h, image.media_id, lossless(w, h, image.rgb) if resized else b"")


def _decode(data: bytes, max_pixels: int, max_side: int) -> tuple[RgbImage, bool]:
    """The file's pixels (no encoded form yet), and whether max_side resized them."""
    if not data:
        raise ImageError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as img:
                width, height = img.size
                if width * height > max_pixels:
                    raise ImageError(
                        f"image is {width}x{height} = {width * height} pixels, "
                        f"over the limit of {max_pixels}"
                    )
                img.seek(0)
                img.load()
                return _to_rgb(img, max_side)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("not a PNG, JPEG, WebP, GIF or BMP file") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"image refused as a decompression bomb: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"image file is truncated or corrupt: {e}") from None


def _to_rgb(img: Image.Image, max_side: int) -> tuple[RgbImage, bool]:
    """EXIF orientation, alpha on white, RGB, max_side: each step only where it changes the
    pixels (exif_transpose without a rotation, and convert to the mode the image has, would
    only copy them)."""
    if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        img = ImageOps.exif_transpose(img)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    resized = max_side > 0 and max(rgb.size) > max_side
    if resized:
        scale = max_side / max(rgb.size)
        size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    return RgbImage(rgb.width, rgb.height, rgb.tobytes()), resized
