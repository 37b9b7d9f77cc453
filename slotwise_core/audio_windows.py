"""What a whisper-style audio encoder produces per window, computed twice: as libmtmd counts it
(clip_n_output_tokens, the cells a prompt is given) and as its graph computes it. Where the two
differ, llama.cpp aborts the whole process on the first encode (GGML_ABORT "Invalid number of
output tokens"): Ultravox with stack factor 8, Ultravox v0.5's setting, counts 187 and encodes
188. Such a projector's sounds are refused before anything is encoded.

Pure arithmetic over the projector's GGUF keys, read off tools/mtmd/clip.cpp (the n_patches
switch of clip_n_output_tokens, the whisper encoder graph and build_stack).
"""

from __future__ import annotations

from pathlib import Path

WINDOW_FRAMES = 3000  # the whisper preprocessor's mel frames per chunk: 30 s at a 10 ms hop
# audio_has_stack_frames and audio_has_avgpool, each alone. Voxtral does both; on paper (stack 4)
# its sums differ too, 187 and 188, but no Voxtral file was measured here: it is left to libmtmd
# rather than refused on a reading of the graph alone.
STACKING = ("ultravox", "meralion")
AVERAGING = ("qwen2a", "music_flamingo")
WHISPER = (*STACKING, *AVERAGING)


def counted(projector: str, stack: int, frames: int = WINDOW_FRAMES) -> int:
    """clip_n_output_tokens: stack first (the frames padded to the factor), then halve."""
    n = frames
    if projector in STACKING:
        n = -(-n // stack) * stack // stack
    n //= 2
    if projector in AVERAGING:
        n //= 2
    return n


def encoded(projector: str, stack: int, frames: int = WINDOW_FRAMES) -> int:
    """The graph: a stride-2 conv (kernel 3, half padding), the transformer, average pooling
    by 2, then frames stacked by the factor (the last stack padded)."""
    n = (frames + 2 - 3) // 2 + 1
    if projector in AVERAGING:
        n //= 2
    if projector in STACKING:
        n = -(-n // stack)
    return n


def mismatch(projector: str, stack: int) -> str:
    """Why this projector's encoder disagrees with its count ("": it does not, or it is not a
    whisper-style one these sums describe)."""
    if projector not in WHISPER or (projector in STACKING and stack <= 0):
        return ""
    want, got = counted(projector, stack), encoded(projector, stack)
    if want == got:
        return ""
    return (
        f"this projector ({projector}, stack factor {stack}) is refused audio: libmtmd counts "
        f"{want} embeddings per 30 s window and its encoder produces {got}, on which llama.cpp "
        "aborts the process"
    )


def refusal(mmproj: Path) -> str:
    """mismatch() for a projector file, from its GGUF keys."""
    import gguf

    reader = gguf.GGUFReader(mmproj)

    def value(key: str) -> object:
        field = reader.get_field(key)
        return field.contents() if field is not None else None

    projector = value("clip.audio.projector_type") or value("clip.projector_type")
    stack = value("clip.audio.projector.stack_factor") or 0
    return mismatch(str(projector or ""), int(stack))  # type: ignore[call-overload]
