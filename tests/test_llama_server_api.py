"""llama-server's native API as llama-server's users drive it: plain HTTP (httpx) with
llama-server's own request bodies, against real prep, infer and gateway servers on the tiny
`rope` pair. Every answer is compared, field by field, with llama-server's own answer to the
same request on the same model (tests/llama_server/recorded.json, which
tests/llama_server/record.py writes with the llama-server that llama-cpp-python 0.3.36
vendors): the same status, the same fields, of the same JSON types, with the same values
except where llama-server's own values change from run to run (ids, clocks) and where slotwise
differs on purpose; those differences are listed below (DIFFERENCES) and in README.md, and a
difference that no longer occurs fails the test too.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llama_server.cases import (
    CASES,
    EMBEDDING_CASES,
    FIM_CASES,
    NO_SLOT_PATH_CASES,
    answer,
)
from llama_server.fim import write_fim_model

from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks
from support.loop import LoopThread

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "llama_server" / "recorded.json").read_text())

# Values llama-server itself changes from run to run: compared by their JSON type only. (Which
# slot serves a request is each server's own choice, but not where id_slot pins it: EXACT.)
VARIES = (
    "*.timings.*",
    "*.time_ms",
    "*.created",
    "*.id",
    "*.body.id_slot",
    "*.body.*.id_slot",
    "*.events.*.id_slot",
)
EXACT = ("completion_slot0*.body.id_slot",)

# Where slotwise answers otherwise on purpose: path pattern -> (what differs, the words that
# README.md's list of differences uses for it). What differs: "value" (the same field, of the
# same type, another value), "missing" (llama-server's field, not slotwise's), "extra"
# (slotwise's own field), "type", or "any".
DIFFERENCES: dict[str, tuple[str, str]] = {
    "props.body.slotwise": ("extra", "`slotwise` object"),
    "slots.body.*.slotwise": ("extra", "`slotwise` object"),
    "*.usage.slotwise": ("extra", "`usage.slotwise`"),
    "*.build_info": ("value", "`build_info`"),
    "*.system_fingerprint": ("value", "`system_fingerprint`"),
    "*.model": ("value", "`--model-name`"),
    "props.body.model_alias": ("value", "`--model-name`"),
    "props.body.model_path": ("value", "`model_path`"),
    "props.body.model_ftype": ("value", "`model_ftype`"),
    "props.body.endpoint_metrics": ("value", "`endpoint_metrics`"),
    "props.body.modalities.video": ("value", "video"),
    "completion_json_schema.body.*": ("value", "json_schema"),
    "completion_no_prompt.body.error.message": ("value", "JSON library"),
    "infill_no_suffix.*": ("value", "never a 500"),
    "infill_*.body.content": ("value", "special tokens"),
    "slot_save_off.body.error.message": ("value", "`--sessions-dir`"),
    "completion_bad_type.body.error.message": ("value", "JSON library"),
    "rerank.body.error.message": ("value", "reranking"),
    "props_post.body.error.message": ("value", "POST /props"),
    "slot_save.body.n_written": ("value", "`n_written`"),
    "slot_restore.body.n_read": ("value", "`n_read`"),
    "slot_bad_id.*": ("any", "Invalid slot ID"),
    "completion_stream.events.[01].tokens": ("value", "`tokens` of a `prompt_progress`"),
    "chat*.choices.*.logprobs": ("extra", "OpenAI's own fields"),
    "chat*.message.refusal": ("extra", "OpenAI's own fields"),
    "*.usage.completion_tokens_details": ("extra", "OpenAI's own fields"),
    "chat_*.body.error.*": ("any", "OpenAI's error shape"),
}


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    return type(v).__name__


def differences(expected: Any, got: Any, path: str) -> list[tuple[str, str, Any, Any]]:
    """(path, what, llama-server's, slotwise's) for each field that differs."""
    if _kind(expected) != _kind(got):
        return [(path, "type", expected, got)]
    if isinstance(expected, dict):
        out = []
        for k in expected.keys() - got.keys():
            out.append((f"{path}.{k}", "missing", expected[k], None))
        for k in got.keys() - expected.keys():
            out.append((f"{path}.{k}", "extra", None, got[k]))
        for k in expected.keys() & got.keys():
            out += differences(expected[k], got[k], f"{path}.{k}")
        return out
    if isinstance(expected, list):
        if len(expected) != len(got):
            return [(path, "length", len(expected), len(got))]
        return [
            d
            for i, (e, g) in enumerate(zip(expected, got, strict=True))
            for d in differences(e, g, f"{path}.{i}")
        ]
    exact = any(fnmatch.fnmatchcase(path, p) for p in EXACT)
    if expected == got or (not exact and any(fnmatch.fnmatchcase(path, p) for p in VARIES)):
        return []
    if isinstance(expected, float) and isinstance(got, float) and abs(expected - got) < 1e-5:
        return []
    return [(path, "value", expected, got)]


def allowed(path: str, what: str) -> str | None:
    """The DIFFERENCES pattern that allows this difference, if one does."""
    for pattern, (kind, _) in DIFFERENCES.items():
        what = "value" if what == "length" else what
        if fnmatch.fnmatchcase(path, pattern) and kind in (what, "any"):
            return pattern
    return None


def request(stack: Stack, case: dict[str, Any]) -> dict[str, Any]:
    return answer(stack.url, case)


@pytest.fixture(scope="module")
def stacks(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stacks]:
    fim = write_fim_model(tmp_path_factory.mktemp("fim"))
    pairs = {**tiny, "fim": TinyPair("fim", fim, None)}  # type: ignore[arg-type]
    s = Stacks(loop_thread, pairs, prep_servers)
    yield s
    s.close()


@pytest.fixture(scope="module")
def stack(stacks: Stacks, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """As llama-server was recorded: 1024 cells over 2 slots, the projector loaded, saved
    sessions (its --slot-save-path)."""
    return stacks.start("rope", parallel=2, sessions_dir=tmp_path_factory.mktemp("sessions"))


@pytest.fixture(scope="module")
def embeddings(stacks: Stacks) -> Stack:
    """As llama-server --embeddings --pooling mean was recorded (without --slot-save-path)."""
    return stacks.start("rope", parallel=2, embeddings_ctx=256)


@pytest.fixture(scope="module")
def fim(stacks: Stacks) -> Stack:
    """On the model with fill-in-the-middle tokens."""
    return stacks.start("fim", parallel=2, prep_port=stacks.prep_with("fim", "chatml"))


@pytest.fixture(scope="module")
def answers(stack: Stack, embeddings: Stack, fim: Stack) -> dict[str, dict[str, Any]]:
    """slotwise's answers to every recorded request, sent in the order llama-server had them
    (the slot actions act on what the completions before them left), each group to a stack
    started as llama-server was for it. (The other tests on these stacks ask for it first, so
    that the caches are what llama-server's were.)"""
    out = {name: request(stack, case) for name, case in CASES.items()}
    for name, case in {**EMBEDDING_CASES, **NO_SLOT_PATH_CASES}.items():
        out[name] = request(embeddings, case)
    for name, case in FIM_CASES.items():
        out[name] = request(fim, case)
    return out


def test_every_answer_is_llama_servers_but_the_differences_listed(
    answers: dict[str, dict[str, Any]],
) -> None:
    found: list[tuple[str, str, Any, Any]] = []
    for name, got in answers.items():
        expected = RECORDED[name]
        found += differences(expected, got, name)
    unexplained = [d for d in found if allowed(d[0], d[1]) is None]
    assert not unexplained, "\n".join(
        f"{p} {w}: llama-server {e!r}, slotwise {g!r}" for p, w, e, g in unexplained
    )
    # and each difference listed still happens: the list (and README's) says what is so
    assert {allowed(p, w) for p, w, _, _ in found} == set(DIFFERENCES)


def readme_section() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## llama-server's native API") :]
    return section[: section.index("\n## ", 1)]


def test_readme_lists_every_difference() -> None:
    section = readme_section()
    missing = {words for _, words in DIFFERENCES.values() if words not in section}
    assert not missing, f"README's native API section does not mention {missing}"


CURL = re.compile(r"curl -sN? '?localhost:8080([^' ]+)'?(?: -d '(.*)')?")


def test_the_readme_examples_answer(
    answers: object, stack: Stack, embeddings: Stack, fim: Stack
) -> None:
    """Each curl line of the section (but the one that reads an image file) as it is written,
    on the stack it needs."""
    lines = [x for x in readme_section().splitlines() if x.startswith("curl ") and "$(" not in x]
    assert len(lines) >= 14
    for line in lines:
        m = CURL.fullmatch(line)
        assert m, line
        path, body = m.group(1), m.group(2)
        on = fim if path == "/infill" else embeddings if path == "/embedding" else stack
        if body is None:
            r = httpx.get(f"{on.url}{path}", timeout=60)
        else:
            r = httpx.post(f"{on.url}{path}", content=body, timeout=60)
        assert r.status_code == 200, (line, r.text)


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=120)


def test_a_saved_slot_outlives_its_server_and_goes_on_from_its_cache(
    stacks: Stacks, loop_thread: LoopThread, tmp_path: Path
) -> None:
    """A slot file is a session on disk: another server (infer and gateway) on the sessions
    directory restores it, and the next completion on the slot decodes only what is new."""
    first = stacks.start("rope", parallel=2, sessions_dir=tmp_path)
    done = post(first, "/completion", {**CASES["completion_slot0"]["body"], "id_slot": 1}).json()
    assert done["id_slot"] == 1
    saved = post(first, "/slots/1?action=save", {"filename": "chat one.bin"}).json()
    assert saved["n_saved"] == RECORDED["slot_save"]["body"]["n_saved"]
    loop_thread.run(first.gateway.stop())
    loop_thread.run(first.infer.stop(0))
    stacks.running.remove(first)

    second = stacks.start("rope", parallel=2, sessions_dir=tmp_path)
    restored = post(second, "/slots/1?action=restore", {"filename": "chat one.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    again = {**CASES["completion_slot0_again"]["body"], "id_slot": 1}
    reply = post(second, "/completion", again).json()
    recorded = RECORDED["completion_slot0_again"]["body"]
    assert reply["content"] == recorded["content"]
    assert reply["id_slot"] == 1
    assert reply["timings"]["cache_n"] == recorded["timings"]["cache_n"]  # reused, not decoded
    assert reply["timings"]["prompt_n"] == recorded["timings"]["prompt_n"]

    # a prompt that does not continue the slot starts it anew; the file keeps the conversation
    other = post(second, "/completion", {**CASES["completion"]["body"], "id_slot": 1}).json()
    assert other["timings"]["cache_n"] < reply["tokens_evaluated"]
    again_restored = post(second, "/slots/1?action=restore", {"filename": "chat one.bin"}).json()
    assert again_restored["n_restored"] > restored["n_restored"]  # (it went on after the save)
    # a streamed turn holds the slot until its stream ends, and then lets it go
    streamed = post(second, "/completion", {**again, "stream": True, "n_predict": 3})
    assert streamed.status_code == 200 and '"stop": true' in streamed.text
    assert post(second, "/completion", {**again, "n_predict": 1}).status_code == 200
    erased = post(second, "/slots/1?action=erase", {}).json()
    assert erased["id_slot"] == 1 and erased["n_erased"] > 0
    assert post(second, "/slots/1?action=restore", {"filename": "chat one.bin"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"mirostat": 2}, "mirostat"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"dry_multiplier": 0.8}, "dry_multiplier"),
        ({"xtc_probability": 0.5}, "xtc_probability"),
        ({"samplers": ["temperature", "top_k"]}, "samplers"),
        ({"lora": [{"id": 0, "scale": 1.0}]}, "lora"),
        ({"post_sampling_probs": True}, "post_sampling_probs"),
        ({"n_probs": 21}, "n_probs"),
        ({"top_k": "forty"}, "Field 'top_k': type must be number, but is string"),
    ],
)
def test_what_slotwise_cannot_honour_is_refused_by_name(
    answers: object, stack: Stack, body: dict[str, Any], named: str
) -> None:
    r = post(stack, "/completion", {"prompt": "Hello", "n_predict": 1, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert named in error["message"]


def test_samplers_left_out_are_left_out(answers: object, stack: Stack) -> None:
    """A sampler `samplers` leaves out does nothing: without it, top_k 1 no longer makes a
    seeded sample at temperature 1.5 the greedy choice."""
    body = {"prompt": "Hello", "n_predict": 8, "seed": 7, "temperature": 1.5}
    narrow = post(stack, "/completion", {**body, "top_k": 1}).json()
    wide = post(stack, "/completion", {**body, "top_k": 1, "samplers": ["temperature"]}).json()
    assert narrow["generation_settings"]["samplers"] == list(
        RECORDED["completion"]["body"]["generation_settings"]["samplers"]
    )
    assert wide["generation_settings"]["samplers"] == ["temperature"]
    assert len(set(narrow["content"])) == 1  # greedy: the tiny model repeats one character
    assert narrow["content"] != wide["content"]


def test_slots_and_their_files_are_each_tenant_s_own(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], tmp_path: Path
) -> None:
    """Slot 0 of one key is not slot 0 of another, and a file one tenant saved is not there
    for another (it is a session of the tenant's); errors come in llama-server's shape, the
    401 included."""
    from clients.gateway import GatewayConfig
    from clients.gateway.serve import start_gateway
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep
    from slotwise_core.keys import Keys
    from slotwise_core.serving import Security

    (tmp_path / "keys").write_text("acme key-of-acme\nglobex key-of-globex\n")
    keys = Keys(tmp_path / "keys")
    pair, security = tiny["rope"], Security(keys=keys)
    config = RuntimeConfig(pair.model, pair.mmproj, ctx_size=1024, parallel=2, threads=1)
    prep = loop_thread.run(start_prep(pair.model, pair.mmproj, threads=1, security=security))
    infer = loop_thread.run(start_infer(config, security=security, sessions_dir=tmp_path / "s"))
    addresses = (f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}")
    gateway = loop_thread.run(
        start_gateway(GatewayConfig(*addresses, api_keys=keys), "127.0.0.1", 0)
    )
    url = f"http://127.0.0.1:{gateway.port}"

    def call(key: str, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)

    try:
        hello = {**CASES["completion_slot0"]["body"]}
        assert call("key-of-acme", "/completion", hello).status_code == 200
        acme = call("key-of-acme", "/slots/0?action=save", {"filename": "a.bin"}).json()
        globex = call("key-of-globex", "/slots/0?action=save", {"filename": "g.bin"}).json()
        assert acme["n_saved"] > 0 and globex["n_saved"] == 0  # globex's slot 0 is empty
        refused = call("key-of-globex", "/slots/0?action=restore", {"filename": "a.bin"})
        assert refused.status_code == 400
        assert refused.json() == RECORDED["slot_restore_missing"]["body"]
        mine = call("key-of-acme", "/slots/0?action=restore", {"filename": "a.bin"}).json()
        assert mine["n_restored"] == acme["n_saved"]
        wrong = call("key-of-nobody", "/tokenize", {"content": "hi"})
        assert wrong.status_code == 401
        assert set(wrong.json()["error"]) == {"code", "message", "type"}
        assert wrong.json()["error"]["type"] == "authentication_error"
    finally:
        loop_thread.run(gateway.stop())
        loop_thread.run(infer.stop(0))
        loop_thread.run(prep.stop(0))


def test_prep_tokenizes_and_detokenizes_as_the_vocabulary_does(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    tmp_path: Path,
) -> None:
    """prep's Tokenize, Detokenize and the model facts /props and /infill read (FIM tokens,
    the template's text, BOS), on the plain tiny model and on the one with FIM tokens."""
    from clients.client import SlotwiseClient, SlotwiseError
    from prep_service.__main__ import start as start_prep
    from slotwise_core.tiny_models import CHAT_TEMPLATE, token_id

    with SlotwiseClient(f"127.0.0.1:{prep_servers('rope')}", None) as c:
        info = c.model_info()
        assert info.fim == {} and info.chat_template == CHAT_TEMPLATE and not info.add_bos
        assert info.bos_token_id == token_id("<|endoftext|>")
        plain = c.tokenize("<|im_end|>", parse_special=False).token_ids
        assert len(plain) == len("<|im_end|>") and c.tokenize("<|im_end|>").token_ids == (262,)
        back = c.detokenize([*plain, 262, 195])
        assert back.pieces == (*(bytes([b]) for b in b"<|im_end|>"), b"<|im_end|>", b"\xc3")
        assert back.text == "<|im_end|><|im_end|>\ufffd"
        with pytest.raises(SlotwiseError) as e:
            c.detokenize([info.num_vocab])
        assert e.value.code().name == "INVALID_ARGUMENT" and "token 0" in e.value.message

    model = write_fim_model(tmp_path)
    running = loop_thread.run(start_prep(model, None, threads=1))
    try:
        with SlotwiseClient(f"127.0.0.1:{running.port}", None) as c:
            names = {"pre": "<tool_call>", "suf": "</tool_call>", "mid": "[TOOL_CALLS]"}
            assert c.model_info().fim == {n: token_id(t) for n, t in names.items()}
    finally:
        loop_thread.run(running.stop(0))
