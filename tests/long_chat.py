"""The long chat: an OpenAI client resends the whole conversation every turn, with an image
every third turn; prints per turn the prompt cells, the cells from the cache, the cells decoded
and the shifts.

    slotwise serve --model M --mmproj P --ctx-size 1024 --http-port 8080 &
    python tests/long_chat.py --base-url http://127.0.0.1:8080/v1 --turns 30

tests/test_openai_api.py runs it on both tiny pairs.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
from typing import Any

import openai
from PIL import Image

SYSTEM = {"role": "system", "content": "You are terse."}


def png_uri(seed: int, width: int = 64, height: int = 48) -> str:
    img = Image.new("RGB", (width, height), ((seed * 37) % 256, 90, 200))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, seed: int) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": png_uri(seed)}},
        ],
    }


def long_chat(client: openai.OpenAI, turns: int = 30) -> list[dict[str, int]]:
    messages: list[dict[str, Any]] = [SYSTEM]
    rows = []
    for t in range(turns):
        text = f"Turn {t}: tell me something about the number {t}."
        messages.append(image_message(text, t) if t % 3 == 0 else {"role": "user", "content": text})
        r = client.chat.completions.create(
            model="slotwise", messages=messages, max_tokens=24, temperature=0.7, seed=t
        )
        assert r.usage is not None and r.choices[0].finish_reason in ("stop", "length")
        extra = r.usage.model_extra["slotwise"]  # type: ignore[index]
        rows.append(
            {
                "turn": t,
                "prompt": r.usage.prompt_tokens,
                "cached": r.usage.prompt_tokens_details.cached_tokens,  # type: ignore[union-attr]
                "decoded": extra["decoded_prompt_cells"],
                "shifts": extra["shifts"],
                "truncated": extra["truncated_cells"],
            }
        )
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--turns", type=int, default=30)
    args = p.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0)
    rows = long_chat(client, args.turns)
    print("turn  prompt  cached  decoded  shifts")
    for r in rows:
        print(f"{r['turn']:4}  {r['prompt']:6}  {r['cached']:6}  {r['decoded']:7}  {r['shifts']:6}")
    decoded = [r["decoded"] for r in rows[1:]]
    print(json.dumps({"turns": len(rows), "median_decoded_after_first": statistics.median(decoded),
                      "shifts": sum(r["shifts"] for r in rows)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
