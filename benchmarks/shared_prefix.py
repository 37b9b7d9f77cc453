"""Shared prefixes (issues 33, 53): conversations that open with one long system prompt, on the
per-slot layout and on the pool (--kv-unified), the engine's own executor stepped in-process.

The first conversation runs alone; then the others start together, one per slot. Printed per
layout: the first's time to first token, the others' median and max, their ratio to the
first, and the cells in use read from llama.cpp against the pool's count (shared prefix once,
plus each conversation's own cells). Then, on the pool (issue 53, unless --no-burst):

- a long prompt (--long tokens of other text) sent with the burst: its time to first token
  over the same prompt's alone (no starvation behind the short ones);
- streams already decoding when the burst comes (256-token replies, the burst after their
  32nd token): their tokens per second, first token to last, over the same streams' without
  it (the burst's prefills share their steps: they must not stall them).

Each figure is a ratio measured in one run::

    python -m benchmarks.shared_prefix --model gemma-3-270m-q4_k_m.gguf [--parallel 16]

With --http the first rows' burst goes through `slotwise serve` and its OpenAI API instead
(prep, gRPC, the gateway, the stream: what a user waits for), then again on a changed system
prompt while the slots hold the first one's chats::

    python -m benchmarks.shared_prefix --model gemma-3-270m-q4_k_m.gguf --http --chat-template gemma
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.servers import Process, free_port
from infer_service.kv.ledger import ContextConfig, Item
from infer_service.runner.executor import Executor, Sampled
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats

TEXT = (Path(__file__).parent / "texts").glob("*")


def system_tokens(rt: Runtime, n: int) -> list[int]:
    words = " ".join(p.read_text(errors="replace") for p in sorted(TEXT) if p.is_file())
    tokens = rt.tokenize(words or "A system prompt, long and detailed. " * 400)
    while len(tokens) < n:
        tokens += tokens
    return tokens[:n]


def run(
    model: Path, *, unified: bool, ctx: int, parallel: int, system: int, threads: int
) -> dict[str, float | int | str]:
    rt = Runtime(
        RuntimeConfig(
            model, None, ctx_size=ctx, parallel=parallel, threads=threads,
            threads_batch=threads, kv_unified=unified,
        )
    )  # fmt: skip
    slots = [Slot(seq) for seq in range(parallel)]
    ex = Executor(rt, EngineStats(), cache_bytes=0, host_sequence_bytes=0, slots=slots)
    try:
        prefix = system_tokens(rt, system)
        started: dict[int, float] = {}
        first: dict[int, float] = {}

        def begin(i: int) -> None:
            user = rt.tokenize(f" Question number {i}: what does the text above say?")
            job = Job(
                [Item.text(prefix, 0), Item.text(user, 1)], {}, KeptEvents(),
                sampling=SamplingConfig(temperature=0), max_tokens=4,
                context=ContextConfig(keep=len(prefix)),
            )  # fmt: skip
            job.note = str(i).encode()
            started[i] = time.perf_counter()
            ex.start(slots[i], job, ex.enter(slots[i], job))

        def drain() -> None:
            while any(s.job for s in slots):
                for job, event in ex.step(slots).events:
                    i = int(job.note)
                    if isinstance(event, Sampled) and i not in first:
                        first[i] = time.perf_counter() - started[i]

        begin(0)
        drain()
        for i in range(1, parallel):
            begin(i)
        drain()
        others = [first[i] for i in range(1, parallel)]
        used = len(rt.cells_in_use()) if unified else "-"  # (a stream per slot: not read)
        own = sum(s.num_cells for s in slots)
        counted = own if ex.pool is None else ex.pool.num_cells - ex.pool_free()
        return {
            # the system prompt once, and each chat's cells beyond it (the ledgers' count)
            "expected": len(prefix) + own - len(prefix) * parallel,
            "per_slot": own,  # (the system prompt in every slot)
            "first": first[0],
            "median": statistics.median(others),
            "max": max(others),
            "used": used,
            "counted": counted,
            "shared": ex.stats.num_shared_prefixes,
        }
    finally:
        ex.close()
        rt.close()


class Burst:
    """The pool's executor, stepped by hand: jobs started by name, each one's first-token
    time and token times recorded."""

    def __init__(self, model: Path, *, ctx: int, parallel: int, threads: int):
        self.rt = Runtime(
            RuntimeConfig(
                model, None, ctx_size=ctx, parallel=parallel, threads=threads,
                threads_batch=threads, kv_unified=True,
            )
        )  # fmt: skip
        self.slots = [Slot(seq) for seq in range(parallel)]
        self.ex = Executor(
            self.rt, EngineStats(), cache_bytes=0, host_sequence_bytes=0, slots=self.slots
        )
        self.started: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.tokens: dict[str, list[float]] = {}

    def close(self) -> None:
        self.ex.close()
        self.rt.close()

    def start(self, name: str, items: list[Item], max_tokens: int, keep: int = 0) -> None:
        slot = next(s for s in self.slots if s.job is None)
        job = Job(
            items, {}, KeptEvents(), sampling=SamplingConfig(temperature=0),
            max_tokens=max_tokens, context=ContextConfig(keep=keep),
        )  # fmt: skip
        job.note = name.encode()
        self.started[name] = time.perf_counter()
        self.tokens[name] = []
        self.ex.start(slot, job, self.ex.enter(slot, job))

    def step(self) -> None:
        for job, event in self.ex.step(self.slots).events:
            if isinstance(event, Sampled):
                name, now = job.note.decode(), time.perf_counter()
                self.first.setdefault(name, now - self.started[name])
                self.tokens[name].append(now)

    def drain(self, *names: str) -> None:
        """Step until these jobs (default: all) ended."""

        def running() -> bool:
            return any(s.job and (not names or s.job.note.decode() in names) for s in self.slots)

        while running():
            self.step()

    def clear(self) -> None:
        """Every slot empty (the next figures start cold)."""
        for s in self.slots:
            self.ex.clear(s)
            s.ledger = None

    def rate(self, name: str) -> float:
        """A stream's tokens per second, first token to last."""
        t = self.tokens[name]
        return (len(t) - 1) / (t[-1] - t[0])


def burst_figures(
    model: Path, *, ctx: int, chats: int, system: int, long: int, streams: int, threads: int
) -> dict[str, float]:
    """The pool with a burst of chats on one system prompt: a long prompt's TTFT with the
    burst over alone, and decoding streams' tok/s with the burst over without."""
    b = Burst(model, ctx=ctx, parallel=chats + max(1, streams), threads=threads)
    try:
        words = system_tokens(b.rt, system + 2 * long + 64)
        prefix, others = words[:system], words[system:]

        def chat(i: int) -> list[Item]:
            user = b.rt.tokenize(f" Question number {i}: what does the text above say?")
            return [Item.text(prefix, 0), Item.text(user, 1)]

        def opener(k: int) -> list[Item]:  # (another long prompt each time: nothing reused)
            return [Item.text(others[k * long : (k + 1) * long], 0)]

        def chats_together(first: int) -> list[str]:
            names = [f"chat {i}" for i in range(first, first + chats - 1)]
            for i, name in enumerate(names, first):
                b.start(name, chat(i), 4, keep=len(prefix))
            return names

        b.start("warm", chat(0), 4, keep=len(prefix))  # (the prefix held, costs measured)
        b.drain()
        b.start("long alone", opener(0), 1)
        b.drain()
        b.clear()
        b.start("prefix", chat(0), 4, keep=len(prefix))
        b.drain()
        b.start("long", opener(1), 1)
        chats_together(1)
        b.drain()
        figures = {
            "long_alone": b.first["long alone"],
            "long_with_burst": b.first["long"],
        }

        # streams: a few tokens of their own prompts, then long replies; the burst comes
        # once they decode
        def stream(k: int) -> list[Item]:
            return [Item.text(others[k * 32 : k * 32 + 32], 0)]

        rates = {}
        for with_burst in (False, True):
            b.clear()
            b.start("prefix again", chat(0), 1, keep=len(prefix))
            b.drain()
            names = [f"stream {k} {with_burst}" for k in range(streams)]
            for k, name in enumerate(names):
                b.start(name, stream(k), STREAM_TOKENS)
            while min(len(b.tokens[n]) for n in names) < STREAM_TOKENS // 8:
                b.step()
            if with_burst:
                chats_together(100)
            b.drain(*names)
            b.drain()
            rates[with_burst] = statistics.median(b.rate(n) for n in names)
        figures["streams_alone"] = rates[False]
        figures["streams_with_burst"] = rates[True]
        return figures
    finally:
        b.close()


STREAM_TOKENS = 256  # a reply's length; the burst comes after its first eighth


def http_burst(
    model: Path, *, chats: int, system: int, ctx: int, threads: int, template: str | None
) -> dict[str, float]:
    """The same burst as a user sends it: `slotwise serve --kv-unified` with its HTTP API,
    the chats streamed through the OpenAI route (httpx, one thread each, started together);
    a time to first token is the first content the stream carries."""
    port = free_port()
    argv = [
        sys.executable, "-m", "slotwise_cli", "serve", "--model", str(model), "--kv-unified",
        "--ctx-size", str(ctx), "--parallel", str(chats), "--threads", str(threads),
        "--threads-batch", str(threads), "--http-port", str(port), "--prep-port",
        str(free_port()), "--infer-port", str(free_port()), "--log-level", "warning",
        *(["--chat-template", template] if template else []),
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as d:
        server = Process("slotwise serve", argv, port, Path(d))
        try:
            _wait_http(server, base)
            words = " ".join(p.read_text(errors="replace") for p in sorted(TEXT) if p.is_file())
            text = words.split()
            while _count(base, " ".join(text)) < system:
                text += text
            prompt = " ".join(text[: len(text) * system // _count(base, " ".join(text))])

            def ttft(system: str, i: int, start: threading.Barrier | None = None) -> float:
                body = {
                    "model": "m", "stream": True, "max_tokens": 4, "temperature": 0,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: what is part {i} about?"},
                    ],
                }  # fmt: skip
                if start is not None:
                    start.wait()
                t0, first = time.perf_counter(), None
                with httpx.stream(
                    "POST", f"{base}/v1/chat/completions", json=body, timeout=600
                ) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if first is None and '"content": "' in line and '"content": ""' not in line:
                            first = time.perf_counter() - t0
                if first is None:
                    raise RuntimeError(f"chat {i}: no content streamed")
                return first

            figures: dict[str, float] = {}
            # a second round on a changed system prompt: the slots hold the first round's
            for name, system_prompt in (("", prompt), ("changed ", f"Revised. {prompt}")):
                alone = ttft(system_prompt, 0)
                together = functools.partial(
                    ttft, system_prompt, start=threading.Barrier(chats - 1)
                )
                with ThreadPoolExecutor(chats - 1) as pool:
                    others = list(pool.map(together, range(1, chats)))
                figures |= {
                    f"{name}first": alone, f"{name}median": statistics.median(others),
                    f"{name}max": max(others),
                }  # fmt: skip
            return figures
        finally:
            server.stop()


def _wait_http(server: Process, base: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"slotwise serve not serving after {timeout:.0f}s:\n{server.log_tail()}")


def _count(base: str, text: str) -> int:
    r = httpx.post(f"{base}/tokenize", json={"content": text}, timeout=60)
    r.raise_for_status()
    return len(r.json()["tokens"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--ctx-size", type=int, default=16384)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--system", type=int, default=1600, help="system prompt tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long", type=int, default=8192, help="the long prompt's tokens")
    ap.add_argument("--streams", type=int, default=2, help="streams decoding when it comes")
    ap.add_argument("--no-burst", action="store_true", help="the two layouts only")
    ap.add_argument(
        "--http", action="store_true",
        help="the burst through `slotwise serve`'s OpenAI API instead (the user's view)",
    )  # fmt: skip
    ap.add_argument("--chat-template", help="(--http) for a model without one: gemma, chatml")
    ap.add_argument(
        "--layout", choices=("both", "pool", "per-slot"), default="both",
        help="(16 chats of a 1,600-token system prompt do not fit the per-slot layout)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.http:
        h = http_burst(
            args.model, chats=args.parallel, system=args.system, ctx=args.ctx_size,
            threads=args.threads, template=args.chat_template,
        )  # fmt: skip
        for name, what in (("", "a"), ("changed ", "then a changed")):
            print(
                f"{args.parallel} chats over HTTP (pool), {what} {args.system}-token system "
                f"prompt: first TTFT {h[name + 'first']:.2f}s, others median "
                f"{h[name + 'median']:.2f}s, max {h[name + 'max']:.2f}s, ratio "
                f"{h[name + 'median'] / h[name + 'first']:.3f}",
                flush=True,
            )
        return 0
    print(
        f"{args.parallel} conversations, a {args.system}-token system prompt, "
        f"ctx {args.ctx_size}, {args.threads} threads; the first alone, then the others together"
    )
    print(f"{'layout':<10} {'first TTFT':>10} {'others median':>14} {'max':>7} {'ratio':>6} "
          f"{'cells in use (llama.cpp)':>25} {'counted':>8} {'shared':>7}")  # fmt: skip
    layouts = {"both": (False, True), "pool": (True,), "per-slot": (False,)}[args.layout]
    for unified in layouts:
        r = run(
            args.model, unified=unified, ctx=args.ctx_size, parallel=args.parallel,
            system=args.system, threads=args.threads,
        )  # fmt: skip
        print(
            f"{'pool' if unified else 'per-slot':<10} {r['first']:>9.2f}s {r['median']:>13.2f}s "
            f"{r['max']:>6.2f}s {float(r['median']) / float(r['first']):>6.3f} {r['used']:>25} "
            f"{r['counted']:>8} {r['shared']:>7}",
            flush=True,
        )
    if args.no_burst:
        return 0
    f = burst_figures(
        args.model, ctx=args.ctx_size + 2 * args.long, chats=args.parallel, system=args.system,
        long=args.long, streams=args.streams, threads=args.threads,
    )  # fmt: skip
    print(
        f"the burst beside a {args.long}-token prompt (pool): its TTFT "
        f"{f['long_with_burst']:.2f}s, alone {f['long_alone']:.2f}s, ratio "
        f"{f['long_with_burst'] / f['long_alone']:.3f}",
        flush=True,
    )
    print(
        f"the burst beside {args.streams} decoding streams (pool): their tok/s "
        f"{f['streams_with_burst']:.1f}, without it {f['streams_alone']:.1f}, ratio "
        f"{f['streams_with_burst'] / f['streams_alone']:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
