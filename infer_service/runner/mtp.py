"""Multi-token-prediction (MTP) drafting for speculative decoding, as llama.cpp's
``--spec-type draft-mtp`` does it (common/speculative.cpp, common_speculative_impl_draft_mtp),
for Qwen3.5 (``qwen35``) GGUFs that carry a nextn block (``llama_model_n_layer_nextn`` > 0).

Why: such a model ships its own draft head. One small decoder block, run on a second llama.cpp
context of the *same* model (``LLAMA_CONTEXT_TYPE_MTP``), predicts the token after next from
the target's last hidden state and the next token: no draft model to load, no vocabulary to
match, and it was trained with the model. The target then verifies the drafts in one decode,
as with any draft.

How (one MtpDrafter per target context; every call on the engine thread):

* The constructor turns on the target's nextn output (``llama_set_embeddings_nextn(ctx_tgt,
  true, masked=false)``: every decoded token's hidden state after the output norm, ``h``, by
  batch index) and makes the MTP context: ``ctx_type`` MTP, ``ctx_other`` the target,
  ``n_rs_seq`` 0, the target's batch sizes. For qwen35 its memory is a plain KV cache of the
  nextn layer alone (no recurrent state): cut anywhere.
* ``after_decode(rows)`` after each target llama_decode that held text: the catch-up decode
  (process()). Cell p of a sequence in the MTP context is (token x_p, h_{p-1}): each token is
  paired with the target's h of the previous row, the first with the sequence's pending row.
  The rows of the decode are kept (the verify rows) and the last becomes pending.
* ``draft(seq, last, pos, n_max, p_min)``: decodes (last, pending) at pos, takes the top token
  (llama.cpp: top-k 10 then data[0]; stops when its probability among those 10 is under
  p_min), feeds (token, the MTP's own h) at pos + 1, ... Its own cells are removed afterwards:
  the verify decode's catch-up writes those positions again, with the target's h.
* ``accept(seq, n)`` after verifying that decode (n drafts accepted): pending becomes verify
  row n (the h that predicted the bonus token) and the MTP cells past the accepted prefix
  (which pair rejected drafts) are removed. With no drafts there is nothing to call.
* ``rewind(seq, pos)`` / ``clear(seq)``: whatever removes target cells (evictions, a new
  prompt) removes the same MTP cells; ``close()``.

The target model must be loaded with ``llama_model_params.load_mtp`` true (slotwise's
native.load_model does not set it): otherwise llama.cpp skips the nextn tensors and making the
MTP context aborts the process (its graph reserve: GGML_ASSERT "MTP block missing
nextn.eh_proj"). Neither llama_model_n_params nor llama_model_size tells the two apart (both
count the skipped tensors), so this cannot be checked here.

Media: llama.cpp's process() skips embedding batches ("TODO: how to make it work with vision
tokens?"), and an MTP batch cannot carry an image embedding and an h row apart (an
embedding-only entry is read as both). So the MTP context simply lacks a media chunk's
positions. That is allowed: qwen35 uses M-RoPE, whose batches may jump forward in position,
and the text after the chunk keeps the target's positions. What the MTP head needs about the
image it still gets: every h after the image comes from the target, which attended to it;
only the MTP layer's own attention does not see the image's cells. Call ``after_media(seq,
last_index)`` after the decode holding the chunk's last embedding: the first text token after
the chunk is then paired with the target's h of the chunk's last embedding, not a stale row
from before the chunk. Drafts stay exact-or-rejected either way (the target verifies them);
only acceptance is at stake (tests/test_mtp.py measures it on the tiny model).

Sessions restored from a saved state (llama_state_seq_set_data on the target) come back
without MTP cells: draft quality drops until new text fills them (llama.cpp warns likewise in
begin()); save the MTP context's sequence too to avoid it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np

from slotwise_core import native_ext
from slotwise_core.native import NativeError

TOP_K = 10  # llama.cpp's MTP draft sampler: top-k 10, then the first candidate

# one target decode's text for one sequence: (seq_id, token ids, position of the first,
# batch index of the first); a sequence's tokens are consecutive in the batch
Row = tuple[int, Sequence[int], int, int]


@dataclass
class _Seq:
    pending: np.ndarray  # h to pair with the sequence's next token (n_embd,)
    verify: np.ndarray | None = None  # h rows of its last target decode (n, n_embd)
    verify_pos: int = 0  # the position of verify's first row


def top_token(logits: np.ndarray, k: int = TOP_K) -> tuple[int, float]:
    """The top token and its probability among the k best (softmax over their logits)."""
    k = min(k, logits.shape[0])
    best = np.argpartition(logits, -k)[-k:]
    top = logits[best].astype(np.float64)
    i = int(np.argmax(top))
    return int(best[i]), float(1.0 / np.exp(top - top[i]).sum())


class MtpDrafter:
    """Owns the MTP context of one target context (see the module docstring)."""

    def __init__(self, model: int, ctx_tgt: int, n_seq_max: int, n_ctx: int, threads: int):
        if llama_cpp.llama_model_n_layer_nextn(model) <= 0:
            raise NativeError("the model has no nextn (MTP) layers: no MTP drafting")
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        self.ctx_tgt = ctx_tgt
        self.ctx = 0
        self._batch = None
        native_ext.set_embeddings_nextn(ctx_tgt, True, False)  # h of every token, by index
        try:
            params = llama_cpp.llama_context_default_params()
            params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
            params.ctx_other = ctx_tgt
            params.n_rs_seq = 0
            params.n_ctx = n_ctx
            params.n_batch = llama_cpp.llama_n_batch(ctx_tgt)  # (a catch-up is a target batch)
            params.n_ubatch = llama_cpp.llama_n_ubatch(ctx_tgt)
            params.n_seq_max = n_seq_max
            params.n_threads = params.n_threads_batch = threads
            params.no_perf = True
            self.ctx = llama_cpp.llama_init_from_model(model, params) or 0
            if not self.ctx:
                raise NativeError("llama_init_from_model failed for the MTP context")
            native_ext.set_embeddings_nextn(self.ctx, True, True)  # h of its outputs
            self.memory = llama_cpp.llama_get_memory(self.ctx)
            self._batch = llama_cpp.llama_batch_ext_init(self.ctx)
            if not self._batch:
                raise NativeError("llama_batch_ext_init failed")
        except BaseException:
            self.close()
            raise
        self._pos = (llama_cpp.llama_pos * 4)()  # (a text token reads pos[0] only)
        self._seqs: dict[int, _Seq] = {}

    def _seq(self, seq: int) -> _Seq:
        s = self._seqs.get(seq)
        if s is None:  # (llama.cpp starts pending at zeros too)
            s = self._seqs[seq] = _Seq(np.zeros(self.n_embd, dtype=np.float32))
        return s

    def _add(self, seq: int, token: int, pos: int, h: np.ndarray, output: bool) -> int:
        b = self._batch
        idx = int(llama_cpp.llama_batch_ext_add_token(b, seq, token))
        if idx < 0:
            raise NativeError(f"llama_batch_ext_add_token({seq}, {token}) failed ({idx})")
        self._pos[0] = pos
        embd = llama_cpp.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, h.size)
        ok = llama_cpp.llama_batch_ext_set_pos(b, idx, self._pos)
        ok = ok and llama_cpp.llama_batch_ext_set_embd_token(b, idx, embd)  # (copied)
        ok = ok and (not output or llama_cpp.llama_batch_ext_set_output_logits(b, idx, True))
        if not ok:
            raise NativeError(f"could not fill MTP batch entry {idx}")
        return idx

    def _process(self) -> None:
        rc = int(
            llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        )
        if rc != 0:
            raise NativeError(f"llama_process on the MTP context failed (rc={rc})")

    def after_decode(self, rows: Sequence[Row]) -> None:
        """The catch-up decode after a target llama_decode whose text was `rows` (in batch
        order; no media). On a NativeError the sequences' MTP state is unknown: clear them."""
        if not rows:
            return
        seqs = [r[0] for r in rows]
        if len(set(seqs)) != len(seqs):
            raise ValueError("one row per sequence: its tokens are consecutive in the batch")
        n = max(first + len(tokens) for _, tokens, _, first in rows)
        h = np.ctypeslib.as_array(native_ext.get_embeddings_nextn(self.ctx_tgt), (n, self.n_embd))
        llama_cpp.llama_batch_ext_clear(self._batch)
        kept: list[tuple[_Seq, np.ndarray, int]] = []
        for seq, tokens, pos0, first in rows:
            if not tokens:
                continue
            s = self._seq(seq)
            for j, token in enumerate(tokens):
                self._add(seq, token, pos0 + j, s.pending if j == 0 else h[first + j - 1], False)
            kept.append((s, h[first : first + len(tokens)].copy(), pos0))
        self._process()
        for s, verify, pos0 in kept:
            s.verify, s.verify_pos, s.pending = verify, pos0, verify[-1].copy()

    def after_media(self, seq: int, last_index: int) -> None:
        """After the target decode holding a media chunk's last embedding (at batch index
        last_index): the next token pairs with its h. The MTP context gets no cells for it."""
        ptr = native_ext.get_embeddings_nextn_ith(self.ctx_tgt, last_index)
        s = self._seq(seq)
        s.pending, s.verify = np.ctypeslib.as_array(ptr, (self.n_embd,)).copy(), None

    def accept(self, seq: int, num_accepted: int) -> None:
        """After verifying the last target decode of seq ([last, d1..dk]): num_accepted of
        its drafts were kept."""
        s = self._seq(seq)
        if s.verify is None:
            return
        i = max(0, min(num_accepted, len(s.verify) - 1))
        s.pending = s.verify[i].copy()
        self.rewind(seq, s.verify_pos + i + 1)  # (those cells pair rejected drafts)
        s.verify = None

    def draft(self, seq: int, last_token: int, pos: int, n_max: int, p_min: float) -> list[int]:
        """Up to n_max tokens to follow last_token (not yet decoded by the target, at pos):
        greedy, stopping at the first whose top-10 probability is under p_min."""
        s = self._seq(seq)
        out: list[int] = []
        token, h = last_token, s.pending
        try:
            while len(out) < n_max:
                llama_cpp.llama_batch_ext_clear(self._batch)
                idx = self._add(seq, token, pos + len(out), h, True)
                self._process()
                ptr = llama_cpp.llama_get_logits_ith(self.ctx, idx)
                if not ptr:
                    raise NativeError("no logits from the MTP context")
                token, p = top_token(np.ctypeslib.as_array(ptr, (self.n_vocab,)))
                if p < p_min:
                    break
                out.append(token)
                ptr = native_ext.get_embeddings_nextn_ith(self.ctx, idx)
                h = np.ctypeslib.as_array(ptr, (self.n_embd,)).copy()
        finally:
            self.rewind(seq, pos)  # drafting's cells: the catch-up rewrites them with target h
        return out

    def rewind(self, seq: int, pos: int) -> None:
        """Remove seq's MTP cells from pos on (rejected drafts, an eviction)."""
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq, pos, -1):
            raise NativeError(f"llama_memory_seq_rm({seq}, {pos}, -1) failed on the MTP context")

    def clear(self, seq: int) -> None:
        """Forget seq (a new prompt, a freed slot): its cells and its pending row."""
        llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._seqs.pop(seq, None)

    def close(self) -> None:
        """Free the MTP context; the target stops writing nextn rows. Safe to call twice."""
        if self._batch:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = 0
        if self.ctx_tgt:
            native_ext.set_embeddings_nextn(self.ctx_tgt, False, False)
            self.ctx_tgt = 0
