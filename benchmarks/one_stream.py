"""The stream1 section of slotwise bench: one greedy stream's streamed tokens/s through gRPC
(Prepare once, then Generate) against the raw llama-cpp-python loop in this process, and
against llama-server (-np 1) when --llama-server is given; --tokens each, --ctx cells.

Its servers also give the ttft section's first row (benchmarks/ttft.py has the second): time to
first token of a new ~250-token prompt each time, Prepare + Generate until the first delta
against tokenize + prefill + sample in process; lower is better.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.calls import PROMPTS, TTFT_PROMPT, generate, prepare_text, prompt_tokens
from benchmarks.harness import Bench
from benchmarks.reference import RawContext
from benchmarks.results import Stream, compared, decode_share, median, share_row, streamed_rate

ROW_STREAM1 = "1 stream tok/s: gRPC / raw loop"
ROW_SERVER1 = "1 stream tok/s: slotwise / llama-server"
ROW_TTFT = "TTFT ms: gRPC / in-process"
ROW_SHARE1 = "1 stream: streamed / inside llama_decode"


def run(b: Bench) -> None:
    """One stream (when --only names stream1) and the TTFT in process (when it names ttft),
    on one infer and one raw context; llama-server beside them for stream1 alone."""
    o = b.o
    prep = b.prep
    prompt = prepare_text(prep, PROMPTS[0])
    tokens = prompt_tokens(prompt)
    with (
        b.infer(ctx=o.ctx, parallel=1) as infer,
        b.raw(ctx=o.ctx, n_seq=1) as raw,
        b.llama_server(ctx=o.ctx, parallel=1, wanted="stream1" in o.only) as server,
    ):
        if "stream1" in o.only:
            last: dict[str, Stream] = {}
            shares: list[float] = []

            def ours() -> float:
                s = last["ours"] = generate(infer, prompt, o.tokens)
                shares.append(decode_share([s]))
                return streamed_rate([s])

            def ref() -> float:
                s = last["raw"] = raw.generate([tokens], o.tokens)[0]
                return streamed_rate([s])

            runs: dict[str, Callable[[], float]] = {"grpc": ours, "raw": ref}
            if server:
                runs["server"] = lambda: streamed_rate([server.generate(PROMPTS[0], o.tokens)])
            for fn in runs.values():  # warm-up: page in the weights, open the channels
                fn()
            # cold, both: later requests reuse the prompt's cells, whose last token is then
            # decoded alone, and batch-1 numerics may change a greedy pick
            same = last["ours"].token_ids == last["raw"].token_ids
            res = b.interleaved(runs, o.repeats)
            engine = last["ours"].num_tokens / max(last["ours"].decode_seconds, 1e-9)
            b.stream1_rate = median(res["grpc"])
            note = (
                f"{last['ours'].num_tokens} tokens, prompt {len(tokens)} tokens, ctx {o.ctx}; "
                f"same tokens as the raw loop (cold): {'yes' if same else 'NO'}; inside "
                f"llama_decode (server-side) the last run went at {engine:.1f} tok/s"
            )
            b.rows.append(compared(ROW_STREAM1, res["grpc"], res["raw"], "tok/s", ">= 0.97", note))
            b.rows.append(share_row(ROW_SHARE1, shares[1:]))  # (the warm-up's left out)
            if server:
                b.rows.append(compared(ROW_SERVER1, res["grpc"], res["server"], "tok/s", ">= 1.0"))
        if "ttft" in o.only:
            ttft_in_process(b, prep, infer, raw)


def ttft_in_process(b: Bench, prep: Any, infer: Any, raw: RawContext) -> None:
    """The ttft section's first row, on this section's prep, infer and raw context."""
    # a new prompt every time: a cached prefix (infer reuses what a slot holds) is not timed
    serial = iter(range(1 << 30))

    def ours() -> float:
        text = f"Report {next(serial)}. {TTFT_PROMPT}"
        t0 = time.perf_counter()
        prompt = prepare_text(prep, text)
        return generate(infer, prompt, 1, t_sent=t0).ttft

    def ref() -> float:
        return raw.time_to_first_token(f"Report {next(serial)}. {TTFT_PROMPT}")

    ours(), ref()
    res = b.interleaved({"grpc": ours, "raw": ref}, max(3, b.o.repeats) * 2)
    n = len(raw.m.tokenize(f"Report 0. {TTFT_PROMPT}"))
    note = (
        f"prompt {n} tokens, a new one each time; Prepare + Generate until the first delta "
        "vs tokenize + prefill + sample in process; lower is better"
    )
    b.rows.append(compared(ROW_TTFT, res["grpc"], res["raw"], "ms", note=note, scale=1e3))
