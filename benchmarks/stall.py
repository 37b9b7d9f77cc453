"""The prefill stall: stream A generates text while client B sends a 1000x1000 JPEG through a
projector heavy enough to cost what a real one does (the image stall), or a long text prompt (the
text stall).

The measuring code shared by `slotwise bench --only stall textstall` (rows, llama-server beside
it), ``tests/image_stall.py`` and ``tests/test_image_stall.py``:

- :func:`heavy_pair` writes the tiny qwen2vl ("mrope") pair with its vision tower widened
  (same token counts, a costly encode);
- :class:`SlotwiseStall` and :class:`ServerStall` run one measurement against slotwise (gRPC) or
  llama-server (HTTP): A streams greedily; after ``settle_s`` it is timed alone for ``alone_s``;
  then B sends its prompt (a picture, or ``text`` alone) and waits for its first token; A is
  stopped once it has a token after that one. Where A's slot holds a bounded number of tokens
  (llama-server: ``n_ctx`` of a slot, it does not shift), A's time alone is cut short so that
  at least 2/3 of what A has left remains for B's wait, at A's rate so far;
- ``b_alone`` of either runs B with no A beside it (B's TTFT alone);
- :class:`StallRun` holds A's token arrivals and B's times, and computes the figures: B's time
  to first token, A's longest gap between two tokens over B's wait (goal <= 0.05 of B's TTFT),
  and A's tokens/s during B's wait against alone (goal >= 0.5).

Every image has its own seed, every text B its own first words: neither side may answer B from a
cache of an earlier one.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.images import make_jpeg
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import TinyPair, Vision, write_tiny_models

# The heavy projector of the documented figures (issue 13).
HEAVY = Vision(width=512, layers=8)
IMAGE_SIDE = 1000
SETTLE_S = 1.0  # A streams this long before it is timed alone
ALONE_S = 2.0  # A's rate alone is taken over this long
TAIL_S = 5.0  # after B's first token, wait at most this long for A's next one
ROOM_KEPT = 2 / 3  # of the tokens A has left when timed alone, this share is kept for B's wait
TICK_S = 0.02  # how often A's time alone looks at A's tokens
ALONE_MIN_TOKENS = 2  # A's time alone goes on past alone_s (up to ALONE_MAX_S) until it has these
ALONE_MAX_S = 60.0

A_TEXT = (
    "Chapter one. The rain had not stopped for three days when the old lighthouse keeper "
    "finally decided to walk down to the village. He took his coat and"
)
B_TEXT = "Picture {n}: {marker}\nDescribe this picture in detail."


class StallError(RuntimeError):
    pass


def heavy_pair(out_dir: Path, vision: Vision = HEAVY) -> TinyPair:
    """The tiny mrope pair with ``vision``'s tower, written into ``out_dir/mrope``."""
    return write_tiny_models(Path(out_dir), ["mrope"], vision=vision)["mrope"]


def stall_jpeg(seed: int, side: int = IMAGE_SIDE) -> bytes:
    """B's image: a new one for every seed (neither server's cache may answer it)."""
    return make_jpeg(side, side, seed)


# -- the figures ------------------------------------------------------------------------------


@dataclass
class StallRun:
    """One measurement: A's token arrival times and B's (all ``time.monotonic()``)."""

    a_times: list[float]
    alone_rate: float  # A's tokens/s before B was sent
    b_sent: float
    b_first: float
    b_admitted: float | None = None  # slotwise: B's Started event
    a_shifts: list[float] = field(default_factory=list)  # times of A's context shifts
    b_cells: int = 0  # cells of B's image (slotwise: from Prepare)
    b_tokens: int = 0  # B's text tokens (slotwise: from Prepare)
    alone_seconds: float = 0.0  # how long A was timed alone (less than asked: its slot's end)

    @property
    def ttft(self) -> float:
        return self.b_first - self.b_sent

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.a_times if t0 <= t <= t1)

    @property
    def a_tokens_during(self) -> int:
        """A's tokens from B's request to B's first token."""
        return self.tokens_between(self.b_sent, self.b_first)

    def _gaps(self, *, without_shifts: bool = False) -> list[float]:
        """A's waits between consecutive tokens whose interval overlaps [B sent, B's first
        token], so a stall that starts before B was sent or ends after B's first token counts
        whole (without_shifts: leaving out those in which A's context shifted)."""
        return [
            b - a
            for a, b in itertools.pairwise(self.a_times)
            if b >= self.b_sent
            and a <= self.b_first
            and not (without_shifts and any(a < t <= b for t in self.a_shifts))
        ]

    @property
    def longest_gap(self) -> float:
        """A's longest wait for a token over B's wait (the window itself when A got nothing
        in it)."""
        return max(self._gaps(), default=self.ttft)

    @property
    def longest_gap_between_shifts(self) -> float:
        """As longest_gap, leaving out the gaps in which A's context shifted."""
        return max(self._gaps(without_shifts=True), default=self.ttft)

    @property
    def shifts_during(self) -> int:
        """A's context shifts (slotwise's Shift events) from B's request to its first token."""
        return sum(1 for t in self.a_shifts if self.b_sent <= t <= self.b_first)

    @property
    def rate_during(self) -> float:
        return self.a_tokens_during / self.ttft

    def figures(self) -> dict[str, float]:
        """The figures as `tests/image_stall.py` printed them."""
        return {
            "b_ttft_s": round(self.ttft, 3),
            "a_longest_gap_s": round(self.longest_gap, 3),
            "gap_over_ttft": round(self.longest_gap / self.ttft, 3),
            "a_tokens_during_b": self.a_tokens_during,
            "a_tokens_per_s_during_b": round(self.rate_during, 1),
            "a_tokens_per_s_without": round(self.alone_rate, 1),
            "during_over_without": round(self.rate_during / self.alone_rate, 3),
            "a_shifts_during_b": self.shifts_during,
            "a_longest_gap_between_shifts_s": round(self.longest_gap_between_shifts, 3),
        }


# -- one measurement, either server -----------------------------------------------------------


class _Reader:
    """A's stream, read on its own thread into ``times`` (one entry per token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.ended = ""  # why A ended by itself (it should not)
        self.shifts: list[float] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._guarded, daemon=True)

    def _guarded(self) -> None:
        try:
            self.read()
        except Exception as e:  # the stream broke or was cut by stop()
            if not self.stopping:
                self.ended = f"error: {e}"
        else:
            if not self.stopping and not self.ended:
                self.ended = "ended"

    def read(self) -> None:
        raise NotImplementedError

    def cut(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.stopping = True
        self.cut()
        self.thread.join(30)


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, reader: _Reader) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if reader.ended:
            hint = (
                " (A's slot is full: a larger ctx?)"
                if "LENGTH" in reader.ended or "limit" in reader.ended
                else ""
            )
            raise StallError(f"A's stream {reader.ended} while {what}{hint}")
        if time.monotonic() > deadline:
            raise StallError(f"timed out after {timeout:.0f}s while {what}")
        time.sleep(0.005)


@dataclass
class BTimes:
    """One B request: when it was sent, admitted (slotwise's Started), got its first token; its
    prompt's image cells and text tokens (slotwise: from Prepare)."""

    sent: float
    admitted: float | None
    first: float
    cells: int = 0
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first - self.sent


def _time_alone(reader: _Reader, alone_s: float, room: int | None) -> tuple[float, float]:
    """A alone for alone_s, or less where A would otherwise leave less than ROOM_KEPT of the
    tokens it has left (``room``: A's tokens in all, None: no bound) for B's wait, at its rate
    so far; longer (up to ALONE_MAX_S) while A has fewer than ALONE_MIN_TOKENS tokens in it (a
    machine busy with other work). Returns (A's tokens/s, the seconds it was timed)."""
    n0, t0 = len(reader.times), time.monotonic()
    if alone_s <= 0:
        return float("nan"), 0.0
    budget = None if room is None else (room - n0) * (1 - ROOM_KEPT)
    while not reader.ended:
        elapsed = time.monotonic() - t0
        used = len(reader.times) - n0
        if elapsed >= alone_s and (used >= ALONE_MIN_TOKENS or elapsed >= ALONE_MAX_S):
            break
        if budget is not None and used + used / max(elapsed, 1e-3) * TICK_S >= budget:
            break
        time.sleep(TICK_S if elapsed >= alone_s else min(TICK_S, alone_s - elapsed))
    n1, t1 = len(reader.times), time.monotonic()
    return (n1 - n0) / (t1 - t0), t1 - t0


def _measure(
    reader: _Reader,
    b: Callable[[], BTimes],
    *,
    settle_s: float,
    alone_s: float,
    warm_tokens: int,
    room: int | None = None,
) -> StallRun:
    """A streams; after settle_s (and warm_tokens) A is timed alone for alone_s (see
    _time_alone: ``room`` is how many tokens A can have in all, None: no bound), then B runs;
    A stops once it has a token after B's first."""
    reader.thread.start()
    try:
        t_start = time.monotonic()
        _wait_for(
            lambda: len(reader.times) >= warm_tokens and time.monotonic() - t_start >= settle_s,
            60, "waiting for A to stream", reader,
        )  # fmt: skip
        alone, alone_seconds = _time_alone(reader, alone_s, room)
        bt = b()
        if reader.ended:
            raise StallError(f"A's stream {reader.ended} during B's wait (a larger ctx?)")
        _wait_for(
            lambda: bool(reader.times) and reader.times[-1] > bt.first,
            TAIL_S, "waiting for A's token after B's first", reader,
        )  # fmt: skip
    finally:
        reader.stop()
    return StallRun(
        list(reader.times), alone, bt.sent, bt.first, bt.admitted, list(reader.shifts),
        b_cells=bt.cells, b_tokens=bt.tokens, alone_seconds=alone_seconds,
    )  # fmt: skip


# -- slotwise ---------------------------------------------------------------------------------


GREEDY = infer_pb2.SamplingParams(temperature=0.0)


class _GrpcReader(_Reader):
    def __init__(self, infer: infer_pb2_grpc.InferServiceStub, prompt: Any):
        super().__init__()
        req = infer_pb2.GenerateRequest(prompt=prompt, max_tokens=1 << 20, sampling=GREEDY)
        self.call = infer.Generate(req, timeout=3600)

    def read(self) -> None:
        for e in self.call:
            kind = e.WhichOneof("event")
            if kind == "delta":
                t = time.monotonic()
                self.times.extend([t] * len(e.delta.token_ids))
            elif kind == "shift":
                self.shifts.append(time.monotonic())
            elif kind == "finished":
                self.ended = "finished: " + infer_pb2.FinishReason.Name(e.finished.reason)

    def cut(self) -> None:
        self.call.cancel()


class SlotwiseStall:
    """Measurements against running prep and infer services (their stubs)."""

    def __init__(self, prep: prep_pb2_grpc.PrepServiceStub, infer: infer_pb2_grpc.InferServiceStub):
        self.prep = prep
        self.infer = infer
        info = prep.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=30).info
        self.marker = info.media_marker
        self.a_prompt = self._prepare(A_TEXT)

    def _prepare(self, text: str, images: tuple[bytes, ...] = ()) -> Any:
        raw = prep_pb2.RawPrompt(
            text=text, images=[prep_pb2.Image(data=d) for d in images], add_special=True
        )
        return self.prep.Prepare(prep_pb2.PrepareRequest(raw=raw), timeout=120).prompt

    def b_alone(self, jpeg: bytes | None = None, n: int = 0, *, text: str | None = None) -> BTimes:
        """B once, from its Prepare call to its first TokenDelta: ``B_TEXT`` with picture
        number n and ``jpeg``, or ``text`` (with ``jpeg``'s marker in it, if any)."""
        images = () if jpeg is None else (jpeg,)
        b_text = B_TEXT.format(n=n, marker=self.marker) if text is None else text
        sent = time.monotonic()
        prompt = self._prepare(b_text, images)
        cells = sum(c.media.num_cells for c in prompt.chunks if c.HasField("media"))
        tokens = sum(len(c.text.token_ids) for c in prompt.chunks if c.HasField("text"))
        admitted = first = None
        req = infer_pb2.GenerateRequest(prompt=prompt, max_tokens=2, sampling=GREEDY)
        for e in self.infer.Generate(req, timeout=600):
            kind = e.WhichOneof("event")
            if kind == "started":
                admitted = time.monotonic()
            elif kind == "delta" and first is None:
                first = time.monotonic()
            elif kind == "finished" and e.finished.reason == infer_pb2.FINISH_REASON_ERROR:
                raise StallError(f"B failed: {e.finished.error}")
        if first is None:
            raise StallError("B finished without a token")
        return BTimes(sent, admitted, first, cells, tokens)

    def run(
        self,
        jpeg: bytes | None,
        n: int = 0,
        *,
        text: str | None = None,
        settle_s: float = SETTLE_S,
        alone_s: float = ALONE_S,
        warm_tokens: int = 20,
    ) -> StallRun:
        """One measurement; B as in :meth:`b_alone`. infer shifts A's context when its slot is
        full: A's tokens are not bounded."""
        reader = _GrpcReader(self.infer, self.a_prompt)
        return _measure(
            reader, lambda: self.b_alone(jpeg, n, text=text), settle_s=settle_s,
            alone_s=alone_s, warm_tokens=warm_tokens,
        )  # fmt: skip


# -- llama-server -----------------------------------------------------------------------------


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise StallError(f"llama-server {path}: HTTP {resp.status} {resp.read()[:300]!r}")
    return conn, resp


def _get(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        if resp.status != 200:
            raise StallError(f"llama-server {path}: HTTP {resp.status}")
        return json.loads(resp.read())
    finally:
        conn.close()


def _events(resp: Any) -> Any:
    """The JSON events of a llama-server stream (server-sent events), as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            yield time.monotonic(), json.loads(line[6:])


class _HttpReader(_Reader):
    def __init__(self, port: int, text: str, extra: dict[str, Any]):
        super().__init__()
        self.port = port
        self.text = text
        self.extra = extra
        self.conn: http.client.HTTPConnection | None = None

    def read(self) -> None:
        body = {
            "prompt": self.text, "n_predict": -1, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False, **self.extra,
        }  # fmt: skip
        self.conn, resp = _post(self.port, "/completion", body)
        for t, event in _events(resp):
            if event.get("stop"):
                self.ended = f"stopped: {event.get('stop_type')}"
                return
            if "prompt_progress" in event:
                continue
            self.times.extend([t] * (len(event.get("tokens") or ()) or 1))

    def cut(self) -> None:
        if self.conn is not None and self.conn.sock is not None:
            with contextlib.suppress(OSError):
                self.conn.sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        super().stop()
        if self.conn is not None:
            self.conn.close()


class ServerStall:
    """Measurements against a running llama-server (its port) loaded with the same model (and
    projector).

    llama-server streams nothing while the generated text ends in an incomplete UTF-8
    character, and a random-weight model may repeat one lead byte for ever (the tiny pair's A
    does after 762 tokens): ``ban_tokens`` (for the tiny pair: the bytes 128-255) get a logit
    bias of -inf on both A and B, so that every token is seen when it comes.

    llama-server does not shift a slot's context (and never with a projector loaded): A can
    generate ``room`` tokens, a slot's ``n_ctx`` (from ``/props``: ``-c / -np``, at most the
    model's ``n_ctx_train``) less A's prompt; A's time alone is cut to leave most of them for
    B's wait.
    """

    def __init__(self, port: int, ban_tokens: Sequence[int] = ()):
        self.port = port
        props = _get(port, "/props")
        self.marker = props.get("media_marker", "")
        self.extra: dict[str, Any] = {}
        if ban_tokens:
            self.extra["logit_bias"] = [[t, False] for t in ban_tokens]
        self.slot_ctx = int(props["default_generation_settings"]["n_ctx"])
        conn, resp = _post(port, "/tokenize", {"content": A_TEXT, "add_special": True})
        try:
            a_prompt = len(json.loads(resp.read())["tokens"])
        finally:
            conn.close()
        self.room = self.slot_ctx - a_prompt - 1

    def idle(self, timeout: float = 30) -> None:
        """Wait until no slot is processing (a cut stream's slot is released on its next
        token)."""
        deadline = time.monotonic() + timeout
        while any(s.get("is_processing") for s in _get(self.port, "/slots")):
            if time.monotonic() > deadline:
                raise StallError("llama-server's slots still busy")
            time.sleep(0.05)

    def b_alone(self, jpeg: bytes | None = None, n: int = 0, *, text: str | None = None) -> BTimes:
        """B once through /completion: ``B_TEXT`` with the image as multimodal_data, or
        ``text`` (a plain prompt when there is no image); from its request to its first token
        event."""
        b_text = B_TEXT.format(n=n, marker=self.marker) if text is None else text
        prompt: Any = b_text
        if jpeg is not None:
            prompt = {"prompt_string": b_text, "multimodal_data": [base64.b64encode(jpeg).decode()]}
        body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "stream": True,
                "cache_prompt": False, **self.extra}  # fmt: skip
        sent = time.monotonic()
        conn, resp = _post(self.port, "/completion", body)
        first = None
        try:
            for t, event in _events(resp):
                if first is None and (event.get("tokens") or event.get("content")):
                    first = t
                if event.get("stop"):
                    first = first or t  # tokens held back (incomplete UTF-8) come here
                    break
        finally:
            conn.close()
        if first is None:
            raise StallError("llama-server: B finished without a token")
        return BTimes(sent, None, first)

    def run(
        self,
        jpeg: bytes | None,
        n: int = 0,
        *,
        text: str | None = None,
        settle_s: float = SETTLE_S,
        alone_s: float = ALONE_S,
        warm_tokens: int = 20,
    ) -> StallRun:
        """One measurement through /completion: A a text prompt, B as in :meth:`b_alone`."""
        self.idle()
        reader = _HttpReader(self.port, A_TEXT, self.extra)
        try:
            return _measure(
                reader, lambda: self.b_alone(jpeg, n, text=text), settle_s=settle_s,
                alone_s=alone_s, warm_tokens=warm_tokens, room=self.room,
            )  # fmt: skip
        finally:
            self.idle()
