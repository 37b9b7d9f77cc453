"""The web page at / and the API behind it: a real Chromium (Debian's, driven by Playwright)
against the real prep, infer and HTTP servers on the tiny vision pair, and `slotwise serve`
serving the page (or not, with --no-ui). Screenshots of key steps go under the test's tmp
folder; their paths are printed."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clients.client import Constraint, SlotwiseClient
from support.hold import PrefillHold
from support.http_stack import Stack, Stacks, stacks_fixture
from support.media import image_bytes, wav_bytes
from support.procs import free_port, serve_argv
from support.required import require_or_skip
from support.wait import PATIENCE, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_MS = int(PATIENCE * 1000)


@pytest.fixture
def stacks(loop_thread, tiny, prep_servers) -> Iterator[Stacks]:
    yield from stacks_fixture(loop_thread, tiny, prep_servers)


# -- the API behind the page ------------------------------------------------------------------


def test_the_sessions_api_keeps_titles_and_each_turn_s_note(stacks) -> None:
    s = stacks.start("mrope", ctx_size=512, parallel=2)
    api = httpx.Client(base_url=s.url, timeout=PATIENCE)
    created = api.post("/slotwise/sessions", json={"title": "Harbour"}).json()
    sid = created["id"]
    assert created["title"] == "Harbour" and created["num_turns"] == 0
    note = json.dumps({"user": "hello there", "thumbs": []})
    chat = api.post(
        "/v1/chat/completions",
        json={
            "model": "slotwise",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello there"}],
            "slotwise": {"session_id": sid, "note": note},
        },
    )
    assert chat.status_code == 200, chat.text
    got = api.get(f"/slotwise/sessions/{sid}").json()
    (turn,) = got["turns"]
    assert turn["note"] == note and turn["text"] == chat.json()["choices"][0]["message"]["content"]
    assert turn["usage"]["prompt_cells"] == chat.json()["usage"]["prompt_tokens"]
    assert (
        api.patch(f"/slotwise/sessions/{sid}", json={"title": "Harbour, day 2"}).json()["title"]
        == "Harbour, day 2"
    )
    assert [x["title"] for x in api.get("/slotwise/sessions").json()["sessions"]] == [
        "Harbour, day 2"
    ]
    bad = api.patch(f"/slotwise/sessions/{sid}", json={"title": "two\nlines"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "title"
    no_session = api.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "slotwise": {"note": "x"}},
    )
    assert no_session.status_code == 400
    assert api.delete(f"/slotwise/sessions/{sid}").json() == {"id": sid, "deleted": True}
    assert api.get(f"/slotwise/sessions/{sid}").status_code == 404
    assert api.get("/slotwise/info").json()["num_cells_per_slot"] == 256


def test_the_kv_stream_sends_views_as_events(stacks) -> None:
    s = stacks.start("mrope", ctx_size=512, parallel=2)
    with httpx.Client(base_url=s.url, timeout=PATIENCE) as api:
        chat = api.post(
            "/v1/chat/completions",
            json={"max_tokens": 3, "messages": [{"role": "user", "content": "Once upon"}]},
        ).json()
        assert api.get("/slotwise/kv", params={"interval_ms": 5}).status_code == 400
        with api.stream("GET", "/slotwise/kv", params={"interval_ms": 100}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            line = next(x for x in lines if x.startswith("data: "))
            view = json.loads(line.removeprefix("data: "))
            # the server stops with the stream open: it ends the stream, and does not wait on it
            stacks.loop_thread.run(s.gateway.stop(), timeout=PATIENCE)
            rest = list(lines)  # (the stream has ended)
            assert all(not x.startswith('data: {"error') for x in rest)
    assert [x["state"] for x in view["slots"]].count("idle") == 1
    (used,) = [x for x in view["slots"] if x["state"] == "idle"]
    prompt = sum(g["num_cells"] for g in used["segments"] if g["kind"] != "generated")
    assert prompt == chat["usage"]["prompt_tokens"] and used["session_id"] == ""


def test_keep_system_pins_the_system_prompt_where_the_template_folds_it_in(stacks) -> None:
    """Gemma's template has no system turn: it writes the system prompt into the first user
    turn. The system prompt's text there is still message 0's (prep cuts it out of the turn),
    so `keep: "system"` pins it, and nothing of the user's message."""
    s = stacks.start("rope", ctx_size=512, parallel=2, chat_template="gemma")
    with httpx.Client(base_url=s.url, timeout=PATIENCE) as api:
        chat = api.post(
            "/v1/chat/completions",
            json={
                "max_tokens": 2,
                "messages": [
                    {"role": "system", "content": "You are a harbour guide."},
                    {"role": "user", "content": "Hello"},
                ],
                "slotwise": {"session_id": "folded"},
            },
        )
        assert chat.status_code == 200, chat.text
        with api.stream("GET", "/slotwise/kv") as r:
            line = next(x for x in r.iter_lines() if x.startswith("data: "))
    (slot,) = [x for x in json.loads(line[6:])["slots"] if x["session_id"] == "folded"]
    first, *rest = slot["segments"]
    assert first["pinned"] and first["message_index"] == 0 and "harbour" in first["preview"]
    assert rest and not any(g["pinned"] for g in rest)
    assert rest[0]["message_index"] == 1 and "Hello" in rest[0]["preview"]


def test_slotwise_serve_serves_the_page_and_no_ui_turns_it_off(tiny, tmp_path: Path) -> None:
    pair = tiny["mrope"]
    for flags, status in (((), 200), (("--no-ui",), 404)):
        http = free_port()
        argv = serve_argv(pair.model, pair.mmproj, "--ctx-size", "512", "--http-port", str(http))
        log = (tmp_path / f"serve{len(flags)}.log").open("w")
        proc = subprocess.Popen([*argv, *flags], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{http}"
            wait_until(lambda url=url: _ready(url), what="slotwise serve answering")
            page = httpx.get(f"{url}/")
            assert page.status_code == status
            if status == 200:
                assert 'id="kv"' in page.text and "text/html" in page.headers["content-type"]
                assert httpx.get(f"{url}/ui/app.js").status_code == 200
            assert httpx.get(f"{url}/slotwise/info").status_code == 200  # the API stays
        finally:
            proc.terminate()
            proc.wait(PATIENCE)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- the page in a browser --------------------------------------------------------------------


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[Any]:
    if CHROMIUM is None:
        require_or_skip("chromium", "no chromium here (Debian's package; .ci/run installs it)")
    try:
        from playwright import sync_api
    except ImportError:
        require_or_skip("chromium", "no playwright package (pip install -e '.[test]')")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: d.accept())
        page.set_default_timeout(WAIT_MS)
        yield page
        browser.close()
        assert not errors, errors  # no script error on the way


class Shots:
    def __init__(self, page: Any, folder: Path):
        self.page, self.folder, self.n = page, folder, 0

    def __call__(self, name: str) -> Path:
        self.n += 1
        path = self.folder / f"{self.n:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


def used_cells(page: Any, slot: int) -> int:
    return int(page.locator(f'.slot[data-slot="{slot}"] .cells').get_attribute("data-used"))


def segments(page: Any, slot: int) -> list[tuple[str, str, int]]:
    return page.eval_on_selector_all(
        f'.slot[data-slot="{slot}"] .bar .seg',
        "els => els.map(e => [e.dataset.kind, e.dataset.type || '', +e.dataset.cells])",
    )


def send(page: Any, text: str, image: Path | None = None) -> None:
    n = page.locator(".message.assistant .usage").count()
    page.fill("#input", text)
    if image is not None:
        page.set_input_files("#file", str(image))
        page.wait_for_selector("#attachments img")
    page.click("#send")
    page.wait_for_function(
        f"document.querySelectorAll('.message.assistant .usage').length > {n}", timeout=WAIT_MS
    )


def last_usage(page: Any) -> dict[str, int]:
    usage = page.locator(".message.assistant .usage").last
    return {
        k: int(usage.get_attribute(f"data-{k}") or 0)
        for k in ("prompt-cells", "generated", "shifts", "evicted-cells")
    }


def test_a_person_chats_with_images_and_watches_the_cells(
    stacks, browser_page, tmp_path: Path
) -> None:
    s: Stack = stacks.start("mrope", ctx_size=512, parallel=2, sessions_dir=tmp_path / "sessions")
    page, shot = browser_page, Shots(browser_page, tmp_path)
    photo = tmp_path / "photo.png"
    photo.write_bytes(image_bytes(64, 48, seed=7))
    api = httpx.Client(base_url=s.url, timeout=PATIENCE)

    page.goto(s.url)
    page.wait_for_selector('.slot[data-slot="1"]')  # the KV picture shows both slots
    page.fill("#max-tokens", "8")
    page.select_option("#policy", "shift")
    page.fill("#system", "You describe pictures.")
    shot("loaded")

    # a message with an image: the reply streams in, the slot's bar holds the prompt's cells
    send(page, "What is in this picture?", photo)
    assert page.locator(".message.user img.thumb").count() == 1
    assert page.locator(".message.assistant .content").last.inner_text().strip()
    (session,) = api.get("/slotwise/sessions").json()["sessions"]
    slot = _slot_of(page, session["id"])
    usage = last_usage(page)
    page.wait_for_function(
        f"+document.querySelector('.slot[data-slot=\"{slot}\"] .cells').dataset.used"
        f" === {session['num_cells']}"
    )
    segs = segments(page, slot)
    prompt = sum(c for kind, typ, c in segs if kind != "free" and typ != "generated")
    assert prompt == usage["prompt-cells"] > 0
    assert any(typ == "media" for _, typ, _ in segs)
    assert sum(c for kind, _, c in segs if kind != "free") == used_cells(page, slot)
    assert sum(c for _, _, c in segs) == 256  # free cells complete the slot
    title = page.locator(f'li.session[data-id="{session["id"]}"] .open').inner_text()
    assert "What is in this picture" in title  # named after its first message
    shot("first-reply")

    # on past the context: the shift is marked with the cells the API reported evicted
    evicted = 0
    for turn in range(30):
        send(page, f"Tell me more about the harbour, part {turn}.")
        evicted += last_usage(page)["evicted-cells"]
        if evicted:
            break
    assert evicted > 0, "no shift in 30 turns of a 256-cell slot"
    marks = f'.slot[data-slot="{slot}"] .shifts li'
    page.wait_for_function(f"document.querySelectorAll('{marks}').length > 0")
    shown = page.eval_on_selector_all(marks, "els => els.map(e => +e.dataset.evictedCells)")
    assert sum(shown) == evicted and len(shown) < 8
    assert page.locator(f'.slot[data-slot="{slot}"] .shift-mark').count() == len(shown)
    # the system message stayed pinned (keep defaults to it), in front of every eviction
    kind, _, pinned = segments(page, slot)[0]
    assert kind == "pinned" and pinned > 0
    at = page.eval_on_selector_all(
        f'.slot[data-slot="{slot}"] .shift-mark', "els => els.map(e => e.dataset.atCell)"
    )
    assert at == [str(pinned)] * len(shown), at
    shot("shifted")

    # stop a generation that is provably under way: the engine is held inside a decode
    page.fill("#max-tokens", "200")
    turns_before = api.get(f"/slotwise/sessions/{session['id']}").json()["num_turns"]
    rt = s.infer.engine.runtime
    with PrefillHold(rt, at=4) as hold:
        page.fill("#input", "And then?")
        page.click("#send")
        assert hold.held.wait(PATIENCE)
        page.wait_for_selector("#stop:not([disabled])")
        page.click("#stop")
        page.wait_for_selector("#stop[disabled]")
    page.wait_for_function(
        "document.querySelector('.message.assistant:last-child').textContent.includes('stopped')"
    )
    wait_until(
        lambda: (
            api.get(f"/slotwise/sessions/{session['id']}").json()["num_turns"] == turns_before
            and not s.infer.engine.slots[slot].job
        ),
        what="the stopped turn ended, not completed",
    )
    shot("stopped")

    # a second session, then back to the first: its messages and image come back from the API
    page.click("#new-session")
    page.wait_for_function("document.querySelectorAll('#messages .message').length === 0")
    send(page, "A new conversation.")
    wait_until(lambda: len(api.get("/slotwise/sessions").json()["sessions"]) == 2)
    page.locator(f'li.session[data-id="{session["id"]}"] .open').click()
    page.wait_for_selector(f'li.session.current[data-id="{session["id"]}"]')
    page.wait_for_selector(".message.user img.thumb")
    first_user = page.locator(".message.user .content").first.inner_text()
    assert "What is in this picture?" in first_user
    shot("switched-back")

    # rename and delete from the sidebar
    item = page.locator(f'li.session[data-id="{session["id"]}"]')
    item.locator(".rename").click()
    page.fill(".rename-input", "The harbour")
    page.keyboard.press("Enter")
    wait_until(
        lambda: api.get(f"/slotwise/sessions/{session['id']}").json()["title"] == "The harbour"
    )
    item.locator(".delete").click()
    page.wait_for_selector(f'li.session[data-id="{session["id"]}"]', state="detached")
    assert [x["id"] for x in api.get("/slotwise/sessions").json()["sessions"]] != [session["id"]]
    assert api.get(f"/slotwise/sessions/{session['id']}").status_code == 404
    shot("deleted")


def _slot_of(page: Any, session_id: str) -> int:
    """The slot whose picture shows the session (once the next view has come)."""
    found = page.wait_for_function(
        """id => {
            const slot = [...document.querySelectorAll('.slot')]
                .find(e => e.querySelector('.slot-head').textContent.includes(id));
            return slot ? +slot.dataset.slot + 1 : 0;
        }""",
        arg=session_id,
    )
    return int(found.json_value()) - 1


def test_the_bar_grows_while_a_prompt_prefills(stacks, browser_page, tmp_path: Path) -> None:
    """The engine is held inside the prompt's third batch until the page's next look is
    queued: that look, made right after the batch, shows exactly three batches of cells, the
    slot prefilling; the page shows it (a MutationObserver keeps every value it drew)."""
    s = stacks.start("rope", ctx_size=4096, batch_size=16, ubatch_size=16)
    page = browser_page
    page.goto(s.url)
    page.wait_for_selector('.slot[data-slot="0"] .cells')
    page.evaluate(
        """() => {
            window.seen = [];
            const note = () => {
                const head = document.querySelector('.slot[data-slot="0"]');
                const cells = head && head.querySelector('.cells');
                if (cells) window.seen.push([+cells.dataset.used, head.textContent]);
            };
            const all = {subtree: true, childList: true, attributes: true};
            new MutationObserver(note).observe(document.getElementById('slots'), all);
        }"""
    )
    page.fill("#max-tokens", "2")
    engine = s.infer.engine
    with PrefillHold(engine.runtime, at=3) as hold:
        page.fill("#input", "The quick brown fox jumps over the lazy dog. " * 20)
        page.click("#send")
        assert hold.held.wait(PATIENCE)
        wait_until(lambda: engine._calls, what="the page's next look queued")
    page.wait_for_selector(".message.assistant .usage")
    seen = page.evaluate("window.seen")
    during = [used for used, head in seen if "prefilling" in head]
    assert 3 * 16 in during, seen
    total = int(page.locator(".message.assistant .usage").get_attribute("data-prompt-cells"))
    assert all(0 < used < total for used in during)
    Shots(page, tmp_path)("prefilled")


def test_errors_are_shown_in_words_and_a_key_is_asked_for(
    stacks, browser_page, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("acme key-of-acme\n")
    from slotwise_core.keys import Keys

    s = stacks.start("mrope", ctx_size=256, max_queue=1, gateway={"api_keys": Keys(keys)})
    page, shot = browser_page, Shots(browser_page, tmp_path)
    page.goto(s.url)
    page.wait_for_selector("#key-dialog[open]")
    shot("key-asked")
    page.fill("#key-input", "key-of-acme")
    page.click("#key-save")
    page.wait_for_selector('.slot[data-slot="0"]')
    page.fill("#max-tokens", "4")

    # a pinned system prompt longer than the whole context can never fit
    page.fill("#system", "You are a patient guide to the harbour town. " * 40)
    page.fill("#input", "Hello")
    page.click("#send")
    page.wait_for_function("document.querySelector('#error').textContent.includes('too long')")
    shot("too-long")

    # the one slot busy and the queue's one place taken: the page's turn is refused, in words
    full = stacks.start("mrope", ctx_size=256, max_queue=1)
    endless = Constraint(grammar='root ::= "a" root')  # allows no end: runs until cancelled
    stop = threading.Event()
    with SlotwiseClient(f"127.0.0.1:{full.prep_port}", f"127.0.0.1:{full.infer.port}") as c:
        engine = full.infer.engine
        # one after the other: a second sent while the first still waits for the slot would
        # find the queue's one place taken, and be refused
        for expected in ((1, 0), (1, 1)):
            generation = c.generate("Say a", constraint=endless, max_tokens=1 << 20)
            threading.Thread(target=_until, args=(generation, stop), daemon=True).start()
            wait_until(lambda e=expected: (engine.num_active, engine.num_waiting) == e)
        page.goto(full.url)
        page.wait_for_selector('.slot[data-slot="0"] .cells')
        page.fill("#input", "Hello again")
        page.click("#send")
        page.wait_for_function(
            "document.querySelector('#error').textContent.includes('queue is full')"
        )
        assert page.input_value("#input") == "Hello again"  # given back, to send again
        shot("queue-full")
        stop.set()
        wait_until(lambda: engine.num_active == engine.num_waiting == 0)


def _until(events: Any, stop: threading.Event) -> None:
    """Read a generation until told to stop, then cancel it (on this thread: its reader's)."""
    with contextlib.suppress(Exception):
        for _ in events:
            if stop.is_set():
                break
    events.close()


def test_markdown_narrow_screens_dark_mode_and_the_keyboard(
    stacks, browser_page, tmp_path: Path
) -> None:
    s = stacks.start("mrope", ctx_size=512, parallel=2)
    page, shot = browser_page, Shots(browser_page, tmp_path)
    page.set_viewport_size({"width": 360, "height": 780})
    page.emulate_media(color_scheme="dark")
    page.goto(s.url)
    page.wait_for_selector('.slot[data-slot="0"] .cells')
    html = page.evaluate(
        """async () => (await import('/ui/markdown.js')).renderMarkdown(
            "# Title\\n**bold** and `x<y`\\n\\n```py\\nprint('<b>')\\n```\\n- one\\n- two\\n" +
            "<script>alert(1)</script> [ok](https://example.org) [no](javascript:alert(1))" +
            "\\n\\n[a_b](https://h.org/x_y_z) foo_ bar *and* \\u00000\\u0000")"""
    )
    # a link is whole: no emphasis inside its URL or attributes; a NUL is no placeholder
    assert '<a href="https://h.org/x_y_z" target="_blank" rel="noopener noreferrer">a_b</a>' in html
    assert "<em>and</em>" in html and "undefined" not in html
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert "<code>x&lt;y</code>" in html
    assert '<pre><code class="language-py">print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert 'href="https://example.org"' in html and "javascript:" not in html.split("[no]")[0]
    assert 'href="javascript' not in html
    # nothing wider than a 360 px phone; a dark background when the system asks for it
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 360, f"the page is {width} px wide at 360 px"
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert sum(int(c) for c in background[4:-1].split(",")[:3]) < 3 * 96, background
    # the keyboard alone: Tab reaches the composer, Enter sends, the reply comes
    page.focus("#input")
    page.keyboard.type("Hello from the keyboard")
    page.keyboard.press("Enter")
    page.wait_for_selector(".message.assistant .usage")
    assert page.locator(".message.user .content").first.inner_text() == "Hello from the keyboard"
    page.keyboard.press("Tab")
    focused = page.evaluate("document.activeElement && document.activeElement.tagName")
    assert focused in ("BUTTON", "LABEL", "INPUT", "TEXTAREA", "A", "SELECT")
    shot("narrow-dark")


def test_the_page_draws_a_shared_prefix_once(stacks, browser_page) -> None:
    """--kv-unified: two sessions open with one system prompt (pinned, as the edge does by
    default); the page draws its cells once, and each slot a box that stands for them."""
    s: Stack = stacks.start("rope", ctx_size=1024, parallel=2, kv_unified=True)
    system = "You are a harbour guide: you answer questions about ships, briefly and kindly."
    with httpx.Client(base_url=s.url, timeout=PATIENCE) as api:
        for session, question in (("first", "Hello"), ("second", "Which ship is that?")):
            chat = api.post("/v1/chat/completions", json={
                "max_tokens": 2,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}],
                "slotwise": {"session_id": session},
            })  # fmt: skip
            assert chat.status_code == 200, chat.text
        with api.stream("GET", "/slotwise/kv") as r:
            line = next(x for x in r.iter_lines() if x.startswith("data: "))
    view = json.loads(line[6:])
    (prefix,) = view["shared_prefixes"]
    assert sorted(prefix["slots"]) == [0, 1] and prefix["num_cells"] >= 32

    page = browser_page
    page.goto(s.url)
    page.wait_for_selector(f'.shared-prefix[data-holder="{prefix["holder"]}"]')
    assert page.locator(".shared-prefix").count() == 1
    drawn = page.eval_on_selector_all(
        ".shared-prefix .bar .seg:not([data-kind='free'])", "els => els.map(e => +e.dataset.cells)"
    )
    assert sum(drawn) == prefix["num_cells"]
    assert "harbour" in page.locator(".shared-prefix .bar .seg").first.get_attribute("title")
    for slot in (0, 1):
        segs = segments(page, slot)
        assert tuple(segs[0]) == ("shared", "shared", prefix["num_cells"])  # once, as a box
        assert sum(c for kind, _, c in segs if kind != "free") == used_cells(page, slot)


def test_the_page_draws_a_hybrid_sequence_s_recurrent_state(stacks, browser_page) -> None:
    """Hybrid memory (the tiny qwen35 pair): a slot's recurrent state is its own box beside
    the cells, with its bytes and the checkpoints kept of it."""
    s: Stack = stacks.start("qwen35", ctx_size=512, parallel=1)
    with httpx.Client(base_url=s.url, timeout=PATIENCE) as api:
        chat = api.post("/v1/chat/completions", json={
            "max_tokens": 3, "messages": [{"role": "user", "content": "Hello there, how are you?"}],
        })  # fmt: skip
        assert chat.status_code == 200, chat.text
        with api.stream("GET", "/slotwise/kv") as r:
            line = next(x for x in r.iter_lines() if x.startswith("data: "))
    (slot,) = json.loads(line[6:])["slots"]
    assert slot["num_recurrent_bytes"] > 0 and slot["num_checkpoints"] > 0

    page = browser_page
    page.goto(s.url)
    box = page.wait_for_selector('.slot[data-slot="0"] .recurrent')
    assert box is not None
    assert int(box.get_attribute("data-bytes")) == slot["num_recurrent_bytes"]
    assert int(box.get_attribute("data-checkpoints")) == slot["num_checkpoints"]
    assert "recurrent state" in box.inner_text() and "checkpoint" in box.inner_text()


def test_a_person_sends_a_sound_and_sees_its_cells(stacks, browser_page, tmp_path: Path) -> None:
    """A WAV attached as images are: it goes as an input_audio part, its cells are drawn as a
    sound's (one 30 s window of the tiny ultravox pair: 94 cells), the next turn sends it as a
    stand-in (the session holds it), and a model that takes no sound says so in words."""
    s: Stack = stacks.start("ultravox", ctx_size=1024, parallel=2)
    page, shot = browser_page, Shots(browser_page, tmp_path)
    sound = tmp_path / "harbour.wav"
    sound.write_bytes(wav_bytes(2.0))
    api = httpx.Client(base_url=s.url, timeout=PATIENCE)

    page.goto(s.url)
    page.wait_for_selector('.slot[data-slot="1"]')
    page.fill("#max-tokens", "4")
    page.fill("#input", "What do you hear?")
    page.set_input_files("#file", str(sound))
    chip = page.wait_for_selector("#attachments .sound")
    assert chip is not None and "harbour.wav" in chip.inner_text() and "2.0 s" in chip.inner_text()
    shot("sound-attached")
    page.click("#send")
    page.wait_for_selector(".message.assistant .usage")
    assert page.locator('.message.user .sound[data-name="harbour.wav"]').count() == 1
    (session,) = api.get("/slotwise/sessions").json()["sessions"]
    slot = _slot_of(page, session["id"])
    sound_cells = f'.slot[data-slot="{slot}"] .seg[data-kind="audio"]'
    page.wait_for_selector(sound_cells)
    segs = segments(page, slot)
    assert [(typ, cells) for kind, typ, cells in segs if kind == "audio"] == [("media", 94)]
    prompt = sum(c for kind, typ, c in segs if kind != "free" and typ != "generated")
    assert prompt == last_usage(page)["prompt-cells"]
    assert "sound" in (page.locator(sound_cells).first.get_attribute("title") or "")
    assert page.locator('#kv-legend .swatch[data-kind="audio"]').count() == 1
    shot("sound-cells")

    # the next turn: the session holds the sound, sent again as a stand-in; its cells stay
    send(page, "And now?")
    assert page.locator("#error").is_hidden()
    page.wait_for_function(
        f"document.querySelectorAll('{sound_cells}').length === 1"
        f" && +document.querySelector('{sound_cells}').dataset.cells === 94"
    )
    # opened again from the sidebar: the sound's name comes back from the turn's note
    page.click("#new-session")
    page.locator(f'li.session[data-id="{session["id"]}"] .open').click()
    page.wait_for_selector('.message.user .sound[data-name="harbour.wav"]')

    # a model whose projector takes images only: the refusal in words, the turn given back
    vision: Stack = stacks.start("mrope", ctx_size=512)
    page.goto(vision.url)
    page.wait_for_selector('.slot[data-slot="0"] .cells')
    page.fill("#input", "Hear this")
    page.set_input_files("#file", str(sound))
    page.wait_for_selector("#attachments .sound")
    page.click("#send")
    page.wait_for_function("document.querySelector('#error').textContent.includes('not audio')")
    assert page.input_value("#input") == "Hear this"
    assert page.locator("#attachments .sound").count() == 1  # given back, to send elsewhere
    shot("sound-refused")


def test_the_page_and_props_say_what_a_cell_is_made_of(stacks, browser_page) -> None:
    """--cache-type-k/v: /props' slotwise object, /slotwise/info and the KV page name the cells'
    types and the bytes one takes (f32 here: twice f16's)."""
    from infer_service.runner.cache_types import CacheTypes

    s: Stack = stacks.start("rope", ctx_size=256, cache_types=CacheTypes("f32", "f32", "off"))
    with httpx.Client(base_url=s.url, timeout=PATIENCE) as api:
        props = api.get("/props").json()["slotwise"]
        info = api.get("/slotwise/info").json()
    assert (props["cache_type_k"], props["cache_type_v"], props["flash_attn"]) == (
        "f32", "f32", "off",
    )  # fmt: skip
    assert props["bytes_per_cell"] == info["bytes_per_cell"] == 2 * 2 * 32 * 4  # 2 layers, K+V
    page = browser_page
    page.goto(s.url)
    page.wait_for_function(
        "document.getElementById('kv-info').textContent.includes('K f32 / V f32, 512 B')"
    )


def test_behind_a_router_the_page_picks_a_model(tiny, tmp_path: Path, browser_page) -> None:
    from support.router import models_folder, running_router

    folder = models_folder(tmp_path / "models", {n: tiny[n] for n in ("rope", "mrope")})
    with running_router("--models-dir", str(folder)) as router:
        page = browser_page
        page.goto(router.url + "/")
        page.wait_for_selector("#model-picker:not([hidden])")
        picked = page.eval_on_selector_all("#model-picker option", "els => els.map(e => e.value)")
        assert picked == ["mrope", "rope"]
        with page.expect_navigation():
            page.select_option("#model-picker", "rope")
        page.wait_for_selector("#model-picker:not([hidden])")
        assert page.input_value("#model-picker") == "rope"
        send(page, "hello")
        assert last_usage(page)["generated"] > 0
        assert router.status("rope") == "loaded"
        # the KV view is rope's: its slot holds the chat's cells
        page.wait_for_function("document.querySelector('.slot[data-slot=\"0\"] .cells') && "
                               "+document.querySelector('.slot[data-slot=\"0\"] .cells')"
                               ".dataset.used > 0")  # fmt: skip
        assert used_cells(page, 0) >= last_usage(page)["prompt-cells"]
