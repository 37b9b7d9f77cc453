"""The hybrid section of slotwise bench (issue 42): a chat resent whole every turn on a model
whose memory is hybrid (the tiny ``qwen35`` pair, or ``--model``/``--mmproj``), beside
llama-server on the same file.

Each turn sends the whole conversation again (a stateless Generate of ``--resent-tokens``,
greedy) and appends the reply stripped of surrounding whitespace, as chat UIs and many
templates (``| trim``) do: the resent chat parts from what the slot holds inside the last reply,
where only a checkpoint at or before that point lets the prefix be reused. A slot holds
``--hybrid-ctx`` cells, fewer than the chat grows to.

- Prompt cells decoded on turns 2-N, with checkpoints of the recurrent state (the default
  ``--ctx-checkpoints``) over none (``--ctx-checkpoints 0``: every turn decoded whole, the only
  exact way without them; refused once the whole chat passes the slot), over the turns both
  served; llama-server's own ratio (its ``--ctx-checkpoints`` default over 0), over the turns it
  served, in the note.
- Checkpoint bytes per slot: what the slot's checkpoints held after the last turn (WatchSlots).
- Turns served before the context ends: slotwise goes on past it (evictions re-prefill from
  the pinned prefix's checkpoint), llama-server answers 400 there.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import grpc

from benchmarks.calls import resent_turn, user_message
from benchmarks.harness import Bench
from benchmarks.results import BenchError, Row
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import write_tiny_models

ROW_DECODED = "hybrid, chat resent whole: prompt cells decoded, checkpoints / none"
ROW_BYTES = "hybrid: checkpoint bytes per slot"
ROW_TURNS = "hybrid, chat resent whole: turns served, checkpoints / none"
ROW_TURNS_SERVER = "hybrid, chat resent whole: turns served, slotwise / llama-server"
ROWS = (ROW_DECODED, ROW_BYTES, ROW_TURNS)  # (and ROW_TURNS_SERVER with --llama-server)
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 2


def turn_text(k: int) -> str:
    return f"Turn {k}: what would you say about the number {k}, and why?"


def run(b: Bench) -> None:
    o = b.o
    if o.model and o.mmproj:
        model, mmproj, what = o.model, o.mmproj, f"{o.model.name} + {o.mmproj.name}"
    else:
        pair = write_tiny_models(b.log_dir / "hybrid", ["qwen35"])["qwen35"]
        model, mmproj, what = pair.model, pair.mmproj, "tiny qwen35 pair"
    turns, ctx = o.resent_turns, o.hybrid_ctx
    prep_svc = b.service("prep_service", ["--model", str(model), "--mmproj", str(mmproj)])
    try:
        prep = prep_pb2_grpc.PrepServiceStub(prep_svc.channel)
        ours: dict[str, list[tuple[int, int]]] = {}
        for label, extra in (("checkpoints", []), ("none", ["--ctx-checkpoints", "0"])):
            with b.infer(
                ctx=ctx, parallel=1, model=model, mmproj=mmproj, extra=extra
            ) as infer:  # fmt: skip
                ours[label] = _slotwise_chat(prep, infer, turns, o.resent_tokens)
                if label == "checkpoints":
                    held = _checkpoint_bytes(infer)
                    info = infer.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)
            b.log(f"hybrid, slotwise {label}: (prompt, reused) per turn {ours[label]}")
    finally:
        prep_svc.stop()
    theirs: dict[str, list[tuple[int, int]]] = {}
    for label, extra in (("checkpoints", []), ("none", ["--ctx-checkpoints", "0"])):
        with b.llama_server(
            ctx=ctx, parallel=1, model=model, mmproj=mmproj, extra=extra
        ) as server:  # fmt: skip
            if server is not None:
                theirs[label] = _server_chat(server.port, turns, o.resent_tokens)
                b.log(f"hybrid, llama-server {label}: (prompt, cached) {theirs[label]}")

    def decoded(rows: list[tuple[int, int]], upto: int | None = None) -> int:
        return sum(p - r for p, r in rows[1:upto])

    served, both = len(ours["checkpoints"]), len(ours["none"])
    with_ck, without = decoded(ours["checkpoints"], both), decoded(ours["none"])
    note = (
        f"{what}; {turns} turns of --resent-tokens {o.resent_tokens}, greedy, each reply resent "
        f"stripped of surrounding whitespace; one slot of "
        f"{info.num_cells_per_slot} cells (--hybrid-ctx {ctx}); turns 2-{both} (without "
        f"checkpoints the chat was refused after turn {both}): {with_ck} / {without} prompt "
        f"cells decoded; all {served} turns with checkpoints: {decoded(ours['checkpoints'])} of "
        f"{sum(p for p, _ in ours['checkpoints'][1:])} decoded; "
        f"{info.stats.num_checkpoints} checkpoints saved, {info.stats.num_checkpoint_restores} "
        f"restored, {info.stats.num_shifts} evictions"
    )
    server_turns = 0
    if theirs:
        n = server_turns = len(theirs["checkpoints"])
        mine = decoded(ours["checkpoints"], n) / max(1, decoded(ours["none"], n))
        ratio = decoded(theirs["checkpoints"]) / max(1, decoded(theirs["none"]))
        note += (
            f"; llama-server over the {n} turns it served: {ratio:.3f} "
            f"({decoded(theirs['checkpoints'])} / {decoded(theirs['none'])}), "
            f"slotwise over the same turns {mine:.3f}"
        )
    b.rows.append(Row(ROW_DECODED, with_ck, "cells", without, with_ck / without, "<= 0.2", note))
    b.rows.append(
        Row(
            ROW_BYTES, held, "bytes",
            note=f"{info.num_checkpoint_bytes} bytes a checkpoint, at most "
            f"{info.num_checkpoints_per_slot} a slot (--ctx-checkpoints)",
        )
    )  # fmt: skip
    b.rows.append(
        Row(
            ROW_TURNS, served, "turns", both, served / both if both else None,
            note=f"of {turns}; without checkpoints a turn is refused once the chat passes the slot",
        )
    )  # fmt: skip
    if server_turns:
        b.rows.append(
            Row(
                ROW_TURNS_SERVER, served, "turns", server_turns, served / server_turns,
                note=f"of {turns}; llama-server answers 400 once the chat passes its context",
            )
        )  # fmt: skip


def _slotwise_chat(
    prep: prep_pb2_grpc.PrepServiceStub,
    infer: infer_pb2_grpc.InferServiceStub,
    turns: int,
    max_tokens: int,
) -> list[tuple[int, int]]:
    """(prompt cells, reused cells) of each turn served, up to the first refused."""
    messages: list[Any] = [prep_pb2.Message(role="system", parts=[prep_pb2.Part(text=SYSTEM)])]
    out = []
    for k in range(1, turns + 1):
        messages.append(user_message(turn_text(k)))
        try:
            t = resent_turn(prep, infer, messages, max_tokens)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:  # (the prompt cannot fit)
                raise
            break
        out.append((t.prompt_cells, t.reused_cells))
        reply = prep_pb2.Part(text=t.reply.strip())
        messages.append(prep_pb2.Message(role="assistant", parts=[reply]))
    return out


def _checkpoint_bytes(infer: infer_pb2_grpc.InferServiceStub) -> int:
    """What the slot's checkpoints hold now (the first picture WatchSlots sends)."""
    for view in infer.WatchSlots(infer_pb2.WatchSlotsRequest(), timeout=30):
        return max((s.num_checkpoint_bytes for s in view.slots), default=0)
    raise BenchError("WatchSlots sent nothing")


def _server_chat(port: int, turns: int, max_tokens: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn llama-server answered; it stops at the
    first refusal (the context is full)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for k in range(1, turns + 1):
        messages.append({"role": "user", "content": turn_text(k)})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            resp = conn.getresponse()
            reply = json.loads(resp.read() or b"{}")
        finally:
            conn.close()
        if resp.status != 200:
            break
        u = reply["usage"]
        out.append((u["prompt_tokens"], u.get("prompt_tokens_details", {}).get("cached_tokens", 0)))
        text = reply["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": text.strip()})
    return out
