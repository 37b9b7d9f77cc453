"""Load: N concurrent multimodal streams against real prep + infer processes for T seconds.

    python tests/load.py --streams 64 --seconds 60          # the documented run
    python tests/load.py --streams 16 --seconds 5           # what the test suite runs

Both services run as subprocesses on loopback ports with a generated tiny pair; every stream
loops Prepare (chat with a Pillow image) -> Generate until the time is up. Prints requests,
errors by status code, tokens/s and the infer process's resident memory growth between the end
of the warm-up and the end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import write_tiny_models
from support.procs import free_port, rss_bytes


def png(seed: int) -> bytes:
    rng = random.Random(seed)
    img = Image.new("RGB", (rng.randint(28, 224), rng.randint(28, 224)), (seed % 256, 90, 200))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


IMAGES = [png(seed) for seed in range(32)]


async def wait_serving(port: int, timeout: float = 60) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"port {port} not serving")


async def stream_loop(
    prep: prep_pb2_grpc.PrepServiceStub,
    infer: infer_pb2_grpc.InferServiceStub,
    until: float,
    seed: int,
    stats: Counter[str],
) -> None:
    i = 0
    while time.monotonic() < until:
        i += 1
        chat = prep_pb2.Chat(
            messages=[
                prep_pb2.Message(
                    role="user",
                    parts=[
                        prep_pb2.Part(text=f"stream {seed} request {i}: "),
                        # a fixed set of images: the embedding cache saturates during warm-up
                        prep_pb2.Part(image=prep_pb2.Image(data=IMAGES[(seed + i) % len(IMAGES)])),
                    ],
                )
            ]
        )
        try:
            prepared = await prep.Prepare(prep_pb2.PrepareRequest(chat=chat), timeout=30)
            request = infer_pb2.GenerateRequest(
                prompt=prepared.prompt,
                max_tokens=random.Random(i).randint(8, 64),
                sampling=infer_pb2.SamplingParams(temperature=0.7, seed=i),
            )
            async for event in infer.Generate(request, timeout=60):
                kind = event.WhichOneof("event")
                if kind == "delta":
                    stats["tokens"] += len(event.delta.token_ids)
                elif kind == "finished":
                    stats[f"finished_{infer_pb2.FinishReason.Name(event.finished.reason)}"] += 1
            stats["requests"] += 1
        except grpc.aio.AioRpcError as e:
            stats[f"error_{e.code().name}"] += 1


async def run(streams: int, seconds: float, pair: str, warmup: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="slotwise-load-") as tmp:
        return await _run(Path(tmp), streams, seconds, pair, warmup)


async def _run(
    tmp: Path, streams: int, seconds: float, pair: str, warmup: float
) -> dict[str, object]:
    models = write_tiny_models(tmp, [pair])[pair]
    prep_port, infer_port = free_port(), free_port()
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    common = ["--model", str(models.model), "--mmproj", str(models.mmproj), "--host", "127.0.0.1"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "prep_service", *common, "--port", str(prep_port)], env=env
        ),
        subprocess.Popen(
            [
                sys.executable, "-m", "infer_service", *common, "--port", str(infer_port),
                "--ctx-size", "2048", "--parallel", "4", "--threads", "1",
                "--max-queue", str(streams * 2),
            ],
            env=env,
        ),
    ]  # fmt: skip
    try:
        await wait_serving(prep_port)
        await wait_serving(infer_port)
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{prep_port}", options=options) as pch,
            grpc.aio.insecure_channel(f"127.0.0.1:{infer_port}", options=options) as ich,
        ):
            prep, infer = prep_pb2_grpc.PrepServiceStub(pch), infer_pb2_grpc.InferServiceStub(ich)
            warm: Counter[str] = Counter()
            await asyncio.gather(
                *(
                    stream_loop(prep, infer, time.monotonic() + warmup, s, warm)
                    for s in range(streams)
                )
            )
            rss_start = rss_bytes(procs[1].pid)
            stats: Counter[str] = Counter()
            t0 = time.monotonic()
            await asyncio.gather(
                *(stream_loop(prep, infer, t0 + seconds, s, stats) for s in range(streams))
            )
            elapsed = time.monotonic() - t0
            rss_end = rss_bytes(procs[1].pid)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    errors = {k: v for k, v in stats.items() if k.startswith("error_")}
    return {
        "streams": streams,
        "seconds": round(elapsed, 1),
        "requests": stats["requests"],
        "errors": errors,
        "finished": {k: v for k, v in stats.items() if k.startswith("finished_")},
        "tokens_per_second": round(stats["tokens"] / elapsed, 1),
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2) if rss_start else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--warmup", type=float, default=5)
    p.add_argument("--pair", default="rope", choices=["mrope", "rope", "noncausal"])
    args = p.parse_args(argv)
    result = asyncio.run(run(args.streams, args.seconds, args.pair, args.warmup))
    print(json.dumps(result, indent=2))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
