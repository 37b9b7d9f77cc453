"""How many prompt tokens one engine step may decode while other slots generate (stdlib only).

A step decodes every generating slot's next token together with some prompt, and each of
those slots waits for the whole step. A long prompt that took a whole batch per step would
hold them for a batch's time per token (vLLM splits prompts, "chunked prefill", for the same
reason). So while others generate, a prompt goes in pieces of about 1/PIECES of its size: the
others' longest wait is then about that share of its time to first token, on any machine. A
piece is never smaller than MIN_PIECE tokens per generating slot (their tokens, decoded with
each piece, then cost the prompt little) and never larger than a batch.
"""

from __future__ import annotations

PIECES = 32  # a prompt goes in about this many pieces while others generate
MIN_PIECE = 32  # prompt tokens a step takes per generating slot, at least
# pieces are whole multiples of this: llama.cpp's CPU matmuls run slower on other sizes
# (Gemma 3 270M, 5,800 tokens beside a generating slot: in 256-token pieces 15.5 s, in 224-
# or 192-token ones 17.5-20 s; alone in whole batches 14.5 s)
ALIGN = 128


def prefill_budget(batch_size: int, num_generating: int, num_prompt_cells: int) -> int:
    """Prompt tokens (or media embeddings) one slot may decode in this step."""
    if num_generating == 0:
        return batch_size
    piece = max(-(-num_prompt_cells // PIECES), MIN_PIECE * num_generating)
    return max(1, min(batch_size, -(-piece // ALIGN) * ALIGN))
