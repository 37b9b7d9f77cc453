"""`slotwise demo`: a multimodal conversation that outgrows its context, turn after turn.

With no model given, it writes the tiny random-weight pairs into a temporary folder, starts
both services in this process on free loopback ports, and talks to them through the client:
the conversation is one session, like an interactive executor: each turn sends a Pillow-made
image and a question (and the previous reply as the chat template writes it, which the session
reuses from its cache), and the session's sequence shifts whenever the next decode would not
fit, images included, with the system prompt pinned.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from PIL import Image, ImageDraw

from clients.client import (
    Completion,
    FinishReason,
    Message,
    SlotwiseClient,
    SlotwiseError,
    collect,
)
from slotwise_serve.launch import ServeConfig, background_services

SYSTEM = "You are a careful assistant. Look at every picture and answer in one sentence."

# (question, image size, what to draw)
SCRIPT: tuple[tuple[str, tuple[int, int], str], ...] = (
    ("What shape is in this picture?", (224, 224), "circle"),
    ("And this one: how does it differ from the first?", (280, 168), "square"),
    ("Which of the pictures so far is the brightest?", (336, 224), "triangle"),
    ("Describe the colours of this image.", (224, 280), "gradient"),
    ("How many stripes are there here?", (252, 252), "stripes"),
    ("Summarise everything you have seen, picture by picture.", (196, 196), "rings"),
)

TINY_NOTE = (
    "note: the tiny models have random weights, so their text is gibberish; the cells, "
    "positions, shifts and evictions in the table are real llama.cpp behaviour."
)


@dataclass
class TurnResult:
    turn: int
    num_turn_cells: int = 0  # the chunks this turn sends
    num_reused_cells: int = 0  # of those, already in the cache (the previous reply)
    num_generated: int = 0
    num_shifts: int = 0
    num_evicted_cells: int = 0
    num_evicted_media: int = 0
    num_session_cells: int = 0  # what the session's sequence holds after the turn
    next_position: int = 0
    policies: str = "-"
    finish: str = "-"
    error: str = ""
    reply: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.finish in (FinishReason.STOP, FinishReason.LENGTH)


def make_image(kind: str, size: tuple[int, int], seed: int) -> Image.Image:
    """A small synthetic picture (distinct pixels per turn, so every media id differs)."""
    w, h = size
    img = Image.new("RGB", size, ((37 * seed) % 256, (91 * seed) % 256, (53 * seed) % 256))
    d = ImageDraw.Draw(img)
    fg = (255 - (37 * seed) % 256, 200, (17 * seed) % 256)
    if kind == "circle":
        d.ellipse((w // 5, h // 5, 4 * w // 5, 4 * h // 5), fill=fg)
    elif kind == "square":
        d.rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=fg)
    elif kind == "triangle":
        d.polygon([(w // 2, h // 8), (w // 8, 7 * h // 8), (7 * w // 8, 7 * h // 8)], fill=fg)
    elif kind == "gradient":
        for y in range(h):
            d.line((0, y, w, y), fill=(255 * y // h, 128, 255 - 255 * y // h))
    elif kind == "stripes":
        for k in range(0, w, max(1, w // 7)):
            d.rectangle((k, 0, k + w // 14, h), fill=fg)
    else:
        for r in range(min(w, h) // 2, 0, -max(1, min(w, h) // 10)):
            d.ellipse((w // 2 - r, h // 2 - r, w // 2 + r, h // 2 + r), outline=fg, width=3)
    return img


def run_conversation(
    client: SlotwiseClient,
    *,
    num_turns: int,
    max_tokens: int,
    image_scale: float = 1.0,
    seed: int = 7,
    temperature: float = 0.8,
    media_marker: str = "",
) -> list[TurnResult]:
    """Play the script as one session: each turn sends only what is new since the last one."""
    conversation: list[Message] = [Message.system(SYSTEM)]
    system_cells = client.prepare(conversation).num_cells_of(0)
    session = client.create_session(keep=system_cells, truncate_prompt=True)
    results = []
    first = 0  # the first message this turn sends: the session holds the ones before
    for k in range(num_turns):
        question, (w, h), kind = SCRIPT[k % len(SCRIPT)]
        size = (max(28, int(w * image_scale)), max(28, int(h * image_scale)))
        conversation.append(Message.user(make_image(kind, size, k + 1), question))
        row = TurnResult(turn=k + 1)
        results.append(row)
        try:
            prepared = client.prepare(conversation, first_message=first)
            row.num_turn_cells = prepared.num_cells
            done: Completion = collect(
                client.generate(
                    prepared,
                    session_id=session.session_id,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=seed + k,
                )
            )
            held = client.get_session(session.session_id)
        except SlotwiseError as e:
            row.error = str(e)
            row.finish = "error"
            break
        finished = done.finished
        row.num_reused_cells = done.started.num_reused_cells if done.started else 0
        row.num_generated = done.usage.num_generated_tokens
        row.num_shifts = len(done.shifts)
        row.num_evicted_cells = done.num_evicted_cells
        row.num_evicted_media = done.num_evicted_media
        row.num_session_cells = held.num_cells
        row.next_position = held.next_position
        row.policies = "/".join(dict.fromkeys(s.policy.value for s in done.shifts)) or "-"
        row.finish = done.reason.value
        row.reply = done.text
        if finished is None or finished.error or not row.ok:
            row.error = (finished.error if finished else "") or f"finished: {row.finish}"
            break
        reply = done.text.replace(media_marker, "") if media_marker else done.text
        conversation.append(Message.assistant(reply or "."))
        first = len(conversation) - 1  # next turn starts with this reply, as the template writes it
    client.delete_session(session.session_id)
    return results


COLUMNS = (
    ("turn", "turn"),
    ("turn cells", "num_turn_cells"),
    ("reused", "num_reused_cells"),
    ("generated", "num_generated"),
    ("shifts", "num_shifts"),
    ("evicted cells", "num_evicted_cells"),
    ("evicted media", "num_evicted_media"),
    ("session cells", "num_session_cells"),
    ("next pos", "next_position"),
    ("policy", "policies"),
    ("finish", "finish"),
)


def format_table(rows: Sequence[TurnResult]) -> str:
    cells = [[str(getattr(r, attr)) for _, attr in COLUMNS] for r in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _) in enumerate(COLUMNS)]
    lines = ["  ".join(t.rjust(w) for (t, _), w in zip(COLUMNS, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def printable(text: str, limit: int = 48) -> str:
    shown = "".join(ch if ch.isprintable() and ch != "\ufffd" else "·" for ch in text)
    return shown[:limit] + ("…" if len(shown) > limit else "")


@dataclass(frozen=True)
class DemoRun:
    name: str
    config: ServeConfig
    max_tokens: int
    image_scale: float


def run_pair(run: DemoRun, *, num_turns: int, out: TextIO) -> bool:
    t0 = time.perf_counter()
    with (
        background_services(run.config) as services,
        SlotwiseClient(services.prep_address, services.infer_address, timeout=120) as client,
    ):
        info = client.server_info()
        model = client.model_info()
        policy = "SHIFT" if info.can_shift else "GAP (positions kept, cells freed)"
        print(
            f"\n== {run.name}: {model.model_description}, "
            f"{'M-RoPE' if info.uses_mrope else 'RoPE'}, can_shift={info.can_shift} "
            f"-> AUTO uses {policy}; {info.num_slots} slot x {info.num_cells_per_slot} cells, "
            f"max_tokens {run.max_tokens}",
            file=out,
        )
        rows = run_conversation(
            client,
            num_turns=num_turns,
            max_tokens=run.max_tokens,
            image_scale=run.image_scale,
            media_marker=model.media_marker,
        )
        stats = client.server_info().stats
    print(format_table(rows), file=out)
    for r in rows:
        if r.error:
            print(f"turn {r.turn} failed: {r.error}", file=out)
        else:
            print(f"turn {r.turn} reply: {printable(r.reply)}", file=out)
    print(
        f"{run.name}: {sum(r.num_shifts for r in rows)} shifts, "
        f"{sum(r.num_evicted_cells for r in rows)} cells evicted, "
        f"{stats.num_media_decodes} media decodes "
        f"({stats.num_media_cache_hits} embedding cache hits), "
        f"{time.perf_counter() - t0:.2f} s",
        file=out,
    )
    return len(rows) == num_turns and all(r.ok for r in rows)


def run_demo(
    model: Path | None = None,
    mmproj: Path | None = None,
    *,
    num_turns: int = 5,
    ctx_size: int | None = None,
    max_tokens: int | None = None,
    threads: int | None = None,
    gpu_layers: int = 0,
    out: TextIO = sys.stdout,
) -> int:
    """Run the demo; 0 when every turn of every pair finished, 1 otherwise."""
    t0 = time.perf_counter()
    ok = True
    if model is None:
        from slotwise_core.tiny_models import write_tiny_models

        with tempfile.TemporaryDirectory(prefix="slotwise-demo-") as tmp:
            pairs = write_tiny_models(Path(tmp), ["mrope", "rope"])
            print(f"tiny models written to {tmp} (mrope: qwen2vl, rope: llama + mlp)", file=out)
            for name in ("mrope", "rope"):
                pair = pairs[name]
                config = ServeConfig.of(
                    pair.model, pair.mmproj, prep_port=0, infer_port=0, prep={"threads": 1},
                    infer={"ctx_size": ctx_size or 512, "threads": threads or 1},
                )  # fmt: skip
                run = DemoRun(name, config, max_tokens or 64, 1.0)
                ok = run_pair(run, num_turns=num_turns, out=out) and ok
        print(f"\n{TINY_NOTE}", file=out)
    else:
        infer: dict[str, Any] = {"ctx_size": ctx_size or 1024, "gpu_layers": gpu_layers}
        if threads:
            infer["threads"] = threads
        config = ServeConfig.of(model, mmproj, prep_port=0, infer_port=0, infer=infer)
        ok = run_pair(
            DemoRun(model.name, config, max_tokens or 96, 2.0), num_turns=num_turns, out=out
        )
    status = "ok" if ok else "FAILED"
    print(f"demo {status} in {time.perf_counter() - t0:.2f} s", file=out)
    return 0 if ok else 1
