"""Which prompts an engine step decodes, and in which order (stdlib only).

A burst of requests that share a cached prefix leaves each a few tokens of its own to decode.
Decoded all in one step, every one of them gets its first token when the last one's prompt is
done; decoded shortest first within a budget per step, the first ones get theirs a step sooner
and the rest one step after their own prefill (vLLM and SGLang order short prefills first
within a token budget the same way). The budget is this machine's: the prompt cells whose step
costs at most STEP_SPAN one-token steps (`StepCost`, measured from the engine's own steps). On
two CPU cores (Gemma 3 270M beside a 1,600-token prefix: a one-token step 18 ms, about 3 ms a
cell more) that is about 100 cells, seven or eight chats of ~13 tokens; on a GPU, where the
weights' read is most of a step, thousands: a burst goes in one step. The slots that generate
wait for every step too: STEP_SPAN bounds what a burst adds to their next token (vLLM's
default chunk of 2,048 tokens is about as many one-token steps of a mid-sized model on a GPU).

Aging keeps a long prompt from waiting behind a stream of short ones: its place improves by
AGING seconds of its own work for every second it waits, so a prompt waits for shorter ones
about 1/AGING of what it takes itself, at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

AGING = 4.0
STEP_SPAN = 16
# (aging before the engine measured a prompt cell's cost: a CPU's order of magnitude, so that
# a long prompt never waits without bound)
UNMEASURED_SECONDS_PER_CELL = 0.002


def priority(remaining: int, waited: float, seconds_per_cell: float) -> float:
    """A prompt's place in the step's order (lowest first): the cells it has left, less AGING
    times those the engine could have decoded of it in the seconds it waited."""
    if seconds_per_cell <= 0:
        return float(remaining)
    return remaining - AGING * waited / seconds_per_cell


def step_budget(
    num_generating: int, seconds: Callable[[int], float | None], batch_size: int
) -> int:
    """Prompt cells one step takes beside `num_generating` tokens: the most whose step costs
    at most STEP_SPAN one-token steps (`seconds(n)`: what a step of n cells takes; None: not
    measured yet, and the whole batch goes)."""
    one = seconds(1)
    if one is None:
        return batch_size
    limit = STEP_SPAN * one
    lo, hi = 0, batch_size  # (the most n with seconds(num_generating + n) <= limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cost = seconds(num_generating + mid)
        if cost is not None and cost <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def admitted(takes: Sequence[int], budget: int) -> int:
    """How many of the prompts (in priority order; the cells each takes this step) join the
    step: the first always, then each while the step's prompt cells stay within `budget`."""
    total = 0
    for k, take in enumerate(takes):
        if k and total + take > budget:
            return k
        total += take
    return len(takes)
