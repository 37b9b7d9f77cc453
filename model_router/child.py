"""One model's process: `slotwise serve` for that model alone, on loopback ports it picks itself
(its ready line says which). Its abort, out-of-memory kill or crash ends that process only; the
router hears of it from the exit, with the last lines it wrote to say why."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("slotwise.router")

# `slotwise serve: prep on H:P, infer on H:P, HTTP API on H:P (...)` (slotwise_serve's ready line)
_READY = re.compile(r"prep on (\S+), infer on (\S+), HTTP API on (\S+):(\d+) ")
_TAIL_LINES = 20
_LONGEST_LINE = 4096  # of a line kept (the tail, the log)


class LoadFailed(Exception):
    """The process ended before it was ready: `reason` is its last words, `exit_code` its end."""

    def __init__(self, reason: str, exit_code: int | None):
        super().__init__(reason)
        self.reason, self.exit_code = reason, exit_code


@dataclass
class Child:
    process: asyncio.subprocess.Process
    name: str
    http_port: int = 0
    prep_address: str = ""
    infer_address: str = ""
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def reason(self) -> str:
        """Why it ended, in its own words: the last line it wrote that says so."""
        for line in reversed(self.tail):
            if "error" in line.lower() or line.startswith("slotwise serve:"):
                return line
        return self.tail[-1] if self.tail else "the process ended without a word"

    def resident_bytes(self) -> int | None:
        """What it holds now (VmRSS), or None where /proc cannot say."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        return int(m.group(1)) * 1024 if m else None

    async def stop(self, timeout: float) -> int:
        """SIGTERM (it drains), then SIGKILL after `timeout` s; its exit status."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                log.warning("%s: not gone %.0fs after SIGTERM; killed", self.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
        code = await self.process.wait()
        for r in self.readers:
            await r
        return code


SERVE = (sys.executable, "-m", "slotwise_cli", "serve")


async def spawn(
    name: str, argv: Sequence[str], env: dict[str, str] | None = None,
    program: Sequence[str] = SERVE,
) -> Child:  # fmt: skip
    """Start `slotwise serve argv` and wait for its ready line; LoadFailed if it ends first.
    The caller cancels the wait to give up (the process is then killed)."""
    process = await asyncio.create_subprocess_exec(
        *program, *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, preexec_fn=_die_with_parent,
    )  # fmt: skip
    child = Child(process, name)
    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    child.readers = [
        asyncio.ensure_future(_read(child, process.stdout, ready)),
        asyncio.ensure_future(_read(child, process.stderr, None)),
    ]
    waiter: asyncio.Future[Any] = asyncio.ensure_future(process.wait())
    try:
        await asyncio.wait([ready, waiter], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        waiter.cancel()
        await child.stop(0)
        raise
    if not ready.done():
        code = await waiter
        for r in child.readers:
            await r
        raise LoadFailed(child.reason(), code)
    waiter.cancel()
    m = ready.result()
    child.prep_address, child.infer_address, child.http_port = m[1], m[2], int(m[4])
    return child


async def _read(
    child: Child, stream: asyncio.StreamReader | None, ready: asyncio.Future[re.Match[str]] | None
) -> None:
    """Its lines into the router's log and the tail; the ready line resolves `ready`."""
    assert stream is not None
    pending = b""
    while chunk := await stream.read(1 << 16):  # (lines of any length: readline has a limit)
        *lines, pending = (pending + chunk).split(b"\n")
        pending = pending[-_LONGEST_LINE:]
        for line in lines:
            _line(child, line[:_LONGEST_LINE].decode(errors="replace").rstrip(), ready)
    if pending:
        _line(child, pending.decode(errors="replace").rstrip(), ready)


def _line(child: Child, text: str, ready: asyncio.Future[Any] | None) -> None:
    child.tail.append(text)
    log.info("[%s] %s", child.name, text)
    if ready is not None and not ready.done() and (m := _READY.search(text)):
        ready.set_result(m)


def _die_with_parent() -> None:
    """The child gets SIGTERM when the router dies, however it dies (Linux's PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    os.setpgrp()  # (a terminal's Ctrl-C reaches the router, which stops its children in turn)
