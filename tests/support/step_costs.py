"""Step costs fixed for a run, where the executor would measure them, and its clock stopped:
which prompts share a step, and in which order (infer_service/runner/prefill_order.py), then
follow the script, not the clock, so an oracle's seed replays the same steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CPU = (0.02, 0.004)  # two cores beside a long prefix: a small step's fixed cost, then per cell
GPU = (0.05, 0.00001)  # the weights' read is the step


def linear(t0: float, c: float) -> Callable[[int], float]:
    return lambda n: 0.0 if n <= 0 else t0 + c * n


class FixedCost:
    """The step costs of a machine, t0 + c*n seconds for n cells (None: none measured)."""

    def __init__(self, line: tuple[float, float] | None = CPU):
        self._line = line

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def line(self) -> tuple[float, float] | None:
        return self._line

    def estimate(self, num_tokens: int) -> float | None:
        return None if self._line is None else linear(*self._line)(num_tokens)


def replayable(executor: Any, line: tuple[float, float] | None = CPU) -> None:
    """The executor's step costs fixed and its clock stopped (no prompt ages but by script)."""
    executor.prefill_cost = FixedCost(line)
    executor.clock = lambda: 0.0
