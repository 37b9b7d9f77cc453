"""The ledger against real llama.cpp (tests/oracle.py): random runs and the exact boundary.

Every pair (M-RoPE, RoPE, non-causal, the hybrid-memory qwen35 and lfm2, and the 2026 families
qwen3vl and gemma4) runs seeded random scripts -- text, images, generated tokens, every policy
-- with the ledger's plans carried out by real llama.cpp calls and the sequence's cells compared
to the ledger after every step (gemma4: its sliding window's cache too); on the hybrid pairs the
logits the engine samples from after every reuse, checkpoint restore and re-prefill are compared
with a fresh prefill of what the ledger says the sequence holds. A failure names its seed;
replay it with ``python tests/oracle.py --pair PAIR --seed SEED --runs 1 -v``. The larger sweep
is ``python tests/oracle.py --runs 200``.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Iterator
from types import MappingProxyType

import llama_cpp
import pytest
from oracle import (
    ALL,
    FAMILIES_2026,
    FRESH_TOLERANCE,
    HYBRID,
    PAIRS,
    SEQ,
    SHAPES,
    Drivers,
    OracleError,
    Picture,
    RunSpec,
    Sweep,
    media_boundary,
    stop_exactness,
)

from infer_service.kv.ledger import ContextConfig, EvictionUnit, Item, Policy
from infer_service.runner.job import Job
from infer_service.runner.runtime import Runtime, SamplingConfig, TokenBatch
from slotwise_core.tiny_models import TinyPair, write_tiny_models

# Runs per pair in CI (seeds 0..N-1); each run is a few dozen to a few hundred decodes.
RUNS_PER_PAIR = 200
# The hybrid pairs' runs also prefill every checked sequence again: fewer of them (about 12 s a
# pair on a 2-core machine); `python tests/oracle.py --runs 600 --pair qwen35` sweeps further.
RUNS_PER_HYBRID_PAIR = 100
# The 2026 families (qwen3vl, gemma4): about 0.1 s a run on a 2-core machine, 20 s a pair at
# 200; fewer here to keep CI short (`python tests/oracle.py --runs 400 --pair gemma4` sweeps
# further: seeds 0..999 of each passed).
RUNS_PER_2026_PAIR = 100


@pytest.fixture(scope="module")
def drivers(
    tiny: dict[str, TinyPair], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Drivers]:
    hybrid = write_tiny_models(tmp_path_factory.mktemp("hybrid-models"), HYBRID)
    d = Drivers({**tiny, **hybrid})
    yield d
    d.close()


def _no_disagreement(sweep: Sweep, pair: str) -> None:
    """The sweep's figures, and its first disagreement with llama.cpp (with how to replay it)."""
    print(sweep.summary())
    if sweep.failures:
        seed, message = sweep.failures[0]
        seeds = [s for s, _ in sweep.failures]
        pytest.fail(
            f"{len(seeds)} of {sweep.runs} {pair} runs disagree with llama.cpp (seeds {seeds[:20]})"
            f"; replay: python tests/oracle.py --pair {pair} --seed {seed} --runs 1 -v\n{message}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("pair", [*ALL, *FAMILIES_2026])
def test_random_runs_match_llama_cpp(drivers: Drivers, pair: str) -> None:
    sweep = drivers.sweep(
        pair, range(RUNS_PER_2026_PAIR if pair in FAMILIES_2026 else RUNS_PER_PAIR)
    )
    _no_disagreement(sweep, pair)
    c = sweep.counts
    # the random scripts really exercise every plan and boundary
    assert c["media_decodes"] > 0 and c["generated"] > 0
    # the executor's own batching of several sequences, and images checked half in (a
    # non-causal projector's image goes into the cache whole)
    assert c["multi_seq_decodes"] > 0
    non_causal = drivers.get(pair, 0).runtime.mtmd.non_causal  # type: ignore[union-attr]
    assert (c["checks_mid_media"] > 0) != non_causal
    assert c["Gap"] > 0 and c["Reprefill"] > 0
    can_shift = drivers.get(pair, 0).runtime.can_shift
    assert (c["Shift"] > 0) == can_shift, "Shift plans exactly where the memory can shift"
    assert c["stop_boundaries"] > 0 and c["full_probes"] >= c["stop_boundaries"]
    assert c["prompts_truncated"] > 0 and c["prompts_rejected"] > 0
    assert c["resends"] > 0 and c["cells_reused"] > 0
    # drafts verified in the batch: some accepted, some given back, the cells checked after each
    assert 0 < c["accepted"] < c["drafted"]
    # a reasoning model's thoughts: marked in the ledger, their ends written past a budget
    assert c["checks_with_thoughts"] > 0 and c["forcing_steps"] > 0
    # a sliding window (gemma4): its cache checked at every step, with cells it masks (GAP)
    n_swa = llama_cpp.llama_model_n_swa(drivers.get(pair, 0).runtime.model)
    assert (c["swa_checks"] == c["checks"]) == (n_swa > 0)
    assert (c["swa_masked_checks"] > 0) == (n_swa > 0)


@pytest.mark.slow
@pytest.mark.parametrize("pair", HYBRID)
def test_hybrid_runs_match_a_fresh_prefill(drivers: Drivers, pair: str) -> None:
    """Hybrid memory: the attention cells are the ledger's after every plan and step (and the
    recurrent state has seen up to the ledger's last cell), and the logits the engine samples
    from after every reuse, checkpoint restore and re-prefill are a fresh prefill's."""
    sweep = drivers.sweep(pair, range(RUNS_PER_HYBRID_PAIR))
    _no_disagreement(sweep, pair)
    c = sweep.counts
    assert c["media_decodes"] > 0 and c["generated"] > 0 and c["multi_seq_decodes"] > 0
    assert c["checks_mid_media"] > 0
    # every eviction is a Reprefill (AUTO, SHIFT and GAP resolve to it); STOP still stops
    assert c["Reprefill"] > 0 and c["Shift"] == c["Gap"] == 0
    assert c["stop_boundaries"] > 0
    assert c["prompts_truncated"] > 0 and c["prompts_rejected"] > 0
    assert c["resends"] > 0 and c["cells_reused"] > 0
    # checkpoints saved, dropped past the run's number and restored: by a request that reuses
    # part of its sequence and by a Reprefill that keeps a pinned prefix; and without one, the
    # sequence decoded from position 0
    assert c["checkpoints"] > 0 and c["checkpoint_restores"] > 0
    assert c["restores"] > 0 and c["reprefills_from_checkpoint"] > 0 and c["decoded_from_0"] > 0
    # the fresh-prefill check fired after each kind of event, within its tolerance
    assert c["fresh_checks"] > 0
    assert c["fresh_after_reuse"] > 0 and c["fresh_after_restore"] > 0
    assert c["fresh_after_reprefill"] > 0
    assert sweep.max_logit_diff <= FRESH_TOLERANCE
    # drafts verified, and the rejected ones taken back both ways: in place (llama.cpp's
    # per-token snapshots) and from the checkpoint before their step; the logits after each
    # such step are a fresh prefill's
    assert c["drafted"] > c["accepted"] > 0
    assert c["spec_rollbacks"] > 0 and c["spec_restores"] > 0
    assert c["fresh_after_rejected_drafts"] > 0


def _corrupting_restore(rt: Runtime) -> None:
    """Runtime.restore, then one more token decoded into the sequence in llama.cpp, and its
    attention cell taken out again: the recurrent state has seen a token the ledger does not
    hold (restored as a checkpoint with the position of the one it replaces, so that the cut
    passes and the recurrent cell sits where the ledger says). Only the fresh-prefill check
    can tell."""
    restore, batch = rt.restore, TokenBatch(1, rt.num_slots)  # (not the step's batch)

    def corrupted(seq: int, state: bytes, pos: int) -> None:
        restore(seq, state, pos)
        batch.clear()
        batch.add([65], pos, seq, logits_last=False)
        assert llama_cpp.llama_decode(rt.ctx, batch.native) == 0
        saw_more = bytearray(rt.checkpoint(seq))
        # (header: magic, seq id; then cell count 1 and the cell's position)
        struct.pack_into("<i", saw_more, 12, struct.unpack_from("<i", state, 12)[0])
        restore(seq, bytes(saw_more), pos)

    rt.restore = corrupted  # type: ignore[method-assign]


@pytest.mark.parametrize("pair", HYBRID)
def test_a_recurrent_state_that_saw_more_fails_the_fresh_check(drivers: Drivers, pair: str) -> None:
    oracles = [drivers.get(pair, shape) for shape in range(len(SHAPES[pair]))]
    for oracle in oracles:
        _corrupting_restore(oracle.runtime)
    try:
        sweep = drivers.sweep(pair, range(40), keep_going=False)
    finally:
        for oracle in oracles:
            del oracle.runtime.restore  # back to the class's method
    assert sweep.failures, "no run restored a checkpoint?"
    seed, message = sweep.failures[0]
    assert f"seed={seed} pair={pair}" in message
    assert "differ from a fresh prefill's" in message, message  # (its cells were right)
    assert "restore" in message or "reprefill" in message


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
    "qwen35": [
        tuple(range(40, 52)),
        Picture(224, 224, 1),  # 49 cells, 7 positions
        tuple(range(60, 65)),
        Picture(196, 140, 2),  # 24 cells, 6 positions
        tuple(range(70, 73)),
    ],
    "lfm2": [tuple(range(40, 52)), Picture(90, 60, 1), (5,), Picture(30, 30, 2), (7, 8)],
    "qwen3vl": [
        tuple(range(40, 52)),
        Picture(224, 224, 1),  # 49 cells, 7 positions
        tuple(range(60, 65)),
        Picture(196, 140, 2),  # 24 cells, 6 positions
        tuple(range(70, 73)),
    ],
    "gemma4": [
        tuple(range(40, 52)),
        Picture(90, 60, 1),  # 77 cells (and positions), decoded non-causally
        (9,),
        Picture(70, 120, 2),
        (3, 4),
    ],
}
# (cells, positions) of the media boundary's image, Picture(224, 224, 3) on the pairs of
# dynamic resolution (the others: Picture(50, 80, 3), 64 cells and positions)
MEDIA_SHAPES = {"mrope": (64, 8), "qwen35": (49, 7), "qwen3vl": (49, 7), "gemma4": (81, 81)}


@pytest.mark.parametrize("shape", range(3))
@pytest.mark.parametrize("pair", PAIRS)
def test_stop_boundary_is_llama_cpp_full(drivers: Drivers, pair: str, shape: int) -> None:
    """STOP ends exactly when llama.cpp is full: the token before fits, the next one fails."""
    oracle = drivers.get(pair, shape)
    b = stop_exactness(oracle, BOUNDARY_PROMPTS[pair])
    assert b.capacity == SHAPES[pair][shape].ctx_size == oracle.runtime.num_cells_per_slot
    assert b.generated == b.capacity - b.prompt_cells > 0
    assert b.rc_after == 1, "one token past the ledger's boundary: llama_decode 'no KV slot'"
    assert b.rc_last_replayed == 0, "the last token the ledger allowed fits in a fresh replay"
    if pair == "mrope":
        assert b.prompt_cells - b.prompt_positions == (64 - 8) + (35 - 7)
    if pair in ("qwen35", "qwen3vl"):  # (the same projector)
        assert b.prompt_cells - b.prompt_positions == (49 - 7) + (24 - 6)
    if oracle.runtime.uses_mrope:
        # position-based accounting (n_past vs n_ctx) would believe this much is still free
        assert b.believed_free_by_positions == b.prompt_cells - b.prompt_positions
    else:
        assert b.believed_free_by_positions == 0


@pytest.mark.parametrize("shape", range(3))
@pytest.mark.parametrize("pair", PAIRS)
def test_media_boundary(drivers: Drivers, pair: str, shape: int) -> None:
    """An image one cell too big for the free cells fails in llama.cpp (in its last piece, when
    it takes several batches), and the ledger refuses it before any piece; an exact fit fills
    the sequence."""
    oracle = drivers.get(pair, shape)
    picture = Picture(224, 224, 3) if pair in MEDIA_SHAPES else Picture(50, 80, 3)
    cells, positions, rc, num_pieces = media_boundary(oracle, picture)
    assert (cells, positions) == MEDIA_SHAPES.get(pair, (64, 64))
    assert rc == 1
    assert num_pieces == math.ceil(cells / oracle.runtime.batch_size)  # (rope, shape 2: 48 + 16)


def test_a_window_cache_missing_cells_in_the_window_fails(drivers: Drivers) -> None:
    """gemma4's sliding window: llama.cpp's window cache may lack cells its window masks (a
    loaded sequence state leaves them out); the oracle allows that, and fails once a cut back
    brings such cells within the window again, where the ledger counts them."""
    oracle = drivers.get("gemma4", 0)
    rt = oracle.runtime
    n_swa = llama_cpp.llama_model_n_swa(rt.model)
    spec = RunSpec(-1, "gemma4", 0, Policy.GAP, 10, 0.5, EvictionUnit.TOKEN, None, ())
    run = oracle._begin(oracle.slots[0], spec)
    try:
        # 10 pinned tokens, then generated ones (no end of generation) until the window masks
        # them: GAP keeps them at their positions
        job = Job(
            [Item.text(tuple(range(40, 50)), 0)],
            MappingProxyType(run.media),
            run,
            sampling=SamplingConfig(temperature=0),
            context=ContextConfig(Policy.GAP, keep=10),
            max_tokens=n_swa + 40,
            logit_bias=rt.eog_bans,
        )
        oracle.executor.start(run.slot, job, run.ledger, 0)
        while run.slot.job is not None and run.error is None:
            oracle._step()
        assert run.error is None, run.error
        assert run.counts["Gap"] > 0 and run.ledger.next_pos > n_swa + 10
        assert run.counts["swa_masked_checks"] > 0 and run.counts["swa_purged_checks"] == 0
        state = bytes(rt.state_get(SEQ))  # (a stash, a swap or a preemption and back)
        rt.seq_clear(SEQ)
        # the runtime refuses such a state (the engine decodes the sequence again)...
        assert not rt.state_set(SEQ, state)
        assert llama_cpp.llama_memory_seq_pos_max(rt.memory, SEQ) == -1
        # ... for what llama.cpp makes of it, loaded: the oracle sees it
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        assert llama_cpp.llama_state_seq_set_data(rt.ctx, buf, len(state), SEQ)
        oracle.verify(run)  # the masked pinned cells are gone from the window cache alone
        assert run.counts["swa_purged_checks"] == 1
        assert llama_cpp.llama_memory_seq_pos_min(rt.memory, SEQ) > 9
        rt.seq_rm(SEQ, run.ledger.truncate(1), -1)  # back to the pinned prefix
        with pytest.raises(OracleError, match="the window cache holds"):
            oracle.verify(run)
    finally:
        oracle._end(run)


def test_an_oracle_failure_names_the_run(drivers: Drivers) -> None:
    """The oracle notices a cache that is not what the ledger says (here: seq_rm skipped)."""
    oracles = [drivers.get("rope", shape) for shape in range(len(SHAPES["rope"]))]
    for oracle in oracles:
        oracle.runtime.seq_rm = lambda seq, p0, p1: None  # type: ignore[method-assign]
    try:
        sweep = drivers.sweep("rope", range(40), keep_going=False)
    finally:
        for oracle in oracles:
            del oracle.runtime.seq_rm  # back to the class's method
    assert sweep.failures, "no run evicted anything?"
    seed, message = sweep.failures[0]
    assert f"seed={seed} pair=rope" in message
    assert "cells differ" in message or "llama.cpp holds" in message, message
