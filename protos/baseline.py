"""Wire/JSON compatibility of the protos against a committed baseline (buf-breaking style).

    python protos/baseline.py            # check protos/slotwise/v1/*.proto against the baseline
    python protos/baseline.py --update   # deliberately accept the current protos as the baseline
    python protos/baseline.py --update --ref HEAD  # ... or the protos as committed at a revision

The baseline, protos/baseline/descriptor_set.binpb, is a FileDescriptorSet compiled by protoc
(from grpcio-tools) with --include_imports and without source info, so comments do not matter.

Breaking (a client or server built from the baseline would misread or fail): a message, enum,
service or method that disappears; a field number that disappears without being listed in the
message's `reserved` numbers; a field whose type, message/enum type, label, oneof or name (the
JSON form uses names) changes, or that loses presence (gaining it, implicit -> optional, reads
the same bytes and JSON); an enum value number that disappears without being
reserved, or is renamed; a method whose request/response type or streaming changes.
Additions of any kind are fine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from google.protobuf import descriptor_pb2

PROTO_ROOT = Path(__file__).resolve().parent
BASELINE = PROTO_ROOT / "baseline" / "descriptor_set.binpb"

FDP = descriptor_pb2.FieldDescriptorProto
_TYPE_NAMES = {v: k.removeprefix("TYPE_").lower() for k, v in FDP.Type.items()}
_LABEL_NAMES = {v: k.removeprefix("LABEL_").lower() for k, v in FDP.Label.items()}


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((root / "slotwise" / "v1").glob("*.proto"))


def compile_descriptor_set(root: Path = PROTO_ROOT) -> descriptor_pb2.FileDescriptorSet:
    """protoc the .proto files under root into a FileDescriptorSet (imports included)."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(root)) for p in proto_files(root)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptor_set.binpb"
        args = [
            "protoc",
            f"-I{root}",
            f"-I{include}",
            f"--descriptor_set_out={out}",
            "--include_imports",
            *sources,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def compile_at(ref: str) -> descriptor_pb2.FileDescriptorSet:
    """The descriptor set of the .proto files as committed at a git revision."""
    folder = "protos/slotwise/v1"
    repo = PROTO_ROOT.parent
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{ref}:{folder}"],
        cwd=repo, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "slotwise" / "v1").mkdir(parents=True)
        for name in (n for n in names if n.endswith(".proto")):
            data = subprocess.run(
                ["git", "show", f"{ref}:{folder}/{name}"], cwd=repo, check=True, capture_output=True
            ).stdout
            (root / "slotwise" / "v1" / name).write_bytes(data)
        return compile_descriptor_set(root)


def load(path: Path = BASELINE) -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())


# -- indexing by full name -------------------------------------------------------------------


def _messages(
    prefix: str, messages: list[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for m in messages:
        name = f"{prefix}.{m.name}"
        yield name, m
        yield from _messages(name, list(m.nested_type))


class _Index:
    def __init__(self, fds: descriptor_pb2.FileDescriptorSet):
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
        self.services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
        for f in fds.file:
            prefix = f".{f.package}" if f.package else ""
            self.enums.update((f"{prefix}.{e.name}", e) for e in f.enum_type)
            for name, m in _messages(prefix, list(f.message_type)):
                self.messages[name] = m
                self.enums.update((f"{name}.{e.name}", e) for e in m.enum_type)
            self.services.update((f"{prefix}.{s.name}", s) for s in f.service)


# -- the check -------------------------------------------------------------------------------


def _reserved(ranges, number: int) -> bool:
    # DescriptorProto.ReservedRange.end is exclusive; EnumReservedRange.end is inclusive
    return any(r.start <= number < r.end for r in ranges)


def _enum_reserved(ranges, number: int) -> bool:
    return any(r.start <= number <= r.end for r in ranges)


def _field_type(f: descriptor_pb2.FieldDescriptorProto) -> str:
    return f.type_name.lstrip(".") if f.type_name else _TYPE_NAMES[f.type]


def _oneof(m: descriptor_pb2.DescriptorProto, f: descriptor_pb2.FieldDescriptorProto) -> str:
    """The real oneof a field belongs to ('' for none; proto3 `optional` is not a real oneof)."""
    if not f.HasField("oneof_index") or f.proto3_optional:
        return ""
    return m.oneof_decl[f.oneof_index].name


def _check_message(
    name: str, old: descriptor_pb2.DescriptorProto, new: descriptor_pb2.DescriptorProto
) -> Iterator[str]:
    new_fields = {f.number: f for f in new.field}
    for f in old.field:
        where = f"{name.lstrip('.')}.{f.name} (field {f.number})"
        g = new_fields.get(f.number)
        if g is None:
            if not _reserved(new.reserved_range, f.number):
                yield f"{where}: deleted without reserving its number"
            continue
        if g.name != f.name:
            yield f"{where}: renamed to {g.name!r} (breaks the JSON form and name-based clients)"
        if g.json_name != f.json_name:
            yield f"{where}: json_name changed from {f.json_name!r} to {g.json_name!r}"
        if _field_type(g) != _field_type(f):
            yield f"{where}: type changed from {_field_type(f)} to {_field_type(g)}"
        if g.label != f.label:
            yield (
                f"{where}: label changed from {_LABEL_NAMES[f.label]} to {_LABEL_NAMES[g.label]}"
            )
        if f.proto3_optional and not g.proto3_optional:  # gaining presence is wire-compatible
            yield (
                f"{where}: presence changed "
                f"({'optional' if f.proto3_optional else 'implicit'} -> "
                f"{'optional' if g.proto3_optional else 'implicit'})"
            )
        if _oneof(new, g) != _oneof(old, f):
            yield (
                f"{where}: oneof changed from {_oneof(old, f) or '(none)'!r} to "
                f"{_oneof(new, g) or '(none)'!r}"
            )


def _check_enum(
    name: str, old: descriptor_pb2.EnumDescriptorProto, new: descriptor_pb2.EnumDescriptorProto
) -> Iterator[str]:
    new_values = {v.number: v for v in new.value}
    for v in old.value:
        where = f"{name.lstrip('.')}.{v.name} (value {v.number})"
        w = new_values.get(v.number)
        if w is None:
            if not _enum_reserved(new.reserved_range, v.number):
                yield f"{where}: deleted without reserving its number"
        elif w.name != v.name:
            yield f"{where}: renamed to {w.name!r} (breaks the JSON form)"


def _check_service(
    name: str,
    old: descriptor_pb2.ServiceDescriptorProto,
    new: descriptor_pb2.ServiceDescriptorProto,
) -> Iterator[str]:
    new_methods = {m.name: m for m in new.method}
    for m in old.method:
        where = f"{name.lstrip('.')}.{m.name}"
        n = new_methods.get(m.name)
        if n is None:
            yield f"{where}: method deleted"
            continue
        for what in ("input_type", "output_type"):
            a, b = getattr(m, what).lstrip("."), getattr(n, what).lstrip(".")
            if a != b:
                yield f"{where}: {what} changed from {a} to {b}"
        for what in ("client_streaming", "server_streaming"):
            if getattr(m, what) != getattr(n, what):
                yield f"{where}: {what} changed to {getattr(n, what)}"


def breaking_changes(
    baseline: descriptor_pb2.FileDescriptorSet, current: descriptor_pb2.FileDescriptorSet
) -> list[str]:
    """Every change from baseline to current that breaks wire or JSON compatibility."""
    old, new = _Index(baseline), _Index(current)
    problems: list[str] = []
    for kind, old_map, new_map, check in (
        ("message", old.messages, new.messages, _check_message),
        ("enum", old.enums, new.enums, _check_enum),
        ("service", old.services, new.services, _check_service),
    ):
        for name, o in old_map.items():
            n = new_map.get(name)
            if n is None:
                problems.append(f"{name.lstrip('.')}: {kind} deleted")
            else:
                problems.extend(check(name, o, n))  # type: ignore[operator]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="write the protos as the baseline")
    parser.add_argument("--ref", help="with --update: take the protos committed at this git ref")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    args = parser.parse_args(argv)
    if args.ref and not args.update:
        parser.error("--ref goes with --update")
    current = compile_at(args.ref) if args.ref else compile_descriptor_set()
    if args.update:
        args.baseline.parent.mkdir(parents=True, exist_ok=True)
        args.baseline.write_bytes(current.SerializeToString(deterministic=True))
        print(f"wrote {args.baseline}")
        return 0
    problems = breaking_changes(load(args.baseline), current)
    for p in problems:
        print(f"BREAKING: {p}", file=sys.stderr)
    if problems:
        print(
            "reserve the numbers of deleted fields/values, or, if the break is deliberate "
            "(a new package version), run: python protos/baseline.py --update",
            file=sys.stderr,
        )
        return 1
    print(f"compatible with {args.baseline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
