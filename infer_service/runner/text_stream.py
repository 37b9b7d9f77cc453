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


# the bytes that may follow each lead byte, one range per continuation byte (RFC 3629, table 3)
_TAIL = (0x80, 0xBF)
_UTF8_LEADS: dict[int, tuple[tuple[int, int], ...]] = {
    **{b: () for b in range(0x00, 0x80)},
    **{b: (_TAIL,) for b in range(0xC2, 0xE0)},
    0xE0: ((0xA0, 0xBF), _TAIL),
    **{b: (_TAIL, _TAIL) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)},
    0xED: ((0x80, 0x9F), _TAIL),
    0xF0: ((0x90, 0xBF), _TAIL, _TAIL),
    **{b: (_TAIL, _TAIL, _TAIL) for b in range(0xF1, 0xF4)},
    0xF4: ((0x80, 0x8F), _TAIL, _TAIL),
}


def utf8_tail(tail: bytes, piece: bytes) -> bytes | None:
    """`tail` (the unfinished character so far, maybe empty) followed by `piece`: the new
    unfinished character, or None when the bytes can no longer be well-formed UTF-8 (a byte
    no character can start with, an overlong form, a surrogate, a code point past U+10FFFF)."""
    pending = tail
    for b in piece:
        if not pending:
            if b not in _UTF8_LEADS:
                return None
            if _UTF8_LEADS[b]:
                pending = bytes((b,))
            continue
        lo, hi = _UTF8_LEADS[pending[0]][len(pending) - 1]
        if not lo <= b <= hi:
            return None
        pending += bytes((b,))
        if len(pending) == 1 + len(_UTF8_LEADS[pending[0]]):
            pending = b""
    return pending
