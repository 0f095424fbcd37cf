"""One running turn's frames: numbered, buffered for replay, fanned out to the attached client.

Frames (`start`, `token`, `done`) get consecutive `seq` numbers from the session. A turn
keeps every frame until it is replaced by the session's next turn, so a client that comes
back with `last_seq` receives exactly the frames it missed, then the live ones: no gaps and
no duplicates by `seq`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from chatcore.outcomes import ErrorCode

Frame = dict[str, Any]


class TurnFrames:
    def __init__(self, turn: int, client_id: str | None, next_seq: Callable[[], int]) -> None:
        self.turn = turn
        self.client_id = client_id
        self._next_seq = next_seq
        self.frames: list[Frame] = []
        self.finished = asyncio.Event()
        self._subscribers: list[asyncio.Queue[Frame]] = []

    def emit(self, frame: Frame) -> Frame:
        frame = {**frame, "turn": self.turn, "seq": self._next_seq()}
        self.frames.append(frame)
        for queue in self._subscribers:
            queue.put_nowait(frame)
        if frame["type"] == "done":
            self.finished.set()
        return frame

    def emit_error(self, code: ErrorCode, message: str) -> None:
        """An error about this turn, to the attached client only (errors carry no `seq`)."""
        for queue in self._subscribers:
            queue.put_nowait({"type": "error", "code": code, "message": message})

    def subscribe(self, after_seq: int | None) -> asyncio.Queue[Frame]:
        """A queue pre-filled with the frames after `after_seq`, then fed live."""
        queue: asyncio.Queue[Frame] = asyncio.Queue()
        for frame in self.frames:
            if after_seq is None or frame["seq"] > after_seq:
                queue.put_nowait(frame)
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Frame]) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    @property
    def attached(self) -> int:
        return len(self._subscribers)

    @property
    def done_frame(self) -> Frame | None:
        return self.frames[-1] if self.frames and self.frames[-1]["type"] == "done" else None
