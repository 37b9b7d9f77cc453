"""What we can know about a model pair from its files alone: identity and embedding sizes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from slotwise_core.descriptors import Fingerprint

_HEAD = 16 << 20
_TAIL = 1 << 20


class ModelMismatchError(ValueError):
    """The projector does not belong to the text model."""


def file_digest(path: Path) -> str:
    """A stable identity of a GGUF file that costs milliseconds, not a pass over gigabytes.

    Size, the first 16 MiB (all metadata, the tokenizer and the first tensors) and the last MiB:
    two different models do not agree on all three.
    """
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    h = hashlib.blake2b(digest_size=16)
    size = os.path.getsize(path)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(_HEAD))
        if size > _HEAD:
            f.seek(max(_HEAD, size - _TAIL))
            h.update(f.read(_TAIL))
    return h.hexdigest()


def fingerprint(model: Path, mmproj: Path | None) -> Fingerprint:
    return Fingerprint(file_digest(model), file_digest(mmproj) if mmproj else "")


def check_embedding_sizes(model: Path, mmproj: Path) -> None:
    """Refuse a projector whose output size differs from the text model's embedding size.

    llama.cpp checks this only when the text model has weights; prep loads it vocab-only.
    """
    from gguf import GGUFReader  # numpy-heavy: imported only where needed

    text = GGUFReader(model)
    arch = _field(text, "general.architecture")
    n_embd = _field(text, f"{arch}.embedding_length")
    proj = GGUFReader(mmproj)
    n_proj = _field(proj, "clip.vision.projection_dim")
    if n_proj is None:  # an audio tower alone (Ultravox, Qwen2-Audio)
        n_proj = _field(proj, "clip.audio.projection_dim")
    if n_proj is None:
        n_proj = _projector_output_from_tensors(proj)
    if n_embd is None or n_proj is None:
        return  # nothing to compare with; libmtmd's own check runs in infer_service
    if int(n_embd) != int(n_proj):
        raise ModelMismatchError(
            f"{mmproj.name} projects to {n_proj}-dim embeddings but {model.name} ({arch}) "
            f"takes {n_embd}: this mmproj belongs to another model"
        )


def _field(reader: object, key: str) -> str | int | None:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str | int) else None


def _projector_output_from_tensors(reader: object) -> int | None:
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}  # type: ignore[attr-defined]
    for name in ("mm.2.weight", "mm.model.fc.weight", "mm.input_projection.weight"):
        if name in shapes:
            return shapes[name][-1] if name != "mm.input_projection.weight" else shapes[name][0]
    return None
