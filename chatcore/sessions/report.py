"""What a turn reports to clients: its usage and timing, and its `done` frame (docs/protocol.md).

The same fields describe a turn that just ended (`TurnStats`) and one read back from the
database (a `Turn` row), so both go through these functions.
"""

from __future__ import annotations

from typing import Any, Protocol

from chatcore.outcomes import FinishReason


class Served(Protocol):
    """How a turn was served: `TurnStats`, or a `Turn` row."""

    prompt_tokens: int
    cached_tokens: int
    cached_device_tokens: int
    cached_disk_tokens: int
    recomputed_tokens: int
    completion_tokens: int
    queue_ms: float | None
    ttft_ms: float | None
    total_ms: float | None


def usage(stats: Served) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
            "completion_tokens": stats.completion_tokens, "cached_device_tokens": stats.cached_device_tokens,
            "cached_disk_tokens": stats.cached_disk_tokens, "recomputed_tokens": stats.recomputed_tokens}


def timing(stats: Served) -> dict[str, float | None]:
    return {"queue_ms": stats.queue_ms, "ttft_ms": stats.ttft_ms, "total_ms": stats.total_ms}


def done_frame(reason: FinishReason, stats: Served, truncated_turns: int) -> dict[str, Any]:
    """A turn's last frame (without its `turn` and `seq`, which `TurnFrames.emit` adds)."""
    return {"type": "done", "finish_reason": reason, "usage": {**usage(stats), "truncated_turns": truncated_turns},
            "timing": timing(stats)}
