"""LoRA adapters: loaded with the model at start (`--lora`, `--lora-scaled`), applied to the
context before each llama_decode.

llama.cpp applies adapters to the whole context, not per sequence: one `llama_decode` runs
under one adapter set. So a request's set (a `LoraSet`: the adapters it uses, by id, with their
scales) is resolved once, when it is admitted, and the executor decodes the slots of each set
in a batch of their own, the set applied before it. The set is part of every reuse key
(`Job.reuse_key`, a session's saved state): a cell decoded under one set is never reused under
another.

A request that names no adapters gets its tenant's scales: the flags' at start (0 with
`--lora-init-without-apply`), then what the tenant last set (llama-server's `POST
/lora-adapters`, global there: here each tenant's own, so that no tenant changes another's
replies). A request that names some gets those, every other adapter at scale 0, as
llama-server does.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from infer_service.kv.host_cache import LoraSet
from slotwise_core import native
from slotwise_core.model_files import file_digest

__all__ = ["LoraAdapter", "LoraAdapters", "LoraError", "LoraFile", "LoraSet", "lora_files"]


class LoraError(ValueError):
    """A request's adapters that cannot be applied (an id not loaded, a scale not finite)."""


@dataclass(frozen=True)
class LoraFile:
    """An adapter to load at start, and its scale (`--lora`: 1; `--lora-scaled F:S`: S)."""

    path: Path
    scale: float = 1.0


def lora_files(value: str, *, scaled: bool) -> list[LoraFile]:
    """llama-server's `--lora A.gguf,B.gguf` and `--lora-scaled A.gguf:0.5,B.gguf:1.2`
    (comma-separated values; ValueError for a malformed one)."""
    out = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        if not scaled:
            out.append(LoraFile(Path(item)))
            continue
        path, sep, scale = item.rpartition(":")
        if not sep or not path:
            raise ValueError(f"lora-scaled format: FNAME:SCALE, got {item!r}")
        s = float(scale)
        if not math.isfinite(s):
            raise ValueError(f"lora-scaled: the scale of {path} must be finite, got {scale}")
        out.append(LoraFile(Path(path), s))
    return out


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter, as `GET /lora-adapters` shows it."""

    id: int
    path: str  # as given at start
    task_name: str  # adapter.lora.task_name, "" when the file has none
    prompt_prefix: str  # adapter.lora.prompt_prefix
    digest: str  # the file's identity (model_files.file_digest): what a session file records


class LoraAdapters:
    """The adapters loaded with the model (ids in the order the flags gave them), the scales
    each tenant's requests get when they name none, and the set the context has applied."""

    def __init__(
        self, adapters: Sequence[LoraAdapter], handles: Sequence[Any], scales: Sequence[float]
    ):
        self.adapters = tuple(adapters)
        self._handles = tuple(handles)
        self._default = tuple(_f32(s) for s in scales)
        self._scales: dict[str, tuple[float, ...]] = {}  # tenant -> the scales it set
        self._lock = threading.Lock()  # (read and set by the servicer, off the engine thread)
        self._applied: LoraSet | None = ()  # what the context has (a new one has none)

    @classmethod
    def load(cls, model: Any, files: Sequence[LoraFile], *, apply: bool = True) -> LoraAdapters:
        """Load each file for the model (FileNotFoundError, or native.NativeError when
        llama.cpp refuses it: another architecture, or shapes of another model). Adapters
        loaded before a refusal stay with the model, which frees them. apply: False starts
        every scale at 0 (`--lora-init-without-apply`)."""
        adapters, handles = [], []
        for i, f in enumerate(files):
            if not f.path.is_file():
                raise FileNotFoundError(f"LoRA adapter not found: {f.path}")
            handle = llama_cpp.llama_adapter_lora_init(model, str(f.path).encode())
            if not handle:
                raise native.NativeError(
                    f"LoRA adapter {f.path}: llama.cpp could not load it (an adapter of "
                    "another model or architecture?)"
                )
            handles.append(handle)
            adapters.append(
                LoraAdapter(
                    i,
                    str(f.path),
                    _meta(handle, "adapter.lora.task_name"),
                    _meta(handle, "adapter.lora.prompt_prefix"),
                    file_digest(f.path),
                )
            )
        scales = [f.scale if apply else 0.0 for f in files]
        return cls(adapters, handles, scales)

    def __len__(self) -> int:
        return len(self.adapters)

    # -- the scales a request gets (the servicer's side) ------------------------------------

    def scales(self, tenant: str) -> tuple[float, ...]:
        """The scales a request of `tenant` that names no adapters gets, by id."""
        with self._lock:
            return self._scales.get(tenant, self._default)

    def set_scales(self, tenant: str, requested: Iterable[tuple[int, float]]) -> None:
        """The tenant's scales from now on: those listed, every other adapter 0 (llama-server's
        POST /lora-adapters). LoraError for an id not loaded or a scale not finite."""
        chosen = self._checked(requested)
        scales = tuple(chosen.get(i, 0.0) for i in range(len(self.adapters)))
        with self._lock:
            self._scales[tenant] = scales

    def resolve(self, tenant: str, requested: Iterable[tuple[int, float]]) -> LoraSet:
        """The set a request decodes under: the adapters it lists (the others at 0), or when
        it lists none, its tenant's scales. Only adapters of a scale other than 0 are in it
        (llama.cpp leaves the others out too): a set of none is ()."""
        chosen = self._checked(requested)
        if not chosen:
            chosen = dict(enumerate(self.scales(tenant)))
        return tuple((i, s) for i, s in sorted(chosen.items()) if s != 0.0)

    def _checked(self, requested: Iterable[tuple[int, float]]) -> dict[int, float]:
        chosen: dict[int, float] = {}
        for i, scale in requested:
            if not 0 <= i < len(self.adapters):
                n = len(self.adapters)
                loaded = (
                    f"ids 0 to {n - 1} are loaded"
                    if n
                    else "none is loaded: start infer_service with --lora"
                )
                raise LoraError(f"lora: no adapter has id {i} ({loaded})")
            if not math.isfinite(scale):
                raise LoraError(f"lora: the scale of adapter {i} must be finite, got {scale}")
            chosen[i] = _f32(scale)  # (a later entry of the same id wins, as llama-server's)
        return chosen

    def identity(self, lora: LoraSet) -> list[list[Any]]:
        """The set by the adapters' files rather than their ids, for what outlives this
        process (a session's KV state on disk): [[digest, scale], ...]."""
        return [[self.adapters[i].digest, s] for i, s in lora]

    # -- the context (engine thread) ----------------------------------------------------------

    def apply(self, ctx: Any, lora: LoraSet) -> bool:
        """Make `lora` the context's adapters (before a llama_decode); returns whether it
        changed them (llama.cpp then reserves its graph again: the executor orders a step's
        batches to change them as little as it can)."""
        if lora == self._applied:
            return False
        n = len(lora)
        handles = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self._handles[i] for i, _ in lora))
        scales = (ctypes.c_float * n)(*(s for _, s in lora))
        self._applied = None  # (unknown, should the call fail)
        rc = llama_cpp.llama_set_adapters_lora(
            ctx, handles if n else None, n, scales if n else None
        )
        if rc != 0:  # (the decode that wanted them fails: its requests are told)
            raise native.NativeError(f"llama_set_adapters_lora failed (rc={rc})")
        self._applied = lora
        return True

    @property
    def applied(self) -> LoraSet | None:
        return self._applied


def _f32(x: float) -> float:
    """A scale as llama.cpp holds it (a float): 0.7 given as a flag and 0.7 sent in a request
    are one set."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _meta(handle: Any, key: str) -> str:
    buf = ctypes.create_string_buffer(1024)
    n = llama_cpp.llama_adapter_meta_val_str(handle, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""
