"""One tenant floods the queue, another sends one request: how long that one waits, with the
queue FIFO across tenants and with it fair (round robin), measured in one run.

    python -m benchmarks.tenant_flood                       # the tiny test models
    python -m benchmarks.tenant_flood --model gemma.gguf --chat-template gemma

Tenant `flood` sends --flood requests into --parallel slots; once they are all in (in slots
or waiting), tenant `other` sends one. Its queue wait is the time from sending it to its
Started event; its place is how many of the flood's generations started before it.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.client import NO_RETRY, AsyncSlotwiseClient, Started
from slotwise_core.keys import Keys

FLOOD_KEY, OTHER_KEY = "key-of-the-flood", "key-of-the-other"
PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


@dataclass
class Waited:
    queue: str
    seconds: float  # the other tenant's request: sent to Started
    place: int  # the flood's generations that started before it
    flood_seconds: float  # the median flood request's wait, for scale


async def measure(
    model: Path,
    mmproj: Path | None,
    *,
    fair: bool,
    flood: int,
    parallel: int,
    max_tokens: int,
    ctx_per_slot: int,
    threads: int,
    chat_template: str | None,
) -> Waited:
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep
    from slotwise_core.serving import Security

    security = Security(keys=Keys(text=f"flood {FLOOD_KEY}\nother {OTHER_KEY}\n"))
    prep = await start_prep(
        model, mmproj, threads=threads, security=security, chat_template=chat_template
    )
    config = RuntimeConfig(
        model, mmproj, ctx_size=ctx_per_slot * parallel, parallel=parallel, threads=threads
    )
    infer = await start_infer(config, security=security, fair=fair, max_queue=flood + 8)
    addresses = (f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}")
    started: list[str] = []
    try:
        async with AsyncSlotwiseClient(*addresses, token=OTHER_KEY) as c:
            prepared = await c.prepare(PROMPT)  # (prep holds no state: one prompt for both)

        async def one(key: str, name: str) -> float:
            async with AsyncSlotwiseClient(*addresses, token=key, retry=NO_RETRY) as c:
                sent = time.monotonic()
                waited = 0.0
                async for event in c.generate(prepared, max_tokens=max_tokens, temperature=0.0):
                    if isinstance(event, Started):
                        waited = time.monotonic() - sent
                        started.append(name)
                return waited

        floods = [asyncio.create_task(one(FLOOD_KEY, "flood")) for _ in range(flood)]
        engine = infer.engine
        while engine.num_waiting + engine.num_active + sum(f.done() for f in floods) < flood:
            await asyncio.sleep(0.005)  # until all of the flood is in
        other = await one(OTHER_KEY, "other")
        flood_waits = sorted(await asyncio.gather(*floods))
        return Waited(
            "fair" if fair else "fifo",
            other,
            started.index("other"),
            flood_waits[len(flood_waits) // 2],
        )
    finally:
        await infer.stop()
        await prep.stop(0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a GGUF (default: the tiny mrope test model)")
    p.add_argument("--mmproj", type=Path)
    p.add_argument("--chat-template")
    p.add_argument("--flood", type=int, default=12, help="the flooding tenant's requests")
    p.add_argument("--parallel", type=int, default=2, help="slots")
    p.add_argument("--max-tokens", type=int, default=128, help="per request")
    p.add_argument("--ctx-per-slot", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, mmproj = args.model, args.mmproj
        if model is None:
            from slotwise_core.tiny_models import write_tiny_models

            pair = write_tiny_models(Path(tmp), ["mrope"])["mrope"]
            model, mmproj = pair.model, pair.mmproj
        rows = [
            asyncio.run(
                measure(
                    model,
                    mmproj,
                    fair=fair,
                    flood=args.flood,
                    parallel=args.parallel,
                    max_tokens=args.max_tokens,
                    ctx_per_slot=args.ctx_per_slot,
                    threads=args.threads,
                    chat_template=args.chat_template,
                )
            )
            for fair in (False, True)
        ]
    print(f"{args.flood} requests of one tenant in {args.parallel} slots, then one of another")
    print(f"{'queue':<6} {'other waits':>12} {'started after':>14} {'flood median':>13}")
    for r in rows:
        print(f"{r.queue:<6} {r.seconds:>11.3f}s {r.place:>8} of {args.flood:<3} "
              f"{r.flood_seconds:>12.3f}s")  # fmt: skip
    fifo, fair = rows
    print(f"the other tenant's wait, fair/fifo: {fair.seconds / max(fifo.seconds, 1e-9):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
