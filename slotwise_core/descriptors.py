"""The contract's domain side: prepared prompts as plain dataclasses, converted only at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from slotwise.v1 import prompt_pb2
from slotwise_core.images import media_id
from slotwise_core.sounds import audio_id, pcm_id


class DescriptorError(ValueError):
    """A PreparedPrompt that is malformed (it can never work, whatever the model)."""


def memory_kind_pb(kind: str) -> int:
    """A model's memory kind ("attention", "hybrid", "recurrent") as the contract's enum."""
    return int(prompt_pb2.MemoryKind.Value(f"MEMORY_KIND_{kind.upper()}"))


def content_id(kind: str, width: int, height: int, data: bytes) -> str:
    """The media_id of a medium's bytes: an image's raw RGB pixels, a sound's file ("audio")
    or its float32 samples ("pcm")."""
    if kind == "audio":
        return audio_id(data)
    if kind == "pcm":
        return pcm_id(data)
    return media_id(width, height, data)


@dataclass(frozen=True)
class Fingerprint:
    model: str
    mmproj: str = ""

    def to_pb(self) -> prompt_pb2.Fingerprint:
        return prompt_pb2.Fingerprint(model=self.model, mmproj=self.mmproj)

    @classmethod
    def from_pb(cls, pb: prompt_pb2.Fingerprint) -> Fingerprint:
        return cls(pb.model, pb.mmproj)


@dataclass(frozen=True)
class TextChunk:
    token_ids: tuple[int, ...]
    message_index: int = 0
    media_group: int = 0

    @property
    def num_cells(self) -> int:
        return len(self.token_ids)

    @property
    def num_positions(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, repr=False)
class MediaChunk:
    media_id: str
    num_cells: int
    num_positions: int
    width: int
    height: int
    rgb: bytes  # the pixels, or b"" while they travel encoded
    message_index: int = 0
    media_group: int = 0
    encoded: bytes = b""  # an image file that decodes to exactly the pixels (see prompt.proto)
    # "image"; or a sound (width: its samples, height 1), "audio": its file as it came, in
    # `audio`, or "pcm": its float32 samples, in `pcm` (empty both: counted, not prepared)
    kind: str = "image"
    audio: bytes = b""
    pcm: bytes = b""

    @property
    def is_audio(self) -> bool:
        return self.kind != "image"

    def __repr__(self) -> str:  # never print pixels
        size = f"{self.width} samples" if self.is_audio else f"{self.width}x{self.height}"
        return (
            f"MediaChunk({self.media_id[:12]}, {size}, "
            f"cells={self.num_cells}, positions={self.num_positions}, "
            f"message={self.message_index}, group={self.media_group})"
        )


Chunk = TextChunk | MediaChunk


@dataclass(frozen=True)
class PreparedPrompt:
    fingerprint: Fingerprint
    chunks: tuple[Chunk, ...]

    @property
    def num_cells(self) -> int:
        return sum(c.num_cells for c in self.chunks)

    @property
    def num_positions(self) -> int:
        return sum(c.num_positions for c in self.chunks)

    @property
    def media(self) -> list[MediaChunk]:
        return [c for c in self.chunks if isinstance(c, MediaChunk)]

    def to_pb(self) -> prompt_pb2.PreparedPrompt:
        return prompt_pb2.PreparedPrompt(
            fingerprint=self.fingerprint.to_pb(),
            chunks=[_chunk_to_pb(c) for c in self.chunks],
            num_cells=self.num_cells,
            num_positions=self.num_positions,
        )

    @classmethod
    def from_pb(cls, pb: prompt_pb2.PreparedPrompt) -> PreparedPrompt:
        """Read a descriptor, checking everything that can be checked without the model."""
        if not pb.chunks:
            raise DescriptorError("prompt has no chunks")
        prompt = cls(Fingerprint.from_pb(pb.fingerprint), tuple(map(_chunk_from_pb, pb.chunks)))
        if (pb.num_cells, pb.num_positions) != (prompt.num_cells, prompt.num_positions):
            raise DescriptorError(
                f"prompt totals say {pb.num_cells} cells / {pb.num_positions} positions but its "
                f"chunks add up to {prompt.num_cells} / {prompt.num_positions}"
            )
        return prompt


def _chunk_to_pb(chunk: Chunk) -> prompt_pb2.Chunk:
    pb = prompt_pb2.Chunk(message_index=chunk.message_index, media_group=chunk.media_group)
    if isinstance(chunk, TextChunk):
        pb.text.token_ids.extend(chunk.token_ids)
    else:
        media = prompt_pb2.MediaChunk(
            media_id=chunk.media_id,
            num_cells=chunk.num_cells,
            num_positions=chunk.num_positions,
            width=chunk.width,
            height=chunk.height,
        )
        if chunk.audio:
            media.audio = chunk.audio
        elif chunk.pcm:
            media.pcm = chunk.pcm
        elif chunk.encoded:  # the compressed form travels when there is one
            media.encoded = chunk.encoded
        else:
            media.rgb = chunk.rgb
        pb.media.CopyFrom(media)
    return pb


def _chunk_from_pb(pb: prompt_pb2.Chunk) -> Chunk:
    kind = pb.WhichOneof("kind")
    if kind == "text":
        if not pb.text.token_ids:
            raise DescriptorError("a text chunk has no tokens")
        return TextChunk(tuple(pb.text.token_ids), pb.message_index, pb.media_group)
    if kind != "media":
        raise DescriptorError("a chunk has neither text nor media")
    m = pb.media
    if pb.media_group == 0:
        raise DescriptorError(f"media chunk {m.media_id!r} has no media_group")
    if m.num_cells == 0 or m.num_positions == 0:
        raise DescriptorError(f"media chunk {m.media_id!r} has zero cells or positions")
    if m.width == 0 or m.height == 0:
        raise DescriptorError(f"media chunk {m.media_id!r} has no size")
    source = m.WhichOneof("pixels")
    if source in ("audio", "pcm"):
        return _sound_from_pb(pb, source)
    if source == "encoded":
        # decoded (off the event loop) and checked against media_id by infer's verification
        return MediaChunk(
            m.media_id, m.num_cells, m.num_positions, m.width, m.height, b"",
            pb.message_index, pb.media_group, m.encoded,
        )  # fmt: skip
    if len(m.rgb) != m.width * m.height * 3:
        raise DescriptorError(
            f"media chunk {m.media_id!r}: {len(m.rgb)} bytes of RGB do not make a "
            f"{m.width}x{m.height} image"
        )
    if media_id(m.width, m.height, m.rgb) != m.media_id:
        raise DescriptorError(f"media chunk {m.media_id!r}: media_id is not the hash of its pixels")
    return MediaChunk(
        m.media_id, m.num_cells, m.num_positions, m.width, m.height, m.rgb,
        pb.message_index, pb.media_group,
    )  # fmt: skip


def _sound_from_pb(pb: prompt_pb2.Chunk, source: str) -> MediaChunk:
    m = pb.media
    if m.height != 1:
        raise DescriptorError(f"media chunk {m.media_id!r}: a sound's height is 1, not {m.height}")
    data = m.audio if source == "audio" else m.pcm
    if source == "pcm" and len(data) != 4 * m.width:
        raise DescriptorError(
            f"media chunk {m.media_id!r}: {len(data)} bytes of float32 PCM are not "
            f"{m.width} samples"
        )
    # (its hash, and a file's length, are checked by infer's verification, off the event loop)
    return MediaChunk(
        m.media_id, m.num_cells, m.num_positions, m.width, 1, b"", pb.message_index,
        pb.media_group, kind=source, audio=data if source == "audio" else b"",
        pcm=data if source == "pcm" else b"",
    )  # fmt: skip
