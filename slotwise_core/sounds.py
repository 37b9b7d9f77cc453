"""Sound files -> what prep and infer need of them before libmtmd decodes them: their format,
their length from the header alone, their content hash.

libmtmd decodes WAV, MP3 and FLAC (miniaudio inside, resampled to the projector's rate). A
compressed file can decode to far more samples than its size suggests (minutes of silence in a
few kilobytes of FLAC), so a sound is measured from its header first and refused when it is
longer than the limit, before anything is decoded. The measuring is the miniaudio package's
(the same library libmtmd embeds).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

FORMATS = ("WAV", "MP3", "FLAC")
DEFAULT_MAX_SECONDS = 600.0  # one sound; longer ones are refused, never decoded
MAX_SOUNDS_PER_REQUEST = 4  # one request's sounds together: this many times the longest
MIN_SAMPLES = 2  # libmtmd asserts (aborts) on a sound of fewer


class AudioError(ValueError):
    """A sound that cannot be used, with a message naming what is wrong."""


class AudioTooLongError(AudioError):
    """A sound over the length limit (OUT_OF_RANGE rather than INVALID_ARGUMENT)."""


def audio_id(data: bytes) -> str:
    """Content hash of a sound file as it came (what the descriptor's media_id is)."""
    return _hash(b"audio:", data)


def pcm_id(pcm: bytes) -> str:
    """Content hash of float32 samples."""
    return _hash(b"pcm:", pcm)


def _hash(prefix: bytes, data: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(prefix)
    h.update(data)
    return h.hexdigest()


def sound_format(data: bytes) -> str:
    """WAV, MP3 or FLAC, by the signature libmtmd looks for ("": none of them). (A JPEG
    begins FF D8: D8 lacks the MPEG sync's three high bits.)"""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"
    return ""


def is_sound(data: bytes) -> bool:
    return bool(sound_format(data))


@dataclass(frozen=True)
class SoundHeader:
    format: str
    sample_rate: int
    channels: int
    num_frames: int

    @property
    def seconds(self) -> float:
        return self.num_frames / self.sample_rate if self.sample_rate else 0.0


def sound_header(data: bytes, *, max_seconds: float = DEFAULT_MAX_SECONDS) -> SoundHeader:
    """The file's format and length, nothing decoded; refused when it is not a sound libmtmd
    reads, or longer than max_seconds."""
    if not data:
        raise AudioError("sound is empty (0 bytes)")
    fmt = sound_format(data)
    if not fmt:
        raise AudioError("not a WAV, MP3 or FLAC file")
    import miniaudio  # (the serve extra's: the client's install tells formats, never decodes)

    info_of = {"WAV": miniaudio.wav_get_info, "MP3": miniaudio.mp3_get_info}
    try:
        info = info_of.get(fmt, miniaudio.flac_get_info)(data)
    except Exception as e:  # miniaudio's DecodeError and whatever a damaged header raises
        raise AudioError(f"{fmt} file is truncated or corrupt: {e}") from None
    header = SoundHeader(fmt, int(info.sample_rate), int(info.nchannels), int(info.num_frames))
    if header.num_frames <= 0 or header.sample_rate <= 0:
        raise AudioError(f"{fmt} file holds no samples")
    check_seconds(header.seconds, max_seconds)
    return header


def check_seconds(seconds: float, max_seconds: float) -> None:
    if seconds > max_seconds:
        raise AudioTooLongError(
            f"sound is {seconds:.1f} s long, over the limit of {max_seconds:g} s"
        )


def check_pcm(pcm: bytes, sample_rate: int, max_seconds: float) -> int:
    """The number of samples of float32 PCM; refused when malformed, too short or too long."""
    if len(pcm) % 4:
        raise AudioError(f"float32 PCM must be a multiple of 4 bytes, got {len(pcm)}")
    n = len(pcm) // 4
    if n < MIN_SAMPLES:
        raise AudioError(f"sound has {n} samples; at least {MIN_SAMPLES} are needed")
    check_seconds(n / sample_rate, max_seconds)
    return n
