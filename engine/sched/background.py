"""Tasks that outlive the request that happened to start them.

An asyncio task copies the context it is created in, and a Ray actor takes the task
it is serving from that context: an actor call made from a task started inside a
request's handler is that request's child, and cancelling the request (its client
disconnected) cancels the call -- Ray cancels child tasks recursively. The
coordinator's lane loops serve every request's rounds, so one started by a request
whose client goes away would fail every sequence in its in-flight target call
("Task ... was cancelled"). Work that belongs to no single request therefore runs in
a context of its own (``tests/test_server.py`` disconnects the loop's first request).
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Coroutine


def detached(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Schedule ``coroutine`` as a task that inherits no context variables."""
    loop = asyncio.get_running_loop()
    return contextvars.Context().run(loop.create_task, coroutine)
