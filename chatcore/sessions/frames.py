"""One running turn's frames: numbered, buffered for replay, fanned out to the attached client.

Frames (`start`, `token`, `done`) get consecutive `seq` numbers from the session. A turn
keeps every frame until it is replaced by the session's next turn, so a client that comes
back with `last_seq` receives exactly the frames it missed, then the live ones: no gaps and
no duplicates by `seq`.

A turn that fails tells its attached clients so with a `TurnError`, a typed outcome (its code and
message), not a frame: the server makes the wire's error frame or body of it (chatcore/server/errors.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chatcore.outcomes import ErrorCode

Frame = dict[str, Any]


@dataclass(frozen=True)
class TurnError:
    """How a turn failed, for its attached clients: the outcome's code, and a line for a person. It comes
    before the turn's `done` and carries no `seq` (it is not replayed)."""

    code: ErrorCode
    message: str


Followed = Frame | TurnError  # what a subscription yields


class TurnFrames:
    def __init__(self, turn: int, client_id: str | None, next_seq: Callable[[], int]) -> None:
        self.turn = turn
        self.client_id = client_id
        self._next_seq = next_seq
        self.frames: list[Frame] = []
        self.finished = asyncio.Event()
        self._subscribers: list[asyncio.Queue[Followed]] = []

    def emit(self, frame: Frame) -> Frame:
        frame = {**frame, "turn": self.turn, "seq": self._next_seq()}
        self.frames.append(frame)
        for queue in self._subscribers:
            queue.put_nowait(frame)
        if frame["type"] == "done":
            self.finished.set()
        return frame

    def emit_error(self, code: ErrorCode, message: str) -> None:
        """This turn failed: a `TurnError`, to the attached clients only."""
        for queue in self._subscribers:
            queue.put_nowait(TurnError(code, message))

    def subscribe(self, after_seq: int | None) -> asyncio.Queue[Followed]:
        """A queue pre-filled with the frames after `after_seq`, then fed live (a `TurnError` among them)."""
        queue: asyncio.Queue[Followed] = asyncio.Queue()
        for frame in self.frames:
            if after_seq is None or frame["seq"] > after_seq:
                queue.put_nowait(frame)
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Followed]) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    @property
    def attached(self) -> int:
        return len(self._subscribers)

    @property
    def done_frame(self) -> Frame | None:
        return self.frames[-1] if self.frames and self.frames[-1]["type"] == "done" else None
