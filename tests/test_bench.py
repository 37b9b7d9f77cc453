"""Smoke test of the benchmark: every row comes out, with positive finite figures.

Runs `benchmarks.bench` end to end (services as subprocesses on loopback, the raw reference loop in
process) on the tiny `rope` pair with tiny counts. Timing targets are not checked here: the
figures of a random-weight model on a shared machine mean nothing.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path

import pytest

from benchmarks import (
    agent_loop,
    batched_streams,
    bench,
    context_shift,
    hybrid,
    image_stall,
    kv_types,
    one_stream,
    prepare,
    resent_chat,
    results,
    session_turns,
    shared,
    spec,
    spec_hybrid,
    text_stall,
    ttft,
)
from benchmarks.stall import ROOM_KEPT, StallRun, _Reader, _time_alone
from slotwise_core.tiny_models import TinyPair

EXPECTED = [
    one_stream.ROW_STREAM1,
    one_stream.ROW_TTFT,
    ttft.ROW_TTFT_THREADS,
    batched_streams.ROW_STREAM4,
    batched_streams.ROW_GAIN4,
    batched_streams.ROW_STREAM16,
    one_stream.ROW_SHARE1,
    batched_streams.ROW_SHARE.format(n=4),
    batched_streams.ROW_SHARE.format(n=16),
    *context_shift.ROW_SHIFT.values(),
    prepare.ROW_COUNT,
    prepare.ROW_PREPARE,
    prepare.ROW_PREPARE_HIT,
    prepare.ROW_PREPARE_BYTES,
    prepare.ROW_PREPARE8,
    image_stall.ROW_STALL_GAP,
    image_stall.ROW_STALL_RATE,
    text_stall.ROW_TEXTSTALL_GAP,
    text_stall.ROW_TEXTSTALL_ALONE,
    resent_chat.ROW_RESENT,
    resent_chat.ROW_RESENT_SESSION,
    session_turns.ROW_SESSION_BYTES,
    session_turns.ROW_SESSION_GAP,
    *(spec.row_drafts(task) for task in spec.tasks()),
    spec.ROW_BESIDE,
    spec.ROW_STREAMS4,
    spec_hybrid.ROW_DRAFTS,
    agent_loop.ROW,
    agent_loop.ROW_TENANT,
    *shared.ROWS,
    *hybrid.ROWS,
    kv_types.ROW_CELLS,
    kv_types.ROW_RATE,
]
STALL_SERVER_ROWS = (
    image_stall.ROW_STALL_SERVER,
    image_stall.ROW_STALL_SERVER_GAP,
    image_stall.ROW_STALL_SERVER_RATE,
    text_stall.ROW_TEXTSTALL_SERVER,
    text_stall.ROW_TEXTSTALL_SERVER_GAP,
)


def test_bench_smoke_on_tiny_rope(
    tiny: dict[str, TinyPair], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    argv = ["--model", str(tiny["rope"].model), "--threads", "1", "--repeats", "1"]
    argv += ["--tokens", "8", "--ctx", "2048", "--prep-requests", "2", "--json", str(out)]
    argv += ["--shift-ctx", "256", "--shift-tokens", "300"]
    argv += ["--session-cells", "600", "--session-turns", "2"]
    # the stall on the default tiny projector: the rows come out, the goals mean nothing here
    argv += ["--vision-width", "32", "--vision-layers", "1", "--stall-alone", "0.5"]
    # the text stall's B and the long TTFT prompt: a few hundred tokens; a short resent chat
    argv += ["--long-tokens", "600", "--resent-turns", "6", "--resent-tokens", "4"]
    argv += ["--spec-tokens", "64"]
    argv += ["--shared-ctx", "2048", "--shared-chats", "4", "--shared-system", "120"]
    argv += ["--shared-held", "8"]
    assert bench.main(argv) == 0

    printed = capsys.readouterr().out
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == sorted(EXPECTED)
    for name in EXPECTED:
        assert name in printed
        r = rows[name]
        if name == agent_loop.ROW_TENANT:  # (a count that must be 0: never another's text)
            assert r["ours"] == 0, r["note"]
            continue
        for key in ("ours", "reference", "ratio"):
            v = r[key]
            if v is not None:
                assert math.isfinite(v) and v > 0, (name, key, v)
        if name not in (prepare.ROW_COUNT, prepare.ROW_PREPARE, spec.ROW_BESIDE, hybrid.ROW_BYTES):
            assert r["ratio"] is not None, name
    # the hybrid chat: checkpoints spare most of the prompts (counts: the same on any machine),
    # and it goes on past the slot where no checkpoints would stop it
    assert rows[hybrid.ROW_DECODED]["ratio"] < 0.5, rows[hybrid.ROW_DECODED]["note"]
    # llama_decode takes a share of a stream's time, never more than the whole of it
    assert 0 < rows[one_stream.ROW_SHARE1]["ratio"] <= 1.0
    assert rows[hybrid.ROW_TURNS]["ours"] == 6 and rows[hybrid.ROW_TURNS]["ratio"] > 1
    assert hybrid.ROW_TURNS_SERVER not in rows
    # the image travels once, as its file
    assert rows[prepare.ROW_PREPARE_BYTES]["ratio"] <= 1.25
    # no llama-server given: its rows are skipped, not printed empty
    assert one_stream.ROW_SERVER1 not in rows and batched_streams.ROW_SERVER4 not in rows
    assert not any(name in rows for name in STALL_SERVER_ROWS)
    # A streamed through B's whole wait (a gap is shorter than B's TTFT)
    assert rows[image_stall.ROW_STALL_GAP]["ratio"] < 1.0
    assert rows[text_stall.ROW_TEXTSTALL_GAP]["ratio"] < 1.0
    assert "text prompt" in rows[text_stall.ROW_TEXTSTALL_GAP]["note"]
    # the resent chat fitted infer's context: its turns were not shifted
    resent = rows[resent_chat.ROW_RESENT]["note"]
    assert "it fits, no shift" in resent, resent
    # the tiny F32 pair: the same greedy tokens with and without drafts, alone and beside
    # another stream; and its greedy replies repeat themselves: drafts land
    assert rows[spec.ROW_BESIDE]["ours"] == 64, rows[spec.ROW_BESIDE]["note"]
    copy = rows[spec.row_drafts("copy")]
    assert "first difference none (the same tokens)" in copy["note"], copy["note"]
    # the pool's count of cells in use is llama.cpp's, and the pool held every chat at once
    assert rows[shared.ROW_CELLS]["ratio"] == 1.0, rows[shared.ROW_CELLS]["note"]
    assert rows[shared.ROW_HELD]["ours"] == 8, rows[shared.ROW_HELD]["note"]
    # q8_0 cells: 34 bytes for every 64 of f16's (a generated 64-wide head: the tiny rope
    # pair's 16 takes no quantized cell)
    assert rows[kv_types.ROW_CELLS]["ratio"] == 512 / 272, rows[kv_types.ROW_CELLS]["note"]
    # the shift rows really shifted, with the policy they asked for
    for name, row in context_shift.ROW_SHIFT.items():
        assert "shifts by " + name in rows[row]["note"], rows[row]["note"]


def test_streamed_rate_counts_tokens_after_the_latest_first_token() -> None:
    a = results.Stream(arrivals=[(1.0, 1), (2.0, 1), (3.0, 2)])
    b = results.Stream(arrivals=[(1.5, 1), (2.5, 1), (3.5, 1)])
    # after t=1.5: a has 1 + 2, b has 1 + 1 -> 5 tokens over 3.5 - 1.5 s
    assert results.streamed_rate([a, b]) == pytest.approx(5 / 2.0)
    # one message with every token: timed from the request
    assert results.streamed_rate([results.Stream(arrivals=[(3.0, 8)], t_sent=1.0)]) == 4.0
    with pytest.raises(results.BenchError):
        results.streamed_rate([results.Stream(arrivals=[(1.0, 1)])])


def test_stall_gap_spans_the_whole_wait() -> None:
    # A's tokens at 0.0, 0.1, 0.2 then a stall until 1.5; B sent at 0.25, first token at 1.4
    run = StallRun([0.0, 0.1, 0.2, 1.5, 1.6], alone_rate=10.0, b_sent=0.25, b_first=1.4)
    assert run.ttft == pytest.approx(1.15)
    assert run.a_tokens_during == 0 and run.rate_during == 0.0
    # the stall counts whole: from A's last token before B to its first after B's first token
    assert run.longest_gap == pytest.approx(1.3)
    steady = StallRun([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], alone_rate=10.0, b_sent=0.15, b_first=0.45)
    assert steady.longest_gap == pytest.approx(0.1)
    assert steady.a_tokens_during == 3
    assert steady.figures()["during_over_without"] == pytest.approx(1.0)


class _Ticking(_Reader):
    """A's tokens at a steady rate (no server)."""

    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate
        self.done = threading.Event()

    def read(self) -> None:
        while not self.done.wait(1 / self.rate):
            self.times.append(time.monotonic())

    def cut(self) -> None:
        self.done.set()


@pytest.mark.parametrize("room", [None, 10**6])
def test_a_is_timed_alone_as_asked_when_it_has_room(room: int | None) -> None:
    reader = _Ticking(500)
    reader.thread.start()
    try:
        rate, seconds = _time_alone(reader, 0.3, room)
    finally:
        reader.stop()
    assert seconds == pytest.approx(0.3, abs=0.1) and rate > 0


def test_a_timed_alone_leaves_most_of_its_slot_for_bs_wait() -> None:
    # llama-server's A can have `room` tokens: its time alone stops before it used 1/3 of them
    reader = _Ticking(500)
    reader.thread.start()
    try:
        time.sleep(0.1)
        n0 = len(reader.times)
        room = n0 + 60
        rate, seconds = _time_alone(reader, 5.0, room)
        used = len(reader.times) - n0
    finally:
        reader.stop()
    assert seconds < 2.0 and rate > 0
    assert used <= (room - n0) * (1 - ROOM_KEPT) + 10, used


def test_table_marks_targets() -> None:
    rows = [
        results.Row("fast enough", 99.0, "tok/s", 100.0, 0.99, ">= 0.97"),
        results.Row("too slow", 90.0, "tok/s", 100.0, 0.90, ">= 0.97"),
        results.Row("no target", 12.5, "ms"),
        results.Row("exact", 7.0, "cells", 7.0, 1.0, "== 1.0"),
        results.Row("not exact", 7.0, "cells", 8.0, 7 / 8, "== 1.0"),
    ]
    lines = results.format_table(rows).splitlines()
    assert lines[2].endswith("ok") and lines[3].endswith("MISS")
    assert not lines[4].rstrip().endswith(("ok", "MISS"))
    assert lines[5].endswith("ok") and lines[6].endswith("MISS")


def test_engine_process_prototype_streams_on_each_side(
    tiny: dict[str, TinyPair], capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import engine_process

    argv = ["--model", str(tiny["rope"].model), "--threads", "1", "--repeats", "1"]
    assert engine_process.main([*argv, "--tokens", "8"]) == 0
    printed = capsys.readouterr().out
    for side in ("raw loop", "thread", "process"):
        rate = re.search(rf"^  {side} +([0-9.]+) tok/s", printed, re.M)
        assert rate and math.isfinite(float(rate[1])) and float(rate[1]) > 0, printed
    assert "process / thread" in printed


def test_shared_prefix_burst_figures_on_tiny_rope(
    tiny: dict[str, TinyPair], capsys: pytest.CaptureFixture[str]
) -> None:
    """The burst section of benchmarks/shared_prefix.py, short: every figure printed and
    finite, the pool's cells llama.cpp's own count."""
    from benchmarks import shared_prefix

    argv = ["--model", str(tiny["rope"].model), "--threads", "1", "--ctx-size", "4096"]
    argv += ["--parallel", "4", "--system", "64", "--long", "256", "--layout", "pool"]
    assert shared_prefix.main(argv) == 0
    printed = capsys.readouterr().out
    pool = re.search(r"^pool .* ([0-9.]+) +(\d+) +(\d+) +(\d+)$", printed, re.M)
    assert pool and pool[2] == pool[3] and int(pool[4]) == 3, printed  # (3 chats shared it)
    for what in ("prompt \\(pool\\): its TTFT", "streams \\(pool\\): their tok/s"):
        ratio = re.search(rf"{what} .* ratio ([0-9.]+)$", printed, re.M)
        assert ratio and math.isfinite(float(ratio[1])) and float(ratio[1]) > 0, printed
