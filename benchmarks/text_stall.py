"""The textstall section of slotwise bench: the stall of the stall section with B a long text
prompt (--long-tokens, a new one each run) instead of an image, on the text model. Stream A
generates text while B waits for its first token.

- A's longest wait for a token over B's wait (B's Prepare to its first token), goal <= 0.05;
- B's TTFT with A streaming over B's TTFT alone (no A running), goal <= 1.05;
- with --llama-server: B's TTFT on slotwise over llama-server's (-np 2, the same cells per
  slot), and llama-server's own gap for reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from benchmarks.calls import PROMPTS
from benchmarks.harness import Bench, round_up
from benchmarks.results import BenchError, compared, median
from benchmarks.stall import BTimes, ServerStall, SlotwiseStall, StallError, StallRun

ROW_TEXTSTALL_GAP = "text stall: A's longest gap / B's TTFT"
ROW_TEXTSTALL_ALONE = "text stall: B's TTFT with A streaming / B's TTFT alone"
ROW_TEXTSTALL_SERVER = "text stall: B's TTFT slotwise / llama-server"
ROW_TEXTSTALL_SERVER_GAP = "text stall, llama-server: A's longest gap / B's TTFT"


def run(b: Bench) -> None:
    """The stall with B a --long-tokens text prompt (a new one each run), on the text model:
    infer --parallel 2, each slot with room for B's prompt and A's run (A's context shifts
    when its slot is full); llama-server -np 2 with the same cells per slot (at most the
    model's n_ctx_train: A's time alone is cut to leave it room for B's wait)."""
    o = b.o
    n_b = b.long_tokens
    slot = o.textstall_ctx or round_up(n_b + 2048)
    if slot < n_b + 64:
        raise BenchError(f"--textstall-ctx {slot} has no room for B's {n_b}-token prompt")
    flags = f"--parallel 2 --ctx-size {2 * slot} --threads {o.threads} --threads-batch "
    flags += str(o.threads)
    with (
        b.infer(ctx=2 * slot, parallel=2) as infer,
        b.llama_server(ctx=2 * slot, parallel=2) as server,
    ):
        try:
            ours = SlotwiseStall(b.prep, infer)
            theirs = ServerStall(server.port) if server else None
        except StallError as e:
            raise BenchError(f"text stall: {e}") from e
        _rows(b, ours, theirs, infer_flags=flags)


def _measure(
    b: Bench, ours: SlotwiseStall, theirs: ServerStall | None
) -> tuple[dict[str, list[StallRun]], list[BTimes]]:
    """Slotwise with A, slotwise B alone (and llama-server with A) interleaved, after one
    warm-up of B with a short prompt on each server; their runs, and B's times alone."""
    serial = itertools.count(1)  # a new prompt every run: no cache may answer B
    got: dict[str, list[StallRun]] = {"slotwise": [], "llama-server": []}
    alone: list[BTimes] = []

    def b_text() -> tuple[bytes | None, int, str | None]:
        k = next(serial)
        return None, k, b.long_text(k)

    def with_a(name: str, target: SlotwiseStall | ServerStall) -> Callable[[], float]:
        return b.stall_side("text stall", name, target, b_text, got[name])

    def b_alone() -> float:
        k = next(serial)
        try:
            times = ours.b_alone(None, k, text=b.long_text(k))
        except StallError as e:
            raise BenchError(f"text stall, B alone: {e}") from e
        alone.append(times)
        return times.ttft

    sides: dict[str, Callable[[], float]] = {"slotwise": with_a("slotwise", ours)}
    sides["alone"] = b_alone
    if theirs:
        sides["llama-server"] = with_a("llama-server", theirs)
    try:
        for target in (ours, theirs) if theirs else (ours,):  # warm-up: a short B
            target.b_alone(None, text=f"Warm-up. {PROMPTS[0]}")
    except StallError as e:
        raise BenchError(f"text stall, warm-up: {e}") from e
    b.interleaved(sides, b.o.repeats)
    return got, alone


def _rows(b: Bench, ours: SlotwiseStall, theirs: ServerStall | None, *, infer_flags: str) -> None:
    """The runs of :func:`_measure`; the rows from the medians."""
    o = b.o
    got, alone = _measure(b, ours, theirs)
    mine = got["slotwise"]
    during = median([r.a_tokens_during for r in mine])
    shifts = median([r.shifts_during for r in mine])
    rate = median([r.rate_during / r.alone_rate for r in mine])
    note = (
        f"{b.model.name}; B: {mine[-1].b_tokens}-token text prompt (a new one each run), "
        f"max_tokens 2; infer {infer_flags}; A's longest wait for a token over B's wait "
        f"(B's Prepare to its first token); medians: A got {during:.0f} tokens during B's "
        f"TTFT at {rate:.2f} of its rate alone ({o.stall_alone:g} s before B), "
        f"{shifts:.0f} context shifts"
    )
    b.rows.append(
        compared(
            ROW_TEXTSTALL_GAP, [r.longest_gap for r in mine], [r.ttft for r in mine], "ms",
            "<= 0.05", note, scale=1e3,
        )
    )  # fmt: skip
    note = (
        "B alone: the same kind of prompt (a new one) with no A running, interleaved with "
        "the runs beside A; lower is better"
    )
    b.rows.append(
        compared(
            ROW_TEXTSTALL_ALONE, [r.ttft for r in mine], [t.ttft for t in alone], "ms",
            "<= 1.05", note, scale=1e3,
        )
    )  # fmt: skip
    if theirs:
        _server_rows(b, mine, got["llama-server"], theirs)


def _server_rows(b: Bench, mine: list[StallRun], ref: list[StallRun], theirs: ServerStall) -> None:
    """B's TTFT on slotwise over llama-server's, and llama-server's own gap."""
    o = b.o
    cut = median([r.alone_seconds for r in ref])
    note = (
        f"llama-server -np 2 -t {o.threads} -tb {o.threads} -c {2 * (theirs.slot_ctx)}: "
        f"{theirs.slot_ctx} cells per slot, the same text model; A and B through "
        f"/completion (cache_prompt off); B's TTFT with A streaming on both; A timed alone "
        f"{cut:.2f} s (median) there; lower is better"
    )
    b.rows.append(
        compared(
            ROW_TEXTSTALL_SERVER, [r.ttft for r in mine], [r.ttft for r in ref], "ms",
            "<= 1.0", note, scale=1e3,
        )
    )  # fmt: skip
    b.rows.append(
        compared(
            ROW_TEXTSTALL_SERVER_GAP, [r.longest_gap for r in ref], [r.ttft for r in ref],
            "ms", note=f"for reference; medians: A got "
            f"{median([r.a_tokens_during for r in ref]):.0f} tokens during B's TTFT, at "
            f"{median([r.rate_during / r.alone_rate for r in ref]):.2f} of its rate alone",
            scale=1e3,
        )
    )  # fmt: skip
