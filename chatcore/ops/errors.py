"""How a part of the cluster that failed is reported: a `ClusterError` naming the part, its exit
code and the tail of its log; `chatcore cluster up` prints it and exits 1, without a traceback."""

from __future__ import annotations

from pathlib import Path

LOG_TAIL_LINES = 40


class ClusterError(RuntimeError):
    """A part of the cluster could not be set up or started; the message says which and why."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])
