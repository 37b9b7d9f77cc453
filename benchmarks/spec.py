"""The spec section of slotwise bench: speculative decoding with n-gram drafts, against the
same server without drafts and against llama-server with its own n-gram drafts.

The tasks are what people give local models and where the reply repeats its context: copy a
source file, the same file with one rename (both as a chat, in Gemma's turns), a JSON that
quotes a document, a chat asked to say again what it said; and free text (a story), where
drafts must cost nothing. Greedy, raw completion prompts (the same text to both servers),
--tokens each (300 at least: a copy needs room to run). Rates are streamed tokens/s, as
everywhere in the bench.

llama-server runs twice, `--spec-type ngram-simple` and `--spec-type ngram-map-k` (its
defaults otherwise); the reference for slotwise's drafts is the faster of the two in each
repeat. Acceptance rates (accepted / drafted) are printed for every side that drafts.

Greedy tokens with and without drafts: on the F32 tiny pairs they are the same, token for
token (tests/test_speculative.py); on a quantized model on the CPU llama.cpp's kernels round
a batch of several tokens differently from one token, so a near-tie can go the other way. The
note says where the first difference is, beside where the same engine without drafts first
differs when another stream shares its batch: the same cause, with no draft involved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.calls import concurrently, generate, prepare_text
from benchmarks.harness import Bench
from benchmarks.results import Row, Stream, compared, streamed_rate
from benchmarks.servers import LlamaServer
from slotwise.v1 import infer_pb2, prep_pb2

TEXTS = Path(__file__).parent / "texts"
COPY_TASKS = ("copy", "edit", "json", "chat")
TARGET_COPY, TARGET_FREE, TARGET_SERVER, TARGET_STREAMS4 = ">= 2.4", ">= 0.97", ">= 1.0", ">= 1.5"
ROW_BESIDE = "spec: greedy, no drafts: tokens alike alone and beside another stream"
ROW_STREAMS4 = "spec copy, 4 streams: tok/s drafts / none"


def row_drafts(task: str) -> str:
    return f"spec {task}: tok/s drafts / none"


def row_server(task: str) -> str:
    return f"spec {task}: slotwise drafts / llama-server's best n-gram"


def tasks(lines: int | None = None) -> dict[str, str]:
    """The prompts; `lines`: only the first lines of the file and the document (a model whose
    context is too small for the whole of them)."""
    code = "".join((TEXTS / "code.py.txt").read_text().splitlines(keepends=True)[:lines])
    first = code.splitlines()[0]
    document = "".join((TEXTS / "document.md.txt").read_text().splitlines(keepends=True)[:lines])
    said = document.split("\n\n")[0]
    return {
        "copy": f"<start_of_turn>user\nHere is a file:\n```python\n{code}```\nCopy the file "
        f"exactly.<end_of_turn>\n<start_of_turn>model\n```python\n{first}\n",
        "edit": f"<start_of_turn>user\nHere is a file:\n```python\n{code}```\nRename "
        "`_MAX_DIGITS` to `MAX_DIGITS` and show the whole file.<end_of_turn>\n"
        f"<start_of_turn>model\n```python\n{first}\n",
        "json": f"{document}\n\nThe document above as JSON, its first paragraph quoted word for "
        'word:\n{"title": "slotwise", "first_paragraph": "',
        "chat": f"<start_of_turn>user\nWhat does slotwise do?<end_of_turn>\n<start_of_turn>model\n"
        f"{said}<end_of_turn>\n<start_of_turn>user\nSay that again, word for word."
        "<end_of_turn>\n<start_of_turn>model\n",
        "story": "Chapter one. The rain had not stopped for three days when the old lighthouse "
        "keeper finally decided to walk down to the village. He took his coat and",
    }


def drafts(kind: int = infer_pb2.SPEC_TYPE_NGRAM_SIMPLE) -> infer_pb2.SpeculativeOptions:
    return infer_pb2.SpeculativeOptions(type=kind)


NO_DRAFTS = infer_pb2.SpeculativeOptions(type=infer_pb2.SPEC_TYPE_NONE)


def acceptance(streams: list[Stream]) -> str:
    drafted = sum(s.drafted for s in streams)
    accepted = sum(s.accepted for s in streams)
    return f"{accepted}/{drafted} = {accepted / drafted:.2f}" if drafted else "no drafts"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two greedy runs differ (None: they are the same)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return None if n is None and len(a) == len(b) else (n or min(len(a), len(b)))


def said(a: list[int], b: list[int]) -> str:
    n = first_difference(a, b)
    return "none (the same tokens)" if n is None else f"at token {n} of {max(len(a), len(b))}"


def run(b: Bench) -> None:
    n = b.o.spec_tokens
    info = b.prep.GetModelInfo(prep_pb2.GetModelInfoRequest(), timeout=10).info
    lines: int | None = None
    while True:  # (the whole texts, unless the model's context cannot hold them)
        texts = tasks(lines)
        prompts = {name: prepare_text(b.prep, text) for name, text in texts.items()}
        longest = max(sum(len(c.text.token_ids) for c in p.chunks) for p in prompts.values())
        if longest + n + 64 <= info.n_ctx_train or lines == 1:
            break
        lines = max(1, (lines or 100) // 2)
    ctx = min(info.n_ctx_train, 1 << (longest + n + 64).bit_length())  # cells per slot
    simple, map_k = ("--spec-type", "ngram-simple"), ("--spec-type", "ngram-map-k")
    with (
        b.infer(ctx=ctx, parallel=1) as infer,
        b.llama_server(ctx=ctx, parallel=1, extra=simple) as server_simple,
        b.llama_server(ctx=ctx, parallel=1, extra=map_k) as server_map_k,
    ):
        servers = {"simple": server_simple, "map-k": server_map_k}
        for name, prompt in prompts.items():
            _task(b, name, texts[name], prompt, n, infer, servers)
        b.rows.append(_beside_another_stream(b, prompts["copy"], n, ctx))
    _streams4(b, prompts["copy"], n, ctx)


def _task(
    b: Bench,
    name: str,
    text: str,
    prompt: Any,
    n: int,
    infer: Any,
    servers: dict[str, LlamaServer | None],
) -> None:
    seen: dict[str, Stream] = {}

    def ours(key: str, spec: infer_pb2.SpeculativeOptions) -> Callable[[], float]:
        def run() -> float:
            s = seen[key] = generate(infer, prompt, n, speculative=spec)
            return streamed_rate([s])

        return run

    def theirs(key: str, srv: LlamaServer) -> Callable[[], float]:
        def run() -> float:
            s = seen[key] = srv.generate(text, n)
            return streamed_rate([s])

        return run

    runs = {"none": ours("none", NO_DRAFTS), "drafts": ours("drafts", drafts())}
    runs |= {key: theirs(key, srv) for key, srv in servers.items() if srv is not None}
    for fn in runs.values():  # warm-up: the prompt decoded once on every side
        fn()
    res = b.interleaved(runs, b.o.repeats)
    rates = ", ".join(f"llama-server {k} {acceptance([seen[k]])}" for k in servers if k in seen)
    note = (
        f"{n} tokens; accepted/drafted: slotwise {acceptance([seen['drafts']])}"
        + (f", {rates}" if rates else "")
        + "; greedy drafts vs none: first difference "
        + said(seen["none"].token_ids, seen["drafts"].token_ids)
    )
    target = TARGET_FREE if name == "story" else TARGET_COPY
    b.rows.append(compared(row_drafts(name), res["drafts"], res["none"], "tok/s", target, note))
    if "simple" in res and "map-k" in res:
        best = [max(x, y) for x, y in zip(res["simple"], res["map-k"], strict=True)]
        target = TARGET_SERVER if name != "story" else ""
        b.rows.append(compared(row_server(name), res["drafts"], best, "tok/s", target))


def _beside_another_stream(b: Bench, prompt: Any, n: int, ctx: int) -> Row:
    """Where the engine without drafts first differs from itself when another stream shares
    its batch (the batch's kernels round differently: the same cause as drafts')."""
    other = prepare_text(b.prep, "Once upon a time, in a small village by the sea,")
    with b.infer(ctx=2 * ctx, parallel=2) as infer:
        alone = generate(infer, prompt, n, speculative=NO_DRAFTS)
        started = threading.Event()

        def beside() -> None:
            generate(infer, other, 2 * n, speculative=NO_DRAFTS, on_token=started.set)

        thread = threading.Thread(target=beside, daemon=True)
        thread.start()
        started.wait(120)
        shared = generate(infer, prompt, n, speculative=NO_DRAFTS)
        thread.join(600)
    where = first_difference(alone.token_ids, shared.token_ids)
    note = (
        f"the same tokens until token {where} of {n}: a batch's kernels round differently, "
        "as drafts' do"
        if where is not None
        else f"the same {n} tokens"
    )
    return Row(ROW_BESIDE, float(n if where is None else where), "tokens", note=note)


def _streams4(b: Bench, prompt: Any, n: int, ctx: int) -> None:
    seen: dict[str, list[Stream]] = {}
    with b.infer(ctx=ctx * 4, parallel=4) as infer:

        def four(key: str, spec: infer_pb2.SpeculativeOptions) -> Callable[[], float]:
            def one() -> Stream:
                return generate(infer, prompt, n, speculative=spec)

            def run() -> float:
                streams = seen[key] = concurrently([one] * 4)
                return streamed_rate(streams)

            return run

        runs = {"none": four("none", NO_DRAFTS), "drafts": four("drafts", drafts())}
        for fn in runs.values():
            fn()
        res = b.interleaved(runs, b.o.repeats)
    note = f"accepted/drafted {acceptance(seen['drafts'])}"
    b.rows.append(
        compared(ROW_STREAMS4, res["drafts"], res["none"], "tok/s", TARGET_STREAMS4, note)
    )
