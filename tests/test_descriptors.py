"""PreparedPrompt <-> protobuf: lossless round trips and the checks from_pb makes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotwise.v1 import prompt_pb2
from slotwise_core.descriptors import (
    DescriptorError,
    Fingerprint,
    MediaChunk,
    PreparedPrompt,
    TextChunk,
)
from slotwise_core.images import media_id

U32 = st.integers(0, 2**32 - 1)
COUNT = st.integers(1, 100_000)  # totals must still fit the proto's uint32

text_chunks = st.builds(
    TextChunk,
    token_ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12).map(tuple),
    message_index=U32,
    media_group=U32,
)


@st.composite
def media_chunks(draw: st.DrawFn) -> MediaChunk:
    w, h = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    rgb = draw(st.binary(min_size=w * h * 3, max_size=w * h * 3))
    return MediaChunk(
        media_id=media_id(w, h, rgb),
        num_cells=draw(COUNT),
        num_positions=draw(COUNT),
        width=w,
        height=h,
        rgb=rgb,
        message_index=draw(U32),
        media_group=draw(st.integers(1, 2**32 - 1)),
    )


prompts = st.builds(
    PreparedPrompt,
    fingerprint=st.builds(Fingerprint, st.text(max_size=32), st.text(max_size=32)),
    chunks=st.lists(st.one_of(text_chunks, media_chunks()), min_size=1, max_size=8).map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(prompts)
def test_round_trip_through_the_wire(prompt: PreparedPrompt) -> None:
    pb = prompt.to_pb()
    assert pb.num_cells == sum(c.num_cells for c in prompt.chunks)
    assert pb.num_positions == sum(c.num_positions for c in prompt.chunks)
    wire = prompt_pb2.PreparedPrompt.FromString(pb.SerializeToString())
    back = PreparedPrompt.from_pb(wire)
    assert back == prompt
    assert [type(c) for c in back.chunks] == [type(c) for c in prompt.chunks]
    assert back.media == [c for c in prompt.chunks if isinstance(c, MediaChunk)]


@settings(max_examples=60, deadline=None)
@given(prompts.filter(lambda p: bool(p.media)), st.data())
def test_any_changed_pixel_is_caught(prompt: PreparedPrompt, data: st.DataObject) -> None:
    pb = prompt.to_pb()
    media = [c for c in pb.chunks if c.HasField("media")]
    m = data.draw(st.sampled_from(media)).media
    i = data.draw(st.integers(0, len(m.rgb) - 1))
    rgb = bytearray(m.rgb)
    rgb[i] ^= 0xFF
    m.rgb = bytes(rgb)
    with pytest.raises(DescriptorError, match="media_id is not the hash of its pixels"):
        PreparedPrompt.from_pb(pb)


def test_media_chunk_repr_never_prints_pixels() -> None:
    rgb = b"\x01\x02\x03" * 4
    c = MediaChunk(media_id(2, 2, rgb), 5, 3, 2, 2, rgb, 1, 1)
    assert "\\x01" not in repr(c) and "2x2" in repr(c) and "cells=5" in repr(c)


# -- rejections ---------------------------------------------------------------------------------


def valid_pb() -> prompt_pb2.PreparedPrompt:
    rgb = bytes(range(2 * 3 * 3))
    prompt = PreparedPrompt(
        Fingerprint("m" * 32, "p" * 32),
        (
            TextChunk((1, 2, 3), 0),
            TextChunk((7,), 0, 1),
            MediaChunk(media_id(2, 3, rgb), 6, 2, 2, 3, rgb, 0, 1),
            TextChunk((8,), 0, 1),
        ),
    )
    pb = prompt.to_pb()
    assert PreparedPrompt.from_pb(pb) == prompt  # the baseline is accepted
    return pb


def media_of(pb: prompt_pb2.PreparedPrompt) -> prompt_pb2.MediaChunk:
    return pb.chunks[2].media


def test_rejects_a_prompt_without_chunks() -> None:
    pb = valid_pb()
    del pb.chunks[:]
    pb.num_cells = pb.num_positions = 0
    with pytest.raises(DescriptorError, match="no chunks"):
        PreparedPrompt.from_pb(pb)


@pytest.mark.parametrize("field", ["num_cells", "num_positions"])
@pytest.mark.parametrize("delta", [-1, 1])
def test_rejects_wrong_totals(field: str, delta: int) -> None:
    pb = valid_pb()
    assert (pb.num_cells, pb.num_positions) == (11, 7)
    setattr(pb, field, getattr(pb, field) + delta)
    with pytest.raises(DescriptorError, match=r"totals say .* chunks add up to 11 / 7"):
        PreparedPrompt.from_pb(pb)


@pytest.mark.parametrize("rgb_len", [0, 17, 19, 36])
def test_rejects_rgb_that_is_not_width_times_height_times_3(rgb_len: int) -> None:
    pb = valid_pb()
    m = media_of(pb)
    m.rgb = bytes(rgb_len)
    m.media_id = media_id(m.width, m.height, m.rgb)  # the hash is not what is wrong
    with pytest.raises(DescriptorError, match=rf"{rgb_len} bytes of RGB do not make a 2x3 image"):
        PreparedPrompt.from_pb(pb)


def test_rejects_a_reshaped_image() -> None:
    pb = valid_pb()
    m = media_of(pb)
    m.width, m.height = 3, 2  # same byte count, other shape: the hash covers the size
    with pytest.raises(DescriptorError, match="media_id is not the hash"):
        PreparedPrompt.from_pb(pb)


def test_rejects_a_media_id_that_is_not_the_hash() -> None:
    pb = valid_pb()
    media_of(pb).media_id = "0" * 32
    with pytest.raises(DescriptorError, match=r"'0{32}': media_id is not the hash of its pixels"):
        PreparedPrompt.from_pb(pb)


def test_rejects_media_without_a_group() -> None:
    pb = valid_pb()
    pb.chunks[2].media_group = 0
    with pytest.raises(DescriptorError, match="has no media_group"):
        PreparedPrompt.from_pb(pb)


@pytest.mark.parametrize("field", ["num_cells", "num_positions"])
def test_rejects_media_with_zero_counts(field: str) -> None:
    pb = valid_pb()
    setattr(media_of(pb), field, 0)
    with pytest.raises(DescriptorError, match="zero cells or positions"):
        PreparedPrompt.from_pb(pb)


def test_rejects_empty_text_and_empty_chunks() -> None:
    pb = valid_pb()
    del pb.chunks[1].text.token_ids[:]
    with pytest.raises(DescriptorError, match="text chunk has no tokens"):
        PreparedPrompt.from_pb(pb)
    pb = valid_pb()
    pb.chunks.add()  # neither text nor media
    with pytest.raises(DescriptorError, match="neither text nor media"):
        PreparedPrompt.from_pb(pb)


@pytest.mark.parametrize("pair", ["mrope", "rope", "noncausal"])
def test_prep_sends_the_image_once_compressed_and_infer_decodes_the_same_pixels(
    pair: str, prep_servers, infer_server
) -> None:
    """A 1 MP JPEG travels as the file it came in (not 18x its size as raw RGB), and infer,
    decoding it with the same code, finds the pixels media_id names."""
    import io

    from PIL import Image

    from slotwise_core.images import decode_image, media_id

    img = Image.effect_noise((1000, 1000), 60).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    jpeg = buf.getvalue()
    from support.rpc import message, prepare, run
    from support.rpc import request as make_request

    prompt = prepare(prep_servers(pair), messages=[message("user", "see ", jpeg, " now")])
    media = [c.media for c in prompt.chunks if c.HasField("media")]
    assert media and all(m.WhichOneof("pixels") == "encoded" for m in media)
    assert prompt.ByteSize() / len(jpeg) <= 1.25 * len({m.media_id for m in media})
    decoded = decode_image(media[0].encoded)
    assert media_id(decoded.width, decoded.height, decoded.rgb) == media[0].media_id
    server = infer_server(pair, ctx_size=4096, ubatch_size=2048, batch_size=2048)
    s = run(server.port, make_request(prompt, max_tokens=2))
    assert s.started.num_prompt_cells == prompt.num_cells
