"""A pytest plugin (``-p llama_suite_plugin``, loaded by run.py) that runs llama.cpp's own
server tests, unmodified, on local files: each preset that would download a model from the
hub gets the local tiny model of the same kind instead, and so does a test that downloads a
model itself (test_speculative's draft model). The test files, their conftest.py and utils.py
are not touched; their ``ServerPreset`` methods and ``download_file`` are wrapped here.

The models come in ``SLOTWISE_SUITE_MODELS`` (JSON: ``text``, ``vision``, and the vision
model's projector, which the shim adds as ``-hf`` adds a repository's mmproj).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import types
from typing import Any

# utils.py imports wget for download_file(); nothing here may download, so a download fails
# as it would offline (but for the models in _DOWNLOAD_MODEL, below), and the tests that need
# one fail (they are listed in the README)
if "wget" not in sys.modules:
    _wget = types.ModuleType("wget")

    def _no_download(url: str, out: str | None = None) -> str:
        raise RuntimeError(f"no downloads here: {url}")

    _wget.download = _no_download  # type: ignore[attr-defined]
    sys.modules["wget"] = _wget

# which local model stands in for each preset's hub model
_PRESET_MODEL = {
    "tinyllama2": "text",
    "tinyllama_infill": "text",
    "stories15m_moe": "text",
    "tinygemma3": "vision",
    "bert_bge_small": "text",
    "bert_bge_small_with_fa": "text",
    "jina_reranker_tiny": "text",
}
# which local model stands in for a model a test downloads itself: stories15M-q4_0 drafts for
# stories15m_moe, whose stand-in is the text model; a model is a valid draft of itself (the
# same vocabulary), so both servers draft with the tiny model for the tiny model
_DOWNLOAD_MODEL = {
    "https://huggingface.co/ggml-org/tiny-llamas/resolve/main/stories15M-q4_0.gguf": "text",
}


# the hub models the router tests name (test_router.py, test_stream.py), as a preset of local
# stand-ins: the router preset starts with it (a test that writes its own preset replaces it)
_ROUTER_MODELS = {
    "ggml-org/tinygemma3-GGUF:Q8_0": "vision",
    "ggml-org/test-model-stories260K:F32": "text",
    "ggml-org/test-model-stories260K-infill:F32": "text",
}


def _router_preset(models: dict[str, Any]) -> str:
    fd, path = tempfile.mkstemp(prefix="llama-suite-router-", suffix=".ini")
    with os.fdopen(fd, "w") as f:
        for name, kind in _ROUTER_MODELS.items():
            f.write(f"[{name}]\nmodel = {models[kind]}\n")
            if models[kind] in models["mmproj"]:
                f.write(f"mmproj = {models['mmproj'][models[kind]]}\n")
    return path


def _local_router(make: Any, preset_path: str) -> Any:
    @functools.wraps(make)
    def preset() -> Any:
        server = make()
        server.models_preset = preset_path
        return server

    return staticmethod(preset)


def _local(make: Any, path: str) -> Any:
    @functools.wraps(make)
    def preset() -> Any:
        server = make()
        server.model_hf_repo = None
        server.model_hf_file = None
        server.model_file = path
        return server

    return staticmethod(preset)


def _local_download(download: Any, models: dict[str, Any]) -> Any:
    @functools.wraps(download)
    def download_file(url: str, output_file_path: str | None = None) -> str:
        kind = _DOWNLOAD_MODEL.get(url)
        return models[kind] if kind is not None else download(url, output_file_path)

    return download_file


def pytest_configure(config: Any) -> None:
    import utils  # the vendored tests' own module (their folder is the rootdir)

    models = json.loads(os.environ["SLOTWISE_SUITE_MODELS"])
    presets = utils.ServerPreset
    for name, kind in _PRESET_MODEL.items():
        make = presets.__dict__.get(name)
        if make is not None:
            setattr(presets, name, _local(make.__func__, models[kind]))
    if "router" in presets.__dict__:
        presets.router = _local_router(presets.__dict__["router"].__func__, _router_preset(models))
    # before the test modules import it (`from utils import *` binds the wrapped one)
    utils.download_file = _local_download(utils.download_file, models)
    # load_all() starts every preset once to fill the download cache: nothing to download
    presets.load_all = staticmethod(lambda: None)
