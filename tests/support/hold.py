"""Test hooks on a real engine: hold its thread at a chosen llama_decode."""

from __future__ import annotations

import threading
from typing import Any

from support.wait import PATIENCE

__all__ = ["PrefillHold"]


class PrefillHold:
    """Holds the engine thread inside the `at`-th text llama_decode from now until released: a
    prefill that is provably under way, however fast or slow the machine."""

    def __init__(self, rt: Any, at: int):
        self.runtime, self.at, self.num_decodes = rt, at, 0
        self.held, self.released = threading.Event(), threading.Event()

    def _decode(self) -> int:
        self.num_decodes += 1
        if self.num_decodes == self.at:
            self.held.set()
            self.released.wait(PATIENCE)
        return type(self.runtime).decode(self.runtime)

    def __enter__(self) -> PrefillHold:
        self.runtime.decode = self._decode
        return self

    def __exit__(self, *_: object) -> None:
        self.released.set()
        del self.runtime.decode  # back to the class's method
