"""Typed errors of the engine: callers (CLI, HTTP layer) map them to messages and status codes."""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory cannot be served: missing file, unsupported graph, mismatched vocab."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (too long a prompt, bad token ids); nothing was changed.
    ``param`` names the option at fault, where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for a single new token within the context limit."""
