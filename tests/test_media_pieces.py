"""Embeddings decoded in pieces by the engine (between other slots' steps) leave the cache
libmtmd's own helper leaves when it splits the chunk the same way: the next token's logits are
the same, bit for bit (and, pieces or not, within float noise of one whole batch)."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from llama_cpp import mtmd_cpp

from infer_service.runner.media import media_handle
from infer_service.runner.runtime import Runtime, RuntimeConfig
from slotwise_core.images import decode_image
from slotwise_core.native import Bitmap
from support.media import image_bytes


def logits_after_image(pair, pieces: int, *, helper: bool) -> np.ndarray:
    rt = Runtime(RuntimeConfig(pair.model, pair.mmproj, ctx_size=1024, threads=1))
    try:
        img = decode_image(image_bytes(112, 84, seed=2))
        handle = media_handle(rt.mtmd, "k", Bitmap(img.width, img.height, img.rgb, img.media_id))
        rt.batch.clear()
        rt.batch.add([1, 2, 3, 4], 0, 0, logits_last=False)
        assert rt.decode() == 0
        embd = rt.encode_media(handle.chunk)
        n = embd.size // rt.n_embd
        if helper:
            end = rt.decode_media(handle.chunk, embd, 4, 0, n_batch=pieces)
        else:
            positions = rt.media_positions(handle.chunk, 4)
            whole = rt.non_causal(handle.chunk)
            step = n if whole else pieces
            for off in range(0, n, step):
                assert rt.decode_embeddings(embd, positions, off, min(step, n - off), 0, whole) == 0
            end = 4 + int(mtmd_cpp.mtmd_input_chunk_get_n_pos(handle.chunk))
        rt.batch.clear()
        last = rt.batch.add([5], end, 0, logits_last=True)
        assert rt.decode() == 0
        ptr = llama_cpp.llama_get_logits_ith(rt.ctx, last)
        out = np.ctypeslib.as_array(ptr, shape=(rt.num_vocab,)).copy()
        handle.close()
        return out
    finally:
        rt.close()


@pytest.mark.parametrize("pair", ["mrope", "rope", "noncausal"])
def test_pieces_equal_the_whole_chunk(tiny, pair: str) -> None:
    pieces = 512 if pair == "noncausal" else 7  # a non-causal image goes whole, one ubatch
    ours = logits_after_image(tiny[pair], pieces, helper=False)
    np.testing.assert_array_equal(ours, logits_after_image(tiny[pair], pieces, helper=True))
    whole = logits_after_image(tiny[pair], 512, helper=True)
    np.testing.assert_allclose(ours, whole, rtol=1e-3, atol=1e-3)
