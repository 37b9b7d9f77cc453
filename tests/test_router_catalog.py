"""The models a router finds in a folder and a preset (model_router/catalog.py, pure), and the
flags each model's process gets (slotwise_serve/router_command.py): llama-server's INI as its
README writes it, keys long, short or LLAMA_ARG_*, command line > section > `[*]`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from model_router.catalog import CatalogError, parse_preset, read_catalog
from slotwise_serve.router_command import child_arguments
from slotwise_serve.serve_command import parser


@pytest.fixture(scope="module")
def serve() -> argparse.ArgumentParser:
    return parser()


def _is_switch(p: argparse.ArgumentParser):  # type: ignore[no-untyped-def]
    return {o: a.nargs == 0 for a in p._actions for o in a.option_strings}.get


def _gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """What argparse reads: the last one given."""
    value = None
    for i, word in enumerate(args[:-1]):
        if word == flag:
            value = args[i + 1]
    return value


def test_a_folder_as_llama_server_reads_it(tmp_path: Path, serve: argparse.ArgumentParser) -> None:
    single = _gguf(tmp_path / "llama-3.2-1b-Q4_K_M.gguf")
    _gguf(tmp_path / "mmproj-stray.gguf")  # a projector alone is no model
    model = _gguf(tmp_path / "gemma-3-4b" / "gemma-3-4b-it-Q8_0.gguf")
    projector = _gguf(tmp_path / "gemma-3-4b" / "mmproj-F16.gguf")
    _gguf(tmp_path / "kimi" / "kimi-00002-of-00002.gguf")
    first = _gguf(tmp_path / "kimi" / "kimi-00001-of-00002.gguf")
    _gguf(tmp_path / "kimi" / "mtp-kimi.gguf")  # a draft head beside it, not the model
    (tmp_path / "empty").mkdir()
    catalog = read_catalog(tmp_path, None, _is_switch(serve))
    found = {e.name: (e.model, e.mmproj) for e in catalog.entries}
    assert found == {
        "llama-3.2-1b-Q4_K_M": (single, None),
        "gemma-3-4b": (model, projector),
        "kimi": (first, None),
    }


def test_a_preset_with_every_kind_of_key(tmp_path: Path, serve: argparse.ArgumentParser) -> None:
    model = _gguf(tmp_path / "models" / "coder.gguf")
    preset = tmp_path / "models.ini"
    preset.write_text(f"""version = 1
; every model
[*]
c = 8192
LLAMA_ARG_N_PARALLEL = 2
kv-unified = true

# llama-server's names and slotwise's own
[coder] ; the one we use most
model = {model}
ctx-size = 4096 ; the section's wins
ngl = 99
jinja = true
alias = code,coder-latest
load-on-startup = true
stop-timeout = 3
max-queue = 7
host = 0.0.0.0

[from-the-hub]
hf-repo = ggml-org/tinygemma3-GGUF
""")
    catalog = read_catalog(None, preset, _is_switch(serve))
    coder = catalog.find("code")
    assert coder is not None and coder.name == "coder" and catalog.find("coder-latest") is coder
    assert coder.model == model and coder.load_on_startup and coder.stop_timeout == 3
    # [*]'s c, then the section's ctx-size: the section's is read last, and wins
    assert _flag_value(coder.args, "--ctx-size") == "4096"
    assert _flag_value(coder.args, "--parallel") == "2"
    assert _flag_value(coder.args, "--gpu-layers") == "99"
    assert _flag_value(coder.args, "--max-queue") == "7"
    assert "--kv-unified" in coder.args and "--jinja" not in coder.args  # (slotwise: always)
    assert "--host" not in coder.args  # (the router's, for each model's process)
    hub = catalog.find("from-the-hub")
    assert hub is not None and hub.model is None and "downloads nothing" in (hub.problem or "")
    # parsed back by slotwise serve itself: every word is one of its flags
    serve.parse_args(["--models-preset", str(preset), *coder.args])


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ("[m]\nnot-a-flag = 1\n", "[m] --not-a-flag"),
        ("[m]\njinja = maybe\n", "[m] jinja: a switch"),
        ("[m]\nload-on-startup = sometimes\n", "[m] load-on-startup"),
        ("[m]\nstop-timeout = -1\n", "[m] stop-timeout"),
        ("[m]\ngrp-attn-n = 4\n", "[m] --grp-attn-n: no group attention"),
        ("[m]\njust words\n", "expected `key = value`"),
        ("[a]\nalias = b\n[b]\nmodel = x.gguf\n", "the name 'b' is both"),
    ],
)
def test_a_preset_key_slotwise_cannot_honour_is_refused_naming_it(
    tmp_path: Path, serve: argparse.ArgumentParser, section: str, says: str
) -> None:
    preset = tmp_path / "p.ini"
    preset.write_text(section)
    with pytest.raises(CatalogError) as e:
        read_catalog(None, preset, _is_switch(serve))
    assert says in str(e.value)


def test_ini_sections_and_comments() -> None:
    star, sections = parse_preset("a = 1\n[*]\nc = 2 \n; x = y\n[m]\n k = v = w # why\n[n]\n")
    assert star == {"c": "2"}
    assert sections == {"m": {"k": "v = w"}, "n": {}}


def test_the_command_line_comes_last_and_the_router_keeps_its_own(
    serve: argparse.ArgumentParser,
) -> None:
    takes_value = {o: a.nargs != 0 for a in serve._actions for o in a.option_strings}
    argv = ["--models-dir", "m", "--models-max", "2", "--no-models-autoload", "--ctx-size",
            "1024", "--http-port=8080", "--host", "0.0.0.0", "--cors-origins", "a", "b",
            "--sessions-dir", "s", "--kv-unified", "--sleep-idle-seconds", "5"]  # fmt: skip
    assert child_arguments(argv, takes_value) == [
        "--ctx-size", "1024", "--cors-origins", "a", "b", "--kv-unified"
    ]  # fmt: skip


# -- what a model will hold (model_router/memory.py) -------------------------------------------


def test_the_header_walk_reads_what_gguf_py_reads(tiny) -> None:  # type: ignore[no-untyped-def]
    from gguf import GGUFReader

    from model_router.memory import read_header

    for name in ("rope", "mrope", "qwen35"):
        for path in (tiny[name].model, tiny[name].mmproj):
            meta, weights = read_header(path)
            reference = GGUFReader(path)
            assert weights == sum(int(t.n_bytes) for t in reference.tensors)
            for key, field in reference.fields.items():
                if key.startswith("GGUF.") or key.startswith("tokenizer.ggml."):
                    continue
                value = field.contents()
                assert meta[key] == value, (path, key)


def test_a_split_model_counts_every_part(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from model_router.memory import estimate

    parts = []
    for k in (1, 2, 3):
        path = tmp_path / f"big-{k:05d}-of-00003.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint16("split.no", k - 1)
        w.add_uint16("split.count", 3)
        if k == 1:
            w.add_block_count(2)
            w.add_embedding_length(64)
            w.add_head_count(4)
        w.add_tensor(f"t{k}", np.zeros((256, 64 * k), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        parts.append(path)
    assert estimate(parts[0], None, ["--ctx-size", "256"], 4096).weights == 4 * 256 * 64 * 6
