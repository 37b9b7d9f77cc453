"""The user's report (shared/seed/llamasharp-mtmd-nokvslot-issue.txt), replayed on real llama.cpp.

LLamaSharp's InteractiveExecutor with MTMD, n_ctx 1792: a prompt of 167 text tokens and an image
that libmtmd makes 1288 KV cells but only 46 positions (M-RoPE). ``mtmd_helper_eval_chunks``
returns n_past = 213 although 1455 cells are used; the executor budgets by n_past, believes
there is room while ``n_past + 1 <= n_ctx``, and ``llama_decode`` fails with "no KV slot" at
n_past 550 -- the numbers in the report. The ledger counts cells: under AUTO (GAP on this
M-RoPE model) it generates 1000 tokens by evicting in time, and under STOP it stops exactly
when llama.cpp is full. The tiny M-RoPE pair computes the same counts as Qwen2-VL.

The same replay runs on the 2026 families: ``qwen3vl`` (interleaved M-RoPE: the picture is
1000 cells, 40 positions; position accounting fails as in the report) and ``gemma4`` (a
1600x1200 picture is 825 cells and as many positions, decoded non-causally in one ubatch; its
position accounting is exact, AUTO is SHIFT, and the long context spreads past the sliding
window's 512 positions).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import llama_cpp
import pytest
from llama_cpp import mtmd_cpp
from oracle import (
    ContextShape,
    Generate,
    Oracle,
    Picture,
    Prompt,
    RunSpec,
    open_runtime,
    stop_exactness,
)

from infer_service.kv.ledger import EvictionUnit, Item, Ledger, Policy
from infer_service.runner.runtime import SamplingConfig
from slotwise_core import native
from slotwise_core.tiny_models import TinyPair

N_CTX = 1792
TEXT_TOKENS = 167


@dataclass(frozen=True)
class Replay:
    """The report's prompt on one pair: its picture and what libmtmd makes of it."""

    picture: Picture
    image_cells: int
    image_positions: int
    shape: ContextShape = ContextShape(N_CTX, 512, 512)

    @property
    def prompt_cells(self) -> int:
        return TEXT_TOKENS + self.image_cells

    @property
    def prompt_positions(self) -> int:
        return TEXT_TOKENS + self.image_positions


REPLAYS = {
    # the report: 1455 cells (its CountTokens), 213 positions (its pastTokensCount)
    "mrope": Replay(Picture(1288, 784, 1792), 1288, 46),
    "qwen3vl": Replay(Picture(1288, 784, 1792), 1000, 40),
    # a non-causal image goes whole, in one ubatch (and one batch)
    "gemma4": Replay(Picture(1600, 1200, 1792), 825, 825, ContextShape(N_CTX, 1024, 1024)),
}
MROPE_PAIRS = [pair for pair, r in REPLAYS.items() if r.image_cells > r.image_positions]


@pytest.fixture(scope="module")
def oracles(tiny: dict[str, TinyPair]) -> Iterator[Callable[[str], Oracle]]:
    """An Oracle per pair, opened on first use (the images are encoded once: cached)."""
    opened: dict[str, Oracle] = {}

    def get(pair: str) -> Oracle:
        if pair not in opened:
            opened[pair] = Oracle(open_runtime(tiny[pair], REPLAYS[pair].shape))
        return opened[pair]

    yield get
    for o in opened.values():
        o.close()
        o.runtime.close()


def _prompt_text(oracle: Oracle, picture: Picture) -> str:
    """A chat prompt with the media marker, padded to exactly 167 text tokens."""
    mtmd = oracle.runtime.mtmd
    assert mtmd is not None
    head = f"<|im_start|>user\n{mtmd.marker}\nWhat is in this picture? "
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    placeholder = native.Bitmap(picture.width, picture.height)

    def text_tokens(text: str) -> int:
        chunks = mtmd.count(text, [placeholder], add_special=False)
        return sum(c.num_cells for c in chunks if not c.is_media)

    pad = TEXT_TOKENS - text_tokens(head + tail)
    text = head + "x" * pad + tail  # 'x' never merges: one token each
    assert text_tokens(text) == TEXT_TOKENS
    return text


def _position_accounting(oracle: Oracle, replay: Replay) -> tuple[int, int, int]:
    """The seed's executor: n_past from mtmd_helper_eval_chunks, room while n_past + 1 <= n_ctx.
    Returns (the last llama_decode's rc, n_past, tokens generated)."""
    rt = oracle.runtime
    assert rt.mtmd is not None
    assert rt.num_cells_per_slot == llama_cpp.llama_n_ctx(rt.ctx) == N_CTX
    rt.seq_clear(0)
    picture = replay.picture
    bitmap = native.Bitmap(picture.width, picture.height, picture.rgb())
    with rt.mtmd.tokenize(_prompt_text(oracle, picture), [bitmap], add_special=False) as chunks:
        raw = chunks.describe()
        assert [c.num_cells for c in raw if c.is_media] == [replay.image_cells]
        assert [c.num_positions for c in raw if c.is_media] == [replay.image_positions]
        assert sum(c.num_cells for c in raw) == replay.prompt_cells
        new_n_past = llama_cpp.llama_pos(0)
        rc = mtmd_cpp.mtmd_helper_eval_chunks(
            rt.mtmd.ctx, rt.ctx, chunks.handle, 0, 0, rt.batch_size, True,
            ctypes.byref(new_n_past),
        )  # fmt: skip
        assert rc == 0
    n_past = int(new_n_past.value)
    assert n_past == replay.prompt_positions  # mtmd returns positions, not cells
    n_ctx = int(llama_cpp.llama_n_ctx(rt.ctx))
    sampler = rt.sampler(SamplingConfig(temperature=0))
    token = rt.sample(sampler, -1)
    generated = 0
    rc = 0
    while n_past + 1 <= n_ctx:  # what the executor believes
        rt.batch.clear()
        index = rt.batch.add([token], n_past, 0, logits_last=True)
        rc = rt.decode()
        if rc != 0:
            break
        n_past += 1
        generated += 1
        token = rt.sample(sampler, index)
    cells, _ = oracle.probes[0].cells()
    rt.seq_clear(0)
    rt.free_sampler(sampler)
    assert len(cells) == N_CTX, "llama.cpp is full"
    assert generated == N_CTX - replay.prompt_cells

    # the ledger, fed the same chunks and tokens, knows the cache is full at this point
    ledger = Ledger(N_CTX, can_shift=rt.can_shift, n_ctx_train=rt.n_ctx_train, policy=Policy.STOP)
    for c in raw:
        if c.is_media:
            ledger.append(Item.media("img", c.num_cells, c.num_positions, 0))
        else:
            ledger.append(Item.text(c.token_ids, 0))
    for _ in range(generated):
        ledger.append(Item.text((0,), 0))
    assert ledger.num_free_cells == 0 and ledger.next_pos == n_past
    assert ledger.ensure(1).__class__.__name__ == "CannotFit"
    return rc, n_past, generated


@pytest.mark.parametrize("pair", MROPE_PAIRS)
def test_position_accounting_fails_with_room_left(
    oracles: Callable[[str], Oracle], pair: str
) -> None:
    """M-RoPE: the image's cells outnumber its positions; n_past believes them free."""
    oracle, replay = oracles(pair), REPLAYS[pair]
    assert oracle.runtime.uses_mrope and not oracle.runtime.can_shift
    rc, n_past, generated = _position_accounting(oracle, replay)
    assert rc == 1, "llama_decode: no KV slot"
    believed_free = N_CTX - n_past  # "there is still free context"
    assert believed_free == replay.image_cells - replay.image_positions
    if pair == "mrope":
        assert generated == 337
        assert n_past == 550  # the report: _session_tokens.Count = 550 when decode failed
        assert believed_free == N_CTX - 550 == 1242


def test_position_accounting_is_exact_when_positions_are_cells(
    oracles: Callable[[str], Oracle],
) -> None:
    """gemma4: an image has as many positions as cells; n_past reaches n_ctx just as the
    cache is full, and every decode before succeeds."""
    oracle, replay = oracles("gemma4"), REPLAYS["gemma4"]
    assert not oracle.runtime.uses_mrope and oracle.runtime.can_shift
    rc, n_past, _ = _position_accounting(oracle, replay)
    assert rc == 0 and n_past == N_CTX


def _prompt_parts(oracle: Oracle, picture: Picture) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prompt's text around the image's media group (its wrapper tokens go with it)."""
    mtmd = oracle.runtime.mtmd
    assert mtmd is not None
    group = mtmd.media_group(native.Bitmap(picture.width, picture.height))
    assert [c.is_media for c in group] == [False, True, False]
    before, media, after = mtmd.count(
        _prompt_text(oracle, picture),
        [native.Bitmap(picture.width, picture.height)],
        add_special=False,
    )
    assert media.is_media and not before.is_media and not after.is_media
    n_open, n_close = group[0].num_cells, group[2].num_cells
    assert before.token_ids[-n_open:] == group[0].token_ids
    assert after.token_ids[:n_close] == group[2].token_ids
    return before.token_ids[:-n_open], after.token_ids[n_close:]


@pytest.mark.parametrize("pair", list(REPLAYS))
def test_ledger_generates_1000_tokens_evicting_in_time(
    oracles: Callable[[str], Oracle], pair: str
) -> None:
    """AUTO is GAP on M-RoPE (seq_rm before the cache is full) and SHIFT on gemma4; every
    decode succeeds, the cells checked after each (gemma4: its sliding window's too)."""
    oracle, replay = oracles(pair), REPLAYS[pair]
    rt = oracle.runtime
    fresh = Ledger(N_CTX, can_shift=rt.can_shift, n_ctx_train=rt.n_ctx_train)
    plan = "Shift" if rt.can_shift else "Gap"
    assert fresh.effective_policy() is Policy[plan.upper()]
    head, tail = _prompt_parts(oracle, replay.picture)
    spec = RunSpec(
        seed=0,
        pair=pair,
        shape=0,
        policy=Policy.AUTO,
        keep=0,
        discard_fraction=0.5,
        unit=EvictionUnit.TOKEN,
        n_ctx_train=None,
        steps=(Prompt((head, replay.picture, tail), truncate=False), Generate(1000)),
        ignore_eos=True,  # (gemma4's greedy tokens reach an end of generation at 632)
    )
    report = oracle.run(spec)  # raises on any failed decode or cell mismatch
    c = report.counts
    assert c["prompts"] == 1 and c["prompts_rejected"] == 0
    assert c["generated"] == 1000
    assert c[plan] > 0, "the image was evicted in time"
    assert c["Shift"] + c["Gap"] == c[plan] and c["Reprefill"] == 0 and c["CannotFit"] == 0
    assert c["cells_evicted"] >= replay.image_cells
    if llama_cpp.llama_model_n_swa(rt.model):
        assert c["swa_masked_checks"] > 0  # positions spread past the window
    print(
        f"{pair}: 1000 tokens, {c[plan]} {plan} plans, {c['cells_evicted']} cells evicted, "
        f"{c['checks']} checks"
    )


@pytest.mark.parametrize("pair", list(REPLAYS))
def test_stop_ends_exactly_at_capacity(oracles: Callable[[str], Oracle], pair: str) -> None:
    oracle, replay = oracles(pair), REPLAYS[pair]
    head, tail = _prompt_parts(oracle, replay.picture)
    b = stop_exactness(oracle, [head, replay.picture, tail])
    assert (b.prompt_cells, b.prompt_positions) == (replay.prompt_cells, replay.prompt_positions)
    assert b.generated == N_CTX - replay.prompt_cells
    assert b.rc_after == 1 and b.rc_last_replayed == 0
    assert b.believed_free_by_positions == replay.image_cells - replay.image_positions
    if pair == "mrope":
        assert b.generated == 337 and b.believed_free_by_positions == 1242
