"""The resent section of slotwise bench: an OpenAI-style client, whose every turn sends the
whole conversation again (Prepare of the chat, then a stateless Generate of --resent-tokens,
greedy) and appends the reply as an assistant message; a new 1000x1000 JPEG in every third user
turn (1, 4, 7...), on the tiny qwen2vl pair (or --model with --mmproj). A late turn should cost
what an early one does: prep knows a resent file by its digest, infer a checked image by its
bytes' digest, and infer continues the slot's sequence.

- the mean latency of the last 3 turns over the first 3's (--resent-turns in all), goal <= 1.2;
- the same over the same conversations sent as a session's turns (only the messages from the
  previous reply on: no image sent again), goal <= 1.2.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.calls import ResentTurn, chat_request, resent_turn, user_message
from benchmarks.harness import Bench, round_up
from benchmarks.images import make_jpeg
from benchmarks.results import compared, median
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import write_tiny_models

ROW_RESENT = "resent chat: last 3 turns' latency / first 3 turns'"
ROW_RESENT_SESSION = "resent chat: last 3 turns' latency / the same as session turns"
RESENT_SEED = 1 << 20  # the resent chat's photos: seeds of their own (no other section's image)

Conversation = list[ResentTurn]


def run(b: Bench) -> None:
    """The conversations, resent and as sessions, on one prep and one infer; then the rows."""
    o = b.o
    model, mmproj, what = _pair(b)
    turns = o.resent_turns
    pair_args = ["--model", str(model), "--mmproj", str(mmproj), "--threads", str(o.threads)]
    prep_svc = b.service("prep_service", pair_args)
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
        with b.infer(ctx=ctx, parallel=1, model=model, mmproj=mmproj) as infer:
            runs, sessions = _conversations(b, prep, infer)
    finally:
        prep_svc.stop()
    _rows(b, runs, sessions, what=what, photo_cells=photo_cells, ctx=ctx)


def _pair(b: Bench) -> tuple[Path, Path, str]:
    """--model and --mmproj, or the tiny mrope pair written to the log directory."""
    o = b.o
    if o.mmproj and o.model:
        return o.model, o.mmproj, f"{o.model.name} + {o.mmproj.name}"
    pair = write_tiny_models(b.log_dir / "resent", ["mrope"])["mrope"]
    return pair.model, pair.mmproj, "tiny mrope pair"


def _conversations(
    b: Bench, prep: prep_pb2_grpc.PrepServiceStub, infer: infer_pb2_grpc.InferServiceStub
) -> tuple[list[Conversation], list[Conversation]]:
    """After a warm-up turn, --repeats conversations resent whole, each followed by the same
    conversation (new photos of the same size) as a session's turns."""
    o = b.o
    turns = o.resent_turns
    seeds = itertools.count(RESENT_SEED)

    def conversation(c: int, n_turns: int, session: str = "") -> Conversation:
        messages: list[Any] = []
        out = []
        if session:
            infer.CreateSession(infer_pb2.CreateSessionRequest(session_id=session), timeout=30)
        for k in range(1, n_turns + 1):
            text = f"Conversation {c}, turn {k}: what do you make of this?"
            jpeg = make_jpeg(1000, 1000, next(seeds)) if k % 3 == 1 else None
            messages.append(user_message(text, jpeg))
            t = resent_turn(prep, infer, messages, o.resent_tokens, session)
            t.photo = jpeg is not None
            messages.append(prep_pb2.Message(role="assistant", parts=[prep_pb2.Part(text=t.reply)]))
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
        b.log(f"resent {c}: turns {per_turn} ms, last 3 / first 3 "
              f"{sum(per_turn[-3:]) / sum(per_turn[:3]):.3f}; as a session: "
              f"{[round(t.seconds * 1e3) for t in sessions[-1]]} ms")  # fmt: skip
    return runs, sessions


def _rows(
    b: Bench,
    runs: list[Conversation],
    sessions: list[Conversation],
    *,
    what: str,
    photo_cells: int,
    ctx: int,
) -> None:
    """The last 3 turns over the first 3, and the same over the conversations as sessions."""
    o = b.o
    turns = o.resent_turns
    photos = -(-turns // 3)
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
    b.rows.append(compared(ROW_RESENT, lasts, firsts, "ms", "<= 1.2", note, scale=1e3))
    as_session = [sum(t.seconds for t in r[-3:]) / 3 for r in sessions]
    session_engine = median([sum(t.engine_seconds for t in r[-3:]) / 3 for r in sessions])
    note = (
        "the same conversations' last 3 turns sent as a session's turns (only the messages "
        "from the previous reply on: no image sent again), on the same infer: what "
        "resending the whole chat costs beyond the cells both decode; infer's prefill + "
        f"decode, last 3 turns: {window_ms(lambda t: t.engine_seconds, lasts3)} ms resent, "
        f"{session_engine * 1e3:.0f} ms as a session"
    )
    b.rows.append(compared(ROW_RESENT_SESSION, lasts, as_session, "ms", "<= 1.2", note, scale=1e3))
