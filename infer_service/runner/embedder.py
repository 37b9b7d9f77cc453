"""Embeddings: the model's hidden states, mean-pooled, on a llama context of their own.

The context shares the loaded weights with the engine's but nothing else, and it runs on a
worker thread of its own: an embedding request never waits behind a generation step, and a
generation never waits for it (beyond the CPU they share).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llama_cpp
import numpy as np

from infer_service.runner.runtime import Runtime, TokenBatch
from slotwise_core import native

log = logging.getLogger("slotwise.embed")

MAX_TEXTS = 256  # per request


class EmbedError(ValueError):
    """A text this context cannot embed (too long, or empty)."""


@dataclass(frozen=True)
class Embedding:
    values: np.ndarray  # float32, n_embd
    num_tokens: int


class Embedder:
    def __init__(self, rt: Runtime, *, ctx_size: int, threads: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = ctx_size
        params.n_batch = params.n_ubatch = ctx_size  # pooling needs a whole text in one ubatch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        params.no_perf = True
        self.runtime = rt
        self.ctx = llama_cpp.llama_init_from_model(rt.model, params)
        if not self.ctx:
            raise native.NativeError("the embeddings context could not be made (too large?)")
        self.num_tokens_max = llama_cpp.llama_n_ctx(self.ctx)
        self.n_embd = llama_cpp.llama_model_n_embd(rt.model)
        self._memory = llama_cpp.llama_get_memory(self.ctx)
        self._batch = TokenBatch(self.num_tokens_max, 1)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")

    def close(self) -> None:
        """Waits for the embedding in progress; before the model is freed."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self.ctx:
            self._batch.close()
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def embed(self, texts: list[str], *, normalize: bool) -> Future[list[Embedding]]:
        """On the worker; raises EmbedError for a text it cannot take."""
        if not 0 < len(texts) <= MAX_TEXTS:
            raise EmbedError(f"give 1 to {MAX_TEXTS} texts, got {len(texts)}")
        return self._worker.submit(lambda: [self._one(t, normalize) for t in texts])

    def _one(self, text: str, normalize: bool) -> Embedding:
        tokens = native.tokenize_text(
            self.runtime.vocab, text, add_special=True, parse_special=False
        )
        if not tokens:
            raise EmbedError("an empty text has no embedding")
        if len(tokens) > self.num_tokens_max:
            raise EmbedError(
                f"a text of {len(tokens)} tokens: the embeddings context holds "
                f"{self.num_tokens_max} (--embeddings-ctx)"
            )
        llama_cpp.llama_memory_clear(self._memory, True)
        batch = self._batch
        batch.clear()
        batch.add(tokens, 0, 0, logits_last=False)
        batch.logits[: len(tokens)] = 1  # every token's state goes into the mean
        rc = llama_cpp.llama_decode(self.ctx, batch.native)
        if rc != 0:
            raise native.NativeError(f"llama_decode of an embedding failed (rc={rc})")
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        values = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
        if normalize:
            norm = float(np.linalg.norm(values))
            values = values / norm if norm > 0 else values
        return Embedding(values.astype(np.float32), len(tokens))
