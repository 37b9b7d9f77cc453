"""Checking a descriptor's promises against our own libmtmd before anything reaches llama.cpp.

An image is checked once: decoded, hashed, tokenized (libmtmd's preprocessing), its group
compared with the descriptor. What that gave is kept in `VerifiedMedia`, by a digest of the
bytes the image came in, so that an image sent again (OpenAI-style clients resend every image
of a chat every turn) costs a hash of its bytes and a comparison of counts: a turn costs the
same whether one or twenty images came before it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from llama_cpp import mtmd_cpp

from slotwise_core import native
from slotwise_core.descriptors import Fingerprint, MediaChunk, PreparedPrompt, TextChunk, content_id
from slotwise_core.images import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_TOTAL_PIXELS,
    decode_image,
    media_id,
)
from slotwise_core.lru import SizedLRU
from slotwise_core.sounds import DEFAULT_MAX_SECONDS, MAX_SOUNDS_PER_REQUEST


@dataclass(frozen=True)
class Pixels:
    """What a session keeps of a medium it holds, to decode it again: its size (a sound's: its
    samples, height 1), its hash and its kind (image, or a sound's: audio, pcm)."""

    width: int
    height: int
    media_id: str  # the content hash (several slices of one image share it)
    kind: str = "image"

    def bitmap(self, data: bytes) -> native.Bitmap:
        """The bitmap of this medium's bytes (raw RGB, or the sound's)."""
        if self.kind == "image":
            return native.Bitmap(self.width, self.height, data, self.media_id)
        return native.Bitmap.of_sound(self.width, self.kind, data, self.media_id)


class StaleDescriptorError(ValueError):
    """The descriptor was made for another model, or its counts are not what libmtmd says."""


class MediaHandle:
    """A native media chunk (preprocessed pixels), ready to encode. An owned one is freed by
    `close`; a shared one (held by `VerifiedMedia` and any number of requests and sessions)
    only once the last of them lets go of it."""

    def __init__(self, chunk: int, media_id: str, *, shared: bool = False):
        self.chunk = chunk
        self.media_id = media_id
        self.shared = shared

    def close(self) -> None:
        if self.chunk and not self.shared:
            self._free()

    def _free(self) -> None:
        if self.chunk:
            mtmd_cpp.mtmd_input_chunk_free(self.chunk)
            self.chunk = 0

    def __del__(self) -> None:
        self._free()


# What a checked image's chunks take in memory besides its RGB bytes: libmtmd's preprocessed
# float pixels, about 4 bytes per channel at about the image's size (13.7 MB measured for a
# 1000x1000 image on the qwen2vl projector).
PREPROCESSED_BYTES_PER_PIXEL = 12


@dataclass(frozen=True)
class Verified:
    """An image as this server checked it: its pixels, what libmtmd makes of them, and its
    media chunks (shared), one per slice."""

    media_id: str
    width: int
    height: int
    rgb: bytes
    group: tuple[native.RawChunk, ...]
    handles: tuple[MediaHandle, ...]

    @property
    def num_bytes(self) -> int:
        return len(self.rgb) + PREPROCESSED_BYTES_PER_PIXEL * self.width * self.height


class VerifiedMedia(SizedLRU[str, Verified]):
    """Checked images by the digest of the bytes they came in (raw pixels: by media_id, whose
    hash the descriptor's reader checked), least recently used out first, bounded in bytes;
    thread-safe. A request must hold the image's bytes to use an entry: the cache tells nobody
    what another request sent. The chunks of an entry that goes live on while requests or
    sessions hold them."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, lambda verified: verified.num_bytes)


def sound_id(sound: MediaChunk) -> str:
    return content_id(sound.kind, sound.width, sound.height, sound.audio or sound.pcm)


def image_key(image: MediaChunk) -> str:
    if image.is_audio:  # (its media_id is the hash of the bytes it came in: verify_prompt's)
        return f"{image.kind}:{image.media_id}"
    if not image.encoded:
        return f"rgb:{image.media_id}"
    digest = hashlib.blake2b(image.encoded, digest_size=16).hexdigest()
    return f"{digest}:{image.width}x{image.height}"


@dataclass(frozen=True)
class MediaLimits:
    ubatch_size: int
    non_causal: bool
    # what a descriptor may claim (a small file can decode to a huge image): per image, and
    # for all the images of one request together, checked before anything is decoded
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS
    # a sound's samples, and all of one request's together (--max-audio-seconds)
    max_samples: int = round(DEFAULT_MAX_SECONDS * 16_000)

    @property
    def max_total_samples(self) -> int:
        return MAX_SOUNDS_PER_REQUEST * self.max_samples


def verify_prompt(
    prompt: PreparedPrompt,
    *,
    fingerprint: Fingerprint,
    mtmd: native.Multimodal | None,
    limits: MediaLimits,
    cache: VerifiedMedia | None = None,
    scope: str = "",
) -> tuple[dict[str, MediaHandle], dict[str, bytes]]:
    """Verify fingerprint and every media group; return native media chunks by media key,
    and the pixels of each image by media_id.

    An encoded image is decoded here (once) with the code prep decoded it with, and must hash
    to its media_id. Each image is tokenized again from its pixels; its group (wrapper text +
    media) must match the descriptor chunk for chunk, cell for cell, position for position.
    An image in `cache` (the same bytes, sent within the same `scope`: a tenant and its
    salt) is not decoded or tokenized again: its group is compared with the one libmtmd made
    of it then. Another scope's entry is never used: how fast a check went would tell a
    tenant that someone else sent the image.
    """
    if prompt.fingerprint != fingerprint:
        raise StaleDescriptorError(
            f"prompt was prepared for model {prompt.fingerprint.model[:12]}/"
            f"{prompt.fingerprint.mmproj[:12] or '-'} but this server runs "
            f"{fingerprint.model[:12]}/{fingerprint.mmproj[:12] or '-'}"
        )
    handles: dict[str, MediaHandle] = {}
    pixels: dict[str, bytes] = {}
    groups = [
        (g, list(chunks))
        for g, chunks in itertools.groupby(prompt.chunks, key=lambda c: c.media_group)
        if g
    ]
    if groups and mtmd is None:
        raise StaleDescriptorError("prompt has media but this server runs a text-only model")
    _check_sizes(prompt, limits)
    try:
        for group, chunks in groups:
            media = [c for c in chunks if isinstance(c, MediaChunk)]
            if not media:
                raise ValueError(f"media group {group} has no media chunk")
            first = (media[0].media_id, media[0].width, media[0].height)
            for m in media:
                if (m.media_id, m.width, m.height) != first:
                    raise ValueError(f"media group {group} holds chunks of more than one image")
                if limits.non_causal and not m.is_audio and m.num_cells > limits.ubatch_size:
                    raise ValueError(
                        f"media {m.media_id[:12]} has {m.num_cells} cells; this projector "
                        f"attends non-causally so it must fit one ubatch: start the server "
                        f"with --ubatch-size >= {m.num_cells} (now {limits.ubatch_size})"
                    )
            assert mtmd is not None
            image = media[0]
            if image.is_audio and not mtmd.supports_audio:
                raise StaleDescriptorError(
                    mtmd.audio_refusal or "this server's projector takes no audio"
                )
            if image.is_audio and sound_id(image) != image.media_id:  # (hashed here, off the loop)
                raise StaleDescriptorError(
                    f"sound {image.media_id[:12]}: media_id is not the hash of its bytes"
                )
            key = f"{scope}\0{image_key(image)}"
            verified = cache.get(key) if cache is not None else None
            if verified is None or verified.media_id != image.media_id:
                seen = pixels.get(image.media_id)  # (another group's: its bytes decoded)
                verified = _verify_image(mtmd, image, seen)
                if cache is not None and seen is None:  # only bytes that were decoded here
                    cache.put(key, verified)
            pixels[image.media_id] = verified.rgb
            _check_group(group, chunks, verified, handles)
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    return handles, pixels


def _check_sizes(prompt: PreparedPrompt, limits: MediaLimits) -> None:
    """Every chunk of one medium names one size; no image or sound, and not all of them
    together, is larger than the limits allow (nothing is decoded yet)."""
    sizes: dict[str, tuple[int, int]] = {}
    samples: dict[str, int] = {}
    for m in prompt.media:
        size = sizes.setdefault(m.media_id, (m.width, m.height))
        if m.is_audio:
            samples[m.media_id] = m.width
        if size != (m.width, m.height):
            raise ValueError(
                f"media {m.media_id[:12]} is {size[0]}x{size[1]} in one chunk and "
                f"{m.width}x{m.height} in another"
            )
        if m.is_audio and m.width > limits.max_samples:
            raise ValueError(
                f"sound {m.media_id[:12]} is {m.width} samples, over {limits.max_samples}"
            )
        if not m.is_audio and m.width * m.height > limits.max_pixels:
            raise ValueError(
                f"media {m.media_id[:12]} is {m.width}x{m.height}, over {limits.max_pixels} pixels"
            )
    if sum(samples.values()) > limits.max_total_samples:
        raise ValueError(
            f"the sounds of this prompt have {sum(samples.values())} samples together, over "
            f"{limits.max_total_samples}"
        )
    total = sum(w * h for m, (w, h) in sizes.items() if m not in samples)
    if total > limits.max_total_pixels:
        raise ValueError(
            f"the images of this prompt have {total} pixels together, over "
            f"{limits.max_total_pixels}"
        )


def _pixels_of(image: MediaChunk) -> bytes:
    if not image.encoded:
        return image.rgb  # (its hash was checked when the descriptor was read)
    try:
        decoded = decode_image(image.encoded, max_pixels=image.width * image.height)
    except Exception as e:  # whatever the decoder says about it: not the promised image
        raise StaleDescriptorError(f"media {image.media_id[:12]}: {e}") from None
    got = media_id(decoded.width, decoded.height, decoded.rgb)
    if got != image.media_id or (decoded.width, decoded.height) != (image.width, image.height):
        raise StaleDescriptorError(
            f"media {image.media_id[:12]}: the image decodes here to other pixels "
            f"({decoded.width}x{decoded.height}, {got[:12]}): another decoder, or tampered"
        )
    return decoded.rgb


def _verify_image(mtmd: native.Multimodal, image: MediaChunk, rgb: bytes | None) -> Verified:
    """Decode (unless its pixels are at hand) and tokenize an image (or a sound: libmtmd
    decodes it to the samples it must have): what libmtmd makes of it, its media chunks
    shared."""
    if image.is_audio:
        rgb = image.audio or image.pcm  # (their hash was checked in verify_prompt)
        bitmap = native.Bitmap.of_sound(image.width, image.kind, rgb, image.media_id)
    else:
        rgb = rgb if rgb is not None else _pixels_of(image)
        bitmap = native.Bitmap(image.width, image.height, rgb, image.media_id)
    try:
        return _tokenized(mtmd, image, bitmap, rgb)
    except ValueError as e:  # libmtmd's decoder, or a length that is not the descriptor's
        if not image.is_audio:
            raise
        raise StaleDescriptorError(f"sound {image.media_id[:12]}: {e}") from None


def _tokenized(
    mtmd: native.Multimodal, image: MediaChunk, bitmap: native.Bitmap, rgb: bytes
) -> Verified:
    with mtmd.tokenize(mtmd.marker, [bitmap], add_special=False) as ours:
        group = ours.describe()
        handles = tuple(
            MediaHandle(mtmd_cpp.mtmd_input_chunk_copy(ours.native(i)), image.media_id,
                        shared=True)
            for i, c in enumerate(group)
            if c.is_media
        )  # fmt: skip
    return Verified(image.media_id, image.width, image.height, rgb, tuple(group), handles)


def _check_group(
    group: int,
    chunks: Sequence[TextChunk | MediaChunk],
    verified: Verified,
    handles: dict[str, MediaHandle],
) -> None:
    """The descriptor's chunks of one image against what libmtmd made of it."""
    raw = verified.group
    if len(raw) != len(chunks):
        raise StaleDescriptorError(
            f"media group {group}: libmtmd makes {len(raw)} chunks of this image, "
            f"the descriptor has {len(chunks)}"
        )
    slices = 0
    for i, (mine, theirs) in enumerate(zip(raw, chunks, strict=True)):
        if isinstance(theirs, TextChunk):
            if mine.is_media or mine.token_ids != theirs.token_ids:
                raise StaleDescriptorError(
                    f"media group {group} chunk {i}: wrapper tokens differ from libmtmd's"
                )
            continue
        if not mine.is_media or (mine.num_cells, mine.num_positions) != (
            theirs.num_cells,
            theirs.num_positions,
        ):
            raise StaleDescriptorError(
                f"media {theirs.media_id[:12]}: descriptor says {theirs.num_cells} cells / "
                f"{theirs.num_positions} positions, libmtmd says {mine.num_cells} / "
                f"{mine.num_positions}"
            )
        key = media_key(theirs.media_id, slices)
        handles.setdefault(key, verified.handles[slices])
        slices += 1


def media_key(media_id: str, slice_index: int) -> str:
    """Which media chunk of an image: tiling projectors make several of one image."""
    return media_id if slice_index == 0 else f"{media_id}:{slice_index}"


def media_handle(mtmd: native.Multimodal, key: str, bitmap: native.Bitmap) -> MediaHandle:
    """The native media chunk `key` names (its slice of the image), tokenized from pixels."""
    slice_index = int(key.rpartition(":")[2]) if ":" in key else 0
    with mtmd.tokenize(mtmd.marker, [bitmap], add_special=False) as chunks:
        media = [i for i, c in enumerate(chunks.describe()) if c.is_media]
        return MediaHandle(mtmd_cpp.mtmd_input_chunk_copy(chunks.native(media[slice_index])), key)
