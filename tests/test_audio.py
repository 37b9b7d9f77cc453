"""Sounds through the real services: prep counts them with libmtmd (from the file, or from a
length alone), infer decodes them again, checks the counts and encodes them beside decoding;
a projector whose encoder would abort the process is refused before anything is encoded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from clients.client import (
    NO_RETRY,
    Audio,
    Message,
    Policy,
    Shift,
    SlotwiseClient,
    SlotwiseError,
    collect,
)
from infer_service.sessions.store import SessionStore
from prep_service.service import Limits
from slotwise.v1 import prompt_pb2
from support.media import image_bytes, wav_bytes
from support.wait import PATIENCE

# the cells of a 2 s and of a 35 s sound's media chunks, as libmtmd counts them: whisper-style
# towers pad each 30 s window (ultravox 94, qwen2a 750 cells a window); gemma4a does not (25
# cells a second, a 30 s window at most)
CHUNKS = {
    "ultravox": ([94], [94, 94]),
    "qwen2a": ([750], [750, 750]),
    "gemma4": ([50], [750, 125]),
}
WRAPPER = {"ultravox": 0, "qwen2a": 2, "gemma4": 2}  # <|audio_bos|> ... <|audio_eos|> and kin


@pytest.fixture
def served(prep_servers: Callable[[str], int], infer_server: Callable[..., Any]):
    def open_pair(name: str, **options: Any) -> SlotwiseClient:
        infer = infer_server(name, **{"ctx_size": 4096, **options})
        return SlotwiseClient(
            f"127.0.0.1:{prep_servers(name)}", f"127.0.0.1:{infer.port}", retry=NO_RETRY
        )

    return open_pair


@pytest.mark.parametrize("name", CHUNKS)
def test_a_sound_is_counted_exactly_and_generates(name: str, served) -> None:
    with served(name) as client:
        info = client.model_info()
        assert info.supports_audio and info.supports_vision == (name == "gemma4")
        short, long = wav_bytes(2.0), wav_bytes(35.0, rate=44_100, seed=1)
        chat = [Message.user("Listen:", audio=short), Message.user("and", audio=long)]
        prepared = client.prepare(chat)
        chunks = prepared.count().chunks
        media = [c for c in chunks if c.is_media]
        # 2 s: one window; 35 s: two windows of one group (evicted together)
        two, thirty_five = CHUNKS[name]
        assert [c.num_cells for c in media] == [*two, *thirty_five]
        assert all(c.is_audio and c.num_positions == c.num_cells for c in media)
        assert [c.media_group for c in media] == [1, 2, 2]
        group_cells = [sum(c.num_cells for c in chunks if c.media_group == g) for g in (1, 2)]
        assert group_cells == [sum(two) + WRAPPER[name], sum(thirty_five) + WRAPPER[name]]
        # a length alone counts the same as the sound itself
        by_length = client.count(
            [Message.user("Listen:", Audio(seconds=2.0)), Message.user("and", Audio(seconds=35.0))]
        )
        assert by_length.num_cells == prepared.num_cells
        done = collect(client.generate(prepared, max_tokens=4, temperature=0))
        assert (
            done.finished.error == "" and done.finished.usage.num_prompt_cells == prepared.num_cells
        )
        # float32 samples count as the file they came from
        pcm = sounds_pcm(short)
        assert client.count([Message.user("Listen:", Audio(pcm=pcm))]).num_cells == (
            client.count([Message.user("Listen:", audio=short)]).num_cells
        )


def sounds_pcm(wav: bytes) -> bytes:
    import io
    import wave

    import numpy as np

    with wave.open(io.BytesIO(wav)) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return (samples.astype("<f4") / 32768).tobytes()


def chat_turn(client: SlotwiseClient, sent: list[Message], first: int, **options: Any):
    """One turn: the events of generating the reply to `sent` (from message `first`)."""
    prepared = client.prepare(sent, first_message=first)
    events: list[Any] = []
    done = collect(
        client.generate(prepared, max_tokens=16, temperature=0, **options), events.append
    )
    return prepared, done, [e for e in events if isinstance(e, Shift)]


def sound_ids(prepared) -> set[str]:
    return {
        c.media.media_id
        for c in prepared.prompt.chunks
        if c.WhichOneof("kind") == "media" and c.media.WhichOneof("pixels") == "audio"
    }


@pytest.mark.parametrize(
    ("on_session", "policy"),
    [(True, Policy.SHIFT), (True, Policy.GAP), (True, Policy.REPREFILL), (False, Policy.AUTO)],
    ids=["session-shift", "session-gap", "session-reprefill", "resent"],
)
def test_a_long_chat_with_sounds_goes_past_the_context_evicting_them_whole(
    on_session: bool, policy: Policy, served, tmp_path
) -> None:
    """20 turns, a 2 s sound every third one (94 cells each), in 1,024 cells: the chat goes
    on past the context, and every sound that leaves leaves whole (its group at once), under
    every policy that evicts."""
    with served("ultravox", ctx_size=1024, sessions_dir=tmp_path) as client:
        if on_session:
            client.create_session("talk")
        messages: list[Message] = [Message.system("You listen and answer.")]
        first, sent_sounds, evicted, cells = 0, set(), [], 0
        for k in range(20):
            ask = f"Turn {k}: what do you hear, and what did you hear before that?"
            user = (
                Message.user(ask, audio=wav_bytes(2.0, seed=k)) if k % 3 == 0 else Message.user(ask)
            )
            sent = [*messages, user]
            options: dict[str, Any] = {"policy": policy}
            if on_session:
                options["session_id"] = "talk"
            prepared, done, shifts = chat_turn(client, sent, first if on_session else 0, **options)
            assert done.finished.error == "", (k, done.finished.error)
            assert all(sh.policy is (policy if policy is not Policy.AUTO else Policy.SHIFT)
                       for sh in shifts), shifts  # fmt: skip
            sent_sounds |= sound_ids(prepared)
            for sh in shifts:
                evicted.extend(sh.media_ids_evicted)
                # each sound's cells all in the one shift that names it
                assert sh.num_cells_evicted >= 94 * len(sh.media_ids_evicted), (k, sh)
            cells += prepared.num_cells + done.finished.usage.num_generated_tokens
            messages = [*sent, Message.assistant(done.text or ".")]
            first = len(messages) - 1
        # the whole chat, each turn's prompt and reply once, is far past the context
        assert cells > 1024 if on_session else prepared.num_cells > 1024
        assert evicted, "20 turns with 7 sounds in 1,024 cells evict some"
        assert set(evicted) <= sent_sounds and len(evicted) == len(set(evicted)), evicted


def test_a_projector_whose_encoder_would_abort_is_refused_audio_and_serves_on(
    served, prep_servers, infer_server
) -> None:
    """ultravox with stack factor 8 (Ultravox v0.5's): libmtmd counts 187 embeddings per window
    and the encoder makes 188, on which llama.cpp aborts the process (test_tiny_families shows
    it in a child). Neither service encodes it: prep refuses the sound, and infer refuses a
    descriptor that carries one anyway; both go on serving."""
    with served("ultravox8") as client:
        assert not client.model_info().supports_audio
        with pytest.raises(SlotwiseError) as refused:
            client.prepare([Message.user("Listen:", audio=wav_bytes(2.0))])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stack factor 8" in refused.value.message and "abort" in refused.value.message
        fingerprint = prompt_pb2.Fingerprint()
        fingerprint.CopyFrom(client.prepare([Message.user("hi")]).prompt.fingerprint)
        # the descriptor libmtmd's count would make: a 2 s sound in 187 cells
        with served("ultravox") as other:
            prompt = other.prepare([Message.user("Listen:", audio=wav_bytes(2.0))]).prompt
        prompt.fingerprint.CopyFrom(fingerprint)
        for chunk in prompt.chunks:
            if chunk.WhichOneof("kind") == "media":
                chunk.media.num_cells = chunk.media.num_positions = 187
        prompt.num_cells, prompt.num_positions = prompt.num_cells + 93, prompt.num_positions + 93
        with pytest.raises(SlotwiseError) as refused:
            collect(client.generate(prompt, max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stack factor 8" in refused.value.message
        # still serving, text alike
        done = collect(client.generate([Message.user("still there?")], max_tokens=4))
        assert done.finished.error == "" and done.finished.usage.num_generated_tokens == 4


def test_a_session_keeps_its_sounds_on_disk_and_another_server_decodes_them_again(
    prep_servers, infer_server, tmp_path
) -> None:
    """A session's sound is written beside its pixels (content-addressed, hashed again when
    read); a server whose context differs decodes the session again from it."""
    prep = f"127.0.0.1:{prep_servers('ultravox')}"
    first = infer_server("ultravox", ctx_size=1024, sessions_dir=tmp_path)
    sound = wav_bytes(2.0, seed=5)
    with SlotwiseClient(prep, f"127.0.0.1:{first.port}", retry=NO_RETRY) as client:
        client.create_session("kept")
        sent = [Message.user("Listen:", audio=sound)]
        prepared, done, _ = chat_turn(client, sent, 0, session_id="kept")
        assert done.finished.saved, done.finished
        (sound_id,) = sound_ids(prepared)
    store = SessionStore(tmp_path)
    assert store.load_media(sound_id, 32_000, 1, "audio") == sound
    # the tenant's disk use counts the sound's file as it is (not 3 bytes a "pixel")
    usage = first.engine.call(first.engine.sessions.usage).result(timeout=PATIENCE)
    (held,) = usage.values()
    files, _ = store.footprint("kept")
    assert held.num_bytes - files == len(sound)
    second = infer_server("ultravox", ctx_size=2048, sessions_dir=tmp_path)  # another layout
    with SlotwiseClient(prep, f"127.0.0.1:{second.port}", retry=NO_RETRY) as client:
        sent = [*sent, Message.assistant(done.text or "."), Message.user("Again?")]
        again, done2, _ = chat_turn(client, sent, 1, session_id="kept")
        assert done2.finished.error == "" and done2.finished.saved
        # the held part (the sound among it) was decoded again, from the disk's bytes
        # the held part was decoded again, its sound among it (this turn sent none): the
        # sound came from the disk's bytes
        assert again.num_images == 0
        assert client.server_info().stats.num_media_decodes == 1


def test_sounds_that_cannot_be_served_are_refused_before_decoding(
    loop_thread, tiny, prep_servers
) -> None:
    """Too long (from the header, nothing decoded): OUT_OF_RANGE; not a sound, or damaged:
    INVALID_ARGUMENT; a sound to a model that takes none, an image to one that takes only
    sound: FAILED_PRECONDITION naming what it takes. The service answers the next request."""
    from prep_service.__main__ import start

    pair = tiny["ultravox"]
    short = loop_thread.run(start(pair.model, pair.mmproj, limits=Limits(max_audio_seconds=5)))
    try:
        with SlotwiseClient(f"127.0.0.1:{short.port}", retry=NO_RETRY) as client:
            assert client.model_info().max_audio_seconds == 5

            def refused(*parts: Any) -> SlotwiseError:
                with pytest.raises(SlotwiseError) as e:
                    client.prepare([Message.user("Listen:", *parts)])
                return e.value

            too_long = refused(Audio(wav_bytes(6.0, rate=8_000)))
            assert too_long.code() == grpc.StatusCode.OUT_OF_RANGE
            assert too_long.reason == "AUDIO_TOO_LONG" and "5 s" in too_long.message
            # four 5 s sounds together are the most one request takes
            assert refused(*[Audio(wav_bytes(4.5, seed=k)) for k in range(5)]).code() == (
                grpc.StatusCode.OUT_OF_RANGE
            )
            damaged = wav_bytes(1.0)[:40]
            for bad in (b"RIFF\x00\x00\x00\x00WAVEjunk", damaged, b"not a sound at all"):
                assert refused(Audio(bad)).code() == grpc.StatusCode.INVALID_ARGUMENT, bad[:12]
            assert refused(Audio(pcm=b"\x00" * 7)).code() == grpc.StatusCode.INVALID_ARGUMENT
            image = refused(image_bytes(32, 32))
            assert image.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "audio, not images" in image.message
            assert client.prepare([Message.user("Listen:", audio=wav_bytes(1.0))]).num_cells
    finally:
        loop_thread.run(short.stop(0))
    with SlotwiseClient(f"127.0.0.1:{prep_servers('rope')}", retry=NO_RETRY) as client:
        assert not client.model_info().supports_audio
        with pytest.raises(SlotwiseError) as e:
            client.prepare([Message.user("Listen:", audio=wav_bytes(1.0))])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "images, not audio" in e.value.message


def test_images_and_sounds_together_on_gemma4(served) -> None:
    """Gemma 4's one projector file holds both towers: an image (decoded non-causally, whole)
    and a sound (causally) in one prompt, each its own group, counted and generated."""
    with served("gemma4") as client:
        chat = [Message.user(image_bytes(224, 224), "and", Audio(wav_bytes(2.0)), "say?")]
        prepared = client.prepare(chat)
        media = [c for c in prepared.count().chunks if c.is_media]
        assert [(c.media_group, c.is_audio, c.num_cells) for c in media] == [
            (1, False, 81),
            (2, True, 50),
        ]
        done = collect(client.generate(prepared, max_tokens=4, temperature=0))
        assert done.finished.error == "" and done.finished.usage.num_prompt_cells == (
            prepared.num_cells
        )


def test_a_sound_that_is_not_its_media_id_is_refused(served) -> None:
    """A descriptor whose sound's bytes are not what its media_id hashes (tampered on the way)
    is refused before anything is decoded, and the server goes on."""
    with served("ultravox") as client:
        prompt = client.prepare([Message.user("Listen:", audio=wav_bytes(2.0))]).prompt
        media = next(c.media for c in prompt.chunks if c.WhichOneof("kind") == "media")
        media.audio = media.audio[:-2] + b"\x01\x02"
        with pytest.raises(SlotwiseError) as refused:
            collect(client.generate(prompt, max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not the hash of its bytes" in refused.value.message
        done = collect(client.generate([Message.user("still there?")], max_tokens=2))
        assert done.finished.error == ""
