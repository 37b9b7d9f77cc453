"""A request's several generations (OpenAI's `n`, llama-server's n_cmpl and its list of
prompts): started together, read whole together or streamed interleaved; one that fails ends
the others."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from clients.client import AsyncSlotwiseClient
from clients.gateway.errors import ApiError
from clients.gateway.turns import Turn, TurnEnd, TurnRequest, start_turn

T = TypeVar("T")


class Choice(Protocol):
    async def whole(self) -> TurnEnd: ...
    async def close(self) -> None: ...


def choices(req: TurnRequest, n: int) -> list[TurnRequest]:
    """n choices: n turns, each with its own seed when one is given (the same seed would give
    the same text n times)."""
    seed = req.sampling.get("seed")
    return [
        replace(
            req,
            sampling={**req.sampling, "seed": None if seed is None else (seed + i) & 0xFFFFFFFF},
        )
        for i in range(n)
    ]


async def start_all(client: AsyncSlotwiseClient, reqs: list[TurnRequest]) -> list[Turn]:
    """Start every choice; a refusal of one ends the others."""
    started = await asyncio.gather(*(start_turn(client, r) for r in reqs), return_exceptions=True)
    turns = [s[0] for s in started if not isinstance(s, BaseException)]
    await _all_or_none(started, turns)
    return turns


async def wholes(choices: Sequence[Choice]) -> list[TurnEnd]:
    """Every choice whole; one that fails ends the others (their generations stop)."""
    ends = await asyncio.gather(*(c.whole() for c in choices), return_exceptions=True)
    await _all_or_none(ends, choices)
    return [e for e in ends if isinstance(e, TurnEnd)]


async def _all_or_none(results: Sequence[object], running: Sequence[Choice]) -> None:
    """The first failure among results, raised once every choice still running is closed."""
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for c in running:
            await c.close()
        raise failure


async def interleaved(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """The streams' items as they come, each with its stream's index. The first to fail ends them
    all with its ApiError (any other exception as a 500: a stream is never left waiting for one
    that died)."""
    queue: asyncio.Queue[tuple[int, T] | ApiError | None] = asyncio.Queue()

    async def run(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except ApiError as e:
            await queue.put(e)
        except Exception as e:
            await queue.put(ApiError(500, f"internal error: {e!r}", type="server_error"))
        else:
            await queue.put(None)  # (this one's end)

    tasks = [asyncio.ensure_future(run(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is None:
                left -= 1
            elif isinstance(got, ApiError):
                raise got
            else:
                yield got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
