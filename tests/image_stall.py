"""The image prefill stall: stream A generates text while client B sends a 1000x1000 JPEG
through a projector heavy enough to cost what a real one does.

    python tests/image_stall.py --vision-width 512 --vision-layers 8

Prints B's time to first token, A's longest gap between two tokens while B waited, their
ratio (goal <= 0.05), and A's tokens/s during B's wait against without it (goal >= 0.5).
Both services run in-process on loopback; the heavy pair is generated into a temp folder.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.tiny_models import Vision, write_tiny_models
from support.loop import LoopThread
from support.rpc import message, prepare


def measure(width: int, layers: int, encode_threads: int) -> dict[str, object]:
    from infer_service.__main__ import start as start_infer
    from infer_service.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    with tempfile.TemporaryDirectory() as tmp:
        pair = write_tiny_models(Path(tmp), ["mrope"], vision=Vision(width, layers))["mrope"]
        lt = LoopThread()
        prep = lt.run(start_prep(pair.model, pair.mmproj, threads=1))
        config = RuntimeConfig(
            pair.model, pair.mmproj, ctx_size=8192, parallel=2, threads=1,
            encode_threads=encode_threads,
        )  # fmt: skip
        infer = lt.run(start_infer(config), timeout=300)
        try:
            return _measure(prep.port, infer.port)
        finally:
            lt.run(infer.stop(0))
            lt.run(prep.stop(0))
            lt.close()


def _measure(prep_port: int, infer_port: int) -> dict[str, object]:
    stub = infer_pb2_grpc.InferServiceStub(grpc.insecure_channel(f"127.0.0.1:{infer_port}"))
    buf = io.BytesIO()
    Image.effect_noise((1000, 1000), 60).convert("RGB").save(buf, "JPEG")
    picture = prepare(prep_port, messages=[message("user", "what is this? ", buf.getvalue())])
    text = prepare(prep_port, messages=[message("user", "tell me a long story")])
    greedy = infer_pb2.SamplingParams(temperature=0)  # never ends by itself here
    a = stub.Generate(
        infer_pb2.GenerateRequest(prompt=text, max_tokens=1 << 20, sampling=greedy), timeout=600
    )
    next(a)
    times: list[float] = []
    stop = threading.Event()

    def read() -> None:
        try:
            for e in a:
                if e.HasField("delta"):
                    times.extend([time.monotonic()] * len(e.delta.token_ids))
                if stop.is_set():
                    break
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(1.0)
    n0, t0 = len(times), time.monotonic()
    time.sleep(2.0)
    alone = (len(times) - n0) / (time.monotonic() - t0)
    sent = first = time.monotonic()
    for e in stub.Generate(infer_pb2.GenerateRequest(prompt=picture, max_tokens=2), timeout=600):
        if e.HasField("delta") and first == sent:
            first = time.monotonic()
    stop.set()
    a.cancel()
    reader.join(10)
    window = [x for x in times if sent <= x <= first]
    gaps = [b - a_ for a_, b in itertools.pairwise(window)] or [first - sent]
    ttft = first - sent
    return {
        "b_ttft_s": round(ttft, 2),
        "a_longest_gap_s": round(max(gaps), 3),
        "gap_over_ttft": round(max(gaps) / ttft, 3),
        "a_tokens_per_s_during_b": round(len(window) / ttft, 1),
        "a_tokens_per_s_without": round(alone, 1),
        "during_over_without": round(len(window) / ttft / alone, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vision-width", type=int, default=512)
    p.add_argument("--vision-layers", type=int, default=8)
    p.add_argument("--encode-threads", type=int, default=2)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.vision_width, args.vision_layers, args.encode_threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
