"""The contract, pinned by golden fixtures (tests/contract/golden/, regenerated deliberately by
`python tests/contract/make_golden.py`): the prep side (slotwise_core.descriptors), the infer
side (infer_service.events' to_pb, PreparedPrompt.from_pb as the infer servicer reads it) and
a client (the raw generated stubs) read and write them identically: the same bytes after a
round trip, the same canonical JSON. The real services still produce / accept them.

Compatibility with the committed baseline (buf breaking) and buf lint: tests/test_proto_tools.py.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message

from infer_service.api.protobuf import event_pb
from slotwise.v1 import infer_pb2, infer_pb2_grpc, prep_pb2_grpc, prompt_pb2
from slotwise_core.descriptors import MediaChunk, PreparedPrompt, TextChunk

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "contract" / "golden"
REGENERATE = "python tests/contract/make_golden.py"


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_golden = load_module("slotwise_make_golden", ROOT / "tests" / "contract" / "make_golden.py")

FIXTURES = sorted(p.stem for p in GOLDEN.glob("*.binpb"))
EVENT_FIXTURES = [n for n in FIXTURES if n.startswith("generate_response_")]


def message_class(name: str) -> type[Message]:
    is_prompt = name.startswith("prepared_prompt")
    return prompt_pb2.PreparedPrompt if is_prompt else infer_pb2.GenerateResponse


def golden_bytes(name: str) -> bytes:
    return (GOLDEN / f"{name}.binpb").read_bytes()


def golden_json(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def golden_message(name: str) -> Message:
    return message_class(name).FromString(golden_bytes(name))


def wire(message: Message) -> bytes:
    return message.SerializeToString(deterministic=True)


def as_json(message: Message) -> dict:
    return json.loads(json_format.MessageToJson(message))


def golden_prompt() -> prompt_pb2.PreparedPrompt:
    pb = golden_message("prepared_prompt")
    assert isinstance(pb, prompt_pb2.PreparedPrompt)
    return pb


# -- the fixtures themselves -----------------------------------------------------------------


def test_fixture_set_is_complete() -> None:
    kinds = {f.name for f in infer_pb2.GenerateResponse.DESCRIPTOR.oneofs_by_name["event"].fields}
    covered = {golden_message(n).WhichOneof("event") for n in EVENT_FIXTURES}
    assert covered == kinds, f"an event kind has no golden fixture: run {REGENERATE}"
    assert "prepared_prompt" in FIXTURES
    for name in FIXTURES:
        assert (GOLDEN / f"{name}.json").is_file(), f"{name}.json missing: run {REGENERATE}"
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == FIXTURES


def _unset_fields(messages: list[Message], prefix: str = "") -> set[str]:
    """Fields (recursively) that none of the messages puts on the wire."""
    if not messages:
        return set()
    descriptor = messages[0].DESCRIPTOR
    missing = set()
    for field in descriptor.fields:
        present = [m for m in messages if field.name in {f.name for f, _ in m.ListFields()}]
        name = f"{prefix}{descriptor.name}.{field.name}"
        if not present:
            missing.add(name)
        elif field.message_type is not None and not field.is_repeated:
            missing |= _unset_fields([getattr(m, field.name) for m in present], prefix)
    return missing


def test_event_fixtures_put_every_field_on_the_wire() -> None:
    """proto3 omits default values: a field left at its default in every fixture is untested."""
    by_kind: dict[str, list[Message]] = {}
    for name in EVENT_FIXTURES:
        event = golden_message(name)
        kind = event.WhichOneof("event")
        by_kind.setdefault(kind, []).append(getattr(event, kind))
    missing = set().union(*(_unset_fields(msgs) for msgs in by_kind.values()))
    assert not missing, (
        f"no golden event sets {sorted(missing)}: extend events() and run {REGENERATE}"
    )


def test_prompt_fixture_shows_what_the_contract_is_about() -> None:
    pb = golden_prompt()
    assert pb.fingerprint.model and pb.fingerprint.mmproj
    kinds = [c.WhichOneof("kind") for c in pb.chunks]
    assert "text" in kinds and "media" in kinds
    media = [c for c in pb.chunks if c.WhichOneof("kind") == "media"]
    assert len(media) == 1
    m = media[0].media
    # M-RoPE: the point of the whole project is that cells and positions differ
    assert m.num_cells != m.num_positions
    assert (m.width, m.height) == make_golden.IMAGE_SIZE and m.width != m.height
    # prep sends the image as the file it came in (a PNG here), a fraction of its raw RGB
    assert m.WhichOneof("pixels") == "encoded" and m.encoded.startswith(b"\x89PNG")
    raw = next(c.media for c in golden_message("prepared_prompt_rgb").chunks if c.HasField("media"))
    assert len(raw.rgb) == m.width * m.height * 3 and raw.media_id == m.media_id
    group = [c for c in pb.chunks if c.media_group == media[0].media_group]
    assert [c.WhichOneof("kind") for c in group] == ["text", "media", "text"]  # vision_start/end
    assert any(c.message_index > 0 for c in pb.chunks)
    assert len(wire(pb)) < 8 << 10, "keep the fixture small"


@pytest.mark.parametrize("name", FIXTURES)
def test_binary_and_json_forms_agree(name: str) -> None:
    from_json = json_format.Parse((GOLDEN / f"{name}.json").read_text(), message_class(name)())
    assert from_json == golden_message(name)
    assert wire(from_json) == golden_bytes(name)


# -- client: the raw generated stubs ---------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_raw_stubs_round_trip(name: str) -> None:
    message = golden_message(name)
    assert wire(message) == golden_bytes(name)
    assert as_json(message) == golden_json(name)
    assert make_golden.to_json(message) == (GOLDEN / f"{name}.json").read_text()


# -- prep side: descriptors ------------------------------------------------------------------


def test_prep_descriptors_round_trip() -> None:
    prompt = PreparedPrompt.from_pb(golden_prompt())
    assert wire(prompt.to_pb()) == golden_bytes("prepared_prompt")
    assert as_json(prompt.to_pb()) == golden_json("prepared_prompt")
    # the domain view agrees with the fixture's own totals
    pb = golden_prompt()
    assert (prompt.num_cells, prompt.num_positions) == (pb.num_cells, pb.num_positions)
    assert [isinstance(c, MediaChunk) for c in prompt.chunks] == [
        c.WhichOneof("kind") == "media" for c in pb.chunks
    ]
    assert all(isinstance(c, TextChunk | MediaChunk) for c in prompt.chunks)


def test_prep_service_still_prepares_the_golden_prompt(
    prep_servers: Callable[[str], int], channel_to: Callable[[int], grpc.Channel]
) -> None:
    stub = prep_pb2_grpc.PrepServiceStub(channel_to(prep_servers(make_golden.PAIR)))
    response = stub.Prepare(make_golden.prepare_request(), timeout=60)
    assert wire(response.prompt) == golden_bytes("prepared_prompt"), (
        f"the prep service no longer produces the golden prompt; if that is deliberate, run "
        f"{REGENERATE} and commit the diff"
    )


# -- infer side: events and reading the prompt -----------------------------------------------


@pytest.mark.parametrize("name", EVENT_FIXTURES)
def test_infer_events_write_the_golden_bytes(name: str) -> None:
    pb = golden_prompt()
    media_id = next(c.media.media_id for c in pb.chunks if c.WhichOneof("kind") == "media")
    event = make_golden.events(media_id)[name.removeprefix("generate_response_")]
    assert wire(event_pb(event)) == golden_bytes(name)
    assert as_json(event_pb(event)) == golden_json(name)


def test_infer_reads_the_golden_prompt_as_its_servicer_does() -> None:
    """infer_service.api.servicer parses a GenerateRequest and calls PreparedPrompt.from_pb on
    it."""
    request_bytes = wire(infer_pb2.GenerateRequest(prompt=golden_prompt(), max_tokens=4))
    request = infer_pb2.GenerateRequest.FromString(request_bytes)
    prompt = PreparedPrompt.from_pb(request.prompt)
    pb = golden_prompt()
    assert len(prompt.chunks) == len(pb.chunks)
    assert (prompt.num_cells, prompt.num_positions) == (pb.num_cells, pb.num_positions)
    assert [m.media_id for m in prompt.media] == [
        c.media.media_id for c in pb.chunks if c.WhichOneof("kind") == "media"
    ]
    assert wire(prompt.to_pb()) == golden_bytes("prepared_prompt")


def test_infer_service_accepts_the_golden_prompt(
    infer_server: Callable[..., object], channel_to: Callable[[int], grpc.Channel]
) -> None:
    running = infer_server(make_golden.PAIR)
    stub = infer_pb2_grpc.InferServiceStub(channel_to(running.port))  # type: ignore[attr-defined]
    request = infer_pb2.GenerateRequest(
        prompt=golden_prompt(), sampling=infer_pb2.SamplingParams(temperature=0), max_tokens=3
    )
    events = list(stub.Generate(request, timeout=60))
    started, finished = events[0], events[-1]
    pb = golden_prompt()
    assert started.WhichOneof("event") == "started"
    assert started.started.num_prompt_cells == pb.num_cells
    assert started.started.num_prompt_positions == pb.num_positions
    assert finished.WhichOneof("event") == "finished"
    assert finished.finished.usage.num_generated_tokens == 3
