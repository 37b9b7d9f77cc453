"""The prep section of slotwise bench: the preparation service on a 1000x1000 JPEG, on the tiny
mrope pair (or --model with --mmproj), prep --threads T.

- CountTokens of a 1 MP image by its size alone, p50 ms.
- Prepare of the JPEG as a file prep has not seen (decoded, its pixels hashed), p50 ms; and of
  the same file resent (prep's cache answers it) over that.
- Prepare's response over the file, in bytes: the image travels as its file.
- Prepare throughput, req/s: 8 clients at once over one client, requests in sequence.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness import Bench
from benchmarks.images import make_jpeg
from benchmarks.results import Row, compared, median
from slotwise.v1 import prep_pb2, prep_pb2_grpc

ROW_COUNT = "CountTokens 1 MP by size, p50 ms"
ROW_PREPARE = "Prepare 1 MP JPEG, p50 ms"
ROW_PREPARE_HIT = "Prepare of a resent 1 MP JPEG (cache hit), p50 ms"
ROW_PREPARE8 = "Prepare 8 clients / 1 client, req/s"
ROW_PREPARE_BYTES = "Prepare 1 MP JPEG: response / file, bytes"


def run(b: Bench) -> None:
    o = b.o
    model, mmproj, what = _pair(b)
    args = ["--model", str(model), "--mmproj", str(mmproj), "--threads", str(o.threads)]
    svc = b.service("prep_service", args)
    try:
        stub = prep_pb2_grpc.PrepServiceStub(svc.channel)
        marker = stub.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info.media_marker
        text = f"Describe this picture in detail: {marker}\nThe picture shows"
        jpeg = make_jpeg(1000, 1000)
        serial = itertools.count()

        def fresh() -> prep_pb2.PrepareRequest:
            """The JPEG as a file prep has not seen (its cache cannot answer): a comment
            segment of its own after SOI; the same pixels, so the same decoding work."""
            com = f"slotwise bench {next(serial)}".encode()
            data = jpeg[:2] + b"\xff\xfe" + (len(com) + 2).to_bytes(2, "big") + com + jpeg[2:]
            image = prep_pb2.Image(data=data)
            return prep_pb2.PrepareRequest(
                raw=prep_pb2.RawPrompt(text=text, images=[image], add_special=True)
            )

        _latency_rows(b, stub, text, jpeg, fresh, what)
        _throughput_row(b, stub, fresh)
    finally:
        svc.stop()


def _pair(b: Bench) -> tuple[Path, Path, str]:
    """--model and --mmproj, or the tiny mrope pair written to the log directory."""
    o = b.o
    if o.mmproj:
        model, mmproj = b.model, o.mmproj
        return model, mmproj, f"{model.name} + {mmproj.name}"
    out = b.log_dir / "tiny"
    subprocess.run(
        [sys.executable, "-m", "slotwise_core.tiny_models", str(out), "--only", "mrope"],
        check=True, capture_output=True,
    )  # fmt: skip
    return out / "mrope/model.gguf", out / "mrope/mmproj.gguf", "tiny mrope pair"


def _latency_rows(
    b: Bench,
    stub: prep_pb2_grpc.PrepServiceStub,
    text: str,
    jpeg: bytes,
    fresh: Callable[[], prep_pb2.PrepareRequest],
    what: str,
) -> None:
    """CountTokens, Prepare of new files and of a resent one, and the response's size."""
    size = prep_pb2.Image(size=prep_pb2.ImageSize(width=1000, height=1000))
    count_req = prep_pb2.CountTokensRequest(
        raw=prep_pb2.RawPrompt(text=text, images=[size], add_special=True)
    )
    prep_req = prep_pb2.PrepareRequest(
        raw=prep_pb2.RawPrompt(text=text, images=[prep_pb2.Image(data=jpeg)], add_special=True)
    )
    n = b.o.prep_requests

    def timed(call: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    counted = stub.CountTokens(count_req, timeout=60)
    response = stub.Prepare(prep_req, timeout=60)  # (prep_req's file is known from now)
    counts = [timed(lambda: stub.CountTokens(count_req, timeout=60)) for _ in range(4 * n)]
    preps = []
    for r in [fresh() for _ in range(n)]:
        t0 = time.perf_counter()
        stub.Prepare(r, timeout=60)
        preps.append(time.perf_counter() - t0)
    hits = [timed(lambda: stub.Prepare(prep_req, timeout=60)) for _ in range(n)]
    b.rows.append(
        Row(
            ROW_COUNT, median(counts) * 1e3, "ms", note=f"{what}: {counted.num_cells} "
            f"cells / {counted.num_positions} positions, {len(counts)} calls",
        )
    )  # fmt: skip
    b.rows.append(
        Row(
            ROW_PREPARE, median(preps) * 1e3, "ms",
            note=f"{what}, {len(jpeg) >> 10} KiB JPEG, {len(preps)} calls, each a file "
            "prep had not seen (decoded, its pixels hashed)",
        )
    )  # fmt: skip
    b.rows.append(
        Row(
            ROW_PREPARE_HIT, median(hits) * 1e3, "ms", median(preps) * 1e3,
            median(hits) / median(preps),
            note=f"the same file {len(hits)} times; reference: a file prep had not seen",
        )
    )  # fmt: skip
    response_size = response.ByteSize()
    b.rows.append(
        Row(
            ROW_PREPARE_BYTES, response_size, "B", len(jpeg), response_size / len(jpeg),
            "<= 1.25", note="the image travels as its file (before: raw RGB, 18.8x)",
        )
    )  # fmt: skip


def _throughput_row(
    b: Bench, stub: prep_pb2_grpc.PrepServiceStub, fresh: Callable[[], prep_pb2.PrepareRequest]
) -> None:
    """8 clients sending new files at once over one client sending them in sequence."""
    o = b.o
    n = o.prep_requests

    def throughput(clients: int) -> float:
        per = max(1, n // clients) if clients > 1 else n
        batches = [[fresh() for _ in range(per)] for _ in range(clients)]

        def client(requests: list[prep_pb2.PrepareRequest]) -> None:
            for r in requests:
                stub.Prepare(r, timeout=120)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(client, batch) for batch in batches]:
                f.result()
        return clients * per / (time.perf_counter() - t0)

    res = b.interleaved({"8": lambda: throughput(8), "1": lambda: throughput(1)}, o.repeats)
    note = f"prep --threads {o.threads}; reference: one client, requests in sequence"
    b.rows.append(compared(ROW_PREPARE8, res["8"], res["1"], "req/s", note=note))
