"""A stop string found among drafts that a hybrid model's step rejected and replayed: the
output processor asks the executor to give back what came after the stop, but the kept drafts
are pending text by then, not cells. Before, the give-back cut the segment before them (a
prompt token) and, with llama.cpp's in-place rollback on, took the recurrent state from a
snapshot of the rejected step: the logits after it were no longer a fresh prefill's."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from oracle import FreshPrefill, compare_logits, exact_kernels

from infer_service.events import FinishReason
from infer_service.kv.ledger import Item, Segment
from infer_service.runner.executor import Executor, Sampled
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig
from infer_service.runner.sampling import Constraint
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from infer_service.spec.config import SpecConfig, SpecType

CELLS = 512


def _fresh_after(rt: Runtime, fresh: FreshPrefill, slot: Slot) -> float:
    """One token after the ledger's end, against a fresh prefill of the ledger and it."""
    ledger = slot.ledger
    assert ledger is not None
    token = ledger.segments[-1].token_ids[-1]
    rt.batch.clear()
    rt.batch.add((token,), ledger.next_pos, slot.seq, logits_last=True)
    assert rt.decode() == 0
    segments = [*ledger.segments, Segment(Item.text((token,), 9), ledger.next_pos, False)]
    diff, problem = compare_logits(rt.logits(0).copy(), fresh.logits(segments, {}))
    assert problem is None, problem
    return diff


@pytest.mark.parametrize("rollback", [0, 1, 2])
def test_a_stop_among_replayed_drafts_leaves_the_state_a_fresh_prefill_s(
    tiny: dict[str, Any], rollback: int
) -> None:
    pair = tiny["qwen35"]
    with exact_kernels():
        rt = Runtime(RuntimeConfig(
            pair.model, None, ctx_size=CELLS, parallel=1, batch_size=128, ubatch_size=128,
            threads=1, threads_batch=1, ctx_checkpoints=8, checkpoint_min_step=16,
            spec_rollback=rollback,
        ))  # fmt: skip
    fresh = FreshPrefill(pair, CELLS)
    stats, slot = EngineStats(), Slot(0)
    executor = Executor(rt, stats, slots=[slot], host_sequence_bytes=0)
    try:
        job = Job(
            [Item.text(rt.tokenize("copy a b c d abcabdabeabcabdabe"), 0)], {}, KeptEvents(),
            sampling=SamplingConfig(temperature=0.0), max_tokens=120, logit_bias=rt.eog_bans,
            constraint=Constraint('root ::= ("abcabdabe")+'),
            speculative=SpecConfig(SpecType.NGRAM_SIMPLE, n_max=8, size_n=1),
        )  # fmt: skip
        executor.start(slot, job, executor.enter(slot, job))
        for _ in itertools.count():
            restores = stats.num_spec_restores
            outcome = executor.step([slot])
            assert slot.job is not None, "the reply ended before a replay"
            if stats.num_spec_restores > restores and slot.num_confirmed >= 1:
                break  # (a step whose kept drafts are pending text, to replay)
        sampled = [e for _, e in outcome.events if isinstance(e, Sampled)]
        cells = slot.ledger.num_cells if slot.ledger else 0
        executor.stopped(slot, job, at=0, num_later=len(sampled) - 1)
        assert slot.ledger is not None and slot.ledger.num_cells == cells  # (nothing to cut)
        assert _fresh_after(rt, fresh, slot) < 1e-5
    finally:
        if slot.job is not None:
            executor.finish(slot, FinishReason.CANCELLED)
        executor.close()
        fresh.close()
        rt.close()
