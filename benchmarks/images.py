"""The images the benchmarks send."""

from __future__ import annotations

import io


def make_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A photo-like JPEG (smooth gradients plus noise) whose pixels depend on ``seed`` only:
    the same bytes every run for one seed, others for another (a cache cannot answer them)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    phase = seed * 37 % 256
    blue = (x + y + phase) * 255 // (width + height)
    base = np.stack([x * 255 // width, y * 255 // height, blue], -1)
    rgb = np.clip(base + rng.integers(-24, 24, size=base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()
