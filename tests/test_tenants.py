"""Tenants from one keys file, against real servers (prep, infer and the HTTP edge): who may
see, continue and reuse what, and a queue fair across tenants with limits of their own."""

from __future__ import annotations

import hashlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from clients.client import (
    NO_RETRY,
    Message,
    SlotwiseClient,
    SlotwiseError,
    collect,
)
from infer_service.runner.plan import StepPlan
from slotwise_core.keys import Keys, KeysError, parse
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.procs import free_port, serve_argv
from support.wait import wait_until

ACME, GLOBEX, PLAIN = "key-of-acme", "key-of-globex", "key-of-nobody-in-particular"
KEYS = (
    "# tenants of the test\n"
    f"acme {ACME}\n"
    "# globex's key is kept as its hash\n"
    f"globex sha256:{hashlib.sha256(GLOBEX.encode()).hexdigest()}\n"
    f"{PLAIN}\n"
)


def test_the_keys_file() -> None:
    keys = Keys(text=KEYS)
    assert keys.tenants == {"acme", "globex", "default"}
    assert [keys.tenant_of(k) for k in (ACME, GLOBEX, PLAIN)] == ["acme", "globex", "default"]
    assert keys.tenant_of("key-of-acm") is None and keys.tenant_of("") is None
    assert keys.tenant_of(hashlib.sha256(GLOBEX.encode()).hexdigest()) is None  # not the key
    assert Keys(text="tok#en\n").tenant_of("tok#en") == "default"  # a token of old, whole
    for bad in ("a b c", "bad!tenant key", "acme k\nglobex k", "# only a comment"):
        with pytest.raises(KeysError):
            parse(bad)


@dataclass
class Tenancy:
    prep: str
    infer: str
    url: str  # the HTTP edge
    running: Any
    prep_running: Any = None

    def client(self, key: str | None, **kw: Any) -> SlotwiseClient:
        return SlotwiseClient(self.prep, self.infer, token=key, retry=NO_RETRY, **kw)


@pytest.fixture
def tenancy(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], tmp_path: Path
) -> Iterator[Callable[..., Tenancy]]:
    """start(**infer start options) -> prep, infer and the HTTP edge on one keys file."""
    from clients.gateway import GatewayConfig
    from clients.gateway.serve import start_gateway
    from infer_service.__main__ import start as start_infer
    from infer_service.runner.runtime import RuntimeConfig
    from prep_service.__main__ import start as start_prep
    from slotwise_core.serving import Security

    (tmp_path / "keys").write_text(KEYS)
    keys = Keys(tmp_path / "keys")
    pair = tiny["mrope"]
    started: list[Any] = []

    def start(**options: Any) -> Tenancy:
        security = Security(keys=keys)
        parallel = options.pop("parallel", 2)
        config = RuntimeConfig(
            pair.model, pair.mmproj, ctx_size=1024 * parallel, parallel=parallel, threads=1
        )
        prep = loop_thread.run(start_prep(pair.model, pair.mmproj, threads=1, security=security))
        infer = loop_thread.run(start_infer(config, security=security, **options))
        addresses = (f"127.0.0.1:{prep.port}", f"127.0.0.1:{infer.port}")
        gateway = loop_thread.run(
            start_gateway(GatewayConfig(*addresses, api_keys=keys), "127.0.0.1", 0)
        )
        started.extend([gateway, infer, prep])
        return Tenancy(*addresses, f"http://127.0.0.1:{gateway.port}", infer, prep)

    yield start
    for s in started:
        loop_thread.run(s.stop() if hasattr(s, "task") else s.stop(0))


def turn(client: SlotwiseClient, session_id: str, text: str) -> Any:
    prepared = client.prepare([Message.user(text)])
    return collect(client.generate(prepared, session_id=session_id, max_tokens=3))


def test_no_key_or_a_wrong_key_is_refused_and_a_hashed_key_works(tenancy) -> None:
    t = tenancy()
    for key in (None, "wrong"):
        with t.client(key) as c, pytest.raises(SlotwiseError) as e:
            c.count("hi")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with t.client(key) as c, pytest.raises(SlotwiseError) as e:
            c.server_info()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(
            f"{t.url}/v1/completions", headers=headers, json={"prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 401
    with t.client(GLOBEX) as c:  # stored as its sha256 in the file
        assert c.count("hi").num_cells > 0
    r = httpx.post(
        f"{t.url}/v1/completions",
        headers={"x-api-key": GLOBEX},
        json={"prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 200


def test_sessions_belong_to_their_tenant(tenancy) -> None:
    t = tenancy()
    with t.client(ACME) as acme, t.client(GLOBEX) as globex:
        acme.create_session("shared-name")
        turn(acme, "shared-name", "hello")
        missing = []
        for c, sid in ((globex, "shared-name"), (globex, "no-such-session")):
            for call in (c.get_session, c.save_session, c.restore_session, c.delete_session):
                with pytest.raises(SlotwiseError) as e:
                    call(sid)
                missing.append((e.value.code(), e.value.reason))
            with pytest.raises(SlotwiseError) as e:
                turn(c, sid, "let me in")
            missing.append((e.value.code(), e.value.reason))
        # another tenant's session is exactly as absent as one that does not exist
        assert missing[:5] == missing[5:] and missing[0][0] == grpc.StatusCode.NOT_FOUND
        assert globex.list_sessions() == []
        assert [s.session_id for s in acme.list_sessions()] == ["shared-name"]
        # the same id is another session for another tenant
        globex.create_session("shared-name")
        assert globex.get_session("shared-name").num_turns == 0
        assert acme.get_session("shared-name").num_turns == 1
    # a stored response is its tenant's too (its chain is a session)
    created = httpx.post(
        f"{t.url}/v1/responses",
        headers={"Authorization": f"Bearer {ACME}"},
        json={"input": "hi", "max_output_tokens": 2},
    )
    assert created.status_code == 200
    rid = created.json()["id"]
    for key, status in ((ACME, 200), (GLOBEX, 404)):
        r = httpx.get(f"{t.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status, r.text


def test_the_kv_picture_shows_another_tenant_s_slot_as_cells_only(tenancy) -> None:
    t = tenancy()
    with t.client(ACME) as acme, t.client(GLOBEX) as globex:
        acme.create_session("diary", title="acme's diary")
        slot = turn(acme, "diary", "a secret plan").started.slot
        (mine,) = list(acme.watch_slots(once=True))
        (theirs,) = list(globex.watch_slots(once=True))
        assert globex.list_sessions() == []
    own, seen = mine.slots[slot], theirs.slots[slot]
    assert own.visible and own.session_id == "diary" and own.runs and own.num_cells > 0
    # another tenant's slot: its state only (not even its size, which would tell lengths)
    assert not seen.visible and seen.state == own.state and seen.num_cells == 0
    assert seen.session_id == "" and not seen.runs and not seen.shifts
    assert "secret" not in str(theirs) and "secret" in str(mine)


def test_reuse_stays_within_a_tenant_and_its_salt(tenancy) -> None:
    t = tenancy(parallel=1)  # one slot: every request meets what the last one left
    prompt = "The same long question, asked by two tenants, word for word. " * 3
    with t.client(ACME) as acme, t.client(GLOBEX) as globex:
        prepared = acme.prepare(prompt)

        def reused(c: SlotwiseClient, salt: str = "") -> int:
            done = collect(c.generate(prepared, max_tokens=2, cache_salt=salt))
            assert done.started is not None
            return done.started.num_reused_cells

        reused(acme)
        assert reused(acme) > 0  # the same tenant: from the cache
        assert reused(globex) == 0  # another tenant: decoded again, nothing handed over
        assert reused(acme) > 0  # acme's own sequence, back from the host cache
        assert reused(acme, salt="narrower") == 0  # a salt of its own: another key again
    # over HTTP (a prompt globex never sent: its own earlier KV would be reused, rightly):
    # cached_tokens 0 for another tenant's identical prompt
    body = {"prompt": "Over HTTP now, another paragraph entirely. " * 3, "max_tokens": 2}
    cached = []
    for key in (ACME, ACME, GLOBEX):
        r = httpx.post(
            f"{t.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body
        ).json()
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[1] > 0 and cached[2] == 0, cached
    salted = httpx.post(
        f"{t.url}/v1/completions",
        headers={"Authorization": f"Bearer {ACME}"},
        json={**body, "cache_salt": "per-user"},  # as vLLM takes it
    ).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("fair", [True, False])
def test_one_tenant_s_flood_does_not_hold_up_another(tenancy, fair: bool) -> None:
    """acme floods 12 requests into 2 slots, then globex sends one: it starts after at most a
    few of acme's (fair), or after all of them (fifo); the engine's own start order shows it
    (the order in which clients read their Started events can differ from it under load)."""
    t = tenancy(parallel=2, fair=fair)
    engine = t.running.engine
    started: list[str] = []  # tenants, in the order the engine's plans start their requests
    schedule = engine.scheduler.schedule

    def recorded(now: float) -> StepPlan:
        plan = schedule(now)
        started.extend(choice.job.tenant for choice in plan.starts)
        return plan

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]

    def run(key: str) -> None:
        with t.client(key) as c:
            collect(c.generate(c.prepare("go on and on"), max_tokens=24, temperature=0.0))

    hold = threading.Event()
    engine.call(lambda: hold.wait(60))  # nothing starts until all 13 wait
    flood = [threading.Thread(target=run, args=(ACME,)) for _ in range(12)]
    for th in flood:
        th.start()
    wait_until(lambda: engine.num_waiting == 12, what="acme's 12 requests queued")
    other = threading.Thread(target=run, args=(GLOBEX,))
    other.start()
    wait_until(lambda: engine.num_waiting == 13, what="globex's request queued last")
    hold.set()
    for th in [*flood, other]:
        th.join(120)
    assert sorted(set(started)) == ["acme", "globex"] and len(started) == 13, started
    position = started.index("globex")
    if fair:
        assert position <= 2, started  # acme's first, then globex's turn
    else:
        assert position == 12, started


def test_per_tenant_limits_answer_429_with_retry_after(tenancy) -> None:
    from infer_service.engine.scheduler import TenantLimits

    t = tenancy(parallel=2, tenant_limits=TenantLimits(max_active=1, max_queued=1))
    engine = t.running.engine
    hold = threading.Event()
    engine.call(lambda: hold.wait(60))  # the engine thread is busy: nothing starts
    try:
        waiting = threading.Thread(target=_ask, args=(t, ACME))  # acme's one may wait
        waiting.start()
        wait_until(lambda: engine.num_waiting == 1, what="acme's request queued")
        r = httpx.post(
            f"{t.url}/v1/completions",
            headers={"Authorization": f"Bearer {ACME}"},
            json={"prompt": "more", "max_tokens": 2},
        )
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        with t.client(ACME) as c, pytest.raises(SlotwiseError) as e:
            collect(c.generate(c.prepare("more"), max_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_delay
        # globex has a limit of its own, not acme's
        other = threading.Thread(target=_ask, args=(t, GLOBEX))
        other.start()
        wait_until(lambda: engine.num_waiting == 2, what="globex's request queued beside")
    finally:
        hold.set()
    for th in (waiting, other):
        th.join(60)


def test_a_full_queue_still_takes_another_tenant_s_share(tenancy) -> None:
    """acme fills the whole queue (4): its next request is refused, globex's is taken."""
    t = tenancy(parallel=1, max_queue=4)
    engine = t.running.engine
    hold = threading.Event()
    engine.call(lambda: hold.wait(60))
    try:
        flood = [threading.Thread(target=_ask, args=(t, ACME)) for _ in range(4)]
        for th in flood:
            th.start()
        wait_until(lambda: engine.num_waiting == 4, what="acme's 4 requests queued")
        with t.client(ACME) as c, pytest.raises(SlotwiseError) as e:
            collect(c.generate(c.prepare("more"), max_tokens=2))
        assert e.value.reason == "QUEUE_FULL" and e.value.metadata["queue_limit"] == "4"
        other = threading.Thread(target=_ask, args=(t, GLOBEX))
        other.start()
        wait_until(lambda: engine.num_waiting == 5, what="globex's request queued all the same")
    finally:
        hold.set()
    for th in [*flood, other]:
        th.join(60)


def _ask(t: Tenancy, key: str) -> None:
    with t.client(key) as c:
        collect(c.generate(c.prepare("hello"), max_tokens=2))


def test_metrics_by_tenant_and_an_access_log_without_keys_or_prompts(
    tenancy, caplog: pytest.LogCaptureFixture
) -> None:
    t = tenancy()
    generated = []  # what each call's Finished said (the random model may end early)
    with caplog.at_level(logging.INFO, logger="slotwise.access"):
        for key in (ACME, ACME, GLOBEX):
            with t.client(key) as c:
                done = collect(c.generate(c.prepare("a secret question"), max_tokens=3))
                assert done.finished is not None
                generated.append(done.finished.usage.num_generated_tokens)
    lines = [r.getMessage() for r in caplog.records if r.name == "slotwise.access"]
    assert [x.split()[0] for x in lines] == ["tenant=acme", "tenant=acme", "tenant=globex"]
    for line, n in zip(lines, generated, strict=True):
        assert "status=OK" in line and line.endswith(f" tokens={n}"), line
    assert not any(secret in x for x in lines for secret in (ACME, GLOBEX, "secret question"))
    snap = t.running.engine.call(t.running.engine.snapshot).result(10)
    by = snap.stats.by_tenant
    assert (by["acme"].num_requests, by["globex"].num_requests) == (2, 1)
    assert by["acme"].num_generated_tokens == sum(generated[:2]) > 0


def test_sighup_revokes_a_key_while_a_call_of_it_finishes(tiny, tmp_path: Path) -> None:
    """slotwise serve: one keys file for prep, infer and the HTTP edge, re-read on SIGHUP."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    http = free_port()
    pair = tiny["mrope"]
    argv = serve_argv(pair.model, pair.mmproj, "--ctx-size", "2048", "--parallel", "2",
                      "--token-file", str(keys), "--http-port", str(http),
                      "--queue", "fair", "--tenant-max-active", "2")  # fmt: skip
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{http}"

    def status(key: str) -> int:
        body = {"prompt": "hi", "max_tokens": 2}
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                json=body,
                timeout=30,
                headers={"Authorization": f"Bearer {key}"},
            )
        except httpx.HTTPError:
            return 0
        return r.status_code

    try:
        wait_until(lambda: status(ACME) == 200, what="slotwise serve answering")
        body = {"prompt": "a long story", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=body,
            timeout=120,
            headers={"Authorization": f"Bearer {ACME}"},
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # streaming: the call is in flight
            keys.write_text(KEYS.replace(f"acme {ACME}\n", ""))
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda: status(ACME) == 401, what="acme's key revoked")
            assert status(GLOBEX) == 200
            rest = [x for x in lines if x]  # the call in flight finishes
        assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_the_flood_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/tenant_flood.py, small (its figures are the note's, not a test's)."""
    from benchmarks.tenant_flood import main

    assert main(["--flood", "4", "--max-tokens", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] for line in out.splitlines()[2:4]}
    assert rows == {"fifo", "fair"} and "fair/fifo" in out, out
