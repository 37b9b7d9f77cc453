"""The dependency picture holds, one way: clients -> stubs; services -> core -> stubs; the
ledger -> stdlib only. Read from the sources' import statements (lazy imports included)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the first-party packages it may import (besides itself)
ALLOWED = {
    "slotwise_core": {"slotwise"},
    "prep_service": {"slotwise_core", "slotwise"},
    "infer_service": {"slotwise_core", "slotwise"},
    "clients": {"slotwise"},
    "slotwise_serve": {"prep_service", "infer_service", "slotwise_core", "clients", "slotwise"},
    "benchmarks": {"prep_service", "infer_service", "slotwise_core", "clients", "slotwise"},
}
FIRST_PARTY = {*ALLOWED, "slotwise"}
# what only the serve extra installs: the client side never imports it
SERVE_ONLY = {"llama_cpp", "numpy", "PIL", "gguf", "grpc_reflection"}
# clients' commands that need the serve extra import it lazily, behind a check (clients.cli)
LAZY_SERVE = {"clients/cli.py": {"slotwise_serve", "benchmarks"}}
# the keys file has one definition for every service and the HTTP edge: the edge imports it
# (it imports the stdlib only, so a client-only install runs it)
SHARED = {"slotwise_core.keys"}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n.split(".")[0] for n in names - SHARED}


def eager_imports(path: Path) -> set[str]:
    """What importing the module imports: top-level statements, not those in functions or
    under ``if TYPE_CHECKING:`` (the client takes PIL images only where PIL is there)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n.split(".")[0] for n in names}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_they_may(package: str) -> None:
    wrong = {}
    for path in modules(package):
        rel = str(path.relative_to(ROOT))
        allowed = ALLOWED[package] | {package} | LAZY_SERVE.get(rel, set())
        bad = (imports(path) & FIRST_PARTY) - allowed
        if bad:
            wrong[rel] = sorted(bad)
    assert not wrong, f"imports against the dependency picture: {wrong}"


def test_the_services_never_import_each_other() -> None:
    for a, b in (("infer_service", "prep_service"), ("prep_service", "infer_service")):
        for path in modules(a):
            assert b not in imports(path), f"{path.relative_to(ROOT)} imports {b}"


def test_the_pure_logic_imports_the_stdlib_only() -> None:
    for name in ("infer_service/ledger", "infer_service/text_stream", "slotwise_core/keys"):
        path = ROOT / f"{name}.py"
        outside = imports(path) - set(sys.stdlib_module_names) - {"__future__"}
        assert not outside, f"{name} imports {outside}"
    for name in ("state_cache", "kv_view"):  # (they build on the ledger)
        found = imports(ROOT / "infer_service" / f"{name}.py")
        assert found - set(sys.stdlib_module_names) - {"__future__", "infer_service"} == set()


def test_the_client_side_needs_no_serve_extra() -> None:
    for path in modules("clients"):
        bad = eager_imports(path) & SERVE_ONLY
        assert not bad, f"{path.relative_to(ROOT)} imports {bad} (the serve extra)"


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from prep_service.chat import x\n    import numpy.linalg\n")
    assert {"prep_service", "numpy"} <= imports(bad)
    assert not eager_imports(bad)
    bad.write_text("import numpy\n")
    assert eager_imports(bad) == {"numpy"}
