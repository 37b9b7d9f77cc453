"""The ttft section of slotwise bench, its second row: time to first token of a long prompt
(--long-tokens, a new one each time), Prepare + Generate until the first delta, on infer started
with no thread flags (its defaults: every core, for generation and prompt steps) against infer
with --threads T --threads-batch T; lower is better. (Its first row, TTFT through gRPC against
in process, is measured on the stream1 section's servers: benchmarks/one_stream.py.)
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

from benchmarks.calls import PROMPTS, generate, prepare_text
from benchmarks.harness import Bench, round_up
from benchmarks.results import compared
from slotwise.v1 import infer_pb2_grpc

ROW_TTFT_THREADS = "TTFT ms, long prompt: infer's default threads / --threads set"


def run(b: Bench) -> None:
    """TTFT of a long prompt on infer started with no thread flags (its defaults: every
    core, for generation and prompt steps) and with --threads T --threads-batch T."""
    o = b.o
    serial = itertools.count(1)
    n = b.long_tokens
    ctx = round_up(n + 256)
    with (
        b.infer(ctx=ctx, parallel=1, threads=False) as default,
        b.infer(ctx=ctx, parallel=1) as tuned,
    ):

        def timed(infer: infer_pb2_grpc.InferServiceStub) -> Callable[[], float]:
            def fn() -> float:
                text = b.long_text(next(serial))
                t0 = time.perf_counter()
                prompt = prepare_text(b.prep, text)
                return generate(infer, prompt, 1, t_sent=t0).ttft

            return fn

        for infer in (default, tuned):  # warm-up: page in the weights, open the channel
            generate(infer, prepare_text(b.prep, f"Warm-up. {PROMPTS[0]}"), 1)
        res = b.interleaved({"default": timed(default), "tuned": timed(tuned)}, o.repeats)
    note = (
        f"prompt {n} tokens, a new one each time, ctx {ctx}; Prepare + Generate until the "
        f"first delta; infer with no thread flags (its defaults: --threads and "
        f"--threads-batch {os.cpu_count()}, every core here) vs --threads {o.threads} "
        f"--threads-batch {o.threads}; lower is better"
    )
    b.rows.append(
        compared(ROW_TTFT_THREADS, res["default"], res["tuned"], "ms", "<= 1.05", note, scale=1e3)
    )
