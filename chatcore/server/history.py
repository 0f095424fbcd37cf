"""What a WebSocket may read of a session's history, and how often.

A `session` frame (the answer to `hello`) carries the last page of the history and a `history` frame
an earlier one, so a long conversation costs a client's `hello` a page, not the whole history. A page
is whole exchanges (a user message and its answer; the history holds nothing else), at most
`history_page_messages` messages and `HISTORY_PAGE_CHARS` characters, but never empty when something
precedes it: one exchange always fits, however long. `history_start` is the index of the page's first
message in the whole history (0: nothing precedes it).

`hello` and `history` frames are the only ones that read the history, so `HistoryReads` bounds them
per socket: at most `max_history_reads_per_minute` in any minute, past which the frame gets `busy`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from chatcore.outcomes import ErrorCode
from chatcore.server.errors import ApiError

HISTORY_PAGE_CHARS = 1 << 20  # of message text, at most, unless one exchange alone is longer
WINDOW_S = 60.0


def history_page(history: list[dict[str, str]], before: int, max_messages: int,
                 max_chars: int = HISTORY_PAGE_CHARS) -> tuple[int, list[dict[str, str]]]:
    """The page ending before message `before` (exclusive; rounded down to a whole exchange): its start
    index and its messages."""
    end = start = min(before, len(history)) // 2 * 2
    chars = 0
    while start >= 2 and end - (start - 2) <= max(2, max_messages):
        size = len(history[start - 2]["content"]) + len(history[start - 1]["content"])
        if chars + size > max_chars and start < end:
            break
        chars += size
        start -= 2
    return start, history[start:end]


def page_fields(history: list[dict[str, str]], before: int, max_messages: int) -> dict[str, Any]:
    """A frame's `history` and `history_start`."""
    start, page = history_page(history, before, max_messages)
    return {"history": page, "history_start": start}


class HistoryReads:
    """A socket's `hello` and `history` frames in the last minute (a sliding window)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._times: deque[float] = deque()

    def take(self) -> None:
        """Count one read now; `busy` naming the limit when the minute holds `per_minute` already."""
        now = time.monotonic()
        while self._times and now - self._times[0] >= WINDOW_S:
            self._times.popleft()
        if len(self._times) >= self.per_minute:
            raise ApiError(ErrorCode.BUSY,
                           f"a socket may send at most {self.per_minute} hello and history frames a minute "
                           "(max_history_reads_per_minute)")
        self._times.append(now)
