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
A draft sequence left by another tenant (or salt) is cleared, never continued from: how fast a
shared prefix caught up would tell one tenant what another sent.

Engine thread only; the draft context is the engine's own, beside the target's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import llama_cpp
import numpy as np

from infer_service.runner.runtime import Runtime, RuntimeConfig
from slotwise_core import native

log = logging.getLogger("slotwise.engine")


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (another vocabulary)."""


class DraftModel:
    def __init__(self, config: RuntimeConfig, target: Runtime):
        self.runtime = Runtime(config)
        try:
            for who, rt in (("the target", target), ("the draft model", self.runtime)):
                if rt.recurrent:  # (a rejected guess cannot be cut out of a recurrent state)
                    raise DraftModelError(
                        f"{who}'s memory is {rt.memory_kind}: drafts cannot be taken back there"
                    )
            check_vocabulary(self.runtime, target)
        except BaseException:
            self.runtime.close()
            raise
        self._held: list[list[int]] = [[] for _ in range(self.runtime.num_slots)]
        self._owner: list[object] = [None] * self.runtime.num_slots
        self.num_decodes = 0
        self.seconds_per_draft = 0.0  # a moving average: what a drafted token costs here

    def close(self) -> None:
        self.runtime.close()

    def draft(
        self, seq: int, tokens: Sequence[int], k: int, p_min: float = 0.0, *, owner: object = None
    ) -> list[int]:
        """Up to k tokens that the draft model's greedy choice adds after `tokens` (the
        target's sequence, its last token decoded in this step); fewer where a guess is less
        likely than p_min, none while the draft's context is still catching up (a batch a
        step, as the target's own prefill goes), or where it cannot hold them. `owner`: whose
        sequence it is (a tenant and its salt): another's is never continued from."""
        if k <= 0 or not tokens or len(tokens) + k > self.runtime.num_cells_per_slot:
            return []
        if owner != self._owner[seq]:  # (how long a shared prefix took would tell)
            self.runtime.seq_rm(seq, 0, -1)
            self._held[seq], self._owner[seq] = [], owner
        if not self._caught_up(seq, tokens[:-1]):
            return []
        held, out, feed = self._held[seq], [], tokens[-1]
        t0, decodes = time.perf_counter(), 0
        for _ in range(k):
            logits = self._decode(seq, [feed], len(held))
            decodes += 1
            held.append(feed)
            token = int(np.argmax(logits))
            if p_min > 0 and _probability(logits, token) < p_min:
                break
            out.append(token)
            feed = token
        each = (time.perf_counter() - t0) / decodes
        self.seconds_per_draft += 0.1 * (each - self.seconds_per_draft)
        return out

    def _caught_up(self, seq: int, tokens: Sequence[int]) -> bool:
        """Bring the draft sequence toward holding exactly `tokens` at positions 0..n-1: their
        common prefix stays, the rest goes, and at most a batch of what is missing is decoded
        this step. Whether it holds them all now."""
        held = self._held[seq]
        same = 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            same += 1
        if same < len(held):
            self.runtime.seq_rm(seq, same, -1)
            del held[same:]
        missing = list(tokens[same : same + self.runtime.batch_size])
        if missing:
            self._decode(seq, missing, same, logits=False)
            held.extend(missing)
        return len(held) == len(tokens)

    def _decode(self, seq: int, tokens: list[int], pos: int, *, logits: bool = True) -> np.ndarray:
        b = self.runtime.batch
        b.clear()
        end = b.add(tokens, pos, seq, logits_last=logits)
        rc = self.runtime.decode()
        self.num_decodes += 1
        if rc != 0:
            self.runtime.seq_rm(seq, pos, -1)  # (a failed decode: the draft holds only what it did)
            del self._held[seq][pos:]
            raise native.NativeError(f"the draft model's llama_decode failed (rc={rc})")
        return self.runtime.logits(end) if logits else np.empty(0)


def check_vocabulary(draft: Runtime, target: Runtime) -> None:
    """The draft's token ids must mean the target's: the same size and the same pieces (of
    the special tokens and of a sample of the rest)."""
    if draft.num_vocab != target.num_vocab:
        raise DraftModelError(
            f"the draft model has {draft.num_vocab} tokens, the model {target.num_vocab}: "
            "drafts must be in the model's own token ids"
        )
    step = max(1, draft.num_vocab // 997)
    special = [
        f(target.vocab)
        for f in (llama_cpp.llama_vocab_bos, llama_cpp.llama_vocab_eos, llama_cpp.llama_vocab_eot)
    ]
    sample = {*range(0, draft.num_vocab, step), draft.num_vocab - 1}
    sample |= {t for t in special if 0 <= t < draft.num_vocab}
    for t in sorted(sample):
        if draft.piece(t) != target.piece(t) or draft.is_eog(t) != target.is_eog(t):
            raise DraftModelError(
                f"token {t} is {draft.piece(t)!r} to the draft model but {target.piece(t)!r} "
                "to the model: another vocabulary"
            )


def _probability(logits: np.ndarray, token: int) -> float:
    top = float(logits.max())
    return (
        float(1.0 / np.exp(logits.astype(np.float64) - top).sum()) if logits[token] >= top else 0.0
    )
