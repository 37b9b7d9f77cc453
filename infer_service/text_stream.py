"""Generated token bytes -> text deltas that never split a UTF-8 character or leak a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._bytes = b""  # undecoded tail: an unfinished UTF-8 character
        self._text = ""  # decoded but not yet released: might begin a stop string
        self.stopped_by: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to release."""
        if self.stopped_by is not None:
            return ""
        self._bytes += piece
        text, self._bytes = _decode_prefix(self._bytes)
        self._text += text
        for s in self.stop:
            at = self._text.find(s)
            if at >= 0:
                self.stopped_by = s
                out, self._text = self._text[:at], ""
                return out
        cut = max(0, len(self._text) - self._hold) if self.stop else len(self._text)
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def flush(self) -> str:
        """The end of generation: release what was held back (invalid bytes as U+FFFD)."""
        if self.stopped_by is not None:
            return ""
        out = self._text + self._bytes.decode("utf-8", errors="replace")
        self._text, self._bytes = "", b""
        return out


def _decode_prefix(data: bytes) -> tuple[str, bytes]:
    """Decode the longest prefix that does not end inside a multi-byte character."""
    for keep in range(min(3, len(data)) + 1):
        end = len(data) - keep
        try:
            return data[:end].decode("utf-8"), data[end:]
        except UnicodeDecodeError as e:
            if e.start < end - 3:  # broken in the middle, not at the tail: replace it
                return data.decode("utf-8", errors="replace"), b""
    return data.decode("utf-8", errors="replace"), b""
