"""How the router groups a request's committed tokens into stream writes (the server's
``stream_interval`` and its write budget, a minimum gap between a stream's writes):
each write is one message from the router to the HTTP proxy, so fewer writes save CPU
at load, but the first token must never wait, nor the last."""
from __future__ import annotations

import asyncio

import pytest

from specserve.deployments.streaming import WriteBudget, cancel_when_dropped, token_writes
from specserve.engine.speculative.sequence import TokenEvent


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


async def _timed_writes(bursts: list[tuple[float, int]], gap_s: float) -> tuple[list[list[int]], list[float], float]:
    """Commit ``bursts`` ((seconds to wait first, tokens)), then end the request, while
    the writer keeps ``gap_s`` between writes. Returns each write's token ids and time,
    and when the request ended (times from the start)."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    start = loop.time()
    ended: list[float] = []

    async def commit() -> None:
        token = 0
        for pause, size in bursts:
            await asyncio.sleep(pause)
            for _ in range(size):
                queue.put_nowait(TokenEvent(token, f"t{token}", None, None))
                token += 1
        queue.put_nowait(None)
        ended.append(loop.time() - start)

    producer = asyncio.ensure_future(commit())
    writes, times = [], []
    async for events in token_writes(queue, 1, lambda: gap_s):
        writes.append([event.token_id for event in events])
        times.append(loop.time() - start)
    await producer
    return writes, times, ended[0]


def test_a_write_gap_gathers_rounds_but_never_holds_the_first_or_last_tokens():
    rounds = [(0.001, size) for size in ROUNDS]  # a round every millisecond, far inside the gap
    writes, times, ended = asyncio.run(_timed_writes(rounds, gap_s=2.0))
    assert writes == [[0], list(range(1, sum(ROUNDS)))]
    assert times[-1] - ended < 0.5  # the end went at once, not after the 2 s gap


def test_a_round_after_a_quiet_spell_longer_than_the_gap_goes_at_once():
    writes, times, _ = asyncio.run(_timed_writes([(0, 1), (0.001, 2), (0.6, 3), (0.6, 0)], gap_s=0.2))
    assert writes == [[0], [1, 2], [3, 4, 5]]
    assert 0.15 < times[1] < 0.45  # held for the gap after the first write, then written
    assert 0.6 < times[2] < 0.9    # committed at ~0.6 s, 0.4 s after the last write: not held


def test_the_finishing_token_goes_at_once_though_the_end_of_the_queue_trails_it():
    """The request's end (``None``) is queued after the coordinator's tick has finished
    (releases, retiring); the token with the finish_reason must not wait for it."""
    async def run() -> tuple[list[list[int]], list[float]]:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def commit() -> None:
            queue.put_nowait(TokenEvent(0, "t0", None, None))
            await asyncio.sleep(0.01)
            queue.put_nowait(TokenEvent(1, "t1", None, None))
            queue.put_nowait(TokenEvent(2, "t2", None, "length"))
            await asyncio.sleep(0.6)  # the rest of the tick
            queue.put_nowait(None)

        producer = asyncio.ensure_future(commit())
        writes, times = [], []
        async for events in token_writes(queue, 4, lambda: 2.0):  # an interval and a gap: neither holds it
            writes.append([event.token_id for event in events])
            times.append(loop.time() - start)
        await producer
        return writes, times

    writes, times = asyncio.run(run())
    assert writes == [[0], [1, 2]]
    assert times[1] < 0.3


def test_a_stream_dropped_before_it_started_cancels_its_request():
    """A client that leaves before the first chunk: the response never starts the stream,
    so only its collection can stop the request from decoding to its end."""
    import gc

    async def run() -> tuple[bool, bool]:
        async def chunks():
            yield "never started"

        never_started, finished = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
        cancel_when_dropped(chunks(), never_started)
        finished.set_result(None)
        streamed = chunks()
        cancel_when_dropped(streamed, finished)
        assert [c async for c in streamed] == ["never started"]
        del streamed
        gc.collect()
        await asyncio.sleep(0.01)
        return never_started.cancelled(), finished.cancelled()

    assert asyncio.run(run()) == (True, False)  # the dropped one cancelled; a finished run left alone


def test_the_write_budget_holds_streams_only_while_the_router_writes_more_than_it():
    budget = WriteBudget(100.0, window_s=1.0)
    assert budget.gap_s(0.0, 16) == 0.0  # nothing written yet
    for i in range(50):  # 50 writes a second: under the budget
        budget.wrote(i / 50)
    assert budget.gap_s(1.0, 16) == 0.0
    for i in range(400):  # then 400 a second for a second
        budget.wrote(1.0 + i / 400)
    assert budget.rate(2.0) > 100
    assert budget.gap_s(2.0, 16) == 15 / 100  # each stream its share of the other 15's
    assert budget.gap_s(2.0, 1) == 0.0       # a lone stream never waits
    assert budget.gap_s(6.0, 16) == 0.0      # quiet for 4 s: the rate has decayed under the budget
    assert WriteBudget(None).gap_s(0.0, 16) == 0.0
