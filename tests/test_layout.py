"""The dependency picture holds, one way: the `slotwise` command tree (slotwise_cli) -> all;
clients -> stubs; services -> core -> stubs (the contracts in pyproject.toml, checked by
import-linter); the ledger -> stdlib only, and the client side without the serve extra (read from
the sources' import statements)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]

# what only the serve extra installs: the client side never imports it
SERVE_ONLY = {"llama_cpp", "numpy", "PIL", "gguf", "grpc_reflection"}
# what `pip install .` (no extra) runs: the client and the command tree over it
CLIENT_SIDE = ("clients", "slotwise_cli")


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n.split(".")[0] for n in names}


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


def test_packages_import_only_what_they_may(monkeypatch) -> None:
    """The contracts in pyproject.toml's [tool.importlinter], checked by import-linter."""
    monkeypatch.chdir(ROOT)
    assert lint_imports(no_cache=True, no_logo=True) == 0


def lint_probe(tmp_path: Path, monkeypatch, late: str, contract: str) -> int:
    """lint-imports on two packages of their own (the real ones are imported already: their
    modules would be read), the first importing the second inside a function of late.py."""
    first, second = "layout_probe_a", "layout_probe_b"
    for package in (first, second):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / second / "command.py").write_text("")
    (tmp_path / first / "late.py").write_text(f"def f():\n    {late.format(second)}\n")
    (tmp_path / ".importlinter").write_text(
        f"[importlinter]\nroot_packages =\n    {first}\n    {second}\n"
        f"[importlinter:contract:1]\nname = probe\n{contract.format(first, second)}"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return lint_imports(no_cache=True, no_logo=True)


def test_import_linter_sees_a_wrong_import(tmp_path: Path, monkeypatch) -> None:
    independent = "type = independence\nmodules =\n    {0}\n    {1}\n"
    assert lint_probe(tmp_path, monkeypatch, "import {}", independent) == 1


def test_import_linter_sees_a_lazy_import_a_forbidden_contract_forbids(
    tmp_path: Path, monkeypatch
) -> None:
    # as clients.cli once reached up into slotwise_serve inside a function
    below = "type = forbidden\nsource_modules =\n    {0}\nforbidden_modules =\n    {1}\n"
    assert lint_probe(tmp_path, monkeypatch, "from {} import command", below) == 1


def test_the_pure_logic_imports_the_stdlib_only() -> None:
    for name in (
        "infer_service/kv/ledger", "infer_service/runner/text_stream",
        "infer_service/sessions/header_delta", "infer_service/runner/step_budget",
        "infer_service/spec/proposer", "slotwise_core/keys", "slotwise_core/enum_names",
    ):  # fmt: skip
        path = ROOT / f"{name}.py"
        outside = imports(path) - set(sys.stdlib_module_names) - {"__future__"}
        assert not outside, f"{name} imports {outside}"
    for name in ("host_cache", "view", "pool"):  # (they build on the ledger)
        found = imports(ROOT / "infer_service" / "kv" / f"{name}.py")
        assert found - set(sys.stdlib_module_names) - {"__future__", "infer_service"} == set()
    # every draft source builds on the proposer's protocol, and nothing else
    for path in sorted((ROOT / "infer_service" / "spec").glob("*.py")):
        found = imports(path) - set(sys.stdlib_module_names) - {"__future__", "infer_service"}
        assert found == set(), f"{path.name} imports {found}"


def test_the_client_side_needs_no_serve_extra() -> None:
    for path in (p for package in CLIENT_SIDE for p in modules(package)):
        bad = eager_imports(path) & SERVE_ONLY
        assert not bad, f"{path.relative_to(ROOT)} imports {bad} (the serve extra)"


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from prep_service.chat import x\n    import numpy.linalg\n")
    assert {"prep_service", "numpy"} <= imports(bad)
    assert not eager_imports(bad)
    bad.write_text("import numpy\n")
    assert eager_imports(bad) == {"numpy"}
