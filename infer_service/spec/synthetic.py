"""llama-server's synthetic acceptance (`--spec-synth-rates`, `--spec-synth-len`), a
benchmarking aid: a draft is accepted at a given rate whatever the model samples, so its
output is not the model's. Pure."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence


def synth_rates(rates: Sequence[float], length: float | None, n_max: int) -> tuple[float, ...]:
    """llama-server's --spec-synth-rates (per position, non-increasing) or --spec-synth-len
    (a mean acceptance length, the target's token included: geometric rates), as the
    conditional probabilities a draft is accepted given the ones before were (llama.cpp's
    common_speculative_synth_rates_resolve). ValueError as llama.cpp's invalid_argument."""
    if rates and length is not None:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    if not rates and length is None:
        return ()
    if rates:
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values")
        if any(not 0.0 <= r <= 1.0 for r in rates) or any(
            b > a for a, b in itertools.pairwise(rates)
        ):
            raise ValueError("synthetic acceptance rates must be within [0, 1], non-increasing")
        resolved = list(rates)
    else:
        assert length is not None
        if not 1.0 <= length <= n_max + 1:
            raise ValueError(f"synthetic acceptance length must be within [1, {n_max + 1}]")
        p = 1.0 if length == n_max + 1 else _geometric(length - 1.0, n_max)
        resolved = [p ** (i + 1) for i in range(n_max)]
    out, before = [], 1.0
    for rate in resolved:
        out.append(rate / before if before > 0 else 0.0)
        before = rate
    return tuple(out)


def _geometric(expected: float, n: int) -> float:
    """p with p + p^2 + ... + p^n = expected (bisection, as llama.cpp)."""
    lo, hi = 0.0, 1.0
    for _ in range(32):
        mid = (lo + hi) / 2
        if sum(mid ** (j + 1) for j in range(n)) < expected:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2 if expected > 0 else 0.0


class SyntheticAcceptance:
    """A request's draws for --spec-synth-rates: seeded by its sampling seed, so the same
    request drafts and accepts the same."""

    def __init__(self, probs: tuple[float, ...], seed: int | None):
        self.probs = probs
        self.rng = random.Random(seed)

    def accepts(self, i: int) -> bool:
        return self.rng.random() < self.probs[min(i, len(self.probs) - 1)]
