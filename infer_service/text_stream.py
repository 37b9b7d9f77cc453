"""Generated token bytes -> text deltas that never split a UTF-8 character or leak a stop string."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # keeps the bytes of an unfinished character; invalid bytes become U+FFFD at once, so the
        # text is always what decoding all bytes in one go would give
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # decoded but not yet released: might begin a stop string
        self.stopped_by: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to release."""
        if self.stopped_by is not None:
            return ""
        self._text += self._decoder.decode(piece)
        found = [(at, s) for s in self.stop if (at := self._text.find(s)) >= 0]
        if found:
            at, self.stopped_by = min(found, key=lambda f: f[0])  # the earliest one ends the text
            out, self._text = self._text[:at], ""
            return out
        cut = max(0, len(self._text) - self._hold) if self.stop else len(self._text)
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def flush(self) -> str:
        """The end of generation: release what was held back (an unfinished character as U+FFFD)."""
        if self.stopped_by is not None:
            return ""
        out = self._text + self._decoder.decode(b"", final=True)
        self._text = ""
        return out
