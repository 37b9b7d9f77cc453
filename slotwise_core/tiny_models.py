"""Tiny random-weight GGUF pairs (text model + mmproj) for tests, demos and benchmarks.

The weights are random (fixed numpy seed per pair, so every run writes the same bytes) and the
generated text is gibberish. What *is* real is everything llama.cpp / libmtmd compute from the
architecture: image token counts and positions, M-RoPE vs. plain RoPE, K-shift support, the
non-causal image decode, KV-cache cell usage and the chat template / special tokens.

Pairs (all tensors F32, text n_embd 64, 2 layers, context_length 4096, a 271-token vocab that
qwen2a and gemma4 extend with their wrapper tokens, and think with its thought markers):

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

Audio pairs (``AUDIO``; written only when named): an audio-only mmproj with a whisper-style
tower (``tiny_audio``; 128 mel bins, a sound is cut into 30 s windows). An audio chunk has
n_pos == n_tokens; a sound over 30 s is one audio chunk per window, wrapped once.

* ``ultravox``  -- text ``llama`` (as ``rope``) + projector ``ultravox`` (stack factor 16):
  94 cells per window (a 2 s sound is 94, 35 s 94 + 94), no wrapper tokens.
* ``qwen2a``    -- text ``qwen2`` + projector ``qwen2a`` (avg-pool by 2): 750 cells per window,
  wrapped in ``<|audio_bos|>`` ... ``<|audio_eos|>`` (this pair's vocabulary adds the two).

2026 families (``FAMILIES_2026``; written only when named):

* ``qwen3vl``   -- text ``qwen3vl`` (Qwen3-VL: q/k norms, interleaved M-RoPE;
  ``llama_memory_can_shift`` is false) + the ``qwen35`` pair's projector ``qwen3vl_merger``:
  a 224x224 image is 49 cells / 7 positions, 448x336 154 / 14.
* ``gemma4``    -- text ``gemma4`` (layer 0 slides over 512 tokens, layer 1 attends to all:
  ``llama_model_n_swa`` 512; K-shift capable only with ``swa_full``, llama.cpp's default) + one
  mmproj with two towers: vision ``gemma4v`` (48 px cells, 70 to 1120 an image: 224x224 is 81
  cells, 640x480 130, n_pos == n_tokens, decoded non-causally) and audio ``gemma4a`` (a
  conformer; no padding to 30 s: 2 s is 50 cells, 35 s 750 + 125; causal). Wrapped in
  ``<|image>`` ... ``<image|>`` and ``<|audio>`` ... ``<audio|>`` (this pair's own tokens).

A multi-token-prediction pair (``MTP``; written only when named):

* ``qwen35mtp`` -- text ``qwen35`` (the ``qwen35`` pair's layers and shapes) plus one nextn
  (MTP) block, ``blk.4.nextn.*`` (``nextn_predict_layers`` 1, block_count 5:
  ``llama_model_n_layer_nextn`` 1; llama.cpp loads it only with ``load_mtp``), for
  ``draft-mtp`` speculative decoding (infer_service/runner/mtp.py) + the ``qwen35`` pair's
  projector. Its layer weights are stronger (std 0.045, not 0.02): the ``qwen35`` pair's
  greedy text only ever repeats its last token, whatever the recurrent state holds, so no draft
  would be rejected and a wrong rollback would not show; these make greedy text that depends
  on the state and repeats a token now and then. The nextn block's eh_proj passes the token
  embedding through (identity plus noise): it drafts "the same token again", which the target
  accepts about one time in six (random weights would never agree).

A reasoning pair (``REASONING``; written only when named):

* ``think``     -- text ``llama`` (as ``rope``, K-shift capable) + the ``rope`` pair's LLaVA
  projector ``mlp``; its vocabulary adds ``<think>`` and ``</think>`` (single special tokens)
  and its chat template (``THINK_TEMPLATE``) is a reasoning model's, as DeepSeek-R1's distills
  and QwQ write theirs: the generation prompt opens the thoughts (``<think>\\n``), or, with
  ``enable_thinking`` false, writes them empty and closed; an earlier reply is shown without
  its thoughts.

``BROKEN`` (written only when named):

* ``ultravox8`` -- ``ultravox`` with stack factor 8 (Ultravox v0.5's): libmtmd counts 187 cells
  per window, the encoder makes 188 and llama.cpp aborts the process (GGML_ABORT "Invalid
  number of output tokens"); encode it only in a child process.

Usage: ``slotwise-tiny-models OUT_DIR [--only NAME ...] [--lora]`` or
``python -m slotwise_core.tiny_models OUT_DIR``. ``--lora`` also writes ``lora.gguf``, a random
LoRA adapter (slotwise_core/tiny_lora.py), beside each pair of ``LORA_ARCHS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slotwise_core import tiny_audio

__all__ = [
    "ALL",
    "AUDIO",
    "BROKEN",
    "CHAT_TEMPLATE",
    "CONTEXT_LENGTH",
    "FAMILIES_2026",
    "HYBRID",
    "LORA_ARCHS",
    "MTP",
    "REASONING",
    "SPECIAL_TOKENS",
    "THINK_TEMPLATE",
    "TinyPair",
    "main",
    "write_tiny_lora",
    "write_tiny_models",
]

ALL: tuple[str, ...] = ("mrope", "rope", "noncausal")
# Not in ALL: what tests and the demo write by default stays as it was.
HYBRID: tuple[str, ...] = ("qwen35", "lfm2")
AUDIO: tuple[str, ...] = ("ultravox", "qwen2a")
FAMILIES_2026: tuple[str, ...] = ("qwen3vl", "gemma4")
REASONING: tuple[str, ...] = ("think",)
MTP: tuple[str, ...] = ("qwen35mtp",)
# Pairs llama.cpp cannot serve as they are: tokenizing promises a count encoding breaks.
BROKEN: tuple[str, ...] = ("ultravox8",)
_NAMES = ALL + HYBRID + AUDIO + FAMILIES_2026 + REASONING + MTP + BROKEN

CONTEXT_LENGTH = 4096

# ChatML; message content must be a string.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A reasoning model's (the think pair's): the generation prompt opens the thoughts, as
# DeepSeek-R1's distills and QwQ do, unless enable_thinking is false (then they are written
# empty and closed, as Qwen3 does); an earlier reply is shown without its thoughts.
THINK_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
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

_SEEDS = {
    "mrope": 1001, "rope": 1002, "noncausal": 1003, "qwen35": 1004, "lfm2": 1005,
    "ultravox": 1006, "qwen2a": 1007, "ultravox8": 1008, "qwen3vl": 1009, "gemma4": 1010,
    "think": 1011, "qwen35mtp": 1012,
}  # fmt: skip
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
    lora: Path | None = None  # a random LoRA adapter for its text model (written when asked)


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


def _vocab(extra: Sequence[str] = ()) -> tuple[list[str], list[int]]:
    """extra: a pair's own control tokens, after the shared ones (the others' ids stay)."""
    tokens = _bytes_to_unicode()  # token id == byte value for the first 256 ids
    tokens += [a + b for a, b in _MERGES]
    types = [_TOKEN_NORMAL] * len(tokens)
    tokens += [*SPECIAL_TOKENS, *extra]
    types += [_TOKEN_CONTROL] * (len(SPECIAL_TOKENS) + len(extra))
    return tokens, types


_TOKENS, _TOKEN_TYPES = _vocab()
_N_VOCAB = len(_TOKENS)


def token_id(piece: str) -> int:
    """The id of a whole token of the tiny vocabulary (a byte's character, a merge or a
    special token): for a test's logit_bias."""
    if len(piece) == 1 and ord(piece) < 128:
        return ord(piece)  # (the first 256 ids are the bytes; ASCII prints as itself)
    if piece in _THINK_TOKENS:  # (the think pair's own, after the shared ones)
        return _N_VOCAB + _THINK_TOKENS.index(piece)
    return _TOKENS.index(piece)


def _add_tokenizer(w, pre: str, extra: Sequence[str] = (), template: str = CHAT_TEMPLATE) -> None:
    tokens, types = _vocab(extra) if extra else (_TOKENS, _TOKEN_TYPES)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in _MERGES])
    w.add_bos_token_id(_TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(_TOKENS.index("<|im_end|>"))
    w.add_pad_token_id(_TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(template)


# ---------------------------------------------------------------------------------------------
# tensors (shapes below are in ggml `ne` order; numpy shapes are the reverse)


class _Tensors:
    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.items: list[tuple[str, np.ndarray]] = []
        self.std = _STD  # of the random tensors made from now on

    def rand(self, name: str, *ne: int) -> None:
        a = self._rng.normal(0.0, self.std, size=tuple(reversed(ne))).astype(np.float32)
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
    tokens: Sequence[str] = (),
    template: str = CHAT_TEMPLATE,
):
    """kv_heads: a per-layer head_count_kv array instead of size.kv_heads (LFM2 marks its
    convolution layers with 0). tokens: the pair's own control tokens (see _vocab);
    template: its chat template."""

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
        w.add_uint32(f"{arch}.vocab_size", _N_VOCAB + len(tokens))
        if extra is not None:
            extra(w)
        _add_tokenizer(w, pre, tokens, template)

    return add


def _text_tensors(
    seed: int, gemma: bool = False, size: Text = TINY, n_tokens: int = 0, qk_norm: bool = False
) -> _Tensors:
    """n_tokens: how many control tokens the pair adds to the vocabulary; qk_norm: q/k RMS
    norms (gemma has them too, with its post-norms)."""
    t = _Tensors(seed)
    n, n_kv = size.width, size.head_dim * size.kv_heads
    t.rand("token_embd.weight", n, _N_VOCAB + n_tokens)  # output.weight is tied to it
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
        if gemma or qk_norm:
            t.ones(f"{p}.attn_q_norm.weight", size.head_dim)
            t.ones(f"{p}.attn_k_norm.weight", size.head_dim)
        if gemma:
            t.ones(f"{p}.post_attention_norm.weight", n)
            t.ones(f"{p}.post_ffw_norm.weight", n)
    return t


def write_text_model(path: Path, size: Text, seed: int = 7) -> Path:
    """A llama-architecture text model of ``size`` with the tiny vocabulary (no projector)."""
    _write(
        Path(path), "llama", _text_kv("llama", "gpt-2", size=size), _text_tensors(seed, size=size)
    )
    return Path(path)


# A wide qwen35 whose step costs what a GPU's does (about 2 ms on one core): 16 heads keep the
# attention head at 16, as the imrope sections of the tiny one expect.
WIDE_HYBRID = Text(width=256, ff=1024, layers=8, heads=16, kv_heads=4)


def write_qwen35_model(path: Path, size: Text = WIDE_HYBRID, seed: int = 1) -> Path:
    """A hybrid-memory ``qwen35`` text model of ``size`` with the tiny vocabulary (no
    projector): what the bench drafts on."""
    kv = _text_kv("qwen35", "qwen35", _qwen35_kv, size)
    _write(Path(path), "qwen35", kv, _qwen35_tensors(seed, size))
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


def _qwen35_tensors(seed: int, size: Text = _HYBRID_TEXT, layer_std: float = _STD) -> _Tensors:
    """layer_std: the random layer weights' (token_embd keeps _STD)."""
    t = _Tensors(seed)
    n = size.width
    t.rand("token_embd.weight", n, _N_VOCAB)  # output.weight is tied to it
    t.ones("output_norm.weight", n)
    t.std = layer_std
    for i in range(size.layers):
        p = f"blk.{i}"
        t.ones(f"{p}.attn_norm.weight", n)
        if (i + 1) % _QWEN35_ATTN_INTERVAL == 0:
            _qwen35_attention(t, p, size)
        else:
            _delta_net(t, p, n)
        t.ones(f"{p}.post_attention_norm.weight", n)  # (the norm before the FFN)
        _swiglu_ffn(t, p, size)
    return t


def _qwen35_attention(t: _Tensors, p: str, size: Text) -> None:
    """Qwen3.5's gated attention: q is twice as wide, its second half gates the output per
    head; q/k RMS norms."""
    n, n_kv = size.width, size.head_dim * size.kv_heads
    t.linear(f"{p}.attn_q", n, 2 * n)
    t.linear(f"{p}.attn_k", n, n_kv)
    t.linear(f"{p}.attn_v", n, n_kv)
    t.linear(f"{p}.attn_output", n, n)
    t.ones(f"{p}.attn_q_norm.weight", size.head_dim)
    t.ones(f"{p}.attn_k_norm.weight", size.head_dim)


def _qwen35_nextn(seed: int, size: Text = _HYBRID_TEXT) -> _Tensors:
    """The nextn (MTP) block after the trunk's layers (Qwen3.5's, as llama.cpp loads it): a
    gated-attention decoder block whose input is eh_proj(concat(enorm(embed(token)),
    hnorm(h))), h the target's last hidden state (after output_norm) at the previous position.
    Without nextn.embed_tokens / shared_head_head / shared_head_norm (optional) it reuses
    token_embd, output and output_norm, as the converted Qwen3.5 files do. eh_proj is the
    identity on the token half plus noise: the head mostly drafts the token it is given again,
    which the target writes now and then, so some drafts are accepted, most not."""
    t = _Tensors(seed)
    n, p = size.width, f"blk.{size.layers}"
    t.ones(f"{p}.attn_norm.weight", n)
    _qwen35_attention(t, p, size)
    t.ones(f"{p}.post_attention_norm.weight", n)
    _swiglu_ffn(t, p, size)
    t.rand(f"{p}.nextn.eh_proj.weight", 2 * n, n)  # ne: (2n in, n out); numpy (n, 2n)
    eh_proj = t.items[-1][1]
    eh_proj[:, :n] += np.eye(n, dtype=np.float32)
    t.ones(f"{p}.nextn.enorm.weight", n)
    t.ones(f"{p}.nextn.hnorm.weight", n)
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
    extra: dict[str, int], mixed: bool = False,
):  # fmt: skip
    """mixed: an audio tower shares the file; each modality names its own projector."""

    def add(w) -> None:
        w.add_string("general.name", f"slotwise-tiny-mmproj-{projector}")
        w.add_string(f"clip.{'vision.' if mixed else ''}projector_type", projector)
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


# learned x and y tables: 1120 tokens (libmtmd's cap) of 3x3 patches in one row is the longest
# side an image can have; a shorter table aborts encoding a 48000x48 image (real ones: 10240)
_GEMMA4V_POSITIONS = 1120 * 3


def _mmproj_gemma4v(seed: int, v: Vision) -> tuple[Callable[[object], None], _Tensors]:
    # Gemma 4's tower: 16 px patches (no bias), learned x/y position tables, 2D RoPE, RMS
    # norms, per-head q/k norms, post-norms, GeGLU FFN, 3x3 avg-pool, RMS norm + projection.
    patch, merge = 16, 3
    t = _Tensors(seed)
    t.rand("v.patch_embd.weight", patch, patch, 3, v.width)
    t.rand("v.position_embd.weight", v.width, _GEMMA4V_POSITIONS, 2)
    head_dim = v.width // v.heads
    for i in range(v.layers):
        p = f"v.blk.{i}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t.linear(f"{p}.{proj}", v.width, v.width)
        t.ones(f"{p}.attn_q_norm.weight", head_dim)
        t.ones(f"{p}.attn_k_norm.weight", head_dim)
        for norm in ("ln1", "ln2", "attn_post_norm", "ffn_post_norm"):
            t.ones(f"{p}.{norm}.weight", v.width)
        t.linear(f"{p}.ffn_gate", v.width, v.ff)
        t.linear(f"{p}.ffn_up", v.width, v.ff)
        t.linear(f"{p}.ffn_down", v.ff, v.width)
    t.rand("mm.input_projection.weight", v.width, _N_EMBD)  # ne[1]: the text width
    extra = {"clip.vision.projector.scale_factor": merge}
    kv = _clip_kv("gemma4v", v, v.layers, 224, patch, extra, mixed=True)

    def add(w) -> None:
        kv(w)
        w.add_bool("clip.use_gelu", True)

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


_MTP_LAYER_STD = 0.045  # (see qwen35mtp in the module docstring)


def _write_qwen35mtp(d: Path, seed: int, v: Vision) -> None:
    # block_count counts the nextn block, nextn_predict_layers says it is one (the last)
    def mtp_kv(w) -> None:
        _qwen35_kv(w)
        w.add_uint32("qwen35.nextn_predict_layers", 1)

    blocks = Text(layers=_HYBRID_TEXT.layers + 1)
    kv = _text_kv("qwen35", "qwen35", mtp_kv, blocks)
    t = _qwen35_tensors(seed, layer_std=_MTP_LAYER_STD)
    t.items += _qwen35_nextn(seed + 2).items
    _write(d / "model.gguf", "qwen35", kv, t)
    kv, mm = _mmproj_qwen3vl(_SEEDS["qwen35"] + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, mm)


def _write_lfm2(d: Path, seed: int, v: Vision) -> None:
    def conv(w) -> None:
        w.add_uint32("lfm2.shortconv.l_cache", _LFM2_L_CACHE)

    kv = _text_kv("lfm2", "lfm2", conv, _HYBRID_TEXT, kv_heads=_lfm2_kv_heads())
    _write(d / "model.gguf", "lfm2", kv, _lfm2_tensors(seed))
    # LLaVA's mlp projector: its output width is the text width, and its images need no
    # wrapper tokens (LFM2's own projector wants <|image_start|> etc., not in the vocab)
    kv, t = _mmproj_mlp(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


# audio pairs (their mmproj holds no vision tower; the Vision argument is unused)

_ULTRAVOX_STACK = 16  # Ultravox v0.4's stack factor; v0.5 has 8 (BROKEN: see ultravox8)
# what mtmd wraps qwen2a audio in: the qwen2a pair's own control tokens
_QWEN2A_TOKENS = ("<|audio_bos|>", "<|audio_eos|>")


def _write_ultravox(d: Path, seed: int, v: Vision, stack: int = _ULTRAVOX_STACK) -> None:
    _write(d / "model.gguf", "llama", _text_kv("llama", "gpt-2"), _text_tensors(seed))
    t, a = _Tensors(seed + 1), tiny_audio.Audio()
    tiny_audio.ultravox_tensors(t, a, _N_EMBD, stack)
    stack_key = {"clip.audio.projector.stack_factor": stack}
    _write(d / "mmproj.gguf", "clip", tiny_audio.audio_kv("ultravox", a, _N_EMBD, stack_key), t)


def _write_ultravox8(d: Path, seed: int, v: Vision) -> None:
    _write_ultravox(d, seed, v, stack=8)


def _write_qwen2a(d: Path, seed: int, v: Vision) -> None:
    kv = _text_kv("qwen2", "qwen2", tokens=_QWEN2A_TOKENS)
    _write(d / "model.gguf", "qwen2", kv, _text_tensors(seed, n_tokens=len(_QWEN2A_TOKENS)))
    t, a = _Tensors(seed + 1), tiny_audio.Audio()
    tiny_audio.qwen2a_tensors(t, a, _N_EMBD)
    _write(d / "mmproj.gguf", "clip", tiny_audio.audio_kv("qwen2a", a, _N_EMBD, {}), t)


# the families of 2026 (FAMILIES_2026)


def _write_qwen3vl(d: Path, seed: int, v: Vision) -> None:
    def sections(w) -> None:
        # interleaved M-RoPE (IMROPE); sum must be head_dim / 2
        w.add_array("qwen3vl.rope.dimension_sections", [2, 3, 3, 0])

    kv = _text_kv("qwen3vl", "qwen2", sections)
    _write(d / "model.gguf", "qwen3vl", kv, _text_tensors(seed, qk_norm=True))
    kv, t = _mmproj_qwen3vl(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


# Gemma 4: layer 0 slides over the last _GEMMA4_SWA tokens, layer 1 attends to all (the real
# models interleave 5 sliding layers to 1 full one); images and audio in one mmproj.
_GEMMA4_SWA = 512
_GEMMA4_TOKENS = ("<|image>", "<image|>", "<|audio>", "<audio|>")  # what mtmd wraps media in


def _gemma4_kv(w) -> None:
    w.add_array("gemma4.attention.sliding_window_pattern", [True, False])
    w.add_uint32("gemma4.attention.sliding_window", _GEMMA4_SWA)
    w.add_uint32("gemma4.attention.key_length_swa", TINY.head_dim)
    w.add_uint32("gemma4.attention.value_length_swa", TINY.head_dim)
    w.add_uint32("gemma4.embedding_length_per_layer_input", 0)  # no per-layer embeddings
    w.add_float32("gemma4.rope.freq_base_swa", 10000.0)
    w.add_float32("gemma4.final_logit_softcapping", 30.0)


def _write_gemma4(d: Path, seed: int, v: Vision) -> None:
    kv = _text_kv("gemma4", "gpt-2", _gemma4_kv, tokens=_GEMMA4_TOKENS)
    t = _text_tensors(seed, gemma=True, n_tokens=len(_GEMMA4_TOKENS))
    t.ones("rope_freqs.weight", TINY.head_dim // 2)  # the full-attention layers' rope factors
    _write(d / "model.gguf", "gemma4", kv, t)
    vision_kv, t = _mmproj_gemma4v(seed + 1, v)
    a = tiny_audio.Audio()
    tiny_audio.gemma4a_tensors(t, a, _N_EMBD)
    audio_kv = tiny_audio.audio_kv("gemma4a", a, _N_EMBD, {}, mixed=True)

    def both(w) -> None:
        vision_kv(w)
        audio_kv(w)

    _write(d / "mmproj.gguf", "clip", both, t)


# the reasoning pair (REASONING)

_THINK_TOKENS = ("<think>", "</think>")  # single special tokens, as in the real vocabularies


def _write_think(d: Path, seed: int, v: Vision) -> None:
    kv = _text_kv("llama", "gpt-2", tokens=_THINK_TOKENS, template=THINK_TEMPLATE)
    _write(d / "model.gguf", "llama", kv, _text_tensors(seed, n_tokens=len(_THINK_TOKENS)))
    kv, t = _mmproj_mlp(seed + 1, v)
    _write(d / "mmproj.gguf", "clip", kv, t)


_WRITERS: dict[str, Callable[[Path, int, Vision], None]] = {
    "mrope": _write_mrope,
    "rope": _write_rope,
    "noncausal": _write_noncausal,
    "qwen35": _write_qwen35,
    "lfm2": _write_lfm2,
    "ultravox": _write_ultravox,
    "qwen2a": _write_qwen2a,
    "ultravox8": _write_ultravox8,
    "qwen3vl": _write_qwen3vl,
    "gemma4": _write_gemma4,
    "think": _write_think,
    "qwen35mtp": _write_qwen35mtp,
}


# the pairs whose text model a tiny LoRA adapter fits (its architecture: the adapter's)
LORA_ARCHS = {"mrope": "qwen2vl", "rope": "llama", "noncausal": "gemma3"}
_LORA_SEED = 100  # added to the pair's seed: an adapter's weights are not its model's


def write_tiny_lora(
    name: str, path: Path, *, seed: int = 0, task_name: str = "", prompt_prefix: str = ""
) -> Path:
    """A random LoRA adapter (slotwise_core/tiny_lora.py) for pair `name`'s text model; seed:
    another adapter for the same model. Same bytes every run."""
    from slotwise_core.tiny_lora import LoraShape, write_lora

    if name not in LORA_ARCHS:
        raise ValueError(f"no tiny LoRA adapter for {name!r}; choose from {list(LORA_ARCHS)}")
    shape = LoraShape(LORA_ARCHS[name], TINY.width, TINY.ff, TINY.layers,
                      TINY.head_dim * TINY.kv_heads)  # fmt: skip
    return write_lora(
        path, shape, seed=_SEEDS[name] + _LORA_SEED + seed, task_name=task_name,
        prompt_prefix=prompt_prefix,
    )  # fmt: skip


def write_tiny_models(
    out_dir: Path, names: Iterable[str] = ALL, *, vision: Vision = Vision(), lora: bool = False
) -> dict[str, TinyPair]:
    """Write ``out_dir/<name>/{model,mmproj}.gguf`` for each name; same bytes every run.
    lora: also ``lora.gguf`` beside each pair that has one (LORA_ARCHS)."""
    out_dir = Path(out_dir)
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in _WRITERS]
    if unknown:
        raise ValueError(f"unknown tiny model(s) {unknown}; choose from {list(_NAMES)}")
    pairs: dict[str, TinyPair] = {}
    for name in names:
        d = out_dir / name
        _WRITERS[name](d, _SEEDS[name], vision)
        adapter = write_tiny_lora(name, d / "lora.gguf") if lora and name in LORA_ARCHS else None
        pairs[name] = TinyPair(name, d / "model.gguf", d / "mmproj.gguf", adapter)
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
        choices=_NAMES,
        metavar="NAME",
        help=f"subset of {', '.join(_NAMES)} (default: {', '.join(ALL)})",
    )
    parser.add_argument(
        "--vision-width", type=int, default=Vision.width, help="vision tower width (x32)"
    )
    parser.add_argument(
        "--vision-layers", type=int, default=Vision.layers, help="vision tower layers"
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help=f"also a random LoRA adapter, lora.gguf, beside {', '.join(LORA_ARCHS)}",
    )
    args = parser.parse_args(argv)
    try:
        vision = Vision(args.vision_width, args.vision_layers)
    except ValueError as e:
        parser.error(str(e))
    pairs = write_tiny_models(args.out_dir, args.only or ALL, vision=vision, lora=args.lora)
    for p in pairs.values():
        lora = f" lora={p.lora}" if p.lora else ""
        print(f"{p.name}: model={p.model} mmproj={p.mmproj}{lora}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
