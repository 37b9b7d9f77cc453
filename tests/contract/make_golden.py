"""Regenerate the contract's golden fixtures in tests/contract/golden/ (a deliberate act).

    python tests/contract/make_golden.py

Run it when the contract changes on purpose, review the diff and commit it with the .proto
change. Each fixture is written twice: the serialized message (`NAME.binpb`, deterministic
serialization) and its canonical proto3 JSON form (`NAME.json`, google.protobuf.json_format).

* `prepared_prompt`: what the real prep service answers (over gRPC) to `prepare_request()` on
  the tiny M-RoPE pair (its image as the PNG it came in); `prepared_prompt_rgb` the same with
  the image as raw RGB (qwen2vl: the image is 8 cells but 4 positions), with a 56x28 image so the
  fixture stays a few KB. The tiny models are generated with fixed seeds, so the fingerprint and
  the tokens are reproducible; tests/test_contract.py checks that the service still says this.
* `generate_response_<kind>`: one GenerateResponse of every event kind, written by
  infer_service.events' own `to_pb` from `events()` below. Every field of every event is set to
  a non-default value in at least one fixture (proto3 does not put defaults on the wire).
"""

from __future__ import annotations

import asyncio
import io
import sys
import tempfile
from pathlib import Path

from google.protobuf import json_format
from google.protobuf.message import Message

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
IMAGE_SIZE = (56, 28)  # width != height catches a swapped pair; 56*28*3 = 4704 bytes of RGB
PAIR = "mrope"


def png(width: int, height: int) -> bytes:
    """A deterministic test pattern; only its decoded pixels reach the fixture."""
    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata(
        [
            ((x * 9) % 256, (y * 17) % 256, (x * y) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def prepare_request():
    from slotwise.v1 import prep_pb2

    text = prep_pb2.Part
    return prep_pb2.PrepareRequest(
        chat=prep_pb2.Chat(
            messages=[
                prep_pb2.Message(role="system", parts=[text(text="You are terse.")]),
                prep_pb2.Message(
                    role="user",
                    parts=[
                        text(text="What is in"),
                        prep_pb2.Part(image=prep_pb2.Image(data=png(*IMAGE_SIZE))),
                        text(text="this picture?"),
                    ],
                ),
            ]
        )
    )


async def prepare_via_service(model: Path, mmproj: Path):
    """Start the real prep service on a free port and call Prepare through the raw stubs."""
    import grpc

    from prep_service.__main__ import start
    from slotwise.v1 import prep_pb2_grpc

    prep = await start(model, mmproj, threads=1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{prep.port}") as channel:
            response = await prep_pb2_grpc.PrepServiceStub(channel).Prepare(prepare_request())
        return response.prompt
    finally:
        await prep.stop(0)


def prepared_prompt():
    from slotwise_core.tiny_models import write_tiny_models

    with tempfile.TemporaryDirectory() as tmp:
        pair = write_tiny_models(Path(tmp), [PAIR])[PAIR]
        return asyncio.run(prepare_via_service(pair.model, pair.mmproj))


def events(media_id: str) -> dict[str, object]:
    """One domain event of every kind, every field non-default somewhere."""
    from infer_service.events import (
        ContextShift,
        Finished,
        FinishReason,
        Persistence,
        PrefillProgress,
        Started,
        TokenChoice,
        TokenDelta,
        TokenLogprobs,
        Usage,
    )
    from infer_service.kv.ledger import Policy

    return {
        "started": Started(
            slot=1,
            num_prompt_cells=60,
            num_prompt_positions=56,
            num_capacity_cells=2048,
            num_truncated_cells=10,
            num_truncated_chunks=3,
            truncated_media_ids=(media_id,),
            num_reused_cells=7,
        ),
        "prefill": PrefillProgress(num_cells_done=38, num_cells_total=60),
        "delta": TokenDelta(
            token_ids=(72, 105, 258),
            text="Hé ✓",
            logprobs=tuple(
                TokenLogprobs(
                    TokenChoice(t, bytes([t % 256]), -0.25 * (i + 1)),
                    (
                        TokenChoice(t, bytes([t % 256]), -0.25 * (i + 1)),
                        TokenChoice(7, b"\x07", -3.5),
                    ),
                )
                for i, t in enumerate((72, 105, 258))
            ),
        ),
        "shift": ContextShift(
            policy=Policy.GAP,
            num_cells_evicted=12,
            num_positions_evicted=6,
            media_ids_evicted=(media_id,),
            num_cells_used_after=1030,
            next_position_after=1090,
        ),
        "finished": Finished(
            reason=FinishReason.STOP,
            usage=Usage(
                num_prompt_cells=60,
                num_prompt_positions=56,
                num_generated_tokens=16,
                num_shifts=1,
                num_evicted_cells=12,
                num_reused_cells=7,
                prefill_seconds=0.25,  # exactly representable: JSON and binary agree
                decode_seconds=1.5,
                num_draft_tokens=9,
                num_accepted_tokens=6,
                drafts_by_type={"ngram-mod": [5, 4, 0], "suffix": [4, 2, 3]},
            ),
            stop_string="\n\n",
            persistence=Persistence.SAVED,
        ),
        "finished_error": Finished(reason=FinishReason.ERROR, error="llama_decode returned -1"),
    }


def as_rgb(prompt):
    """The prompt with its image as raw RGB (what infer accepts besides prep's encoded form)."""
    from slotwise.v1 import prompt_pb2
    from slotwise_core.images import decode_image

    out = prompt_pb2.PreparedPrompt()
    out.CopyFrom(prompt)
    for c in out.chunks:
        if c.WhichOneof("kind") == "media":
            c.media.rgb = decode_image(c.media.encoded).rgb
    return out


def fixtures(prompt) -> dict[str, Message]:
    from infer_service.api.protobuf import event_pb

    """name -> message: the prompt plus the event fixtures (events made from its media id)."""
    media_id = next(c.media.media_id for c in prompt.chunks if c.WhichOneof("kind") == "media")
    out: dict[str, Message] = {"prepared_prompt": prompt, "prepared_prompt_rgb": as_rgb(prompt)}
    for kind, event in events(media_id).items():
        out[f"generate_response_{kind}"] = event_pb(event)
    return out


def to_json(message: Message) -> str:
    return json_format.MessageToJson(message, indent=2, sort_keys=True) + "\n"


def write(out: Path = GOLDEN) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, message in fixtures(prepared_prompt()).items():
        for path, data in (
            (out / f"{name}.binpb", message.SerializeToString(deterministic=True)),
            (out / f"{name}.json", to_json(message).encode()),
        ):
            path.write_bytes(data)
            written.append(path)
    return written


def main() -> int:
    for path in write():
        print(path.relative_to(HERE.parents[1]), path.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
