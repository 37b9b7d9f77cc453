"""Regenerate the committed Python stubs from protos/slotwise/v1/*.proto.

python protos/codegen.py            # write next to the .proto files
python protos/codegen.py --out DIR  # write elsewhere (the drift test compares the two)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "slotwise" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the files written under out."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted(p for p in (out / "slotwise" / "v1").iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
