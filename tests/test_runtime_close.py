"""The runtime is never freed under a thread that uses it off the engine thread (a prompt's
verification that a handler cancelled at shutdown left running): close waits for it, and a
use that begins after close began is refused."""

from __future__ import annotations

import threading

import pytest

from infer_service.runner.runtime import Runtime, RuntimeConfig
from slotwise_core.native import NativeError
from slotwise_core.tiny_models import TinyPair
from support.wait import wait_until


def test_close_waits_for_a_borrower_and_refuses_new_ones(tiny: dict[str, TinyPair]) -> None:
    pair = tiny["mrope"]
    rt = Runtime(RuntimeConfig(pair.model, pair.mmproj, ctx_size=256, threads=1))
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def verification() -> None:
        with rt.borrowed():
            inside.set()
            release.wait(60)
            seen.append(rt.mtmd is not None and bool(rt.ctx))  # there, whatever close does

    borrower = threading.Thread(target=verification)
    borrower.start()
    assert inside.wait(60)
    closer = threading.Thread(target=rt.close)
    closer.start()
    wait_until(lambda: rt.closing, what="close begun")
    with pytest.raises(NativeError, match="shutting down"), rt.borrowed():
        pass
    assert rt.ctx and closer.is_alive()  # nothing freed while the borrower works
    release.set()
    borrower.join(60)
    closer.join(60)
    assert seen == [True]
    assert not closer.is_alive() and rt.ctx == 0 and rt.mtmd is None
