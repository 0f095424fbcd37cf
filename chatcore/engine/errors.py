"""What the engine raises at callers that add a request (`InferenceEngine.check_fits`, `generate`), and how
it describes a failure to an operator."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served: too long for the context or the pool."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (a `busy`, not a request error)."""


def describe_failure(exc: BaseException, limit: int = 300) -> str:
    """An exception in one line for an operator: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
