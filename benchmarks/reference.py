"""The reference: llama-cpp-python's low-level API in this process, no slotwise code. A loaded
text model, and the decode loop every ratio against "the raw loop" is taken over."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.results import BenchError, Stream


class RawModel:
    """A loaded text model; contexts made from it decode the same way the engine's does."""

    _log_callback: Any = None

    def __init__(self, path: Path, gpu_layers: int = 0):
        import llama_cpp

        self.ll = llama_cpp
        if RawModel._log_callback is None and not os.environ.get("SLOTWISE_NATIVE_LOGS"):
            RawModel._log_callback = llama_cpp.llama_log_callback(lambda level, text, data: None)
            llama_cpp.llama_log_set(RawModel._log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        from slotwise_core import native

        params = llama_cpp.llama_model_default_params()
        # the same buffers infer picks: the comparison is of the loops, not of matmul kernels
        params.use_extra_bufts, _ = native.extra_bufts_decision(
            native.cpu_flags(), native.amx_tile_permission
        )
        params.n_gpu_layers = gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise BenchError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        cap = len(data) + 16
        buf = (self.ll.llama_token * cap)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, cap, True, True)
        if n < 0:
            raise BenchError("tokenize failed")
        return list(buf[:n])

    def close(self) -> None:
        self.ll.llama_model_free(self.model)


class RawContext:
    """The reference decode loop: every live sequence's token in one llama_decode per step."""

    def __init__(
        self, model: RawModel, *, n_ctx: int, n_seq: int, threads: int, n_batch: int = 512
    ):
        ll = self.ll = model.ll
        self.m = model
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = False
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise BenchError("llama_init_from_model failed")
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = ll.llama_batch_init(n_batch, 0, n_seq)
        self.sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(self.sampler, ll.llama_sampler_init_greedy())
        self.piece_buf = ctypes.create_string_buffer(256)

    def close(self) -> None:
        self.ll.llama_sampler_free(self.sampler)
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise BenchError(f"llama_decode returned {rc}")

    def _sample(self, index: int) -> tuple[int, bool]:
        ll = self.ll
        token = ll.llama_sampler_sample(self.sampler, self.ctx, index)
        if ll.llama_vocab_is_eog(self.m.vocab, token):
            return token, True
        ll.llama_token_to_piece(self.m.vocab, token, self.piece_buf, 256, 0, True)  # detokenise
        return token, False

    def _prefill(self, seq: int, tokens: Sequence[int]) -> int:
        """Decode a prompt in batches; returns the first generated token (-1: end at once)."""
        index = 0
        for start in range(0, len(tokens), self.n_batch):
            part = tokens[start : start + self.n_batch]
            last = start + len(part) == len(tokens)
            self._decode(
                [(t, start + k, seq, last and k == len(part) - 1) for k, t in enumerate(part)]
            )
            index = len(part) - 1
        token, eog = self._sample(index)
        return -1 if eog else token

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Stream]:
        """Greedy: prefill every prompt, then one llama_decode per step for all live ones."""
        streams = [Stream(t_sent=time.perf_counter()) for _ in prompts]
        pos = [len(t) for t in prompts]
        last: list[int] = []
        for seq, tokens in enumerate(prompts):
            self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
            token = self._prefill(seq, tokens)
            last.append(token)
            if token >= 0:
                streams[seq].token_ids.append(token)
                streams[seq].add(time.perf_counter(), 1)
        live = [seq for seq, token in enumerate(last) if token >= 0 and max_tokens > 1]
        while live:
            self._decode([(last[seq], pos[seq], seq, True) for seq in live])
            got = []
            for i, seq in enumerate(live):
                pos[seq] += 1
                token, eog = self._sample(i)
                if not eog:
                    streams[seq].token_ids.append(token)
                    last[seq] = token
                    got.append(seq)
            t = time.perf_counter()
            for seq in got:
                streams[seq].add(t, 1)
            live = [seq for seq in got if len(streams[seq].token_ids) < max_tokens]
        for seq in range(len(prompts)):
            self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return streams

    def tokens(self, prompt: Sequence[int], max_tokens: int) -> Iterator[int]:
        """Sequence 0's greedy tokens as they come, one llama_decode each."""
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        token, pos = self._prefill(0, prompt), len(prompt)
        for _ in range(max_tokens):
            if token < 0:
                return
            yield token
            self._decode([(token, pos, 0, True)])
            pos += 1
            token, eog = self._sample(0)
            token = -1 if eog else token

    def time_to_first_token(self, text: str) -> float:
        """Tokenize, prefill and sample one token, in process."""
        t0 = time.perf_counter()
        tokens = self.m.tokenize(text)
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        self._prefill(0, tokens)
        dt = time.perf_counter() - t0
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        return dt
