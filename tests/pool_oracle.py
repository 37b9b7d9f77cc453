"""The pool oracle: the unified cache (``--kv-unified``) against real llama.cpp, step by step.

A driver owns one ``Runtime`` with a small pool of cells shared by three slots and two holder
sequences, and drives the engine's own executor on it: random stateless chats of two tenants
(and two cache salts) that open with one of a few system prompts (pinned: ``keep`` covers
them, or not), under a random policy and ``max_tokens``, some cancelled half way. The pool is
small, so prompts wait for room, holders are dropped, idle slots are emptied and generating
slots shift. After every step the driver reads the whole cache out of llama.cpp
(``llama_state_get_data``: every cell, its position and every sequence that has it) and checks:

- every ``llama_decode`` returned 0;
- each slot's cells are its ledger's, position for position; each holder's are its prefix's
  (so no shift ever moved a shared cell: a shared cell has one position for all);
- the cells in use are what the pool counts: holders' cells, then each slot's less those it
  shares; each counted once;
- a cell belongs to one tenant and salt only, and a cell of several sequences is a holder's;
- and across the run, prefixes were shared (others did not decode them again).

Usage (tests/test_kv_pool.py runs a few seeds; sweep further with others)::

    python tests/pool_oracle.py --runs 50 --seed 100
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from infer_service.events import FinishReason, ProblemError, Started
from infer_service.kv.ledger import ContextConfig, Item, Ledger, Policy
from infer_service.runner.executor import Executor
from infer_service.runner.job import Job, KeptEvents
from infer_service.runner.runtime import Runtime, RuntimeConfig, SamplingConfig
from infer_service.runner.slot import Slot
from infer_service.runner.stats import EngineStats
from slotwise_core.tiny_models import TinyPair, write_tiny_models
from support.step_costs import replayable

NUM_SLOTS = 3
TENANTS = (("a", ""), ("a", "salt"), ("b", ""))


class PoolError(AssertionError):
    """llama.cpp's cache and the pool's count (or a ledger) disagree."""


@dataclass
class Report:
    steps: int = 0
    started: int = 0
    shared: int = 0  # requests given a prefix from the pool (its cells' ids copied)
    reused_cells: int = 0  # cells requests did not decode (shared or the slot's own)
    waited: int = 0  # steps in which a prompt waited for the pool
    pool_full: int = 0  # requests ended RESOURCE_EXHAUSTED POOL_FULL
    shifts: int = 0
    nested: int = 0  # requests that pinned examples after a system prompt held alone
    preempted: int = 0  # generations put aside in host memory for another tenant's prompt


def open_pool(pair: TinyPair, *, cells: int = 224, holders: int = 2, batch: int = 64) -> Runtime:
    return Runtime(
        RuntimeConfig(
            pair.model, None, ctx_size=cells, parallel=NUM_SLOTS, batch_size=batch,
            ubatch_size=batch, threads=1, kv_unified=True, shared_prefixes=holders,
        )
    )  # fmt: skip


def ledger_positions(ledger: Ledger) -> list[int]:
    return sorted(p for s in ledger.segments for p in range(s.pos_start, s.pos_end))


class PoolOracle:
    def __init__(self, rt: Runtime):
        self.runtime = rt
        self.slots = [Slot(seq) for seq in range(NUM_SLOTS)]
        self.stats = EngineStats()
        self.executor = Executor(
            rt, self.stats, cache_bytes=0, host_sequence_bytes=0, slots=self.slots
        )
        replayable(self.executor)  # (a seed replays the same steps)

    def close(self) -> None:
        self.executor.close()

    def verify(self) -> None:
        ex, pool = self.executor, self.executor.pool
        assert pool is not None
        if self.stats.num_failed_decodes:
            raise PoolError("llama_decode failed on a batch the ledgers admitted")
        cells = self.runtime.cells_in_use()
        by_seq: dict[int, list[int]] = {}
        for pos, seqs in cells:
            for s in seqs:
                by_seq.setdefault(s, []).append(pos)
            owners = {self._owner(s) for s in seqs}
            if len(owners) != 1:
                raise PoolError(f"a cell at {pos} is shared across tenants or salts: {seqs}")
            if len(seqs) > 1 and not any(h.seq in seqs for h in pool.holders):
                raise PoolError(f"a cell at {pos} is shared without a holder: {seqs}")
        for slot in self.slots:
            # (a generation put aside for another tenant holds no cells until it goes on)
            held = slot.ledger is not None and slot.preempted is None
            want = ledger_positions(slot.ledger) if held else []  # type: ignore[arg-type]
            if sorted(by_seq.pop(slot.seq, [])) != want:
                raise PoolError(f"slot {slot.seq}: llama.cpp's cells are not its ledger's")
        for h in pool.holders:
            if sorted(by_seq.pop(h.seq, [])) != list(range(h.num_cells)):
                raise PoolError(f"holder {h.seq}: its cells moved or went")
            pairs = _pairs(cells, h.seq)
            for user in h.users:
                have = [p for p in range(h.num_cells) if (p, user) in pairs]
                if len(have) != pool.shared_cells(user):
                    raise PoolError(
                        f"slot {user} shares {len(have)} cells of holder {h.seq}, counted as "
                        f"{pool.shared_cells(user)}"
                    )
        if by_seq:
            raise PoolError(f"cells of sequences nobody accounts for: {sorted(by_seq)}")
        if len(cells) != pool.num_cells - ex.pool_free():
            shared = Counter(seqs for _, seqs in cells if len(seqs) > 1)
            raise PoolError(
                f"{len(cells)} cells in use, the pool counts {pool.num_cells - ex.pool_free()} "
                f"(cells of several sequences: {dict(shared)})"
            )

    def _owner(self, seq: int) -> object:
        pool = self.executor.pool
        assert pool is not None
        for h in pool.holders:
            if h.seq == seq:
                return h.key[0]
        return self.slots[seq].reuse_key

    def run(self, seed: int, steps: int = 120) -> Report:
        r = random.Random(seed)
        report = Report()
        systems = [tuple(r.randrange(3, 250) for _ in range(r.randint(32, 90))) for _ in range(3)]
        examples = [tuple(r.randrange(3, 250) for _ in range(r.randint(4, 40))) for _ in range(2)]
        shares, preempted = self.stats.num_shared_prefixes, self.stats.num_preemptions
        for _ in range(steps):
            for slot in self.slots:
                if slot.job is None and r.random() < 0.5:
                    self._start(r, slot, systems, examples, report)
                elif slot.job is not None and r.random() < 0.03:
                    self.executor._outcome.endings.append(  # (as the engine cancels one)
                        self.executor.finish(slot, FinishReason.CANCELLED)
                    )
            waits = self.stats.num_pool_waits
            outcome = self.executor.step(self.slots)
            report.steps += 1
            report.waited += self.stats.num_pool_waits - waits
            report.shifts += len(outcome.shifted)
            report.pool_full += sum(
                1 for e in outcome.endings if e.problem and e.problem.reason.value == "POOL_FULL"
            )
            self.verify()
        report.shared = self.stats.num_shared_prefixes - shares
        report.preempted = self.stats.num_preemptions - preempted
        return report

    def _start(
        self, r: random.Random, slot: Slot, systems: list, examples: list, report: Report
    ) -> None:
        tenant, salt = r.choice(TENANTS)
        system = r.choice(systems)
        # some pin examples after the system prompt: a held system prompt alone is nested in it
        head = [Item.text(system, 0)]
        if r.random() < 0.4:
            head.append(Item.text(r.choice(examples), 0))
        user = tuple(r.randrange(3, 250) for _ in range(r.randint(1, 60)))
        pinned = sum(i.num_cells for i in head)
        keep = pinned if r.random() < 0.8 else r.choice([0, 8, len(system)])
        policy = r.choice([Policy.AUTO, Policy.SHIFT, Policy.GAP, Policy.REPREFILL, Policy.STOP])
        events = KeptEvents()
        never = tuple(
            (t, float("-inf")) for t in range(self.runtime.num_vocab) if self.runtime.is_eog(t)
        )
        job = Job(
            [*head, Item.text(user, 1)], {}, events,
            sampling=SamplingConfig(temperature=0), max_tokens=r.randint(4, 300),
            context=ContextConfig(policy=policy, keep=keep), tenant=tenant, cache_salt=salt,
            logit_bias=never,
        )  # fmt: skip
        shares = self.stats.num_shared_prefixes
        try:
            self.executor.start(slot, job, self.executor.enter(slot, job))
        except ProblemError:
            return
        report.started += 1
        pool = self.executor.pool
        assert pool is not None
        holder = pool.holder_of(slot.seq)
        if self.stats.num_shared_prefixes > shares and len(head) == 2 and keep == pinned:
            assert holder is not None
            report.nested += holder.key[1] == system  # (shared the system prompt held alone)
        for _, event in self.executor.take_outcome().events:
            if isinstance(event, Started):
                report.reused_cells += event.num_reused_cells


def _pairs(cells: list[tuple[int, tuple[int, ...]]], holder: int) -> set[tuple[int, int]]:
    return {(pos, s) for pos, seqs in cells if holder in seqs for s in seqs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        pair = write_tiny_models(Path(d))["rope"]
        rt = open_pool(pair)
        oracle = PoolOracle(rt)
        total: Counter[str] = Counter()
        try:
            for seed in range(args.seed, args.seed + args.runs):
                rep = oracle.run(seed)
                total.update({k: v for k, v in vars(rep).items()})
                print(f"seed {seed}: {rep}", flush=True)
        finally:
            oracle.close()
            rt.close()
        print(dict(total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
