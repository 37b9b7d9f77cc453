"""The shared section of slotwise bench (issue 33): chats that open with one long system
prompt, on the pool (``--kv-unified``) against the per-slot layout.

- TTFT: the first chat runs alone and leaves its pinned system prompt in the pool; then the
  others (``--shared-chats`` in all) are sent together. Their median time to first token over
  the first's. A fresh ``cache_salt`` each repeat: every repeat's first chat decodes it all.
- The same with a 1 MP image pinned in the system message, on the heavy tiny pair (as the stall
  section; --vision-width/--vision-layers).
- Cells: the same chats stepped in process (benchmarks/shared_prefix.py); every cell in use read
  from llama.cpp's state, over the system prompt once plus each chat's own cells.
- Held at once: ``--shared-held`` chats of that shape in one pool of --shared-ctx cells (none
  waited, shifted or left: every slot still holds its chat), over what the per-slot layout can
  hold: the most slots whose share of the cells fits one such chat (the next count up is asked
  to take one, and refuses).
- 1 and 4 streams' tok/s on the pool over the per-slot layout, the same flags otherwise.
"""

from __future__ import annotations

import itertools
import statistics
import threading
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from benchmarks.calls import (
    PROMPTS,
    chat_request,
    concurrently,
    generate,
    prepare_text,
    prompt_tokens,
    user_message,
)
from benchmarks.harness import Bench
from benchmarks.results import BenchError, Row, Stream, compared, median, streamed_rate
from benchmarks.shared_prefix import run as run_in_process
from benchmarks.stall import heavy_pair, stall_jpeg
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc

TEXTS = Path(__file__).parent / "texts"
ROW_TTFT = "shared system prompt: later chats' median TTFT / the first's"
ROW_IMAGE = "shared system prompt + 1 MP image: later chats' median TTFT / the first's"
ROW_CELLS = "shared system prompt: cells in use (llama.cpp) / shared + each chat's own"
ROW_HELD = "shared system prompt: chats held at once, pool / per-slot"
ROW_STREAM1 = "1 stream tok/s: pool / per-slot layout"
ROW_STREAM4 = "4 streams tok/s: pool / per-slot layout"
ROW_STREAM1_BESIDE = "1 stream tok/s beside the chats' cells: pool / per-slot layout"
ROW_JOINING = "a prompt joining 3 streams, its TTFT: pool / per-slot layout"
ROWS = (
    ROW_TTFT, ROW_IMAGE, ROW_CELLS, ROW_HELD, ROW_STREAM1, ROW_STREAM4, ROW_STREAM1_BESIDE,
    ROW_JOINING,
)  # fmt: skip
JOINING_TOKENS = 800  # the joining prompt
REPLY_TOKENS = 8  # each chat's reply: TTFT is what is timed
POOL = ("--kv-unified",)


def question(i: int) -> str:
    return f"Question {i}: what is part {i} about?"


def system_text(prep: prep_pb2_grpc.PrepServiceStub, num_tokens: int) -> str:
    """Prose of about ``num_tokens`` tokens (prep's count)."""
    words = " ".join(p.read_text(errors="replace") for p in sorted(TEXTS.glob("*.md.txt")))
    words_list = words.split()
    count = len(prompt_tokens(prepare_text(prep, words)))
    while count < num_tokens:
        words_list += words_list
        count *= 2
    cut = words_list[: max(1, len(words_list) * num_tokens // count)]
    return " ".join(cut)


class Chats:
    """Chats of one shape: a system message (text, maybe an image), then a question of their own."""

    def __init__(self, prep: prep_pb2_grpc.PrepServiceStub, system: str, jpeg: bytes | None = None):
        parts = [prep_pb2.Part(text=system)]
        if jpeg is not None:
            parts.append(prep_pb2.Part(image=prep_pb2.Image(data=jpeg)))
        self.system = prep_pb2.Message(role="system", parts=parts)
        self.prep = prep
        self._prompts: dict[int, Any] = {}
        self.keep = sum(_cells(c) for c in self.prompt(0).chunks if c.message_index == 0)

    def prompt(self, i: int) -> Any:
        if i not in self._prompts:
            request = chat_request([self.system, user_message(question(i))])
            self._prompts[i] = self.prep.Prepare(request, timeout=600).prompt
        return self._prompts[i]

    def generate(
        self,
        infer: infer_pb2_grpc.InferServiceStub,
        i: int,
        salt: str,
        max_tokens: int,
        policy: int = 0,
    ) -> Stream:
        return generate(
            infer, self.prompt(i), max_tokens, keep=self.keep, cache_salt=salt, policy=policy
        )


def _cells(chunk: Any) -> int:
    return (
        chunk.media.num_cells if chunk.WhichOneof("kind") == "media" else len(chunk.text.token_ids)
    )


def first_and_later(
    b: Bench, infer: infer_pb2_grpc.InferServiceStub, chats: Chats, n: int, salt: str
) -> tuple[float, list[float]]:
    """The first chat alone, then the n - 1 others together: (its TTFT, theirs)."""
    for i in range(n):
        chats.prompt(i)  # (prepared before anything is timed)
    first = chats.generate(infer, 0, salt, REPLY_TOKENS)
    later = concurrently(
        [partial(chats.generate, infer, i, salt, REPLY_TOKENS) for i in range(1, n)]
    )
    return first.ttft, [s.ttft for s in later]


def ttft_row(b: Bench, name: str, infer: Any, chats: Chats, n: int, note: str) -> None:
    firsts, laters, ratios = [], [], []
    for r in range(b.o.repeats):
        first, later = first_and_later(b, infer, chats, n, salt=f"repeat {r}")
        firsts.append(first)
        laters.append(statistics.median(later))
        ratios.append(laters[-1] / first)
        b.log(f"{name}: first {first:.3f}s, later median {laters[-1]:.3f}s, max {max(later):.3f}s")
    stats = infer.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=30).stats
    note += (
        f"; {n} chats, the system message {chats.keep} cells (pinned); shared "
        f"{stats.num_shared_prefixes} times, {stats.num_shared_cells} cells not decoded"
    )
    b.rows.append(
        Row(
            name, median(laters) * 1e3, "ms", median(firsts) * 1e3, median(ratios), "<= 0.10",
            note, (min(ratios), max(ratios)),
        )
    )  # fmt: skip


def refuses(infer: infer_pb2_grpc.InferServiceStub, chats: Chats) -> bool:
    """Whether a per-slot server refuses one chat of this shape (its prompt does not fit)."""
    return not holds(infer, chats, 1)


def holds(infer: infer_pb2_grpc.InferServiceStub, chats: Chats, num_tokens: int) -> bool:
    """Whether a slot holds the first chat, prompt and a reply of ``num_tokens``: neither
    refused nor stopped short for want of cells (policy STOP: nothing of it evicted)."""
    try:
        s = chats.generate(infer, 0, "holds?", num_tokens, policy=infer_pb2.SHIFT_POLICY_STOP)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        return False
    return s.num_tokens >= num_tokens


def run(b: Bench) -> None:
    prep_svc = b.service("prep_service", ["--model", str(b.model), *template(b)])
    try:
        _bench_text(b, prep_pb2_grpc.PrepServiceStub(prep_svc.channel))
    finally:
        prep_svc.stop()
    image_row(b)


def template(b: Bench) -> list[str]:
    """(the base Gemma has no chat template: --chat-template gemma)"""
    return ["--chat-template", b.o.chat_template] if b.o.chat_template else []


def _bench_text(b: Bench, prep: prep_pb2_grpc.PrepServiceStub) -> None:
    o = b.o
    ctx, n = o.shared_ctx, o.shared_chats
    chats = Chats(prep, system_text(prep, o.shared_system))
    per_slot_cells = ctx // n
    with b.infer(ctx=ctx, parallel=n, extra=POOL) as pool, b.infer(ctx=ctx, parallel=n) as per_slot:
        streams = [prepare_text(prep, p) for p in PROMPTS]
        streams_rows(b, streams, pool, per_slot, ((1, ROW_STREAM1), (4, ROW_STREAM4)))
        size = min(JOINING_TOKENS, per_slot_cells // 2)  # (it fits the per-slot layout)
        joining_row(b, prep, streams, pool, per_slot, size)
        refused = refuses(per_slot, chats)
        today = f"per-slot layout ({per_slot_cells} cells a slot): " + (
            "refused" if refused else "takes it"
        )
        ttft_row(b, ROW_TTFT, pool, chats, n, f"{b.model.name}; {today}")
        # the pool now holds those chats (and a shared prefix per repeat): a stream's
        # attention spans the cells in use, others' included (masked)
        streams_rows(b, streams, pool, per_slot, ((1, ROW_STREAM1_BESIDE),))
    cells_row(b, chats.keep)
    held_row(b, chats)


def streams_rows(
    b: Bench, prompts: list[Any], pool: Any, per_slot: Any, rows: tuple[tuple[int, str], ...]
) -> None:
    o = b.o

    def streams(infer: Any, k: int) -> float:
        fns = [partial(generate, infer, p, o.tokens) for p in prompts[:k]]
        return streamed_rate(concurrently(fns))

    for k, name in rows:
        runs: dict[str, Callable[[], float]] = {
            "pool": partial(streams, pool, k), "per-slot": partial(streams, per_slot, k)
        }  # fmt: skip
        for fn in runs.values():
            fn()  # warm-up, and every later run reuses the prompt's cells alike
        res = b.interleaved(runs, o.repeats)
        note = f"--ctx-size {o.shared_ctx} --parallel {o.shared_chats}, {o.tokens} tokens"
        target = ">= 0.97" if name == ROW_STREAM1 else ""
        b.rows.append(compared(name, res["pool"], res["per-slot"], "tok/s", target, note))


def joining_row(
    b: Bench,
    prep: prep_pb2_grpc.PrepServiceStub,
    streams: list[Any],
    pool: Any,
    per_slot: Any,
    size: int,
) -> None:
    """A step that mixes generation and a prompt's pieces: llama.cpp splits such a batch
    otherwise with one pool than with a stream per slot (the issue asks which is faster).
    Each run's prompt opens with a number of its own: no cache answers it."""
    text, runs_so_far = system_text(prep, size), itertools.count()

    def joining(infer: Any) -> float:
        prompt = prepare_text(prep, f"Part {next(runs_so_far)}. {text}")
        going = [threading.Event() for _ in streams[:3]]
        ran = [
            threading.Thread(target=generate, args=(infer, p, 4 * b.o.tokens),
                             kwargs={"on_token": e.set})
            for p, e in zip(streams[:3], going, strict=True)
        ]  # fmt: skip
        for t in ran:
            t.start()
        try:
            for e in going:
                if not e.wait(300):
                    raise BenchError("a stream never started")
            return generate(infer, prompt, 2).ttft
        finally:
            for t in ran:
                t.join()

    runs: dict[str, Callable[[], float]] = {
        "pool": partial(joining, pool), "per-slot": partial(joining, per_slot)
    }  # fmt: skip
    res = b.interleaved(runs, b.o.repeats)
    note = f"~{size} prompt tokens beside 3 streams; the default layout: per-slot"
    b.rows.append(compared(ROW_JOINING, res["pool"], res["per-slot"], "ms", "", note, 1e3))


def cells_row(b: Bench, keep: int) -> None:
    o = b.o
    r = run_in_process(
        b.model, unified=True, ctx=o.shared_ctx, parallel=o.shared_chats, system=keep,
        threads=o.threads,
    )  # fmt: skip
    used, expected = int(r["used"]), int(r["expected"])
    note = (
        f"{o.shared_chats} chats in process: {used} cells read from llama.cpp, "
        f"{r['counted']} counted by the pool; the per-slot layout would hold "
        f"{r['per_slot']} (the system prompt in every slot)"
    )
    b.rows.append(Row(ROW_CELLS, used, "cells", expected, used / expected, "== 1.0", note))


def held_row(b: Bench, chats: Chats) -> None:
    """Chats held at once in the pool, against the most the per-slot layout holds."""
    o = b.o
    ctx, n = o.shared_ctx, o.shared_held
    with b.infer(ctx=ctx, parallel=n, extra=POOL) as pool:
        first = chats.generate(pool, 0, "held", REPLY_TOKENS)
        turns = [partial(chats.generate, pool, i, "held", REPLY_TOKENS) for i in range(1, n)]
        later = concurrently(turns)
        info = pool.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=30)
    st, kv = info.stats, info.pool
    # each slot holds the last chat it ran (the first's slot may have taken a later one): the
    # prefix once, and each chat's own cells (its reply's last token is sampled, not decoded)
    ended = sorted([first, *later], key=lambda s: s.arrivals[-1][0])  # (the last in a slot wins)
    own = {s.slot: s.prompt_cells - chats.keep + s.num_tokens - 1 for s in ended}
    held = len(own)
    if kv.num_cells_used != chats.keep + sum(own.values()) or st.num_shifts:
        raise_held(kv, st, chats.keep, own.values())
    # the per-slot layout: the most slots whose share of the cells holds one chat of this shape
    # (llama.cpp gives a slot a multiple of 256 cells: rounded down, the total stays in ctx)
    need = chats.keep + max(own.values())
    most = max((p for p in range(1, ctx // need + 1) if slot_cells(ctx, p) >= need), default=0)
    for p, want in ((most, True), (most + 1, False)):
        if p and slot_cells(ctx, p):
            with b.infer(ctx=p * slot_cells(ctx, p), parallel=p) as per_slot:
                if holds(per_slot, chats, first.num_tokens) != want:
                    why = f"{p} slots of {slot_cells(ctx, p)} cells: held {not want}"
                    raise_held(kv, st, chats.keep, own.values(), why)
    free = kv.num_cells - kv.num_cells_used
    note = (
        f"{held} of {n} chats held at once in {ctx} cells, {free} cells left (room for "
        f"~{free // max(own.values())} more), {st.num_pool_waits} pool waits; per-slot: {most} "
        f"slots of {slot_cells(ctx, most or 1)} cells hold one chat of {need} cells each "
        f"(checked), {most + 1} do not"
    )
    ratio = held / most if most else None  # (none: the per-slot layout holds not one)
    b.rows.append(Row(ROW_HELD, held, "chats", most, ratio, ">= 3", note))


def slot_cells(ctx: int, parallel: int) -> int:
    return ctx // parallel // 256 * 256


def raise_held(kv: Any, st: Any, keep: int, own: Iterable[int], why: str = "") -> None:
    raise BenchError(
        f"held at once: pool used {kv.num_cells_used}, expected {keep} + {sum(own)} "
        f"({kv.num_holders} holders, {kv.num_shared_cells} cells); {st.num_shifts} shifts, "
        f"{st.num_pool_waits} pool waits, {st.num_shared_prefixes} shared. {why}"
    )


def image_row(b: Bench) -> None:
    o = b.o
    pair = heavy_pair(b.log_dir / "shared", o.vision)
    pair_args = ["--model", str(pair.model), "--mmproj", str(pair.mmproj)]
    prep_svc = b.service("prep_service", [*pair_args, "--threads", "1"])
    try:
        prep = prep_pb2_grpc.PrepServiceStub(prep_svc.channel)
        chats = Chats(prep, system_text(prep, 200), stall_jpeg(seed=33 << 20))
        n = o.shared_chats
        with b.infer(ctx=o.shared_ctx, parallel=n, extra=POOL, model=pair.model,
                     mmproj=pair.mmproj) as pool:  # fmt: skip
            what = f"tiny mrope pair, vision {o.vision.width} x {o.vision.layers}"
            ttft_row(b, ROW_IMAGE, pool, chats, n, what)
    finally:
        prep_svc.stop()
