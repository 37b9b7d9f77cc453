"""TextStream: token bytes -> text deltas that never split a character or leak a stop string."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer_service.runner.text_stream import TextStream, utf8_tail


def stream_all(
    pieces: list[bytes], stop: tuple[str, ...] = ()
) -> tuple[list[str], str, TextStream]:
    """Push every piece; returns (the delta after each push, the flushed rest, the stream)."""
    ts = TextStream(stop)
    deltas = [ts.push(p) for p in pieces]
    return deltas, ts.flush(), ts


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_multibyte_characters_split_across_pieces_are_never_broken(size: int) -> None:
    text = "naïve café ✓ 𝄞 日本語 🙂!"
    deltas, rest, _ = stream_all(split_every(text.encode(), size))
    assert "".join(deltas) + rest == text
    # every delta is whole characters: no replacement character ever appears
    assert all("\ufffd" not in d for d in deltas)
    assert rest == ""  # nothing is held back without stop strings once the text is complete


def test_a_character_is_released_by_the_piece_that_completes_it() -> None:
    ts = TextStream()
    emoji = "🙂".encode()  # 4 bytes
    assert [ts.push(emoji[i : i + 1]) for i in range(4)] == ["", "", "", "🙂"]
    assert ts.push(b"\xc3") == ""
    assert ts.push(b"\xa9x") == "éx"


def test_invalid_bytes_become_replacement_characters_and_do_not_swallow_later_text() -> None:
    # a lone continuation byte, then ASCII, then a multibyte character cut in the middle
    pieces = [b"\x82", b"a", b"b", b"c\xe2\x82", b"\xac", b"d"]
    deltas, rest, _ = stream_all(pieces)
    assert "".join(deltas) + rest == "\ufffdabc€d"
    assert "".join(deltas) + rest == b"".join(pieces).decode("utf-8", errors="replace")


def test_random_byte_streams_decode_like_one_shot_decoding() -> None:
    # every way of cutting these bytes into pieces gives what one decode of all of them gives
    data = "é€🙂".encode() + b"\xff\xe2\x82(" + "ü".encode() + b"\xf0\x9f"
    expected = data.decode("utf-8", errors="replace")
    for cuts in itertools.combinations(range(1, len(data)), 3):
        bounds = (0, *cuts, len(data))
        pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
        deltas, rest, _ = stream_all(pieces)
        assert "".join(deltas) + rest == expected, pieces


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement() -> None:
    ts = TextStream()
    assert ts.push(b"ok\xe2\x82") == "ok"
    assert ts.flush() == "\ufffd"
    assert ts.flush() == ""


def test_stop_string_spanning_pieces() -> None:
    deltas, rest, ts = stream_all([b"He", b"llo wo", b"r", b"ld again"], stop=("o wor",))
    assert ts.stopped_by == "o wor"
    assert "".join(deltas) + rest == "Hell"
    assert rest == ""


def test_stop_string_made_of_multibyte_characters_split_across_pieces() -> None:
    data = "abc→日本x".encode()
    deltas, rest, ts = stream_all(split_every(data, 1), stop=("→日",))
    assert ts.stopped_by == "→日"
    assert "".join(deltas) + rest == "abc"


def test_nothing_that_could_begin_a_stop_string_is_released_early() -> None:
    ts = TextStream(("STOP",))
    out = [ts.push(p) for p in (b"xx", b"S", b"T", b"O")]
    # "STO" could still become "STOP": it must be held
    assert "".join(out) == "xx"
    assert ts.push(b"P tail") == ""
    assert ts.stopped_by == "STOP"
    assert ts.push(b"more") == ""  # after a stop nothing more comes out
    assert ts.flush() == ""


def test_held_back_text_is_released_on_flush() -> None:
    deltas, rest, ts = stream_all([b"hello", b" wor"], stop=("world!",))
    assert ts.stopped_by is None
    assert "".join(deltas) == "hello wor"[: len("hello wor") - (len("world!") - 1)]
    assert rest == "hello wor"[len("hello wor") - (len("world!") - 1) :]
    assert "".join(deltas) + rest == "hello wor"


def test_earliest_stop_string_wins_when_one_piece_holds_several() -> None:
    deltas, rest, ts = stream_all([b"hello world"], stop=("world", "lo"))
    assert ts.stopped_by == "lo"
    assert "".join(deltas) + rest == "hel"


def test_released_text_never_contains_a_stop_string() -> None:
    stops = ("ab", "bca", "c")
    for pieces in itertools.product([b"a", b"b", b"ab", b"bc", b"xc"], repeat=4):
        deltas, rest, ts = stream_all(list(pieces), stop=stops)
        out = "".join(deltas) + rest
        assert not any(s in out for s in stops), (pieces, out)
        # generation stops at the first piece after which any stop string has appeared
        seen = ""
        for piece in pieces:
            seen += piece.decode()
            if any(s in seen for s in stops):
                at = min(seen.find(s) for s in stops if s in seen)
                assert out == seen[:at], (pieces, out)
                assert seen[at:].startswith(ts.stopped_by or "\0")
                break
        else:
            assert ts.stopped_by is None
            assert out == seen


def test_empty_stop_strings_are_ignored() -> None:
    deltas, rest, ts = stream_all([b"abc"], stop=("",))
    assert ts.stopped_by is None
    assert deltas == ["abc"]
    assert rest == ""


@given(st.lists(st.binary(max_size=4), max_size=12))
@settings(max_examples=500, deadline=None)
def test_utf8_tail_agrees_with_python_on_whole_texts(pieces: list[bytes]) -> None:
    """Piece by piece, utf8_tail refuses exactly the byte strings no completion makes valid."""
    tail: bytes | None = b""
    done = b""
    for piece in pieces:
        assert tail is not None
        tail = utf8_tail(tail, piece)
        if tail is None:
            # no continuation helps: every completion of done + piece fails to decode
            with pytest.raises(UnicodeDecodeError):
                (done + piece).decode("utf-8")
            for ending in (b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xbf"):
                with pytest.raises(UnicodeDecodeError):
                    (done + piece + ending).decode("utf-8")
            return
        done += piece
        # all but the unfinished character decodes; the unfinished one is a real prefix
        head = done[: len(done) - len(tail)]
        head.decode("utf-8")
        assert len(tail) < 4
    assert tail is not None
    (done[: len(done) - len(tail)]).decode("utf-8")


def test_utf8_tail_examples() -> None:
    assert utf8_tail(b"", "héllo".encode()) == b""
    assert utf8_tail(b"", "é".encode()[:1]) == b"\xc3"
    assert utf8_tail(b"\xc3", b"\xa9") == b""
    for bad in (b"\xc0\x80", b"\xe0\x80", b"\xed\xa0", b"\xf4\x90", b"\xf5", b"\x80", b"\xff"):
        assert utf8_tail(b"", bad) is None, bad
