"""What a model will hold once loaded, estimated before it loads, from its files: the weights
(the GGUF's tensor sizes), the KV cache (cells x bytes per cell, from its layers and heads and
the cache type), the projector, llama.cpp's compute buffers (the logits of a batch and the
activations of a micro-batch) and the serving process itself. The router measures a loaded
model's resident size and holds it to that from then on."""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
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
    meta, weights = read_header(model)
    weights += sum(read_header(part)[1] for part in _other_parts(model, meta))
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
    # llama.cpp reserves its graph for a micro-batch of outputs: their logits (f32), and the
    # widest activations of one layer (the buffer is reused layer to layer) with the
    # attention scores over the context
    ff = _first(meta.get(f"{arch}.feed_forward_length", 4 * embd)) or 4 * embd
    compute = 4 * n_ubatch * (vocab + 4 * embd + 2 * ff + ctx)
    projector = read_header(mmproj)[1] if mmproj is not None else 0
    return Footprint(weights, int(per_cell * ctx), projector, compute)


def _other_parts(model: Path, meta: dict[str, Any]) -> list[Path]:
    """A split model's other files (NAME-00002-of-00003.gguf ...), beside its first."""
    count = int(meta.get("split.count", 1) or 1)
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", model.name)
    if count <= 1 or m is None:
        return []
    return [model.with_name(f"{m[1]}-{k:05d}-of-{m[3]}.gguf") for k in range(2, count + 1)]


# GGUF's value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 4096  # longer arrays (a vocabulary) are skipped, only counted


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A GGUF file's metadata (scalars and short arrays; a long array as its length) and its
    tensors' size in bytes, from the header alone (gguf-py's reader decodes every token of a
    vocabulary: seconds for a 262k one)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        _version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        at = 24
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, at = _string(m, at)
            (kind,) = struct.unpack_from("<I", m, at)
            meta[key], at = _value(m, at + 4, kind)
        weights = 0
        for _ in range(n_tensors):
            _name, at = _string(m, at)
            (n_dims,) = struct.unpack_from("<I", m, at)
            dims = struct.unpack_from(f"<{n_dims}Q", m, at + 4)
            (kind,) = struct.unpack_from("<I", m, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 4 + 8
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            weights += math.prod(dims) // block * size
    return meta, weights


def _string(m: mmap.mmap, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, at)
    return m[at + 8 : at + 8 + n].decode(errors="replace"), at + 8 + n


def _value(m: mmap.mmap, at: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALAR:
        fmt = "<" + _SCALAR[kind]
        return struct.unpack_from(fmt, m, at)[0], at + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(m, at)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, n = struct.unpack_from("<IQ", m, at)
    at += 12
    if item == _STRING:
        for _ in range(n):  # (each string its own length: walked, not decoded)
            at += 8 + struct.unpack_from("<Q", m, at)[0]
        return n, at
    fmt = "<" + _SCALAR[item]
    width = struct.calcsize(fmt)
    if n > _SMALL_ARRAY:
        return n, at + n * width
    return list(struct.unpack_from(f"<{n}{_SCALAR[item]}", m, at)), at + n * width


def _vocab_size(meta: dict[str, Any], arch: str) -> int:
    n = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens") or 32000
    return n if isinstance(n, int) else len(n)


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
