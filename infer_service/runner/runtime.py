"""The llama.cpp side of inference: one model, one context, one mtmd context.

Everything here must be called from the single engine thread (media verification, which only
tokenizes, is the exception: libmtmd's tokenizer is thread-safe).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import mtmd_cpp

from infer_service.runner.cache_types import FLASH_ATTN, GGML_TYPES, CacheTypes
from infer_service.runner.lora import LoraAdapters, LoraFile, LoraSet
from infer_service.runner.mtp import MtpDrafter
from slotwise_core import model_files, native
from slotwise_core.descriptors import Fingerprint
from slotwise_core.lru import SizedLRU

log = logging.getLogger("slotwise.runtime")

CLOSE_WAIT = 30.0  # seconds close waits for borrowers (a verification finishing its image)


def physical_cores() -> int:
    """llama-server's default thread count: one per physical core this process may run on
    (two hyperthreads of a core share its math units), i.e. the distinct thread-sibling sets of
    the CPUs in its affinity."""
    try:
        cpus: Iterable[int] = os.sched_getaffinity(0)
    except AttributeError:  # (not Linux)
        cpus = range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings")
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


@dataclass(frozen=True)
class RuntimeConfig:
    model: Path
    mmproj: Path | None = None
    ctx_size: int = 4096  # all slots together; each gets llama_n_ctx_seq cells
    parallel: int = 1
    # one pool of cells for every slot (llama.cpp's unified cache), where a pinned prefix
    # (a system prompt and its images) is stored once for every conversation that opens with it
    kv_unified: bool = False
    shared_prefixes: int = 4  # (kv_unified) prefixes kept at once, each in a sequence of its own
    max_cells_per_slot: int = 0  # (kv_unified) the most one slot's sequence may hold; 0: the pool
    batch_size: int = 512
    ubatch_size: int = 512
    gpu_layers: int = 0
    # llama.cpp's threads for a step that generates one token per sequence, and for a step
    # with prompt tokens (llama-server's default for both: every physical core)
    threads: int = field(default_factory=physical_cores)
    threads_batch: int = field(default_factory=physical_cores)
    # the projector runs on its own worker beside decoding, and only while an image waits
    encode_threads: int = field(default_factory=physical_cores)
    # its priority below decoding's (nice): while slots generate, it takes what they leave
    encode_nice: int = 10
    extra_bufts: bool | None = None  # None: unless the CPU reports AMX the kernel refuses
    # the most one token's grammar work may take on the engine thread (a request past it ends)
    grammar_ms: int = 250
    # (recurrent memory) checkpoints of a slot's recurrent state kept at once, and the cells
    # a prompt decodes between two (llama-server's --ctx-checkpoints, --checkpoint-min-step)
    ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8192
    # (hybrid memory) the recurrent state keeps one snapshot per token for this many of the
    # last tokens a step decodes (llama.cpp's n_rs_seq): that many rejected drafts roll back in
    # place; a longer draft is verified from a checkpoint of the state taken before its step.
    # 0: always a checkpoint (what llama-server does for n-gram drafts): the snapshots cost
    # every step (a one-token step of the bench's wide qwen35: 4.0 ms with 4, 3.0 without),
    # a checkpoint only a drafting one (10 us there), and a rejection a replay
    spec_rollback: int = 0
    # the model's own multi-token-prediction head drafts (speculative type draft-mtp): its
    # nextn layers loaded, and an MTP context beside the target's
    mtp: bool = False
    # the types of K and V cells and flash attention (--cache-type-k/v, --flash-attn); None:
    # llama.cpp's defaults (f16, f16, auto)
    cache_types: CacheTypes | None = None
    # LoRA adapters loaded with the model, in id order (--lora, --lora-scaled), and whether
    # they start at scale 0 (--lora-init-without-apply)
    lora: tuple[LoraFile, ...] = ()
    lora_init_without_apply: bool = False


RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random one


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = RANDOM_SEED


class Runtime:
    def __init__(self, config: RuntimeConfig):
        self.config = config
        # a token's bytes and whether it ends generation, as the vocabulary says (it never
        # changes): read from llama.cpp once a token, not on every step
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self.fingerprint: Fingerprint = model_files.fingerprint(config.model, config.mmproj)
        extra_bufts = config.extra_bufts
        if extra_bufts is None:
            extra_bufts, why = native.extra_bufts_decision(
                native.cpu_flags(), native.amx_tile_permission
            )
            (log.info if extra_bufts else log.warning)("extra buffer types: %s", why)
        self.model = native.load_model(
            config.model,
            vocab_only=False,
            n_gpu_layers=config.gpu_layers,
            extra_bufts=extra_bufts,
            load_mtp=config.mtp,
        )
        if config.mtp and llama_cpp.llama_model_n_layer_nextn(self.model) <= 0:
            native.free_model(self.model)
            raise native.NativeError(
                f"{config.model.name} has no nextn (multi-token-prediction) layers: the "
                "speculative type draft-mtp needs a model that ships them"
            )
        try:
            self.lora = LoraAdapters.load(
                self.model, config.lora, apply=not config.lora_init_without_apply
            )
        except BaseException:
            native.free_model(self.model)  # (with the adapters loaded so far)
            raise
        self._borrowers = threading.Condition()
        self._num_borrowers, self._closing = 0, False
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.num_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        # every end-of-generation token banned (ignore_eos): the vocabulary may mark several
        self.eog_bans = tuple(
            (t, -math.inf)
            for t in range(self.num_vocab)
            if llama_cpp.llama_vocab_is_eog(self.vocab, t)
        )
        holders = config.shared_prefixes if config.kv_unified else 0
        try:
            self.ctx, self.cache_types = self._context(config, holders)
        except BaseException:
            native.free_model(self.model)  # (with its adapters)
            raise
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.mtmd: native.Multimodal | None = None
        self._batch: TokenBatch | None = None
        self.mtp: MtpDrafter | None = None
        try:
            if config.mtp:
                self.mtp = MtpDrafter(
                    self.model, self.ctx, params_seqs(config, holders),
                    llama_cpp.llama_n_ctx(self.ctx), config.threads,
                )  # fmt: skip
            if config.mmproj:
                self.mtmd = native.Multimodal(
                    config.mmproj,
                    self.model,
                    n_threads=config.encode_threads,
                    use_gpu=config.gpu_layers > 0,
                )
            self.batch = self._batch = TokenBatch(
                llama_cpp.llama_n_batch(self.ctx), config.parallel
            )
        except BaseException:  # nothing loaded so far stays behind
            self.close()
            raise
        self.num_slots = config.parallel
        self.num_cells = llama_cpp.llama_n_ctx(self.ctx)
        self.num_cells_per_slot = llama_cpp.llama_n_ctx_seq(self.ctx)
        if config.kv_unified and config.max_cells_per_slot > 0:
            self.num_cells_per_slot = min(self.num_cells_per_slot, config.max_cells_per_slot)
        self.holder_seqs = range(config.parallel, config.parallel + holders)
        self.batch_size = llama_cpp.llama_n_batch(self.ctx)
        self.ubatch_size = llama_cpp.llama_n_ubatch(self.ctx)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)
        self.n_embd = llama_cpp.llama_model_n_embd_inp(self.model)
        self.n_swa = max(0, llama_cpp.llama_model_n_swa(self.model))  # (sliding window)
        self.can_shift = self._can_shift()
        self.memory_kind = native.memory_kind(self.model)
        # a state per sequence that llama.cpp cannot cut back (only clear or restore)
        self.recurrent = self.memory_kind != "attention"
        self.checkpoint_bytes = 0  # (recurrent) one sequence's state: the last one saved
        # (recurrent) rejected drafts a step can roll back in place (0: none, a checkpoint)
        self.rollback_tokens = llama_cpp.llama_n_rs_seq(self.ctx) if self.recurrent else 0
        self.uses_mrope = bool(self.mtmd and self.mtmd.uses_mrope)
        self._null_callback = mtmd_cpp.mtmd_helper_post_decode_callback(0)
        self.bytes_per_cell = self._measure_bytes_per_cell()

    def _context(self, config: RuntimeConfig, holders: int) -> tuple[int, CacheTypes]:
        """The llama.cpp context the config asks for, and the types its cells got (llama.cpp's
        defaults where the config names none)."""
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.ctx_size
        params.n_batch = config.batch_size
        params.n_ubatch = config.ubatch_size
        params.n_seq_max = params_seqs(config, holders)
        params.n_threads = config.threads
        params.n_threads_batch = config.threads_batch
        params.kv_unified = config.kv_unified  # else every sequence has its own budget of cells
        params.n_rs_seq = config.spec_rollback  # (llama.cpp clamps it to 0 where not hybrid)
        params.no_perf = True
        if config.cache_types is not None:
            config.cache_types.check_head_size(native.head_size(self.model))
            params.type_k = GGML_TYPES[config.cache_types.k]
            params.type_v = GGML_TYPES[config.cache_types.v]
            params.flash_attn_type = FLASH_ATTN[config.cache_types.flash_attn]
        types = CacheTypes(
            type_name(params.type_k),
            type_name(params.type_v),
            {v: k for k, v in FLASH_ATTN.items()}[params.flash_attn_type],
        )
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise native.NativeError(
                "llama_init_from_model failed (context too large? cache types "
                f"{types.describe()} not supported here?)"
            )
        return ctx, types

    def _can_shift(self) -> bool:
        """llama.cpp's answer, unless a shift of these cells would crash it."""
        if not llama_cpp.llama_memory_can_shift(self.memory):
            return False
        head = native.head_size(self.model)
        if self.cache_types.shift_crashes(head):
            log.warning(
                "a shift of this quantized K cache (%s, head size %d) would crash llama.cpp: "
                "no shifts (evictions decode the kept part again)", self.cache_types.k, head,
            )  # fmt: skip
            return False
        return True

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[Runtime]:
        """The runtime used off the engine thread (a prompt's verification, a grammar's
        parse): `close` waits until every borrower is done. Once it closes, UNAVAILABLE."""
        with self._borrowers:
            if self._closing:
                raise native.NativeError("the model is being unloaded: server shutting down")
            self._num_borrowers += 1
        try:
            yield self
        finally:
            with self._borrowers:
                self._num_borrowers -= 1
                self._borrowers.notify_all()

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Free everything, once no borrower uses it; safe to call twice. A borrower that is
        still at work after `wait` seconds keeps it (leaked, never freed under it)."""
        with self._borrowers:
            self._closing = True
            if not self._borrowers.wait_for(lambda: self._num_borrowers == 0, timeout=wait):
                log.warning("the runtime is still in use after %.0f s: left unfreed", wait)
                return
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self.mtp is not None:
            self.mtp.close()
            self.mtp = None
        if self.mtmd is not None:
            self.mtmd.close()
            self.mtmd = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = 0
        if self.model:
            native.free_model(self.model)
            self.model = 0

    # -- memory ---------------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        if not self.try_seq_rm(seq, p0, p1):
            raise native.NativeError(f"llama_memory_seq_rm({seq}, {p0}, {p1}) failed")

    def try_seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """False where llama.cpp refuses (a recurrent state cut back past its snapshots):
        then nothing changed."""
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq, p0, p1))

    def seq_add(self, seq: int, p0: int, delta: int) -> None:
        if not self.can_shift:  # (llama.cpp aborts the process there: M-RoPE, IMROPE)
            raise native.NativeError("llama_memory_seq_add on a memory that cannot shift")
        llama_cpp.llama_memory_seq_add(self.memory, seq, p0, -1, delta)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst gets src's cells at positions [p0, p1): in a unified cache, the same cells."""
        llama_cpp.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_clear(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def state_get(self, seq: int) -> memoryview:
        """The sequence's KV state, as llama_state_seq_get_data writes it: one copy, into a
        buffer the caller owns (written to disk as it is)."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq)
        buf = bytearray(size)
        n = llama_cpp.llama_state_seq_get_data(
            self.ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, seq
        )
        return memoryview(buf)[:n]

    def state_set(self, seq: int, data: bytes | bytearray | memoryview) -> bool:
        """Load a saved state into seq; False (and seq left empty) when it does not fit, or
        (a sliding-window model) reaches past the window, where it lost cells."""
        if isinstance(data, bytearray | memoryview):
            buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        else:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(data), seq) == 0:
            self.seq_clear(seq)
            return False
        if self.n_swa and llama_cpp.llama_memory_seq_pos_max(self.memory, seq) >= self.n_swa:
            # a sliding-window model's state leaves out the cells its window hides, and a
            # later cut back or shift would need them: decoded again instead (llama-server
            # re-processes its prompt there too)
            self.seq_clear(seq)
            return False
        return True

    def checkpoint(self, seq: int) -> bytes:
        """(recurrent memory) The sequence's recurrent state alone, without its attention
        cells: what `restore` puts back (llama-server's context checkpoints)."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, flags)
        if n == 0:
            raise native.NativeError(f"sequence {seq}: its recurrent state could not be read")
        self.checkpoint_bytes = n
        return bytes(memoryview(buf)[:n])

    def restore(self, seq: int, state: bytes, pos: int) -> None:
        """Put a checkpoint's recurrent state back and remove the attention cells from `pos`
        on (the checkpoint was taken there). On a refusal the sequence is cleared: what it
        holds is no longer known."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        ok = llama_cpp.llama_state_seq_set_data_ext(self.ctx, buf, len(state), seq, flags) != 0
        if not ok or not llama_cpp.llama_memory_seq_rm(self.memory, seq, pos, -1):
            self.seq_clear(seq)
            raise native.NativeError(f"sequence {seq}: its checkpoint at {pos} did not load")

    def cells_in_use(self) -> list[tuple[int, tuple[int, ...]]]:
        """(position, sequences) of every cell in use in a unified cache (one stream), read
        from llama.cpp's whole state: a diagnostic for oracles and benchmarks (it copies every
        cell's K and V). As
        llama_state_get_data writes it: a u32-sized arch name, u32 n_stream, then per stream u32
        cell_count and per cell i32 pos, u32 n_seq_id, the cell ext on M-RoPE models (x, y,
        token), the sequence ids; then u32 v_trans and u32 n_layer, checked here. Only the
        first cache is read (a sliding-window model's full one)."""
        size = int(llama_cpp.llama_state_get_size(self.ctx))
        buf = bytearray(size)
        n = llama_cpp.llama_state_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(buf), size)
        data = memoryview(buf)[:n]
        ext = self._cell_ext()
        at = 4 + struct.unpack_from("<I", data, 0)[0]
        (num_streams,) = struct.unpack_from("<I", data, at)
        at += 4
        cells: list[tuple[int, tuple[int, ...]]] = []
        for _ in range(num_streams):
            (count,) = struct.unpack_from("<I", data, at)
            at += 4
            for _ in range(count):
                pos, k = struct.unpack_from("<iI", data, at)
                at += 8 + ext
                cells.append((pos, tuple(sorted(struct.unpack_from(f"<{k}i", data, at)))))
                at += 4 * k
            if count:
                v_trans, n_layer = struct.unpack_from("<II", data, at)
                # (n_layer: this cache's; a sliding-window model writes its full-attention
                # cache first, with some of the layers, then the window's)
                if v_trans > 1 or not 0 < n_layer <= llama_cpp.llama_model_n_layer(self.model):
                    raise native.NativeError("the cache's state is not laid out as expected")
                break  # (its K and V follow: read no further; a unified cache has one stream)
        return cells

    @property
    def layout(self) -> dict[str, int]:
        """What a saved sequence state depends on: it loads only into the same layout."""
        return {
            "n_ctx_seq": self.num_cells_per_slot,
            "n_seq_max": self.num_slots,
            "kv_unified": int(self.config.kv_unified),
            "type_k": GGML_TYPES[self.cache_types.k],
            "type_v": GGML_TYPES[self.cache_types.v],
        }

    def _measure_bytes_per_cell(self) -> int:
        """What one cell's K and V take in the (first) attention cache, as llama.cpp writes
        them: one token decoded into sequence 0 at start, its state's rows read, the sequence
        cleared. 0 where nothing is read (a recurrent model has no cells)."""
        if self.memory_kind == "recurrent":
            return 0
        token = max(0, llama_cpp.llama_vocab_bos(self.vocab))
        self.batch.clear()
        self.batch.add([token], 0, 0, logits_last=False)
        try:
            if self.decode() != 0:
                return 0
            return kv_row_bytes(self.state_get(0), mrope_ext=self._cell_ext())
        finally:
            self.seq_clear(0)
            self.batch.clear()

    def _cell_ext(self) -> int:
        mrope = (
            llama_cpp.LLAMA_ROPE_TYPE_MROPE,
            llama_cpp.LLAMA_ROPE_TYPE_IMROPE,
            llama_cpp.LLAMA_ROPE_TYPE_VISION,
        )
        return 12 if llama_cpp.llama_model_rope_type(self.model) in mrope else 0

    # -- decoding -------------------------------------------------------------------------

    def decode(self) -> int:
        return int(llama_cpp.llama_decode(self.ctx, self.batch.native))

    def use_lora(self, lora: LoraSet) -> bool:
        """The LoRA adapters the next decodes run under (llama.cpp applies them to the whole
        context); returns whether they changed."""
        return self.lora.apply(self.ctx, lora)

    def encode_media(self, chunk: int) -> np.ndarray:
        """Run the projector on one media chunk; returns (n_tokens, n_embd) float32 embeddings.

        Called on the encode worker, never on the engine thread, one at a time: the output
        buffer belongs to the mtmd context, so it is copied out before the next encode.
        """
        assert self.mtmd is not None
        rc = mtmd_cpp.mtmd_encode_chunk(self.mtmd.ctx, chunk)
        if rc != 0:
            raise native.NativeError(f"mtmd_encode_chunk failed (rc={rc})")
        n = int(mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk))
        ptr = mtmd_cpp.mtmd_get_output_embd(self.mtmd.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n * self.n_embd,)).copy()

    def media_positions(self, chunk: int, pos: int) -> np.ndarray:
        """The positions of a media chunk's embeddings from pos: one per embedding, or for
        M-RoPE four per embedding, section-major ([t..., y..., x..., z...]) as llama.cpp reads
        an embedding batch (what mtmd_helper_decode_image_chunk builds)."""
        n = int(mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk))
        if not self.uses_mrope:
            return np.arange(pos, pos + n, dtype=np.int32)
        if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_AUDIO:
            # a sound's embeddings are a line: every section advances with them (M-RoPE 1D)
            return np.tile(np.arange(pos, pos + n, dtype=np.int32), (4, 1))
        image = mtmd_cpp.mtmd_input_chunk_get_tokens_image(chunk)
        out = np.empty((4, n), dtype=np.int32)
        for i in range(n):
            p = mtmd_cpp.mtmd_image_tokens_get_decoder_pos(image, pos, i)
            out[0, i], out[1, i], out[2, i], out[3, i] = p.t, p.y, p.x, p.z
        return out

    def non_causal(self, chunk: int) -> bool:
        """Whether this media chunk is decoded with non-causal attention (Gemma 3's images,
        say; never a sound): then it must go whole, in one ubatch."""
        return bool(self.mtmd and mtmd_cpp.mtmd_decode_use_non_causal(self.mtmd.ctx, chunk))

    def decode_embeddings(
        self,
        embeddings: np.ndarray,
        positions: np.ndarray,
        offset: int,
        n: int,
        seq: int,
        non_causal: bool = False,
    ) -> int:
        """Decode embeddings [offset, offset + n) of one media chunk into seq (its positions
        from media_positions); returns llama_decode's rc. A piece of a chunk decodes between
        other slots' steps; a non-causal chunk must go whole (one ubatch). Wipes all logits."""
        assert self.mtmd is not None
        piece = np.ascontiguousarray(embeddings.reshape(-1, self.n_embd)[offset : offset + n])
        if positions.ndim == 1:
            pos = np.ascontiguousarray(positions[offset : offset + n])
        else:
            pos = np.ascontiguousarray(positions[:, offset : offset + n]).reshape(-1)
        n_seq_id = np.ones(n, dtype=np.int32)
        seq_id = ctypes.c_int32(seq)
        seq_ids = (ctypes.POINTER(ctypes.c_int32) * n)(*([ctypes.pointer(seq_id)] * n))
        logits = np.zeros(n, dtype=np.int8)
        batch = llama_cpp.llama_batch(
            n_tokens=n,
            token=None,
            embd=piece.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos=pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
            n_seq_id=n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=seq_ids,
            logits=logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        if non_causal:
            llama_cpp.llama_set_causal_attn(self.ctx, False)
        try:
            return int(llama_cpp.llama_decode(self.ctx, batch))
        finally:
            if non_causal:
                llama_cpp.llama_set_causal_attn(self.ctx, True)

    def decode_media(
        self, chunk: int, embeddings: np.ndarray, pos: int, seq: int, n_batch: int = 0
    ) -> int:
        """Decode encoded media at pos; returns the next position. Wipes all logits."""
        assert self.mtmd is not None
        new_pos = llama_cpp.llama_pos(0)
        rc = mtmd_cpp.mtmd_helper_decode_image_chunk(
            self.mtmd.ctx,
            self.ctx,
            chunk,
            embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos,
            seq,
            n_batch or self.batch_size,
            ctypes.byref(new_pos),
            self._null_callback,
            None,
        )
        if rc != 0:
            raise native.NativeError(f"mtmd_helper_decode_image_chunk failed (rc={rc})")
        return int(new_pos.value)

    # -- sampling and text ----------------------------------------------------------------

    def sampler(self, s: SamplingConfig, logit_bias: tuple[tuple[int, float], ...] = ()) -> Any:
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        if logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(logit_bias))(*logit_bias)
            add(chain, llama_cpp.llama_sampler_init_logit_bias(
                self.num_vocab, len(logit_bias), biases
            ))  # fmt: skip
        if s.repeat_penalty != 1.0 or s.presence_penalty or s.frequency_penalty:
            add(chain, llama_cpp.llama_sampler_init_penalties(
                self.num_vocab, s.penalty_last_n, s.repeat_penalty, s.frequency_penalty,
                s.presence_penalty,
            ))  # fmt: skip
        if s.temperature <= 0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
            return chain
        if s.top_k > 0:
            add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
        add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
        add(chain, llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
        add(chain, llama_cpp.llama_sampler_init_temp(s.temperature))
        add(chain, llama_cpp.llama_sampler_init_dist(s.seed))
        return chain

    def grammar_sampler(self, gbnf: str) -> Any:
        """A grammar sampler, or None when llama.cpp cannot parse the grammar. Reads only the
        vocabulary: callable off the engine thread (to check a request before it queues)."""
        return llama_cpp.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root") or None

    def logits(self, batch_index: int) -> np.ndarray:
        """The logits of the last decode at batch_index: a view, valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, batch_index)
        return np.ctypeslib.as_array(ptr, shape=(self.num_vocab,))

    def tokenize(self, text: str) -> list[int]:
        return native.tokenize_text(self.vocab, text, add_special=False, parse_special=True)

    def sample(self, sampler: Any, batch_index: int) -> int:
        return int(llama_cpp.llama_sampler_sample(sampler, self.ctx, batch_index))

    @staticmethod
    def free_sampler(sampler: Any) -> None:
        llama_cpp.llama_sampler_free(sampler)

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))
        return eog

    def piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = native.token_piece(self.vocab, token)
        return piece


class TokenBatch:
    """A reusable llama_batch with numpy views, so filling it is not a ctypes call per field."""

    def __init__(self, capacity: int, n_seq_max: int):
        self.capacity = capacity
        self.native = llama_cpp.llama_batch_init(capacity, 0, n_seq_max)
        self.tokens = np.ctypeslib.as_array(self.native.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.native.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(self.native.logits, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.native.n_seq_id, shape=(capacity,))
        self._seq_ids = [
            np.ctypeslib.as_array(self.native.seq_id[i], shape=(1,)) for i in range(capacity)
        ]
        self.n_seq_id[:] = 1
        self.size = 0

    def clear(self) -> None:
        self.size = 0
        self.native.n_tokens = 0

    def add(
        self,
        tokens: tuple[int, ...] | list[int],
        pos: int,
        seq: int,
        logits_last: bool,
        *,
        num_logits: int = 1,
    ) -> int:
        """Append tokens of one sequence at consecutive positions; returns the last index.
        logits_last: the last `num_logits` tokens get logits (a drafted run: each of them)."""
        i, n = self.size, len(tokens)
        if n == 1:  # (a generating slot's one token, every step: no slices)
            self.tokens[i], self.pos[i], self.logits[i] = tokens[0], pos, logits_last
            self._seq_ids[i][0] = seq
            self.size = self.native.n_tokens = i + 1
            return i
        self.tokens[i : i + n] = tokens
        self.pos[i : i + n] = np.arange(pos, pos + n)
        self.logits[i : i + n] = 0
        for k in range(i, i + n):
            self._seq_ids[k][0] = seq
        if logits_last:
            self.logits[i + n - min(n, num_logits) : i + n] = 1
        self.size = i + n
        self.native.n_tokens = self.size
        return i + n - 1

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.native)


class EmbeddingCache(SizedLRU[str, np.ndarray]):
    """media key -> projector output, least recently used out first, bounded in bytes."""

    def __init__(self, max_bytes: int = 1 << 30):
        super().__init__(max_bytes, lambda embeddings: embeddings.nbytes)


def params_seqs(config: RuntimeConfig, holders: int) -> int:
    """The context's sequences: one a slot, one a held prefix."""
    return config.parallel + holders


def type_name(ggml_type: int) -> str:
    for name, value in GGML_TYPES.items():
        if value == ggml_type:
            return name
    return f"ggml type {ggml_type}"


def kv_row_bytes(state: memoryview, *, mrope_ext: int) -> int:
    """The bytes of one cell's K and V rows over every layer, read from a sequence's state as
    llama_state_seq_get_data writes it: a u32 magic and the i32 sequence id, then
    (llama_kv_cache::state_write) u32 n_stream; per stream
    u32 cell_count, each cell's i32 pos, u32 n_seq_id, the M-RoPE ext, the i32 seq ids; then
    u32 v_trans, u32 n_layer, per layer i32 K type, u64 K row size and the rows; then per layer
    V the same (v_trans: i32 type, u32 element size, u32 row elements). The first stream that
    holds cells, of the first cache (a hybrid model's attention cache; a sliding-window model's
    full one)."""
    (num_streams,) = struct.unpack_from("<I", state, 8)
    at = 12
    for _ in range(num_streams):
        (count,) = struct.unpack_from("<I", state, at)
        at += 4
        if not count:
            continue
        for _ in range(count):
            _, k = struct.unpack_from("<iI", state, at)
            at += 8 + mrope_ext + 4 * k
        v_trans, n_layer = struct.unpack_from("<II", state, at)
        at += 8
        total = 0
        for _ in range(n_layer):
            _, row = struct.unpack_from("<iQ", state, at)
            at += 12 + row * count
            total += row
        for _ in range(n_layer):
            if v_trans:
                _, size, n = struct.unpack_from("<iII", state, at)
                at += 12 + size * n * count
                total += size * n
            else:
                _, row = struct.unpack_from("<iQ", state, at)
                at += 12 + row * count
                total += row
        return total
    return 0
