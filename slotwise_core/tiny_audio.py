"""Tiny random-weight audio towers for the pairs of ``tiny_models`` (kept apart so that module
stays short). No import of ``tiny_models``: the writers here fill a tensor list and a key
writer that it passes in.

* whisper-style (``ultravox``, ``qwen2a``): 128 log-mel bins, conv1d (stride 1, then 2), learned
  positions for the 1500 frames of a 30 s window, a pre-LN ViT block without a k bias, post-LN.
  ultravox stacks ``stack_factor`` frames and projects with RMS norm + SwiGLU; qwen2a avg-pools
  by 2 and projects with one linear layer.
* ``gemma4a`` (Gemma 4's conformer; shares its mmproj with the ``gemma4v`` vision tower).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["WHISPER_POSITIONS", "Audio", "audio_kv", "qwen2a_tensors", "ultravox_tensors"]

N_MEL = 128  # whisper-large-v3's bins (what Ultravox and Qwen2-Audio take)
WHISPER_POSITIONS = 1500  # 3000 mel frames of a 30 s window, halved by the stride-2 conv


class Tensors(Protocol):
    def rand(self, name: str, *ne: int) -> None: ...
    def ones(self, name: str, *ne: int) -> None: ...
    def linear(self, name: str, n_in: int, n_out: int, bias: bool = False) -> None: ...
    def layer_norm(self, name: str, n: int) -> None: ...


@dataclass(frozen=True)
class Audio:
    """The audio tower's size (tiny: the token counts depend on none of it)."""

    width: int = 32
    layers: int = 1
    heads: int = 2

    @property
    def ff(self) -> int:
        return 2 * self.width


def audio_kv(
    projector: str, a: Audio, n_embd: int, extra: dict[str, int], *, mixed: bool = False
) -> Callable[[Any], None]:
    """The ``clip.audio.*`` keys. mixed: the file holds a vision tower too, so the projector
    goes under ``clip.audio.projector_type`` (clip.cpp reads ``clip.projector_type`` first,
    for every modality)."""

    def add(w: Any) -> None:
        if not mixed:
            w.add_string("general.name", f"slotwise-tiny-mmproj-{projector}")
            w.add_string("clip.projector_type", projector)
        else:
            w.add_string("clip.audio.projector_type", projector)
        w.add_bool("clip.has_audio_encoder", True)
        w.add_uint32("clip.audio.embedding_length", a.width)
        w.add_uint32("clip.audio.feed_forward_length", a.ff)
        w.add_uint32("clip.audio.block_count", a.layers)
        w.add_uint32("clip.audio.attention.head_count", a.heads)
        w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
        w.add_uint32("clip.audio.projection_dim", n_embd)
        w.add_uint32("clip.audio.num_mel_bins", N_MEL)
        for key, value in extra.items():
            w.add_uint32(key, value)

    return add


def _whisper_encoder(t: Tensors, a: Audio) -> None:
    w = a.width
    t.rand("a.conv1d.1.weight", 3, N_MEL, w)  # [kernel, in, out]
    t.rand("a.conv1d.1.bias", 1, w)
    t.rand("a.conv1d.2.weight", 3, w, w)
    t.rand("a.conv1d.2.bias", 1, w)
    t.rand("a.position_embd.weight", w, WHISPER_POSITIONS)
    for i in range(a.layers):
        p = f"a.blk.{i}"
        t.linear(f"{p}.attn_q", w, w, bias=True)
        t.linear(f"{p}.attn_k", w, w)  # whisper has no k bias (the graph asserts it)
        t.linear(f"{p}.attn_v", w, w, bias=True)
        t.linear(f"{p}.attn_out", w, w, bias=True)
        t.layer_norm(f"{p}.ln1", w)
        t.layer_norm(f"{p}.ln2", w)
        t.linear(f"{p}.ffn_up", w, a.ff, bias=True)
        t.linear(f"{p}.ffn_down", a.ff, w, bias=True)
    t.layer_norm("a.post_ln", w)


def ultravox_tensors(t: Tensors, a: Audio, n_embd: int, stack_factor: int) -> None:
    """Ultravox: ``stack_factor`` encoder frames stacked into one token, RMS norm, SwiGLU
    (mlp.1 is twice the hidden width), RMS norm, mlp.2 to the text width (its ne[1])."""
    _whisper_encoder(t, a)
    stacked, hidden = a.width * stack_factor, n_embd
    t.ones("mm.a.norm_pre.weight", stacked)
    t.rand("mm.a.mlp.1.weight", stacked, 2 * hidden)
    t.ones("mm.a.norm_mid.weight", hidden)
    t.rand("mm.a.mlp.2.weight", hidden, n_embd)


def qwen2a_tensors(t: Tensors, a: Audio, n_embd: int) -> None:
    """Qwen2-Audio: the encoder output avg-pooled by 2, one linear layer to the text width."""
    _whisper_encoder(t, a)
    t.linear("mm.a.fc", a.width, n_embd, bias=True)


# Gemma 4's conformer: two stride-2 conv2d over (time, mel) with a channel LayerNorm each, a
# projection of channels x bins to the width, then per block: half-step FFN, chunked local
# attention with relative positions, a GLU + causal depthwise conv module, half-step FFN.
_GEMMA4A_CHANNELS = (8, 8)  # the two convs' output channels (the real ones: 128, 32)
_GEMMA4A_DW_KERNEL = 5  # the depthwise conv spans 5 frames (the graph pads 4 on the left)


def gemma4a_tensors(t: Tensors, a: Audio, n_embd: int) -> None:
    w, c0, c1 = a.width, *_GEMMA4A_CHANNELS
    t.rand("a.conv1d.0.weight", 3, 3, 1, c0)  # (conv2d kernels, under conv1d names)
    t.ones("a.conv1d.0.norm.weight", c0)
    t.rand("a.conv1d.1.weight", 3, 3, c0, c1)
    t.ones("a.conv1d.1.norm.weight", c1)
    t.rand("a.input_projection.weight", c1 * (N_MEL // 4), w)  # channels x bins after /4
    for i in range(a.layers):
        p = f"a.blk.{i}"
        t.ones(f"{p}.ffn_norm.weight", w)  # FFN 1
        t.linear(f"{p}.ffn_up", w, a.ff)
        t.linear(f"{p}.ffn_down", a.ff, w)
        t.ones(f"{p}.ffn_post_norm.weight", w)
        t.ones(f"{p}.attn_pre_norm.weight", w)  # attention
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t.linear(f"{p}.{proj}", w, w)
        t.ones(f"{p}.per_dim_scale.weight", w // a.heads)
        t.linear(f"{p}.attn_k_rel", w, w)
        t.ones(f"{p}.attn_post_norm.weight", w)
        t.ones(f"{p}.conv_norm.weight", w)  # conv module (GGUF's conv_norm is its pre-norm)
        t.linear(f"{p}.conv_pw1", w, 2 * w)  # GLU halves it
        t.rand(f"{p}.conv_dw.weight", _GEMMA4A_DW_KERNEL, w)
        t.ones(f"{p}.norm_conv.weight", w)
        t.linear(f"{p}.conv_pw2", w, w)
        t.ones(f"{p}.ffn_norm_1.weight", w)  # FFN 2
        t.linear(f"{p}.ffn_up_1", w, a.ff)
        t.linear(f"{p}.ffn_down_1", a.ff, w)
        t.ones(f"{p}.ffn_post_norm_1.weight", w)
        t.ones(f"{p}.ln2.weight", w)  # the block's output norm
    t.linear("a.pre_encode.out", w, w)  # the encoder's output projection
    t.rand("mm.a.input_projection.weight", w, n_embd)  # ne[1]: the text width
