"""KV cache types: llama-server's names for them (`--cache-type-k/v`), and what llama.cpp
refuses of them, said before it is asked.

A cell's K and V may be stored in half the bytes of f16 (q8_0) or less (q4_0...): on the same
memory, about twice the context. The ledger counts cells whatever their type. llama.cpp
refuses a quantized V cache without flash attention, and a quantized type whose block (32
values) does not divide the head size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# ggml_type ids (ggml.h) of the types llama-server's --cache-type-k/v take (common/arg.cpp)
GGML_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
}
QUANTIZED = ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
BLOCK = 32  # values per block of every quantized type above
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type


class CacheTypeError(ValueError):
    """A combination llama.cpp would refuse, with why."""


@dataclass(frozen=True)
class CacheTypes:
    k: str = "f16"
    v: str = "f16"
    flash_attn: str = "auto"

    def __post_init__(self) -> None:
        for which, name in (("K", self.k), ("V", self.v)):
            if name not in GGML_TYPES:
                raise CacheTypeError(f"{which} cache type {name!r}: one of {', '.join(GGML_TYPES)}")
        if self.flash_attn not in FLASH_ATTN:
            raise CacheTypeError(f"flash attention {self.flash_attn!r}: on, off or auto")
        if self.v in QUANTIZED and self.flash_attn == "off":
            raise CacheTypeError(
                f"a quantized V cache ({self.v}) needs flash attention: --flash-attn on or "
                "auto (llama.cpp refuses it without)"
            )

    @property
    def quantized(self) -> bool:
        return self.k in QUANTIZED or self.v in QUANTIZED

    def check_head_size(self, head_size: int) -> None:
        """llama.cpp's rule: a quantized type's block divides every layer's head size."""
        for which, name in (("K", self.k), ("V", self.v)):
            if name in QUANTIZED and head_size % BLOCK:
                raise CacheTypeError(
                    f"{which} cache type {name} stores blocks of {BLOCK} values, which do not "
                    f"divide this model's head size ({head_size}): use f16, bf16 or f32"
                )

    def shift_crashes(self, head_size: int) -> bool:
        """Whether llama.cpp would crash shifting this K cache (measured on the vendored
        llama.cpp: a segfault in llama_kv_cache::build_rope_shift). A quantized K is
        dequantized, rotated and quantized back through its Hadamard rotation matrix, which
        llama.cpp makes only where the head size is a multiple of 64 (and
        LLAMA_ATTN_ROT_DISABLE is unset); elsewhere the shift multiplies by a null tensor."""
        rotated = head_size % 64 == 0 and not int(os.environ.get("LLAMA_ATTN_ROT_DISABLE", 0))
        return self.k in QUANTIZED and not rotated

    def describe(self) -> str:
        return f"K {self.k}, V {self.v}, flash attention {self.flash_attn}"
