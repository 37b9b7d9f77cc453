"""Sounds at every edge, against real prep, infer and gateway servers on the tiny audio pairs:
OpenAI's input_audio parts (Chat Completions and the Responses API, with the `openai`
package), llama-server's multimodal_data and /props, Anthropic's Messages (which has no audio
block: refused in its shape, with the `anthropic` package), and the CLI (`slotwise count`,
`generate`, `chat`). Every refusal is a 4xx in the API's own shape, naming the field or the
limit; the cells a reply's usage reports are the ones prep counts."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from clients.client import NO_RETRY, Audio, Message, SlotwiseClient
from clients.gateway.media import MediaPolicy
from prep_service.service import Limits
from slotwise_core.tiny_models import TinyPair
from support.http_stack import Stack, Stacks, stacks_fixture
from support.loop import LoopThread
from support.media import image_bytes, wav_bytes

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 94  # ultravox: cells of one 30 s window (a shorter sound is one window)
MAX_SECONDS = 10.0  # the ultravox stack's prep --max-audio-seconds
MAX_AUDIO_BYTES = 1 << 20  # ... and its gateway's --max-audio-mb, in bytes


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def listen(*parts: dict[str, Any]) -> Any:  # (the SDKs' message types, for a dict)
    return [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, *parts]}]


@pytest.fixture(scope="module")
def stacks(
    loop_thread: LoopThread, tiny: dict[str, TinyPair], prep_servers: Callable[[str], int]
) -> Iterator[Stacks]:
    yield from stacks_fixture(loop_thread, tiny, prep_servers)


@pytest.fixture(scope="module")
def ultravox(stacks: Stacks, loop_thread: LoopThread) -> Iterator[Stack]:
    """The audio-only pair behind a prep that takes sounds of at most MAX_SECONDS, and a
    gateway that takes files of at most MAX_AUDIO_BYTES and 3 media a request."""
    from prep_service.__main__ import start

    pair = stacks.tiny["ultravox"]
    limits = Limits(max_audio_seconds=MAX_SECONDS)
    prep = loop_thread.run(start(pair.model, pair.mmproj, threads=1, limits=limits))
    media = MediaPolicy(max_audio_bytes=MAX_AUDIO_BYTES, max_images=3)
    yield stacks.start("ultravox", prep_port=prep.port, ctx_size=2048, gateway={"media": media})
    loop_thread.run(prep.stop(0))


@pytest.fixture(scope="module")
def vision(stacks: Stacks) -> Stack:
    return stacks.start("mrope")


@pytest.fixture(scope="module")
def both(stacks: Stacks) -> Stack:
    """gemma4: images and sounds through one projector."""
    return stacks.start("gemma4", ctx_size=2048)


def grpc_client(s: Stack) -> SlotwiseClient:
    return SlotwiseClient(f"127.0.0.1:{s.prep_port}", f"127.0.0.1:{s.infer.port}", retry=NO_RETRY)


def post(s: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json=body, timeout=120)


def refused(r: httpx.Response, *, param: str | None = None, says: str = "") -> dict[str, Any]:
    """A 400 in OpenAI's shape (naming `param`, saying `says`); its error."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


# -- OpenAI: Chat Completions ---------------------------------------------------------------


def test_chat_completions_take_input_audio_and_count_its_cells(ultravox: Stack) -> None:
    sound = wav_bytes(2.0)
    with grpc_client(ultravox) as c:
        expected = c.count([Message.user("Listen:", Audio(sound))])
        assert sum(ch.num_cells for ch in expected.chunks if ch.is_audio) == WINDOW
    client = ultravox.client()
    r = client.chat.completions.create(
        model="x", messages=listen(audio_part(sound)), max_tokens=3, temperature=0
    )
    assert r.usage is not None and r.usage.prompt_tokens == expected.num_cells
    (medium,) = r.usage.model_extra["slotwise"]["media"]
    assert medium["kind"] == "audio" and medium["cells"] == WINDOW
    # streamed: the same prompt, the same count, from the cache; the format field is read
    # loosely (the bytes say what they are, as llama-server reads them)
    chunks = list(
        client.chat.completions.create(
            model="x", messages=listen(audio_part(sound, "mp3")), max_tokens=3,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == expected.num_cells
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > WINDOW  # the sound's cells came back
    # a sound between two texts, and two sounds: each where it was put
    two: Any = [{"type": "text", "text": "A"}, audio_part(sound), {"type": "text", "text": "B"},
                audio_part(wav_bytes(1.0, seed=3))]  # fmt: skip
    r2 = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": two}], max_tokens=2
    )
    with grpc_client(ultravox) as c:
        parts = Message.user("A", Audio(sound), "B", Audio(wav_bytes(1.0, seed=3)))
        assert r2.usage is not None and r2.usage.prompt_tokens == c.count([parts]).num_cells
    assert [m["kind"] for m in r2.usage.model_extra["slotwise"]["media"]] == ["audio", "audio"]


@pytest.mark.parametrize("pair", ["ultravox", "qwen2a"])
def test_a_sound_as_an_image_url_data_uri_is_a_sound(stacks: Stacks, pair: str) -> None:
    """The issue's second row: a WAV sent as an image_url data URI is served as the sound it
    is (libmtmd, and llama-server, tell a file by its bytes), with prep's exact count."""
    stack = stacks.start(pair, ctx_size=2048)
    sound = wav_bytes(2.0, seed=4)
    with grpc_client(stack) as c:
        expected = c.count([Message.user("Listen:", Audio(sound))]).num_cells
    uri = {"type": "image_url", "image_url": {"url": f"data:audio/wav;base64,{b64(sound)}"}}
    r = stack.client().chat.completions.create(
        model="x", messages=listen(uri), max_tokens=2, temperature=0
    )
    assert r.usage is not None and r.usage.prompt_tokens == expected
    assert [m["kind"] for m in r.usage.model_extra["slotwise"]["media"]] == ["audio"]


def test_chat_completions_refuse_bad_sounds_by_field(ultravox: Stack) -> None:
    s, where = ultravox, "messages.0.content.1.input_audio"
    chat = "/v1/chat/completions"

    def body(part: dict[str, Any]) -> dict[str, Any]:
        return {"model": "x", "max_tokens": 2, "messages": listen(part)}

    bad_b64 = {"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}
    refused(post(s, chat, body(bad_b64)), param=f"{where}.data", says="not valid base64")
    png = audio_part(image_bytes(32, 32))
    refused(post(s, chat, body(png)), param=f"{where}.data", says="not a WAV, MP3 or FLAC")
    ogg = audio_part(wav_bytes(1.0), "ogg")
    refused(post(s, chat, body(ogg)), param=f"{where}.format", says="'ogg'")
    missing = {"type": "input_audio", "input_audio": {"format": "wav"}}
    refused(post(s, chat, body(missing)), param=f"{where}.data", says="Field required")
    unknown = {"type": "input_video", "input_video": {}}
    refused(post(s, chat, body(unknown)), param="messages.0.content.1.type")
    # a file over --max-audio-mb, before it is decoded
    big = wav_bytes(40.0)
    assert len(big) > MAX_AUDIO_BYTES
    error = refused(post(s, chat, body(audio_part(big))), param=f"{where}.data")
    assert str(MAX_AUDIO_BYTES) in error["message"] and "--max-audio-mb" in error["message"]
    # a sound longer than prep's --max-audio-seconds: prep's OUT_OF_RANGE, the limit named
    error = refused(post(s, chat, body(audio_part(wav_bytes(MAX_SECONDS + 2)))))
    assert error["code"] == "audio_too_long" and f"limit of {MAX_SECONDS:g} s" in error["message"]
    # an undecodable file that has a WAV's signature: prep's INVALID_ARGUMENT
    torn = wav_bytes(1.0)[:30]
    refused(post(s, chat, body(audio_part(torn))), says="WAV")
    # more sounds than --max-images, counted before any is decoded
    many = listen(*(audio_part(wav_bytes(0.5, seed=k)) for k in range(4)))
    r = post(s, chat, {"model": "x", "max_tokens": 2, "messages": many})
    refused(r, param="messages", says="4 images and sounds in one request")
    # an image to a projector that takes sounds only
    url = "data:image/png;base64," + b64(image_bytes(32, 32))
    picture = {"type": "image_url", "image_url": {"url": url}}
    refused(post(s, chat, body(picture)), says="takes audio, not images")


def test_a_sound_to_a_model_that_takes_none_is_a_400_naming_the_kind(
    vision: Stack, stacks: Stacks
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        vision.client().chat.completions.create(
            model="x", messages=listen(audio_part(wav_bytes(1.0))), max_tokens=2
        )
    assert "takes images, not audio" in str(e.value)
    # a projector whose audio encoder would abort the process: refused, saying why
    broken = stacks.start("ultravox8")
    r = post(broken, "/v1/chat/completions", {"messages": listen(audio_part(wav_bytes(1.0)))})
    refused(r, says="stack factor 8")
    assert broken.client().models.list().data  # and it serves on


# -- llama-server's native API ----------------------------------------------------------------


def test_props_say_which_kinds_each_model_takes(
    ultravox: Stack, vision: Stack, both: Stack
) -> None:
    for s, audio, pictures in ((ultravox, True, False), (vision, False, True), (both, True, True)):
        modalities = httpx.get(f"{s.url}/props", timeout=30).json()["modalities"]
        with grpc_client(s) as c:
            info = c.model_info()
        assert modalities["audio"] is info.supports_audio is audio
        assert modalities["vision"] is info.supports_vision is pictures


def test_completion_takes_sounds_and_images_in_marker_order(both: Stack, vision: Stack) -> None:
    with grpc_client(both) as c:
        marker = c.model_info().media_marker
        sound, picture = wav_bytes(2.0, seed=1), image_bytes(64, 48)
        text = f"Hear {marker} and see {marker}."
        expected = c.count(text, [Audio(sound), picture])
        swapped = c.count(f"See {marker} and hear {marker}.", [picture, Audio(sound)])
    prompt = {"prompt_string": text, "multimodal_data": [b64(sound), b64(picture)]}
    r = post(both, "/completion", {"prompt": prompt, "n_predict": 2})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] == expected.num_cells
    order = [ch.is_audio for ch in expected.chunks if ch.is_media]
    assert order[0] and not order[-1]  # the sound's chunk first, as its marker came
    back = {"prompt_string": f"See {marker} and hear {marker}.",
            "multimodal_data": [b64(picture), b64(sound)]}  # fmt: skip
    r = post(both, "/completion", {"prompt": back, "n_predict": 2})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == swapped.num_cells
    # the OpenAI route of the same server, and its input_tokens count, agree with prep
    with grpc_client(both) as c:
        chat_cells = c.count([Message.user("Listen:", Audio(sound))]).num_cells
    counted = post(
        both, "/v1/chat/completions/input_tokens", {"messages": listen(audio_part(sound))}
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] == chat_cells

    # refusals, in llama-server's shape
    def native_refusal(s: Stack, body: dict[str, Any], says: str) -> None:
        r = post(s, "/completion", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "invalid_request_error", error
        assert says in error["message"] and set(error) == {"code", "message", "type"}

    one = {"prompt_string": f"Hear {marker}.", "multimodal_data": [b64(wav_bytes(1.0))]}
    native_refusal(vision, {"prompt": one}, "takes images, not audio")
    bad = {"prompt_string": f"Hear {marker}.", "multimodal_data": ["@@"]}
    native_refusal(both, {"prompt": bad}, "multimodal_data.0: not valid base64")
    junk = {"prompt_string": f"Hear {marker}.", "multimodal_data": [b64(b"RIFF\0\0\0\0WAVEjunk")]}
    native_refusal(both, {"prompt": junk}, "WAV")
    # the OpenAI /v1/completions route takes text prompts: an object is a 400, not a 500
    r = post(both, "/v1/completions", {"prompt": one, "max_tokens": 2})
    refused(r)


def test_completion_on_an_audio_only_model_is_no_longer_refused_as_not_multimodal(
    ultravox: Stack,
) -> None:
    with grpc_client(ultravox) as c:
        marker = c.model_info().media_marker
        sound = wav_bytes(1.5)
        expected = c.count(f"Hear {marker} now.", [Audio(sound)])
    prompt = {"prompt_string": f"Hear {marker} now.", "multimodal_data": [b64(sound)]}
    r = post(ultravox, "/completion", {"prompt": prompt, "n_predict": 2, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] == expected.num_cells > WINDOW


# -- the Responses API and Anthropic's Messages -----------------------------------------------


def test_responses_take_input_audio_and_anthropic_refuses_an_audio_block(
    ultravox: Stack,
) -> None:
    sound = wav_bytes(2.0, seed=5)
    content: Any = [{"type": "input_text", "text": "Listen:"}, audio_part(sound)]
    r = ultravox.client().responses.create(
        model="x", input=[{"role": "user", "content": content}], max_output_tokens=2
    )
    with grpc_client(ultravox) as c:
        expected = c.count([Message.user("Listen:", Audio(sound))]).num_cells
    assert r.usage is not None and r.usage.input_tokens == expected
    bad = [{"type": "input_text", "text": "Listen:"}, audio_part(sound, "aiff")]
    r2 = post(ultravox, "/v1/responses", {"input": [{"role": "user", "content": bad}]})
    refused(r2, param="input.0.content.1.input_audio.format")
    r3 = post(ultravox, "/v1/responses/input_tokens",
              {"input": [{"role": "user", "content": content}]})  # fmt: skip
    assert r3.status_code == 200 and r3.json()["input_tokens"] == expected

    # Anthropic's Messages API has no audio block: a 400 in its shape, naming the field
    client = anthropic.Anthropic(base_url=ultravox.url, api_key="unused", max_retries=0)
    block = {"type": "audio", "source": {"type": "base64", "media_type": "audio/wav",
                                         "data": b64(sound)}}  # fmt: skip
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, block]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=2, messages=messages)
    body: Any = e.value.body
    assert body["type"] == "error"
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert "messages.0.content.1.type" in error["message"] and "input_audio" in error["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="x", messages=messages)


# -- the CLI ----------------------------------------------------------------------------------


def slotwise(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slotwise_cli", *args], input=stdin, capture_output=True,
        text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_the_cli_counts_generates_and_chats_with_sounds(ultravox: Stack, tmp_path: Path) -> None:
    sound = tmp_path / "hello.wav"
    sound.write_bytes(wav_bytes(2.0))
    prep = ["--prep", f"127.0.0.1:{ultravox.prep_port}"]
    both = [*prep, "--infer", f"127.0.0.1:{ultravox.infer.port}"]
    with grpc_client(ultravox) as c:
        expected = c.count([Message.user(Audio(sound.read_bytes()), "hi")])
    by_file = slotwise("count", "--prompt", "hi", "--audio", str(sound), "-v", *prep)
    by_length = slotwise("count", "--prompt", "hi", "--audio-seconds", "2", *prep)
    assert by_file.returncode == by_length.returncode == 0, by_file.stderr + by_length.stderr
    first = by_file.stdout.splitlines()[0]
    assert first == by_length.stdout.strip()
    assert first.startswith(f"cells={expected.num_cells} ")
    rows = [ln.split() for ln in by_file.stdout.splitlines()[2:]]
    assert [int(r[4]) for r in rows if r[3] == "audio"] == [WINDOW]

    g = slotwise("generate", "--prompt", "hi", "--audio", str(sound), "--max-tokens", "2", *both)
    assert g.returncode == 0, g.stderr
    assert f"prompt_cells={expected.num_cells} " in g.stderr

    script = f"/audio {sound}\nWhat is this?\n/audio /no/such.wav\n/history\n/quit\n"
    r = slotwise("chat", "--max-tokens", "2", *both, stdin=script)
    assert r.returncode == 0, r.stderr
    assert f"[sound {sound} attached to your next message]" in r.stderr
    assert "[cannot read /no/such.wav" in r.stderr
    assert "[1 sound(s)]" in next(ln for ln in r.stderr.splitlines() if " user:" in ln)

    missing = slotwise("count", "--prompt", "x", "--audio", "/no/such.wav", *prep)
    assert missing.returncode == 2 and "cannot read sound" in missing.stderr
    negative = slotwise("count", "--prompt", "x", "--audio-seconds", "-1", *prep)
    assert negative.returncode == 2 and "positive" in negative.stderr
    too_long = slotwise("count", "--prompt", "x", "--audio-seconds", str(MAX_SECONDS + 1), *prep)
    assert too_long.returncode == 1 and "OUT_OF_RANGE" in too_long.stderr


def test_the_gateway_flag_bounds_a_sound_s_bytes_apart_from_an_image_s() -> None:
    from clients.cli import gateway_config
    from slotwise_cli import parser

    base = ["gateway", "--prep", "p:1", "--infer", "i:2"]
    default = gateway_config(parser().parse_args(base), "", "", None).media
    assert default.max_audio_bytes == MediaPolicy().max_audio_bytes == 32 << 20
    given = gateway_config(parser().parse_args([*base, "--max-audio-mb", "5"]), "", "", None)
    assert given.media.max_audio_bytes == 5 << 20 and given.media.max_bytes == 20 << 20


# -- a long chat ------------------------------------------------------------------------------


@pytest.mark.parametrize("on_session", [False, True], ids=["resent", "session"])
def test_a_20_turn_chat_with_sounds_goes_past_1024_cells_evicting_them_whole(
    stacks: Stacks, on_session: bool
) -> None:
    """A sound every third turn (94 cells each) in 1,024 cells, on Chat Completions: resent
    whole every turn, or turn by turn on a server-side session (`slotwise.session_id`: a turn
    sends only its new message). Every turn answers; `usage.slotwise` counts the sounds
    evicted, each whole."""
    stack = stacks.start("ultravox", ctx_size=1024)
    client = stack.client()
    session: dict[str, Any] = {}
    if on_session:
        with grpc_client(stack) as c:
            session = {"session_id": c.create_session().session_id}
    messages: list[Any] = [{"role": "system", "content": "You listen and answer."}]
    evicted, evicted_cells = 0, 0
    for k in range(20):
        content: list[Any] = [{"type": "text", "text": f"Turn {k}: what did you hear?"}]
        if k % 3 == 0:
            content.append(audio_part(wav_bytes(2.0, seed=k)))
        sent = [*messages, {"role": "user", "content": content}]
        c = client.chat.completions.create(
            model="x", messages=sent[-1:] if on_session and k else sent, max_tokens=16,
            temperature=0, extra_body={"slotwise": session},
        )  # fmt: skip
        messages = [*sent, {"role": "assistant", "content": c.choices[0].message.content}]
        assert c.usage is not None
        extra = c.usage.model_extra["slotwise"]
        evicted += extra["evicted_media"]
        evicted_cells += extra["evicted_cells"]
    assert evicted >= 2, "7 sounds and 20 turns in 1,024 cells: the oldest sounds leave"
    assert evicted_cells >= evicted * WINDOW  # each sound left with all of its cells
