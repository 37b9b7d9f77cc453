"""LoRA adapters end to end: real prep and infer servers on loopback, real llama.cpp on the tiny
`rope` pair with tiny random adapters (slotwise_core/tiny_lora.py), no mocks.

llama.cpp applies adapters to the whole context, so requests of different adapter sets never
share a llama_decode, and no KV cell decoded under one set is reused under another: prefix
reuse in a slot, the host state cache, the pool's shared prefixes and sessions (in a slot and
on disk) each key by the set. The greedy tokens below under scales 0, 1 and 0.5 are what the
vendored llama-server answered on the same model and adapter.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import Message, SlotwiseClient, SlotwiseError, collect
from infer_service.runner.lora import LoraFile
from slotwise_core.tiny_models import TinyPair, token_id, write_tiny_lora, write_tiny_models
from support.http_stack import Stack, Stacks
from support.loop import LoopThread
from support.rpc import server_info
from support.wait import PATIENCE, wait_until

PROMPT = "Once upon a time"
# llama-server (the vendored sources) on the rope pair with lora.gguf: POST /completion
# {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "lora": [{"id": 0, "scale": S}]}
LLAMA_SERVER_TOKENS = {
    0.0: [101] * 12,
    1.0: [182, 182, 182, 182, 194, 182, 100, 100, 100, 266, 266, 266],
    0.5: [221] * 12,
}
X = {token_id("x"): 100.0}
# a prompt of more than the 32 cells a slot's displaced conversation needs to be kept
LONG = "The quick brown fox jumps over the lazy dog, again and again, until it tires. "


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two adapters for the rope pair's text model (the second with a task name)."""
    d = tmp_path_factory.mktemp("lora")
    first = write_tiny_lora("rope", d / "first.gguf")
    second = write_tiny_lora("rope", d / "second.gguf", seed=1, task_name="second")
    return first, second


@pytest.fixture
def start(
    infer_server: Callable[..., Any],
    prep_servers: Callable[[str], int],
    adapters: tuple[Path, Path],
) -> Iterator[Callable[..., tuple[Any, SlotwiseClient]]]:
    """start(**RuntimeConfig fields) -> (infer, a client of rope's prep and that infer); the
    adapters loaded unless `lora` is given."""
    clients: list[SlotwiseClient] = []

    def one(**kwargs: Any) -> tuple[Any, SlotwiseClient]:
        kwargs.setdefault("lora", (LoraFile(adapters[0]), LoraFile(adapters[1], 0.5)))
        kwargs.setdefault("ctx_size", 1024)
        infer = infer_server("rope", **kwargs)
        client = SlotwiseClient(f"127.0.0.1:{prep_servers('rope')}", f"127.0.0.1:{infer.port}")
        clients.append(client)
        return infer, client

    yield one
    for c in clients:
        c.close()


def greedy(client: SlotwiseClient, prompt: Any, **options: Any) -> Any:
    options.setdefault("max_tokens", 12)
    return collect(client.generate(prompt, temperature=0.0, **options))


# -- the generator ------------------------------------------------------------------------------


def test_tiny_adapters_are_extra_files_of_the_same_bytes_every_run(tmp_path: Path) -> None:
    plain = write_tiny_models(tmp_path / "plain", ["rope", "mrope"])
    with_lora = write_tiny_models(tmp_path / "lora", ["rope", "mrope"], lora=True)
    again = write_tiny_models(tmp_path / "again", ["rope"], lora=True)
    for name, pair in plain.items():
        other = with_lora[name]
        assert pair.lora is None and other.lora == other.model.parent / "lora.gguf"
        assert other.model.read_bytes() == pair.model.read_bytes()
        assert other.mmproj.read_bytes() == pair.mmproj.read_bytes()
    assert again["rope"].lora.read_bytes() == with_lora["rope"].lora.read_bytes()  # type: ignore[union-attr]
    assert not (tmp_path / "plain" / "rope" / "lora.gguf").exists()
    with pytest.raises(ValueError, match="no tiny LoRA adapter"):
        write_tiny_lora("qwen35", tmp_path / "x.gguf")


# -- an adapter changes the tokens, as llama-server's does ----------------------------------------


def test_each_scale_gives_llama_servers_tokens_and_scale_0_is_no_adapter(start, tiny) -> None:
    _, client = start(parallel=1)
    _, bare = start(parallel=1, lora=())
    prompt = client.prepare(PROMPT)
    for scale, expected in LLAMA_SERVER_TOKENS.items():
        assert greedy(client, prompt, lora={0: scale}).token_ids == expected, scale
    assert LLAMA_SERVER_TOKENS[1.0] != LLAMA_SERVER_TOKENS[0.0]  # (the adapter changes them)
    # a request that names none gets the server's scales: 1 and 0.5 (the flags')
    both = greedy(client, prompt, lora={0: 1.0, 1: 0.5}).token_ids
    assert greedy(client, prompt).token_ids == both
    assert both not in LLAMA_SERVER_TOKENS.values()
    # scale 0 is no adapter at all: a server without any gives the same tokens
    assert greedy(bare, prompt).token_ids == LLAMA_SERVER_TOKENS[0.0]
    with pytest.raises(SlotwiseError) as refused:
        greedy(bare, prompt, lora={0: 1.0})
    assert refused.value.code().name == "INVALID_ARGUMENT" and "no adapter has id 0" in str(
        refused.value
    )
    assert refused.value.field_violations == {"lora": refused.value.field_violations["lora"]}
    assert bare.lora_adapters() == []


class DecodeLog:
    """Every text llama_decode of an engine from now on: the adapter set the context had, and
    the sequences in its batch."""

    def __init__(self, rt: Any):
        self.runtime, self.decodes = rt, []

    def _decode(self) -> int:
        batch = self.runtime.batch
        seqs = frozenset(int(batch._seq_ids[k][0]) for k in range(batch.size))
        self.decodes.append((self.runtime.lora.applied, seqs))
        return type(self.runtime).decode(self.runtime)

    def __enter__(self) -> DecodeLog:
        self.runtime.decode = self._decode
        return self

    def __exit__(self, *_: object) -> None:
        del self.runtime.decode  # back to the class's method


def run_together(infer: Any, client: SlotwiseClient, jobs: list[dict[str, Any]]) -> list[Any]:
    """Generate the jobs at once: the engine thread is held until all of them wait in its
    queue, so one admission starts them together and every step has each one's token."""
    engine = infer.engine
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(PATIENCE)

    held = engine.call(hold)
    assert entered.wait(PATIENCE)  # (held now: no admission until the gate opens)
    results: list[Any] = [None] * len(jobs)

    def worker(i: int) -> None:
        try:
            results[i] = greedy(client, **jobs[i])
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    wait_until(lambda: engine.num_waiting == len(jobs), what="every job queued")
    gate.set()
    held.result(PATIENCE)
    for t in threads:
        t.join(PATIENCE)
    for r in results:
        assert not isinstance(r, BaseException), r
    return results


def test_an_adapter_and_none_sent_together_each_get_their_tokens_alone(start) -> None:
    infer, client = start(parallel=2)
    prompt = client.prepare(PROMPT)
    jobs = [
        {"prompt": prompt, "lora": {0: 0.0}, "max_tokens": 24},
        {"prompt": prompt, "lora": {0: 1.0}, "max_tokens": 24},
    ]
    alone = [greedy(client, **job, cache_salt=f"alone-{i}") for i, job in enumerate(jobs)]
    assert alone[0].token_ids != alone[1].token_ids
    before = server_info(infer.port).stats
    with DecodeLog(infer.engine.runtime) as log:
        together = run_together(infer, client, jobs)
    for a, t in zip(alone, together, strict=True):
        assert t.token_ids == a.token_ids
        assert t.started.num_reused_cells == 0  # (a salt of their own: nothing was reused)
    slots = [t.started.slot for t in together]
    assert len(set(slots)) == 2  # two slots ...
    sets_of = {slots[0]: (), slots[1]: ((0, 1.0),)}
    for applied, seqs in log.decodes:
        (seq,) = seqs  # ... never in one llama_decode,
        assert applied == sets_of[seq]  # each under its own adapters
    # and in the same steps: each step decoded both, one llama_decode after the other, the
    # set the context had first (one change of adapters a step)
    steps = [log.decodes[k : k + 2] for k in range(0, len(log.decodes), 2)]
    assert len(steps) >= 24
    for step in steps:
        assert {seqs for _, seqs in step} == {frozenset({slots[0]}), frozenset({slots[1]})}
    for previous, step in itertools.pairwise(steps):
        assert step[0][0] == previous[1][0]  # (a step begins under its last decode's set)
    assert server_info(infer.port).stats.num_multi_seq_decodes == before.num_multi_seq_decodes

    # the same set sent together does share the batch
    same = [dict(job, lora={0: 1.0}, cache_salt=f"same-{i}") for i, job in enumerate(jobs)]
    assert [r.token_ids for r in run_together(infer, client, same)] == [alone[1].token_ids] * 2
    assert server_info(infer.port).stats.num_multi_seq_decodes > before.num_multi_seq_decodes


# -- reuse never crosses adapter sets ------------------------------------------------------------


def test_a_slot_and_the_host_cache_reuse_only_within_an_adapter_set(start) -> None:
    _, client = start(parallel=1)
    prompt = client.prepare(LONG * 2)
    assert prompt.num_cells >= 64
    first = greedy(client, prompt, lora={0: 0.0})
    assert first.started.num_reused_cells == 0
    again = greedy(client, prompt, lora={0: 0.0})
    assert again.started.num_reused_cells == prompt.num_cells - 1  # the same set reuses
    assert again.token_ids == first.token_ids
    other = greedy(client, prompt, lora={0: 1.0})  # the slot holds ()'s cells: none reused
    assert other.started.num_reused_cells == 0
    # ()'s conversation went to the host cache when {0: 1} took the slot: back from there
    back = greedy(client, prompt, lora={0: 0.0})
    assert back.started.num_reused_cells == prompt.num_cells - 1
    assert back.token_ids == first.token_ids
    # neither the slot ({0: 0} now) nor the cache ({0: 1}) holds {0: 0.5}'s
    assert greedy(client, prompt, lora={0: 0.5}).started.num_reused_cells == 0
    # a request naming no adapters gets the server's scales: (0: 1, 1: 0.5), none of those
    assert greedy(client, prompt).started.num_reused_cells == 0
    assert greedy(client, prompt, lora={0: 1.0, 1: 0.5}).started.num_reused_cells > 0


def test_the_pool_shares_a_prefix_only_within_an_adapter_set(start) -> None:
    infer, client = start(parallel=2, kv_unified=True, ctx_size=2048)
    system = Message.system(LONG * 2)
    chats = [[system, Message.user(f"question {i}")] for i in range(4)]
    prompts = [client.prepare(chat) for chat in chats]
    keep = prompts[0].num_cells_of(0)  # (the system message, pinned)
    assert keep >= 32

    def ask(i: int, lora: dict[int, float]) -> Any:
        return greedy(client, prompts[i], lora=lora, keep=keep, max_tokens=4)

    before = server_info(infer.port).stats
    assert ask(0, {0: 1.0}).started.num_reused_cells == 0  # held from here, under {0: 1}
    assert ask(1, {0: 1.0}).started.num_reused_cells >= keep  # shared
    after_same = server_info(infer.port).stats
    assert after_same.num_shared_prefixes == before.num_shared_prefixes + 1
    assert ask(2, {0: 0.5}).started.num_reused_cells == 0  # another set: decoded again
    assert server_info(infer.port).stats.num_shared_prefixes == after_same.num_shared_prefixes
    assert ask(3, {0: 0.5}).started.num_reused_cells >= keep  # its own holder now


def test_a_session_turn_under_other_adapters_decodes_the_session_again(
    start, tmp_path: Path
) -> None:
    infer, client = start(parallel=1, sessions_dir=tmp_path / "sessions")
    engine = infer.engine
    session = client.create_session(temperature=0.0).session_id
    chat = [Message.user("Tell me a story")]
    first = 0

    def turn(lora: dict[int, float], question: str) -> Any:
        nonlocal first
        prompt = client.prepare(chat, first_message=first)
        # (a reply of whole UTF-8 comes back as the template renders it: its tokens reused)
        done = greedy(client, prompt, session_id=session, lora=lora, max_tokens=6, logit_bias=X)
        chat.extend([Message.assistant(done.text), Message.user(question)])
        first = len(chat) - 2
        return done

    def reprefills() -> int:
        return engine.call(lambda: engine.stats.num_session_reprefills).result(PATIENCE)

    assert turn({0: 1.0}, "and then?").started.num_reused_cells == 0  # (the first turn)
    assert turn({0: 1.0}, "and?").started.num_reused_cells > 0  # its reply, reused
    n = reprefills()
    assert turn({0: 0.5}, "more").started.num_reused_cells == 0  # another set: none of it
    assert reprefills() == n + 1
    assert turn({0: 0.5}, "go on").started.num_reused_cells > 0  # the new set's, reused
    # on disk: the checkpoint names the set its KV bytes were decoded under
    client.save_session(session)
    client.restore_session(session)  # (out of its slot: the next turn reads the checkpoint)
    assert turn({0: 1.0}, "again").started.num_reused_cells == 0  # not under {0: 1}
    assert reprefills() == n + 2
    client.save_session(session)
    client.restore_session(session)
    assert turn({0: 1.0}, "end").started.num_reused_cells > 0  # its own checkpoint: loaded
    assert reprefills() == n + 2


# -- start, and the scales at run time -------------------------------------------------------------


def test_flags_load_adapters_in_order_and_refuse_what_llama_cpp_cannot_load(
    start, adapters: tuple[Path, Path], tiny: dict[str, TinyPair], tmp_path: Path
) -> None:
    from infer_service.__main__ import parser, start_arguments
    from infer_service.flags import OPTIONS
    from slotwise_core.flags import settings

    first, second = adapters
    argv = ["--model", "m.gguf", "--lora", f"{first}", "--lora-scaled", f"{second}:0.25,x:2"]
    config, _ = start_arguments(settings(parser().parse_args([*argv, "--lora", "y"]), OPTIONS))
    assert config.lora == (
        LoraFile(first),
        LoraFile(second, 0.25),
        LoraFile(Path("x"), 2.0),
        LoraFile(Path("y")),
    )
    assert not config.lora_init_without_apply
    with pytest.raises(SystemExit):
        parser().parse_args(["--model", "m.gguf", "--lora-scaled", str(first)])  # no scale

    _, client = start(lora=config.lora[:2], lora_init_without_apply=True)
    listed = client.lora_adapters()
    assert [(a.id, a.path, a.scale, a.task_name) for a in listed] == [
        (0, str(first), 0.0, ""),
        (1, str(second), 0.0, "second"),
    ]
    prompt = client.prepare(PROMPT)
    assert greedy(client, prompt).token_ids == LLAMA_SERVER_TOKENS[0.0]  # none applied
    with pytest.raises(FileNotFoundError):
        start(lora=(LoraFile(tmp_path / "missing.gguf"),))
    mrope_adapter = write_tiny_lora("mrope", tmp_path / "qwen2vl.gguf")
    with pytest.raises(Exception, match="could not load"):  # (another architecture)
        start(lora=(LoraFile(mrope_adapter),))


def test_set_scales_are_the_callers_and_refused_for_an_unknown_id(start) -> None:
    _, client = start(parallel=1)
    prompt = client.prepare(PROMPT)
    listed = client.set_lora_scales({0: 0.5})
    assert [(a.id, a.scale) for a in listed] == [(0, 0.5), (1, 0.0)]  # (the others: 0)
    assert [a.scale for a in client.lora_adapters()] == [0.5, 0.0]
    assert greedy(client, prompt).token_ids == LLAMA_SERVER_TOKENS[0.5]
    assert greedy(client, prompt, lora={0: 1.0}).token_ids == LLAMA_SERVER_TOKENS[1.0]
    for bad in ({2: 1.0}, {0: float("nan")}):
        with pytest.raises(SlotwiseError) as refused:
            client.set_lora_scales(bad)
        assert refused.value.code().name == "INVALID_ARGUMENT"
    assert [a.scale for a in client.lora_adapters()] == [0.5, 0.0]  # (unchanged)
    client.set_lora_scales([])
    assert greedy(client, prompt).token_ids == LLAMA_SERVER_TOKENS[0.0]


# -- llama-server's HTTP API ----------------------------------------------------------------------


@pytest.fixture
def stack(
    loop_thread: LoopThread,
    tiny: dict[str, TinyPair],
    prep_servers: Callable[[str], int],
    adapters: tuple[Path, Path],
) -> Iterator[Stack]:
    stacks = Stacks(loop_thread, tiny, prep_servers)
    try:
        yield stacks.start("rope", parallel=2, lora=(LoraFile(adapters[0]),))
    finally:
        stacks.close()


def test_lora_adapters_get_and_post_round_trip_as_llama_servers(
    stack: Stack, adapters: tuple[Path, Path]
) -> None:
    url = stack.url
    # llama-server's shapes, as it answered them with --lora lora.gguf
    assert httpx.get(f"{url}/lora-adapters").json() == [
        {"id": 0, "path": str(adapters[0]), "scale": 1.0, "task_name": "", "prompt_prefix": ""}
    ]
    r = httpx.post(f"{url}/lora-adapters", json=[{"id": 0, "scale": 0.25}])
    assert (r.status_code, r.json()) == (200, {"success": True})
    assert httpx.get(f"{url}/lora-adapters").json()[0]["scale"] == 0.25
    r = httpx.post(f"{url}/lora-adapters", json={"id": 0})
    assert (r.status_code, r.json()) == (400, {"error": {
        "code": 400, "message": "Request body must be an array", "type": "invalid_request_error",
    }})  # fmt: skip
    r = httpx.post(f"{url}/lora-adapters", json=[{"id": 3, "scale": 1}])
    assert r.status_code == 400 and "no adapter has id 3" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/lora-adapters", json=[])  # (every adapter at 0)
    assert r.status_code == 200 and httpx.get(f"{url}/lora-adapters").json()[0]["scale"] == 0.0

    def completion(**body: Any) -> dict[str, Any]:
        body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True, **body}
        r = httpx.post(f"{url}/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    assert completion()["tokens"] == LLAMA_SERVER_TOKENS[0.0]  # (the scales POSTed: 0)
    for scale, tokens in LLAMA_SERVER_TOKENS.items():
        got = completion(lora=[{"id": 0, "scale": scale}])
        assert got["tokens"] == tokens
        assert got["generation_settings"]["lora"] == [{"id": 0, "scale": scale}]
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "lora": {"id": 0}})
    assert r.status_code == 400 and "'lora' must be an array" in r.json()["error"]["message"]

    # OpenAI's chat body takes llama-server's `lora` too
    def chat(**extra: Any) -> str:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                "temperature": 0, **extra}  # fmt: skip
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert chat(lora=[{"id": 0, "scale": 0.0}]) == chat()  # (the POSTed scales: 0)
    assert chat(lora=[{"id": 0, "scale": 1.0}]) != chat()
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "lora": [{"id": 5, "scale": 1.0}],
    })  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"


def test_the_readme_examples_answer(stack: Stack, adapters: tuple[Path, Path]) -> None:
    """Each curl line of the README's LoRA section, as written, on a stack with its adapter."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## LoRA adapters") :]
    section = section[: section.index("\n## ", 1)]
    curl = re.compile(r"curl -s localhost:8080(\S+)(?: -H '([^']*)')?(?: -d '(.*)')?")
    lines = [x for x in section.splitlines() if x.startswith("curl ")]
    assert len(lines) >= 4
    for line in lines:
        m = curl.fullmatch(line)
        assert m, line
        path, header, body = m.groups()
        headers = dict([header.split(": ", 1)]) if header else {}
        if body is None:
            r = httpx.get(f"{stack.url}{path}", timeout=60)
        else:
            r = httpx.post(f"{stack.url}{path}", content=body, headers=headers, timeout=120)
        assert r.status_code == 200, (line, r.text)
