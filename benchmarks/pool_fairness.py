"""Two tenants on one pool of cells (--kv-unified): how long tenant B's prompt waits while
tenant A holds the pool, measured in one run.

    python -m benchmarks.pool_fairness                 # the tiny rope test model
    python -m benchmarks.pool_fairness --model gemma.gguf --ctx 4096

A 1,024-cell pool (--ctx) of 4 slots, each free to grow to the whole pool. B sends a 100-word
chat (its time to first token and to its end are the figures) while:
- `idle session`: A's session holds about 90% of the pool from one long turn, then idles
  (goal: B served, under 2 s);
- `pinned generation`: A's stateless prompt of about 85% of the pool, all of it pinned,
  generates --tokens tokens (goal: B served under 5 s, while A's generation goes on);
- `alone`: B with the pool to itself, for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.client import (
    NO_RETRY,
    AsyncSlotwiseClient,
    Delta,
    Finished,
    Message,
    Prepared,
    SlotwiseError,
)

ALICE, BOB = "key-of-alice", "key-of-bob"


@dataclass
class Seen:
    case: str
    ttft: float  # B's, seconds
    seconds: float  # B's request to its end
    how: str  # how B's request ended
    a_tokens: int  # A's tokens by then (the pinned generation: still going)


def words(n: int, seed: int = 0) -> str:
    return " ".join(f"w{(i * 7 + seed) % 97}" for i in range(n))


async def _b(bob: AsyncSlotwiseClient) -> tuple[float, float, str]:
    t0 = time.monotonic()
    ttft = 0.0
    try:
        async for e in bob.generate([Message.user(words(100, 1))], max_tokens=8):
            if isinstance(e, Delta) and not ttft:
                ttft = time.monotonic() - t0
            if isinstance(e, Finished):
                return ttft, time.monotonic() - t0, e.reason.value
    except SlotwiseError as e:
        return ttft, time.monotonic() - t0, f"{e.code().name} {e.reason}"
    return ttft, time.monotonic() - t0, "no end"


async def measure(model: Path, *, ctx: int, tokens: int, threads: int, keys: Path) -> list[Seen]:
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep
    from slotwise_core.keys import Keys
    from slotwise_core.serving import Security

    security = Security(keys=Keys(keys))
    prep = await start_prep(model, None, threads=threads, security=security)
    config = RuntimeConfig(
        model, None, ctx_size=ctx, parallel=4, kv_unified=True, threads=threads
    )  # fmt: skip
    infer = await start_infer(config, security=security)
    addresses = (f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}")
    seen = []
    try:
        async with (
            AsyncSlotwiseClient(*addresses, token=ALICE, retry=NO_RETRY) as alice,
            AsyncSlotwiseClient(*addresses, token=BOB, retry=NO_RETRY) as bob,
        ):
            ttft, seconds, how = await _b(bob)
            seen.append(Seen("alone", ttft, seconds, how, 0))
            fill = await _fit(alice, int(ctx * 0.9))
            session = await alice.create_session(keep=8)
            async for _ in alice.generate(fill, session_id=session.session_id, max_tokens=4):
                pass
            ttft, seconds, how = await _b(bob)
            seen.append(Seen("idle session", ttft, seconds, how, 0))

            pinned = await _fit(alice, int(ctx * 0.85))
            got = [0]

            async def a() -> None:
                async for e in alice.generate(
                    pinned, max_tokens=tokens, keep=pinned.num_cells, ignore_eos=True,
                    temperature=0, cache_salt="pinned",
                ):  # fmt: skip
                    if isinstance(e, Delta):
                        got[0] += len(e.token_ids)

            task = asyncio.create_task(a())
            while got[0] < 200 and not task.done():  # (A holds the pool: its prompt and more)
                await asyncio.sleep(0.05)
            ttft, seconds, how = await _b(bob)
            seen.append(Seen("pinned generation", ttft, seconds, how, got[0]))
            task.cancel()
    finally:
        await infer.stop()
        await prep.stop(0)
    return seen


async def _fit(c: AsyncSlotwiseClient, cells: int) -> Prepared:
    """A prompt of about `cells` cells."""
    n = cells // 4
    while True:
        prepared = await c.prepare([Message.user(words(n))])
        if prepared.num_cells >= cells or n > 10 * cells:
            return prepared
        n += max(1, (cells - prepared.num_cells) // 4)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a GGUF (default: the tiny rope test model)")
    p.add_argument("--ctx", type=int, default=1024, help="cells in the pool")
    p.add_argument("--tokens", type=int, default=10000, help="A's pinned generation")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"alice {ALICE}\nbob {BOB}\n")
        model = args.model
        if model is None:
            from slotwise_core.tiny_models import write_tiny_models

            model = write_tiny_models(Path(tmp), ["rope"])["rope"].model
        rows = asyncio.run(
            measure(model, ctx=args.ctx, tokens=args.tokens, threads=args.threads, keys=keys)
        )
    goals = {"idle session": 2.0, "pinned generation": 5.0}
    print(f"{'beside':<18} {'B TTFT':>8} {'B end':>8} {'goal':>6}  B ended   A's tokens then")
    for r in rows:
        goal = goals.get(r.case)
        mark = "" if goal is None else ("ok" if r.seconds < goal and r.how != "error" else "MISS")
        limit = f"< {goal:.0f}s" if goal else "-"
        print(f"{r.case:<18} {r.ttft:>7.3f}s {r.seconds:>7.3f}s {limit:>6}  {r.how:<9} "
              f"{r.a_tokens}  {mark}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
