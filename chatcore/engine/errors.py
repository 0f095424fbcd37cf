"""What the engine raises at callers that add a request (`InferenceEngine.check_fits`, `generate`)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served: too long for the context or the pool."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (a `busy`, not a request error)."""
