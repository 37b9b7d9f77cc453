"""Tiny random-weight GGUF pairs (text model + mmproj) for tests, demos and benchmarks.

The weights are random (fixed numpy seed per pair, so every run writes the same bytes) and the
generated text is gibberish. What *is* real is everything llama.cpp / libmtmd compute from the
architecture: image token counts and positions, M-RoPE vs. plain RoPE, K-shift support, the
non-causal image decode, KV-cache cell usage and the chat template / special tokens.

Pairs (all tensors F32, text n_embd 64, 2 layers, context_length 4096, ~271-token vocab):

* ``mrope``     -- text ``qwen2vl`` + projector ``qwen2vl_merger`` (M-RoPE, dynamic resolution:
  a 1288x784 image is 1288 cells / 46 positions; ``llama_memory_can_shift`` is false).
* ``rope``      -- text ``llama`` + projector ``mlp`` (LLaVA; plain RoPE, K-shift capable;
  every image is 64 cells / 64 positions).
* ``noncausal`` -- text ``gemma3`` + projector ``gemma3`` (SigLIP + avg-pool; the image is
  decoded with non-causal attention, so it must fit one ubatch; every image is 64 cells /
  64 positions, wrapped in ``<start_of_image>`` ... ``<end_of_image>``).

Hybrid-memory pairs (``HYBRID``; written only when named, e.g. ``--only qwen35 lfm2``): 4 text
layers, each sequence holds a recurrent state besides its KV cells, so removing a sequence's
last tokens (``llama_memory_seq_rm(seq, p, -1)``) fails; ``llama_model_is_hybrid`` is true.

* ``qwen35``    -- text ``qwen35`` (Qwen3.5: gated delta-net in layers 0-2, gated attention in
  layer 3, interleaved M-RoPE) + projector ``qwen3vl_merger`` (Qwen3-VL's tower, which Qwen3.5
  ships: 16 px patches, dynamic resolution; a 448x392 image is 168 cells / 14 positions;
  ``llama_memory_can_shift`` is false).
* ``lfm2``      -- text ``lfm2`` (LFM2: short convolutions in layers 0 and 2, attention in 1 and
  3; plain RoPE, K-shift capable) + the ``rope`` pair's LLaVA projector ``mlp`` (LFM2's own
  projector wraps images in tokens the shared vocabulary lacks); every image is 64 cells / 64
  positions.

Usage: ``slotwise-tiny-models OUT_DIR [--only NAME ...]`` or
``python -m slotwise_core.tiny_models OUT_DIR``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "ALL",
    "CHAT_TEMPLATE",
    "CONTEXT_LENGTH",
    "HYBRID",
    "SPECIAL_TOKENS",
    "TinyPair",
    "main",
    "write_tiny_models",
]

ALL: tuple[str, ...] = ("mrope", "rope", "noncausal")
# Not in ALL: what tests and the demo write by default stays as it was.
HYBRID: tuple[str, ...] = ("qwen35", "lfm2")

CONTEXT_LENGTH = 4096

# ChatML; message content must be a string.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# CONTROL tokens appended after the byte tokens and merges (same vocab for every pair).
# <|vision_start|>/<|vision_end|> are what mtmd wraps qwen2vl images in;
# <start_of_image>/<end_of_image> are what it wraps gemma3 images in. They must be single
# special tokens, otherwise the wrappers would be tokenized as plain bytes.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<start_of_image>",
    "<end_of_image>",
    # the tool-call markers of Qwen (Hermes) and Mistral templates, single tokens there too:
    # a test's logit_bias can make a random model open a call with one
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
)

# BPE merges (each result is also a vocab token). At least one merge is required: gguf drops an
# empty array silently and llama.cpp then fails with "cannot find tokenizer merges".
_MERGES: tuple[tuple[str, str], ...] = (("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"))

_SEEDS = {"mrope": 1001, "rope": 1002, "noncausal": 1003, "qwen35": 1004, "lfm2": 1005}
_STD = 0.02

_RMS_EPS = 1e-6


@dataclass(frozen=True)
class Text:
    """The text model's size. The default is the tiny pairs' (their projectors write into its
    width); a wider, deeper one (``write_text_model``) makes a decode step cost what a real
    model's does on a GPU, for figures there, with the same vocabulary."""

    width: int = 64
    ff: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


TINY = Text()
_N_EMBD = TINY.width  # (the projectors' output)
# The hybrid pairs: deep enough for 3 recurrent layers to 1 attention layer (Qwen3.5's ratio).
_HYBRID_TEXT = Text(layers=4)


@dataclass(frozen=True)
class Vision:
    """The vision tower's size (all projectors). The default is tiny; a wider, deeper one
    (e.g. width 512, 8 layers) makes encoding cost what a real one does, for the image-stall
    benchmark and test, with the same token counts. n_ff = 2 * width keeps n_ff != n_embd: for
    legacy files of these projector types clip.cpp swaps ffn up/down when they are equal."""

    width: int = 32
    layers: int = 1

    def __post_init__(self) -> None:
        if self.width < 32 or self.width % 32 or self.layers < 1:
            raise ValueError("vision width must be a multiple of 32, layers >= 1")

    @property
    def ff(self) -> int:
        return 2 * self.width

    @property
    def heads(self) -> int:
        return max(2, self.width // 32)


_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3


@dataclass(frozen=True)
class TinyPair:
    """Paths of one generated pair."""

    name: str
    model: Path
    mmproj: Path


# ---------------------------------------------------------------------------------------------
# tokenizer


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable unicode map, indexed by byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def _vocab() -> tuple[list[str], list[int]]:
    tokens = _bytes_to_unicode()  # token id == byte value for the first 256 ids
    tokens += [a + b for a, b in _MERGES]
    types = [_TOKEN_NORMAL] * len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += [_TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    return tokens, types


_TOKENS, _TOKEN_TYPES = _vocab()
_N_VOCAB = len(_TOKENS)


def token_id(piece: str) -> int:
    """The id of a whole token of the tiny vocabulary (a byte's character, a merge or a
    special token): for a test's logit_bias."""
    if len(piece) == 1 and ord(piece) < 128:
        return ord(piece)  # (the first 256 ids are the bytes; ASCII prints as itself)
    return _TOKENS.index(piece)


def _add_tokenizer(w, pre: str) -> None:
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_token_list(_TOKENS)
    w.add_token_types(_TOKEN_TYPES)
    w.add_token_merges([f"{a} {b}" for a, b in _MERGES])
    w.add_bos_token_id(_TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(_TOKENS.index("<|im_end|>"))
    w.add_pad_token_id(_TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


# ---------------------------------------------------------------------------------------------
# tensors (shapes below are in ggml `ne` order; numpy shapes are the reverse)


class _Tensors:
    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.items: list[tuple[str, np.ndarray]] = []

    def rand(self, name: str, *ne: int) -> None:
        a = self._rng.normal(0.0, _STD, size=tuple(reversed(ne))).astype(np.float32)
        self.items.append((name, a))

    def ones(self, name: str, *ne: int) -> None:
        self.items.append((name, np.ones(tuple(reversed(ne)), dtype=np.float32)))

    def fill(self, name: str, value: float, *ne: int) -> None:
        self.items.append((name, np.full(tuple(reversed(ne)), value, dtype=np.float32)))

    def linear(self, name: str, n_in: int, n_out: int, bias: bool = False) -> None:
        self.rand(f"{name}.weight", n_in, n_out)
        if bias:
            self.rand(f"{name}.bias", n_out)

    def layer_norm(self, name: str, n: int) -> None:
        self.ones(f"{name}.weight", n)
        self.rand(f"{name}.bias", n)


def _write(path: Path, arch: str, add_kv: Callable[[object], None], t: _Tensors) -> None:
    import gguf  # local import: keeps `import slotwise_core.tiny_models` cheap

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    try:
        w.add_uint32("general.file_type", 0)  # all F32
        add_kv(w)
        for name, a in t.items:
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


# ---------------------------------------------------------------------------------------------
# text models


def _text_kv(
    arch: str,
    pre: str,
    extra: Callable[[object], None] | None = None,
    size: Text = TINY,
    kv_heads: Sequence[int] | None = None,
):
    """kv_heads: a per-layer head_count_kv array instead of size.kv_heads (LFM2 marks its
    convolution layers with 0)."""

    def add(w) -> None:
        w.add_string("general.name", f"slotwise-tiny-{arch}")
        w.add_uint32(f"{arch}.context_length", CONTEXT_LENGTH)
        w.add_uint32(f"{arch}.embedding_length", size.width)
        w.add_uint32(f"{arch}.block_count", size.layers)
        w.add_uint32(f"{arch}.feed_forward_length", size.ff)
        w.add_uint32(f"{arch}.attention.head_count", size.heads)
        if kv_heads is None:
            w.add_uint32(f"{arch}.attention.head_count_kv", size.kv_heads)
        else:
            w.add_array(f"{arch}.attention.head_count_kv", list(kv_heads))
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", _RMS_EPS)
        w.add_float32(f"{arch}.rope.freq_base", 10000.0)
        w.add_uint32(f"{arch}.vocab_size", _N_VOCAB)
        if extra is not None:
            extra(w)
        _add_tokenizer(w, pre)

    return add


def _text_tensors(seed: int, gemma: bool = False, size: Text = TINY) -> _Tensors:
    t = _Tensors(seed)
    n, n_kv = size.width, size.head_dim * size.kv_heads
    t.rand("token_embd.weight", n, _N_VOCAB)  # output.weight is tied to it
    t.ones("output_norm.weight", n)
    for i in range(size.layers):
        p = f"blk.{i}"
        t.ones(f"{p}.attn_norm.weight", n)
        t.linear(f"{p}.attn_q", n, n)
        t.linear(f"{p}.attn_k", n, n_kv)
        t.linear(f"{p}.attn_v", n, n_kv)
        t.linear(f"{p}.attn_output", n, n)
        t.ones(f"{p}.ffn_norm.weight", n)
        t.linear(f"{p}.ffn_gate", n, size.ff)
        t.linear(f"{p}.ffn_up", n, size.ff)
        t.linear(f"{p}.ffn_down", size.ff, n)
        if gemma:
            t.ones(f"{p}.attn_q_norm.weight", size.head_dim)
            t.ones(f"{p}.attn_k_norm.weight", size.head_dim)
            t.ones(f"{p}.post_attention_norm.weight", n)
            t.ones(f"{p}.post_ffw_norm.weight", n)
    return t


def write_text_model(path: Path, size: Text, seed: int = 7) -> Path:
    """A llama-architecture text model of ``size`` with the tiny vocabulary (no projector)."""
    _write(
        Path(path), "llama", _text_kv("llama", "gpt-2", size=size), _text_tensors(seed, size=size)
    )
    return Path(path)


# hybrid text models: some layers keep a recurrent state per sequence instead of KV cells

# Qwen3.5's gated delta-net, tiny: 2 key heads and 4 value heads of 16 (value_dim 64 = width).
_QWEN35_ATTN_INTERVAL = 4  # every 4th layer is full attention (Qwen3.5's own setting)
_DELTA_CONV_KERNEL = 4
_DELTA_HEAD = 16  # ssm.state_size: the key and the value head size
_DELTA_K_HEADS = 2  # ssm.group_count
_DELTA_V_HEADS = 4  # ssm.time_step_rank
_LFM2_L_CACHE = 3  # LFM2's short convolution spans 3 tokens


def _qwen35_kv(w) -> None:
    # imrope sections: sum must be head_dim / 2, as for qwen2vl
    w.add_array("qwen35.rope.dimension_sections", [2, 3, 3, 0])
    w.add_uint32("qwen35.full_attention_interval", _QWEN35_ATTN_INTERVAL)
    w.add_uint32("qwen35.ssm.conv_kernel", _DELTA_CONV_KERNEL)
    w.add_uint32("qwen35.ssm.state_size", _DELTA_HEAD)
    w.add_uint32("qwen35.ssm.group_count", _DELTA_K_HEADS)
    w.add_uint32("qwen35.ssm.time_step_rank", _DELTA_V_HEADS)
    # the graph derives the value head size as inner_size / time_step_rank: keep them equal
    w.add_uint32("qwen35.ssm.inner_size", _DELTA_HEAD * _DELTA_V_HEADS)


def _swiglu_ffn(t: _Tensors, p: str, size: Text) -> None:
    t.linear(f"{p}.ffn_gate", size.width, size.ff)
    t.linear(f"{p}.ffn_up", size.width, size.ff)
    t.linear(f"{p}.ffn_down", size.ff, size.width)


def _delta_net(t: _Tensors, p: str, n: int) -> None:
    key_dim, value_dim = _DELTA_HEAD * _DELTA_K_HEADS, _DELTA_HEAD * _DELTA_V_HEADS
    t.linear(f"{p}.attn_qkv", n, 2 * key_dim + value_dim)
    t.linear(f"{p}.attn_gate", n, value_dim)  # z, the output gate
    t.rand(f"{p}.ssm_conv1d.weight", _DELTA_CONV_KERNEL, 2 * key_dim + value_dim)
    t.rand(f"{p}.ssm_dt.bias", _DELTA_V_HEADS)
    # ssm_a is -exp(A_log); negative keeps the per-token decay below 1 (a random sign would
    # let the state grow without bound over a long prompt)
    t.fill(f"{p}.ssm_a", -1.0, _DELTA_V_HEADS)
    t.linear(f"{p}.ssm_beta", n, _DELTA_V_HEADS)
    t.linear(f"{p}.ssm_alpha", n, _DELTA_V_HEADS)
    t.ones(f"{p}.ssm_norm.weight", _DELTA_HEAD)
    t.linear(f"{p}.ssm_out", value_dim, n)


def _qwen35_tensors(seed: int, size: Text = _HYBRID_TEXT) -> _Tensors:
    t = _Tensors(seed)
    n, n_kv = size.width, size.head_dim * size.kv_heads
    t.rand("token_embd.weight", n, _N_VOCAB)  # output.weight is tied to it
    t.ones("output_norm.weight", n)
    for i in range(size.layers):
        p = f"blk.{i}"
        t.ones(f"{p}.attn_norm.weight", n)
        if (i + 1) % _QWEN35_ATTN_INTERVAL == 0:
            # gated attention: q is twice as wide, its second half gates the output per head
            t.linear(f"{p}.attn_q", n, 2 * n)
            t.linear(f"{p}.attn_k", n, n_kv)
            t.linear(f"{p}.attn_v", n, n_kv)
            t.linear(f"{p}.attn_output", n, n)
            t.ones(f"{p}.attn_q_norm.weight", size.head_dim)
            t.ones(f"{p}.attn_k_norm.weight", size.head_dim)
        else:
            _delta_net(t, p, n)
        t.ones(f"{p}.post_attention_norm.weight", n)  # (the norm before the FFN)
        _swiglu_ffn(t, p, size)
    return t


def _lfm2_kv_heads(size: Text = _HYBRID_TEXT) -> list[int]:
    return [0 if i % 2 == 0 else size.kv_heads for i in range(size.layers)]  # 0: convolution


def _lfm2_tensors(seed: int, size: Text = _HYBRID_TEXT) -> _Tensors:
    t = _Tensors(seed)
    n, n_kv = size.width, size.head_dim * size.kv_heads
    t.rand("token_embd.weight", n, _N_VOCAB)  # output.weight is tied to it
    t.ones("token_embd_norm.weight", n)  # (LFM2's output norm, under a legacy name)
    for i, kv_heads in enumerate(_lfm2_kv_heads(size)):
        p = f"blk.{i}"
        t.ones(f"{p}.attn_norm.weight", n)
        if kv_heads:
            t.ones(f"{p}.attn_q_norm.weight", size.head_dim)
            t.ones(f"{p}.attn_k_norm.weight", size.head_dim)
            t.linear(f"{p}.attn_q", n, n)
            t.linear(f"{p}.attn_k", n, n_kv)
            t.linear(f"{p}.attn_v", n, n_kv)
            t.linear(f"{p}.attn_output", n, n)
        else:
            t.rand(f"{p}.shortconv.conv.weight", _LFM2_L_CACHE, n)
            t.linear(f"{p}.shortconv.in_proj", n, 3 * n)  # B, C and x gates
            t.linear(f"{p}.shortconv.out_proj", n, n)
        t.ones(f"{p}.ffn_norm.weight", n)
        _swiglu_ffn(t, p, size)
    return t


# ---------------------------------------------------------------------------------------------
# projectors (general.architecture "clip")


def _clip_kv(
    projector: str, v: Vision, n_layer: int, image_size: int, patch_size: int,
    extra: dict[str, int],
):  # fmt: skip
    def add(w) -> None:
        w.add_string("general.name", f"slotwise-tiny-mmproj-{projector}")
        w.add_string("clip.projector_type", projector)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_uint32("clip.vision.embedding_length", v.width)
        w.add_uint32("clip.vision.feed_forward_length", v.ff)
        w.add_uint32("clip.vision.block_count", n_layer)
        w.add_uint32("clip.vision.attention.head_count", v.heads)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_uint32("clip.vision.projection_dim", _N_EMBD)
        w.add_uint32("clip.vision.image_size", image_size)
        w.add_uint32("clip.vision.patch_size", patch_size)
        # required: mtmd init fails without mean/std
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        for key, value in extra.items():
            w.add_uint32(key, value)

    return add


def _vit_blocks(t: _Tensors, v: Vision, n_layer: int) -> None:
    # Attention biases are needed by the qwen2vl graph (without them: segfault on encode).
    for i in range(n_layer):
        p = f"v.blk.{i}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t.linear(f"{p}.{proj}", v.width, v.width, bias=True)
        t.layer_norm(f"{p}.ln1", v.width)
        t.layer_norm(f"{p}.ln2", v.width)
        t.linear(f"{p}.ffn_up", v.width, v.ff, bias=True)
        t.linear(f"{p}.ffn_down", v.ff, v.width, bias=True)


def _mmproj_qwen2vl(seed: int, v: Vision) -> tuple[Callable[[object], None], _Tensors]:
    patch = 14
    t = _Tensors(seed)
    # qwen2vl splits its 3D patch conv into two 2D convs: both .weight and .weight.1 needed.
    t.rand("v.patch_embd.weight", patch, patch, 3, v.width)
    t.rand("v.patch_embd.weight.1", patch, patch, 3, v.width)
    _vit_blocks(t, v, v.layers)
    t.layer_norm("v.post_ln", v.width)
    merged = v.width * 4  # 2x2 spatial merge
    t.linear("mm.0", merged, merged, bias=True)
    t.linear("mm.2", merged, _N_EMBD, bias=True)
    kv = _clip_kv("qwen2vl_merger", v, v.layers, 224, patch, {"clip.vision.spatial_merge_size": 2})
    return kv, t


def _mmproj_mlp(seed: int, v: Vision) -> tuple[Callable[[object], None], _Tensors]:
    patch, size = 14, 112
    n_layer = v.layers + 1  # the llava graph runs n_layer - 1 ViT layers
    n_patches = (size // patch) ** 2  # 64
    t = _Tensors(seed)
    t.rand("v.patch_embd.weight", patch, patch, 3, v.width)
    t.rand("v.position_embd.weight", v.width, n_patches)
    t.layer_norm("v.pre_ln", v.width)
    _vit_blocks(t, v, n_layer)
    t.linear("mm.0", v.width, _N_EMBD, bias=True)
    # mm.2 is mandatory: the projector's output size (must equal text n_embd) is read from it
    t.linear("mm.2", _N_EMBD, _N_EMBD, bias=True)
    return _clip_kv("mlp", v, n_layer, size, patch, {}), t


def _mmproj_gemma3(seed: int, v: Vision) -> tuple[Callable[[object], None], _Tensors]:
    # SigLIP: 224/14 = 16x16 patches, avg-pooled by scale_factor 2 -> 8x8 = 64 image tokens.
    patch, size, scale = 14, 224, 2
    n_patches = (size // patch) ** 2  # 256
    t = _Tensors(seed)
    t.rand("v.patch_embd.weight", patch, patch, 3, v.width)
    t.rand("v.patch_embd.bias", v.width)
    t.rand("v.position_embd.weight", v.width, n_patches)
    _vit_blocks(t, v, v.layers)
    t.layer_norm("v.post_ln", v.width)
    t.ones("mm.soft_emb_norm.weight", v.width)
    # used transposed: ne[0] is the output size (text n_embd)
    t.rand("mm.input_projection.weight", _N_EMBD, v.width)
    kv = _clip_kv("gemma3", v, v.layers, size, patch, {"clip.vision.projector.scale_factor": scale})
    return kv, t


def _mmproj_qwen3vl(seed: int, v: Vision) -> tuple[Callable[[object], None], _Tensors]:
    # Qwen3-VL's tower (Qwen3.5 pairs with it): 16 px patches, a patch bias, learned position
    # embeddings (interpolated to each image's grid), fused qkv, GELU FFN, a 2x2 merge. No
    # deepstack layers: with them the output would be wider than the text width.
    patch, size = 16, 224
    n_patches = (size // patch) ** 2  # 196: the graph takes its sqrt as the grid side
    t = _Tensors(seed)
    # the 3D patch conv as two 2D convs, like qwen2vl; both .weight and .weight.1 needed
    t.rand("v.patch_embd.weight", patch, patch, 3, v.width)
    t.rand("v.patch_embd.weight.1", patch, patch, 3, v.width)
    t.rand("v.patch_embd.bias", v.width)  # asserted by the qwen3vl graph
    t.rand("v.position_embd.weight", v.width, n_patches)  # asserted too
    for i in range(v.layers):
        p = f"v.blk.{i}"
        t.linear(f"{p}.attn_qkv", v.width, 3 * v.width, bias=True)
        t.linear(f"{p}.attn_out", v.width, v.width, bias=True)
        t.layer_norm(f"{p}.ln1", v.width)
        t.layer_norm(f"{p}.ln2", v.width)
        t.linear(f"{p}.ffn_up", v.width, v.ff, bias=True)
        t.linear(f"{p}.ffn_down", v.ff, v.width, bias=True)
    t.layer_norm("v.post_ln", v.width)  # the merger's norm, before the merge
    merged = v.width * 4  # 2x2 spatial merge
    t.linear("mm.0", merged, merged, bias=True)
    t.linear("mm.2", merged, _N_EMBD, bias=True)  # its bias gives the output width
    kv = _clip_kv("qwen3vl_merger", v, v.layers, size, patch, {"clip.vision.spatial_merge_size": 2})

    def add(w) -> None:
        kv(w)
        w.add_bool("clip.use_gelu", True)  # as the converter writes it (else quick GELU)

    return add, t


# ---------------------------------------------------------------------------------------------
# pairs


def _write_mrope(d: Path, seed: int, v: Vision) -> None:
    def sections(w) -> None:
        # required by qwen2vl; sum must be head_dim / 2
        w.add_array("qwen2vl.rope.dimension_sections", [2, 3, 3, 0])

    _write(d / "model.gguf", "qwen2vl", _text_kv("qwen2vl", "qwen2", sections), _text_tensors(seed))
    kv, t = _mmproj_qwen2vl(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


def _write_rope(d: Path, seed: int, v: Vision) -> None:
    _write(d / "model.gguf", "llama", _text_kv("llama", "gpt-2"), _text_tensors(seed))
    kv, t = _mmproj_mlp(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


def _write_noncausal(d: Path, seed: int, v: Vision) -> None:
    # Text arch gemma3 (the projector's real partner) works: mtmd toggles causal attention off
    # around the image batch via llama_set_causal_attn, which the gemma3 graph honours. No
    # sliding-window key is written, so gemma3 uses a plain (non-SWA) KV cache and stays
    # K-shift capable. Its graph scales token embeddings by sqrt(n_embd) but not image
    # embeddings, like the real model.
    _write(
        d / "model.gguf",
        "gemma3",
        _text_kv("gemma3", "gpt-2"),
        _text_tensors(seed, gemma=True),
    )
    kv, t = _mmproj_gemma3(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


def _write_qwen35(d: Path, seed: int, v: Vision) -> None:
    kv = _text_kv("qwen35", "qwen35", _qwen35_kv, _HYBRID_TEXT)
    _write(d / "model.gguf", "qwen35", kv, _qwen35_tensors(seed))
    kv, t = _mmproj_qwen3vl(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


def _write_lfm2(d: Path, seed: int, v: Vision) -> None:
    def conv(w) -> None:
        w.add_uint32("lfm2.shortconv.l_cache", _LFM2_L_CACHE)

    kv = _text_kv("lfm2", "lfm2", conv, _HYBRID_TEXT, kv_heads=_lfm2_kv_heads())
    _write(d / "model.gguf", "lfm2", kv, _lfm2_tensors(seed))
    # LLaVA's mlp projector: its output width is the text width, and its images need no
    # wrapper tokens (LFM2's own projector wants <|image_start|> etc., not in the vocab)
    kv, t = _mmproj_mlp(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


_WRITERS: dict[str, Callable[[Path, int, Vision], None]] = {
    "mrope": _write_mrope,
    "rope": _write_rope,
    "noncausal": _write_noncausal,
    "qwen35": _write_qwen35,
    "lfm2": _write_lfm2,
}


def write_tiny_models(
    out_dir: Path, names: Iterable[str] = ALL, *, vision: Vision = Vision()
) -> dict[str, TinyPair]:
    """Write ``out_dir/<name>/{model,mmproj}.gguf`` for each name; same bytes every run."""
    out_dir = Path(out_dir)
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in _WRITERS]
    if unknown:
        raise ValueError(f"unknown tiny model(s) {unknown}; choose from {list(ALL + HYBRID)}")
    pairs: dict[str, TinyPair] = {}
    for name in names:
        d = out_dir / name
        _WRITERS[name](d, _SEEDS[name], vision)
        pairs[name] = TinyPair(name, d / "model.gguf", d / "mmproj.gguf")
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slotwise-tiny-models",
        description="Write tiny random-weight GGUF pairs (gibberish output, real counts).",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ALL + HYBRID,
        metavar="NAME",
        help=f"subset of {', '.join(ALL + HYBRID)} (default: {', '.join(ALL)})",
    )
    parser.add_argument(
        "--vision-width", type=int, default=Vision.width, help="vision tower width (x32)"
    )
    parser.add_argument(
        "--vision-layers", type=int, default=Vision.layers, help="vision tower layers"
    )
    args = parser.parse_args(argv)
    try:
        vision = Vision(args.vision_width, args.vision_layers)
    except ValueError as e:
        parser.error(str(e))
    pairs = write_tiny_models(args.out_dir, args.only or ALL, vision=vision)
    for p in pairs.values():
        print(f"{p.name}: model={p.model} mmproj={p.mmproj}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
