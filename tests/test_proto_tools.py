"""The protos, checked by buf with the rules in buf.yaml: `buf lint`, and `buf breaking` against
the committed baseline protos/baseline/descriptor_set.binpb (the published contract). A
deliberate break (a new package version) takes the current protos as the baseline:

    buf build --exclude-source-info --as-file-descriptor-set -o protos/baseline/descriptor_set.binpb

buf is the npm package @bufbuild/buf, pinned in tests/contract/node/package.json (`npm ci`
there installs it). Copies of the protos with one change show that both checks do fail.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from support.required import require_or_skip

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "protos" / "baseline" / "descriptor_set.binpb"
NODE_MODULES = ROOT / "tests" / "contract" / "node" / "node_modules"


@pytest.fixture(scope="module")
def buf() -> str:
    # the binary of npm's platform package (the one that fits is installed), else npm's node
    # wrapper around it, else a buf on PATH
    npm = [*sorted(NODE_MODULES.glob("@bufbuild/buf-*/bin/buf")), NODE_MODULES / ".bin" / "buf"]
    found = next((str(p) for p in npm if p.exists()), None) or shutil.which("buf")
    if found is None:
        require_or_skip(
            "buf", "no buf binary: `npm ci` in tests/contract/node installs it (needs npm)"
        )
    return found


def run_buf(buf: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([buf, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def violations(done: subprocess.CompletedProcess[str]) -> set[str]:
    """The rule ids buf names in its --error-format json output (one object a line)."""
    return {json.loads(line)["type"] for line in done.stdout.splitlines() if line.strip()}


def changed_copy(tmp_path: Path, file: str, old: str, new: str) -> Path:
    """buf.yaml and the protos in tmp_path, with `old` replaced by `new` (once) in one file."""
    shutil.copy(ROOT / "buf.yaml", tmp_path)
    folder = tmp_path / "protos" / "slotwise" / "v1"
    folder.mkdir(parents=True)
    for proto in (ROOT / "protos" / "slotwise" / "v1").glob("*.proto"):
        shutil.copy(proto, folder)
    path = folder / file
    text = path.read_text()
    assert text.count(old) == 1, f"{file} no longer has exactly one {old!r}: update the test"
    path.write_text(text.replace(old, new))
    return tmp_path


def test_the_baseline_is_a_snapshot_of_the_protos() -> None:
    baseline = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    names = {f"slotwise/v1/{p.name}" for p in (ROOT / "protos" / "slotwise" / "v1").glob("*.proto")}
    assert names and names <= {f.name for f in baseline.file}


def test_buf_lint_passes(buf: str) -> None:
    done = run_buf(buf, "lint")
    assert done.returncode == 0, done.stdout + done.stderr


def test_buf_breaking_passes_against_the_baseline(buf: str) -> None:
    done = run_buf(buf, "breaking", "--against", str(BASELINE))
    assert done.returncode == 0, (
        "breaking proto changes: reserve the numbers and names of deleted fields and values; a "
        "deliberate break needs a new package version and a new baseline (see buf.yaml)\n"
        + done.stdout
        + done.stderr
    )


def test_buf_lint_fails_on_a_violation(buf: str, tmp_path: Path) -> None:
    root = changed_copy(tmp_path, "prompt.proto", "message_index = 1;", "messageIndex = 1;")
    done = run_buf(buf, "lint", "--error-format", "json", cwd=root)
    assert done.returncode != 0
    assert "FIELD_LOWER_SNAKE_CASE" in violations(done), done.stdout + done.stderr


# (file, old, new, the rule buf names)
BREAKING = {
    "field renumbered": (
        "prompt.proto",
        "num_cells = 2;",
        "num_cells = 12;",
        "FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED",
    ),
    "field deleted": (
        "prompt.proto",
        "  uint32 message_index = 1;\n",
        "",
        "FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED",
    ),
    "field deleted, only its number reserved": (
        "prompt.proto",
        "  uint32 message_index = 1;\n",
        "  reserved 1;\n",
        "FIELD_NO_DELETE_UNLESS_NAME_RESERVED",
    ),
    "field type changed": (
        "prompt.proto",
        "uint32 num_positions = 3;",
        "string num_positions = 3;",
        "FIELD_WIRE_JSON_COMPATIBLE_TYPE",
    ),
    "field renamed": (
        "prompt.proto",
        "string mmproj = 2;",
        "string projector = 2;",
        "FIELD_SAME_JSON_NAME",
    ),
    "field loses presence": (
        "infer.proto",
        "optional float temperature = 1;",
        "float temperature = 1;",
        "FIELD_SAME_CARDINALITY",
    ),
    "enum value renamed": (
        "infer.proto",
        "FINISH_REASON_STOP = 1;",
        "FINISH_REASON_EOS = 1;",
        "ENUM_VALUE_SAME_NAME",
    ),
    "method stops streaming": (
        "infer.proto",
        "returns (stream GenerateResponse)",
        "returns (GenerateResponse)",
        "RPC_SAME_SERVER_STREAMING",
    ),
    "method deleted": (
        "prep.proto",
        "  rpc CountTokens(CountTokensRequest) returns (CountTokensResponse);\n",
        "",
        "RPC_NO_DELETE",
    ),
}

COMPATIBLE = {
    "field added": ("prompt.proto", "message Chunk {\n", "message Chunk {\n  string note = 99;\n"),
    "field deleted, its number and name reserved": (
        "prompt.proto",
        "  uint32 message_index = 1;\n",
        '  reserved 1;\n  reserved "message_index";\n',
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKING))
def test_buf_breaking_fails_on_a_breaking_change(buf: str, tmp_path: Path, case: str) -> None:
    file, old, new, rule = BREAKING[case]
    root = changed_copy(tmp_path, file, old, new)
    done = run_buf(buf, "breaking", "--against", str(BASELINE), "--error-format", "json", cwd=root)
    assert done.returncode != 0, f"{case}: buf breaking passed"
    assert rule in violations(done), done.stdout + done.stderr


@pytest.mark.parametrize("case", sorted(COMPATIBLE))
def test_buf_breaking_accepts_a_compatible_change(buf: str, tmp_path: Path, case: str) -> None:
    root = changed_copy(tmp_path, *COMPATIBLE[case])
    done = run_buf(buf, "breaking", "--against", str(BASELINE), cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
