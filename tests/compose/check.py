"""What tests/compose_up.sh asks of the running stack, as a client on the host would.

    python tests/compose/check.py turns PREP INFER SESSION N   # N image turns of a session
    python tests/compose/check.py chat HTTP_URL                # a chat through the HTTP edge

`turns` creates the session if needed, and checks that each turn continues exactly where the
session stood (expect_turns) and that the session's cells grow; it prints the turn count.
"""

from __future__ import annotations

import io
import sys

from clients.client import FinishReason, Message, SlotwiseClient, SlotwiseError, collect


def image(seed: int) -> bytes:
    from PIL import Image

    im = Image.new("RGB", (64, 48), ((seed * 53) % 256, (seed * 97) % 256, 128))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def turns(prep: str, infer: str, session_id: str, n: int) -> None:
    with SlotwiseClient(prep, infer, timeout=120) as c:
        try:
            info = c.get_session(session_id)
        except SlotwiseError as e:
            if e.reason != "SESSION_NOT_FOUND":
                raise
            info = c.create_session(session_id, keep=0, policy="auto")
        for _ in range(n):
            before = info.num_turns
            chat = [Message.user(f"Turn {before + 1}: what is in this picture?", image(before))]
            prepared = c.prepare(chat)
            done = collect(
                c.generate(prepared, session_id=session_id, max_tokens=8, expect_turns=before)
            )
            assert done.reason in (FinishReason.STOP, FinishReason.LENGTH), done.finished
            cells = info.num_cells
            info = c.get_session(session_id)
            assert info.num_turns == before + 1, (info.num_turns, before)
            assert info.num_cells > cells, (info.num_cells, cells)  # (a 2048-cell context)
            print(f"turn {info.num_turns}: {info.num_cells} cells", file=sys.stderr)
    print(info.num_turns)


def chat(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=120)
    reply = client.chat.completions.create(
        model="gpt-4o-mini",  # any name: one model is served
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
    )
    assert reply.choices[0].message.content is not None and reply.usage.prompt_tokens > 0
    print(f"chat: {reply.usage.prompt_tokens} prompt cells, {reply.usage.completion_tokens} tokens")


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    if what == "turns":
        turns(rest[0], rest[1], rest[2], int(rest[3]))
    elif what == "chat":
        chat(rest[0])
    else:
        sys.exit(f"unknown check {what!r}")
