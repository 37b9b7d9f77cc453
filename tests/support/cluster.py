"""Several prep and infer processes behind a real nginx on loopback, sharing a sessions directory
(tests/test_cluster.py, tests/cluster.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from signal import SIGKILL, SIGTERM

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from slotwise.v1 import infer_pb2, infer_pb2_grpc
from slotwise_core.tiny_models import TinyPair
from support.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "nginx" / "slotwise.conf.template"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/nginx/sbin/nginx") if os.access(p, os.X_OK)), None
)


def render(template: str, values: dict[str, str]) -> str:
    """The template with ${SLOTWISE_*} filled in, as the nginx image's envsubst does (nginx's
    own $variables stay)."""
    return re.sub(r"\$\{(SLOTWISE_\w+)\}", lambda m: values[m.group(1)], template)


def servers(ports: list[int]) -> str:
    # fail_timeout: how long nginx skips a replica that refused a connection
    return " ".join(f"server 127.0.0.1:{p} max_fails=1 fail_timeout=3s;" for p in ports)


@dataclass
class Proc:
    name: str
    argv: list[str]
    port: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "GGML_NO_BACKTRACE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=log, env=env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def stop(self, sig: int = SIGKILL) -> None:
        """kill -9 by default (a replica's crash); nginx gets SIGTERM, since its workers
        outlive a master killed with -9."""
        if not self.alive:
            return
        self.signal(sig)
        try:
            self.wait(10)
        except subprocess.TimeoutExpired:
            self.signal(SIGKILL)
            self.wait()

    def wait_serving(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if not self.alive:
                    raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} on {self.address} is not serving")


@dataclass
class Cluster:
    """`num_prep` prep and `num_infer` infer processes on one tiny pair, one nginx in front."""

    pair: TinyPair
    work: Path
    num_prep: int = 2
    num_infer: int = 3
    parallel: int = 2
    ctx_size: int = 1024
    keys: Path | None = None  # a keys file for every replica (token: the key its calls use)
    token: str | None = None
    prep: list[Proc] = field(default_factory=list)
    infer: list[Proc] = field(default_factory=list)
    nginx: Proc | None = None

    @property
    def sessions_dir(self) -> Path:
        return self.work / "sessions"

    @property
    def prep_address(self) -> str:
        return f"127.0.0.1:{self.prep_port}"

    @property
    def infer_address(self) -> str:
        return f"127.0.0.1:{self.infer_port}"

    def start(self) -> Cluster:
        assert NGINX is not None, "no nginx binary"
        self.work.mkdir(parents=True, exist_ok=True)
        self.sessions_dir.mkdir(exist_ok=True)
        m, p = str(self.pair.model), str(self.pair.mmproj)
        secured = ["--token-file", str(self.keys)] if self.keys else []
        for i in range(self.num_prep):
            port = free_port()
            argv = [sys.executable, "-m", "prep_service", "--model", m, "--mmproj", p,
                    "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
                    *secured]  # fmt: skip
            self.prep.append(Proc(f"prep{i}", argv, port, self.work / f"prep{i}.log"))
        for i in range(self.num_infer):
            port = free_port()
            argv = [sys.executable, "-m", "infer_service", "--model", m, "--mmproj", p,
                    "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
                    "--ctx-size", str(self.ctx_size * self.parallel),
                    "--parallel", str(self.parallel), "--sessions-dir", str(self.sessions_dir),
                    "--drain-seconds", "30", *secured]  # fmt: skip
            self.infer.append(Proc(f"infer{i}", argv, port, self.work / f"infer{i}.log"))
        for proc in (*self.prep, *self.infer):
            proc.start()
        for proc in (*self.prep, *self.infer):
            proc.wait_serving()
        self._start_nginx()
        return self

    def _start_nginx(self) -> None:
        self.prep_port, self.infer_port = free_port(), free_port()
        d = self.work / "nginx"
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        fragment = render(
            TEMPLATE.read_text(),
            {
                "SLOTWISE_PREP_SERVERS": servers([p.port for p in self.prep]),
                "SLOTWISE_INFER_SERVERS": servers([p.port for p in self.infer]),
                "SLOTWISE_PREP_LISTEN": f"127.0.0.1:{self.prep_port}",
                "SLOTWISE_INFER_LISTEN": f"127.0.0.1:{self.infer_port}",
            },
        )
        (d / "slotwise.conf").write_text(fragment)
        temp = " ".join(f"{k}_temp_path {d / v};" for k, v in (
            ("client_body", "body"), ("proxy", "proxy"), ("fastcgi", "fastcgi"),
            ("uwsgi", "uwsgi"), ("scgi", "scgi"),
        ))  # fmt: skip
        (d / "nginx.conf").write_text(
            f"daemon off;\nworker_processes 1;\npid {d / 'nginx.pid'};\n"
            f"error_log {d / 'error.log'} warn;\nevents {{ worker_connections 1024; }}\n"
            f"http {{\n  access_log off;\n  {temp}\n"
            # which replica answered (tests only): routed_to() reads it
            "  add_header x-slotwise-upstream $upstream_addr always;\n"
            f"  include {d / 'slotwise.conf'};\n}}\n"
        )
        argv = [NGINX, "-c", str(d / "nginx.conf"), "-p", str(d)]
        self.nginx = Proc("nginx", argv, self.infer_port, self.work / "nginx.log")
        self.nginx.start()
        self.nginx.wait_serving(30)  # health through nginx: some replica answers

    def routed_to(self, session_id: str) -> Proc:
        """The replica nginx sends the session's calls to now (a GetServerInfo carrying the
        session's header, answered by whichever replica its hash picks)."""
        with grpc.insecure_channel(self.infer_address) as ch:
            _, call = infer_pb2_grpc.InferServiceStub(ch).GetServerInfo.with_call(
                infer_pb2.GetServerInfoRequest(),
                metadata=[("x-slotwise-session", session_id), *self._auth],
                timeout=10,
            )
        upstream = dict(call.initial_metadata())["x-slotwise-upstream"]
        return self.replica_of(upstream.split(",")[-1].strip())

    def replica_of(self, address: str) -> Proc:
        return next(p for p in self.infer if p.address == address)

    def sessions_on(self, proc: Proc, token: str | None = None) -> dict[str, int]:
        """The sessions one replica holds in memory (session id -> turns), asked directly: a
        replica lists only sessions it created, served or loaded at its start (with keys:
        only the caller's, token's or else the cluster's own)."""
        auth = [("authorization", f"Bearer {token}")] if token else self._auth
        with grpc.insecure_channel(proc.address) as ch:
            r = infer_pb2_grpc.InferServiceStub(ch).ListSessions(
                infer_pb2.ListSessionsRequest(), metadata=auth, timeout=10
            )
        return {s.session_id: s.num_turns for s in r.sessions}

    @property
    def _auth(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def restart(self, proc: Proc) -> None:
        proc.stop()
        proc.start()
        proc.wait_serving()

    def close(self) -> None:
        if self.nginx is not None:
            self.nginx.stop(SIGTERM)
        for proc in (*self.infer, *self.prep):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.log.read_text()[-1500:]}"
            for p in (*self.infer, self.nginx)
            if p is not None and p.log.exists()
        )
