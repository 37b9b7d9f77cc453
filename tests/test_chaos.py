"""The short version of tests/chaos.py: 16 clients doing everything at once for 20 seconds
against real service processes, with a sessions directory on a tmpfs that fills and frees."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from chaos import RSS_BOUND_MB, chaos, healthy

pytestmark = pytest.mark.slow  # a documented run's short version


def test_sixteen_chaotic_clients_cannot_stop_the_service_or_lose_a_turn() -> None:
    report = asyncio.run(chaos(clients=16, seconds=20, pair="mrope", seed=7))
    assert report["num_unexpected"] == 0, report["unexpected"]
    assert report["engine_deaths"] == 0 and report["serving"] and report["good_request_ok"]
    assert (report["leaked_slots"], report["leaked_queue"]) == (0, 0)
    assert report["lost_completed_turns"] == 0, report["restore_problems"]
    assert not report["restore_problems"]
    assert report["infer_exit_code"] == 0  # a SIGTERM drain, not a crash
    rss_growth = float(report["rss_end_mb"]) - float(report["rss_start_mb"])  # type: ignore[arg-type]
    assert rss_growth < RSS_BOUND_MB
    assert report["cancels"] and report["deadlines"] and report["dropped_connections"]
    if report["tmpfs"]:  # as root: the disk really filled, and turns said they were not saved
        assert report["disk_full_episodes"] >= 3 and report["turns_not_saved"] > 0
    assert healthy(report)
