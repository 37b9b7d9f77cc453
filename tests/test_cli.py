"""The `slotwise` command line, driven as a user would: subprocesses against `slotwise serve`."""

from __future__ import annotations

import io
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from clients.client import NO_RETRY, Message, SlotwiseClient, SlotwiseError, Tls
from support.procs import serve_argv

ROOT = Path(__file__).resolve().parents[1]
CTX = 256
ENV = {**os.environ, "GGML_NO_BACKTRACE": "1", "PYTHONUNBUFFERED": "1"}


def slotwise(
    *args: str, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slotwise_cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=ENV,
        errors="replace",
    )


@dataclass
class Served:
    process: subprocess.Popen
    prep: str
    infer: str
    lines: list[str]

    def connection(self) -> list[str]:
        return ["--prep", self.prep, "--infer", self.infer]

    def stop(self, timeout: float = 20) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def wait_serving(address: str, tls: Tls | None = None, timeout: float = 30) -> None:
    """Poll grpc.health.v1 (open even when a token is required) until SERVING."""
    deadline = time.monotonic() + timeout
    with SlotwiseClient(address, tls=tls, retry=NO_RETRY, timeout=2) as client:
        while True:
            try:
                if client.health("prep") == "SERVING":
                    return
            except SlotwiseError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout} s")
            time.sleep(0.05)


def start_serve(model: Path, mmproj: Path, *extra: str, tls: Tls | None = None) -> Served:
    process = subprocess.Popen(
        serve_argv(model, mmproj, "--ctx-size", str(CTX), *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=ENV,
        errors="replace",
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("slotwise serve: prep on"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or process.poll() is not None:
        process.kill()
        raise AssertionError("slotwise serve did not start:\n" + "".join(lines))
    m = re.search(r"prep on (\S+), infer on (\S+) ", "".join(lines))
    assert m, "".join(lines)
    served = Served(process, m.group(1), m.group(2), lines)
    wait_serving(served.prep, tls)
    wait_serving(served.infer, tls)
    return served


@pytest.fixture(scope="module")
def served(tiny: dict[str, Any]) -> Iterator[Served]:
    s = start_serve(tiny["mrope"].model, tiny["mrope"].mmproj)
    yield s
    if s.process.poll() is None:
        s.stop()


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("images") / "circle.png"
    img = Image.new("RGB", (224, 224), (20, 60, 200))
    ImageDraw.Draw(img).ellipse((40, 40, 180, 180), fill=(240, 200, 10))
    img.save(path)
    return path


def summary(stderr: str) -> dict[str, str]:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("[slotwise] "))
    return dict(kv.split("=", 1) for kv in line.removeprefix("[slotwise] ").split())


# -- against a running `slotwise serve` -------------------------------------------------------


def test_generate_streams_text_and_reports_a_summary(served: Served, image_file: Path) -> None:
    args = [
        "--prompt",
        "What is in the picture?",
        "--image",
        str(image_file),
        "--system",
        "Be brief.",
    ]
    r = slotwise(
        "generate", *args, "--max-tokens", "24", "--temperature", "0", *served.connection()
    )
    assert r.returncode == 0, r.stderr
    s = summary(r.stderr)
    with SlotwiseClient(served.prep) as c:
        prepared = c.prepare(
            [
                Message.system("Be brief."),
                Message.user(image_file.read_bytes(), "What is in the picture?"),
            ]
        )
    assert int(s["prompt_cells"]) == prepared.num_cells
    assert int(s["prompt_positions"]) == prepared.num_positions < prepared.num_cells  # M-RoPE
    assert 0 < int(s["generated_tokens"]) <= 24
    assert s["finish"] in ("stop", "length")
    assert s["shifts"] == "0" and s["truncated_cells"] == "0"
    assert r.stdout  # the reply (gibberish; greedy on random weights: newlines) on stdout


def test_generate_shifts_and_truncates_a_long_prompt(served: Served, image_file: Path) -> None:
    long_prompt = "Tell me everything about this picture, in great detail. " * 8
    r = slotwise(
        "generate", "--prompt", long_prompt, "--image", str(image_file), "--max-tokens", "120",
        "--temperature", "0", "--policy", "gap", "--truncate", "--verbose", *served.connection(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = summary(r.stderr)
    assert int(s["truncated_cells"]) > 0
    assert int(s["shifts"]) >= 1 and int(s["evicted_cells"]) > 0 and s["policy"] == "gap"
    assert "prompt truncated: the oldest" in r.stderr
    assert "context shift (gap): evicted" in r.stderr


def test_generate_too_long_for_stop_policy_exits_1(served: Served, image_file: Path) -> None:
    long_prompt = "word " * 400
    r = slotwise("generate", "--prompt", long_prompt, "--policy", "stop", *served.connection())
    assert r.returncode == 1
    assert "INVALID_ARGUMENT" in r.stderr  # can never fit: not the transient RESOURCE_EXHAUSTED


def test_count_by_size_and_by_file(served: Served, image_file: Path) -> None:
    by_file = slotwise("count", "--prompt", "hi", "--image", str(image_file), "--prep", served.prep)
    by_size = slotwise(
        "count", "--prompt", "hi", "--image-size", "224x224", "-v", "--prep", served.prep
    )
    assert by_file.returncode == by_size.returncode == 0, by_file.stderr + by_size.stderr
    first = by_size.stdout.splitlines()[0]
    assert by_file.stdout.strip() == first
    m = re.fullmatch(r"cells=(\d+) positions=(\d+) chunks=(\d+)", first)
    assert m
    cells, positions, chunks = map(int, m.groups())
    rows = [ln.split() for ln in by_size.stdout.splitlines()[2:]]
    assert len(rows) == chunks
    assert sum(int(r[4]) for r in rows) == cells and sum(int(r[5]) for r in rows) == positions
    media = [r for r in rows if r[3] == "media"]
    assert [(int(r[4]), int(r[5])) for r in media] == [(64, 8)]  # 224 px: 8x8 cells, 8 positions


def test_info_shows_both_services(served: Served) -> None:
    r = slotwise("info", *served.connection())
    assert r.returncode == 0, r.stderr
    assert f"prep ({served.prep}):" in r.stdout and f"infer ({served.infer}):" in r.stdout
    assert "uses_mrope: True" in r.stdout
    assert f"num_cells_per_slot: {CTX}" in r.stdout
    assert "can_shift: False" in r.stdout
    assert "fingerprints match: yes" in r.stdout


def test_chat_keeps_the_conversation(served: Served, image_file: Path) -> None:
    script = (
        f"/image {image_file}\nWhat is this?\n/image /no/such.png\nAnd the colour?\n"
        "Tell me more, at length.\n/history\n/quit\n"
    )
    r = slotwise(
        "chat", "--system", "Be brief.", "--max-tokens", "60", "--temperature", "0",
        *served.connection(), stdin=script,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "[image" in r.stderr and "attached" in r.stderr
    assert "[cannot read /no/such.png" in r.stderr
    history = [
        ln for ln in r.stderr.splitlines() if re.match(r"\s+\d+ (system|user|assistant):", ln)
    ]
    assert [ln.split()[1] for ln in history] == [
        "system:", "user:", "assistant:", "user:", "assistant:", "user:", "assistant:"
    ]  # fmt: skip
    assert "[1 image(s)]" in history[1]
    # three turns of a growing conversation in a 256-cell context: it must have been cut
    assert "[note: prompt truncated" in r.stderr or "[note: context shift" in r.stderr


def test_errors_and_usage_exit_codes(served: Served, image_file: Path) -> None:
    r = slotwise("count", "--raw", "--prompt", "no marker", "--image", str(image_file),
                 "--prep", served.prep)  # fmt: skip
    assert r.returncode == 1
    assert "INVALID_ARGUMENT" in r.stderr and "media marker" in r.stderr
    r = slotwise("count", "--prompt", "x", "--image", "/no/such.png", "--prep", served.prep)
    assert r.returncode == 2 and "cannot read image" in r.stderr
    r = slotwise("count", "--prompt", "x", "--image-size", "big", "--prep", served.prep)
    assert r.returncode == 2 and "WIDTHxHEIGHT" in r.stderr
    r = slotwise("generate", "--prompt", "x", "--policy", "sometimes", *served.connection())
    assert r.returncode == 2
    r = slotwise("info", "--prep", served.prep, "--infer", "127.0.0.1:1", "--timeout", "1")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stdout


def test_serve_drains_and_exits_on_sigterm(tiny: dict[str, Any]) -> None:
    s = start_serve(tiny["rope"].model, tiny["rope"].mmproj)
    try:
        r = slotwise("info", *s.connection())
        assert r.returncode == 0 and "can_shift: True" in r.stdout
    finally:
        rc = s.stop()
    assert rc == 0, "".join(s.lines)
    assert "slotwise serve: stopped" in "".join(s.lines)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_serve_with_mutual_tls_and_a_token(tiny: dict[str, Any], tmp_path: Path) -> None:
    from test_client import make_certificates

    pem = make_certificates(tmp_path)
    (tmp_path / "token").write_text("let-me-in\n")
    tls = Tls(pem["ca.pem"], pem["client.pem"], pem["client.key"])
    s = start_serve(
        tiny["mrope"].model, tiny["mrope"].mmproj,
        "--host", "localhost", "--tls-cert", str(tmp_path / "server.pem"),
        "--tls-key", str(tmp_path / "server.key"), "--tls-client-ca", str(tmp_path / "ca.pem"),
        "--token-file", str(tmp_path / "token"),
        tls=tls,
    )  # fmt: skip
    client_tls = ["--tls-ca", str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "client.pem"),
                  "--tls-key", str(tmp_path / "client.key")]  # fmt: skip
    try:
        r = slotwise("info", *s.connection(), *client_tls, "--token-file", str(tmp_path / "token"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "fingerprints match: yes" in r.stdout
        r = slotwise("count", "--prompt", "hi", "--prep", s.prep, *client_tls, "--token", "nope")
        assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
        r = slotwise("count", "--prompt", "hi", "--prep", s.prep, "--token", "let-me-in")
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr  # plaintext to a TLS port
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_serve_with_a_missing_model_is_a_usage_error(tmp_path: Path) -> None:
    r = slotwise("serve", "--model", str(tmp_path / "none.gguf"), "--prep-port", "0")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_the_console_script_is_installed() -> None:
    exe = shutil.which("slotwise") or str(Path(sys.executable).parent / "slotwise")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30, env=ENV)
    assert r.returncode == 0
    for command in ("generate", "chat", "count", "info", "serve", "demo"):
        assert command in r.stdout


# -- the demo ---------------------------------------------------------------------------------


def parse_table(text: str) -> list[dict[str, str]]:
    """Every row of every table the demo printed, keyed by the header's columns."""
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("turn  turn cells"):
            header = re.split(r"\s{2,}", line.strip())
            for row in lines[i + 2 :]:
                if not re.match(r"\s*\d+\s", row):
                    break
                rows.append(dict(zip(header, row.split(), strict=True)))
    return rows


def test_demo_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    r = slotwise("demo", timeout=120)
    wall = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\n[slotwise demo: {wall:.2f} s wall, exit {r.returncode}]")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gibberish" in r.stdout and "real llama.cpp behaviour" in r.stdout
    assert "== mrope" in r.stdout and "== rope" in r.stdout
    rows = parse_table(r.stdout)
    assert len(rows) == 10  # 5 turns on each pair
    assert sum(int(row["shifts"]) for row in rows) > 0
    assert sum(int(row["evicted media"]) for row in rows) > 0  # images leave, whole
    policies = {row["policy"] for row in rows}
    assert "gap" in policies and "shift" in policies  # M-RoPE cannot seq_add; RoPE can
    capacity = int(re.search(r"1 slot x (\d+) cells", r.stdout).group(1))
    assert all(int(row["session cells"]) <= capacity for row in rows)
    mrope, rope = rows[:5], rows[5:]
    # the session keeps its sequence between turns: on M-RoPE positions only grow (GAP), with
    # RoPE they stay equal to the cells (SHIFT moves the kept cells back)
    assert all(int(a["next pos"]) < int(b["next pos"]) for a, b in itertools.pairwise(mrope))
    assert all(row["next pos"] == row["session cells"] for row in rope)
    assert all(row["finish"] in ("stop", "length") for row in rows)
    assert re.search(r"demo ok in [\d.]+ s", r.stdout)
    assert wall < 30


def test_prefill_progress_line_appears_only_when_prefill_is_slow() -> None:
    from clients.cli import Progress
    from clients.client import Prefill

    err = io.StringIO()
    quick = Progress(err, after=10.0)
    quick.update(Prefill(100, 1000))
    assert err.getvalue() == ""
    slow = Progress(err, after=0.0)
    slow.update(Prefill(250, 1000))
    slow.update(Prefill(500, 1000))  # within a second of the last line (not a tty): skipped
    assert err.getvalue() == "prefill 250/1000 cells (25%)\n"


def test_demo_on_a_given_model_pair(tiny: dict[str, Any]) -> None:
    pair = tiny["rope"]  # stands in for a real model: the path a user's --model takes
    r = slotwise(
        "demo", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--turns", "3",
        "--ctx-size", "192", "--max-tokens", "48", "--threads", "1", timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gibberish" not in r.stdout  # the note is for the tiny models only
    rows = parse_table(r.stdout)
    assert [row["turn"] for row in rows] == ["1", "2", "3"]
    assert sum(int(row["shifts"]) for row in rows) > 0
    r = slotwise("demo", "--model", str(pair.model))
    assert r.returncode == 2 and "go together" in r.stderr


def test_one_keys_file_for_the_services_and_the_http_api(tmp_path: Path) -> None:
    """The HTTP API passes each caller's key on: the services must read the same keys file."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("acme key-a\n")
    b.write_text("acme key-b\n")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # (refused before any model is read)
    r = slotwise("serve", "--model", str(model), "--token-file", str(a), "--api-key-file", str(b))
    assert r.returncode == 2 and "two files" in r.stderr, r.stderr
    r = slotwise("gateway", "--prep", "127.0.0.1:1", "--infer", "127.0.0.1:2",
                 "--token-file", str(a), "--api-key-file", str(a))  # fmt: skip
    assert r.returncode == 2 and "each caller's key on" in r.stderr, r.stderr
