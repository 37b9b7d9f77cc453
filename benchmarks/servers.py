"""The services, as subprocesses on loopback: prep_service and infer_service spoken to through
the generated stubs, and llama-server over HTTP (its /completion stream read as a Stream)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.results import BenchError, Stream

MAX_MESSAGE = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A server subprocess whose output goes to a log file; stopped with SIGTERM."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path):
        self.name = name
        self.port = port
        self.log_path = log_dir / f"{name}-{port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log_dir
        )  # cwd: no checkout in the way of the installed packages (or PYTHONPATH)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class GrpcService(Process):
    def __init__(self, module: str, args: list[str], log_dir: Path):
        port = free_port()
        argv = [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(port)]
        super().__init__(module, [*argv, "--log-level", "warning"], port, log_dir)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)

    def wait_serving(self, timeout: float = 180) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                r = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise BenchError(f"{self.name} not serving after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.channel.close()
        super().stop()


class LlamaServer(Process):
    def __init__(
        self,
        binary: str,
        model: Path,
        *,
        ctx: int,
        parallel: int,
        threads: int,
        log_dir: Path,
        mmproj: Path | None = None,
        extra: Sequence[str] = (),
        gpu_layers: int = 0,
    ):
        port = free_port()
        # like infer_service: a budget of cells per slot, full-size SWA cache
        flags = f"-c {ctx} -np {parallel} -t {threads} -tb {threads} -b 512 -ub 512 --host"
        flags += f" 127.0.0.1 --port {port} --no-kv-unified --swa-full --no-webui -ngl {gpu_layers}"
        argv = [binary, "-m", str(model), *flags.split(), *extra]
        if mmproj is not None:
            argv += ["--mmproj", str(mmproj)]
        from slotwise_core import native

        # the weight buffers infer and the raw loop use: where they go without llama.cpp's extra
        # (repacked) buffer types, so does llama-server
        if not native.extra_bufts_decision(native.cpu_flags(), native.amx_tile_permission)[0]:
            argv.append("--no-repack")
        super().__init__("llama-server", argv, port, log_dir)

    def wait_serving(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                conn.close()
            time.sleep(0.2)
        raise BenchError(f"llama-server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def generate(self, text: str, max_tokens: int, **fields: Any) -> Stream:
        body = json.dumps(
            {
                "prompt": text,
                "n_predict": max_tokens,
                "temperature": 0,
                "stream": True,
                "cache_prompt": False,
                "return_tokens": True,
                **fields,
            }
        )
        s = Stream()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        s.t_sent = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"llama-server /completion: HTTP {resp.status} {resp.read()[:300]!r}")
        n_seen = 0
        while True:
            line = resp.readline()
            if not line:
                break
            t = time.perf_counter()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            tokens = event.get("tokens") or ()
            s.token_ids.extend(tokens)
            if event.get("stop"):
                n = int(event.get("tokens_predicted", n_seen + len(tokens)))
                s.add(t, n - n_seen)
                s.finish = str(event.get("stop_type", "stop"))
                timings = event.get("timings") or {}
                s.drafted = int(timings.get("draft_n") or 0)
                s.accepted = int(timings.get("draft_n_accepted") or 0)
                break
            k = len(tokens) or 1
            s.add(t, k)
            n_seen += k
        conn.close()
        return s
