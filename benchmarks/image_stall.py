"""The stall section of slotwise bench: the image prefill stall (benchmarks/stall.py measures
it). Stream A generates text while client B sends a 1000x1000 JPEG (a new one each run) through
a projector heavy enough to cost what a real one does: the tiny qwen2vl pair with a projector of
--vision-width x --vision-layers (or --model with --mmproj); it needs no Gemma. infer
--parallel 2, --stall-decode-threads for generation, --encode-threads for the image.

- A's longest wait for a token over B's wait (B's Prepare to its first token), goal <= 0.05;
- A's tokens/s during B's wait over the --stall-alone seconds before B was sent, goal >= 0.5;
- with --llama-server: B's TTFT on slotwise over llama-server's (the same pair, -np 2), and
  llama-server's own two figures for reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from benchmarks.harness import Bench
from benchmarks.results import compared, median
from benchmarks.stall import ServerStall, SlotwiseStall, StallRun, heavy_pair, stall_jpeg
from slotwise.v1 import infer_pb2_grpc, prep_pb2_grpc

ROW_STALL_GAP = "image stall: A's longest gap / B's TTFT"
ROW_STALL_RATE = "image stall: A's tok/s during B's prefill / without"
ROW_STALL_SERVER = "image stall: B's TTFT slotwise / llama-server"
ROW_STALL_SERVER_GAP = "image stall, llama-server: A's longest gap / B's TTFT"
ROW_STALL_SERVER_RATE = "image stall, llama-server: A's tok/s during / without"


def run(b: Bench) -> None:
    o = b.o
    ban: Sequence[int] = ()
    if o.mmproj and o.model:
        model, mmproj = o.model, o.mmproj
        what = f"{model.name} + {mmproj.name}"
    else:
        pair = heavy_pair(b.log_dir / "stall", o.vision)
        model, mmproj = pair.model, pair.mmproj
        what = f"tiny mrope pair, vision {o.vision.width} x {o.vision.layers}"
        ban = range(128, 256)  # the pair's non-ASCII byte tokens (see ServerStall)
    pair_args = ["--model", str(model), "--mmproj", str(mmproj)]
    enc = o.encode_threads or o.threads
    infer_args = [*pair_args, "--parallel", "2", "--ctx-size", str(2 * o.stall_ctx)]
    infer_args += ["--threads", str(o.stall_decode_threads), "--encode-threads", str(enc)]
    prep = b.service("prep_service", [*pair_args, "--threads", "1"])
    try:
        infer = b.service("infer_service", infer_args)
        try:
            with b.llama_server(
                ctx=2 * o.stall_ctx, parallel=2, model=model, mmproj=mmproj
            ) as server:
                _rows(
                    b,
                    SlotwiseStall(
                        prep_pb2_grpc.PrepServiceStub(prep.channel),
                        infer_pb2_grpc.InferServiceStub(infer.channel),
                    ),
                    ServerStall(server.port, ban) if server else None,
                    what=what,
                    infer_flags=" ".join(infer_args[len(pair_args) :]),
                )
        finally:
            infer.stop()
    finally:
        prep.stop()


def _rows(
    b: Bench, ours: SlotwiseStall, theirs: ServerStall | None, *, what: str, infer_flags: str
) -> None:
    """Both sides interleaved, after one warm-up run each; the rows from the medians."""
    o = b.o
    seed = iter(range(1, 1 << 30))  # a new picture every run: no cache may answer B
    got: dict[str, list[StallRun]] = {"slotwise": [], "llama-server": []}
    sides: dict[str, Callable[[], float]] = {}

    def b_image() -> tuple[bytes | None, int, str | None]:
        n = next(seed)
        return stall_jpeg(n), n, None

    def side(name: str, target: SlotwiseStall | ServerStall) -> Callable[[], float]:
        return b.stall_side("stall", name, target, b_image, got[name])

    sides["slotwise"] = side("slotwise", ours)
    if theirs:
        sides["llama-server"] = side("llama-server", theirs)
    for fn in sides.values():  # warm-up: first encode, first image of each size
        fn()
    for runs in got.values():
        runs.clear()
    b.interleaved(sides, o.repeats)
    mine = got["slotwise"]
    cells = mine[-1].b_cells
    during = median([r.a_tokens_during for r in mine])
    shifts = median([r.shifts_during for r in mine])
    calm = median([r.longest_gap_between_shifts for r in mine]) * 1e3
    note = (
        f"{what}; B: {cells} image cells ({len(stall_jpeg(0)) >> 10} KiB JPEG, a new one "
        f"each run); infer {infer_flags}; A's longest wait for a token over B's wait (B's "
        f"Prepare to its first token); medians: A got {during:.0f} tokens and made "
        f"{shifts:.0f} context shifts during B's TTFT; its longest gap leaving out the "
        f"shifts: {calm:.0f} ms"
    )
    b.rows.append(
        compared(
            ROW_STALL_GAP, [r.longest_gap for r in mine], [r.ttft for r in mine], "ms",
            "<= 0.05", note, scale=1e3,
        )
    )  # fmt: skip
    b.rows.append(
        compared(
            ROW_STALL_RATE, [r.rate_during for r in mine], [r.alone_rate for r in mine],
            "tok/s", ">= 0.5", f"A alone: the {o.stall_alone:g} s before B was sent",
        )
    )  # fmt: skip
    if theirs:
        _server_rows(b, mine, got["llama-server"], theirs)


def _server_rows(b: Bench, mine: list[StallRun], ref: list[StallRun], theirs: ServerStall) -> None:
    """B's TTFT on slotwise over llama-server's, and llama-server's own figures."""
    o = b.o
    note = (
        f"llama-server -np 2 -t {o.threads} -c {2 * o.stall_ctx} ({theirs.slot_ctx} cells "
        f"per slot: A timed alone {median([r.alone_seconds for r in ref]):.2f} s, median, "
        "to leave it room for B's wait), the same pair, A and B through /completion (B's "
        "image as multimodal_data, cache_prompt off"
        + (", byte tokens 128-255 banned: it streams no incomplete UTF-8" if theirs.extra else "")
        + "); lower is better"
    )
    b.rows.append(
        compared(
            ROW_STALL_SERVER, [r.ttft for r in mine], [r.ttft for r in ref], "ms", "<= 1.0",
            note, scale=1e3,
        )
    )  # fmt: skip
    b.rows.append(
        compared(
            ROW_STALL_SERVER_GAP, [r.longest_gap for r in ref], [r.ttft for r in ref], "ms",
            note=f"for reference; median: A got {median([r.a_tokens_during for r in ref]):.0f}"
            " tokens during B's TTFT", scale=1e3,
        )
    )  # fmt: skip
    b.rows.append(
        compared(
            ROW_STALL_SERVER_RATE, [r.rate_during for r in ref],
            [r.alone_rate for r in ref], "tok/s", note="for reference",
        )
    )  # fmt: skip
