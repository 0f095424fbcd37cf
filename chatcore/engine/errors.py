"""What the engine raises at callers that add a request (`InferenceEngine.check_fits`, `generate`), and how
it describes a failure to an operator. A refusal a client may see carries its `ErrorCode` (`code`), which the
server answers with (chatcore/server/errors.py, `to_api_error`)."""

from __future__ import annotations

from chatcore.outcomes import ErrorCode


class RequestRejected(ValueError):
    """A request that can never be served: too long for the context or the pool."""

    code = ErrorCode.TOO_LARGE


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (a `busy`, not a request error)."""

    code = ErrorCode.BUSY


class PrefixOnDisk(Exception):
    """A session turn's add declined (`SessionPrefix.disk_tier`): the pool holds only `device_blocks` of
    its prompt's full blocks, and the disk tier may hold more. Read them, then add it again with them. The
caller's own business (chatcore/sessions/turns.py): no client ever sees it, so it carries no code."""

    def __init__(self, device_blocks: int) -> None:
        super().__init__(f"the pool holds {device_blocks} of the prompt's blocks; the disk tier may hold more")
        self.device_blocks = device_blocks


def describe_failure(exc: BaseException, limit: int = 300) -> str:
    """An exception in one line for an operator: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
