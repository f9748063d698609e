"""Streaming a response's tokens: how the router groups a request's committed tokens
into stream writes (``token_writes``), the write budget its open streams share
(``WriteBudget``), and cancelling a request whose stream was dropped unstarted
(``cancel_when_dropped``).
"""
from __future__ import annotations

import asyncio
import math
import weakref
from typing import AsyncIterator, Callable

from specserve.engine.speculative.sequence import TokenEvent

from .openai_responses import ChoiceEvent


class WriteBudget:
    """The router's stream writes per second, against its budget (``stream_writes_per_s``).

    Each write is a message to Serve's HTTP proxy; at load, one-round calls would send
    one per round per stream. While the router writes more than the budget, each stream
    waits its share, (open streams - 1) / budget, between writes, so writes carry
    several rounds; below the budget nothing waits (eight-round target-only calls at 16
    streams write ~100 a second and are never held). The rate is a moving average over
    about ``window_s``."""

    def __init__(self, per_s: float | None, window_s: float = 1.0) -> None:
        self.per_s, self.window_s = per_s, window_s
        self._rate, self._at = 0.0, 0.0
        self.writes = 0  # in all (``/specserve/status``)

    def rate(self, now: float) -> float:
        return self._rate * math.exp(-(now - self._at) / self.window_s)

    def wrote(self, now: float) -> None:
        self._rate, self._at = self.rate(now) + 1.0 / self.window_s, now
        self.writes += 1

    def gap_s(self, now: float, open_streams: int) -> float:
        if not self.per_s or self.rate(now) <= self.per_s:
            return 0.0
        return max(0, open_streams - 1) / self.per_s


def cancel_when_dropped(stream: AsyncIterator[str], run: asyncio.Future) -> None:
    """Cancel ``run`` once ``stream`` is garbage: a stream whose client left before its
    first chunk is never started, so its own ``finally`` (which cancels the request when
    the client goes mid-stream) never runs, and the request would decode to its end.
    Thread-safe: the collector may run in another of the replica's threads."""
    loop = asyncio.get_running_loop()

    def cancel() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(run.cancel)  # a no-op for a run that finished

    weakref.finalize(stream, cancel)


async def token_writes(queue: asyncio.Queue, interval: int = 1, min_gap_s: Callable[[], float] | None = None
                       ) -> AsyncIterator[list[ChoiceEvent | TokenEvent]]:
    """Group a request's committed tokens (``None`` ends the queue; each has a
    ``finish_reason``: the router queues its choices' ``ChoiceEvent``s) into stream writes.

    A round commits several tokens at once and they go as one write, so a round costs one
    message to the HTTP proxy, not one per token. With ``interval`` > 1 a write also waits
    until it holds that many tokens (vLLM's ``--stream-interval``), and with ``min_gap_s``
    until that many seconds have passed since the stream's last write (asked afresh each
    write: the router's write budget shared by its open streams). Neither ever holds the
    first token (time to first token is unchanged) or the last ones (the one with a
    ``finish_reason`` goes at once, not when the request's end is queued, which trails it
    by the rest of the coordinator's tick)."""
    loop = asyncio.get_running_loop()
    sent, last_write = 0, 0.0
    getter: asyncio.Future | None = None  # a get kept across a gap's timeout: one task per wait, not per round
    try:
        while True:
            if getter is None:
                events = [await queue.get()]
            else:
                events, getter = [await getter], None
            while True:
                while not queue.empty():
                    events.append(queue.get_nowait())
                last = events[-1]
                if last is None or sent == 0 or any(e is not None and e.finish_reason is not None for e in events):
                    break  # (one choice's finishing token among a sibling's goes at once too)
                if len(events) < interval:
                    events.append(await queue.get())
                    continue
                wait = last_write + (min_gap_s() if min_gap_s is not None else 0.0) - loop.time()
                if wait <= 0:
                    break
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if not done:
                    break  # the gap has passed: write; the pending get carries on for the next write
                events.append(getter.result())
                getter = None
            finished = events[-1] is None
            if finished:
                events.pop()
            if events:
                sent += len(events)
                yield events
                last_write = loop.time()
            if finished:
                return
    finally:
        if getter is not None:
            getter.cancel()
