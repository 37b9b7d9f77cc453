"""Streams while another model loads (issue 51): a router (`slotwise serve --models-dir`)
streams from model A while model B is loaded beside it (its process starts, reads its GGUF,
allocates, warms up, on the same cores). Printed per run, and the median over runs:

- A's largest gap between tokens while B loads (B's `loading` to its `loaded` on
  /models/sse) over A's median gap outside that window, goal <= 3 on 2 cores;
- B's load time, and A's tokens per second while B loads over outside.

    python -m benchmarks.router_load                       # tiny generated pairs
    python -m benchmarks.router_load --models-dir DIR --stream MODEL --load OTHER
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

GOAL = 3.0


@dataclass
class Run:
    load_seconds: float
    median_gap_ms: float  # A's, outside B's load
    largest_gap_during_load_ms: float
    ratio: float
    tokens_per_second_ratio: float  # A's while B loads / outside


def _router(models_dir: Path, threads: int, ctx: int) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "slotwise_cli", "serve", "--models-dir", str(models_dir),
            "--models-max", "0", "--http-port", "0", "--threads", str(threads),
            "--prep-threads", "1", "--ctx-size", str(ctx)]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    for line in p.stdout:
        if m := re.search(r"router on \S+:(\d+) ", line):
            threading.Thread(target=p.stdout.read, daemon=True).start()  # (drain it)
            return p, f"http://127.0.0.1:{m[1]}"
    raise SystemExit("the router did not start")


def _stream(url: str, model: str, n: int, times: list[float], started: threading.Event) -> None:
    body = {"model": model, "prompt": "Once upon a time", "n_predict": n, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
                if len(times) == 32:
                    started.set()


def _load_window(url: str, model: str) -> tuple[float, float]:
    """B loaded while A streams: when /models/sse said loading, and loaded."""
    marks: dict[str, float] = {}
    with httpx.stream("GET", f"{url}/models/sse", timeout=600) as events:
        lines = events.iter_lines()
        next(lines)  # (subscribed)
        r = httpx.post(f"{url}/models/load", json={"model": model}, timeout=60)
        r.raise_for_status()
        for line in lines:
            if line.startswith("data: "):
                e = json.loads(line[6:])
                if e["model"] == model and e["event"] == "model_status":
                    marks[e["data"]["status"]] = time.perf_counter()
                    if e["data"]["status"] in ("loaded", "unloaded"):
                        break
    if "loaded" not in marks:
        raise SystemExit(f"{model} did not load: {marks}")
    return marks["loading"], marks["loaded"]


def one_run(url: str, stream: str, load: str, tokens: int) -> Run:
    times: list[float] = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(url, stream, tokens, times, started))
    t.start()
    if not started.wait(120):
        raise SystemExit("A did not stream")
    t0, t1 = _load_window(url, load)
    t.join()
    if times[-1] <= t1:
        raise SystemExit(f"A ended before B loaded: raise --tokens (now {tokens})")
    gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
    inside = [g for g, at in gaps if t0 <= at <= t1]
    outside = [g for g, at in gaps if not t0 <= at <= t1]
    median = statistics.median(outside)
    largest = max(inside, default=0.0)
    rate_in = len(inside) / (t1 - t0)
    rate_out = len(outside) / sum(outside)
    httpx.post(f"{url}/models/unload", json={"model": load}, timeout=60).raise_for_status()
    _wait_unloaded(url, load)
    return Run(t1 - t0, median * 1e3, largest * 1e3, largest / median, rate_in / rate_out)


def _wait_unloaded(url: str, model: str) -> None:
    for _ in range(600):
        data = httpx.get(f"{url}/models", timeout=60).json()["data"]
        if next(m for m in data if m["id"] == model)["status"]["value"] == "unloaded":
            return
        time.sleep(0.05)
    raise SystemExit(f"{model} did not unload")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, help="default: tiny generated pairs")
    ap.add_argument("--stream", default="rope", help="model A, streaming (default rope)")
    ap.add_argument("--load", default="mrope", help="model B, loaded beside it (default mrope)")
    ap.add_argument("--tokens", type=int, default=3000, help="A's stream (default 3000)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="each model's (default 1)")
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--json", type=Path, help="write the runs and their medians here")
    o = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = o.models_dir or _tiny(Path(tmp))
        router, url = _router(folder, o.threads, o.ctx_size)
        try:
            warm = {"model": o.stream, "prompt": "warm", "n_predict": 4}
            httpx.post(f"{url}/completion", json=warm, timeout=120).raise_for_status()
            runs = [one_run(url, o.stream, o.load, o.tokens) for _ in range(o.runs)]
        finally:
            router.terminate()
            router.wait(60)
    print(f"{'run':>4} {'B loads s':>10} {'A median gap ms':>16} {'A largest in load ms':>21} "
          f"{'ratio':>6} {'A tok/s in/out':>15}")  # fmt: skip
    for k, r in enumerate(runs, 1):
        print(f"{k:>4} {r.load_seconds:>10.2f} {r.median_gap_ms:>16.2f} "
              f"{r.largest_gap_during_load_ms:>21.2f} {r.ratio:>6.2f} "
              f"{r.tokens_per_second_ratio:>15.2f}")  # fmt: skip
    ratio = statistics.median(r.ratio for r in runs)
    verdict = "met" if ratio <= GOAL else "missed"
    print(f"A's largest gap while B loads / its median gap: {ratio:.2f} (median of {len(runs)}; "
          f"goal <= {GOAL:g}: {verdict})")  # fmt: skip
    if o.json:
        result: dict[str, Any] = {"command": " ".join(sys.argv), "runs": [asdict(r) for r in runs],
                                  "ratio": ratio, "goal": GOAL}  # fmt: skip
        o.json.write_text(json.dumps(result, indent=1))
    return 0


def _tiny(out: Path) -> Path:
    from slotwise_core.tiny_models import write_tiny_models

    pairs = write_tiny_models(out / "pairs", ("rope", "mrope"))
    folder = out / "models"
    for name, pair in pairs.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "model.gguf").symlink_to(pair.model)
        (folder / name / "mmproj.gguf").symlink_to(pair.mmproj)
    return folder


if __name__ == "__main__":
    sys.exit(main())
