"""A draft model (`--model-draft`): a small model of the same vocabulary that guesses the
target's next tokens, verified in the target's step as n-gram drafts are.

Its context has a sequence per slot, and each holds what the target's sequence holds, token for
token at the same positions: before a slot drafts, its draft sequence is brought to the target's
(the ledger's text, in order) by keeping their common prefix, removing the rest (`seq_rm`) and
decoding what is missing. So whatever the target's ledger did since (a shift, an eviction, a
re-prefill, a session swapped in, drafts given back), the pair never disagrees about what is in
context: the draft's cells are the ledger's, recomputed where they differ. A shift that keeps a
sequence's tail moves only positions on the target; here it costs one decode of the tail, once.
A sequence holding media is not drafted for (a text-only draft model cannot see the image).

Engine thread only; the draft context is the engine's own, beside the target's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from infer_service.runtime import Runtime, RuntimeConfig
from slotwise_core import native

log = logging.getLogger("slotwise.engine")


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (another vocabulary)."""


class DraftModel:
    def __init__(self, config: RuntimeConfig, target: Runtime):
        self.rt = Runtime(config)
        try:
            check_vocabulary(self.rt, target)
        except BaseException:
            self.rt.close()
            raise
        self._held: list[list[int]] = [[] for _ in range(self.rt.num_slots)]
        self.num_decodes = 0
        self.seconds_per_draft = 0.0  # a moving average: what a drafted token costs here

    def close(self) -> None:
        self.rt.close()

    def draft(self, seq: int, tokens: Sequence[int], k: int, p_min: float = 0.0) -> list[int]:
        """Up to k tokens that the draft model's greedy choice adds after `tokens` (the
        target's sequence, its last token not yet decoded there); fewer where its choice is
        less likely than p_min, none where the draft's context cannot hold them."""
        if k <= 0 or not tokens or len(tokens) + k > self.rt.num_cells_per_slot:
            return []
        self._sync(seq, tokens[:-1])
        held, out, feed = self._held[seq], [], tokens[-1]
        t0 = time.perf_counter()
        for _ in range(k):
            logits = self._decode(seq, [feed], len(held))
            held.append(feed)
            token = int(np.argmax(logits))
            if p_min > 0 and _probability(logits, token) < p_min:
                break
            out.append(token)
            feed = token
        each = (time.perf_counter() - t0) / k
        self.seconds_per_draft += 0.1 * (each - self.seconds_per_draft)
        return out

    def _sync(self, seq: int, tokens: Sequence[int]) -> None:
        """Make the draft sequence hold exactly `tokens` at positions 0..n-1."""
        held = self._held[seq]
        same = 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            same += 1
        if same < len(held):
            self.rt.seq_rm(seq, same, -1)
            del held[same:]
        batch = self.rt.batch_size
        for start in range(same, len(tokens), batch):
            piece = list(tokens[start : start + batch])
            self._decode(seq, piece, start, logits=False)
            held.extend(piece)

    def _decode(self, seq: int, tokens: list[int], pos: int, *, logits: bool = True) -> np.ndarray:
        b = self.rt.batch
        b.clear()
        end = b.add(tokens, pos, seq, logits_last=logits)
        rc = self.rt.decode()
        self.num_decodes += 1
        if rc != 0:
            self.rt.seq_rm(seq, pos, -1)  # (a failed decode: the draft holds only what it did)
            del self._held[seq][pos:]
            raise native.NativeError(f"the draft model's llama_decode failed (rc={rc})")
        return self.rt.logits(end) if logits else np.empty(0)


def check_vocabulary(draft: Runtime, target: Runtime) -> None:
    """The draft's token ids must mean the target's: the same size and the same pieces (of
    every special token and a sample of the rest)."""
    if draft.num_vocab != target.num_vocab:
        raise DraftModelError(
            f"the draft model has {draft.num_vocab} tokens, the model {target.num_vocab}: "
            "drafts must be in the model's own token ids"
        )
    step = max(1, draft.num_vocab // 997)
    sample = [*range(0, draft.num_vocab, step), draft.num_vocab - 1]
    for t in sample:
        if draft.piece(t) != target.piece(t):
            raise DraftModelError(
                f"token {t} is {draft.piece(t)!r} to the draft model but {target.piece(t)!r} "
                "to the model: another vocabulary"
            )


def _probability(logits: np.ndarray, token: int) -> float:
    top = float(logits.max())
    return (
        float(1.0 / np.exp(logits.astype(np.float64) - top).sum()) if logits[token] >= top else 0.0
    )
