"""The user's report (shared/seed/llamasharp-mtmd-nokvslot-issue.txt), replayed on real llama.cpp.

LLamaSharp's InteractiveExecutor with MTMD, n_ctx 1792: a prompt of 167 text tokens and an image
that libmtmd makes 1288 KV cells but only 46 positions (M-RoPE). ``mtmd_helper_eval_chunks``
returns n_past = 213 although 1455 cells are used; the executor budgets by n_past, believes
there is room while ``n_past + 1 <= n_ctx``, and ``llama_decode`` fails with "no KV slot" at
n_past 550 -- the numbers in the report. The ledger counts cells: under AUTO (GAP on this
M-RoPE model) it generates 1000 tokens by evicting in time, and under STOP it stops exactly
when llama.cpp is full. The tiny M-RoPE pair computes the same counts as Qwen2-VL.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

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
PICTURE = Picture(1288, 784, 1792)
IMAGE_CELLS, IMAGE_POSITIONS = 1288, 46
PROMPT_CELLS = TEXT_TOKENS + IMAGE_CELLS  # 1455: the report's CountTokens
PROMPT_POSITIONS = TEXT_TOKENS + IMAGE_POSITIONS  # 213: the report's pastTokensCount


@pytest.fixture(scope="module")
def oracle(tiny: dict[str, TinyPair]) -> Iterator[Oracle]:
    rt = open_runtime(tiny["mrope"], ContextShape(N_CTX, 512, 512))
    o = Oracle(rt)  # the 1288-cell image takes ~1.4 s to encode here: once (cached)
    yield o
    o.close()
    rt.close()


@pytest.fixture(scope="module")
def prompt_text(oracle: Oracle) -> str:
    """A chat prompt with the media marker, padded to exactly 167 text tokens."""
    mtmd = oracle.rt.mtmd
    assert mtmd is not None
    head = f"<|im_start|>user\n{mtmd.marker}\nWhat is in this picture? "
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    placeholder = native.Bitmap(PICTURE.width, PICTURE.height)

    def text_tokens(text: str) -> int:
        chunks = mtmd.count(text, [placeholder], add_special=False)
        return sum(c.num_cells for c in chunks if not c.is_media)

    pad = TEXT_TOKENS - text_tokens(head + tail)
    text = head + "x" * pad + tail  # 'x' never merges: one token each
    assert text_tokens(text) == TEXT_TOKENS
    return text


def test_position_accounting_fails_with_room_left(oracle: Oracle, prompt_text: str) -> None:
    """The seed's executor: n_past from mtmd_helper_eval_chunks, room while n_past + 1 <= n_ctx."""
    rt = oracle.rt
    assert rt.mtmd is not None and rt.uses_mrope and not rt.can_shift
    assert rt.num_cells_per_slot == llama_cpp.llama_n_ctx(rt.ctx) == N_CTX
    rt.seq_clear(0)
    bitmap = native.Bitmap(PICTURE.width, PICTURE.height, PICTURE.rgb())
    with rt.mtmd.tokenize(prompt_text, [bitmap], add_special=False) as chunks:
        raw = chunks.describe()
        assert [c.num_cells for c in raw if c.is_media] == [IMAGE_CELLS]
        assert [c.num_positions for c in raw if c.is_media] == [IMAGE_POSITIONS]
        assert sum(c.num_cells for c in raw) == PROMPT_CELLS
        new_n_past = llama_cpp.llama_pos(0)
        rc = mtmd_cpp.mtmd_helper_eval_chunks(
            rt.mtmd.ctx, rt.ctx, chunks.handle, 0, 0, rt.batch_size, True,
            ctypes.byref(new_n_past),
        )  # fmt: skip
        assert rc == 0
    n_past = int(new_n_past.value)
    assert n_past == PROMPT_POSITIONS  # mtmd returns positions, not cells
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
    believed_free = n_ctx - n_past
    cells, _ = oracle.probes[0].cells()
    rt.seq_clear(0)
    rt.free_sampler(sampler)
    assert rc == 1, "llama_decode: no KV slot"
    assert len(cells) == N_CTX, "llama.cpp is full"
    assert generated == N_CTX - PROMPT_CELLS == 337
    assert n_past == 550  # the report: _session_tokens.Count = 550 when decode failed
    assert believed_free == N_CTX - 550 == 1242  # "there is still free context"

    # the ledger, fed the same chunks and tokens, knows the cache is full at this point
    ledger = Ledger(N_CTX, can_shift=False, n_ctx_train=rt.n_ctx_train, policy=Policy.STOP)
    for c in raw:
        if c.is_media:
            ledger.append(Item.media("img", c.num_cells, c.num_positions, 0))
        else:
            ledger.append(Item.text(c.token_ids, 0))
    for _ in range(generated):
        ledger.append(Item.text((0,), 0))
    assert ledger.num_free_cells == 0 and ledger.next_pos == 550
    assert ledger.ensure(1).__class__.__name__ == "CannotFit"


def _prompt_parts(oracle: Oracle, prompt_text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prompt's text around the image's media group (its wrapper tokens go with it)."""
    mtmd = oracle.rt.mtmd
    assert mtmd is not None
    group = mtmd.media_group(native.Bitmap(PICTURE.width, PICTURE.height))
    assert [c.is_media for c in group] == [False, True, False]
    before, media, after = mtmd.count(
        prompt_text, [native.Bitmap(PICTURE.width, PICTURE.height)], add_special=False
    )
    assert media.is_media and not before.is_media and not after.is_media
    n_open, n_close = group[0].num_cells, group[2].num_cells
    assert before.token_ids[-n_open:] == group[0].token_ids
    assert after.token_ids[:n_close] == group[2].token_ids
    return before.token_ids[:-n_open], after.token_ids[n_close:]


def test_ledger_generates_1000_tokens_with_gaps(oracle: Oracle, prompt_text: str) -> None:
    """AUTO on M-RoPE is GAP: seq_rm before the cache is full; every decode succeeds."""
    rt = oracle.rt
    fresh = Ledger(N_CTX, can_shift=rt.can_shift, n_ctx_train=rt.n_ctx_train)
    assert fresh.effective_policy() is Policy.GAP
    head, tail = _prompt_parts(oracle, prompt_text)
    spec = RunSpec(
        seed=0,
        pair="mrope",
        shape=0,
        policy=Policy.AUTO,
        keep=0,
        discard_fraction=0.5,
        unit=EvictionUnit.TOKEN,
        n_ctx_train=None,
        steps=(Prompt((head, PICTURE, tail), truncate=False), Generate(1000)),
    )
    report = oracle.run(spec)  # raises on any failed decode or cell mismatch
    c = report.counts
    assert c["prompts"] == 1 and c["prompts_rejected"] == 0
    assert c["generated"] == 1000
    assert c["Gap"] > 0, "the image was evicted in time"
    assert c["Shift"] == 0 and c["Reprefill"] == 0 and c["CannotFit"] == 0
    assert c["cells_evicted"] >= IMAGE_CELLS
    print(f"1000 tokens: {c['Gap']} gaps, {c['cells_evicted']} cells evicted, {c['checks']} checks")


def test_stop_ends_exactly_at_capacity(oracle: Oracle, prompt_text: str) -> None:
    head, tail = _prompt_parts(oracle, prompt_text)
    b = stop_exactness(oracle, [head, PICTURE, tail])
    assert (b.prompt_cells, b.prompt_positions) == (PROMPT_CELLS, PROMPT_POSITIONS)
    assert b.generated == N_CTX - PROMPT_CELLS == 337
    assert b.rc_after == 1 and b.rc_last_replayed == 0
    assert b.believed_free_by_positions == 1242
