"""What a model will hold once loaded, estimated before it loads, from its files: the weights
(the GGUF's tensor sizes), the KV cache (cells x bytes per cell, from its layers and heads and
the cache type), the projector, llama.cpp's compute buffers (the logits of a batch and the
activations of a micro-batch) and the serving process itself. The router measures a loaded
model's resident size and holds it to that from then on."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Footprint", "available_bytes", "estimate", "fmt_bytes", "parse_bytes"]

# a `slotwise serve` process with nothing loaded: Python, grpc, FastAPI, llama.cpp's libraries
# (measured: 180-230 MiB resident on x86-64 Linux; rounded up)
PROCESS_BYTES = 256 << 20
_CACHE_TYPE_BYTES = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32,
}  # fmt: skip


@dataclass(frozen=True)
class Footprint:
    weights: int
    kv: int
    projector: int
    compute: int
    process: int = PROCESS_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.projector + self.compute + self.process

    def describe(self) -> str:
        parts = (("weights", self.weights), ("KV cache", self.kv), ("projector", self.projector),
                 ("compute buffers", self.compute), ("process", self.process))  # fmt: skip
        shown = " + ".join(f"{fmt_bytes(n)} {what}" for what, n in parts if n)
        return f"{fmt_bytes(self.total)} ({shown})"


def estimate(model: Path, mmproj: Path | None, args: Sequence[str], default_ctx: int) -> Footprint:
    """From the files' headers (nothing is loaded) and the model's flags (`--ctx-size`,
    `--batch-size`, `--ubatch-size`, `--cache-type-k/v`, slotwise serve's names)."""
    from gguf import GGUFReader  # (the serve extra's: only a router that loads models reads)

    reader = GGUFReader(model)
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    meta = _metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    ctx = _int_flag(args, "--ctx-size", default_ctx)
    n_batch = _int_flag(args, "--batch-size", 2048)
    n_ubatch = min(n_batch, _int_flag(args, "--ubatch-size", 512))
    k_bytes = _CACHE_TYPE_BYTES.get(_flag(args, "--cache-type-k") or "f16", 2.0)
    v_bytes = _CACHE_TYPE_BYTES.get(_flag(args, "--cache-type-v") or "f16", 2.0)
    layers = int(meta.get(f"{arch}.block_count", 0))
    embd = int(meta.get(f"{arch}.embedding_length", 0))
    heads = _first(meta.get(f"{arch}.attention.head_count", 1)) or 1
    kv_heads = _first(meta.get(f"{arch}.attention.head_count_kv", heads)) or heads
    key_len = int(meta.get(f"{arch}.attention.key_length", embd // heads))
    value_len = int(meta.get(f"{arch}.attention.value_length", embd // heads))
    per_cell = layers * kv_heads * (key_len * k_bytes + value_len * v_bytes)
    vocab = _vocab_size(meta, arch)
    # the logits of a batch (f32), and a micro-batch's activations through one layer's widest
    # tensors (llama.cpp reuses the buffer layer to layer)
    ff = _first(meta.get(f"{arch}.feed_forward_length", 4 * embd)) or 4 * embd
    compute = 4 * (n_batch * vocab + n_ubatch * (4 * embd + 2 * ff) + n_ubatch * ctx)
    projector = 0
    if mmproj is not None:
        projector = sum(int(t.n_bytes) for t in GGUFReader(mmproj).tensors)
    return Footprint(weights, int(per_cell * ctx), projector, compute)


def _metadata(reader: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in reader.fields.items():  # type: ignore[attr-defined]
        if name.startswith("tokenizer.ggml.tokens"):
            out[name] = len(f.data)
            continue
        try:
            value = f.contents()
        except Exception:  # (a type gguf-py cannot read into Python: not one we use)
            continue
        if isinstance(value, (int, float, str)) or (
            isinstance(value, list)
            and len(value) <= 4096
            and all(isinstance(v, int) for v in value)
        ):
            out[name] = value
    return out


def _vocab_size(meta: dict[str, Any], arch: str) -> int:
    n = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens") or 32000
    return int(n)  # type: ignore[call-overload]


def _first(value: object) -> int:
    """A per-layer count's largest (a list where layers differ), or the count."""
    if isinstance(value, list):
        return max((int(v) for v in value), default=0)
    return int(value)  # type: ignore[call-overload]


def _flag(args: Sequence[str], flag: str) -> str | None:
    value = None
    for i, word in enumerate(args[:-1]):
        if word == flag:
            value = args[i + 1]  # (the last one given wins, as argparse reads it)
    return value


def _int_flag(args: Sequence[str], flag: str, default: int) -> int:
    value = _flag(args, flag)
    return int(value) if value is not None and value.isdigit() else default


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """`8G`, `512M`, `1.5g`, or bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if m is None:
        raise ValueError(f"expected a size like 8G or 512M, got {text!r}")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def available_bytes(margin: float = 0.1) -> int | None:
    """The machine's available memory now (MemAvailable), less a margin; None where unknown."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        pages = getattr(os, "sysconf", lambda _n: -1)("SC_AVPHYS_PAGES")
        return int(pages * os.sysconf("SC_PAGE_SIZE") * (1 - margin)) if pages > 0 else None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(int(m.group(1)) * 1024 * (1 - margin)) if m else None
