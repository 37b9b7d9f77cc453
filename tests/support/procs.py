"""Ports and processes on this machine."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def serve_argv(model: Path, mmproj: Path | None, *extra: str) -> list[str]:
    """`slotwise serve` on a tiny pair: one thread each, ports picked by the OS unless extra
    names them (a later flag wins)."""
    argv = [sys.executable, "-m", "slotwise_cli", "serve", "--model", str(model)]
    if mmproj is not None:
        argv += ["--mmproj", str(mmproj)]
    return [*argv, "--prep-port", "0", "--infer-port", "0", "--threads", "1",
            "--prep-threads", "1", *extra]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
