"""The n-gram drafter and the draft length (pure): drafts equal a brute-force search of the
history, whatever it holds and however often it was cut; the length adapts as it says."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.spec.drafting import NO_TOKEN, NgramIndex
from infer_service.spec.length import DraftLength, StepCost


def reference(tokens: list[int], n: int, limit: int, min_hits: int = 1) -> list[int]:
    """The continuation of the last n tokens' latest earlier occurrence (a scan)."""
    end = len(tokens) - 1
    gram = tokens[end - n + 1 : end + 1]
    if end - n + 1 < 0 or NO_TOKEN in gram or limit <= 0:
        return []
    ends = [e for e in range(n - 1, end) if tokens[e - n + 1 : e + 1] == gram]
    if len(ends) < min_hits:
        return []
    # what followed, then (past the end) the copy again: the tokens at period p = end - found
    out = []
    for t in (tokens + tokens[ends[-1] + 1 :] * limit)[ends[-1] + 1 : ends[-1] + 1 + limit]:
        if t == NO_TOKEN:
            break
        out.append(t)
    return out


@given(
    st.lists(st.integers(-1, 3), max_size=300),
    st.integers(1, 4),
    st.integers(0, 20),
    st.integers(1, 3),
)
@settings(max_examples=400, deadline=None)
def test_drafts_equal_a_scan_of_the_history(tokens, n, limit, min_hits) -> None:
    index = NgramIndex(n, max_tokens=1 << 12)
    for i, t in enumerate(tokens):
        index.append(t)
        seen = tokens[: i + 1]
        assert index.draft(limit, min_hits=min_hits) == reference(seen, n, limit, min_hits)


@given(st.lists(st.integers(0, 2), min_size=1, max_size=400), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_a_bounded_history_drafts_from_what_it_kept(tokens, n) -> None:
    index = NgramIndex(n, max_tokens=2 * n + 8)
    for i, t in enumerate(tokens):
        index.append(t)
        assert len(index) <= index.max_tokens
        kept = list(index.tokens)
        assert kept == tokens[i + 1 - len(kept) : i + 1]  # the newest tokens
        assert index.draft(5) == reference(kept, n, 5)


def test_a_copy_task_drafts_the_rest_of_what_it_copies() -> None:
    text = list(range(100, 160))
    index = NgramIndex(4)
    index.extend(text)  # the document
    index.extend([7, 8])  # "copy it:"
    index.extend(text[:4])  # the reply begins the copy
    assert index.draft(16) == text[4:20]


def test_the_draft_length_weighs_acceptance_against_cost() -> None:
    length = DraftLength(48, prior=0.9)
    assert length.limit(0.5) == 6  # 0.9^6 = 0.53 > 0.5 >= 0.9^7
    assert length.limit(0.05) == 28  # drafts are cheap (a GPU): more of them
    for _ in range(20):
        length.update(10, 10)  # every draft lands
    assert length.limit(0.5) > 6
    for _ in range(30):
        length.update(2, 0)  # every first draft misses
    assert length.a <= 0.5
    # a slot whose drafts miss tries one now and then, the pause doubling while it misses
    tries = [length.limit(0.5) for _ in range(8)]
    assert tries[0] == 1 and sum(tries) < 8
    length.update(1, 0)
    assert [length.limit(0.5) for _ in range(3)].count(1) <= 1
    length.update(1, 1)  # a hit: tried again soon
    assert 1 in [length.limit(0.5) for _ in range(2)]


def test_the_step_cost_weighs_a_draft_against_the_token_it_may_save() -> None:
    cost = StepCost(prior=0.5)
    assert cost.ratio() == 0.5
    for _ in range(3):
        cost.observe(4, 0.049)
    assert cost.ratio() == 0.5  # steps of one size: no line yet
    for n in (1, 2, 4, 8, 17) * 40:  # two CPU cores: t = 11 ms + 9.5 ms a token
        cost.observe(n, 0.011 + 0.0095 * n)
    assert abs(cost.ratio(1) - 9.5 / 20.5) < 0.01
    assert abs(cost.ratio(4) - 9.5 / ((11 + 38) / 4)) < 0.01  # a batch of four: dearer
    for n in (1, 4, 16) * 200:  # a GPU: a step costs about the same whatever it holds
        cost.observe(n, 0.010 + 0.0001 * n)
    assert cost.ratio(1) < 0.05


def test_a_run_of_one_token_drafts_as_far_as_asked() -> None:
    """The latest earlier occurrence of a run's last n tokens ends one token before now: the
    copy goes on reading what it copied (a repeating reply drafts its period again)."""
    index = NgramIndex(3)
    index.extend([9, 5, 5, 5, 5])
    assert index.draft(6) == [5] * 6
    index = NgramIndex(2)
    index.extend([1, 2, 3, 1, 2, 3, 1, 2])
    assert index.draft(7) == [3, 1, 2, 3, 1, 2, 3]


def test_the_draft_length_follows_the_measured_cost_of_long_steps() -> None:
    """Where a step of many tokens costs more a token than the line through the small ones
    says (a recurrent layer's scan on a CPU), the length stops where drafts stop paying."""
    cost = StepCost()
    for n in (1, 2, 4, 8, 9, 10, 12) * 20:  # 3 ms alone, 1 ms a token more up to 12
        cost.observe(n, 0.003 + 0.001 * (n - 1))
    assert cost.worth(1, 0.95, 12) == 12  # every draft pays
    for _ in range(20):
        cost.observe(49, 0.120)  # 49 tokens: 2.4 ms each
    assert 4 <= cost.worth(1, 0.95, 48) <= 16
    assert cost.worth(1, 0.2, 48) <= 1  # drafts that rarely land: one at most


def test_a_draft_past_what_rolls_back_in_place_weighs_its_replay() -> None:
    """(hybrid memory) Drafts past the state's in-place rollback are taken back from a
    checkpoint: a rejection re-decodes what was kept, so where drafts often miss the length
    stays within what rolls back in place."""
    cost = StepCost()
    for n in (1, 2, 3, 4, 6, 8, 12, 16) * 30:  # 3 ms alone, 0.5 ms a token more
        cost.observe(n, 0.003 + 0.0005 * (n - 1))
    free = cost.worth(1, 0.7, 16)
    replayed = cost.worth(1, 0.7, 16, in_place=2)
    assert replayed < free
    assert cost.worth(1, 0.99, 16, in_place=2) == cost.worth(1, 0.99, 16)  # (they land)
