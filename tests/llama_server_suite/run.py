"""Run llama.cpp's own server tests (tools/server/tests of the llama.cpp that
llama-cpp-python 0.3.36 vendors), unmodified, against `slotwise serve` or llama-server.

    .venv/bin/python tests/llama_server_suite/run.py                 # slotwise
    .venv/bin/python tests/llama_server_suite/run.py --llama-server /path/to/llama-server

The tests come from the llama-cpp-python sdist (`pip download`, cached), or from --tests DIR;
their presets' hub models (and test_speculative's draft model) become local tiny models
(llama_suite_plugin.py) and LLAMA_SERVER_BIN_PATH is the shim beside this file, which runs
`slotwise serve` with llama-server's flags translated (or the real binary given by
--llama-server, for the baseline on the same models). The files run by default are those
whose models have a local stand-in (FILES); pytest's arguments go after `--`. At the end:
passed and failed by file, and each failed test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VERSION = "0.3.36"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotwise"
# what a test run needs of the sdist, under vendor/llama.cpp/ (the tests read templates and an
# image by paths relative to their own folder)
NEEDED = ("tools/server/tests/", "models/templates/", "tools/mtmd/test-1.jpeg")
FILES = (
    "test_basic.py",
    "test_chat_completion.py",
    "test_compat_anthropic.py",
    "test_compat_oai_responses.py",
    "test_completion.py",
    "test_ctx_shift.py",
    "test_security.py",
    "test_router.py",
    "test_sleep.py",
    "test_speculative.py",
    "test_stream.py",
    "test_template.py",
    "test_tokenize.py",
    "test_tool_call.py",
    "test_vision_api.py",
)


def vendored_tests() -> Path:
    """llama.cpp's tools/server/tests from the sdist, fetched once into the cache."""
    root = CACHE / f"llama-cpp-python-{VERSION}" / "llama.cpp"
    tests = root / "tools" / "server" / "tests"
    if (tests / "utils.py").is_file():
        return tests
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp],
            check=True,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            for member in tar.getmembers():
                rest = member.name.removeprefix(prefix)
                if member.isfile() and member.name.startswith(prefix) and rest.startswith(NEEDED):
                    member.name = rest
                    tar.extract(member, root, filter="data")
    return tests


def tiny_models(out: Path) -> dict[str, object]:
    sys.path.insert(0, str(ROOT))
    from slotwise_core.tiny_models import write_tiny_models

    pairs = write_tiny_models(out, ("rope", "noncausal"))
    text, vision = pairs["rope"], pairs["noncausal"]
    return {
        "text": str(text.model),  # llama, plain RoPE: shifts as llama-server's tinyllama does
        "vision": str(vision.model),  # gemma3 and its projector, as tinygemma3
        "mmproj": {str(vision.model): str(vision.mmproj)},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(junit: Path) -> int:
    counts: dict[str, Counter[str]] = {}
    failed: list[str] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts.setdefault(file, Counter())[outcome] += 1
        if outcome == "failed":
            failed.append(f"{file}::{case.get('name')}")
    total: Counter[str] = Counter()
    print("\nfile                           failed passed skipped")
    for file, c in sorted(counts.items()):
        total += c
        print(f"{file:30} {c['failed']:6} {c['passed']:6} {c['skipped']:7}")
    print(f"{'total':30} {total['failed']:6} {total['passed']:6} {total['skipped']:7}")
    print("\nfailed:\n" + "\n".join(f"  {name}" for name in failed))
    print(f"\n{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", type=Path, help="tools/server/tests of a llama.cpp tree")
    p.add_argument("--llama-server", type=Path, help="run the real llama-server instead")
    p.add_argument("--junit", type=Path, help="keep pytest's JUnit XML here")
    p.add_argument("pytest_args", nargs="*", help="after --: pytest's (default: FILES)")
    args = p.parse_args()
    tests = (args.tests or vendored_tests()).resolve()
    (tests / "tmp").mkdir(exist_ok=True)  # utils.TMP_DIR (load_all, stubbed, would make it)
    work = Path(tempfile.mkdtemp(prefix="llama-server-suite-"))
    try:
        env = {
            **os.environ,
            "LLAMA_SERVER_BIN_PATH": str(HERE / "llama-server"),
            "SLOTWISE_SUITE_MODELS": json.dumps(tiny_models(work / "models")),
            "SLOTWISE_SUITE_PYTHON": sys.executable,
            "SLOTWISE_SUITE_TARGET": "llama-server" if args.llama_server else "slotwise",
            "PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), str(tests)]),
            "LLAMA_CACHE": str(work / "cache"),
        }
        if args.llama_server:
            env["SLOTWISE_SUITE_LLAMA_SERVER"] = str(args.llama_server.resolve())
        junit = args.junit or work / "junit.xml"
        selected = args.pytest_args or [f"unit/{f}" for f in FILES]
        cmd = [sys.executable, "-m", "pytest", "-p", "llama_suite_plugin",
               "-p", "no:cacheprovider", "-c", str(tests / "pytest.ini"), "--rootdir", str(tests),
               "-q", "-rN", "-m", "not slow", "--timeout", "300", f"--junitxml={junit}",
               *selected]  # fmt: skip
        subprocess.run(cmd, cwd=tests, env=env)
        return summary(junit)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
