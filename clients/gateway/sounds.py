"""Sounds the APIs carry: OpenAI's `input_audio` parts (Chat Completions; the Responses API
takes the same part), and llama-server's `multimodal_data` items, which may be images or sounds.

A sound is a WAV, MP3 or FLAC file, sent base64. It is told from an image by its signature, as
libmtmd's own decoder tells them (llama-server reads the bytes, not a declared format): RIFF ....
WAVE, fLaC, ID3 or an MPEG frame sync. A part's `format` must name one of the three, but the
bytes decide which one it is, so a .wav labelled "mp3" is served (loosely, as llama-server does);
bytes that are none of them are refused, naming the part's `data`. Its size is bounded before it
is decoded (MediaPolicy.max_audio_bytes, --max-audio-mb: per sound). Its length, and whether the
model takes sounds at all, is prep's to say (OUT_OF_RANGE past --max-audio-seconds, and
FAILED_PRECONDITION for a projector without audio: both a 400 in every API's shape).

The signature test is slotwise_core.sounds' (prep's); what measures a sound there (miniaudio)
is imported only where a sound is measured, never by the gateway's install.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

import slotwise_core.sounds
from clients.gateway.errors import ApiError, bad_request
from clients.gateway.media import MediaPolicy
from clients.types import Audio

__all__ = ["FORMATS", "audio_part", "b64_bytes", "multimodal_item", "sound_format"]

FORMATS = ("wav", "mp3", "flac")  # what an input_audio part's `format` may say


def sound_format(data: bytes) -> str:
    """wav, mp3 or flac by the file's signature (libmtmd's test); "" for anything else."""
    return slotwise_core.sounds.sound_format(data).lower()


def b64_bytes(
    text: Any, limit: int, what: str, fail: Callable[[str], ApiError] = bad_request
) -> bytes:
    """Base64 text -> bytes, at most `limit` of them (refused before decoding); `fail` words
    the refusal as the API does (`what` names the field)."""
    if not isinstance(text, str):
        raise fail(f"{what}: give the file's bytes as a base64 string")
    if len(text) > limit * 4 // 3 + 4:
        raise fail(f"{what}: over {limit} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise fail(f"{what}: not valid base64") from None


def audio_part(data: Any, fmt: Any, media: MediaPolicy, where: str) -> Audio:
    """An input_audio part's {data, format} (`where`: the part's input_audio, dotted) -> the
    sound, or a 400 naming the field at fault."""
    if fmt not in FORMATS:
        param = f"{where}.format"
        raise bad_request(f"{param}: {fmt!r} is not one of {', '.join(FORMATS)}", param)
    param = f"{where}.data"
    raw = b64_bytes(
        data, media.max_audio_bytes, param, lambda m: bad_request(_limit_named(m), param)
    )
    if not sound_format(raw):
        raise bad_request(f"{param}: not a WAV, MP3 or FLAC file (format says {fmt})", param)
    return Audio(raw)


def multimodal_item(data: Any, media: MediaPolicy, k: int) -> bytes | Audio:
    """The k-th of a /completion's multimodal_data (base64, in the order of the prompt's
    markers): a sound when its bytes say so, else an image's bytes (prep names one that is
    neither). Each kind is held to its own size limit."""
    where = f"multimodal_data.{k}"
    if not isinstance(data, str):
        raise bad_request('"multimodal_data" must be an array of base64 strings', where)
    limit = max(media.max_bytes, media.max_audio_bytes)  # (the kind is known once decoded)
    raw = b64_bytes(data, limit, where, lambda m: bad_request(m, where))
    if sound_format(raw):
        if len(raw) > media.max_audio_bytes:
            raise bad_request(f"{where}: a sound over {media.max_audio_bytes} bytes", where)
        return Audio(raw)
    if len(raw) > media.max_bytes:
        raise bad_request(f"{where}: an image over {media.max_bytes} bytes", where)
    return raw


def _limit_named(message: str) -> str:
    return f"{message} (--max-audio-mb)" if "bytes" in message else message
