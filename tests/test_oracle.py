"""The ledger against real llama.cpp (tests/oracle.py): random runs and the exact boundary.

Every pair (M-RoPE, RoPE, non-causal) runs seeded random scripts -- text, images, generated
tokens, every policy -- with the ledger's plans carried out by real llama.cpp calls and the
sequence's cells compared to the ledger after every step. A failure names its seed; replay it
with ``python tests/oracle.py --pair PAIR --seed SEED --runs 1 -v``. The larger sweep is
``python tests/oracle.py --runs 200``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from oracle import (
    ALL,
    SHAPES,
    Drivers,
    Picture,
    media_boundary,
    stop_exactness,
)

from slotwise_core.tiny_models import TinyPair

# Runs per pair in CI (seeds 0..N-1); each run is a few dozen to a few hundred decodes.
RUNS_PER_PAIR = 200


@pytest.fixture(scope="module")
def drivers(tiny: dict[str, TinyPair]) -> Iterator[Drivers]:
    d = Drivers(tiny)
    yield d
    d.close()


@pytest.mark.slow
@pytest.mark.parametrize("pair", ALL)
def test_random_runs_match_llama_cpp(drivers: Drivers, pair: str) -> None:
    sweep = drivers.sweep(pair, range(RUNS_PER_PAIR))
    print(sweep.summary())
    if sweep.failures:
        seed, message = sweep.failures[0]
        seeds = [s for s, _ in sweep.failures]
        pytest.fail(
            f"{len(seeds)} of {sweep.runs} {pair} runs disagree with llama.cpp (seeds {seeds[:20]})"
            f"; replay: python tests/oracle.py --pair {pair} --seed {seed} --runs 1 -v\n{message}"
        )
    c = sweep.counts
    # the random scripts really exercise every plan and boundary
    assert c["media_decodes"] > 0 and c["generated"] > 0
    # the executor's own batching of several sequences, and images checked half in (a
    # non-causal projector's image goes into the cache whole)
    assert c["multi_seq_decodes"] > 0
    non_causal = drivers.get(pair, 0).rt.mtmd.non_causal  # type: ignore[union-attr]
    assert (c["checks_mid_media"] > 0) != non_causal
    assert c["Gap"] > 0 and c["Reprefill"] > 0
    can_shift = drivers.get(pair, 0).rt.can_shift
    assert (c["Shift"] > 0) == can_shift, "Shift plans exactly where the memory can shift"
    assert c["stop_boundaries"] > 0 and c["full_probes"] >= c["stop_boundaries"]
    assert c["prompts_truncated"] > 0 and c["prompts_rejected"] > 0
    assert c["resends"] > 0 and c["cells_reused"] > 0
    # drafts verified in the batch: some accepted, some given back, the cells checked after each
    assert 0 < c["accepted"] < c["drafted"]


# Images in context; on M-RoPE the images' cells far outnumber their positions.
BOUNDARY_PROMPTS: dict[str, list[tuple[int, ...] | Picture]] = {
    "mrope": [
        tuple(range(40, 52)),
        Picture(224, 224, 1),  # 64 cells, 8 positions
        tuple(range(60, 65)),
        Picture(196, 140, 2),  # 35 cells, 7 positions
        tuple(range(70, 73)),
    ],
    "rope": [tuple(range(40, 52)), Picture(90, 60, 1), (5,), Picture(30, 30, 2), (7, 8)],
    "noncausal": [tuple(range(40, 52)), Picture(90, 60, 1), (9,), Picture(70, 120, 2), (3, 4)],
}


@pytest.mark.parametrize("shape", range(3))
@pytest.mark.parametrize("pair", ALL)
def test_stop_boundary_is_llama_cpp_full(drivers: Drivers, pair: str, shape: int) -> None:
    """STOP ends exactly when llama.cpp is full: the token before fits, the next one fails."""
    oracle = drivers.get(pair, shape)
    b = stop_exactness(oracle, BOUNDARY_PROMPTS[pair])
    assert b.capacity == SHAPES[pair][shape].ctx_size == oracle.rt.num_cells_per_slot
    assert b.generated == b.capacity - b.prompt_cells > 0
    assert b.rc_after == 1, "one token past the ledger's boundary: llama_decode 'no KV slot'"
    assert b.rc_last_replayed == 0, "the last token the ledger allowed fits in a fresh replay"
    if pair == "mrope":
        assert b.prompt_cells - b.prompt_positions == (64 - 8) + (35 - 7)
        # position-based accounting (n_past vs n_ctx) would believe this much is still free
        assert b.believed_free_by_positions == b.prompt_cells - b.prompt_positions
    else:
        assert b.believed_free_by_positions == 0


@pytest.mark.parametrize("shape", range(3))
@pytest.mark.parametrize("pair", ALL)
def test_media_boundary(drivers: Drivers, pair: str, shape: int) -> None:
    """An image one cell too big for the free cells fails in llama.cpp (in its last piece, when
    it takes several batches), and the ledger refuses it before any piece; an exact fit fills
    the sequence."""
    oracle = drivers.get(pair, shape)
    picture = Picture(224, 224, 3) if pair == "mrope" else Picture(50, 80, 3)
    cells, positions, rc, num_pieces = media_boundary(oracle, picture)
    assert (cells, positions) == ((64, 8) if pair == "mrope" else (64, 64))
    assert rc == 1
    assert num_pieces == math.ceil(64 / oracle.rt.batch_size)  # (rope, shape 2: 48 + 16)


def test_an_oracle_failure_names_the_run(drivers: Drivers) -> None:
    """The oracle notices a cache that is not what the ledger says (here: seq_rm skipped)."""
    oracles = [drivers.get("rope", shape) for shape in range(len(SHAPES["rope"]))]
    for oracle in oracles:
        oracle.rt.seq_rm = lambda seq, p0, p1: None  # type: ignore[method-assign]
    try:
        sweep = drivers.sweep("rope", range(40), keep_going=False)
    finally:
        for oracle in oracles:
            del oracle.rt.seq_rm  # back to the class's method
    assert sweep.failures, "no run evicted anything?"
    seed, message = sweep.failures[0]
    assert f"seed={seed} pair=rope" in message
    assert "cells differ" in message or "llama.cpp holds" in message, message
