"""Shared prefixes (issue 33): conversations that open with one long system prompt, on the
per-slot layout and on the pool (--kv-unified), the engine's own executor stepped in-process.

The first conversation runs alone; then the others start together, one per slot. Printed per
layout: the first's time to first token, the others' median and max, their ratio to the
first, and the cells in use read from llama.cpp against the pool's count (shared prefix once,
plus each conversation's own cells)::

    python -m benchmarks.shared_prefix --model gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--ctx-size", type=int, default=16384)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--system", type=int, default=1600, help="system prompt tokens")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print(
        f"{args.parallel} conversations, a {args.system}-token system prompt, "
        f"ctx {args.ctx_size}, {args.threads} threads; the first alone, then the others together"
    )
    print(f"{'layout':<10} {'first TTFT':>10} {'others median':>14} {'max':>7} {'ratio':>6} "
          f"{'cells in use (llama.cpp)':>25} {'counted':>8} {'shared':>7}")  # fmt: skip
    for unified in (False, True):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
