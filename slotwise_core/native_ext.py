"""ctypes declarations for llama.cpp's staging API (src/llama-ext.h) that llama-cpp-python's
bindings leave out: the nextn (multi-token-prediction) embeddings.

llama.cpp's MTP drafting (common/speculative.cpp, ``draft-mtp``) reads the target's last
hidden state of every token of a decode (``h_nextn``) and feeds it to the MTP context beside
the next token. That needs ``llama_set_embeddings_nextn`` and ``llama_get_embeddings_nextn(_ith)``,
which libllama exports (LLAMA_API in llama-ext.h) but the Python bindings do not declare. They
are declared here, from the shared library the bindings loaded. llama-ext.h is a C++ header
with no ``extern "C"``: libllama exports them under their Itanium-mangled names (as
``nm -D --defined-only libllama.so | grep nextn`` shows), so each is looked up by its C name
first, then by its mangled one. A library without them makes each call raise NativeError
instead of crashing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as _bindings

from slotwise_core.native import NativeError

_FloatP = ctypes.POINTER(ctypes.c_float)


def _declare(
    name: str, mangled: str, argtypes: list[Any], restype: Any
) -> Callable[..., Any] | None:
    for symbol in (name, mangled):
        fn = getattr(_bindings._lib, symbol, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    return None  # this libllama does not export it


_ctx = llama_cpp.llama_context_p_ctypes
# (mangled: `llama_context *` is P13llama_context, bool b, int32_t i)
_set_embeddings_nextn = _declare(
    "llama_set_embeddings_nextn",
    "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    [_ctx, ctypes.c_bool, ctypes.c_bool],
    None,
)
_get_embeddings_nextn = _declare(
    "llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context", [_ctx], _FloatP
)
_get_embeddings_nextn_ith = _declare(
    "llama_get_embeddings_nextn_ith",
    "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
    [_ctx, ctypes.c_int32],
    _FloatP,
)

NEXTN_FUNCTIONS = (
    "llama_set_embeddings_nextn",
    "llama_get_embeddings_nextn",
    "llama_get_embeddings_nextn_ith",
)


def has_nextn() -> bool:
    """Whether the loaded libllama exports the nextn staging functions."""
    return None not in (_set_embeddings_nextn, _get_embeddings_nextn, _get_embeddings_nextn_ith)


def _need(fn: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
    if fn is None:
        raise NativeError(f"this libllama does not export {name} (llama-ext.h)")
    return fn


def set_embeddings_nextn(ctx: int, value: bool, masked: bool) -> None:
    """Whether decodes on ctx output each token's nextn embedding (its last hidden state);
    masked: only for the tokens whose logits are requested, else for every token, stored
    densely by batch index."""
    _need(_set_embeddings_nextn, "llama_set_embeddings_nextn")(ctx, value, masked)


def get_embeddings_nextn(ctx: int) -> Any:
    """The nextn rows of the last decode (a float pointer; NativeError where there are none)."""
    ptr = _need(_get_embeddings_nextn, "llama_get_embeddings_nextn")(ctx)
    if not ptr:
        raise NativeError("no nextn embeddings: llama_set_embeddings_nextn is off")
    return ptr


def get_embeddings_nextn_ith(ctx: int, i: int) -> Any:
    """The nextn row of batch index i of the last decode (NativeError where it is out of range;
    llama.cpp logs why)."""
    ptr = _need(_get_embeddings_nextn_ith, "llama_get_embeddings_nextn_ith")(ctx, i)
    if not ptr:
        raise NativeError(f"no nextn embedding for batch index {i}")
    return ptr
