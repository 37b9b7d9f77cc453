"""What the bench's figures are made of: a stream as its reader saw it, its streamed rate, and
the rows of the table (medians of interleaved repeats) with their printing."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


class BenchError(RuntimeError):
    pass


# -- results ----------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    ours: float
    unit: str
    reference: float | None = None
    ratio: float | None = None
    target: str = ""  # e.g. ">= 0.97"; empty: informational
    note: str = ""
    spread: tuple[float, float] | None = None  # lowest and highest per-repeat ratio

    @property
    def meets(self) -> bool | None:
        if not self.target or self.ratio is None:
            return None
        op, value = self.target.split()
        if op == "==":  # (a count: exact)
            return abs(self.ratio - float(value)) < 1e-9
        return self.ratio >= float(value) if op == ">=" else self.ratio <= float(value)


def format_table(rows: Sequence[Row]) -> str:
    def fig(v: float | None, unit: str) -> str:
        if v is None:
            return "-"
        return f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}"

    head = ("benchmark", "slotwise", "reference", "ratio", "repeats", "target", "")
    lines = [
        (
            r.name,
            fig(r.ours, r.unit),
            fig(r.reference, r.unit),
            "-" if r.ratio is None else f"{r.ratio:.3f}",
            "-" if r.spread is None else f"{r.spread[0]:.2f}-{r.spread[1]:.2f}",
            r.target or "-",
            {True: "ok", False: "MISS", None: ""}[r.meets],
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    out = []
    for k, line in enumerate([head, *lines]):
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    notes = [f"  {r.name}: {r.note}" for r in rows if r.note]
    if notes:
        out += ["", "notes:", *notes]
    return "\n".join(out)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def compared(
    name: str,
    ours: Sequence[float],
    reference: Sequence[float],
    unit: str,
    target: str = "",
    note: str = "",
    scale: float = 1.0,
) -> Row:
    """Medians of both sides and of the ratio A / B taken within each repeat (the two ran back
    to back, so they saw the same machine)."""
    ratios = [a / b for a, b in zip(ours, reference, strict=True)]
    return Row(
        name, median(ours) * scale, unit, median(reference) * scale, median(ratios), target,
        note, (min(ratios), max(ratios)),
    )  # fmt: skip


@dataclass
class Stream:
    """One generation as seen by its reader: (arrival time, number of tokens) per message."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    shifts: list[str] = field(default_factory=list)
    finish: str = ""
    t_sent: float = 0.0
    decode_seconds: float = 0.0  # server side: time inside llama_decode (slotwise only)
    prefill_seconds: float = 0.0  # ... and from its start in its slot to its first token
    drafted: int = 0  # speculative: drafts verified
    accepted: int = 0  # ... and accepted
    cache_hits: int = 0  # (slotwise) drafts from the tenant's earlier requests (suffix)
    slot: int = -1  # (slotwise) where it ran
    prompt_cells: int = 0  # ... and its prompt's cells, reused ones included

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def add(self, t: float, n: int) -> None:
        if n:
            self.arrivals.append((t, n))

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.t_sent


def share_row(name: str, shares: Sequence[float]) -> Row:
    """The median share of repeats (their lowest and highest beside it)."""
    note = (
        "server side, same run: the share of the streams' time inside llama_decode (1 - it: "
        "the engine's own cost per step)"
    )
    return Row(name, median(shares), "", None, median(shares), "", note, (min(shares), max(shares)))


def decode_share(streams: Sequence[Stream]) -> float:
    """What of the requests' time (sent to last token, as their reader saw it) the server
    spent in its slot (its prefill, then llama_decode for its tokens): 1.0 when nothing but
    llama.cpp stands between the model and the client. Both are of the same run, so a
    machine whose speed changes from second to second moves them together."""
    live = [s for s in streams if s.arrivals]
    inside = max((s.prefill_seconds + s.decode_seconds for s in live), default=0.0)
    if inside <= 0:
        raise BenchError("no decode time reported (not a slotwise stream?)")
    window = max(s.arrivals[-1][0] for s in live) - min(s.t_sent for s in live)
    return inside / window


def streamed_rate(streams: Sequence[Stream]) -> float:
    """Aggregate tokens/s after the latest first token (all streams under way) to the end.

    When (almost) nothing arrived after that (a tiny model's whole answer in one message), the
    rate is taken from the request instead, prefill included.
    """
    live = [s for s in streams if s.arrivals]
    if not live:
        raise BenchError("no stream produced a token")
    t0 = max(s.arrivals[0][0] for s in live)
    t1 = max(s.arrivals[-1][0] for s in live)
    n = sum(k for s in live for t, k in s.arrivals if t > t0)
    if n < 2 or t1 <= t0:  # (nearly) everything came in one message per stream
        t0 = min(s.t_sent for s in live)
        n = sum(s.num_tokens for s in live)
    if n < 2 or t1 <= t0:
        raise BenchError(
            f"too few tokens to time: {[s.num_tokens for s in streams]} (end of generation "
            "came at once? try another model or prompt)"
        )
    return n / (t1 - t0)
