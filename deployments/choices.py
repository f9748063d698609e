"""A request's choices (``n``, batched prompts): each one's options, admitting them
together or not at all, and waiting for all of them.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from specserve.engine.options import GenerationOptions
from specserve.engine.sched.coordinator import RoundCoordinator


async def admit_all(coordinator: RoundCoordinator, drivers: list, rejected: Callable[[object, str], None]) -> list:
    """Admit every choice of a request at once, or none (``RoundCoordinator.admit_many``:
    the KV of all of them is reserved together, so a request never holds part of it while
    it waits for the rest); ``rejected(driver, outcome)`` is called for each choice of one
    that was not admitted, with "cancelled" where its caller went away, else "rejected"."""
    try:
        return await coordinator.admit_many(drivers)
    except BaseException as exc:
        outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "rejected"
        for driver in drivers:
            rejected(driver, outcome)
        raise


def choice_options(options: GenerationOptions, n: int) -> list[GenerationOptions]:
    """Each of ``n`` choices' options: a seeded request's choice i draws from seed + i, as
    vLLM seeds its parallel samples, so each choice differs and the whole is reproducible."""
    if options.seed is None:
        return [options] * n
    return [options.model_copy(update={"seed": options.seed + i}) for i in range(n)]


async def all_choices(tasks: list[asyncio.Task]) -> None:
    """Wait for every choice of a request; on the first failure, or when cancelled, the
    rest are cancelled too (their sequences retired, their KV freed)."""
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for a finished one
