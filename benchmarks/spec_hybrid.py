"""The spechybrid section of slotwise bench: drafts on a hybrid-memory model, the kind people
run in 2026 (Qwen3.5: gated delta-net layers beside attention), against the same server
without drafts and against llama-server's own speculative types.

The model is a wide random ``qwen35`` the section writes (256 wide, 8 layers: a step costs
what a GPU's does, about 2 ms on one core). Greedy, 256 tokens, one compute thread, the same
request three times in a row on each side: a random model's greedy reply falls into
repetition, the work drafts exist for, and a pool that outlives a request (llama-server's
ngram-mod) drafts the repeats from the first. The rate of a side is the median of its three.

- slotwise without drafts, and with each of its n-gram types (rejected drafts rolled back in
  place, ``--spec-rollback``, or from a checkpoint of the recurrent state taken before their
  step); the best of them against none;
- llama-server built from the same vendored sources (``--llama-server``): no drafts,
  ``--spec-default`` (ngram-mod), ngram-simple, ngram-map-k; slotwise's best against its best.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from statistics import median

from benchmarks.calls import generate, prepare_text
from benchmarks.harness import Bench
from benchmarks.results import Stream, compared, streamed_rate
from slotwise.v1 import prep_pb2_grpc
from slotwise_core.tiny_models import write_qwen35_model

PROMPT = (
    "The history of the city begins in the early middle ages, when a small settlement of "
    "fishermen grew up on the banks of the river. Over the following centuries"
)
TOKENS, REQUESTS, CTX = 256, 3, 1024
ROW_DRAFTS = "spec hybrid (wide qwen35): tok/s drafts / none"
ROW_SERVER = "spec hybrid (wide qwen35): slotwise drafts / llama-server's best"
OURS = {  # what slotwise runs, each a server of its own flags
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "--spec-default": ("--spec-default",),
    "--spec-default, --spec-rollback 4": ("--spec-default", "--spec-rollback", "4"),
    "--spec-default, --spec-rollback 64": ("--spec-default", "--spec-rollback", "64"),
    "ngram-simple,suffix": ("--spec-type", "ngram-simple,suffix"),
}
THEIRS = {
    "--spec-default": ("--spec-default",),
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-map-k": ("--spec-type", "ngram-map-k"),
}


def run(b: Bench) -> None:
    model = write_qwen35_model(b.log_dir / "wide-qwen35.gguf")
    prep = b.service("prep_service", ["--model", str(model)])
    try:
        prompt = prepare_text(prep_pb2_grpc.PrepServiceStub(prep.channel), PROMPT)
    finally:
        prep.stop()
    seen: dict[str, list[Stream]] = {}
    with contextlib.ExitStack() as up:  # every side up at once: their requests interleave
        runs: dict[str, Callable[[], float]] = {}
        for label, flags in {"none": ("--spec-type", "none"), **OURS}.items():
            infer = up.enter_context(b.infer(ctx=CTX, parallel=1, model=model, extra=flags))
            runs[label] = _side(seen, label, functools.partial(generate, infer, prompt, TOKENS))
        for label, extra in {"none": (), **THEIRS}.items():
            server = up.enter_context(b.llama_server(ctx=CTX, parallel=1, model=model, extra=extra))
            if server is not None:
                one = functools.partial(server.generate, PROMPT, TOKENS, cache_prompt=True)
                runs[f"llama-server {label}"] = _side(seen, f"llama-server {label}", one)
        rates = b.interleaved(runs, REQUESTS)  # (each side: the same request, three times)
    for label, streams in seen.items():
        b.log(f"spechybrid {label}: {_said(streams, rates[label])}")
    ours = {k: v for k, v in rates.items() if not k.startswith("llama-server")}
    theirs = {k.removeprefix("llama-server "): v for k, v in rates.items() if k not in ours}
    best = max(OURS, key=lambda k: median(ours[k]))
    per_side = "; ".join(f"{k} {median(v):.0f}" for k, v in ours.items())
    note = f"best: {best}, {_said(seen[best], ours[best])}; medians tok/s: {per_side}"
    b.rows.append(
        compared(ROW_DRAFTS, [median(ours[best])], [median(ours["none"])], "tok/s", ">= 2.5", note)
    )
    if theirs:
        top = max((k for k in theirs if k != "none"), key=lambda k: median(theirs[k]))
        note = f"llama-server's best: {top}; its medians tok/s: " + "; ".join(
            f"{k} {median(v):.0f}" for k, v in theirs.items()
        )
        b.rows.append(
            compared(
                ROW_SERVER, [median(ours[best])], [median(theirs[top])], "tok/s", ">= 1.0", note
            )
        )


def _side(
    seen: dict[str, list[Stream]], label: str, one: Callable[[], Stream]
) -> Callable[[], float]:
    def run() -> float:
        s = one()
        seen.setdefault(label, []).append(s)
        return streamed_rate([s])

    return run


def _said(streams: list[Stream], rates: list[float]) -> str:
    drafted = sum(s.drafted for s in streams)
    accepted = sum(s.accepted for s in streams)
    per = ", ".join(f"{r:.0f}" for r in rates)
    return f"tok/s {per} (accepted/drafted {accepted}/{drafted})"
