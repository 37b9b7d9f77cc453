"""Real encoded images made with Pillow."""

from __future__ import annotations

import io

from PIL import Image


def image_bytes(
    width: int, height: int, fmt: str = "PNG", *, seed: int = 0, mode: str = "RGB"
) -> bytes:
    """A real encoded image with content that depends on seed."""
    img = Image.new(mode, (width, height))
    px = img.load()
    assert px is not None
    for y in range(0, height, max(1, height // 16)):
        for x in range(0, width, max(1, width // 16)):
            v = (x * 7 + y * 13 + seed * 31) % 256
            px[x, y] = (v, 255 - v, (v * 3) % 256) if mode == "RGB" else px[x, y]
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()
