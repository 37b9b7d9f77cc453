"""Checking a descriptor's promises against our own libmtmd before anything reaches llama.cpp."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llama_cpp import mtmd_cpp

from slotwise_core import native
from slotwise_core.descriptors import Fingerprint, MediaChunk, PreparedPrompt, TextChunk
from slotwise_core.images import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_TOTAL_PIXELS,
    decode_image,
    media_id,
)


class StaleDescriptorError(ValueError):
    """The descriptor was made for another model, or its counts are not what libmtmd says."""


class MediaHandle:
    """An owned native media chunk (preprocessed pixels), ready to encode."""

    def __init__(self, chunk: int, media_id: str):
        self.chunk = chunk
        self.media_id = media_id

    def close(self) -> None:
        if self.chunk:
            mtmd_cpp.mtmd_input_chunk_free(self.chunk)
            self.chunk = 0

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class MediaLimits:
    ubatch_size: int
    non_causal: bool
    # what a descriptor may claim (a small file can decode to a huge image): per image, and
    # for all the images of one request together, checked before anything is decoded
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS


def verify_prompt(
    prompt: PreparedPrompt,
    *,
    fingerprint: Fingerprint,
    mtmd: native.Multimodal | None,
    limits: MediaLimits,
) -> tuple[dict[str, MediaHandle], dict[str, bytes]]:
    """Verify fingerprint and every media group; return native media chunks by media key,
    and the pixels of each image by media_id.

    An encoded image is decoded here (once) with the code prep decoded it with, and must hash
    to its media_id. Each image is tokenized again from its pixels; its group (wrapper text +
    media) must match the descriptor chunk for chunk, cell for cell, position for position.
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
                if limits.non_causal and m.num_cells > limits.ubatch_size:
                    raise ValueError(
                        f"media {m.media_id[:12]} has {m.num_cells} cells; this projector "
                        f"attends non-causally so it must fit one ubatch: start the server "
                        f"with --ubatch-size >= {m.num_cells} (now {limits.ubatch_size})"
                    )
            assert mtmd is not None
            rgb = pixels.get(media[0].media_id) or _pixels_of(media[0])
            pixels[media[0].media_id] = rgb
            _verify_group(mtmd, group, chunks, media[0], rgb, handles)
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    return handles, pixels


def _check_sizes(prompt: PreparedPrompt, limits: MediaLimits) -> None:
    """Every chunk of one image names one size; no image, and not all of them together, has
    more pixels than the limits allow (nothing is decoded yet)."""
    sizes: dict[str, tuple[int, int]] = {}
    for m in prompt.media:
        size = sizes.setdefault(m.media_id, (m.width, m.height))
        if size != (m.width, m.height):
            raise ValueError(
                f"media {m.media_id[:12]} is {size[0]}x{size[1]} in one chunk and "
                f"{m.width}x{m.height} in another"
            )
        if m.width * m.height > limits.max_pixels:
            raise ValueError(
                f"media {m.media_id[:12]} is {m.width}x{m.height}, over {limits.max_pixels} pixels"
            )
    total = sum(w * h for w, h in sizes.values())
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


def _verify_group(
    mtmd: native.Multimodal,
    group: int,
    chunks: list[TextChunk | MediaChunk],
    image: MediaChunk,
    rgb: bytes,
    handles: dict[str, MediaHandle],
) -> None:
    bitmap = native.Bitmap(image.width, image.height, rgb, image.media_id)
    with mtmd.tokenize(mtmd.marker, [bitmap], add_special=False) as ours:
        raw = ours.describe()
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
            if (mine.num_cells, mine.num_positions) != (theirs.num_cells, theirs.num_positions):
                raise StaleDescriptorError(
                    f"media {theirs.media_id[:12]}: descriptor says {theirs.num_cells} cells / "
                    f"{theirs.num_positions} positions, libmtmd says {mine.num_cells} / "
                    f"{mine.num_positions}"
                )
            key = media_key(theirs.media_id, slices)
            slices += 1
            if key not in handles:
                handles[key] = MediaHandle(mtmd_cpp.mtmd_input_chunk_copy(ours.native(i)), key)


def media_key(media_id: str, slice_index: int) -> str:
    """Which media chunk of an image: tiling projectors make several of one image."""
    return media_id if slice_index == 0 else f"{media_id}:{slice_index}"


def media_handle(mtmd: native.Multimodal, key: str, bitmap: native.Bitmap) -> MediaHandle:
    """The native media chunk `key` names (its slice of the image), tokenized from pixels."""
    slice_index = int(key.rpartition(":")[2]) if ":" in key else 0
    with mtmd.tokenize(mtmd.marker, [bitmap], add_special=False) as chunks:
        media = [i for i, c in enumerate(chunks.describe()) if c.is_media]
        return MediaHandle(mtmd_cpp.mtmd_input_chunk_copy(chunks.native(media[slice_index])), key)
