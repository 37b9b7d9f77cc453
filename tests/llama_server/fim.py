"""A tiny model with fill-in-the-middle tokens, for /infill: the rope pair's text model, whose
<tool_call>, </tool_call> and [TOOL_CALLS] tokens its vocabulary names FIM prefix, suffix and
middle (the tokens are special already: the names are all that a FIM model has more)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slotwise_core import tiny_models as tiny


def write_fim_model(out_dir: Path) -> Path:
    names = {"pre": "<tool_call>", "suf": "</tool_call>", "mid": "[TOOL_CALLS]"}

    def fim(w: Any) -> None:
        for name, token in names.items():
            w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", tiny.token_id(token))

    path = out_dir / "fim" / "model.gguf"
    kv = tiny._text_kv("llama", "gpt-2", fim)
    tiny._write(path, "llama", kv, tiny._text_tensors(tiny._SEEDS["rope"]))
    return path
