"""A turn's delta of a session header (infer_service/sessions/header_delta.py): applied to the
header it was made from it gives the new one exactly, and its size is the turn's. Pure: ledgers
driven as the engine drives them (shifts, gaps, re-prefills and rolled-back replies)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_ledger import FakeSequence, carry_out, decode, scenarios

from infer_service.kv.ledger import CannotFit, Fits, Item, Ledger
from infer_service.sessions.header_delta import apply, diff, records_diff, segments_diff


def header(ledger: Ledger, turn: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    held = {s.media_id for s in ledger.segments if s.media_id}
    return {
        "ledger": ledger.to_json(),
        "pixels": {m: {"media_id": m, "width": 4, "height": 4} for m in sorted(held)},
        "num_turns": turn,
        "records": records[-5:],
        "title": f"t{turn // 3}",
        "kv_digest": f"digest of turn {turn}",  # a checkpoint's: never in a delta
    }


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.integers(1, 6), st.randoms(use_true_random=False))
def test_a_delta_makes_the_new_header_from_the_old_one_exactly(
    scenario: tuple[Ledger, bool, list[Item]], turns: int, rnd: Any
) -> None:
    ledger, mrope, items = scenario
    seq = FakeSequence(ledger.capacity, mrope=mrope)
    records: list[dict[str, Any]] = []
    old = header(ledger, 0, records)
    per_turn = max(1, len(items) // turns)
    for turn in range(1, turns + 1):
        if rnd.random() < 0.3:  # the reply is rendered again by the next turn's prompt
            ledger.truncate(ledger.generated_tail())
        for item in items[(turn - 1) * per_turn : turn * per_turn]:
            plan = ledger.ensure(item.num_cells, item.num_positions, group=item.group)
            if isinstance(plan, CannotFit):
                continue
            if not isinstance(plan, Fits):
                carry_out(ledger, seq, plan)
            decode(ledger, seq, item)
        records.append({"turn": turn, "text": f"reply {turn}"})
        new = header(ledger, turn, records)
        delta = diff(old, new)
        assert "kv_digest" not in delta
        assert apply(old, json.loads(json.dumps(delta))) == {**new, "kv_digest": old["kv_digest"]}
        old = {**new, "kv_digest": old["kv_digest"]}


def segment(pos: int, tokens: tuple[int, ...], message: int = 0) -> dict[str, Any]:
    return {
        "pos": pos, "cells": len(tokens), "positions": len(tokens), "message": message,
        "tokens": list(tokens), "media": None, "group": None, "generated": False,
        "pinned": False,
    }  # fmt: skip


def test_what_a_turn_appends_costs_its_own_segments_and_a_shift_costs_a_few_numbers() -> None:
    old = [segment(10 * i, tuple(range(10 * i, 10 * i + 10)), i) for i in range(500)]
    grown = [*old, segment(5000, (1, 2, 3), 500)]
    ops = segments_diff(old, grown)
    assert ops == [[0, 500, 0], {"add": [grown[-1]]}]
    # a shift: the first 2 kept, 100 evicted, the rest 1000 positions earlier
    shifted = [*old[:2], *({**s, "pos": s["pos"] - 1000} for s in old[102:])]
    assert segments_diff(old, shifted) == [[0, 2, 0], [102, 500, -1000]]
    assert records_diff([1, 2, 3], [2, 3, 4]) == {"drop": 1, "add": [4]}
    assert records_diff([1, 2], [5]) == {"drop": 2, "add": [5]}
