"""Real encoded images (made with Pillow) and sounds (WAV files made with the wave module)."""

from __future__ import annotations

import io
import wave

import numpy as np
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


def wav_bytes(seconds: float, rate: int = 16_000, *, seed: int = 0, channels: int = 1) -> bytes:
    """A real 16-bit WAV file: a tone whose pitch depends on seed."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (np.sin(2 * np.pi * (220 + 40 * seed) * t) * 8000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(tone, channels).tobytes())
    return buf.getvalue()
