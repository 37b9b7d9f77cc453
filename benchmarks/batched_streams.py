"""The stream4 section of slotwise bench: concurrent greedy streams, their aggregate streamed
tokens/s through gRPC against the raw batched loop (every sequence's token in one llama_decode
per step): 4 streams (--parallel 4, 4 x --ctx cells), against llama-server -np 4 too when
--llama-server is given, then 16 (--parallel 16, 16 x --ctx cells), where the engine's own cost
per step grows with the streams; and, after the stream1 section in the same run, the 4-stream
rate over the 1-stream rate.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.calls import PROMPTS, concurrently, generate, prepare_text, prompt_tokens
from benchmarks.harness import Bench
from benchmarks.results import Row, Stream, compared, decode_share, median, share_row, streamed_rate

ROW_STREAM4 = "4 streams tok/s: gRPC / raw batched loop"
ROW_STREAM16 = "16 streams tok/s: gRPC / raw batched loop"
ROW_GAIN4 = "4 streams / 1 stream (slotwise)"
ROW_SERVER4 = "4 streams tok/s: slotwise / llama-server"
ROW_SHARE = "{n} streams: streamed / inside llama_decode"


def run(b: Bench) -> None:
    ours4 = _streams(b, 4, ROW_STREAM4, ">= 0.95", ROW_SERVER4)
    if b.stream1_rate:
        b.rows.append(
            Row(
                ROW_GAIN4, ours4, "tok/s", b.stream1_rate, ours4 / b.stream1_rate,
                "", "aggregate 4-stream rate over the 1-stream rate of this run",
            )
        )  # fmt: skip
    _streams(b, 16, ROW_STREAM16, "")


def _streams(b: Bench, n: int, row: str, target: str, server_row: str = "") -> float:
    """n prompts at once on each side, interleaved (the four prompts, numbered past the
    fourth); slotwise's median aggregate rate."""
    o = b.o
    texts = [p if i < len(PROMPTS) else f"{p} ({i})" for i, p in enumerate(PROMPTS * (n // 4))]
    prompts = [prepare_text(b.prep, t) for t in texts]
    tokens = [prompt_tokens(p) for p in prompts]
    with (
        b.infer(ctx=n * o.ctx, parallel=n) as infer,
        b.raw(ctx=n * o.ctx, n_seq=n) as raw,
        b.llama_server(ctx=n * o.ctx, parallel=n, wanted=bool(server_row)) as server,
    ):
        last: dict[str, list[Stream]] = {}
        shares: list[float] = []

        def ours() -> float:
            fns = [lambda p=p: generate(infer, p, o.tokens) for p in prompts]
            last["ours"] = concurrently(fns)
            shares.append(decode_share(last["ours"]))
            return streamed_rate(last["ours"])

        def ref() -> float:
            last["raw"] = raw.generate(tokens, o.tokens)
            return streamed_rate(last["raw"])

        runs: dict[str, Callable[[], float]] = {"grpc": ours, "raw": ref}
        if server:
            fns = [lambda t=t: server.generate(t, o.tokens) for t in texts]
            runs["server"] = lambda: streamed_rate(concurrently(fns))
        for fn in runs.values():
            fn()
        res = b.interleaved(runs, o.repeats)
        counts = "/".join(str(s.num_tokens) for s in last["ours"])
        note = f"aggregate of {n} streams ({counts} tokens), --parallel {n}, ctx {n * o.ctx}"
        b.rows.append(compared(row, res["grpc"], res["raw"], "tok/s", target, note))
        b.rows.append(share_row(ROW_SHARE.format(n=n), shares[1:]))  # (the warm-up's left out)
        if server:
            b.rows.append(
                compared(server_row, res["grpc"], res["server"], "tok/s", ">= 1.0", f"-np {n}")
            )
        return median(res["grpc"])
