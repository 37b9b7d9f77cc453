"""MTP drafting (infer_service/runner/mtp.py) on the tiny qwen35mtp pair in real llama.cpp:
the nextn block loads, drafts are deterministic, and greedy speculative decoding, where the
hybrid target rolls its recurrent state back on every rejection (a context with n_rs_seq >= k,
so llama_memory_seq_rm can drop the rejected tail), writes exactly what plain greedy decoding
writes, with and without an image in the prompt. The acceptance rates are printed (-s)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from infer_service.runner.mtp import MtpDrafter, top_token
from slotwise_core import native_ext
from slotwise_core.native import Bitmap, Multimodal, NativeError, quiet_native_logs
from slotwise_core.tiny_models import MTP, TinyPair, main, write_tiny_models

os.environ.setdefault("GGML_NO_BACKTRACE", "1")

K = 4  # drafts per step, and the target's recurrent snapshots (n_rs_seq)
N_GEN = 64
N_CTX = 1024
PROMPT = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyPair]:
    return write_tiny_models(tmp_path_factory.mktemp("mtp"), [*MTP, "qwen35"])


def load(path: Path) -> int:
    """As native.load_model, with the nextn tensors (load_mtp: llama.cpp skips them else)."""
    quiet_native_logs()
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.load_mtp = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"could not load {path}"
    return model


@pytest.fixture(scope="module")
def model(pairs: dict[str, TinyPair]) -> Iterator[int]:
    m = load(pairs["qwen35mtp"].model)
    yield m
    L.llama_model_free(m)


class Target:
    """A target context as slotwise's runtime makes one (llama_decode of a llama_batch, one
    sequence), plus n_rs_seq = K: a rejected draft tail can be removed from the hybrid memory."""

    def __init__(self, model: int, drafter: bool = True, n_seq: int = 1):
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = N_CTX * n_seq, 256, 256
        params.n_seq_max, params.n_rs_seq = n_seq, K
        params.n_threads = params.n_threads_batch = 1
        params.no_perf = True
        self.ctx = L.llama_init_from_model(model, params)
        assert self.ctx
        self.memory = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.batch = L.llama_batch_init(256, 0, 1)
        self.mtp = MtpDrafter(model, self.ctx, n_seq, N_CTX * n_seq, 1) if drafter else None

    def decode(self, tokens: list[int], pos: int, all_logits: bool = False) -> None:
        self.decode_seqs([(0, tokens, pos)], all_logits)

    def decode_seqs(self, seqs: list[tuple[int, list[int], int]], all_logits: bool) -> None:
        """One llama_decode of (seq, tokens, pos) runs, one after the other in the batch."""
        b, rows, i = self.batch, [], 0
        for seq, tokens, pos in seqs:
            rows.append((seq, tokens, pos, i))
            for j, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = t, pos + j, 1, seq
                b.logits[i] = all_logits or j == len(tokens) - 1
                i += 1
        b.n_tokens = i
        assert L.llama_decode(self.ctx, b) == 0
        if self.mtp:
            self.mtp.after_decode(rows)

    def argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
        return int(np.argmax(logits))

    def close(self) -> None:
        if self.mtp:
            self.mtp.close()
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)


def prompt_ids() -> list[int]:
    return list(PROMPT.encode())  # (the tiny vocabulary's first 256 ids are the bytes)


@dataclass
class Run:
    tokens: list[int]
    drafted: int = 0
    accepted: int = 0


def plain(t: Target, first: int, pos: int) -> Run:
    out = [first]
    while len(out) < N_GEN:
        t.decode([out[-1]], pos + len(out) - 1)
        out.append(t.argmax(0))
    return Run(out)


def speculative(t: Target, first: int, pos: int, p_min: float = 0.0) -> Run:
    """Greedy: decode [last, d1..dk] with logits for each, keep the drafts while they equal
    the target's argmax, then its argmax at the first miss (or after the last draft)."""
    assert t.mtp
    run = Run([first])
    while len(run.tokens) < N_GEN:
        last, at = run.tokens[-1], pos + len(run.tokens) - 1
        drafts = t.mtp.draft(0, last, at, K, p_min)
        t.decode([last, *drafts], at, all_logits=True)
        n = 0
        while n < len(drafts) and drafts[n] == t.argmax(n):
            n += 1
        run.tokens += [*drafts[:n], t.argmax(n)]
        run.drafted, run.accepted = run.drafted + len(drafts), run.accepted + n
        if n < len(drafts):  # the rejected tail, recurrent state included (n_rs_seq >= K)
            assert L.llama_memory_seq_rm(t.memory, 0, at + n + 1, -1)
        t.mtp.accept(0, n)
    run.tokens = run.tokens[:N_GEN]
    return run


def rate(run: Run) -> str:
    return f"{run.accepted}/{run.drafted} = {run.accepted / max(1, run.drafted):.0%}"


# ---------------------------------------------------------------------------------------------


def test_the_family_has_one_nextn_block(pairs, model, tmp_path) -> None:
    assert L.llama_model_n_layer_nextn(model) == 1
    assert L.llama_model_n_layer(model) == 4  # (the trunk's; block_count 5 counts the nextn)
    again = write_tiny_models(tmp_path / "again", MTP)["qwen35mtp"]
    assert again.model.read_bytes() == pairs["qwen35mtp"].model.read_bytes()
    assert again.mmproj.read_bytes() == pairs["qwen35"].mmproj.read_bytes()  # (qwen35's)
    assert main([str(tmp_path / "cli"), "--only", "qwen35mtp"]) == 0
    assert (tmp_path / "cli" / "qwen35mtp" / "model.gguf").is_file()
    assert main([str(tmp_path / "default")]) == 0
    assert not (tmp_path / "default" / "qwen35mtp").exists()  # (only when named)


def test_a_model_without_nextn_is_refused(pairs) -> None:
    assert native_ext.has_nextn()
    other = load(pairs["qwen35"].model)
    try:
        assert L.llama_model_n_layer_nextn(other) == 0
        ctx = Target(other, drafter=False)
        try:
            with pytest.raises(NativeError, match="no nextn"):
                MtpDrafter(other, ctx.ctx, 1, N_CTX, 1)
        finally:
            ctx.close()
    finally:
        L.llama_model_free(other)


def test_top_token() -> None:
    logits = np.full(50, -10.0, dtype=np.float32)
    logits[7], logits[3] = 2.0, 2.0 - np.log(3.0)
    token, p = top_token(logits)
    assert token == 7
    # softmax over the 10 best: e^2 / (e^2 + e^2 / 3 + 8 e^-10)
    assert p == pytest.approx(0.75, abs=1e-4)


def test_drafts_are_deterministic_and_leave_no_cells(model) -> None:
    drafts = []
    for _ in range(2):
        t = Target(model)
        try:
            ids = prompt_ids()
            t.decode(ids, 0)
            assert t.mtp
            mem = t.mtp.memory
            # the catch-up put one MTP cell per prompt token
            assert L.llama_memory_seq_pos_min(mem, 0) == 0
            assert L.llama_memory_seq_pos_max(mem, 0) == len(ids) - 1
            last = t.argmax(len(ids) - 1)
            drafts.append(t.mtp.draft(0, last, len(ids), 8, 0.0))
            # its own cells are gone: the verify decode's catch-up writes them
            assert L.llama_memory_seq_pos_max(mem, 0) == len(ids) - 1
            assert t.mtp.draft(0, last, len(ids), 8, 1.01) == []  # (p_min: none is that sure)
        finally:
            t.close()
    assert len(drafts[0]) == 8 and all(0 <= d < 271 for d in drafts[0])
    assert drafts[0] == drafts[1]


# The tiny MTP head's attention is weak: a wrong pairing of tokens and h rows in the catch-up
# seldom changes its top token, but it moves its logits by ~5e-4, where decoding the same text
# in other batches moves them by ~6e-7 (or not at all).
ATOL = 2e-5


def mtp_logits(t: Target, seq: int, last: int, pos: int) -> np.ndarray:
    """The MTP head's logits for the token after `last` (at pos): its first draft step."""
    assert t.mtp
    t.mtp.draft(seq, last, pos, 1, 0.0)
    return np.ctypeslib.as_array(L.llama_get_logits_ith(t.mtp.ctx, 0), (t.n_vocab,)).copy()


def test_the_catch_up_pairs_each_token_with_the_previous_h(model) -> None:
    """A prompt decoded in one batch leaves the MTP context as when decoded token by token
    (where every token pairs with the pending row of the decode before)."""
    ids = prompt_ids()
    got = []
    for one_by_one in (False, True):
        t = Target(model)
        try:
            if one_by_one:
                for i, token in enumerate(ids):
                    t.decode([token], i)
            else:
                t.decode(ids, 0)
            got.append(mtp_logits(t, 0, 7, len(ids)))
        finally:
            t.close()
    np.testing.assert_allclose(got[0], got[1], rtol=0, atol=ATOL)


def test_sequences_batched_together_draft_as_alone(model) -> None:
    """Two sequences in each target decode (prompts, then a verify of both): each pairs with
    its own part of the batch and its own pending row."""
    prompts = [prompt_ids(), list(b"Pack my box with five dozen liquor jugs.")]

    def run(t: Target, seqs: list[int]) -> list[np.ndarray]:
        assert t.mtp
        ps = [prompts[s] for s in seqs]
        t.decode_seqs([(i, p, 0) for i, p in enumerate(ps)], all_logits=True)
        offsets = np.cumsum([0, *map(len, ps)])
        verify = []
        for i, p in enumerate(ps):
            last = t.argmax(int(offsets[i]) + len(p) - 1)
            verify.append((i, [last, *t.mtp.draft(i, last, len(p), K, 0.0)], len(p)))
        t.decode_seqs(verify, all_logits=True)  # (every draft kept)
        for i, _, _ in verify:
            t.mtp.accept(i, K)
        return [mtp_logits(t, i, 7, pos + K + 1) for i, _, pos in verify]

    alone = []
    for s in (0, 1):
        t = Target(model)
        try:
            alone += run(t, [s])
        finally:
            t.close()
    t = Target(model, n_seq=2)
    try:
        together = run(t, [0, 1])
    finally:
        t.close()
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


def test_accept_leaves_what_the_accepted_text_alone_leaves(model) -> None:
    """A verify decode whose third draft is wrong, then accept(2): the MTP context drafts as
    one that decoded only the prompt and the accepted tokens."""
    ids = prompt_ids()
    base = Target(model, drafter=False)
    try:
        base.decode(ids, 0)
        greedy = plain(base, base.argmax(len(ids) - 1), len(ids)).tokens[:4]
    finally:
        base.close()
    last, kept, bonus = greedy[0], greedy[1:3], greedy[3]
    wrong = (greedy[3] + 1) % 256
    t = Target(model)
    try:
        t.decode(ids, 0)
        t.decode([last, *kept, wrong, 9], len(ids), all_logits=True)
        assert [t.argmax(i) for i in range(3)] == [*kept, bonus]  # (the third draft: rejected)
        assert L.llama_memory_seq_rm(t.memory, 0, len(ids) + 3, -1)
        assert t.mtp
        t.mtp.accept(0, 2)
        assert L.llama_memory_seq_pos_max(t.mtp.memory, 0) == len(ids) + 2
        got = mtp_logits(t, 0, bonus, len(ids) + 3)
    finally:
        t.close()
    ref = Target(model)
    try:
        ref.decode([*ids, last, *kept], 0)
        want = mtp_logits(ref, 0, bonus, len(ids) + 3)
    finally:
        ref.close()
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_speculative_greedy_writes_what_plain_greedy_writes(model) -> None:
    ids = prompt_ids()
    base = Target(model, drafter=False)
    try:
        base.decode(ids, 0)
        want = plain(base, base.argmax(len(ids) - 1), len(ids))
    finally:
        base.close()
    t = Target(model)
    try:
        t.decode(ids, 0)
        got = speculative(t, t.argmax(len(ids) - 1), len(ids))
        assert t.mtp
        # the MTP cells end where the target's do (accept dropped the rejected ones)
        end = L.llama_memory_seq_pos_max(t.memory, 0)
        assert L.llama_memory_seq_pos_max(t.mtp.memory, 0) == end
    finally:
        t.close()
    print(f"\nMTP acceptance, text: {rate(got)}")
    assert len(set(want.tokens)) > 8  # (greedy text that is not one token again and again)
    assert got.tokens == want.tokens
    # both paths ran: drafts kept, and drafts rejected (the recurrent state rolled back)
    assert 0 < got.accepted < got.drafted


def rgb(w: int, h: int) -> bytes:
    return np.random.default_rng(5).integers(0, 256, w * h * 3, dtype=np.uint8).tobytes()


def prefill_with_image(t: Target, mm: Multimodal, pass_media_h: bool) -> tuple[int, int]:
    """Decode 'describe <image> <PROMPT>' into t: text as Target.decode does, the image with
    libmtmd's helper (M-RoPE positions), then after_media when pass_media_h; returns (first
    generated token, its position)."""
    w, h = 448, 392
    with mm.tokenize(f"describe {mm.marker} {PROMPT}", [Bitmap(w, h, rgb(w, h))],
                     add_special=False) as chunks:  # fmt: skip
        pos = 0
        for i, c in enumerate(chunks.describe()):
            chunk = chunks.native(i)
            if not c.is_media:
                t.decode(list(c.token_ids), pos)
                pos += c.num_positions
                continue
            assert M.mtmd_encode_chunk(mm.ctx, chunk) == 0
            embd = M.mtmd_get_output_embd(mm.ctx)
            new_pos = L.llama_pos(0)
            rc = M.mtmd_helper_decode_image_chunk(
                mm.ctx, t.ctx, chunk, embd, pos, 0, 256, ctypes.byref(new_pos),
                M.mtmd_helper_post_decode_callback(0), None,
            )  # fmt: skip
            assert rc == 0
            pos = new_pos.value
            if t.mtp and pass_media_h:
                last_index = (c.num_cells - 1) % 256  # (in the helper's last batch of 256)
                t.mtp.after_media(0, last_index)
        return t.argmax(len(c.token_ids) - 1), pos


def test_an_image_in_the_prompt(pairs, model) -> None:
    mm = Multimodal(pairs["qwen35mtp"].mmproj, model, n_threads=1)
    try:
        assert mm.uses_mrope  # (positions may jump forward: the MTP cells skip the image's)
        base = Target(model, drafter=False)
        try:
            want = plain(base, *prefill_with_image(base, mm, False))
        finally:
            base.close()
        runs, first_logits = {}, {}
        for pass_media_h in (True, False):
            t = Target(model)
            try:
                first, pos = prefill_with_image(t, mm, pass_media_h)
                assert t.mtp
                # the MTP cells end with the target's: after the image it skipped
                end = L.llama_memory_seq_pos_max(t.memory, 0)
                assert L.llama_memory_seq_pos_max(t.mtp.memory, 0) == end == pos - 1
                first_logits[pass_media_h] = mtp_logits(t, 0, first, pos)
                runs[pass_media_h] = speculative(t, first, pos)
            finally:
                t.close()
    finally:
        mm.close()
    print(
        f"\nMTP acceptance after an image: with the image's h {rate(runs[True])}, "
        f"with a stale h {rate(runs[False])}"
    )
    for run in runs.values():
        assert run.tokens == want.tokens
        assert 0 < run.accepted < run.drafted
    # the image's h reached the MTP cell of the text token after the image (the only cell
    # the two runs fill differently; the tiny head barely shows it: ~4e-5)
    assert not np.array_equal(first_logits[True], first_logits[False])
