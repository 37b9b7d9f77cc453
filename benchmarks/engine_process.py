"""Issue 32, item 3: does the engine loop in a process of its own (vLLM v1's answer to the GIL)
stream faster than today's engine thread beside the gRPC event loop?

Both sides run the same loop (the bench's raw loop: `llama_decode`, greedy sample, one token per
step) behind the same grpc.aio streaming method, one message per token, so the only difference
is where the loop runs:

- `thread`: a thread of the gRPC server's process, each token handed to the event loop with
  `call_soon_threadsafe` (what infer does);
- `process`: a process of its own, each token sent through a pipe that the event loop reads
  (`add_reader`), so the loop's Python never takes the GIL from the engine's.

    python -m benchmarks.engine_process [--model PATH | Gemma] [--threads 2] [--repeats 5]

It prints tok/s for each, for the raw loop with no gRPC in the bench process, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from benchmarks.calls import PROMPTS
from benchmarks.harness import gemma_path
from benchmarks.reference import RawContext, RawModel
from benchmarks.results import BenchError, Stream, median, streamed_rate
from benchmarks.servers import free_port

_METHOD = "/slotwise.bench.Engine/Generate"
_END = -1
_CTX = 1024


def _context(model: str, threads: int) -> RawContext:
    return RawContext(RawModel(Path(model)), n_ctx=_CTX, n_seq=1, threads=threads)


def _engine_process(conn: Connection, model: str, threads: int) -> None:
    rc = _context(model, threads)
    conn.send_bytes(b"ready")
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:  # (the server is gone)
            return
        n = struct.unpack_from("<I", request)[0]
        prompt = list(struct.unpack_from(f"<{(len(request) - 4) // 4}i", request, 4))
        for token in rc.tokens(prompt, n):
            conn.send_bytes(struct.pack("<i", token))
        conn.send_bytes(struct.pack("<i", _END))


def _encode(prompt: list[int], n: int) -> bytes:
    return struct.pack(f"<I{len(prompt)}i", n, *prompt)


async def _serve(mode: str, model: str, threads: int, port: int) -> None:
    loop = asyncio.get_running_loop()
    if mode == "process":
        ours, theirs = multiprocessing.Pipe()
        child = multiprocessing.get_context("spawn").Process(
            target=_engine_process, args=(theirs, model, threads), daemon=True
        )
        child.start()
        ours.recv_bytes()  # ready

        async def generate(request: bytes, context: object) -> AsyncIterator[bytes]:
            got: asyncio.Queue[int] = asyncio.Queue()
            loop.add_reader(ours.fileno(), lambda: got.put_nowait(_token(ours.recv_bytes())))
            try:
                ours.send_bytes(request)
                while (token := await got.get()) != _END:
                    yield struct.pack("<i", token)
            finally:
                loop.remove_reader(ours.fileno())

    else:
        rc = _context(model, threads)
        jobs: queue.Queue[tuple[bytes, Callable[[int], None]]] = queue.Queue()

        def engine() -> None:
            while True:
                request, put = jobs.get()
                n = struct.unpack_from("<I", request)[0]
                prompt = list(struct.unpack_from(f"<{(len(request) - 4) // 4}i", request, 4))
                for token in rc.tokens(prompt, n):
                    loop.call_soon_threadsafe(put, token)
                loop.call_soon_threadsafe(put, _END)

        threading.Thread(target=engine, daemon=True, name="engine").start()

        async def generate(request: bytes, context: object) -> AsyncIterator[bytes]:
            got: asyncio.Queue[int] = asyncio.Queue()
            jobs.put((request, got.put_nowait))
            while (token := await got.get()) != _END:
                yield struct.pack("<i", token)

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "slotwise.bench.Engine", {"Generate": grpc.unary_stream_rpc_method_handler(generate)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


def _token(data: bytes) -> int:
    return struct.unpack("<i", data)[0]


class _Server:
    def __init__(self, mode: str, model: str, threads: int):
        self.port = free_port()
        argv = [sys.executable, "-m", "benchmarks.engine_process", "--serve", mode]
        argv += ["--model", model, "--threads", str(threads), "--port", str(self.port)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout is None or self.proc.stdout.readline().strip() != "serving":
            raise BenchError(f"{mode} server did not start")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.call = self.channel.unary_stream(_METHOD)

    def generate(self, prompt: list[int], n: int) -> Stream:
        s = Stream(t_sent=time.perf_counter())
        for _ in self.call(_encode(prompt, n), timeout=600):
            s.add(time.perf_counter(), 1)
        return s

    def stop(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_process", description=__doc__)
    p.add_argument("--model", help="text model GGUF (default: Gemma 3 270M, `bench` extra)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--serve", choices=("thread", "process"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model = args.model or str(gemma_path())
    if args.serve:
        asyncio.run(_serve(args.serve, model, args.threads, args.port))
        return 0
    raw = _context(model, args.threads)
    prompt = raw.m.tokenize(PROMPTS[0])
    servers = {mode: _Server(mode, model, args.threads) for mode in ("thread", "process")}
    try:
        runs: dict[str, Callable[[], Stream]] = {
            "raw loop": lambda: raw.generate([prompt], args.tokens)[0],
            "thread": lambda: servers["thread"].generate(prompt, args.tokens),
            "process": lambda: servers["process"].generate(prompt, args.tokens),
        }
        for run in runs.values():
            run()  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.repeats):
            for name in names[r % 3 :] + names[: r % 3]:
                rates[name].append(streamed_rate([runs[name]()]))
    finally:
        for s in servers.values():
            s.stop()
    m = {name: median(v) for name, v in rates.items()}
    print(f"{Path(model).name}, {args.threads} threads, {args.tokens} tokens, "
          f"{args.repeats} repeats, {os.cpu_count()} CPUs")  # fmt: skip
    for name, v in rates.items():
        print(f"  {name:9} {m[name]:8.1f} tok/s  ({min(v):.1f}-{max(v):.1f})")
    print(f"  thread  / raw loop   {m['thread'] / m['raw loop']:.3f}")
    print(f"  process / raw loop   {m['process'] / m['raw loop']:.3f}")
    print(f"  process / thread     {m['process'] / m['thread']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
