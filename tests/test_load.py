"""The short version of tests/load.py: concurrent streams through real service processes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from load import run

pytestmark = pytest.mark.slow  # a documented run's short version


def test_sixteen_streams_for_five_seconds_without_errors() -> None:
    result = asyncio.run(run(streams=16, seconds=5, pair="rope", warmup=1))
    assert result["errors"] == {}
    assert isinstance(result["requests"], int) and result["requests"] >= 16
    finished = result["finished"]
    assert isinstance(finished, dict) and sum(finished.values()) == result["requests"]
