"""The stream4 section of slotwise bench: four concurrent greedy streams (--parallel 4, 4 x --ctx
cells), their aggregate streamed tokens/s through gRPC against the raw batched loop (every
sequence's token in one llama_decode per step), and against llama-server -np 4 when
--llama-server is given; and, after the stream1 section in the same run, the 4-stream rate over
the 1-stream rate.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.calls import PROMPTS, concurrently, generate, prepare_text, prompt_tokens
from benchmarks.harness import Bench
from benchmarks.results import Row, Stream, compared, median, streamed_rate

ROW_STREAM4 = "4 streams tok/s: gRPC / raw batched loop"
ROW_GAIN4 = "4 streams / 1 stream (slotwise)"
ROW_SERVER4 = "4 streams tok/s: slotwise / llama-server"


def run(b: Bench) -> None:
    """The four prompts at once on each side, interleaved."""
    o = b.o
    prompts = [prepare_text(b.prep, p) for p in PROMPTS]
    tokens = [prompt_tokens(p) for p in prompts]
    with (
        b.infer(ctx=4 * o.ctx, parallel=4) as infer,
        b.raw(ctx=4 * o.ctx, n_seq=4) as raw,
        b.llama_server(ctx=4 * o.ctx, parallel=4) as server,
    ):
        last: dict[str, list[Stream]] = {}

        def ours() -> float:
            fns = [lambda p=p: generate(infer, p, o.tokens) for p in prompts]
            last["ours"] = concurrently(fns)
            return streamed_rate(last["ours"])

        def ref() -> float:
            last["raw"] = raw.generate(tokens, o.tokens)
            return streamed_rate(last["raw"])

        runs: dict[str, Callable[[], float]] = {"grpc": ours, "raw": ref}
        if server:
            fns = [lambda t=t: server.generate(t, o.tokens) for t in PROMPTS]
            runs["server"] = lambda: streamed_rate(concurrently(fns))
        for fn in runs.values():
            fn()
        res = b.interleaved(runs, o.repeats)
        counts = "/".join(str(s.num_tokens) for s in last["ours"])
        note = f"aggregate of 4 streams ({counts} tokens), --parallel 4, ctx {4 * o.ctx}"
        b.rows.append(compared(ROW_STREAM4, res["grpc"], res["raw"], "tok/s", ">= 0.95", note))
        if b.stream1_rate:
            ours4 = median(res["grpc"])
            b.rows.append(
                Row(
                    ROW_GAIN4, ours4, "tok/s", b.stream1_rate, ours4 / b.stream1_rate,
                    "", "aggregate 4-stream rate over the 1-stream rate of this run",
                )
            )  # fmt: skip
        if server:
            b.rows.append(
                compared(ROW_SERVER4, res["grpc"], res["server"], "tok/s", ">= 1.0", "-np 4")
            )
