"""Chaos: many clients doing everything at once, badly, against real prep + infer processes.

    python tests/chaos.py --clients 16 --seconds 600     # the documented long run (10 min)
    python tests/chaos.py --clients 16 --seconds 20      # what the test suite runs

Every client loops over a random mix of text and image generations, session turns and every
session RPC, cancels at random points, deadlines from 1 ms to 10 s (log-uniform) and dropped
connections (a channel closed mid-stream). Meanwhile the sessions directory sits on a small
tmpfs (as root; elsewhere a plain directory, and the report says so) that a filler fills up
and frees again, over and over.

Afterwards the run checks, and the report states: the infer process is alive and SERVING, a
good request is served at once, no slot or queue entry leaked, no call ended with UNKNOWN or
INTERNAL, every session's file is consistent with what the client was told (a turn reported
SAVED is on disk after a restart, and the next turn continues from there), and infer's RSS
grew within a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from load import wait_serving

from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2, prep_pb2_grpc
from slotwise_core.tiny_models import write_tiny_models
from support.procs import free_port, rss_bytes

OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
MEDIA_CACHE_MB = 32  # every image is new: the projector-output cache fills to its bound
STATE_CACHE_MB = 16  # KV states of stateless sequences that lost their slot
RSS_BOUND_MB = 2 * MEDIA_CACHE_MB + STATE_CACHE_MB + 48
# what a call may end with under chaos; anything else (UNKNOWN, INTERNAL, ...) is a failure
EXPECTED = {
    "OK",
    "CANCELLED",  # we cancelled it
    "DEADLINE_EXCEEDED",  # our deadline
    "RESOURCE_EXHAUSTED",  # queue full, or the disk is full (turn not saved, save refused)
    "FAILED_PRECONDITION",  # a session with a turn running
    "NOT_FOUND",  # a session another operation deleted
    "ALREADY_EXISTS",  # a session created twice
}


def png(rng: random.Random) -> bytes:
    img = Image.new("RGB", (rng.randint(28, 160), rng.randint(28, 160)))
    img.putdata([(rng.randrange(256), 90, 200)] * (img.width * img.height))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def deadline(rng: random.Random) -> float:
    return math.exp(rng.uniform(math.log(0.001), math.log(10.0)))


@dataclass
class SessionView:
    """What the client was told about one session."""

    turns: int = 0  # completed turns, as far as the server said
    saved: int = 0  # the newest turn the server said is on disk
    exists: bool = True


@dataclass
class Stats:
    ops: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    cancels: int = 0
    deadlines: int = 0
    drops: int = 0
    disk_full_episodes: int = 0
    turns_not_saved: int = 0
    sessions: dict[str, SessionView] = field(default_factory=dict)

    def outcome(self, op: str, code: str, detail: str = "") -> None:
        self.ops[op] += 1
        self.codes[code] += 1
        if code not in EXPECTED:
            self.unexpected.append(f"{op}: {code}: {detail[:200]}")


class Client:
    def __init__(
        self,
        k: int,
        prep: prep_pb2_grpc.PrepServiceStub,
        infer: infer_pb2_grpc.InferServiceStub,
        infer_address: str,
        stats: Stats,
        seed: int,
    ):
        self.k, self.prep, self.infer, self.address = k, prep, infer, infer_address
        self.stats, self.rng = stats, random.Random(seed)
        self.session = f"c{k}"
        stats.sessions[self.session] = SessionView(exists=False)

    async def run(self, until: float) -> None:
        ops = [self.text, self.image, self.turn, self.turn, self.session_rpc, self.drop]
        while time.monotonic() < until:
            await self.rng.choice(ops)()

    async def _prompt(self, with_image: bool) -> infer_pb2.GenerateRequest | None:
        parts = [prep_pb2.Part(text=f"client {self.k}: {self.rng.random():.6f} ")]
        if with_image:
            parts.append(prep_pb2.Part(image=prep_pb2.Image(data=png(self.rng))))
            parts.append(prep_pb2.Part(text=" what is it?"))
        chat = prep_pb2.Chat(messages=[prep_pb2.Message(role="user", parts=parts)])
        try:
            r = await self.prep.Prepare(prep_pb2.PrepareRequest(chat=chat), timeout=30)
        except grpc.aio.AioRpcError as e:
            self.stats.outcome("prepare", e.code().name, e.details() or "")
            return None
        return infer_pb2.GenerateRequest(
            prompt=r.prompt,
            max_tokens=self.rng.randint(1, 48),
            sampling=infer_pb2.SamplingParams(temperature=0.8, seed=self.rng.randrange(1 << 30)),
        )

    async def _stream(self, op: str, request: infer_pb2.GenerateRequest) -> None:
        timeout = deadline(self.rng) if self.rng.random() < 0.3 else 30.0
        cancel_after = self.rng.randint(0, 20) if self.rng.random() < 0.2 else None
        if timeout < 30:
            self.stats.deadlines += 1
        call = self.infer.Generate(request, timeout=timeout)
        n = 0
        finished = None
        try:
            async for event in call:
                n += 1
                if event.HasField("finished"):
                    finished = event.finished
                if cancel_after is not None and n >= cancel_after:
                    self.stats.cancels += 1
                    call.cancel()
                    break
            code = "CANCELLED" if call.cancelled() else "OK"
            self.stats.outcome(op, code)
        except grpc.aio.AioRpcError as e:
            self.stats.outcome(op, e.code().name, e.details() or "")
        except asyncio.CancelledError:
            self.stats.outcome(op, "CANCELLED")
        if request.session_id and finished is not None:
            self._told(finished)

    def _told(self, finished: infer_pb2.Finished) -> None:
        view = self.stats.sessions[self.session]
        if finished.reason not in (infer_pb2.FINISH_REASON_STOP, infer_pb2.FINISH_REASON_LENGTH):
            return
        view.turns += 1
        if finished.persistence == infer_pb2.PERSISTENCE_SAVED:
            view.saved = view.turns
        elif finished.persistence == infer_pb2.PERSISTENCE_NOT_SAVED:
            self.stats.turns_not_saved += 1

    async def text(self) -> None:
        request = await self._prompt(with_image=False)
        if request is not None:
            await self._stream("generate_text", request)

    async def image(self) -> None:
        request = await self._prompt(with_image=True)
        if request is not None:
            await self._stream("generate_image", request)

    async def turn(self) -> None:
        view = self.stats.sessions[self.session]
        if not view.exists:
            await self._create()
            return
        request = await self._prompt(with_image=self.rng.random() < 0.5)
        if request is not None:
            request.session_id = self.session
            await self._stream("session_turn", request)

    async def _create(self) -> None:
        request = infer_pb2.CreateSessionRequest(session_id=self.session)
        try:
            await self.infer.CreateSession(request, timeout=10)
            self.stats.sessions[self.session] = SessionView()
            self.stats.outcome("create_session", "OK")
        except grpc.aio.AioRpcError as e:
            self.stats.outcome("create_session", e.code().name, e.details() or "")
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:  # we lost track of it: saved 0
                self.stats.sessions[self.session] = SessionView()
            # RESOURCE_EXHAUSTED: the disk is full; the session exists in memory all the same
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.stats.sessions[self.session] = SessionView()

    async def session_rpc(self) -> None:
        view = self.stats.sessions[self.session]
        sid = self.session
        kind = self.rng.choice(["get", "list", "save", "restore", "delete", "info", "other"])
        timeout = deadline(self.rng)
        self.stats.deadlines += 1
        try:
            if kind == "get":
                r = await self.infer.GetSession(
                    infer_pb2.GetSessionRequest(session_id=sid), timeout=timeout
                )
                view.turns = r.session.num_turns
            elif kind == "list":
                await self.infer.ListSessions(infer_pb2.ListSessionsRequest(), timeout=timeout)
            elif kind == "save":
                r = await self.infer.SaveSession(
                    infer_pb2.SaveSessionRequest(session_id=sid), timeout=timeout
                )
                view.turns = view.saved = r.session.num_turns
            elif kind == "restore":
                r = await self.infer.RestoreSession(
                    infer_pb2.RestoreSessionRequest(session_id=sid), timeout=timeout
                )
                if r.session.num_turns < view.saved:
                    self.stats.unexpected.append(
                        f"restore {sid}: {r.session.num_turns} turns on disk, told {view.saved}"
                    )
                view.turns = view.saved = r.session.num_turns
            elif kind == "delete":
                await self.infer.DeleteSession(
                    infer_pb2.DeleteSessionRequest(session_id=sid), timeout=timeout
                )
                self.stats.sessions[sid] = SessionView(exists=False)
            elif kind == "info":
                await self.infer.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=timeout)
            else:  # another client's session: busy, missing, or fine
                other = f"c{self.rng.randrange(len(self.stats.sessions))}"
                await self.infer.GetSession(
                    infer_pb2.GetSessionRequest(session_id=other), timeout=timeout
                )
            self.stats.outcome(kind, "OK")
        except grpc.aio.AioRpcError as e:
            self.stats.outcome(kind, e.code().name, e.details() or "")
            gave_up = e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            if gave_up and kind in ("delete", "restore"):
                # the server may have done it all the same: what we know of it is gone
                self.stats.sessions[sid] = SessionView(exists=kind == "restore")

    async def drop(self) -> None:
        """A connection that goes away mid-stream (its own channel, closed under the call)."""
        request = await self._prompt(with_image=self.rng.random() < 0.5)
        if request is None:
            return
        channel = grpc.aio.insecure_channel(self.address, options=OPTIONS)
        call = infer_pb2_grpc.InferServiceStub(channel).Generate(request, timeout=30)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for _ in call:
                if self.rng.random() < 0.3:
                    break
        await channel.close(grace=None)
        self.stats.drops += 1
        self.stats.ops["dropped_connection"] += 1


async def disk_filler(root: Path, until: float, stats: Stats, rng: random.Random) -> None:
    """Fill the tmpfs for a while, free it for a while, until the end."""
    filler = root / "filler"
    while time.monotonic() < until:
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        st = os.statvfs(root)
        # (on a full tmpfs even creating the file may fail: that is full enough)
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize))  # up to ENOSPC
        stats.disk_full_episodes += 1
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        filler.unlink(missing_ok=True)


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


def start_infer(models, port: int, sessions: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable, "-m", "infer_service", "--model", str(models.model),
            "--mmproj", str(models.mmproj), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", "2048", "--parallel", "4", "--threads", "1", "--max-queue", "32",
            "--sessions-dir", str(sessions), "--log-level", "error",
            "--media-cache-mb", str(MEDIA_CACHE_MB), "--state-cache-mb", str(STATE_CACHE_MB),
        ],
        env=env,
    )  # fmt: skip


async def chaos(
    clients: int = 16, seconds: float = 20, pair: str = "mrope", seed: int = 0
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="slotwise-chaos-") as tmp:
        root = Path(tmp) / "disk"
        tmpfs = os.geteuid() == 0 and mount_tmpfs(root, "6m")
        try:
            return await _chaos(Path(tmp), root, tmpfs, clients, seconds, pair, seed)
        finally:
            if tmpfs:
                subprocess.run(["umount", "-l", str(root)], check=False)


async def _chaos(
    tmp: Path, root: Path, tmpfs: bool, clients: int, seconds: float, pair: str, seed: int
) -> dict[str, object]:
    root.mkdir(parents=True, exist_ok=True)
    sessions = root / "sessions"
    models = write_tiny_models(tmp / "models", [pair])[pair]
    prep_port, infer_port = free_port(), free_port()
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    prep_proc = subprocess.Popen(
        [
            sys.executable, "-m", "prep_service", "--model", str(models.model),
            "--mmproj", str(models.mmproj), "--host", "127.0.0.1", "--port", str(prep_port),
            "--log-level", "error",
        ],
        env=env,
    )  # fmt: skip
    infer = start_infer(models, infer_port, sessions, env)
    stats = Stats()
    report: dict[str, object] = {"clients": clients, "seconds": seconds, "tmpfs": tmpfs}
    try:
        await wait_serving(prep_port)
        await wait_serving(infer_port)
        address = f"127.0.0.1:{infer_port}"
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{prep_port}", options=OPTIONS) as pch,
            grpc.aio.insecure_channel(address, options=OPTIONS) as ich,
        ):
            prep, stub = prep_pb2_grpc.PrepServiceStub(pch), infer_pb2_grpc.InferServiceStub(ich)
            rss_start = rss_bytes(infer.pid)
            until = time.monotonic() + seconds
            rng = random.Random(seed)
            workers = [
                Client(k, prep, stub, address, stats, seed * 1000 + k).run(until)
                for k in range(clients)
            ]
            if tmpfs:
                workers.append(disk_filler(root, until, stats, rng))
            await asyncio.gather(*workers)
            (root / "filler").unlink(missing_ok=True)
            idle = await settled(stub)  # the calls cancelled last have reached the engine
            rss_end = rss_bytes(infer.pid)
            report.update(await after_the_storm(prep, stub, infer, infer_port, idle))
        report["rss_start_mb"] = round(rss_start / 2**20, 1)
        report["rss_end_mb"] = round(rss_end / 2**20, 1)
        # a restart: what is on disk is what the clients were told
        infer.send_signal(signal.SIGTERM)
        report["infer_exit_code"] = infer.wait(60)
        infer = start_infer(models, infer_port, sessions, env)
        await wait_serving(infer_port)
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{prep_port}", options=OPTIONS) as pch,
            grpc.aio.insecure_channel(address, options=OPTIONS) as ich,
        ):
            report.update(
                await check_restored(
                    infer_pb2_grpc.InferServiceStub(ich), prep_pb2_grpc.PrepServiceStub(pch), stats
                )
            )
    finally:
        for p in (prep_proc, infer):
            p.terminate()
        for p in (prep_proc, infer):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
    report.update(
        operations=sum(stats.ops.values()),
        by_operation=dict(stats.ops),
        codes=dict(stats.codes),
        cancels=stats.cancels,
        deadlines=stats.deadlines,
        dropped_connections=stats.drops,
        disk_full_episodes=stats.disk_full_episodes,
        turns_not_saved=stats.turns_not_saved,
        unexpected=stats.unexpected[:20],
        num_unexpected=len(stats.unexpected),
    )
    return report


async def settled(stub: infer_pb2_grpc.InferServiceStub) -> infer_pb2.GetServerInfoResponse:
    """The engine's snapshot once no slot is busy and nothing is queued: the streams the
    clients left are cancelled within a step or two. After 10 s, whatever it holds then (a
    leak, which the report shows)."""
    deadline_at = time.monotonic() + 10
    while True:
        info = await stub.GetServerInfo(infer_pb2.GetServerInfoRequest(), timeout=10)
        if (info.num_active, info.num_queued) == (0, 0) or time.monotonic() > deadline_at:
            return info
        await asyncio.sleep(0.1)


async def after_the_storm(
    prep: prep_pb2_grpc.PrepServiceStub,
    stub: infer_pb2_grpc.InferServiceStub,
    infer: subprocess.Popen,
    port: int,
    info: infer_pb2.GetServerInfoResponse,
) -> dict[str, object]:
    """info: the engine's snapshot once settled."""
    out: dict[str, object] = {"engine_deaths": 0 if infer.poll() is None else 1}
    out["leaked_slots"], out["leaked_queue"] = info.num_active, info.num_queued
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    out["serving"] = health.status == health_pb2.HealthCheckResponse.SERVING
    chat = prep_pb2.Chat(messages=[prep_pb2.Message(role="user", parts=[prep_pb2.Part(text="hi")])])
    prompt = (await prep.Prepare(prep_pb2.PrepareRequest(chat=chat), timeout=10)).prompt
    t0 = time.monotonic()
    events = [
        e
        async for e in stub.Generate(
            infer_pb2.GenerateRequest(prompt=prompt, max_tokens=8), timeout=10
        )
    ]
    out["good_request_seconds"] = round(time.monotonic() - t0, 3)
    out["good_request_ok"] = events[-1].HasField("finished")
    return out


async def check_restored(
    stub: infer_pb2_grpc.InferServiceStub, prep: prep_pb2_grpc.PrepServiceStub, stats: Stats
) -> dict[str, object]:
    """After a restart: every session has at least the turns it was told were saved, and its
    next turn continues from what is on disk."""
    lost = 0
    continued = 0
    problems = []
    chat = prep_pb2.Chat(
        messages=[prep_pb2.Message(role="user", parts=[prep_pb2.Part(text="still there?")])]
    )
    prompt = (await prep.Prepare(prep_pb2.PrepareRequest(chat=chat), timeout=10)).prompt
    for sid, view in stats.sessions.items():
        if not view.exists:
            continue
        try:
            info = (
                await stub.GetSession(infer_pb2.GetSessionRequest(session_id=sid), timeout=10)
            ).session
        except grpc.aio.AioRpcError as e:
            if view.saved:
                lost += view.saved
                problems.append(f"{sid}: {e.code().name} {e.details()}")
            continue
        if info.num_turns < view.saved:
            lost += view.saved - info.num_turns
            problems.append(f"{sid}: {info.num_turns} turns on disk, told {view.saved}")
        request = infer_pb2.GenerateRequest(prompt=prompt, session_id=sid, max_tokens=3)
        events = []
        with contextlib.suppress(grpc.aio.AioRpcError):  # served but not saved: a full disk
            async for e in stub.Generate(request, timeout=30):
                events.append(e)
        after = (
            await stub.GetSession(infer_pb2.GetSessionRequest(session_id=sid), timeout=10)
        ).session
        if events and events[-1].HasField("finished") and after.num_turns == info.num_turns + 1:
            continued += 1
        else:
            problems.append(f"{sid}: the next turn did not continue from turn {info.num_turns}")
    return {
        "lost_completed_turns": lost,
        "sessions_continued": continued,
        "restore_problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--pair", default="mrope", choices=["mrope", "rope", "noncausal"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    report = asyncio.run(chaos(args.clients, args.seconds, args.pair, args.seed))
    print(json.dumps(report, indent=2))
    return 0 if healthy(report) else 1


def healthy(report: dict[str, object]) -> bool:
    return bool(
        report["num_unexpected"] == 0
        and report["engine_deaths"] == 0
        and report["serving"]
        and report["good_request_ok"]
        and report["leaked_slots"] == 0
        and report["leaked_queue"] == 0
        and report["lost_completed_turns"] == 0
        and not report["restore_problems"]
        and report["infer_exit_code"] == 0
        and report["rss_end_mb"] - report["rss_start_mb"] < RSS_BOUND_MB  # type: ignore[operator]
    )


if __name__ == "__main__":
    sys.exit(main())
