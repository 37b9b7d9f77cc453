"""Latency of prep_service through gRPC on the tiny mrope pair (not a pytest module).

    python tests/measure_prep_latency.py [--calls 20]

Prints p50 (and p90) of CountTokens with an image given by size, and of Prepare with a 1 MP
JPEG (1000x1000, photo-like content), each over --calls calls after two warm-up calls.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from prep_service.__main__ import start
from slotwise.v1 import prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import write_tiny_models

MARKER = "<__media__>"


def photo_jpeg(width: int, height: int) -> bytes:
    """Smooth gradients plus mild noise: compresses like a photograph, not like a flat fill."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(0)
    channels = [
        128 + 100 * np.sin(x / 90.0) * np.cos(y / 70.0),
        128 + 100 * np.sin((x + y) / 150.0),
        128 + 100 * np.cos(x / 40.0 - y / 110.0),
    ]
    rgb = np.stack(channels, axis=-1) + rng.normal(0, 12, (height, width, 3))
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    return buf.getvalue()


def timed(call: Callable[[], object], n: int) -> list[float]:
    for _ in range(2):
        call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1000)
    return out


def report(name: str, ms: list[float]) -> None:
    q = statistics.quantiles(ms, n=10)
    print(f"{name:<44} p50 {statistics.median(ms):8.2f} ms   p90 {q[8]:8.2f} ms   (n={len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    with tempfile.TemporaryDirectory() as tmp:
        pair = write_tiny_models(Path(tmp), ["mrope"])["mrope"]
        server = run(start(pair.model, pair.mmproj, threads=2))
        channel = grpc.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_receive_message_length", 256 << 20)],
        )
        stub = prep_pb2_grpc.PrepServiceStub(channel)
        try:
            sized = prep_pb2.CountTokensRequest(
                chat=prep_pb2.Chat(
                    messages=[
                        prep_pb2.Message(
                            role="user",
                            parts=[
                                prep_pb2.Part(text="What is in this picture?"),
                                prep_pb2.Part(
                                    image=prep_pb2.Image(
                                        size=prep_pb2.ImageSize(width=1288, height=784)
                                    )
                                ),
                            ],
                        )
                    ]
                )
            )
            jpeg = photo_jpeg(1000, 1000)
            prepare = prep_pb2.PrepareRequest(
                raw=prep_pb2.RawPrompt(
                    text=f"What is in this picture? {MARKER}",
                    images=[prep_pb2.Image(data=jpeg)],
                )
            )
            counted = stub.CountTokens(sized)
            prepared = stub.Prepare(prepare)
            print(f"CountTokens 1288x784 in a chat: {counted.num_cells} cells")
            print(
                f"Prepare 1000x1000 JPEG ({len(jpeg) / 1024:.0f} KiB in, "
                f"{prepared.ByteSize() / 2**20:.1f} MiB out): {prepared.prompt.num_cells} cells"
            )
            report(
                "CountTokens (chat, image by size)",
                timed(lambda: stub.CountTokens(sized), args.calls),
            )
            report("Prepare (raw, 1 MP JPEG)", timed(lambda: stub.Prepare(prepare), args.calls))
        finally:
            channel.close()
            run(server.stop(0))
            loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
