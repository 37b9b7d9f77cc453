"""Tiny random LoRA adapters (GGUF) for the tiny pairs' text models, for tests and demos.

An adapter is written as llama.cpp's convert_lora_to_gguf.py writes one: ``general.type``
"adapter", ``general.architecture`` the base model's, ``adapter.type`` "lora",
``adapter.lora.alpha``, and for each adapted weight ``W`` (ggml ``ne`` [n_in, n_out]) a pair
``W.lora_a`` ([n_in, rank]) and ``W.lora_b`` ([rank, n_out]); llama.cpp adds
``scale * alpha / rank * B @ A`` to the weight's product. Here every attention and feed-forward
weight of every layer is adapted, with values large enough beside the base weights' (std 0.02)
that the greedy tokens of a random model change under scale 1.

The weights are random (a fixed numpy seed, so every run writes the same bytes). Called from
slotwise_core/tiny_models.py (``write_tiny_lora``, ``slotwise-tiny-models DIR --lora``); the
pairs' own files never change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["LoraShape", "write_lora"]


@dataclass(frozen=True)
class LoraShape:
    """The base text model's sizes an adapter must match."""

    arch: str  # general.architecture of the base model
    width: int  # n_embd
    ff: int  # feed_forward_length
    layers: int
    kv_width: int  # head_dim * head_count_kv


def _targets(s: LoraShape, layer: int) -> list[tuple[str, int, int]]:
    """(weight name, n_in, n_out) of each adapted weight of one layer."""
    p = f"blk.{layer}"
    n, kv, ff = s.width, s.kv_width, s.ff
    return [
        (f"{p}.attn_q.weight", n, n),
        (f"{p}.attn_k.weight", n, kv),
        (f"{p}.attn_v.weight", n, kv),
        (f"{p}.attn_output.weight", n, n),
        (f"{p}.ffn_gate.weight", n, ff),
        (f"{p}.ffn_up.weight", n, ff),
        (f"{p}.ffn_down.weight", ff, n),
    ]


def write_lora(
    path: Path,
    shape: LoraShape,
    *,
    seed: int,
    rank: int = 4,
    alpha: float | None = None,
    std: float = 0.15,
    task_name: str = "",
    prompt_prefix: str = "",
) -> Path:
    """Write a random LoRA adapter for a model of `shape` to path (the same bytes for the same
    arguments). alpha: default the rank (so scale 1 adds B @ A itself)."""
    import gguf  # local import: keeps `import slotwise_core.tiny_lora` cheap

    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), shape.arch)
    try:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string("general.name", f"slotwise-tiny-{shape.arch}-lora")
        w.add_uint32("general.file_type", 0)  # all F32
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank if alpha is None else alpha))
        if task_name:
            w.add_string(gguf.Keys.Adapter.LORA_TASK_NAME, task_name)
        if prompt_prefix:
            w.add_string(gguf.Keys.Adapter.LORA_PROMPT_PREFIX, prompt_prefix)
        for layer in range(shape.layers):
            for name, n_in, n_out in _targets(shape, layer):
                # (numpy shapes are ggml's ne reversed)
                a = rng.normal(0.0, std, size=(rank, n_in)).astype(np.float32)
                b = rng.normal(0.0, std, size=(n_out, rank)).astype(np.float32)
                w.add_tensor(f"{name}.lora_a", a)
                w.add_tensor(f"{name}.lora_b", b)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return path
