"""prep's cache of verified images: real gRPC servers on the tiny mrope pair, real Pillow files.
Whether a file was decoded is read from the cache's own hit/miss counts, never from timing."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from PIL import ExifTags, Image

from prep_service.__main__ import RunningPrep, start
from prep_service.image_cache import ENTRY_OVERHEAD, CacheStats, ImageCache
from prep_service.service import Limits
from slotwise.v1 import prep_pb2, prep_pb2_grpc
from slotwise_core.images import decode_image, image_facts, media_id
from slotwise_core.tiny_models import TinyPair
from support.loop import LoopThread
from support.rpc import rgb_of

MARKER = "<__media__>"


def noise_png(width: int, height: int, seed: int) -> bytes:
    img = Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def jpeg(width: int, height: int, seed: int, orientation: int = 0) -> bytes:
    img = Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[ExifTags.Base.Orientation] = orientation
    img.save(buf, "JPEG", quality=90, exif=exif)
    return buf.getvalue()


def truncated(data: bytes) -> bytes:
    return data[: len(data) * 6 // 10]


def user(*parts: str | bytes) -> prep_pb2.Message:
    pbs = [
        prep_pb2.Part(text=p) if isinstance(p, str) else prep_pb2.Part(image=prep_pb2.Image(data=p))
        for p in parts
    ]
    return prep_pb2.Message(role="user", parts=pbs)


def assistant(text: str) -> prep_pb2.Message:
    return prep_pb2.Message(role="assistant", parts=[prep_pb2.Part(text=text)])


def chat(*messages: prep_pb2.Message) -> prep_pb2.PrepareRequest:
    return prep_pb2.PrepareRequest(chat=prep_pb2.Chat(messages=list(messages)))


def raw(*images: bytes) -> prep_pb2.PrepareRequest:
    text = " ".join(MARKER for _ in images) or "nothing"
    ims = [prep_pb2.Image(data=d) for d in images]
    return prep_pb2.PrepareRequest(raw=prep_pb2.RawPrompt(text=text, images=ims))


def media(resp: prep_pb2.PrepareResponse) -> list[Any]:
    return [c.media for c in resp.prompt.chunks if c.HasField("media")]


class Server:
    def __init__(self, running: RunningPrep, channel: grpc.Channel):
        self.running = running
        self.stub = prep_pb2_grpc.PrepServiceStub(channel)

    @property
    def cache(self) -> ImageCache:
        return self.running.servicer.image_cache

    def stats(self) -> CacheStats:
        return self.cache.stats()

    def prepare(self, request: prep_pb2.PrepareRequest) -> prep_pb2.PrepareResponse:
        return self.stub.Prepare(request, timeout=30)

    def counted(self, request: prep_pb2.PrepareRequest) -> tuple[Any, int, int]:
        """The response, and how many lookups hit and missed for it."""
        before = self.stats()
        resp = self.prepare(request)
        after = self.stats()
        return resp, after.hits - before.hits, after.misses - before.misses


@pytest.fixture(scope="module")
def servers(loop_thread: LoopThread, tiny: dict[str, TinyPair]) -> Iterator[Callable[..., Server]]:
    """server(**start options) -> a prep server on the mrope pair, started once per option set."""
    pair = tiny["mrope"]
    running: dict[str, tuple[RunningPrep, grpc.Channel]] = {}

    def server(**options: Any) -> Server:
        name = repr(sorted(options.items()))
        if name not in running:
            prep = loop_thread.run(start(pair.model, pair.mmproj, **options))
            running[name] = (prep, grpc.insecure_channel(f"127.0.0.1:{prep.port}"))
        return Server(*running[name])

    yield server
    for prep, channel in running.values():
        channel.close()
        loop_thread.run(prep.stop(0))


# -- hits ---------------------------------------------------------------------------------------


def test_a_resent_image_is_not_decoded_again_and_answers_the_same(servers) -> None:
    s = servers()
    a, b = jpeg(160, 120, seed=1), noise_png(90, 70, seed=2)
    first_turn = chat(user("What is this?", a))
    resp1, hits, misses = s.counted(first_turn)
    assert (hits, misses) == (0, 1)
    again, hits, misses = s.counted(first_turn)
    assert (hits, misses) == (1, 0)
    # a hit answers byte for byte what the decode did
    assert again.SerializeToString() == resp1.SerializeToString()
    # the client's next turn sends the whole chat: the old image is a hit, the new one decoded
    second_turn = chat(user("What is this?", a), assistant("A cat."), user("And this?", b))
    resp2, hits, misses = s.counted(second_turn)
    assert (hits, misses) == (1, 1)
    m1, m2 = media(resp2)
    assert m1 == media(resp1)[0]
    w, h, rgb = 90, 70, decode_image(b).rgb
    assert (m2.width, m2.height, m2.media_id, rgb_of(m2)) == (w, h, media_id(w, h, rgb), rgb)
    assert m2.encoded == b  # the file itself travels
    # and the same chat once more is all hits, the same bytes again
    resp3, hits, misses = s.counted(second_turn)
    assert (hits, misses) == (2, 0)
    assert resp3.SerializeToString() == resp2.SerializeToString()
    # which is what a server without the cache answers
    off = servers(image_cache_bytes=0).prepare(second_turn)
    assert off.SerializeToString() == resp3.SerializeToString()


def test_count_tokens_and_prepare_share_the_cache(servers) -> None:
    s = servers()
    image = noise_png(64, 48, seed=3)
    before = s.stats()
    counted = s.stub.CountTokens(
        prep_pb2.CountTokensRequest(chat=chat(user("see", image)).chat), timeout=30
    )
    resp, hits, misses = s.counted(chat(user("see", image)))
    assert (hits, misses) == (1, 0)
    assert s.stats().misses == before.misses + 1  # decoded once, by CountTokens
    assert counted.num_cells == resp.prompt.num_cells


def test_one_file_twice_in_a_request_is_decoded_once(servers) -> None:
    s = servers()
    image = noise_png(40, 40, seed=4)
    resp, hits, misses = s.counted(raw(image, image))
    assert (hits, misses) == (0, 1)
    first, second = media(resp)
    assert first.media_id == second.media_id == media_id(40, 40, decode_image(image).rgb)


def test_the_same_pixels_in_another_file_is_another_entry(servers) -> None:
    """Keyed by the file: the same pixels as BMP are decoded (and give the same media_id)."""
    s = servers()
    img = Image.frombytes("RGB", (20, 10), random.Random(5).randbytes(600))
    files = []
    for fmt in ("PNG", "BMP"):
        buf = io.BytesIO()
        img.save(buf, fmt)
        files.append(buf.getvalue())
    _, hits, misses = s.counted(raw(files[0]))
    assert (hits, misses) == (0, 1)
    _, hits, misses = s.counted(raw(files[1]))
    assert (hits, misses) == (0, 1)
    assert {m.media_id for m in media(s.prepare(raw(*files)))} == {media_id(20, 10, img.tobytes())}


# -- what is never cached -----------------------------------------------------------------------


def test_a_corrupt_image_is_never_cached(servers) -> None:
    s = servers()
    bad = truncated(noise_png(120, 120, seed=6))
    before = s.stats()
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as e:
            s.prepare(raw(bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "image 0: image file is truncated or corrupt" in (e.value.details() or "")
    after = s.stats()
    # looked up and decoded each time, never remembered
    assert (after.misses - before.misses, after.hits - before.hits) == (2, 0)
    assert after.num_entries == before.num_entries


def test_a_request_with_a_bad_image_names_it_and_keeps_only_the_good(servers) -> None:
    s = servers()
    good, bad = noise_png(30, 30, seed=7), truncated(noise_png(120, 120, seed=8))
    before = s.stats()
    with pytest.raises(grpc.RpcError) as e:
        s.prepare(raw(good, bad, good))
    assert "image 1: image file is truncated or corrupt" in (e.value.details() or "")
    assert s.stats().num_entries == before.num_entries + 1
    # the client sends it again without the bad one: the good file is known, the bad one not
    _, hits, misses = s.counted(raw(good))
    assert (hits, misses) == (1, 0)
    with pytest.raises(grpc.RpcError):
        s.prepare(raw(bad))
    assert s.stats().num_entries == before.num_entries + 1


def test_the_cache_off_decodes_every_time(servers) -> None:
    s = servers(image_cache_bytes=0)
    image = noise_png(30, 20, seed=9)
    first = s.prepare(raw(image))
    for _ in range(2):
        resp, hits, misses = s.counted(raw(image))
        assert (hits, misses) == (0, 1)
        assert resp.SerializeToString() == first.SerializeToString()
    assert s.stats().num_entries == 0


# -- the bound ----------------------------------------------------------------------------------


def test_the_cache_stays_within_its_bytes_and_drops_the_least_recently_used(servers) -> None:
    s = servers(image_cache_bytes=8 * ENTRY_OVERHEAD)
    files = [noise_png(16, 16, seed=100 + k) for k in range(30)]
    for f in files:
        s.prepare(raw(f))
        st = s.stats()
        assert st.num_bytes <= st.max_bytes == 8 * ENTRY_OVERHEAD
    assert s.stats().num_entries == 8
    _, hits, misses = s.counted(raw(files[-1]))  # among the last 8: kept
    assert (hits, misses) == (1, 0)
    _, hits, misses = s.counted(raw(files[0]))  # the first: dropped long ago
    assert (hits, misses) == (0, 1)
    # kept now: files[-7:] and files[0]; the eldest, files[-7], becomes the youngest when used
    _, hits, _ = s.counted(raw(files[-7]))
    assert hits == 1
    s.prepare(raw(noise_png(16, 16, seed=999)))  # one more: out goes the eldest, files[-6]
    _, hits, _ = s.counted(raw(files[-7]))
    assert hits == 1
    _, hits, misses = s.counted(raw(files[-6]))
    assert (hits, misses) == (0, 1)


def test_reencoded_images_count_their_bytes(servers) -> None:
    """max_side resizes: the lossless file of the resized pixels is what is kept (and sent)."""
    bound = 64 << 10
    s = servers(image_cache_bytes=bound, limits=Limits(max_side=64))
    for k in range(40):
        resp, hits, misses = s.counted(raw(noise_png(200, 100, seed=200 + k)))
        assert (hits, misses) == (0, 1)
        [m] = media(resp)
        assert (m.width, m.height) == (64, 32)
        assert m.media_id == media_id(64, 32, rgb_of(m))
        st = s.stats()
        assert st.num_bytes <= bound
    st = s.stats()
    assert 0 < st.num_entries < 40
    assert st.num_bytes > st.num_entries * ENTRY_OVERHEAD  # the files are counted
    last = noise_png(200, 100, seed=239)
    resp, hits, _ = s.counted(raw(last))  # a hit, answered with the kept file
    assert hits == 1
    [m] = media(resp)
    assert m.encoded != last
    assert rgb_of(m) == decode_image(last, max_side=64).rgb


def test_an_entry_over_the_bound_is_not_kept(servers) -> None:
    s = servers(image_cache_bytes=ENTRY_OVERHEAD + 100, limits=Limits(max_side=64))
    image = noise_png(200, 100, seed=300)  # its 64x32 PNG is kilobytes
    for _ in range(2):
        _, hits, misses = s.counted(raw(image))
        assert (hits, misses) == (0, 1)
    assert s.stats().num_entries == 0


# -- keys ---------------------------------------------------------------------------------------


def test_different_max_side_settings_do_not_share_entries(servers) -> None:
    cache = ImageCache(1 << 20)
    image = noise_png(400, 200, seed=10)
    full = image_facts(image)
    cache.put(cache.key(image, max_pixels=10**8, max_side=0), full)
    assert cache.get(cache.key(image, max_pixels=10**8, max_side=100)) is None
    assert cache.get(cache.key(image, max_pixels=10**7, max_side=0)) is None  # (refusal limit)
    assert cache.get(cache.key(image, max_pixels=10**8, max_side=0)) == full
    assert (full.width, full.height, full.reencoded) == (400, 200, b"")
    # and through servers: one that downscales, one that does not, each with its own answer
    small = servers(limits=Limits(max_side=100)).prepare(raw(image))
    large = servers().prepare(raw(image))
    assert [(m.width, m.height) for m in media(small)] == [(100, 50)]
    assert [(m.width, m.height) for m in media(large)] == [(400, 200)]
    again = servers(limits=Limits(max_side=100))
    _, hits, misses = again.counted(raw(image))
    assert (hits, misses) == (1, 0)
    assert again.prepare(raw(image)).SerializeToString() == small.SerializeToString()


def test_a_rotated_jpeg_travels_as_its_own_file(servers) -> None:
    """EXIF orientation is applied by decoding, here and in infer: the file decodes to the
    rotated pixels, so it is sent as it came (not re-encoded)."""
    s = servers()
    file = jpeg(48, 32, seed=11, orientation=6)
    [m] = media(s.prepare(raw(file)))
    assert (m.width, m.height) == (32, 48)
    assert m.encoded == file
    decoded = decode_image(file)
    assert rgb_of(m) == decoded.rgb and m.media_id == decoded.media_id
