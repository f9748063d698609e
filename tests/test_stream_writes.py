"""How the router groups a request's committed tokens into stream writes (the server's
``stream_interval``): each write is one message from the router to the HTTP proxy, so
fewer writes save CPU at load, but the first token must never wait."""
from __future__ import annotations

import asyncio

import pytest

from deployments.router import token_writes
from engine.spec.sequence import TokenEvent


async def _writes(rounds: list[int], interval: int) -> list[list[int]]:
    """Commit ``rounds`` (tokens per round) one round per loop turn, as the coordinator's
    ticks do, and return the token ids of each write."""
    queue: asyncio.Queue = asyncio.Queue()

    async def commit() -> None:
        token = 0
        for size in rounds:
            for _ in range(size):
                queue.put_nowait(TokenEvent(token, f"t{token}", None, None))
                token += 1
            await asyncio.sleep(0.001)  # the next tick
        queue.put_nowait(None)

    producer = asyncio.ensure_future(commit())
    writes = [[event.token_id for event in events] async for events in token_writes(queue, interval)]
    await producer
    return writes


ROUNDS = [1, 1, 1, 1, 1, 2, 3, 1]


def test_every_round_is_one_write_by_default():
    writes = asyncio.run(_writes(ROUNDS, interval=1))
    assert [len(w) for w in writes] == ROUNDS
    assert sum(writes, []) == list(range(sum(ROUNDS)))


@pytest.mark.parametrize("interval, sizes", [(4, [1, 4, 5, 1]), (3, [1, 3, 3, 3, 1]), (100, [1, 10])])
def test_an_interval_groups_rounds_but_never_holds_the_first_or_last_tokens(interval, sizes):
    writes = asyncio.run(_writes(ROUNDS, interval))
    assert [len(w) for w in writes] == sizes
    assert sum(writes, []) == list(range(sum(ROUNDS)))  # every token once, in order


def test_a_request_that_ends_before_its_first_token_writes_nothing():
    assert asyncio.run(_writes([], interval=4)) == []
