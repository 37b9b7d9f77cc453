"""A stored Responses chain: each turn sends only its new input with previous_response_id,
an image every third turn; prints per turn the input tokens, those from the cache and those
decoded (the chain is a slotwise session: it goes on past the context, shifted).

    slotwise serve --model M --mmproj P --ctx-size 1024 --http-port 8080 --sessions-dir S &
    python tests/responses_chain.py --base-url http://127.0.0.1:8080/v1 --turns 30

tests/test_responses_chain.py runs it on the tiny mrope pair, with a kill -9 in the middle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import openai
from long_chat import png_uri


def turn_input(t: int) -> list[dict[str, Any]]:
    text = {"type": "input_text", "text": f"Turn {t}: tell me about the number {t}."}
    image = {"type": "input_image", "image_url": png_uri(t)}
    return [{"role": "user", "content": [text, image] if t % 3 == 0 else [text]}]


def responses_chain(
    client: openai.OpenAI, turns: range, previous: str | None = None, temperature: float = 0.7
) -> list[dict[str, Any]]:
    """Run the chain's turns (from `previous`, or a new chain); one row per turn."""
    rows = []
    for t in turns:
        r = client.responses.create(
            model="slotwise",
            instructions="You are terse." if previous is None else None,
            input=turn_input(t),  # type: ignore[arg-type]
            previous_response_id=previous,
            max_output_tokens=24,
            temperature=temperature,
        )
        assert r.usage is not None and r.status in ("completed", "incomplete"), r
        cached = r.usage.input_tokens_details.cached_tokens
        rows.append(
            {
                "turn": t,
                "id": r.id,
                "input": r.usage.input_tokens,
                "cached": cached,
                "decoded": r.usage.input_tokens - cached,
                "output": r.usage.output_tokens,
            }
        )
        previous = r.id
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", required=True)
    p.add_argument("--turns", type=int, default=30)
    args = p.parse_args()
    rows = responses_chain(openai.OpenAI(base_url=args.base_url, api_key="x"), range(args.turns))
    for row in rows:
        print(json.dumps(row))
    decoded = [r["decoded"] for r in rows[1:]]
    print(f"decoded after turn 0: median {statistics.median(decoded)}, max {max(decoded)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
