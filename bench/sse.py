"""A server's streamed response (server-sent events) as the JSON chunks it carries, up to
``data: [DONE]``: what every bench that times served streams reads."""
from __future__ import annotations

import json
from collections.abc import Iterator


def chunks(response) -> Iterator[dict]:
    """The JSON of each ``data:`` event of an ``httpx`` streamed response, in order."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])
