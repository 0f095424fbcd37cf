"""Faults of one request's rows, kept inside that request, as data.

Everything a step does for one request after the shared forward pass (its fork, its grammar mask, its
penalties and draw, its beam search, its detokenizing and stop checks) runs through `RowFaults.run`.
An exception there records that request's fault (`internal`, with what failed and why) and the step
goes on for every other request. Recording changes nothing: the sampler only records, so no request
fails while a caller iterates over the step's rows; the step's update (`engine/step_update.py`) fails
the recorded requests once (`apply`), and the engine finishes them through its one exit path. Only a
fault of the shared forward pass fails a whole step's requests.
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
        self._faults: dict[Request, tuple[ErrorCode, str]] = {}

    def ok(self, req: Request) -> bool:
        """Whether `req` has neither failed nor a fault recorded here."""
        return req.error is None and req not in self._faults

    def run(self, req: Request, what: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None when it raises (the fault is recorded) or the request has a fault already."""
        if not self.ok(req):
            return None
        try:
            return fn()
        except Exception as exc:
            log.exception("request %s: %s failed", req.request_id, what)
            self.fail(req, f"{what} failed: {describe_failure(exc)}")
            return None

    def fail(self, req: Request, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """Record `req`'s fault with `code` (`internal` unless the fault is the client's; its first stands)."""
        if self.ok(req):
            self._faults[req] = (code, message)

    def apply(self) -> None:
        """Fail each request with its recorded fault (the update's to call, once the step's rows are read)."""
        for req, (code, message) in self._faults.items():
            if req.error is None:
                req.fail(code, message, FinishReason.ERROR)
