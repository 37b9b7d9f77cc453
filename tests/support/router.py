"""`slotwise serve --models-dir` (the router) as a real process on a loopback port, over a
folder of tiny pairs linked in by name."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from slotwise_core.tiny_models import TinyPair
from support.wait import PATIENCE, wait_until

_READY = re.compile(r"router on \S+:(\d+) ")
# the children's and the router's own: one thread each, small contexts
SMALL = ("--threads", "1", "--prep-threads", "1", "--ctx-size", "1024")


def models_folder(folder: Path, pairs: Mapping[str, TinyPair], *, text_only: bool = False) -> Path:
    """NAME/model.gguf and NAME/mmproj.gguf for each pair (links, not copies)."""
    for name, pair in pairs.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "model.gguf").symlink_to(pair.model)
        if not text_only:
            (folder / name / "mmproj.gguf").symlink_to(pair.mmproj)
    return folder


@dataclass
class Router:
    process: subprocess.Popen[str]
    url: str
    lines: list[str]

    def models(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.url}/models", timeout=PATIENCE)
        r.raise_for_status()
        return {m["id"]: m for m in r.json()["data"]}

    def status(self, name: str) -> str:
        return str(self.models()[name]["status"]["value"])

    def wait_status(self, name: str, *wanted: str) -> None:
        wait_until(lambda: self.status(name) in wanted, what=f"{name} {wanted}")


@contextmanager
def running_router(*args: str, env: Mapping[str, str] | None = None) -> Iterator[Router]:
    argv = [sys.executable, "-m", "slotwise_cli", "serve", "--http-port", "0", *SMALL, *args]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    lines: list[str] = []
    ports: queue.Queue[int | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip())
            if m := _READY.search(line):
                ports.put(int(m[1]))
        ports.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        port = ports.get(timeout=PATIENCE)
        assert port is not None, "the router ended before it was ready:\n" + "\n".join(lines)
        yield Router(process, f"http://127.0.0.1:{port}", lines)
    finally:
        process.terminate()
        try:
            process.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def router_exit(*args: str) -> tuple[int, str]:
    """A router that refuses to start: its exit status and what it said."""
    argv = [sys.executable, "-m", "slotwise_cli", "serve", "--http-port", "0", *SMALL, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE)
    return done.returncode, done.stdout + done.stderr


def chat(url: str, model: str, content: Any, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=PATIENCE)


def since(t0: float) -> float:
    return time.monotonic() - t0
