"""Faults of one request's rows, kept inside that request.

Everything a step does for one request after the shared forward pass (its grammar mask, its
penalties and draw, its beam search, its detokenizing and stop checks) runs through `RowFaults.run`.
An exception there marks that request failed (`internal`, with what failed and why) and the step
goes on for every other request; the engine then finishes the failed ones through its one exit
path. Only a fault of the shared forward pass fails a whole step's requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from chatcore.engine.errors import describe_failure
from chatcore.engine.request import Request
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")


class RowFaults:
    def __init__(self) -> None:
        self.failed: list[Request] = []

    def run(self, req: Request, what: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None when it raises (the request is then failed) or the request failed already."""
        if req.error is not None:
            return None
        try:
            return fn()
        except Exception as exc:
            log.exception("request %s: %s failed", req.request_id, what)
            self.fail(req, f"{what} failed: {describe_failure(exc)}")
            return None

    def fail(self, req: Request, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """Fail `req` alone with `code` (`internal` unless the fault is the client's; its first failure stands)."""
        if req.error is None:
            req.fail(code, message, FinishReason.ERROR)
            self.failed.append(req)
