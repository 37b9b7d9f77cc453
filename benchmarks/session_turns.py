"""The session section of slotwise bench: what a session turn writes, and what its end costs
the other stream. A session of ~--session-cells cells takes --session-turns short turns while
another stream generates. Bytes written come from infer's metrics; a whole-state write (what
every turn wrote before the journal) is the session's checkpoint file, made at the end by
SaveSession.

- bytes written per cell a turn added over a whole-state write's per cell, goal <= 0.02;
- per turn, the other stream's longest gap that overlaps the turn's end (its last token to its
  write) over its median gap, median over the turns, goal <= 1.5.
"""

from __future__ import annotations

import http.client
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.calls import PROMPTS, TTFT_PROMPT, generate, prepare_text, prompt_tokens
from benchmarks.harness import Bench
from benchmarks.results import BenchError, Row, Stream, median
from benchmarks.servers import free_port
from slotwise.v1 import infer_pb2, infer_pb2_grpc

ROW_SESSION_BYTES = "session turn: bytes written per cell added / a whole-state write's"
ROW_SESSION_GAP = "session turn's end: other stream's longest gap / its median gap"  # median/turn


def run(b: Bench) -> None:
    """The session's long first turn, then its short turns beside the other stream."""
    o = b.o
    sessions, metrics_port = b.log_dir / "sessions", free_port()
    words = TTFT_PROMPT.split()
    while len(prompt_tokens(prepare_text(b.prep, " ".join(words)))) < o.session_cells:
        words += TTFT_PROMPT.split()
    n = len(prompt_tokens(prepare_text(b.prep, " ".join(words))))
    prompt = prepare_text(b.prep, " ".join(words[: len(words) * o.session_cells // n]))
    extra = ["--sessions-dir", str(sessions), "--metrics-port", str(metrics_port)]
    ctx = 2 * (o.session_cells + 64 * (o.session_turns + 2) + o.tokens)
    with b.infer(ctx=ctx, parallel=2, extra=extra) as infer:

        def written() -> float:
            return scrape_metric(metrics_port, "slotwise_infer_session_bytes_written_total")

        infer.CreateSession(infer_pb2.CreateSessionRequest(session_id="bench"), timeout=30)
        session_turn(infer, prompt, 4)  # the long first turn
        short = prepare_text(b.prep, " And then, in a few words, what happened next?")
        other_prompt = prepare_text(b.prep, PROMPTS[1])
        other: dict[str, Stream] = {}
        started = threading.Event()

        def other_stream() -> None:
            other["s"] = generate(infer, other_prompt, 1 << 16, on_token=started.set,
                                  until=lambda: "done" in other)  # fmt: skip

        reader = threading.Thread(target=other_stream, daemon=True)
        reader.start()
        if not started.wait(300):
            raise BenchError("the other stream never started")
        per_cell, cells, windows = [], [], []
        for _ in range(o.session_turns):
            before = written()
            added, t_last, t_end = session_turn(infer, short, 16)
            cells.append(added)
            windows.append((t_last, t_end))  # the turn's end: its last token to its write
            per_cell.append((written() - before) / max(added, 1))
        other["done"] = Stream()
        reader.join(300)
        info = infer.SaveSession(
            infer_pb2.SaveSessionRequest(session_id="bench"), timeout=120
        ).session
    whole = (sessions / "bench.session").stat().st_size
    whole_per_cell, ours = whole / max(median(cells), 1), median(per_cell)
    note = (
        f"a {info.num_cells}-cell session, turns of {median(cells):.0f} cells; its "
        f"checkpoint (KV state) is {whole / 1e6:.1f} MB, written on swap-out, on drain, or "
        "once as many cells as it holds were added"
    )
    ratio = ours / whole_per_cell
    b.rows.append(Row(ROW_SESSION_BYTES, ours, "B/cell", whole_per_cell, ratio, "<= 0.02", note))
    gaps = other_gaps(other.get("s"), windows)
    if gaps is None:
        raise BenchError("the other stream had no tokens around the session turns' ends")
    longest, typical = gaps
    note = (
        "per turn the other stream's longest gap that overlaps the turn's end (its last "
        "token to its write), median over the turns"
    )
    b.rows.append(Row(ROW_SESSION_GAP, longest, "s", typical, longest / typical, "<= 1.5", note))


def session_turn(
    infer: infer_pb2_grpc.InferServiceStub, prompt: Any, max_tokens: int
) -> tuple[int, float, float]:
    """One turn of session "bench": the cells it added (prompt and reply), when its last token
    and when its end (written) arrived."""
    req = infer_pb2.GenerateRequest(
        prompt=prompt, session_id="bench", max_tokens=max_tokens,
        sampling=infer_pb2.SamplingParams(temperature=0.0),
    )  # fmt: skip
    t_last = time.perf_counter()
    for r in infer.Generate(req, timeout=600):
        if r.WhichOneof("event") == "delta":
            t_last = time.perf_counter()
        if r.WhichOneof("event") == "finished":
            f = r.finished
            if f.reason == infer_pb2.FINISH_REASON_ERROR or f.persistence not in (
                infer_pb2.PERSISTENCE_SAVED,
            ):
                raise BenchError(f"the session turn was not saved: {f.error or f.persistence}")
            u = f.usage
            cells = u.num_prompt_cells - u.num_reused_cells + u.num_generated_tokens
            return cells, t_last, time.perf_counter()
    raise BenchError("the session turn ended without a Finished event")


def scrape_metric(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise BenchError(f"metric {name} not found")


def other_gaps(
    s: Stream | None, windows: Sequence[tuple[float, float]]
) -> tuple[float, float] | None:
    """(per window the longest gap between the stream's tokens that overlaps it, as a median
    over the windows; the stream's median gap)."""
    if s is None or len(s.arrivals) < 3:
        return None
    gaps = list(itertools.pairwise(t for t, _ in s.arrivals))
    longest = []
    for t0, t1 in windows:
        inside = [b - a for a, b in gaps if a < t1 and b > t0]
        if inside:
            longest.append(max(inside))
    if not longest:
        return None
    return median(longest), median([b - a for a, b in gaps])
