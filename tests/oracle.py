"""The oracle: the ledger against real llama.cpp, decode for decode, no gRPC in between.

A driver owns one ``Runtime`` (three sequences, each with a tight ``ctx_size``) and drives the
engine's own executor (infer_service/runner/executor.py) on it: the code that carries out the
ledger's plans, batches the text of several sequences into one ``llama_decode``, encodes
images on its worker and decodes them in pieces. Three runs go side by side, one per sequence.
A run is a random script of chat turns -- text of random length (byte tokens 0..255),
Pillow-made RGB images of random size, runs of greedily generated tokens, and new requests in
the used sequence (stateless re-sends, reused by the engine's own rules, and session turns from
the generated tail) -- under a random policy (AUTO, SHIFT, GAP, REPREFILL, STOP), keep, discard
fraction, eviction unit and ``n_ctx_train`` bound. After every plan and every step the driver
asks llama.cpp what each sequence holds:

- every ``llama_decode`` returns 0 (the executor would fail the request) and every media chunk
  spans the positions the ledger counts;
- the sequence's cells, read out of ``llama_state_seq_get_data`` (count, position of every cell,
  and on M-RoPE the token id stored in each cell, -1 for image cells), equal the ledger's
  segments cell for cell (an image half in: its pieces so far);
  ``llama_memory_seq_pos_min/max`` agree; the ledger never holds more than ``llama_n_ctx_seq``
  cells;
- whenever the ledger answers CannotFit, the same decode done unguarded fails in llama.cpp and
  leaves the cache untouched (the ledger calls "full" exactly when llama.cpp is full: the
  decode before succeeded, the one after fails);
- an admitted prompt never meets CannotFit during its prefill and leaves room for one token.

Hybrid memory (the ``qwen35`` and ``lfm2`` pairs: attention cells beside a recurrent state per
sequence that llama.cpp cannot cut back) runs the same scripts, plus regenerations and edits
(re-sends that part from the sequence inside the last reply, at the prompt's end, or earlier),
each run keeping 0..4 checkpoints of the recurrent state (``checkpoint_min_step`` small, per
shape). Every eviction resolves to a Reprefill (from the pinned prefix's checkpoint, or 0),
rejected drafts roll back in place (llama.cpp's per-token snapshots, ``spec_rollback`` per
shape) or from a checkpoint taken before their step, and in addition:

- the attention cells are read out of the first part of the hybrid state, and the recurrent
  cell of the second (its bytes are the sequence's checkpoint): one when the ledger holds
  cells, at the position of the ledger's last cell;
- at every request's first token (so after every reuse: a request that starts on a sequence
  holding cells, and every checkpoint restore), the first after every Reprefill and the first
  after every step that rejected drafts, the logits
  the engine samples from equal a fresh prefill's of the ledger's segments on a runtime of its
  own (``FreshPrefill``), within ``FRESH_TOLERANCE``: what proves the recurrent state right,
  which the cells cannot show. These runtimes keep f32 K/V cells without flash attention
  (``exact_kernels``), so that batching changes logits by ~1e-7, not ~1e-3.

The 2026 families run the same scripts: ``qwen3vl`` (interleaved M-RoPE, no shift) and
``gemma4``, whose layers alternate a 512-token sliding window and full attention (llama.cpp
keeps two caches; with ``swa_full`` both have a sequence's cells, and it can shift) and whose
images are decoded non-causally, each in one ubatch. Beside the full cache, compared as above,
the window cache must hold exactly the ledger's cells within the window of its last position;
cells it masks may be gone from it (``Oracle._verify_window`` says why that is honest).

Some runs are a reasoning model's (``RunSpec.thoughts``, drawn last): two byte tokens stand
for ``<think>`` and ``</think>``, the generated tokens inside are marked as thoughts (each an
eviction unit), and a budget writes a message and the end, one forced token a step, decoded and
checked like any other token.

``stop_exactness`` and ``media_boundary`` check the boundary itself, with images in context.

Usage (tests/test_oracle.py runs seeds 0..199 of the first three attention pairs, 0..99 of the
hybrid ones and of the 2026 families; sweep further with other seeds)::

    python tests/oracle.py --runs 200                    # every pair, seeds 0..199
    python tests/oracle.py --runs 1000 --seed 200        # 1000 more per pair
    python tests/oracle.py --runs 1000 --pair mrope      # one pair
    python tests/oracle.py --runs 600 --pair qwen35      # a hybrid pair
    python tests/oracle.py --runs 400 --pair gemma4      # a 2026 family
    python tests/oracle.py --runs 1 --pair rope --seed 17 -v   # replay one failing seed

A replayed seed runs alone: its batches differ from the sweep's, and so, rarely, its sampled
tokens (batched float sums differ in the last bits); the script and its checks do not.

The tiny model pairs are written to a temporary directory first (``--models DIR`` keeps them).
Runtimes use one thread (for batches and the encoder too): on a busy 2-core machine a second
spinning thread makes each decode up to 100x slower.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import struct
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

os.environ.setdefault("GGML_NO_BACKTRACE", "1")

import llama_cpp
import numpy as np
from llama_cpp import mtmd_cpp
from PIL import Image, ImageDraw

from infer_service.events import (
    ContextShift,
    Event,
    FinishReason,
    ProblemError,
    Reason,
    Started,
)
from infer_service.kv.ledger import (
    Admission,
    CannotFit,
    ContextConfig,
    EvictionUnit,
    Fits,
    Gap,
    Item,
    Ledger,
    Policy,
    Reprefill,
    Segment,
    Shift,
    text_like,
)
from infer_service.runner.executor import Ending, Executor, Sampled, media_cache_key
from infer_service.runner.job import Job
from infer_service.runner.media import MediaHandle
from infer_service.runner.reasoning import State as ThoughtState
from infer_service.runner.reasoning import Thoughts
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.spec.config import SpecConfig, SpecType
from slotwise_core import native
from slotwise_core.tiny_models import ALL, FAMILIES_2026, HYBRID, TinyPair, write_tiny_models
from support.step_costs import replayable

__all__ = [
    "ALL",
    "FAMILIES_2026",
    "HYBRID",
    "PAIRS",
    "SHAPES",
    "Boundary",
    "ContextShape",
    "FreshPrefill",
    "KvProbe",
    "Oracle",
    "OracleError",
    "Picture",
    "RunReport",
    "RunSpec",
    "SeqCells",
    "make_spec",
    "open_runtime",
]

PAIRS: tuple[str, ...] = (*ALL, *HYBRID, *FAMILIES_2026)  # every pair the oracle drives

SEQ = 0
UNTIL_FULL = 1 << 20  # a generation step that runs until the ledger says CannotFit


class OracleError(AssertionError):
    """The ledger and llama.cpp disagree (or llama.cpp refused what the ledger allowed)."""


# -- contexts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextShape:
    ctx_size: int
    batch_size: int
    ubatch_size: int
    # (recurrent memory) RuntimeConfig.checkpoint_min_step: small, so that long prompts are
    # checkpointed on the way too (the checkpoints a run keeps, 0..4, are its spec's)
    checkpoint_min_step: int = 8192
    # (hybrid memory) RuntimeConfig.spec_rollback: rejected drafts rolled back in place up to
    # this many, past it from a checkpoint taken before the step (0: always from one)
    spec_rollback: int = 0


# Tight contexts (n_ctx is padded to multiples of 256 per sequence: these are exact). Small
# batches split prompts and images over several llama_decode calls / ubatches; the non-causal
# pairs need a whole image in one ubatch (and one batch): noncausal's 64 cells, gemma4's 70..96
# (images up to 200 px) or, where a ubatch takes them, up to 169 (up to 640 px: `_picture`).
SHAPES: dict[str, tuple[ContextShape, ...]] = {
    "mrope": (ContextShape(256, 256, 256), ContextShape(512, 512, 96), ContextShape(256, 64, 32)),
    "rope": (ContextShape(256, 256, 256), ContextShape(512, 128, 128), ContextShape(256, 48, 32)),
    "noncausal": (
        ContextShape(256, 256, 64),
        ContextShape(512, 512, 512),
        ContextShape(256, 96, 80),
    ),
    # hybrid memory: attention cells beside a recurrent state (qwen35: IMROPE, images of fewer
    # positions than cells, no shift; lfm2: 64-cell LLaVA images, can shift)
    "qwen35": (
        ContextShape(256, 256, 256, checkpoint_min_step=24, spec_rollback=4),
        ContextShape(512, 512, 96, checkpoint_min_step=64),
        ContextShape(256, 64, 32, checkpoint_min_step=16, spec_rollback=16),
    ),
    "lfm2": (
        ContextShape(256, 256, 256, checkpoint_min_step=32),
        ContextShape(512, 128, 128, checkpoint_min_step=16, spec_rollback=2),
        ContextShape(256, 48, 32, checkpoint_min_step=48, spec_rollback=8),
    ),
    # 2026 families: qwen3vl (IMROPE: images of fewer positions than cells, up to 196 cells,
    # no shift); gemma4 (a 512-token sliding window beside full attention, can shift; images
    # decoded non-causally, n_pos == n_tokens)
    "qwen3vl": (ContextShape(256, 256, 256), ContextShape(512, 512, 96), ContextShape(256, 64, 32)),
    "gemma4": (
        ContextShape(256, 256, 96),
        ContextShape(512, 512, 176),
        ContextShape(256, 112, 96),
    ),
}
GEMMA4_BIG_PICTURE_CELLS = 169  # gemma4's most cells for an image of up to 640x640 px
MAX_CHECKPOINTS = 4  # (recurrent memory) the most checkpoints a run keeps per sequence
GGML_TYPE_F32 = 0


@contextmanager
def exact_kernels(on: bool = True) -> Iterator[None]:
    """Contexts created meanwhile keep f32 K/V cells and no flash attention: a logit then
    depends on what a sequence holds, not on how it was batched (flash attention's f16
    accumulation makes a sequence decoded in other pieces differ by up to ~1e-3 on logits of
    ~1, as much as a recurrent state that saw one more token; with these, ~1e-7). For the
    hybrid pairs, whose fresh-prefill check compares logits; what the oracle checks does not
    depend on the kernels."""
    if not on:
        yield
        return
    default = llama_cpp.llama_context_default_params

    def params() -> llama_cpp.llama_context_params:
        p = default()
        p.type_k = p.type_v = GGML_TYPE_F32
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        return p

    llama_cpp.llama_context_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_context_default_params = default


def open_runtime(
    pair: TinyPair, shape: ContextShape, *, lanes: int = 1, threads: int = 1
) -> Runtime:
    """A runtime of `lanes` sequences, each of shape.ctx_size cells (hybrid pairs: with
    exact kernels)."""
    with exact_kernels(pair.name in HYBRID):
        return _runtime(pair, shape, lanes, threads)


def _runtime(pair: TinyPair, shape: ContextShape, lanes: int, threads: int) -> Runtime:
    return Runtime(
        RuntimeConfig(
            pair.model,
            pair.mmproj,
            ctx_size=shape.ctx_size * lanes,
            parallel=lanes,
            batch_size=shape.batch_size,
            ubatch_size=shape.ubatch_size,
            threads=threads,
            threads_batch=threads,  # (a second thread spins against the first: see above)
            encode_threads=threads,
            ctx_checkpoints=MAX_CHECKPOINTS,  # (each ledger keeps its run's number of them)
            checkpoint_min_step=shape.checkpoint_min_step,
            spec_rollback=shape.spec_rollback,
        )
    )


# -- what llama.cpp holds ------------------------------------------------------------------------


@dataclass(frozen=True)
class SeqCells:
    """What llama.cpp holds for one sequence."""

    pos: np.ndarray  # the position of every attention cell, in cache order
    tok: np.ndarray | None  # (M-RoPE) the token id stored in each (-1: media)
    # (hybrid memory) the positions of the sequence's recurrent cells: () when it has none,
    # else one, the last position its state has seen; None: attention memory alone
    recurrent: tuple[int, ...] | None = None
    # (sliding-window memory) the positions of the window cache's cells that llama.cpp writes
    # out: those the window does not mask from the sequence's last position; None: no window
    swa: np.ndarray | None = None


class KvProbe:
    """One sequence's cells as llama.cpp serialises them (llama_state_seq_get_data).

    Layout in this llama.cpp (measured, then checked on every read): 8 header bytes (magic,
    seq id), u32 n_stream (one per sequence: the cache is not unified), then per stream a u32
    cell_count, and for the one stream that holds the sequence's cells (empty streams are
    skipped): per cell i32 pos, u32 n_seq_id (1), on M-RoPE models llama_kv_cell_ext {i32 x,
    i32 y, i32 tok} (tok -1 for media cells), i32 seq_id; then the K/V rows (u32 v_trans, u32
    n_layer; per layer i32 type, u64 row size, the rows; the same for V, or, transposed, i32
    type, u32 element size, u32 width, the elements). The meta stride is calibrated once on a
    two-token sequence.

    Hybrid memory (src/llama-memory-hybrid.cpp ``state_write``) writes that attention cache
    first, then the recurrent one: u32 cell_count (0 or 1 for one sequence), per cell i32 pos
    (the last position the state has seen) and u32 n_seq_id (0 for a single sequence's
    state), then its rows. That tail is exactly what ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``
    writes after the header (the checkpoints' bytes): checked byte for byte at calibration
    and by size on every read, so the attention part is parsed to its very end.

    Sliding-window memory (the ``gemma4`` pair: src/llama-kv-cache-iswa.cpp ``state_write``)
    writes two such caches: the full-attention layers' first (every cell: what ``read``
    compares), then the window layers' (with ``swa_full``, llama.cpp's default, as many cells),
    whose cells the window masks from the sequence's last position (``pos_max - pos >=
    n_swa``) are left out. Both are parsed to the state's very end.
    """

    def __init__(self, rt: Runtime, seq: int = SEQ):
        self.runtime = rt
        self.seq = seq
        self._buf = (ctypes.c_uint8 * 0)()
        self.hybrid = rt.memory_kind == "hybrid"
        if rt.memory_kind not in ("attention", "hybrid"):
            raise OracleError(f"no attention cells to probe: {rt.memory_kind} memory")
        self.n_swa = int(llama_cpp.llama_model_n_swa(rt.model))
        if self.n_swa and self.hybrid:
            raise OracleError("hybrid memory with a sliding window: its layout is not parsed")
        rt.seq_clear(seq)
        rt.batch.clear()
        rt.batch.add([200, 201], 7, seq, logits_last=False)
        if rt.decode() != 0:
            raise OracleError("calibration decode failed")
        words = self._words()
        at = self._stream(words)
        if words[2] != rt.num_slots or words[at] != 2 or words[at + 1] != 7 or words[at + 2] != 1:
            raise OracleError(f"unexpected sequence state layout: {words[:16].tolist()}")
        c = at + 1  # the first cell
        for stride in (3, 4, 5, 6, 7, 8):
            if (
                words[c + stride] == 8
                and words[c + stride + 1] == 1
                and words[c + stride - 1] == seq
            ):
                self.stride = stride
                break
        else:
            raise OracleError(f"cannot find the cell stride: {words[:24].tolist()}")
        self.has_tok = self.stride == 6  # pos, n_seq_id, x, y, tok, seq_id
        if self.has_tok and words[c + 4] != 200:
            raise OracleError(f"M-RoPE cell ext does not hold the token: {words[:16].tolist()}")
        self.header = bytes(words[:2].tobytes())
        if self.hybrid:
            tail = self._recurrent_at(words, at, 2)
            n = len(words) * 4
            state = memoryview(self._buf)[tail:n].tobytes()
            if state != self.checkpoint()[8:]:
                raise OracleError("the sequence state's tail is not its recurrent checkpoint")
            if self._recurrent(tail) != (8,):
                raise OracleError(f"recurrent cells {self._recurrent(tail)}, not (8,)")
        if self.n_swa:
            swa = self._window(self._attention_end(words, at, 2))
            if swa.tolist() != [7, 8]:
                raise OracleError(f"the window cache holds {swa.tolist()}, not [7, 8]")
        rt.seq_clear(seq)

    @staticmethod
    def _stream(words: np.ndarray) -> int:
        """Where the cell_count of the stream holding the sequence is (the last one when the
        sequence is empty: every count is 0)."""
        at = 3
        for _ in range(int(words[2]) - 1):
            if words[at]:
                break
            at += 1
        return at

    def _words(self) -> np.ndarray:
        ctx = self.runtime.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, self.seq))
        if len(self._buf) < size:
            self._buf = (ctypes.c_uint8 * max(size, 2 * len(self._buf)))()
        n = int(llama_cpp.llama_state_seq_get_data(ctx, self._buf, size, self.seq))
        if n != size:
            raise OracleError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
        self._size = size
        return np.frombuffer(self._buf, dtype=np.int32, count=size // 4)

    def checkpoint(self) -> bytes:
        """(hybrid) The recurrent state alone, as Runtime.checkpoint saves it."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.runtime.ctx, self.seq, flags))
        buf = (ctypes.c_uint8 * size)()
        n = int(
            llama_cpp.llama_state_seq_get_data_ext(self.runtime.ctx, buf, size, self.seq, flags)
        )
        if n != size:
            raise OracleError(f"llama_state_seq_get_data_ext wrote {n} of {size} bytes")
        return bytes(buf)

    def _rows_end(self, end: int, n: int) -> int:
        """The byte offset after the K and V rows of `n` cells that start at byte `end`."""
        data = memoryview(self._buf)
        v_trans, n_layer = struct.unpack_from("<II", data, end)
        end += 8
        if v_trans > 1 or not 0 < n_layer <= llama_cpp.llama_model_n_layer(self.runtime.model):
            raise OracleError(f"unexpected K/V header: v_trans {v_trans}, {n_layer} layers")
        for _ in range(n_layer):  # K
            _, row = struct.unpack_from("<iQ", data, end)
            end += 12 + row * n
        for _ in range(n_layer):  # V (a layer without V is not written: sizes check it)
            if v_trans:
                _, el, width = struct.unpack_from("<iII", data, end)
                end += 12 + el * width * n
            else:
                _, row = struct.unpack_from("<iQ", data, end)
                end += 12 + row * n
        return end

    def _attention_end(self, words: np.ndarray, at: int, n: int) -> int:
        """The byte offset after the (first) attention cache: after the `n` cells of the
        stream whose cell_count is at word `at` (its K and V rows parsed to their end), or
        after the counts when the sequence has no attention cells."""
        end = 4 * (at + 1)
        if n:
            end = self._rows_end(end + 4 * n * self.stride, n)
            end += 4 * (int(words[2]) - 1 - (at - 3))  # the counts of the streams after it
        return end

    def _window(self, at: int) -> np.ndarray:
        """(sliding window) The positions of the window cache's cells written from byte `at`
        (its u32 n_stream) on, in cache order; its rows must end the state."""
        data = memoryview(self._buf)
        (n_stream,) = struct.unpack_from("<I", data, at)
        if n_stream != self.runtime.num_slots:
            raise OracleError(f"the window cache has {n_stream} streams")
        at += 4
        pos = np.zeros(0, np.int32)
        for _ in range(n_stream):
            (n,) = struct.unpack_from("<I", data, at)
            at += 4
            if not n:
                continue
            if len(pos):
                raise OracleError("two streams of the window cache hold the sequence")
            meta = np.frombuffer(data, np.int32, n * self.stride, at).reshape(n, self.stride)
            if not ((meta[:, 1] == 1).all() and (meta[:, -1] == self.seq).all()):
                raise OracleError("a window cell of the sequence belongs to other sequences too")
            pos = meta[:, 0].copy()
            at = self._rows_end(at + 4 * n * self.stride, n)
        if at != self._size:
            raise OracleError(f"the window cache ends at byte {at} of {self._size}")
        return pos

    def _recurrent_at(self, words: np.ndarray, at: int, n: int) -> int:
        """(hybrid) The byte offset where the recurrent state starts: after the attention
        cache. It must be where the recurrent part's own size says it starts."""
        end = self._attention_end(words, at, n)
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        partial = int(llama_cpp.llama_state_seq_get_size_ext(self.runtime.ctx, self.seq, flags))
        if self._size - end != partial - 8:
            raise OracleError(
                f"the attention state ends at byte {end} of {self._size}, but the recurrent "
                f"state takes {partial - 8}"
            )
        return end

    def _recurrent(self, at: int) -> tuple[int, ...]:
        data = memoryview(self._buf)
        (count,) = struct.unpack_from("<I", data, at)
        if count > 1:
            raise OracleError(f"the sequence has {count} recurrent cells")
        out = []
        for i in range(count):
            pos, n_seq_id = struct.unpack_from("<iI", data, at + 4 + 8 * i)
            if n_seq_id != 0:
                raise OracleError(f"a recurrent cell of one sequence lists {n_seq_id} ids")
            out.append(pos)
        return tuple(out)

    def read(self) -> SeqCells:
        words = self._words()
        if bytes(words[:2].tobytes()) != self.header or words[2] != self.runtime.num_slots:
            raise OracleError(f"unexpected sequence state header: {words[:4].tolist()}")
        at = self._stream(words)
        n = int(words[at])
        meta = words[at + 1 : at + 1 + n * self.stride].reshape(n, self.stride)
        if n and not ((meta[:, 1] == 1).all() and (meta[:, -1] == self.seq).all()):
            raise OracleError("a cell of the sequence belongs to other sequences too")
        recurrent = self._recurrent(self._recurrent_at(words, at, n)) if self.hybrid else None
        swa = self._window(self._attention_end(words, at, n)) if self.n_swa else None
        tok = meta[:, 4].copy() if self.has_tok else None
        return SeqCells(meta[:, 0].copy(), tok, recurrent, swa)

    def cells(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(positions, token ids or None) of every cell of the sequence, in cache order."""
        got = self.read()
        return got.pos, got.tok


# -- scripts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Picture:
    width: int
    height: int
    seed: int

    def rgb(self) -> bytes:
        """A Pillow-made RGB image: a random background with a few random shapes."""
        r = random.Random(self.seed)
        img = Image.new("RGB", (self.width, self.height), _color(r))
        draw = ImageDraw.Draw(img)
        for _ in range(r.randint(1, 4)):
            x0, y0 = r.randrange(self.width), r.randrange(self.height)
            x1, y1 = r.randint(x0, self.width), r.randint(y0, self.height)
            draw.rectangle((x0, y0, x1, y1), fill=_color(r))
        return img.tobytes()


def _color(r: random.Random) -> tuple[int, int, int]:
    return (r.randrange(256), r.randrange(256), r.randrange(256))


@dataclass(frozen=True)
class Prompt:
    parts: tuple[tuple[int, ...] | Picture, ...]
    truncate: bool


@dataclass(frozen=True)
class Resend:
    """A new request in the same sequence, the engine's way: ``common_prefix`` against what the
    ledger holds, ``truncate`` + ``seq_rm(cut, -1)``, then admit and decode the rest.

    Stateless (``session`` False): the client re-sends the first ``share`` of the conversation
    (the items it sent and the tokens it got) and a new message. Session: the new turn starts
    with the first ``share`` of the last reply's tokens, compared from ``generated_tail``.
    Stateless ``edit`` (hybrid pairs' scripts): "regenerate" re-sends the conversation without
    its last reply (no new message: the same prompt again); "edit" re-sends all of it with one
    token changed, in the last reply or in another text, then the new message.
    """

    parts: tuple[tuple[int, ...] | Picture, ...]
    truncate: bool
    session: bool
    share: float
    edit: str = ""  # "", "regenerate" or "edit" (stateless only)


@dataclass(frozen=True)
class Generate:
    num_tokens: int


Step = Prompt | Resend | Generate


@dataclass(frozen=True)
class RunSpec:
    seed: int
    pair: str
    shape: int  # index into SHAPES[pair]
    policy: Policy
    keep: int
    discard_fraction: float
    unit: EvictionUnit
    n_ctx_train: int | None  # None: the model's own
    steps: tuple[Step, ...]
    spec: SpecConfig = SpecConfig()  # drafts verified in the batch: accepted and rejected
    temperature: float = 0.0  # (seeded: a run samples the same tokens every time)
    # (recurrent memory) checkpoints its sequence keeps at once (0: none, every cut back
    # decodes the sequence again from position 0)
    checkpoints: int = 0
    # every end-of-generation token banned: each Generate runs its full length (never drawn
    # by make_spec; for scripts that must reach a length, whatever the greedy tokens are)
    ignore_eos: bool = False
    # a reasoning model's thoughts (two byte tokens stand for <think> and </think>): generated
    # tokens marked, and a budget that writes the end, one forced token a step
    thoughts: Thoughts | None = None

    def describe(self) -> str:
        parts = []
        for s in self.steps:
            if isinstance(s, Generate):
                parts.append(
                    "gen-until-full" if s.num_tokens == UNTIL_FULL else f"gen{s.num_tokens}"
                )
                continue
            text = "+".join(
                f"img{p.width}x{p.height}" if isinstance(p, Picture) else f"t{len(p)}"
                for p in s.parts
            )
            if isinstance(s, Resend):
                kind = "session" if s.session else s.edit or "resend"
                text = f"{kind}({s.share:.2f})+{text}"
            parts.append(text + ("(trunc)" if s.truncate else ""))
        return (
            f"seed={self.seed} pair={self.pair} shape={SHAPES[self.pair][self.shape]} "
            f"policy={self.policy.name} keep={self.keep} discard={self.discard_fraction:.2f} "
            f"unit={self.unit.name} n_ctx_train={self.n_ctx_train} steps=[{' '.join(parts)}]"
            + (
                f" spec={self.spec.type.value}(n_max={self.spec.n_max}, n={self.spec.size_n})"
                f" temperature={self.temperature}"
                if self.spec.enabled
                else ""
            )
            + (f" checkpoints={self.checkpoints}" if self.pair in HYBRID else "")
            + (" ignore_eos" if self.ignore_eos else "")
            + (f" thoughts={self.thoughts}" if self.thoughts else "")
        )


def make_spec(pair: str, seed: int) -> RunSpec:
    """The run of ``seed`` on ``pair``: the same spec every time."""
    r = random.Random(f"oracle:{pair}:{seed}")
    shape = r.randrange(len(SHAPES[pair]))
    capacity = SHAPES[pair][shape].ctx_size
    policies = [Policy.AUTO, Policy.SHIFT, Policy.GAP, Policy.REPREFILL, Policy.STOP]
    weights = [3, 2, 3, 2, 2] if pair != "mrope" else [4, 1, 3, 2, 2]
    policy = r.choices(policies, weights)[0]
    keep = 0 if r.random() < 0.5 else r.randint(1, capacity // 3)
    discard = r.choice([0.0, 0.5, 0.5, 1.0, round(r.random(), 2)])
    if policy is Policy.REPREFILL and discard < 0.2 and r.random() < 0.8:
        discard = 0.5  # discarding only what is needed re-prefills on every token: slow
    unit = r.choice([EvictionUnit.TOKEN, EvictionUnit.MESSAGE])
    n_ctx_train = None if r.random() < 0.5 else r.randint(capacity, 3 * capacity)
    steps: list[Step] = []
    for i in range(r.randint(1, 6)):
        parts: list[tuple[int, ...] | Picture] = []
        for _ in range(r.choice([0, 1, 1, 1, 2, 2, 3])):
            if r.random() < 0.7:
                parts.append(_text(r))
            parts.append(_picture(r, pair, SHAPES[pair][shape]))
        parts.append(_text(r))  # generation needs the logits of a text decode
        truncate = r.random() < 0.5
        if i and r.random() < 0.3:
            share = r.choice([0.0, 1.0, round(r.random(), 2)])
            steps.append(Resend(tuple(parts), truncate, session=r.random() < 0.5, share=share))
        else:
            steps.append(Prompt(tuple(parts), truncate))
        steps.append(Generate(r.choice([0, r.randint(1, 20), r.randint(1, 80)])))
    if policy is Policy.STOP and r.random() < 0.7:
        steps[-1] = Generate(UNTIL_FULL)  # reach the boundary: CannotFit, probed in llama.cpp
    if pair in HYBRID:  # (an RNG of their own: the draws below are as for the other pairs)
        steps = _edits(random.Random(f"oracle-edits:{pair}:{seed}"), steps)
    spec = SpecConfig()  # (drawn last: the scripts of the seeds before drafts are unchanged)
    if r.random() < 0.5:  # greedy random weights repeat themselves: drafts land, and miss
        kind = r.choice([
            SpecType.NGRAM_SIMPLE, SpecType.NGRAM_MAP_K, SpecType.NGRAM_MAP_K4V,
            SpecType.NGRAM_MOD, SpecType.NGRAM_CACHE, SpecType.SUFFIX,
        ])  # fmt: skip
        match = r.randint(1, 4)
        spec = SpecConfig(
            kind, n_max=r.randint(1, 16), size_n=match, size_m=48,
            mod_n_match=match, mod_n_min=1, mod_n_max=16,
        )  # fmt: skip
    # sampled text repeats itself less: drafts that miss, their cells given back
    temperature = 1.0 if spec.enabled and r.random() < 0.5 else 0.0
    # (drawn last too)
    checkpoints = r.randint(0, MAX_CHECKPOINTS) if pair in HYBRID else 0
    thoughts = _thoughts(r) if r.random() < 0.4 else None  # (drawn last too)
    return RunSpec(
        seed, pair, shape, policy, keep, discard, unit, n_ctx_train, tuple(steps), spec,
        temperature, checkpoints, thoughts=thoughts,
    )  # fmt: skip


def _thoughts(r: random.Random) -> Thoughts:
    """Thoughts between two byte tokens (greedy random weights write them now and then), a
    budget that is often reached, and an ending of a message and the end."""
    start, end = r.sample(range(256), 2)
    budget = r.choice([None, 0, r.randint(1, 8), r.randint(1, 40)])
    message = tuple(r.randrange(256) for _ in range(r.choice([0, 0, 1, 5])))
    forced = (*message, end) if message else ()
    return Thoughts((start,), (end,), r.random() < 0.7, budget, forced)


def _edits(r: random.Random, steps: list[Step]) -> list[Step]:
    """More stateless re-sends, and some of them regenerations and edits: a conversation that
    parts from what the sequence holds (inside the last reply, at the prompt's end, in an
    earlier message) is cut back to the checkpoint before that point on recurrent memory."""
    out: list[Step] = []
    for i, step in enumerate(steps):
        if i and isinstance(step, Prompt) and r.random() < 0.3:
            step = Resend(step.parts, step.truncate, session=False, share=1.0)
        if isinstance(step, Resend) and not step.session and r.random() < 0.6:
            step = replace(step, edit=r.choice(["regenerate", "edit"]))
        out.append(step)
    return out


def _text(r: random.Random) -> tuple[int, ...]:
    n = r.choice([r.randint(1, 8), r.randint(1, 40), r.randint(1, 120)])
    if r.random() < 0.05:
        n = r.randint(200, 400)  # a long message, more than a small batch or a whole context
    return tuple(r.randrange(256) for _ in range(n))


def _picture(r: random.Random, pair: str, shape: ContextShape) -> Picture:
    if pair in ("mrope", "qwen35", "qwen3vl"):  # dynamic resolution: cells and positions
        hi = 448 if r.random() < 0.15 else 160
        return Picture(r.randint(28, hi), r.randint(28, hi), r.randrange(1 << 30))
    if pair == "gemma4":  # dynamic resolution, 70 cells at the least, one ubatch a picture
        big = r.random() < 0.15 and shape.ubatch_size >= GEMMA4_BIG_PICTURE_CELLS
        hi = 640 if big else 200  # (up to 200 px: 70..96 cells)
        return Picture(r.randint(16, hi), r.randint(16, hi), r.randrange(1 << 30))
    return Picture(r.randint(16, 200), r.randint(16, 200), r.randrange(1 << 30))


# -- a fresh prefill (recurrent memory) ----------------------------------------------------------

# The most a logit of the engine may differ from a fresh prefill's of the same segments. Not 0:
# the engine decodes a prompt in other pieces and ubatches than the fresh prefill does (a
# gated delta-net runs its chunked rule over each ubatch), and several sequences in one
# llama_decode, so float sums differ in the last bits: measured up to 3.6e-7 on logits of
# magnitude ~1 over 1200 runs with `exact_kernels` (with flash attention and f16 cells, up to
# 1e-3). The tiny models barely use their context: a changed or extra token of the prompt moves
# the logits by 5e-3 to 6e-2 and rarely the greedy token, and a recurrent state that saw one
# token more (tests/test_oracle.py) by 1e-5 to 2e-3 (lfm2's short convolution forgets it after
# two tokens). So logits are compared, not only their argmax.
FRESH_TOLERANCE = 1e-5


class FreshPrefill:
    """What a fresh prefill of a ledger's segments gives: a second runtime of the same pair
    (one sequence, a context that holds any of the oracle's sequences), cleared, the segments
    decoded in order at the ledger's positions -- text in batches, media from its own encode
    of the run's chunk, at ``Runtime.media_positions`` -- then the logits of the last token.
    Recurrent memory keeps no per-token state: this is what proves that a sequence cut back to
    a checkpoint, cleared and decoded again, or re-prefilled after an eviction holds what its
    ledger says (its attention cells alone cannot show it)."""

    def __init__(self, pair: TinyPair, ctx_size: int, batch_size: int = 128):
        with exact_kernels():
            self.runtime = Runtime(
                RuntimeConfig(
                    pair.model, pair.mmproj, ctx_size=ctx_size, parallel=1,
                    batch_size=batch_size, ubatch_size=batch_size, threads=1, threads_batch=1,
                    encode_threads=1, ctx_checkpoints=0,
                )
            )  # fmt: skip
        self._embd: dict[str, np.ndarray] = {}  # media key -> this runtime's encode of it

    def close(self) -> None:
        self.runtime.close()

    def _embeddings(self, key: str, handle: MediaHandle) -> np.ndarray:
        embd = self._embd.get(key)
        if embd is None:
            if len(self._embd) >= 512:
                self._embd.clear()
            embd = self._embd[key] = self.runtime.encode_media(handle.chunk)
        return embd

    def logits(self, segments: Sequence[Segment], media: Mapping[str, MediaHandle]) -> np.ndarray:
        """The logits after a fresh prefill of `segments` (the last one is text)."""
        rt, batch = self.runtime, self.runtime.batch
        if not segments or segments[-1].is_media:
            raise OracleError("a fresh prefill must end with text")
        if sum(seg.num_cells for seg in segments) > rt.num_cells_per_slot:
            raise OracleError("the fresh prefill's context is too small")
        rt.seq_clear(0)
        batch.clear()

        def flush() -> None:
            if batch.size and rt.decode() != 0:
                raise OracleError("the fresh prefill's llama_decode failed")
            batch.clear()

        for k, seg in enumerate(segments):
            if seg.is_media:
                flush()
                assert seg.media_id is not None
                handle = media[seg.media_id]
                embd = self._embeddings(seg.media_id, handle)
                positions = rt.media_positions(handle.chunk, seg.pos_start)
                for at in range(0, seg.num_cells, rt.batch_size):
                    n = min(rt.batch_size, seg.num_cells - at)
                    nc = rt.non_causal(handle.chunk)
                    if rt.decode_embeddings(embd, positions, at, n, 0, nc) != 0:
                        raise OracleError("the fresh prefill's media decode failed")
                continue
            tokens, at = seg.token_ids, 0
            while at < len(tokens):
                if batch.size == rt.batch_size:
                    flush()
                n = min(rt.batch_size - batch.size, len(tokens) - at)
                last = k == len(segments) - 1 and at + n == len(tokens)
                batch.add(tokens[at : at + n], seg.pos_start + at, 0, logits_last=last)
                at += n
        index = batch.size - 1
        flush()
        ptr = llama_cpp.llama_get_logits_ith(rt.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(rt.num_vocab,)).copy()


def prefix_to(segments: Sequence[Segment], pos: int) -> list[Segment]:
    """The segments up to the text token at position `pos`, that one included."""
    out: list[Segment] = []
    for seg in segments:
        if seg.pos_start > pos:
            break
        if not seg.is_media and seg.pos_start + seg.num_cells > pos + 1:
            seg = replace(seg, item=text_like(seg.item, seg.token_ids[: pos - seg.pos_start + 1]))
        out.append(seg)
    return out


def compare_logits(engine: np.ndarray, fresh: np.ndarray) -> tuple[float, str | None]:
    """(max abs difference, why they disagree or None)."""
    diff = float(np.abs(engine - fresh).max())
    te, tf = int(engine.argmax()), int(fresh.argmax())
    if diff > FRESH_TOLERANCE:
        return diff, (
            f"the engine's logits differ from a fresh prefill's by up to {diff:.3g} (tolerance "
            f"{FRESH_TOLERANCE:g}; greedy token {te} vs {tf})"
        )
    if te != tf and fresh[te] < fresh[tf] - 2 * FRESH_TOLERANCE:  # (implied by diff: a guard)
        return diff, f"greedy token {te}, a fresh prefill's {tf}"
    return diff, None


# -- the driver ----------------------------------------------------------------------------------

LANES = 3  # sequences per runtime: runs go side by side, their text in one llama_decode


@dataclass
class RunReport:
    spec: RunSpec
    counts: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    max_logit_diff: float = 0.0  # (recurrent memory) the largest engine - fresh prefill


@dataclass
class _Probe:
    """A CannotFit to try unguarded after the step (the batch is the executor's until then)."""

    item: Item
    num_cells: int


class _Run:
    """One script on one slot: its conversation as the client knows it, and what it saw."""

    def __init__(self, spec: RunSpec, slot: Slot):
        self.spec = spec
        self.slot = slot
        self.steps = deque(spec.steps)
        self.rng = random.Random(f"exec:{spec.pair}:{spec.seed}")
        self.media: dict[str, MediaHandle] = {}
        self.history: list[Item] = []  # the conversation as the client knows it
        self.sent: list[Item] = []  # what the job running now was given
        self.last_reply: list[int] = []  # the tokens of the last generation step
        self.reply: list[int] = []  # tokens of the job running now
        self.message = -1
        self.group = 0
        self.counts: Counter[str] = Counter()
        self.trail: deque[str] = deque(maxlen=12)
        self.probes: list[_Probe] = []
        self.error: OracleError | None = None
        self.stopped = False  # STOP refused a prompt: the script ends there
        # (recurrent memory) why its next sample is compared with a fresh prefill: "start" (a
        # request's first token), "reuse", "restore" (a checkpoint loaded), "reprefill"
        self.fresh_due: set[str] = set()
        self.rejected = 0  # drafts the job running now had rejected so far
        self.max_logit_diff = 0.0
        self.t0 = time.perf_counter()

    @property
    def ledger(self) -> Ledger:
        assert self.slot.ledger is not None
        return self.slot.ledger

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            what = str(e) if isinstance(e, OracleError) else f"{type(e).__name__}: {e}"
            trail = "\n  ".join(self.trail)
            self.error = OracleError(f"{what}\n{self.spec.describe()}\nlast steps:\n  {trail}")

    def post(self, events: Sequence[Event | Sampled]) -> None:
        """(The job's mailbox) what the executor's step recorded for it, told in order."""
        for event in events:
            self.emit(event)

    def emit(self, event: Event | Sampled) -> None:
        if isinstance(event, Sampled):
            self.reply.append(event.token)
        elif isinstance(event, ContextShift):
            self.counts[event.policy.name.capitalize()] += 1
            self.counts["cells_evicted"] += event.num_cells_evicted
            self.trail.append(
                f"{event.policy.name} evicted {event.num_cells_evicted} cells -> "
                f"{event.num_cells_used_after} cells, next_pos {event.next_position_after}"
            )
        elif isinstance(event, Started):
            self.counts["prompts_truncated"] += event.num_truncated_chunks > 0
            self.counts["cells_reused"] += event.num_reused_cells


class Oracle:
    """Drives the engine's executor on every sequence of one runtime, several runs side by
    side, and checks each sequence against its ledger after every plan and every step."""

    def __init__(self, rt: Runtime, fresh: FreshPrefill | None = None):
        self.runtime = rt
        self.capacity = rt.num_cells_per_slot
        # (recurrent memory) the sampler's logits are compared with a fresh prefill's first
        self.fresh = fresh if rt.recurrent else None
        if self.fresh is not None:
            self._engine_sample = rt.sample
            rt.sample = self._sample  # type: ignore[method-assign]
        self.probes = [KvProbe(rt, seq) for seq in range(rt.num_slots)]
        self.slots = [Slot(seq) for seq in range(rt.num_slots)]
        self.stats = EngineStats()
        self._woken = threading.Event()
        self.executor = Executor(
            rt, self.stats, cache_bytes=64 << 20, host_sequence_bytes=0, notify=self._woken.set,
            observer=self,
        )  # fmt: skip
        replayable(self.executor)  # (a seed replays the same steps)
        self._runs: dict[int, _Run] = {}  # seq -> the run on it
        self._cells_of: dict[int, tuple[Segment, np.ndarray, np.ndarray]] = {}

    def close(self) -> None:
        self.executor.close()
        if self.fresh is not None:
            vars(self.runtime).pop("sample", None)  # back to the class's method

    # -- public -------------------------------------------------------------------------------

    def run(self, spec: RunSpec) -> RunReport:
        (outcome,) = self.run_side_by_side([spec])
        if isinstance(outcome, OracleError):
            raise outcome
        return outcome

    def run_side_by_side(self, specs: Sequence[RunSpec]) -> list[RunReport | OracleError]:
        """Every spec, at most one per sequence at a time; the outcome of each, in order."""
        queue = deque(enumerate(specs))
        outcomes: dict[int, RunReport | OracleError] = {}
        index: dict[int, int] = {}
        while queue or self._runs:
            for slot in self.slots:
                run = self._runs.get(slot.seq)
                if run is None and queue:
                    i, spec = queue.popleft()
                    run = self._begin(slot, spec)
                    index[slot.seq] = i
                if run is None:
                    continue
                if run.error is None and slot.job is None:
                    self._next_job(run)
                if run.error is not None or slot.job is None:
                    outcomes[index[slot.seq]] = self._end(run)
            if any(s.job for s in self.slots):
                self._step()
        return [outcomes[i] for i in range(len(specs))]

    def new_ledger(
        self,
        policy: Policy,
        *,
        keep: int = 0,
        discard_fraction: float = 0.5,
        unit: EvictionUnit = EvictionUnit.TOKEN,
        n_ctx_train: int | None = None,
        checkpoints: int = 0,
    ) -> Ledger:
        return Ledger(
            self.capacity,
            can_shift=self.runtime.can_shift,
            n_ctx_train=n_ctx_train or self.runtime.n_ctx_train,
            policy=policy,
            keep=keep,
            discard_fraction=discard_fraction,
            unit=unit,
            recurrent=self.runtime.recurrent,
            max_marks=checkpoints,
        )

    def image_items(self, run: _Run, picture: Picture, message: int) -> list[Item]:
        """Tokenize one image alone: its media group (wrapper text + media chunks). The media
        key names the picture, as a content hash would: the same picture again is a cache
        hit."""
        mtmd = self.runtime.mtmd
        assert mtmd is not None
        run.group += 1
        media_id = f"{picture.seed:x}-{picture.width}x{picture.height}"
        bitmap = native.Bitmap(picture.width, picture.height, picture.rgb(), media_id)
        items: list[Item] = []
        with mtmd.tokenize(mtmd.marker, [bitmap], add_special=False) as chunks:
            for i, raw in enumerate(chunks.describe()):
                if not raw.is_media:
                    items.append(Item.text(raw.token_ids, message, group=run.group))
                    continue
                key = f"{media_id}:{i}"
                if key not in run.media:
                    chunk = mtmd_cpp.mtmd_input_chunk_copy(chunks.native(i))
                    run.media[key] = MediaHandle(chunk, key)
                n_pos = int(mtmd_cpp.mtmd_input_chunk_get_n_pos(run.media[key].chunk))
                if n_pos != raw.num_positions:
                    raise OracleError(
                        f"media {key}: {n_pos} positions, counted {raw.num_positions}"
                    )
                media = Item.media(key, raw.num_cells, raw.num_positions, message, group=run.group)
                items.append(media)
        return items

    # -- runs ---------------------------------------------------------------------------------

    def _begin(self, slot: Slot, spec: RunSpec) -> _Run:
        run = _Run(spec, slot)
        self._runs[slot.seq] = run
        self.executor.clear(slot)
        slot.ledger = self.new_ledger(
            spec.policy,
            keep=spec.keep,
            discard_fraction=spec.discard_fraction,
            unit=spec.unit,
            n_ctx_train=spec.n_ctx_train,
            checkpoints=spec.checkpoints,
        )
        self._verify(run)
        return run

    def _end(self, run: _Run) -> RunReport | OracleError:
        del self._runs[run.slot.seq]
        if run.slot.job is not None:  # a failed run mid-job
            self.executor.finish(run.slot, FinishReason.CANCELLED)
        self.executor.clear(run.slot)
        run.slot.ledger = None
        for handle in run.media.values():
            handle.close()
        if run.error is not None:
            return run.error
        return RunReport(run.spec, run.counts, time.perf_counter() - run.t0, run.max_logit_diff)

    def _next_job(self, run: _Run) -> None:
        """The run's last job ended: take in its reply, start the next prompt (and the
        generation after it) as the engine starts a request."""
        if run.sent or run.reply:
            run.history += run.sent
            run.last_reply = list(run.reply)
            if run.reply:
                run.history.append(_generated(run.reply, max(run.message, 0)))
            run.sent, run.reply = [], []
        while run.steps and run.error is None and not run.stopped:
            step = run.steps.popleft()
            if isinstance(step, Generate):
                continue  # a generation without a prompt before it: nothing to sample from
            max_tokens = 1
            if run.steps and isinstance(run.steps[0], Generate):
                max_tokens = max(1, run.steps.popleft().num_tokens)
            try:
                if self._start(run, step, max_tokens):
                    return
            except Exception as e:  # the ledger's own checks and NativeError count as well
                run.fail(e)
        run.steps.clear()

    def _start(self, run: _Run, step: Prompt | Resend, max_tokens: int) -> bool:
        """Start one request; False when the prompt was refused."""
        ledger, spec = run.ledger, run.spec
        run.message += 1
        new: list[Item] = []
        for part in step.parts:
            if isinstance(part, Picture):
                new += self.image_items(run, part, run.message)
            else:
                new.append(Item.text(part, run.message))
        session, start = True, len(ledger.segments)  # a new message after what it holds
        items = new
        if isinstance(step, Resend) and step.session:  # a turn: from the generated tail
            start = ledger.generated_tail()
            lead = run.last_reply[: round(step.share * len(run.last_reply))]
            items = ([_generated(lead, run.message)] if lead else []) + new
            if run.last_reply:
                del run.history[-1]
        elif isinstance(step, Resend) and (edited := _edit(run, step, new)) is not None:
            session, start, items = False, 0, edited  # a regeneration or an edit
            run.history = []
        elif isinstance(step, Resend):  # stateless: the client sends the conversation again
            session, start = False, 0
            k = round(step.share * len(run.history))
            items = run.history[:k]
            if k < len(run.history) and _plain_text(run.history[k]) and run.rng.random() < 0.5:
                cut = run.history[k]
                if cut.num_cells > 1:
                    items.append(_head(cut, run.rng.randint(1, cut.num_cells - 1)))
            items += new
            run.history = []
        run.counts["resends"] += isinstance(step, Resend)
        context = ContextConfig(
            spec.policy, spec.keep, spec.discard_fraction, spec.unit, truncate_prompt=step.truncate
        )
        job = Job(
            list(items),
            MappingProxyType(run.media),  # (the run's: the job ends, they stay)
            run,
            sampling=SamplingConfig(temperature=spec.temperature, seed=spec.seed),
            context=context,
            max_tokens=max_tokens,
            session_id="run" if session else None,
            speculative=spec.spec,
            logit_bias=self.runtime.eog_bans if spec.ignore_eos else (),
            reasoning=spec.thoughts,
        )
        shapes = [(i.num_cells, i.num_positions) for i in items[:8]]
        run.trail.append(
            f"{type(step).__name__.lower()} of {len(items)} items (cells, positions) {shapes}"
            f"{'...' if len(items) > 8 else ''} from segment {start}, {max_tokens} tokens"
        )
        restores, num_held = self.stats.num_checkpoint_restores, ledger.num_cells
        try:
            self.executor.start(run.slot, job, ledger, start)
        except ProblemError as e:
            needed = dict(e.problem.metadata).get("cells_needed")
            if e.problem.reason is not Reason.PROMPT_TOO_LONG or needed is None:
                raise
            if int(needed) <= self.capacity:
                raise OracleError(f"admit refused a prompt that fits: {e.problem.message}") from e
            run.trail.append(f"refused: {e.problem.message}")
            run.counts["prompts_rejected"] += 1
            run.stopped = spec.policy is Policy.STOP
            run.history += items  # the client still holds what it sent
            self._verify(run)
            return False
        run.counts["prompts"] += 1
        run.sent = items
        if self.runtime.recurrent:
            # (the first sample of every request; a session's kept turns count as reuse too)
            run.fresh_due.add("start")
            if ledger.num_cells:
                run.fresh_due.add("reuse")
            if self.stats.num_checkpoint_restores > restores:
                run.fresh_due.add("restore")
                run.counts["restores"] += 1
            elif num_held and not ledger.num_cells:
                run.counts["decoded_from_0"] += 1  # (no checkpoint before where it parts)
            if spec.spec.enabled:
                run.counts["drafts_asked"] += 1
        self._verify(run)
        return True

    # -- what a step did, and the executor's observer ----------------------------------------

    def _ended(self, ending: Ending) -> None:
        run = self._runs[ending.slot.seq]
        run.counts["generated"] += ending.usage.num_generated_tokens
        run.counts["drafted"] += ending.usage.num_draft_tokens
        run.counts["accepted"] += ending.usage.num_accepted_tokens
        run.trail.append(f"finished: {ending.reason.name} {ending.error}")
        if ending.reason is FinishReason.ERROR:
            run.fail(OracleError(f"the executor failed the request: {ending.error}"))

    def on_plan(self, slot: Slot) -> None:
        run = self._runs[slot.seq]
        self._verify(run)  # the plan carried out: the cache is the ledger's
        if self.runtime.recurrent:  # (a Reprefill: kept from the pinned prefix's checkpoint, or 0)
            run.fresh_due.add("reprefill")
            if slot.ledger is not None and slot.ledger.segments:
                run.counts["reprefills_from_checkpoint"] += 1

    def _sample(self, chain: object, index: int) -> int:
        """(recurrent memory) Runtime.sample, the engine's: first the logits at `index`, the
        ones it samples from, are compared with a fresh prefill of the ledger's segments,
        when the run's sequence was reused, restored or re-prefilled since its last check."""
        seq = int(self.runtime.batch.native.seq_id[index][0])
        run = self._runs.get(seq)
        if run is not None and run.fresh_due and run.error is None:
            try:
                self.check_fresh(run, index)
            except OracleError as e:
                run.fail(e)
            except Exception as e:
                run.fail(OracleError(f"the fresh prefill failed: {type(e).__name__}: {e}"))
        return self._engine_sample(chain, index)

    def check_fresh(self, run: _Run, index: int) -> None:
        """The engine's logits at batch index `index` (the run's last token) against those of
        a fresh prefill of what the run's ledger says its sequence holds."""
        assert self.fresh is not None
        why, run.fresh_due = sorted(run.fresh_due), set()
        ptr = llama_cpp.llama_get_logits_ith(self.runtime.ctx, index)
        engine = np.ctypeslib.as_array(ptr, shape=(self.runtime.num_vocab,)).copy()
        # (drafts after the sampled token are in the ledger already: not in its prefix)
        segments = prefix_to(run.ledger.segments, int(self.runtime.batch.native.pos[index]))
        fresh = self.fresh.logits(segments, run.media)
        diff, problem = compare_logits(engine, fresh)
        run.max_logit_diff = max(run.max_logit_diff, diff)
        run.counts["fresh_checks"] += 1
        run.counts["fresh_cells"] += sum(seg.num_cells for seg in segments)
        for reason in why:
            run.counts[f"fresh_after_{reason}"] += 1
        run.counts["fresh_ties"] += int(engine.argmax()) != int(fresh.argmax())
        if problem is not None:
            raise OracleError(
                f"{problem}, after {'+'.join(why)}; the ledger holds {len(segments)} segments, "
                f"{run.ledger.num_cells} cells, {len(run.ledger.marks)} checkpoints"
            )

    def on_cannot_fit(self, slot: Slot, plan: CannotFit, num_cells: int) -> None:
        run = self._runs[slot.seq]
        run.counts["CannotFit"] += 1
        run.trail.append(f"ensure({num_cells}) -> {plan.message}")
        if slot.prefilling:
            run.fail(OracleError("an admitted prompt met CannotFit during its prefill"))
        elif slot.usage.num_generated_tokens == 1:
            run.fail(OracleError(f"an admitted prompt left no room for one token: {plan}"))
        run.probes.append(_Probe(slot.pending[0], num_cells))

    # -- steps and checks ---------------------------------------------------------------------

    def _step(self) -> None:
        before = self._progress()
        failed = self.stats.num_failed_decodes
        rollbacks, restores = self.stats.num_spec_rollbacks, self.stats.num_spec_restores
        self._woken.clear()
        outcome = self.executor.step(self.slots)
        for job, event in outcome.events:  # (the engine tells them the same way)
            job.mailbox.post([event])
        for ending in outcome.endings:
            self._ended(ending)
        taken_back = (  # (recurrent memory) how the step's rejected drafts left
            self.stats.num_spec_rollbacks - rollbacks,
            self.stats.num_spec_restores - restores,
        )
        for run in self._runs.values():
            rejected = run.slot.usage.num_draft_tokens - run.slot.usage.num_accepted_tokens
            if rejected > run.rejected and run.slot.job is not None and self.runtime.recurrent:
                run.fresh_due.add("rejected_drafts")
                run.counts["spec_rollbacks"] += taken_back[0]
                run.counts["spec_restores"] += taken_back[1]
                taken_back = (0, 0)  # (the step's counts go to one of its runs)
            run.rejected = rejected
        for slot in self.slots:  # (a thought's end written: one forced token a step)
            if slot.thoughts is not None and slot.thoughts.state is ThoughtState.FORCING:
                self._runs[slot.seq].counts["forcing_steps"] += 1
        if self.stats.num_failed_decodes != failed:  # (the executor retries each alone)
            for run in self._runs.values():
                run.fail(OracleError("llama_decode failed for a batch the ledgers admitted"))
        for run in list(self._runs.values()):
            for probe in run.probes:
                self._probe_full(run, probe)
            run.probes.clear()
            self._verify(run)
        if self._progress() == before:
            self._woken.wait(0.01)  # an image is being encoded: no spinning meanwhile

    def _progress(self) -> tuple[int, ...]:
        pieces = (s.piece.offset if s.piece else -1 for s in self.slots)
        return (self.stats.num_decodes, self.stats.num_media_decodes, *pieces)

    def _verify(self, run: _Run) -> None:
        if run.error is None:
            try:
                self.verify(run)
            except OracleError as e:
                run.fail(e)

    def _probe_full(self, run: _Run, probe: _Probe) -> None:
        """CannotFit: the same decode, unguarded, must fail and leave the cache as it was."""
        rt, ledger, seq = self.runtime, run.ledger, run.slot.seq
        item, n_cells = probe.item, probe.num_cells
        if ledger.num_cells + n_cells <= self.capacity:
            run.fail(OracleError(f"CannotFit with {ledger.num_free_cells} free for {n_cells}"))
            return
        pos = ledger.next_pos
        if item.is_media:
            assert item.media_id is not None
            assert run.slot.job is not None
            embd = self.executor.cache.get(media_cache_key(run.slot.job, item.media_id))
            if n_cells > rt.batch_size or embd is None:
                return  # several llama_decode calls: the first ones would commit
            try:
                rt.decode_media(run.media[item.media_id].chunk, embd, pos, seq)
            except native.NativeError:
                pass
            else:
                run.fail(OracleError(f"media of {n_cells} cells decoded past CannotFit"))
        else:
            rt.batch.clear()
            rt.batch.add([item.token_ids[0]] * n_cells, pos, seq, logits_last=True)
            rc = rt.decode()
            if rc == 0:
                run.fail(OracleError(
                    f"{n_cells} tokens decoded at {pos} although the ledger holds "
                    f"{ledger.num_cells}/{self.capacity} cells and said CannotFit"
                ))  # fmt: skip
            run.counts[f"full_probe_rc{rc}"] += 1
        run.counts["full_probes"] += 1
        if ledger.policy is Policy.STOP and n_cells == 1:
            if ledger.num_cells != self.capacity:
                run.fail(OracleError(f"STOP ended at {ledger.num_cells}/{self.capacity} cells"))
            run.counts["stop_boundaries"] += 1

    def expected_cells(self, ledger: Ledger) -> tuple[np.ndarray, np.ndarray | None]:
        """The position of every cell the ledger says the sequence holds (and, on M-RoPE, the
        token stored in it: -1 for media); M-RoPE media cells all store t = the image's start."""
        has_tok = self.probes[0].has_tok
        segs = ledger.segments
        cache = self._cells_of
        pos: list[np.ndarray] = []
        tok: list[np.ndarray] = []
        for seg in segs:
            hit = cache.get(id(seg))
            if hit is None or hit[0] is not seg:  # the entry holds seg: its id is not reused
                hit = (seg, *self._segment_cells(seg))
                cache[id(seg)] = hit
            pos.append(hit[1])
            tok.append(hit[2])
        if len(cache) > 4 * len(segs) + 1024:
            live = [s for run in self._runs.values() for s in run.ledger.segments]
            self._cells_of = {id(s): cache[id(s)] for s in live if id(s) in cache}
        if not segs:
            return np.zeros(0, np.int32), (np.zeros(0, np.int32) if has_tok else None)
        return np.concatenate(pos), (np.concatenate(tok) if has_tok else None)

    def _segment_cells(self, seg: Segment) -> tuple[np.ndarray, np.ndarray]:
        return segment_cells(seg, self.runtime.uses_mrope)

    def verify(self, run: _Run) -> None:
        ledger, mem, seq = run.ledger, self.runtime.memory, run.slot.seq
        if not 0 <= ledger.num_cells <= self.capacity:
            raise OracleError(f"ledger holds {ledger.num_cells} cells, capacity {self.capacity}")
        want_pos, want_tok = self.expected_cells(ledger)
        piece = run.slot.piece
        if piece is not None:  # a media chunk going in a piece at a time: its rest is not there
            missing = piece.item.num_cells - piece.offset
            want_pos = want_pos[: len(want_pos) - missing]
            want_tok = want_tok[: len(want_tok) - missing] if want_tok is not None else None
        held = self.probes[seq].read()
        got_pos, got_tok = held.pos, held.tok
        if len(got_pos) != len(want_pos):
            raise OracleError(f"llama.cpp holds {len(got_pos)} cells, ledger {len(want_pos)}")
        if got_tok is None or want_tok is None:
            same = np.array_equal(np.sort(got_pos), np.sort(want_pos))
        else:
            got = np.lexsort((got_tok, got_pos))
            want = np.lexsort((want_tok, want_pos))
            same = np.array_equal(got_pos[got], want_pos[want]) and np.array_equal(
                got_tok[got], want_tok[want]
            )
        if not same:
            raise OracleError(
                f"cells differ: llama.cpp {_ranges(got_pos)}, ledger {_ranges(want_pos)}"
            )
        pmin = int(llama_cpp.llama_memory_seq_pos_min(mem, seq))
        pmax = int(llama_cpp.llama_memory_seq_pos_max(mem, seq))
        want_min = int(want_pos.min()) if len(want_pos) else -1
        want_max = int(want_pos.max()) if len(want_pos) else -1
        if held.recurrent is not None:
            # the recurrent state has seen up to the last cell decoded (in ledger order; on
            # M-RoPE an image's cells all sit at its first position); hybrid memory answers
            # pos_min/max as the max of the two minima and the min of the two maxima
            want_rec = (int(want_pos[-1]),) if len(want_pos) else ()
            if held.recurrent != want_rec:
                raise OracleError(
                    f"the recurrent state is at {held.recurrent}, the ledger's last cell at "
                    f"{want_rec}"
                )
            if want_rec:
                want_min, want_max = max(want_min, want_rec[0]), min(want_max, want_rec[0])
        if held.swa is not None:
            want_min = self._verify_window(run, held.swa, want_pos, want_min, want_max, pmin)
        if (pmin, pmax) != (want_min, want_max):
            raise OracleError(f"seq_pos_min/max {pmin}/{pmax}, ledger {want_min}/{want_max}")
        whole = piece is None and not self.runtime.uses_mrope and len(want_pos)
        if whole and pmax != ledger.next_pos - 1:
            raise OracleError(f"seq_pos_max {pmax} but the ledger's next_pos is {ledger.next_pos}")
        run.counts["checks"] += 1
        run.counts["checks_mid_media"] += piece is not None
        run.counts["checks_with_thoughts"] += any(seg.item.thought for seg in ledger.segments)

    def _verify_window(
        self, run: _Run, swa: np.ndarray, want_pos: np.ndarray, want_min: int, want_max: int,
        pmin: int,
    ) -> int:  # fmt: skip
        """(sliding-window memory: gemma4) The window cache against the ledger; returns the
        seq_pos_min llama.cpp must answer.

        The full-attention cache holds every cell (compared in `verify`); the window cache
        (with ``swa_full``, llama.cpp's default, as many cells) need not hold those its window
        masks from the sequence's last position (``pos_max - pos >= n_swa``: STANDARD). Its
        ``state_write`` leaves them out, so a sequence state loaded back lacks them; and
        ``llama_kv_cache::find_slot`` may take such a cell as readily as an empty one, after
        which ``apply_ubatch`` purges the sequence's positions up to it (keeping [pos_min,
        pos_max] whole; with a stream per sequence, as here, only where the search wraps).
        While the sequence only grows they stay masked for every later token: nothing attends
        to them, whether they are there or not. So what is exact, and checked, is: the window
        cache holds exactly the ledger's cells within the window of its last position (read
        from the state, which leaves out the masked ones), and ``llama_memory_seq_pos_min``
        (the window cache's answer) is a ledger position between the ledger's lowest and the
        window's lowest. A sequence cut back so that cells it lacks are within the window
        again fails here: llama.cpp would no longer attend to cells the ledger counts. Only
        positions spread over n_swa or more (GAP runs, long contexts) mask anything; pairs
        without a window are checked as before.
        """
        n_swa = self.probes[run.slot.seq].n_swa
        window = want_pos[want_max - want_pos < n_swa]
        run.counts["swa_checks"] += 1
        if not np.array_equal(np.sort(swa), np.sort(window)):
            raise OracleError(
                f"the window cache holds {_ranges(swa)}, the ledger's cells within {n_swa} of "
                f"{want_max}: {_ranges(window)}"
            )
        if not len(want_pos):
            return want_min
        if not (want_min <= pmin <= int(window.min()) and pmin in want_pos):
            raise OracleError(
                f"seq_pos_min {pmin}: not a ledger position in {want_min}..{int(window.min())}"
            )
        run.counts["swa_masked_checks"] += len(window) < len(want_pos)
        run.counts["swa_purged_checks"] += pmin > want_min
        return pmin


def segment_cells(seg: Segment, mrope: bool) -> tuple[np.ndarray, np.ndarray]:
    """The position of each cell a segment holds, and the token stored in it (-1: media)."""
    n = seg.num_cells
    if seg.is_media and mrope:
        pos = np.full(n, seg.pos_start, dtype=np.int32)
    else:
        pos = np.arange(seg.pos_start, seg.pos_start + n, dtype=np.int32)
    if seg.is_media:
        return pos, np.full(n, -1, dtype=np.int32)
    return pos, np.asarray(seg.token_ids, dtype=np.int32)


def _edit(run: _Run, step: Resend, new: list[Item]) -> list[Item] | None:
    """The items of a regeneration or an edit of the run's conversation (None: a plain
    re-send, or nothing there to regenerate or edit)."""
    history = run.history
    if step.edit == "regenerate":
        if len(history) > 1 and history[-1].generated and _plain_text(history[-2]):
            run.counts["regenerations"] += 1
            return history[:-1]
        return None
    if step.edit == "edit":
        texts = [j for j, item in enumerate(history) if _plain_text(item)]
        if not texts:
            return None
        last_reply = history[-1].generated and run.rng.random() < 0.5
        j = len(history) - 1 if last_reply else run.rng.choice(texts)
        item = history[j]
        ids = list(item.token_ids)
        at = run.rng.randrange(len(ids))
        ids[at] = (ids[at] + 1) % 256
        run.counts["edits"] += 1
        run.counts["edits_in_last_reply"] += j == len(history) - 1 and item.generated
        return [*history[:j], replace(item, token_ids=tuple(ids)), *history[j + 1 :], *new]
    return None


def _plain_text(item: Item) -> bool:
    return not item.is_media and item.group is None


def _generated(tokens: Sequence[int], message: int) -> Item:
    return Item(len(tokens), len(tokens), message, tuple(tokens), generated=True)


def _head(item: Item, n: int) -> Item:
    return replace(item, num_cells=n, num_positions=n, token_ids=item.token_ids[:n])


def _tail(item: Item, n: int) -> Item:
    rest = item.num_cells - n
    return replace(item, num_cells=rest, num_positions=rest, token_ids=item.token_ids[n:])


def _brief(x: object) -> str:
    if isinstance(x, Shift | Gap):
        return f"{type(x).__name__}({x.p0}..{x.p1}, {x.num_cells_evicted} cells)"
    if isinstance(x, Reprefill):
        return f"Reprefill(keep {len(x.kept)} items, evict {x.num_cells_evicted} cells)"
    if isinstance(x, Admission):
        return f"admitted {len(x.kept)} items, dropped {len(x.dropped)}"
    return repr(x)


def _ranges(pos: np.ndarray) -> str:
    """Compact sorted positions: '0-9,12,12,12,15-20'."""
    if not len(pos):
        return "[]"
    s = np.sort(pos)
    out: list[str] = []
    start = prev = int(s[0])
    for p in map(int, s[1:]):
        if p == prev + 1:
            prev = p
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = p
    out.append(f"{start}-{prev}" if prev != start else f"{start}")
    text = ",".join(out)
    return text if len(text) < 300 else text[:300] + "..."


# -- the boundary --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    capacity: int
    prompt_cells: int
    prompt_positions: int
    generated: int  # generated tokens decoded before the ledger said CannotFit
    rc_after: int  # llama_decode's answer to one more, unguarded token
    rc_last_replayed: int  # the last token before the boundary, decoded unguarded in a replay
    next_pos: int

    @property
    def believed_free_by_positions(self) -> int:
        """What position-based accounting (n_past vs n_ctx) thinks is free at the boundary."""
        return self.capacity - self.next_pos


@contextmanager
def _alone(oracle: Oracle, policy: Policy) -> Iterator[_Run]:
    """A run of its own on sequence 0, for a boundary check."""
    spec = RunSpec(-1, "boundary", 0, policy, 0, 0.5, EvictionUnit.TOKEN, None, ())
    run = oracle._begin(oracle.slots[0], spec)
    try:
        yield run
    finally:
        oracle._end(run)


def _request(oracle: Oracle, run: _Run, items: Sequence[Item], max_tokens: int) -> None:
    """One request on the run's sequence through the executor, to its end (or its boundary:
    no end-of-generation token stops it before)."""
    job = Job(
        list(items),
        MappingProxyType(run.media),
        run,
        sampling=SamplingConfig(temperature=0),
        context=ContextConfig(run.spec.policy),
        max_tokens=max_tokens,
        session_id="boundary",
        logit_bias=oracle.runtime.eog_bans,
    )
    oracle.executor.start(run.slot, job, run.ledger, len(run.ledger.segments))
    while run.slot.job is not None and run.error is None:
        oracle._step()
    if run.error is not None:
        raise run.error


def _unguarded(rt: Runtime, token: int, pos: int) -> int:
    rt.batch.clear()
    rt.batch.add([token], pos, SEQ, logits_last=True)
    return rt.decode()


def stop_exactness(oracle: Oracle, prompt: Sequence[tuple[int, ...] | Picture]) -> Boundary:
    """STOP: generate until the ledger says CannotFit; llama.cpp must agree to the token.

    Run 1 prefills ``prompt`` and generates under STOP until CannotFit (the executor's own
    request), then decodes one more token unguarded (it must fail). Run 2 replays the same
    tokens into a fresh sequence, the last one before the boundary unguarded (it must
    succeed), then one more (it must fail).
    """
    rt = oracle.runtime
    with _alone(oracle, Policy.STOP) as run:
        items: list[Item] = []
        for part in prompt:
            if isinstance(part, Picture):
                items += oracle.image_items(run, part, 0)
            else:
                items.append(Item.text(part, 0))
        _request(oracle, run, items, UNTIL_FULL)
        ledger = run.ledger
        prompt_cells = sum(i.num_cells for i in items)
        prompt_positions = sum(i.num_positions for i in items)
        if run.counts["stop_boundaries"] != 1:
            raise OracleError(f"STOP ended without its boundary: {dict(run.counts)}")
        token, next_pos = run.reply[-1], ledger.next_pos
        rc_after = _unguarded(rt, token, next_pos)
        oracle.verify(run)  # a failed decode leaves the cells as they were

        # run 2: same sequence, fresh cache; the last token before the boundary goes unguarded
        kept = [s.item for s in ledger.segments]
        oracle.executor.clear(run.slot)
        run.slot.ledger = oracle.new_ledger(Policy.STOP)
        oracle.verify(run)
        last = kept.pop()
        _request(oracle, run, kept, 1)
        if run.ledger.num_free_cells != 1:
            raise OracleError(f"the replay has {run.ledger.num_free_cells} free cells, not 1")
        rt.batch.clear()
        rt.batch.add(last.token_ids, run.ledger.next_pos, SEQ, logits_last=True)
        rc_last = rt.decode()
        if rc_last == 0:
            run.ledger.append(last)
            oracle.verify(run)
            if _unguarded(rt, token, run.ledger.next_pos) == 0:
                raise OracleError("the replay decoded a token past capacity")
            oracle.verify(run)
        generated = ledger.num_cells - prompt_cells
    return Boundary(
        oracle.capacity, prompt_cells, prompt_positions, generated, rc_after, rc_last, next_pos
    )


def media_boundary(oracle: Oracle, picture: Picture) -> tuple[int, int, int, int]:
    """An image whose cells exceed the free cells by one fails; one that fits exactly works.

    The image goes in as the executor puts it there: whole when it fits one batch, else a
    batch-sized piece per llama_decode (then the pieces before the last fit, and the last
    finds no slot). Returns (image cells, image positions, rc of the unguarded over-full
    decode: 0 or 1, the number of llama_decode calls the image took).
    """
    rt = oracle.runtime
    outcome = []
    num_pieces = 0
    for spare in (-1, 0):
        with _alone(oracle, Policy.STOP) as run:
            group = oracle.image_items(run, picture, 0)
            (media,) = [i for i in group if i.is_media]
            filler = oracle.capacity - media.num_cells - spare
            rng = random.Random(filler)
            _request(oracle, run, [Item.text([rng.randrange(256) for _ in range(filler)], 0)], 1)
            plan = run.ledger.ensure(media.num_cells, media.num_positions, group=media.group)
            pos = run.ledger.next_pos
            assert media.media_id is not None
            chunk = run.media[media.media_id].chunk
            embd = rt.encode_media(chunk)  # (no request runs: the encode worker is idle)
            positions = rt.media_positions(chunk, pos)
            # (recurrent memory: the pieces that went in are taken out by a checkpoint's restore)
            saved = rt.checkpoint(SEQ) if rt.recurrent else None
            pieces = range(0, media.num_cells, rt.batch_size)
            num_pieces = len(pieces)
            whole = rt.non_causal(chunk)
            rcs = [
                rt.decode_embeddings(
                    embd, positions, at, min(rt.batch_size, media.num_cells - at), SEQ, whole
                )
                for at in pieces
            ]
            if spare < 0:
                if not isinstance(plan, CannotFit):
                    raise OracleError(f"{run.ledger.num_free_cells} free cells: ensure said {plan}")
                if rcs[:-1] != [0] * (len(rcs) - 1):
                    raise OracleError(f"pieces before the last found no slot: rc {rcs}")
                outcome.append(rcs[-1])
                if saved is not None:
                    rt.restore(SEQ, saved, pos)
                else:
                    rt.seq_rm(SEQ, pos, -1)  # the pieces that went in leave again (as _drop_piece)
                oracle.verify(run)
            else:
                if not isinstance(plan, Fits):
                    raise OracleError(f"an image that fits exactly got {plan}")
                if any(rcs):
                    raise OracleError(f"an image that fits exactly failed: rc {rcs}")
                run.ledger.append(media)
                oracle.verify(run)
                if run.ledger.num_cells != oracle.capacity:
                    raise OracleError("the exact fit did not fill the sequence")
    return media.num_cells, media.num_positions, outcome[0], num_pieces


# -- many runs -----------------------------------------------------------------------------------


@dataclass
class Sweep:
    pair: str
    runs: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    policies: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)
    max_logit_diff: float = 0.0  # (recurrent memory) engine vs fresh prefill, over the runs

    def count_engine(self, before: tuple[EngineStats, int], oracle: Oracle) -> None:
        stats, misses = before
        self.counts["checkpoints"] += oracle.stats.num_checkpoints - stats.num_checkpoints
        self.counts["checkpoint_restores"] += (
            oracle.stats.num_checkpoint_restores - stats.num_checkpoint_restores
        )
        self.counts["decodes"] += oracle.stats.num_decodes - stats.num_decodes
        self.counts["multi_seq_decodes"] += (
            oracle.stats.num_multi_seq_decodes - stats.num_multi_seq_decodes
        )
        self.counts["media_decodes"] += oracle.stats.num_media_decodes - stats.num_media_decodes
        self.counts["media_encodes"] += oracle.executor.cache.misses - misses

    def summary(self) -> str:
        c = self.counts
        plans = ", ".join(f"{k} {c[k]}" for k in ("Shift", "Gap", "Reprefill", "CannotFit") if c[k])
        rate = self.seconds / self.runs * 1000 if self.runs else 0.0
        lines = [
            f"{self.pair}: {self.runs} runs in {self.seconds:.1f} s ({rate:.0f} ms/run), "
            f"{len(self.failures)} failed",
            f"  policies: {dict(sorted(self.policies.items()))}",
            f"  decodes {c['decodes']} text ({c['multi_seq_decodes']} of several sequences) + "
            f"{c['media_decodes']} media ({c['media_encodes']} encodes), {c['generated']} "
            f"generated tokens, {c['checks']} cell-for-cell checks "
            f"({c['checks_mid_media']} with an image half in)",
            f"  plans: {plans}; cells evicted {c['cells_evicted']}",
            f"  requests in a used sequence {c['resends']} ({c['cells_reused']} cells reused "
            f"via common_prefix + truncate + seq_rm)",
            f"  prompts {c['prompts']} ({c['prompts_truncated']} truncated, "
            f"{c['prompts_rejected']} rejected); CannotFit probes {c['full_probes']} "
            f"(all failed in llama.cpp as they must; {c['stop_boundaries']} STOP boundaries "
            f"at exactly capacity)",
            f"  drafts {c['drafted']} verified, {c['accepted']} accepted (the rest given back)",
            f"  thoughts: {c['checks_with_thoughts']} checks with thought cells, "
            f"{c['forcing_steps']} steps that wrote a thought's end past its budget",
        ]
        if self.pair in HYBRID:
            lines += [
                f"  recurrent: {c['checkpoints']} checkpoints saved, "
                f"{c['checkpoint_restores']} restored ({c['restores']} by a request's reuse, "
                f"{c['reprefills_from_checkpoint']} Reprefills kept a pinned prefix), "
                f"{c['decoded_from_0']} requests decoded from 0 instead; {c['regenerations']} "
                f"regenerations, {c['edits']} edits ({c['edits_in_last_reply']} in the last "
                f"reply); drafts asked by {c['drafts_asked']} requests, rejected ones taken "
                f"back in place {c['spec_rollbacks']} times, from a checkpoint "
                f"{c['spec_restores']} times",
                f"  fresh-prefill checks {c['fresh_checks']} ({c['fresh_cells']} cells): after "
                f"reuse {c['fresh_after_reuse']}, restore {c['fresh_after_restore']}, "
                f"reprefill {c['fresh_after_reprefill']}, rejected drafts "
                f"{c['fresh_after_rejected_drafts']}; max |logit diff| "
                f"{self.max_logit_diff:.2g}, greedy ties {c['fresh_ties']}",
            ]
        if c["swa_checks"]:
            lines.append(
                f"  sliding window: {c['swa_checks']} checks of the window cache, "
                f"{c['swa_masked_checks']} with ledger cells it masks, "
                f"{c['swa_purged_checks']} with some of them gone from it"
            )
        for seed, msg in self.failures[:5]:
            lines.append(f"  FAILED seed {seed}: {msg.splitlines()[0]}")
        return "\n".join(lines)


class Drivers:
    """One Oracle per (pair, shape), opened on first use."""

    def __init__(self, pairs: dict[str, TinyPair]):
        self.pairs = pairs
        self._open: dict[tuple[str, int], Oracle] = {}
        self._fresh: dict[str, FreshPrefill] = {}

    def get(self, pair: str, shape: int) -> Oracle:
        key = (pair, shape)
        if key not in self._open:
            rt = open_runtime(self.pairs[pair], SHAPES[pair][shape], lanes=LANES)
            fresh = self.fresh(pair) if rt.recurrent else None
            self._open[key] = Oracle(rt, fresh)
        return self._open[key]

    def fresh(self, pair: str) -> FreshPrefill:
        """(recurrent memory) The pair's fresh-prefill runtime, shared by its shapes."""
        if pair not in self._fresh:
            ctx = max(shape.ctx_size for shape in SHAPES[pair])
            self._fresh[pair] = FreshPrefill(self.pairs[pair], ctx)
        return self._fresh[pair]

    def close(self) -> None:
        for oracle in self._open.values():
            oracle.close()
            oracle.runtime.close()
        self._open.clear()
        for fresh in self._fresh.values():
            fresh.close()
        self._fresh.clear()

    def sweep(
        self, pair: str, seeds: Sequence[int], *, keep_going: bool = True, verbose: bool = False
    ) -> Sweep:
        result = Sweep(pair)
        t0 = time.perf_counter()
        specs = [make_spec(pair, seed) for seed in seeds]
        by_shape: dict[int, list[RunSpec]] = {}
        for spec in specs:
            by_shape.setdefault(spec.shape, []).append(spec)
        for shape, group in sorted(by_shape.items()):
            oracle = self.get(pair, shape)
            # in pieces of a few runs, so that a failure stops a sweep soon when asked to
            for k in range(0, len(group), 4 * LANES if keep_going else LANES):
                chunk = group[k : k + (4 * LANES if keep_going else LANES)]
                if verbose:
                    for spec in chunk:
                        print(spec.describe(), flush=True)
                before = replace(oracle.stats), oracle.executor.cache.misses
                outcomes = oracle.run_side_by_side(chunk)
                result.count_engine(before, oracle)
                for spec, outcome in zip(chunk, outcomes, strict=True):
                    result.runs += 1
                    result.policies[spec.policy.name] += 1
                    if isinstance(outcome, OracleError):
                        result.failures.append((spec.seed, str(outcome)))
                        if verbose:
                            print(f"FAILED: {outcome}", flush=True)
                    else:
                        result.counts.update(outcome.counts)
                        result.max_logit_diff = max(result.max_logit_diff, outcome.max_logit_diff)
                if result.failures and not keep_going:
                    break
            if result.failures and not keep_going:
                break
        result.failures.sort()
        result.seconds = time.perf_counter() - t0
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per pair (default 200)")
    parser.add_argument("--pair", choices=PAIRS, action="append", help="default: every pair")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--models", type=Path, help="directory for the tiny models")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    args = parser.parse_args(argv)
    pairs = args.pair or list(PAIRS)
    with tempfile.TemporaryDirectory() as tmp:
        models = write_tiny_models(args.models or Path(tmp), pairs)
        drivers = Drivers(models)
        failed = 0
        try:
            for pair in pairs:
                seeds = range(args.seed, args.seed + args.runs)
                sweep = drivers.sweep(pair, seeds, verbose=args.verbose)
                print(sweep.summary(), flush=True)
                failed += len(sweep.failures)
                for seed, msg in sweep.failures[:1]:
                    print(f"\nfirst failure, seed {seed}:\n{msg}\n", flush=True)
        finally:
            drivers.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
