"""The pool oracle (tests/pool_oracle.py) on the hybrid-memory pairs, with the fresh-prefill check.

``--kv-unified`` on hybrid memory: slots share a pinned prefix's attention cells and its
recurrent state (``seq_cp`` copies the holder's state; a slot's next decode forks it), evict
by re-prefilling from the pinned prefix's checkpoint, and wait for the pool. The pool oracle
checks every cell of the pool after each step; here, in addition, the logits every request
samples its first token from, and its first token after each shift, are compared with a fresh
prefill of the slot's ledger (tests/oracle.py ``FreshPrefill``): what proves a shared or
restored recurrent state right. Replay more seeds with ``python tests/test_hybrid_oracle.py
--pair lfm2 --runs 20``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from oracle import FRESH_TOLERANCE, HYBRID, FreshPrefill, compare_logits, exact_kernels
from pool_oracle import NUM_SLOTS, PoolOracle

from infer_service.runner.runtime import Runtime, RuntimeConfig
from slotwise_core.tiny_models import TinyPair, write_tiny_models

CELLS = 224  # the pool (as pool_oracle.open_pool)
SEEDS = range(6)  # (about 0.5 s each, per pair)


class FreshPool:
    """A PoolOracle on a hybrid pair whose runtime's sampling is checked first: the logits at
    a request's first sample, and at its first after each shift, against a fresh prefill."""

    def __init__(self, pair: TinyPair):
        with exact_kernels():
            self.runtime = Runtime(
                RuntimeConfig(
                    pair.model, None, ctx_size=CELLS, parallel=NUM_SLOTS, batch_size=64,
                    ubatch_size=64, threads=1, threads_batch=1, kv_unified=True,
                    shared_prefixes=2,
                    ctx_checkpoints=3, checkpoint_min_step=24,
                )
            )  # fmt: skip
        self.oracle = PoolOracle(self.runtime)
        self.fresh = FreshPrefill(pair, CELLS)
        self._engine_sample = self.runtime.sample
        self.runtime.sample = self._sample  # type: ignore[method-assign]
        self._seen: dict[int, tuple[object, int]] = {}  # seq -> (its job, its shifts) checked
        self.checks = self.shared_checks = self.shift_checks = 0
        self.max_diff = 0.0
        self.errors: list[str] = []

    def close(self) -> None:
        self.oracle.close()
        self.runtime.close()
        self.fresh.close()

    def _sample(self, chain: object, index: int) -> int:
        seq = int(self.runtime.batch.native.seq_id[index][0])
        slot = self.oracle.slots[seq]
        job, shifts = self._seen.get(seq, (None, 0))
        if slot.ledger is not None and (job is not slot.job or shifts != slot.usage.num_shifts):
            self._seen[seq] = (slot.job, slot.usage.num_shifts)
            ptr = llama_cpp.llama_get_logits_ith(self.runtime.ctx, index)
            engine = np.ctypeslib.as_array(ptr, shape=(self.runtime.num_vocab,)).copy()
            fresh = self.fresh.logits(slot.ledger.segments, {})
            diff, problem = compare_logits(engine, fresh)
            self.max_diff = max(self.max_diff, diff)
            self.checks += 1
            pool = self.oracle.executor.pool
            self.shared_checks += pool is not None and pool.shared_cells(seq) > 0
            self.shift_checks += slot.usage.num_shifts > 0
            if problem is not None:
                self.errors.append(
                    f"slot {seq}: {problem} ({slot.ledger.num_cells} cells, shifts "
                    f"{slot.usage.num_shifts}, shared {pool.shared_cells(seq) if pool else 0})"
                )
        return self._engine_sample(chain, index)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyPair]:
    return write_tiny_models(tmp_path_factory.mktemp("hybrid-pool"), HYBRID)


@pytest.fixture(scope="module", params=HYBRID)
def fresh_pool(request: pytest.FixtureRequest, hybrid: dict[str, TinyPair]) -> Iterator[FreshPool]:
    fp = FreshPool(hybrid[request.param])
    yield fp
    fp.close()


@pytest.mark.slow
def test_pool_on_hybrid_memory_matches_llama_cpp_and_a_fresh_prefill(fresh_pool: FreshPool) -> None:
    shared = shifts = 0
    for seed in SEEDS:
        report = fresh_pool.oracle.run(seed)  # (raises PoolError where the cells disagree)
        assert not fresh_pool.errors, f"seed {seed}: {fresh_pool.errors[0]}"
        shared += report.shared
        shifts += report.shifts
    assert shared > 0 and shifts > 0
    assert fresh_pool.checks > 0 and fresh_pool.shared_checks > 0 and fresh_pool.shift_checks > 0
    assert fresh_pool.max_diff <= FRESH_TOLERANCE
    assert fresh_pool.oracle.stats.num_checkpoint_restores > 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=HYBRID, action="append")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as d:
        pairs = write_tiny_models(Path(d), HYBRID)
        for name in args.pair or HYBRID:
            fp = FreshPool(pairs[name])
            try:
                for seed in range(args.seed, args.seed + args.runs):
                    try:
                        report = fp.oracle.run(seed)
                    except AssertionError as e:
                        fp.errors.append(f"{type(e).__name__}: {e}")
                    if fp.errors:
                        failed += 1
                        print(f"{name} seed {seed}: FAILED {fp.errors[0]}", flush=True)
                        fp.errors.clear()
                    else:
                        print(f"{name} seed {seed}: {report}", flush=True)
                print(
                    f"{name}: {fp.checks} fresh-prefill checks ({fp.shared_checks} of a shared "
                    f"prefix, {fp.shift_checks} after a shift), max |logit diff| "
                    f"{fp.max_diff:.2g}, {fp.oracle.stats.num_checkpoint_restores} checkpoint "
                    "restores",
                    flush=True,
                )
            finally:
                fp.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
