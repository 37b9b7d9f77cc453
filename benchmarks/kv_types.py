"""The kvtypes section of slotwise bench: the same model served with f16 cells and with q8_0
cells (--cache-type-k/v q8_0 --flash-attn on). Cells that fit in the same bytes, q8_0 over f16
(each side's bytes a cell, as its GetServerInfo reads them off llama.cpp's own state), and
streamed tokens/s of one greedy stream, q8_0 over f16, interleaved in this run. Quantized cells
need a head size that 32 divides (Gemma 3 270M: 256): a model whose heads are narrower (the tiny
pairs' 16) is replaced by a generated one of the same vocabulary with one 64-wide head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.calls import PROMPTS, generate, prepare_text
from benchmarks.harness import Bench
from benchmarks.results import Row, compared, streamed_rate
from slotwise.v1 import infer_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import Text, write_text_model

ROW_CELLS = "cells in the same bytes: q8_0 / f16"
ROW_RATE = "1 stream tok/s: q8_0 cells / f16 cells"
Q8 = ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--flash-attn", "on")
F16 = ("--cache-type-k", "f16", "--cache-type-v", "f16", "--flash-attn", "on")


def run(b: Bench) -> None:
    """Both servers side by side; their streams interleaved."""
    o = b.o
    model = b.model if head_size(b.model) % 32 == 0 else _one_wide_head(b.log_dir)
    prep = b.service("prep_service", ["--model", str(model)])
    try:
        prompt = prepare_text(prep_pb2_grpc.PrepServiceStub(prep.channel), PROMPTS[0])
    finally:
        prep.stop()
    with (
        b.infer(ctx=o.ctx, parallel=1, extra=F16, model=model) as f16,
        b.infer(ctx=o.ctx, parallel=1, extra=Q8, model=model) as q8,
    ):
        sizes = [
            s.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10).num_bytes_per_cell
            for s in (f16, q8)
        ]
        runs: dict[str, Callable[[], float]] = {
            "q8_0": lambda: streamed_rate([generate(q8, prompt, o.tokens)]),
            "f16": lambda: streamed_rate([generate(f16, prompt, o.tokens)]),
        }
        for fn in runs.values():
            fn()  # (warm both)
        res = b.interleaved(runs, o.repeats)
    cells = sizes[0] / sizes[1]
    note = (
        f"{sizes[0]} bytes a cell in f16, {sizes[1]} in q8_0 (llama.cpp's own rows), {model.name}"
    )
    b.rows.append(Row(ROW_CELLS, cells, "x", 1.0, cells, ">= 1.8", note))
    b.rows.append(
        compared(ROW_RATE, res["q8_0"], res["f16"], "tok/s", ">= 0.90", f"ctx {o.ctx}, greedy")
    )


def head_size(model: Path) -> int:
    """The model's attention head size, from its GGUF keys."""
    from gguf import GGUFReader

    fields = GGUFReader(model).fields
    arch = fields["general.architecture"].contents()

    def value(key: str) -> Any:
        f = fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    heads = value("attention.head_count")
    heads = max(heads) if isinstance(heads, list) else heads
    return int(value("attention.key_length") or value("embedding_length") // heads)


def _one_wide_head(where: Path) -> Path:
    return write_text_model(where / "one-64-wide-head.gguf", Text(width=64, heads=1, kv_heads=1))
