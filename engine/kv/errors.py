"""The errors the KV cache raises on purpose."""
from __future__ import annotations

from specserve.engine.errors import EngineError


class KVCacheError(EngineError):
    """Base class of every error the cache raises on purpose."""


class KVCacheCapacityError(KVCacheError):
    """Not enough free blocks for an append; the cache was left unchanged."""


class UnknownSequenceError(KVCacheError, KeyError):
    """The sequence id was never added, or has been freed."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""
