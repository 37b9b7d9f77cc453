"""A hostile request beside another client's stream: how long that stream's tokens wait while
the hostile one runs, and how the hostile one ends, measured in one run.

    python -m benchmarks.hostile                 # the tiny rope test model
    python -m benchmarks.hostile --model gemma.gguf

The victim streams --tokens tokens in one slot. Beside it, in the other slot:
- `pattern`: a lazy grammar whose trigger `(.*.*)*X` never matches (X is banned), the case
  that backtracked for minutes on the engine thread before triggers ran in RE2;
- `grammar`: a small ambiguous grammar the model is biased to follow, whose parse stacks grow
  every token (llama.cpp's work per token grows past any bound; --max-grammar-ms ends it).
The figure is the victim's longest gap between two tokens, against the same stream alone.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.client import (
    NO_RETRY,
    AsyncSlotwiseClient,
    Constraint,
    Delta,
    Finished,
    SlotwiseError,
)

PROMPT = "Write a long story about a lighthouse keeper and the sea."
ENDS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "</s>", "<|eot_id|>")
AMBIGUOUS = "root ::= " + " ".join(['("a" | "a" "a")?'] * 400) + ' "b"'


@dataclass
class Seen:
    case: str
    longest_gap: float  # the victim's, seconds
    tokens: int  # the victim's
    hostile: str  # how the hostile request ended
    hostile_seconds: float


async def measure(model: Path, *, tokens: int, grammar_ms: int, threads: int) -> list[Seen]:
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep

    prep = await start_prep(model, None, threads=threads)
    config = RuntimeConfig(
        model, None, ctx_size=4096, parallel=2, threads=threads, grammar_ms=grammar_ms
    )
    infer = await start_infer(config)
    addresses = (f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}")
    try:
        async with AsyncSlotwiseClient(*addresses, retry=NO_RETRY) as c:
            prepared = await c.prepare(PROMPT)
            x_id, a_id = await _token(c, "X"), await _token(c, "a")
            if x_id is None or a_id is None:
                raise SystemExit("'X' and 'a' must be single tokens of the model")
            # the hostile stream runs as long as the victim (its worst case): no end token
            no_end = {t: -100.0 for t in [await _token(c, e) for e in ENDS] if t is not None}

            async def victim() -> tuple[float, int]:
                times: list[float] = []
                async for e in c.generate(prepared, max_tokens=tokens, temperature=1.0, seed=3):
                    if isinstance(e, Delta):
                        times.extend([time.monotonic()] * len(e.token_ids))
                gaps = [b - a for a, b in itertools.pairwise(times)]
                return max(gaps, default=0.0), len(times)

            async def hostile(case: str) -> tuple[str, float]:
                t0 = time.monotonic()
                options: dict[str, Any]
                if case == "pattern":
                    options = {
                        "constraint": Constraint('root ::= "X"', trigger_patterns=("(.*.*)*X",)),
                        "logit_bias": {x_id: -100.0, **no_end},
                    }
                else:
                    options = {"constraint": Constraint(AMBIGUOUS), "logit_bias": {a_id: 100.0}}
                try:
                    async for e in c.generate(
                        prepared, max_tokens=tokens, temperature=1.0, timeout=300, **options
                    ):
                        if isinstance(e, Finished):
                            return f"{e.reason.value} {e.error}".strip(), time.monotonic() - t0
                except SlotwiseError as e:
                    return f"{e.code().name} {e.reason}", time.monotonic() - t0
                return "no end", time.monotonic() - t0

            seen = []
            gap, n = await victim()
            seen.append(Seen("alone", gap, n, "-", 0.0))
            for case in ("pattern", "grammar"):
                (gap, n), (how, seconds) = await asyncio.gather(victim(), hostile(case))
                seen.append(Seen(case, gap, n, how, seconds))
            return seen
    finally:
        await infer.stop()
        await prep.stop(0)


async def _token(c: AsyncSlotwiseClient, text: str) -> int | None:
    """The id of the one token `text` is in the model's vocabulary (None: it is several)."""
    prepared = await c.prepare(text, add_special=False)
    ids = [t for chunk in prepared.prompt.chunks for t in chunk.text.token_ids]
    return ids[0] if len(ids) == 1 else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a GGUF (default: the tiny rope test model)")
    p.add_argument("--tokens", type=int, default=400, help="the victim's max_tokens")
    p.add_argument("--max-grammar-ms", type=int, default=250, help="infer's --max-grammar-ms")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from slotwise_core.tiny_models import write_tiny_models

            model = write_tiny_models(Path(tmp), ["rope"])["rope"].model
        rows = asyncio.run(
            measure(model, tokens=args.tokens, grammar_ms=args.max_grammar_ms, threads=args.threads)
        )
    print(f"{'beside':<8} {'victim longest gap':>19} {'tokens':>7}  hostile request ended")
    for r in rows:
        print(f"{r.case:<8} {r.longest_gap:>18.3f}s {r.tokens:>7}  {r.hostile} "
              f"after {r.hostile_seconds:.2f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
