"""Skips that CI must not take: a test that needs a tool skips, saying why, where the tool is
absent, but fails where the run says the tool is there.

.ci/run installs nginx, chromium, node's packages and buf, and names those it got in
SLOTWISE_REQUIRE (`nginx,chromium,node,buf`): a suite that skipped them all would otherwise
go green without having run them.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE = "SLOTWISE_REQUIRE"


def required() -> set[str]:
    """The tools this run must have (SLOTWISE_REQUIRE, comma-separated)."""
    return {t.strip() for t in os.environ.get(REQUIRE, "").split(",") if t.strip()}


def require_or_skip(tool: str, reason: str) -> NoReturn:
    """Skip for want of `tool`, or fail where SLOTWISE_REQUIRE names it."""
    if tool in required():
        pytest.fail(f"{reason}; yet {REQUIRE} says this run has {tool}", pytrace=False)
    pytest.skip(reason)
