"""The one wrapper around llama.cpp's and libmtmd's ctypes bindings that both services share.

Loading models, silencing native logs, and tokenizing text + bitmaps into chunks whose cells and
positions are read from libmtmd, never computed by us.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort must not attach gdb to the server

import llama_cpp
from llama_cpp import mtmd_cpp

from slotwise_core import audio_windows, sounds

_LOG_LOCK = threading.Lock()
_log_callbacks: list[object] = []  # ctypes callbacks must outlive every native call


class NativeError(RuntimeError):
    """llama.cpp or libmtmd refused an operation."""


def quiet_native_logs() -> None:
    """Route llama.cpp, ggml and mtmd logs to nowhere unless SLOTWISE_NATIVE_LOGS is set.

    Importing llama_cpp installs a Python callback that prints every line; a server must not.
    """
    if os.environ.get("SLOTWISE_NATIVE_LOGS"):
        return
    with _LOG_LOCK:
        if _log_callbacks:
            return
        llama_cb = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(llama_cb, ctypes.c_void_p(0))
        mtmd_cb = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        mtmd_cpp.mtmd_helper_log_set(mtmd_cb, ctypes.c_void_p(0))
        _log_callbacks.extend([llama_cb, mtmd_cb])


def load_model(
    path: Path,
    *,
    vocab_only: bool,
    n_gpu_layers: int = 0,
    extra_bufts: bool = True,
    load_mtp: bool = False,
) -> int:
    """Load a GGUF text model and return its handle (freed with free_model).

    extra_bufts False: no repacked weight buffers (the AMX ones among them; see amx_usable).
    load_mtp: its multi-token-prediction (nextn) tensors too, which llama.cpp skips otherwise.
    """
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    quiet_native_logs()
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = extra_bufts
    params.load_mtp = load_mtp
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise NativeError(f"llama.cpp could not load {path} (not a GGUF text model?)")
    return model


# -- AMX: reported by the CPU is not the same as usable -----------------------------------------

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def amx_tile_permission() -> bool:
    """Ask the kernel for AMX tile data (Linux >= 5.16 wants this before a thread uses it);
    some VMs report AMX in cpuinfo and refuse it here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def extra_bufts_decision(flags: set[str], permission: Callable[[], bool]) -> tuple[bool, str]:
    """Whether llama.cpp may use its extra (repacked) weight buffers, and why.

    llama.cpp picks its AMX buffer type whenever the CPU reports amx_tile. On VMs that report
    AMX the first Q4_K decode has been seen to crash in ggml_backend_amx_mul_mat: a segfault
    where the kernel refuses tile data, and a SIGILL (tilezero in a worker thread) on this
    project's own 2-core VM, where the kernel grants it and tile instructions run in a test
    thread. So a CPU that reports AMX loads without extra buffer types unless told otherwise
    (--extra-bufts on): slower matmuls, no crash.
    """
    if "amx_tile" not in flags:
        return True, "the CPU reports no AMX"
    kernel = "grants" if permission() else "refuses"
    return False, (
        f"the CPU reports AMX (the kernel {kernel} tile data): loading without extra buffer "
        "types, since llama.cpp's AMX kernels crash on some such hosts "
        "(ggml_backend_amx_mul_mat); --extra-bufts on to use them"
    )


def memory_kind(model: int) -> str:
    """What a sequence's memory is: "attention" (KV cells, cut anywhere), "hybrid" (attention
    cells beside a recurrent state: Qwen3.5, LFM2, Granite 4 hybrid, Nemotron-H) or
    "recurrent" (the state alone: Mamba, RWKV)."""
    if llama_cpp.llama_model_is_hybrid(model):
        return "hybrid"
    if llama_cpp.llama_model_is_recurrent(model):
        return "recurrent"
    return "attention"


def head_size(model: int) -> int:
    """The attention heads' size (K's): the model's `attention.key_length` where it says it,
    else its width over its heads."""
    arch = meta_string(model, "general.architecture") or ""
    key_length = meta_string(model, f"{arch}.attention.key_length")
    if key_length and key_length.isdigit():
        return int(key_length)
    heads = llama_cpp.llama_model_n_head(model)
    return llama_cpp.llama_model_n_embd(model) // heads if heads > 0 else 0


def free_model(model: int) -> None:
    llama_cpp.llama_model_free(model)


def meta_string(model: int, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace")


def chat_template(model: int) -> str | None:
    raw = llama_cpp.llama_model_chat_template(model, None)
    return raw.decode("utf-8", errors="replace") if raw else None


def token_piece(vocab: int, token: int) -> bytes:
    """The bytes of one token as the model would print it (special tokens rendered)."""
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    return buf.raw[:n]


def tokenize_text(vocab: int, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode()
    capacity = len(data) + 8
    tokens = (llama_cpp.llama_token * capacity)()
    n = llama_cpp.llama_tokenize(
        vocab, data, len(data), tokens, capacity, add_special, parse_special
    )
    if n < 0:
        capacity = -n
        tokens = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(
            vocab, data, len(data), tokens, capacity, add_special, parse_special
        )
    return list(tokens[:n])


@dataclass(frozen=True)
class Bitmap:
    """An RGB image for libmtmd. rgb None is a placeholder: counted by size, never encoded.

    A sound (kind "audio": a WAV, MP3 or FLAC file; "pcm": float32 samples) is `width`
    samples long, height 1; its bytes are in `sound` (None: a placeholder of that length)."""

    width: int
    height: int
    rgb: bytes | None = None
    media_id: str | None = None
    kind: str = "image"
    sound: bytes | None = None

    @classmethod
    def of_sound(
        cls, n_samples: int, kind: str, sound: bytes | None = None, media_id: str | None = None
    ) -> Bitmap:
        return cls(n_samples, 1, None, media_id, kind, sound)

    @property
    def is_audio(self) -> bool:
        return self.kind != "image"


@dataclass(frozen=True)
class RawChunk:
    """One chunk as libmtmd produced it."""

    is_media: bool
    num_cells: int
    num_positions: int
    token_ids: tuple[int, ...] = ()


class Multimodal:
    """An mtmd context over a loaded text model. Tokenizing is thread-safe; encoding is not."""

    def __init__(self, mmproj: Path, model: int, *, n_threads: int, use_gpu: bool = False):
        if not mmproj.is_file():
            raise FileNotFoundError(f"mmproj file not found: {mmproj}")
        quiet_native_logs()
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        params.warmup = False
        ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), model, params)
        if not ctx:
            raise NativeError(f"libmtmd could not load {mmproj} (not an mmproj for this model?)")
        self.ctx = ctx
        marker = mtmd_cpp.mtmd_default_marker()
        self.marker: str = marker.decode() if isinstance(marker, bytes) else str(marker)
        self.uses_mrope = bool(mtmd_cpp.mtmd_decode_use_mrope(ctx))
        self.non_causal = bool(mtmd_cpp.mtmd_decode_use_non_causal(ctx, None))
        self.supports_vision = bool(mtmd_cpp.mtmd_support_vision(ctx))
        takes_audio = bool(mtmd_cpp.mtmd_support_audio(ctx))
        self.sample_rate = int(mtmd_cpp.mtmd_get_audio_sample_rate(ctx)) if takes_audio else 0
        # why this projector's sounds are refused ("": they are not): one its encoder would
        # abort the process on
        self.audio_refusal = audio_windows.refusal(mmproj) if takes_audio else ""
        self.supports_audio = takes_audio and not self.audio_refusal

    def close(self) -> None:
        if self.ctx:
            mtmd_cpp.mtmd_free(self.ctx)
            self.ctx = None

    @contextmanager
    def tokenize(
        self, text: str, bitmaps: Sequence[Bitmap], *, add_special: bool, parse_special: bool = True
    ) -> Iterator[NativeChunks]:
        """Tokenize text whose media markers are replaced, in order, by the bitmaps.

        Yields the native chunks; they are freed when the block ends.
        """
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        handles: list[int] = []
        try:
            for b in bitmaps:  # one by one: a bad one must not leak those made before it
                handles.append(self._make_bitmap(b))
            data = text.encode()
            inp = mtmd_cpp.mtmd_input_text(data, len(data), add_special, parse_special)
            array = (mtmd_cpp.mtmd_bitmap_p_ctypes * max(1, len(handles)))(*handles)
            rc = mtmd_cpp.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), array, len(handles))
            if rc == 1:
                raise ValueError(
                    f"the prompt has a different number of media markers ({self.marker!r}) "
                    f"than images ({len(handles)})"
                )
            if rc != 0:
                raise ValueError(f"libmtmd could not preprocess the media (mtmd_tokenize rc={rc})")
            for h in handles:
                mtmd_cpp.mtmd_bitmap_free(h)
            handles = []
            yield NativeChunks(chunks)
        finally:
            for h in handles:
                mtmd_cpp.mtmd_bitmap_free(h)
            mtmd_cpp.mtmd_input_chunks_free(chunks)

    def count(self, text: str, bitmaps: Sequence[Bitmap], *, add_special: bool) -> list[RawChunk]:
        with self.tokenize(text, bitmaps, add_special=add_special) as chunks:
            return chunks.describe()

    def media_group(self, bitmap: Bitmap) -> list[RawChunk]:
        """The chunks libmtmd makes of one medium alone: its wrapper text and media chunks."""
        placeholder = Bitmap(bitmap.width, bitmap.height, kind=bitmap.kind)
        return self.count(self.marker, [placeholder], add_special=False)

    def sound_length(self, data: bytes) -> int:
        """The samples a sound file decodes to at the projector's rate (libmtmd's decoder:
        what infer will decode it to). Check its header's length first (sounds.sound_header):
        the whole sound is decoded here."""
        handle = self._decode_sound(data, placeholder=True)
        try:
            return int(mtmd_cpp.mtmd_bitmap_get_nx(handle))
        finally:
            mtmd_cpp.mtmd_bitmap_free(handle)

    def check_audio(self) -> None:
        if not self.supports_audio:
            raise ValueError(self.audio_refusal or "this model's projector takes no audio")

    def _decode_sound(self, data: bytes, *, placeholder: bool) -> int:
        self.check_audio()
        buf = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))  # (no copy)
        handle = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), placeholder)
        if not handle:
            raise ValueError("libmtmd could not decode the sound (not a WAV, MP3 or FLAC file?)")
        if not mtmd_cpp.mtmd_bitmap_is_audio(handle):
            mtmd_cpp.mtmd_bitmap_free(handle)
            raise ValueError("the file is not a sound")
        return handle

    def _make_bitmap(self, bitmap: Bitmap) -> int:
        if not bitmap.is_audio:
            return _make_bitmap(bitmap)
        self.check_audio()
        if bitmap.width < sounds.MIN_SAMPLES:
            raise ValueError(f"a sound must have at least {sounds.MIN_SAMPLES} samples")
        if bitmap.sound is None:  # a placeholder: counted by length, never encoded
            handle = mtmd_cpp.mtmd_bitmap_init_from_audio(bitmap.width, None)
        elif bitmap.kind == "pcm":
            if len(bitmap.sound) != 4 * bitmap.width:
                raise ValueError(f"{len(bitmap.sound)} bytes of PCM are not {bitmap.width} samples")
            data = ctypes.cast(ctypes.c_char_p(bitmap.sound), ctypes.POINTER(ctypes.c_float))
            handle = mtmd_cpp.mtmd_bitmap_init_from_audio(bitmap.width, data)
        else:
            handle = self._decode_sound(bitmap.sound, placeholder=False)
            n = int(mtmd_cpp.mtmd_bitmap_get_nx(handle))
            if n != bitmap.width:
                mtmd_cpp.mtmd_bitmap_free(handle)
                raise ValueError(f"the sound decodes to {n} samples here, not {bitmap.width}")
        if not handle:
            raise NativeError("mtmd_bitmap_init_from_audio failed")
        if bitmap.media_id:
            mtmd_cpp.mtmd_bitmap_set_id(handle, bitmap.media_id.encode())
        return handle


class NativeChunks:
    """A borrowed view of an mtmd_input_chunks list."""

    def __init__(self, handle: int):
        self.handle = handle

    def __len__(self) -> int:
        return int(mtmd_cpp.mtmd_input_chunks_size(self.handle))

    def native(self, index: int) -> int:
        return mtmd_cpp.mtmd_input_chunks_get(self.handle, index)

    def describe(self) -> list[RawChunk]:
        return [describe_chunk(self.native(i)) for i in range(len(self))]


def describe_chunk(chunk: int) -> RawChunk:
    kind = mtmd_cpp.mtmd_input_chunk_get_type(chunk)
    if kind == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT:
        n = ctypes.c_size_t(0)
        ptr = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        tokens = tuple(ptr[: n.value]) if n.value else ()
        return RawChunk(False, len(tokens), len(tokens), tokens)
    return RawChunk(
        True,
        int(mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk)),
        int(mtmd_cpp.mtmd_input_chunk_get_n_pos(chunk)),
    )


def _make_bitmap(bitmap: Bitmap) -> int:
    if bitmap.width <= 0 or bitmap.height <= 0:
        raise ValueError(f"image size must be positive, got {bitmap.width}x{bitmap.height}")
    if bitmap.rgb is None:
        data = None
    else:
        if len(bitmap.rgb) != bitmap.width * bitmap.height * 3:
            raise ValueError(
                f"RGB data of a {bitmap.width}x{bitmap.height} image must be "
                f"{bitmap.width * bitmap.height * 3} bytes, got {len(bitmap.rgb)}"
            )
        # c_char_p points into the bytes object: mtmd copies from it, we don't copy twice
        data = ctypes.cast(ctypes.c_char_p(bitmap.rgb), ctypes.POINTER(ctypes.c_uint8))
    handle = mtmd_cpp.mtmd_bitmap_init(bitmap.width, bitmap.height, data)
    if not handle:
        raise NativeError("mtmd_bitmap_init failed")
    if bitmap.media_id:  # (cannot fail: the id is copied)
        mtmd_cpp.mtmd_bitmap_set_id(handle, bitmap.media_id.encode())
    return handle
