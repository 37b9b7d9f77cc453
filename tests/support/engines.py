"""An engine for tests in one call (vLLM's create_scheduler, here for the whole engine): the
runtime on a generated model, the engine on it, started; both closed after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from infer_service.engine.loop import Engine
from infer_service.runner.draft_model import DraftModel
from infer_service.runner.runtime import Runtime, RuntimeConfig


@contextlib.contextmanager
def running_engine(
    model: Path,
    *,
    parallel: int = 1,
    ctx_size: int = 1024,
    batch_size: int = 32,
    draft: bool = False,
    **engine: Any,
) -> Iterator[Engine]:
    """An engine on `model` (one compute thread, small batches: steps are cheap), the model
    as its own draft when `draft`; `engine` goes to Engine as it is."""
    config = RuntimeConfig(model, None, ctx_size=ctx_size, parallel=parallel, threads=1,
                           batch_size=batch_size, ubatch_size=batch_size)  # fmt: skip
    runtime = Runtime(config)
    try:
        drafts = DraftModel(config, runtime) if draft else None
        e = Engine(runtime, cache_bytes=engine.pop("cache_bytes", 0), draft_model=drafts, **engine)
        e.start()
        try:
            yield e
        finally:
            e.stop()
    finally:
        runtime.close()
