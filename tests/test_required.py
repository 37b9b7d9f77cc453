"""The skip points for the tools .ci/run installs (tests/support/required.py): a skip where the
run does not name the tool in SLOTWISE_REQUIRE, a failure where it does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.required import REQUIRE, require_or_skip, required

TESTS = Path(__file__).resolve().parent


def test_a_tool_the_run_does_not_require_is_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    for named in (None, "", "chromium, node", "nginxx"):
        if named is None:
            monkeypatch.delenv(REQUIRE, raising=False)
        else:
            monkeypatch.setenv(REQUIRE, named)
        with pytest.raises(pytest.skip.Exception, match="no nginx here"):
            require_or_skip("nginx", "no nginx here")


def test_a_tool_the_run_requires_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE, "nginx, chromium,node,buf")
    assert required() == {"nginx", "chromium", "node", "buf"}
    for tool in sorted(required()):
        with pytest.raises(pytest.fail.Exception, match=f"no {tool} here.*{REQUIRE}"):
            require_or_skip(tool, f"no {tool} here")


def test_a_module_that_would_skip_fails_the_run_where_its_tool_is_required(
    tmp_path: Path,
) -> None:
    """A whole run, as .ci/run's: its exit status is a failure, not a green run of skips."""
    (tmp_path / "test_needs_a_tool.py").write_text(
        "import pytest\n"
        "from support.required import require_or_skip\n\n"
        "@pytest.fixture(scope='module', autouse=True)\n"
        "def needs_frob():\n"
        "    require_or_skip('frob', 'no frob here')\n\n"
        "def test_one():\n"
        "    pass\n"
    )

    def run(require: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": str(TESTS), REQUIRE: require, "PATH": ""},
            cwd=tmp_path,
        )

    skipped = run("nginx")
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    failed = run("nginx,frob")
    assert failed.returncode == 1 and "1 error" in failed.stdout, failed.stdout
    assert "no frob here" in failed.stdout
