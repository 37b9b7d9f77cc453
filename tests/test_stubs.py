"""The committed stubs are exactly what protos/codegen.py generates from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "protos" / "slotwise" / "v1"


def load_codegen():
    spec = importlib.util.spec_from_file_location(
        "slotwise_codegen", ROOT / "protos" / "codegen.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regenerated_stubs_are_byte_identical(tmp_path: Path) -> None:
    codegen = load_codegen()
    protos = codegen.proto_files()
    assert {p.name for p in protos} == {"prompt.proto", "prep.proto", "infer.proto"}
    generated = codegen.generate(tmp_path)
    names = {p.name for p in generated}
    # every .proto gives message stubs, type stubs and service stubs
    expected = {f"{p.stem}_pb2{suffix}" for p in protos for suffix in (".py", ".pyi", "_grpc.py")}
    assert names == expected
    committed = {p.name for p in COMMITTED.iterdir() if "_pb2" in p.name}
    assert committed == expected, "stale or missing committed stubs: run python protos/codegen.py"
    drifted = [p.name for p in generated if p.read_bytes() != (COMMITTED / p.name).read_bytes()]
    assert not drifted, f"stubs out of date, run python protos/codegen.py: {drifted}"


def test_codegen_command_line_writes_where_told(tmp_path: Path) -> None:
    codegen = load_codegen()
    assert codegen.main(["--out", str(tmp_path)]) == 0
    written = sorted(p.name for p in (tmp_path / "slotwise" / "v1").iterdir())
    assert written == sorted(p.name for p in COMMITTED.iterdir() if "_pb2" in p.name)
