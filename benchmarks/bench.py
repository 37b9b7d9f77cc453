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

import sys
from collections.abc import Sequence

from benchmarks import (
    agent_loop,
    batched_streams,
    context_shift,
    hybrid,
    image_stall,
    kv_types,
    one_stream,
    prepare,
    resent_chat,
    session_turns,
    shared,
    spec,
    spec_hybrid,
    text_stall,
    ttft,
)
from benchmarks.harness import Section
from benchmarks.harness import main as run_bench

# The names --only takes, in the order its help lists them.
NAMES = (
    "stream1", "stream4", "shift", "prep", "ttft", "stall", "textstall", "resent", "session",
    "spec", "spechybrid", "agent", "shared", "hybrid", "kvtypes",
)  # fmt: skip

# The sections, in the order they run; each runs when --only names any of its names.
SECTIONS = (
    # (one stream's servers also give the ttft section its first row)
    Section(("stream1", "ttft"), one_stream.run),
    Section(("ttft",), ttft.run),
    Section(("stream4",), batched_streams.run),
    Section(("shift",), context_shift.run),
    Section(("prep",), prepare.run),
    Section(("stall",), image_stall.run, needs_model=False),
    Section(("textstall",), text_stall.run),
    Section(("resent",), resent_chat.run, needs_model=False),
    Section(("session",), session_turns.run),
    Section(("spec",), spec.run),
    Section(("spechybrid",), spec_hybrid.run, needs_model=False),
    Section(("agent",), agent_loop.run, needs_model=False),
    Section(("shared",), shared.run),
    Section(("hybrid",), hybrid.run, needs_model=False),
    Section(("kvtypes",), kv_types.run),
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_bench(argv, SECTIONS, NAMES, __doc__)


if __name__ == "__main__":
    sys.exit(main())
