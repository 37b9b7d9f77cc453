"""Record llama-server's own answers to the requests tests/test_llama_server_api.py sends to
slotwise, on the same generated tiny model (the `rope` pair, whose bytes every run writes the
same), into recorded.json beside this file. The tests compare slotwise's bodies with these,
field by field; they never run llama-server.

    python tests/llama_server/record.py --server PATH/TO/llama-server

PATH is the llama-server built from the llama.cpp that llama-cpp-python 0.3.36 vendors
(vendor/llama.cpp/build/bin/llama-server). It runs as the tests' stack does: 1024 cells over
2 slots, the projector loaded, --slot-save-path; once more with --embeddings; and on the
model with fill-in-the-middle tokens (fim.py) for /infill. The media
marker is pinned (LLAMA_MEDIA_MARKER) to the one slotwise's /props reports, so that the bodies
do not change from run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from llama_server.cases import (  # noqa: E402
    CASES,
    EMBEDDING_CASES,
    FIM_CASES,
    MARKER,
    NO_SLOT_PATH_CASES,
    answer,
)
from llama_server.fim import write_fim_model  # noqa: E402
from slotwise_core.tiny_models import write_tiny_models  # noqa: E402
from support.procs import free_port  # noqa: E402


@contextlib.contextmanager
def llama_server(binary: Path, *args: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "LLAMA_MEDIA_MARKER": MARKER}
    argv = [str(binary), "--no-repack", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError("llama-server did not come up")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", type=Path, required=True, help="the llama-server binary")
    args = parser.parse_args()
    recorded: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pair = write_tiny_models(Path(tmp) / "tiny", ("rope",))["rope"]
        model = ["-m", str(pair.model), "-c", "1024", "-np", "2", "-t", "1"]
        saves = Path(tmp) / "slots"
        saves.mkdir()
        with llama_server(
            args.server, *model, "--mmproj", str(pair.mmproj), "--slot-save-path", f"{saves}/"
        ) as url:
            for name, case in CASES.items():
                recorded[name] = answer(url, case)
        with llama_server(args.server, *model, "--embeddings", "--pooling", "mean") as url:
            for name, case in {**EMBEDDING_CASES, **NO_SLOT_PATH_CASES}.items():
                recorded[name] = answer(url, case)
        fim = ["-m", str(write_fim_model(Path(tmp))), *model[2:]]
        with llama_server(args.server, *fim) as url:
            for name, case in FIM_CASES.items():
                recorded[name] = answer(url, case)
    out = HERE / "recorded.json"
    out.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"{len(recorded)} answers -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
